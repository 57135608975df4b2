"""longattn's kinds inside stock transformers models (the "longattn" attention implementation).

Tiny random-weight models built from configs (nothing downloaded): BERT, RoBERTa, GPT-2, Llama with grouped-query
attention, Mistral, Qwen2 and BART. Outputs are compared at real (unpadded) positions only.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
from kind_configs import FOUR_HEADS, NO_DROPOUT, bart_sizes
from transformers import (
    AutoModel,
    AutoModelForCausalLM,
    BartConfig,
    BartModel,
    BertConfig,
    BertModel,
    DebertaV2Config,
    DebertaV2Model,
    DynamicCache,
    ElectraConfig,
    ElectraModel,
    GemmaConfig,
    GemmaForCausalLM,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    OPTConfig,
    OPTForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    RobertaConfig,
    RobertaModel,
    T5Config,
    T5Model,
    XLMRobertaConfig,
    XLMRobertaModel,
)

import longattn
from longattn import LongAttnConfig, apply_longattn
from longattn.integration_transformers import longattn_attention_forward

VOCAB, LENGTH = 100, 48
# The families' sizes: hidden 32 in 4 heads (64 in 4 heads sharing 2 key-value heads with rotary positions), 2
# layers, feed-forward 64, 256 positions; no dropout.
ENCODER = {**FOUR_HEADS, "vocab_size": VOCAB, "max_position_embeddings": 256, **NO_DROPOUT}
ROPE = {**FOUR_HEADS, "hidden_size": 64, "num_key_value_heads": 2, "vocab_size": VOCAB, "max_position_embeddings": 256}


def _no_dropout(config):
    """`config` with each of its dropout probabilities 0 (the float fields named *dropout*, *dropout_prob* or *pdrop*:
    a family's own names)."""
    for name, value in config.to_dict().items():
        if isinstance(value, float) and name.endswith(("dropout", "dropout_prob", "pdrop")):
            setattr(config, name, 0.0)
    return config


FAMILIES = {
    # name: (model class, config, causal)
    "bert": (BertModel, lambda: BertConfig(**ENCODER), False),
    "roberta": (RobertaModel, lambda: RobertaConfig(**{**ENCODER, "max_position_embeddings": 258}), False),
    "gpt2": (
        GPT2LMHeadModel,
        lambda: _no_dropout(GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=256)),
        True,
    ),
    "llama": (LlamaForCausalLM, lambda: LlamaConfig(**ROPE), True),
    "mistral": (MistralForCausalLM, lambda: MistralConfig(**ROPE), True),
    "qwen2": (Qwen2ForCausalLM, lambda: Qwen2Config(**ROPE), True),
    "bart": (
        BartModel,
        lambda: _no_dropout(
            BartConfig(vocab_size=VOCAB, max_position_embeddings=256, **bart_sizes(32, layers=2, heads=4, ffn=64))
        ),
        False,
    ),
}
MORE_FAMILIES = {
    "xlm_roberta": (XLMRobertaModel, lambda: XLMRobertaConfig(**ENCODER), False),
    "electra": (ElectraModel, lambda: ElectraConfig(**ENCODER, embedding_size=32), False),
    "opt": (
        OPTForCausalLM,
        lambda: _no_dropout(
            OPTConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, ffn_dim=64)
        ),
        True,
    ),
    "qwen3": (Qwen3ForCausalLM, lambda: Qwen3Config(**ROPE, head_dim=16), True),
    "phi3": (Phi3ForCausalLM, lambda: Phi3Config(**ROPE, pad_token_id=0, eos_token_id=2, bos_token_id=1), True),
    "gemma": (GemmaForCausalLM, lambda: GemmaConfig(**ROPE, head_dim=16), True),
}
FAMILIES.update(MORE_FAMILIES)
CAUSAL = [name for name, (_, _, causal) in FAMILIES.items() if causal and name not in MORE_FAMILIES]


def build(family: str, implementation: str = "sdpa", **config_fields):
    model_class, make_config, _ = FAMILIES[family]
    torch.manual_seed(0)
    config = make_config()
    for key, value in config_fields.items():
        setattr(config, key, value)
    return model_class._from_config(config, attn_implementation=implementation).eval()


def inputs(family: str, length: int = LENGTH) -> dict:
    """A batch of two, the second row padded (on the left for causal models, as generation pads)."""
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(3, VOCAB, (2, length), generator=generator)
    mask = torch.ones(2, length, dtype=torch.long)
    if FAMILIES[family][2]:
        mask[1, :11] = 0
    else:
        mask[1, -11:] = 0
    batch = {"input_ids": ids, "attention_mask": mask}
    if family == "bart":
        batch["decoder_input_ids"] = torch.randint(3, VOCAB, (2, 9), generator=generator)
    return batch


def real_outputs(family: str, model, batch: dict, **kwargs) -> list[torch.Tensor]:
    """The outputs at real positions (encoder and decoder outputs for BART)."""
    out = model(**batch, **kwargs)
    real = batch["attention_mask"].bool()
    if family == "bart":
        return [out.encoder_last_hidden_state[real], out.last_hidden_state]
    main = out.logits if hasattr(out, "logits") else out.last_hidden_state
    return [main[real]]


def outputs_and_grads(family: str, model, batch: dict, **kwargs) -> tuple[list[torch.Tensor], dict]:
    model.zero_grad()
    outs = real_outputs(family, model, batch, **kwargs)
    generator = torch.Generator().manual_seed(2)
    loss = sum((out * torch.randn(out.shape, generator=generator)).sum() for out in outs)
    loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return [out.detach() for out in outs], grads


def assert_same(first, second, atol=1e-5, rtol=1e-5):
    (outs_a, grads_a), (outs_b, grads_b) = first, second
    for a, b in zip(outs_a, outs_b):
        torch.testing.assert_close(a, b, atol=atol, rtol=rtol)
    assert grads_a.keys() == grads_b.keys()
    for name in grads_a:
        torch.testing.assert_close(grads_a[name], grads_b[name], atol=atol, rtol=rtol, msg=name)


# ------------------------------------------------------------------------------------------ registration
def test_import_registers_implementation_and_mask_function():
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    assert "longattn" in AttentionInterface._global_mapping
    assert "longattn" in AttentionMaskInterface._global_mapping


def test_mask_function_returns_the_padding_mask_cut_to_the_cached_keys():
    mask = torch.tensor([[0, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0]])
    out = longattn.integration_transformers.longattn_mask(
        batch_size=2, q_length=1, kv_length=3, kv_offset=2, attention_mask=mask.bool(), local_size=3
    )
    assert out.shape == (2, 3) and out.tolist() == [[True, True, True], [True, True, False]]


# ------------------------------------------------------------------------------------------ exactness
@pytest.mark.parametrize("family", [name for name in FAMILIES if name not in MORE_FAMILIES])
@pytest.mark.parametrize(
    "fields",
    [{"attention_type": "full"}, {"attention_type": "sliding", "sliding_window": LENGTH}],
    ids=["full", "covering_window"],
)
def test_equals_sdpa_with_padding(family, fields):
    """A window covering the sequence (or "full"): outputs and gradients equal the same model under sdpa."""
    reference = build(family)
    model = apply_longattn(copy.deepcopy(reference), **fields)
    assert model.config._attn_implementation == "longattn"
    batch = inputs(family)
    assert_same(outputs_and_grads(family, model, batch), outputs_and_grads(family, reference, batch))


SPARSE_FIELDS = {
    "sliding": {"attention_type": "sliding", "sliding_window": 5, "sliding_dilation": [1, 1, 2, 3]},
    "strided": {"attention_type": "strided", "strided_stride": [4, 6]},
    "fixed": {"attention_type": "fixed", "fixed_block_size": 8, "fixed_num_summary": 2},
    "per_layer": {
        "attention_type": ["sliding", "fixed"],
        "sliding_window": 4,
        "fixed_block_size": 6,
        "fixed_num_summary": 1,
    },
}


@pytest.mark.parametrize("family", ["bert", "llama", "bart"])
@pytest.mark.parametrize("kind", list(SPARSE_FIELDS))
def test_real_window_equals_dense_masked_reference(family, kind):
    """A real window: the fast executors equal the kind's dense masked form (`attention_backend="reference"`), in
    float64 (in float32 the two summation orders of the tied embedding gradient, about 200 in size, differ by 3e-5)."""
    base = build(family).double()
    model = apply_longattn(copy.deepcopy(base), **SPARSE_FIELDS[kind], attention_backend="torch")
    reference = apply_longattn(copy.deepcopy(base), **SPARSE_FIELDS[kind], attention_backend="reference")
    batch = inputs(family)
    assert_same(outputs_and_grads(family, model, batch), outputs_and_grads(family, reference, batch))
    # and the pattern is really sparse: the output differs from full attention
    full = apply_longattn(copy.deepcopy(base), attention_type="full")
    assert not torch.allclose(real_outputs(family, model, batch)[0], real_outputs(family, full, batch)[0], atol=1e-4)


@pytest.mark.parametrize("family", ["bert", "roberta", "llama", "bart"])
def test_global_tokens_reach_the_attention_as_a_forward_kwarg(family):
    base = build(family)
    fields = {"attention_type": "sliding", "sliding_window": 3}
    model = apply_longattn(copy.deepcopy(base), **fields, attention_backend="torch")
    reference = apply_longattn(copy.deepcopy(base), **fields, attention_backend="reference")
    batch = inputs(family)
    global_mask = torch.zeros(2, LENGTH, dtype=torch.bool)
    global_mask[:, [20, 30]] = True
    with_globals = outputs_and_grads(family, model, batch, global_attention_mask=global_mask)
    assert_same(with_globals, outputs_and_grads(family, reference, batch, global_attention_mask=global_mask))
    without = real_outputs(family, model, batch)
    assert not torch.allclose(with_globals[0][0], without[0].detach(), atol=1e-4)


def test_bart_global_tokens_apply_to_the_encoder_only():
    """The decoder's self-attention ("full" here) and the cross-attention ignore `global_attention_mask`."""
    model = apply_longattn(build("bart"), attention_type="sliding", sliding_window=3, decoder_attention_type="sliding")
    batch = inputs("bart")
    global_mask = torch.zeros(2, LENGTH, dtype=torch.bool)
    global_mask[:, 0] = True
    out = model(**batch, global_attention_mask=global_mask)
    # the same encoder output fed to the decoder without global tokens gives the same decoder output
    decoder_only = model(
        encoder_outputs=(out.encoder_last_hidden_state,),
        attention_mask=batch["attention_mask"],
        decoder_input_ids=batch["decoder_input_ids"],
    )
    torch.testing.assert_close(out.last_hidden_state, decoder_only.last_hidden_state)


# ------------------------------------------------------------------------------------------ generation and cache
GENERATE_CASES = [(family, "sliding") for family in CAUSAL] + [
    ("llama", "dilated"),
    ("gpt2", "strided"),
    ("llama", "synthesizer"),
]
GENERATE_FIELDS = {
    "sliding": {"attention_type": "sliding", "sliding_window": 4},  # a bounded cache (window 5)
    "dilated": {"attention_type": "sliding", "sliding_window": 3, "sliding_dilation": 2},  # full cache layers
    "strided": {"attention_type": "strided", "strided_stride": 4},
    "synthesizer": {"attention_type": "synthesizer", "synthesizer_mode": "factorized_random", "synthesizer_mix": True},
}


@pytest.mark.parametrize("family, kind", GENERATE_CASES)
def test_cached_generate_equals_uncached(family, kind):
    model = apply_longattn(build(family), **GENERATE_FIELDS[kind])
    batch = inputs(family, length=12)
    kwargs = dict(max_new_tokens=8, do_sample=False, pad_token_id=0)
    cached = model.generate(**batch, **kwargs)
    uncached = model.generate(**batch, **kwargs, use_cache=False)
    assert torch.equal(cached, uncached)


def _prompt_with_global_first_token(family: str) -> tuple[dict, torch.Tensor]:
    """Two prompts of 12 tokens, the second left-padded by 3; each row's first real token is global."""
    batch = inputs(family, length=12)
    batch["attention_mask"] = torch.ones_like(batch["attention_mask"])
    batch["attention_mask"][1, :3] = 0
    global_mask = torch.zeros(2, 12, dtype=torch.long)
    global_mask[0, 0] = global_mask[1, 3] = 1
    return batch, global_mask


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_generate_passes_global_tokens_to_the_prompt(family):
    """`generate(..., global_attention_mask=...)` reaches the attention at the prompt (the first step's scores
    change) and decodes correctly afterwards: generated tokens are not global, the cache keeps the global keys, so
    cached generation equals uncached generation."""
    model = apply_longattn(build(family), attention_type="sliding", sliding_window=2, sliding_dilation=2)
    batch, global_mask = _prompt_with_global_first_token(family)
    kwargs = dict(max_new_tokens=6, do_sample=False, pad_token_id=0, output_scores=True, return_dict_in_generate=True)
    cached = model.generate(**batch, global_attention_mask=global_mask, **kwargs)
    uncached = model.generate(**batch, global_attention_mask=global_mask, use_cache=False, **kwargs)
    assert torch.equal(cached.sequences, uncached.sequences)
    torch.testing.assert_close(torch.stack(cached.scores), torch.stack(uncached.scores))
    without = model.generate(**batch, **kwargs)
    assert not torch.allclose(cached.scores[0], without.scores[0], atol=1e-4)  # the prompt saw its global tokens
    # a plain causal window bounds the cache, which drops the early global keys: refused, never silently wrong
    apply_longattn(model, attention_type="sliding", sliding_window=2)
    with pytest.raises(ValueError, match="cached decoding with global tokens needs a full cache"):
        model.generate(**batch, global_attention_mask=global_mask, **kwargs)
    # a model that does not run longattn still refuses the keyword (it would be ignored)
    with pytest.raises(ValueError, match="not used by the model"):
        build(family).generate(**batch, global_attention_mask=global_mask, **kwargs)


def test_plain_causal_window_bounds_the_cache_and_the_dict_wins_over_mistral_window():
    """Mistral's own `sliding_window` (4096) gives way to the `longattn` dict, for the attention and the cache:
    a plain window w per side is transformers' window w + 1 (it counts the current token); dilated, strided or
    per-layer windows keep full cache layers."""
    model = build("mistral")
    assert model.config.sliding_window == 4096
    apply_longattn(model, attention_type="sliding", sliding_window=6)
    assert model.config.sliding_window == 7
    cache = DynamicCache(config=model.config)
    batch = inputs("mistral", length=30)
    model(**batch, cache=cache, use_cache=True)
    assert cache.layers[0].keys.shape[2] == 6  # transformers keeps window - 1 keys between steps
    apply_longattn(model, attention_type="sliding", sliding_window=[6, 4])  # one window per layer: full layers
    assert model.config.sliding_window is None
    apply_longattn(model, attention_type="sliding", sliding_window=6, sliding_dilation=2)
    assert model.config.sliding_window is None
    cache = DynamicCache(config=model.config)
    model(**batch, cache=cache, use_cache=True)
    assert cache.layers[0].keys.shape[2] == 30
    # the attention follows the dict (window 2 per side), not Mistral's 4096-token window
    apply_longattn(model, attention_type="sliding", sliding_window=2)
    window_two = real_outputs("mistral", model, batch)[0]
    apply_longattn(model, attention_type="full")
    assert not torch.allclose(window_two, real_outputs("mistral", model, batch)[0], atol=1e-4)


def test_qwen2_layer_types_follow_the_dict():
    model = apply_longattn(build("qwen2"), attention_type="sliding", sliding_window=3)
    assert model.config.layer_types == ["sliding_attention"] * 2 and model.model.has_sliding_layers
    apply_longattn(model, attention_type="strided", strided_stride=4)
    assert model.config.layer_types == ["full_attention"] * 2 and not model.model.has_sliding_layers


# ------------------------------------------------------------------------------------------ parameters, save, reload
PARAMETRIZED_KINDS = {
    "linformer": {"attention_type": "linformer", "linformer_proj_len": 8},
    "sinkhorn": {"attention_type": "sinkhorn", "sinkhorn_block_size": 8},
    "routing": {
        "attention_type": "routing",
        "routing_num_clusters": 4,
        "routing_num_local_heads": 1,
        "routing_local_window": 4,
    },
    "adaptive_span": {"attention_type": "adaptive_span", "adaptive_span_max": 16, "adaptive_span_ramp": 4},
    "efficient": {"attention_type": "efficient"},
    "sliding": {"attention_type": "sliding", "sliding_window": 4},
    "random_synthesizer": {"attention_type": "synthesizer", "synthesizer_mode": "random"},
    "factorized_random_mixed": {
        "attention_type": "synthesizer",
        "synthesizer_mode": "factorized_random",
        "synthesizer_factor_k": 4,
        "synthesizer_mix": True,
    },
}


@pytest.mark.parametrize("kind", list(PARAMETRIZED_KINDS))
def test_trained_kind_parameters_survive_save_and_reload(kind, tmp_path):
    family = "bert"
    model = apply_longattn(build(family), **PARAMETRIZED_KINDS[kind])
    own = [name for name, _ in model.named_parameters() if ".longattn." in name]
    batch = inputs(family)
    if own:  # a training step moves the kind's own parameters
        model.train()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
        outputs_and_grads(family, model, batch)
        optimizer.step()
        model.eval()
    model.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["attn_implementation"] == "longattn" and saved["longattn"] == PARAMETRIZED_KINDS[kind]
    reloaded, info = AutoModel.from_pretrained(tmp_path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert reloaded.config._attn_implementation == "longattn"
    assert sorted(reloaded.state_dict()) == sorted(model.state_dict())
    for name, tensor in model.state_dict().items():
        torch.testing.assert_close(reloaded.state_dict()[name], tensor, msg=name)
    reloaded.eval()
    for a, b in zip(real_outputs(family, model, batch), real_outputs(family, reloaded, batch)):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("family", ["llama", "bart", "gpt2"])
def test_save_reload_round_trip_other_families(family, tmp_path):
    fields = {"attention_type": "sliding", "sliding_window": 5}
    if family == "bart":
        fields = {"attention_type": "linformer", "linformer_proj_len": 8}
    model = apply_longattn(build(family), **fields)
    model.save_pretrained(tmp_path)
    auto = AutoModelForCausalLM if FAMILIES[family][2] else AutoModel
    reloaded, info = auto.from_pretrained(tmp_path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert reloaded.config._attn_implementation == "longattn"
    batch = inputs(family)
    for a, b in zip(real_outputs(family, model, batch), real_outputs(family, reloaded.eval(), batch)):
        torch.testing.assert_close(a, b)
    # a second save of the reloaded model keeps the implementation as well
    reloaded.save_pretrained(tmp_path / "again")
    assert json.loads((tmp_path / "again" / "config.json").read_text())["attn_implementation"] == "longattn"


def test_saved_implementation_follows_set_attn_implementation(tmp_path):
    """After `set_attn_implementation`, `save_pretrained` writes the implementation in use; a kind with parameters
    refuses to be switched off (they would not reload)."""
    model = apply_longattn(build("llama"), attention_type="sliding", sliding_window=4)
    model.set_attn_implementation("sdpa")
    model.save_pretrained(tmp_path / "sdpa")
    assert json.loads((tmp_path / "sdpa" / "config.json").read_text())["attn_implementation"] == "sdpa"
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "sdpa").config._attn_implementation == "sdpa"
    model.set_attn_implementation("longattn")
    model.save_pretrained(tmp_path / "longattn")
    assert json.loads((tmp_path / "longattn" / "config.json").read_text())["attn_implementation"] == "longattn"
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "longattn").config._attn_implementation == "longattn"
    model = apply_longattn(build("bert"), **PARAMETRIZED_KINDS["linformer"])
    with pytest.raises(ValueError, match=r"`attn_implementation`='sdpa'.*\['linformer'\].*trained parameters"):
        model.set_attn_implementation("sdpa")
    assert model.config._attn_implementation == "longattn" and model.config.attn_implementation == "longattn"


def test_auxiliary_loss_of_a_stock_model_is_its_kinds_span_penalty():
    """A stock head's loss does not know the kinds: `longattn.auxiliary_loss(model)` is the sum of adaptive span's
    per-layer penalties (λ · S · mean fraction), differentiable in the spans; None for kinds without one."""
    model = apply_longattn(
        build("bert"),
        attention_type="adaptive_span",
        adaptive_span_max=16,
        adaptive_span_ramp=4,
        adaptive_span_loss_coef=0.5,
    )
    kinds = [module for name, module in model.named_modules() if name.endswith(".longattn")]
    assert len(kinds) == 2
    with torch.no_grad():
        for kind in kinds:
            kind.span_fraction.fill_(0.25)
    loss = longattn.auxiliary_loss(model)
    torch.testing.assert_close(loss, torch.tensor(2 * 0.5 * 16 * 0.25))
    loss.backward()
    assert all(bool(kind.span_fraction.grad.ne(0).all()) for kind in kinds)
    assert longattn.auxiliary_loss(apply_longattn(build("bert"), attention_type="sliding", sliding_window=4)) is None


def test_from_config_attaches_the_kinds():
    config = FAMILIES["bert"][1]()
    config.longattn = {"attention_type": "linformer", "linformer_proj_len": 8}
    model = AutoModel.from_config(config, attn_implementation="longattn")
    assert any(".longattn.e_proj" in name for name, _ in model.named_parameters())
    model(**inputs("bert"))


# ------------------------------------------------------------------------------------------ refusals
def test_direct_construction_is_refused_at_forward_with_what_to_call():
    config = FAMILIES["roberta"][1]()
    config.longattn = {"attention_type": "sliding", "sliding_window": 4}
    model = RobertaModel(config)
    model.set_attn_implementation("longattn")
    with pytest.raises(ValueError, match="RobertaSelfAttention has no longattn kind.*apply_longattn"):
        model(**inputs("roberta"))


def test_family_that_never_calls_the_interface_is_refused():
    config = DebertaV2Config(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64
    )
    with pytest.raises(ValueError, match="DebertaV2Model.*never call transformers' AttentionInterface"):
        apply_longattn(DebertaV2Model(config), attention_type="sliding")


def test_dense_position_bias_is_refused():
    config = T5Config(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4)
    with pytest.raises(ValueError, match="T5Model.*dense position bias"):
        apply_longattn(T5Model(config), attention_type="sliding")
    module = build("bert").encoder.layer[0].attention.self
    q = torch.zeros(1, 4, 5, 8)
    with pytest.raises(ValueError, match="BertSelfAttention.*dense position bias"):
        longattn_attention_forward(module, q, q, q, None, position_bias=torch.zeros(1, 4, 5, 5))


@pytest.mark.parametrize("kind", ["reduction", "lsh"])
def test_kinds_that_need_hidden_states_or_shared_qk_are_refused(kind):
    with pytest.raises(ValueError, match=f"`attention_type`='{kind}' cannot run in a stock transformers model"):
        apply_longattn(build("bert"), attention_type=kind)


@pytest.mark.parametrize("mode", ["dense", "factorized_dense"])
def test_dense_synthesizer_is_refused(mode):
    with pytest.raises(ValueError, match=f"`synthesizer_mode`='{mode}' cannot run.*hidden states.*'random'"):
        apply_longattn(build("bert"), attention_type="synthesizer", synthesizer_mode=mode)


def test_fields_are_validated_like_longattn_config():
    model = build("bert")
    with pytest.raises(ValueError) as native:
        LongAttnConfig(attention_type="sliding", sliding_window=0)
    with pytest.raises(ValueError) as stock:
        apply_longattn(model, attention_type="sliding", sliding_window=0)
    assert str(stock.value) == str(native.value)
    with pytest.raises(
        ValueError, match=r"`longattn` dict: unknown config field\(s\) 'sliding_windw' \(did you mean sliding_window"
    ):
        apply_longattn(model, attention_type="sliding", sliding_windw=4)
    with pytest.raises(ValueError, match="has 3 entries"):
        apply_longattn(model, attention_type=["sliding", "full", "full"])
    with pytest.raises(ValueError, match="`model` must be a built transformers model .* got str"):
        apply_longattn("bert-base-uncased", attention_type="sliding")
    assert model.config._attn_implementation == "sdpa" and getattr(model.config, "longattn", None) is None


def test_four_d_mask_is_refused_for_sparse_kinds():
    model = apply_longattn(build("llama"), attention_type="sliding", sliding_window=4)
    batch = inputs("llama", length=10)
    mask = torch.ones(2, 1, 10, 10, dtype=torch.bool).tril()
    with pytest.raises(ValueError, match="4-D attention mask cannot be applied by the sparse kind 'sliding'"):
        model(input_ids=batch["input_ids"], attention_mask=mask)


PACKING_KINDS = {
    "sliding": dict(attention_type="sliding", sliding_window=3, sliding_dilation=[1, 2, 1, 2]),
    "fixed": dict(attention_type="fixed", fixed_block_size=4, fixed_num_summary=1),
    "full": dict(attention_type="full"),
}


@pytest.mark.parametrize("kind", sorted(PACKING_KINDS))
@pytest.mark.parametrize("family", ["llama", "roberta"])
def test_packed_documents_equal_documents_alone(family, kind):
    """Positions that restart per document (`DataCollatorWithFlattening`): each document's output is the one it has
    alone, for a causal (rotary) and a bidirectional (learned positions) family. This used to raise."""
    model = apply_longattn(build(family), **PACKING_KINDS[kind]).double()
    lengths = (5, 9, 7)
    ids = torch.randint(3, VOCAB, (1, sum(lengths)), generator=torch.Generator().manual_seed(0))
    first = model.config.pad_token_id + 1 if family == "roberta" else 0  # RoBERTa counts from padding_idx + 1
    position_ids = torch.cat([torch.arange(n) + first for n in lengths])[None]
    main = "logits" if family == "llama" else "last_hidden_state"
    packed = getattr(model(input_ids=ids, position_ids=position_ids), main)
    start = 0
    for n in lengths:
        alone = getattr(model(input_ids=ids[:, start : start + n], position_ids=torch.arange(n)[None] + first), main)
        torch.testing.assert_close(packed[:, start : start + n], alone, atol=1e-9, rtol=0)
        start += n


def test_flattening_collator_batches_equal_documents_alone():
    """`DataCollatorWithFlattening` with the varlen keywords (`cu_seq_lens_q`/`_k`, `max_length_q`/`_k`), which
    mark the documents, and its restarting `position_ids`, which the model's rotary embedding reads."""
    from transformers import DataCollatorWithFlattening

    model = apply_longattn(build("llama"), **PACKING_KINDS["sliding"]).double()
    generator = torch.Generator().manual_seed(0)
    documents = [torch.randint(3, VOCAB, (n,), generator=generator).tolist() for n in (6, 11, 4)]
    batch = DataCollatorWithFlattening(return_flash_attn_kwargs=True)([{"input_ids": ids} for ids in documents])
    assert "cu_seq_lens_q" in batch and "position_ids" in batch
    batch.pop("labels")
    packed = model(**batch).logits
    start = 0
    for ids in documents:
        alone = model(input_ids=torch.tensor([ids])).logits
        torch.testing.assert_close(packed[:, start : start + len(ids)], alone, atol=1e-9, rtol=0)
        start += len(ids)


def test_packed_documents_are_refused_by_a_kind_that_cannot_pack():
    model = apply_longattn(build("bert"), attention_type="linformer", linformer_proj_len=8)
    ids = torch.randint(3, VOCAB, (1, 12))
    with pytest.raises(ValueError, match="'linformer'.*cannot run packed documents"):
        model(input_ids=ids, position_ids=torch.cat([torch.arange(5), torch.arange(7)])[None])
    model(input_ids=ids, position_ids=torch.arange(12)[None])  # one document per row runs


def test_kind_parameters_missing_from_a_stock_checkpoint_are_initialised_by_the_kind(tmp_path):
    """from_pretrained of a checkpoint without kind tensors: they are reported MISSING and initialised as the kind
    initialises them (spans at 0, unit-norm centroids), never left as uninitialised memory."""
    from transformers import AutoConfig

    build("bert").save_pretrained(tmp_path)
    for fields, name in (
        ({"attention_type": "adaptive_span", "adaptive_span_max": 16}, "span_fraction"),
        ({"attention_type": "routing", "routing_num_clusters": 4}, "centroids"),
    ):
        config = AutoConfig.from_pretrained(tmp_path)
        config.longattn = fields
        model, info = AutoModel.from_pretrained(
            tmp_path, config=config, attn_implementation="longattn", output_loading_info=True
        )
        assert {key.rsplit(".", 1)[-1] for key in info["missing_keys"]} == {name}
        tensor = (
            model.encoder.layer[1].attention.self.longattn.get_parameter(name)
            if name == "span_fraction"
            else (model.encoder.layer[1].attention.self.longattn.centroids)
        )
        if name == "span_fraction":
            assert torch.equal(tensor, torch.zeros_like(tensor))
        else:
            torch.testing.assert_close(tensor.norm(dim=-1), torch.ones(tensor.shape[:-1]))


def test_an_invalid_decoder_field_changes_nothing():
    """Every stack is validated before any kind is attached: BART's causal decoder refuses Linformer, and its
    encoder keeps no kind."""
    model = build("bart")
    with pytest.raises(ValueError, match="'linformer' cannot be causal"):
        apply_longattn(model, attention_type="sliding", decoder_attention_type="linformer")
    assert not any(name.endswith(".longattn") for name, _ in model.named_modules())
    assert model.config._attn_implementation == "sdpa"


def test_global_tokens_with_a_cache():
    """Full cache layers (a dilated window): a cached decoding step with global tokens equals the uncached forward
    (the steps `generate(..., global_attention_mask=...)` takes, one by one). A bounded
    cache (a plain causal window) has dropped the early global keys: refused at the decoding step."""
    ids = inputs("llama", length=13)["input_ids"][:1]
    global_mask = torch.zeros(1, 13, dtype=torch.bool)
    global_mask[:, 2] = True
    model = apply_longattn(build("llama"), attention_type="sliding", sliding_window=2, sliding_dilation=2)
    whole = model(input_ids=ids, global_attention_mask=global_mask).logits[:, -1]
    cache = DynamicCache(config=model.config)
    model(input_ids=ids[:, :12], global_attention_mask=global_mask[:, :12], cache=cache, use_cache=True)
    step = model(input_ids=ids[:, 12:], global_attention_mask=global_mask, cache=cache, use_cache=True).logits[:, -1]
    torch.testing.assert_close(step, whole)
    apply_longattn(model, attention_type="sliding", sliding_window=2)
    cache = DynamicCache(config=model.config)
    model(input_ids=ids[:, :12], global_attention_mask=global_mask[:, :12], cache=cache, use_cache=True)
    with pytest.raises(ValueError, match="cached decoding with global tokens needs a full cache"):
        model(input_ids=ids[:, 12:], global_attention_mask=global_mask, cache=cache, use_cache=True)


@pytest.mark.parametrize("family", list(MORE_FAMILIES))
def test_more_families_equal_sdpa_and_reload(family, tmp_path):
    """The other supported attention classes: a covering window equals sdpa (outputs and gradients, with padding),
    and the model reloads with its Auto class as the same longattn model."""
    reference = build(family)
    model = apply_longattn(copy.deepcopy(reference), attention_type="sliding", sliding_window=LENGTH)
    batch = inputs(family)
    assert_same(outputs_and_grads(family, model, batch), outputs_and_grads(family, reference, batch))
    model.save_pretrained(tmp_path)
    auto = AutoModelForCausalLM if FAMILIES[family][2] else AutoModel
    reloaded = auto.from_pretrained(tmp_path).eval()
    assert reloaded.config._attn_implementation == "longattn"
    assert any(name.endswith(".longattn") for name, _ in reloaded.named_modules())
    model.eval()
    torch.testing.assert_close(real_outputs(family, reloaded, batch)[0], real_outputs(family, model, batch)[0])


@pytest.mark.parametrize("kind", ["sliding", "strided", "fixed"])
def test_sparse_kinds_never_build_an_n_by_n_mask(kind, monkeypatch):
    """The stock forward of a sparse kind runs its executor: no dense mask, no dense reference."""
    model = apply_longattn(build("roberta"), **SPARSE_FIELDS[kind], attention_backend="torch")

    def refuse(*args, **kwargs):
        raise AssertionError("a dense [n, m] mask was built")

    for target in (
        "longattn.executor_families.materialize_mask",
        "longattn.attention_base.materialize_mask",
        "longattn.executor_reference.materialize_mask",
        "longattn.executor_reference.reference_attention",
        "longattn.ops.reference_attention",
        "longattn.attention_base.reference_attention",
    ):
        monkeypatch.setattr(target, refuse)
    batch = inputs("roberta")
    model(**batch, global_attention_mask=batch["attention_mask"].bool() & (torch.arange(LENGTH) == 0))


@pytest.mark.parametrize("global_tokens", [False, True])
def test_grouped_query_sliding_reads_kv_heads_in_place_and_equals_repeated(global_tokens, monkeypatch):
    """Llama with 4 query heads over 2 key/value heads: the sliding kind gets k, v with 2 heads (never repeated) and
    gives the outputs and gradients of the repeated path (float64, padding, causal window shorter than the rows)."""
    import longattn.attention_longformer as sliding_module
    import longattn.integration_transformers as integration

    model = build("llama").double()
    apply_longattn(model, attention_type="sliding", sliding_window=5).train()
    batch = inputs("llama", length=37)
    kwargs = {}
    if global_tokens:
        kwargs["global_attention_mask"] = torch.zeros(2, 37, dtype=torch.long).index_fill_(1, torch.tensor([15]), 1)
    seen_heads = []
    original = sliding_module.sliding_window_attention

    def spy(q, k, v, **fields):
        seen_heads.append((q.shape[1], k.shape[1], v.shape[1]))
        return original(q, k, v, **fields)

    monkeypatch.setattr(sliding_module, "sliding_window_attention", spy)
    grouped = outputs_and_grads("llama", model, batch, **kwargs)
    assert seen_heads and set(seen_heads) == {(4, 2, 2)}
    monkeypatch.setattr(integration, "GROUPED_KINDS", ())
    seen_heads.clear()
    repeated = outputs_and_grads("llama", model, batch, **kwargs)
    assert set(seen_heads) == {(4, 4, 4)}
    assert_same(grouped, repeated, atol=1e-10, rtol=1e-10)


# ------------------------------------------------------------------------------------------ relative-position logits
RELATIVE = {"relative_position_logits": True, "relative_max_distance": 6}


def _random_relative_tables(model, seed: int = 3) -> None:
    """Give every layer's relative table random values (`apply_longattn` starts them at zero)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("relative_embedding.weight"):
                parameter.copy_(torch.randn(parameter.shape, generator=generator, dtype=parameter.dtype))


@pytest.mark.parametrize("family", ["roberta", "llama"])
def test_relative_logits_start_at_zero_and_keep_the_pretrained_attention(family):
    """`relative_position_logits` in the `longattn` dict gives every self-attention layer its table r
    `[2M + 1, head_dim]`, zero at first: the lengthened model computes what it computed without them."""
    fields = {"attention_type": "sliding", "sliding_window": 5}
    base = build(family)
    plain = apply_longattn(copy.deepcopy(base), **fields)
    relative = apply_longattn(copy.deepcopy(base), **fields, **RELATIVE)
    tables = [p for name, p in relative.named_parameters() if name.endswith("relative_embedding.weight")]
    head_dim = relative.config.hidden_size // relative.config.num_attention_heads
    assert len(tables) == relative.config.num_hidden_layers
    assert all(t.shape == (2 * RELATIVE["relative_max_distance"] + 1, head_dim) and not t.any() for t in tables)
    batch = inputs(family)
    for a, b in zip(real_outputs(family, plain, batch), real_outputs(family, relative, batch)):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("family, fields", [
    ("roberta", {"attention_type": "sliding", "sliding_window": 5}),
    ("llama", {"attention_type": "sliding", "sliding_window": 5, "sliding_dilation": [1, 1, 2, 2]}),
    ("bert", {"attention_type": "strided", "strided_stride": 4}),
])  # fmt: skip
def test_relative_logits_equal_the_dense_reference(family, fields):
    """With a trained (random) table, the fast executors equal the kind's dense form with the same logits, in
    float64, outputs and gradients (the table's included), with padding; the logits change the output."""
    base = build(family).double()
    model = apply_longattn(copy.deepcopy(base), **fields, **RELATIVE, attention_backend="torch")
    reference = apply_longattn(copy.deepcopy(base), **fields, **RELATIVE, attention_backend="reference")
    _random_relative_tables(model)
    _random_relative_tables(reference)
    batch = inputs(family)
    fast, dense = outputs_and_grads(family, model, batch), outputs_and_grads(family, reference, batch)
    assert_same(fast, dense)
    assert any(name.endswith("relative_embedding.weight") and grad.abs().sum() > 0 for name, grad in fast[1].items())
    without = apply_longattn(copy.deepcopy(base), **fields, attention_backend="torch")
    assert not torch.allclose(real_outputs(family, without, batch)[0], fast[0][0], atol=1e-4)


@pytest.mark.parametrize("family", ["roberta", "llama"])
def test_relative_tables_missing_from_a_stock_checkpoint_start_at_zero(family, tmp_path):
    """`from_pretrained` of a stock checkpoint with `relative_position_logits` in the `longattn` dict: the tables are
    reported MISSING and start at zero, as `apply_longattn` starts them (the stock `_init_weights` would draw them
    like word embeddings), so the loaded model computes what the pretrained one does."""
    from transformers import AutoConfig

    fields = {"attention_type": "sliding", "sliding_window": 5}
    base = build(family)
    base.save_pretrained(tmp_path)
    config = AutoConfig.from_pretrained(tmp_path)
    config.longattn = {**fields, **RELATIVE}
    loaded, info = type(base).from_pretrained(
        tmp_path, config=config, attn_implementation="longattn", output_loading_info=True
    )
    assert {key.rsplit(".", 2)[-2] for key in info["missing_keys"]} == {"relative_embedding"}
    tables = [p for name, p in loaded.named_parameters() if name.endswith("relative_embedding.weight")]
    assert len(tables) == base.config.num_hidden_layers and not any(t.any() for t in tables)
    batch = inputs(family)
    plain = apply_longattn(base, **fields)
    torch.testing.assert_close(real_outputs(family, loaded.eval(), batch), real_outputs(family, plain, batch))


def test_relative_logits_survive_save_reload_and_cached_generation(tmp_path):
    """The tables are saved and reloaded (no missing or unexpected key), and cached greedy decoding equals
    uncached with them."""
    model = apply_longattn(build("llama"), attention_type="sliding", sliding_window=4, **RELATIVE)
    _random_relative_tables(model)
    model.save_pretrained(tmp_path)
    reloaded, info = AutoModelForCausalLM.from_pretrained(tmp_path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    batch = inputs("llama", length=12)
    torch.testing.assert_close(real_outputs("llama", model, batch), real_outputs("llama", reloaded.eval(), batch))
    kwargs = dict(max_new_tokens=8, do_sample=False, pad_token_id=0)
    assert torch.equal(model.generate(**batch, **kwargs), model.generate(**batch, **kwargs, use_cache=False))


# ------------------------------------------------------------------------------------------ torch.compile
@pytest.mark.parametrize("family, fields", [
    ("llama", {"attention_type": "sliding", "sliding_window": 5}),
    ("roberta", {"attention_type": "sliding", "sliding_window": 5, "sliding_dilation": [1, 2, 1, 2]}),
    ("bert", {"attention_type": "fixed", "fixed_block_size": 5, "fixed_num_summary": 1}),
])  # fmt: skip
def test_torch_compile_traces_a_stock_model_without_a_graph_break(family, fields):
    """A stock model running longattn's kinds compiles with `fullgraph=True` (the first graph break raises), with
    padding and global tokens, and gives the eager model's outputs and gradients."""
    model = apply_longattn(build(family), **fields)
    batch = inputs(family)
    global_mask = torch.zeros_like(batch["input_ids"], dtype=torch.bool)
    global_mask[:, 12] = True
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="eager", fullgraph=True)

    def step(forward) -> tuple[list[torch.Tensor], dict]:
        model.zero_grad()
        outs = real_outputs(family, forward, batch, global_attention_mask=global_mask)
        generator = torch.Generator().manual_seed(2)
        sum((out * torch.randn(out.shape, generator=generator)).sum() for out in outs).backward()
        return [out.detach() for out in outs], {
            n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None
        }

    assert_same(step(compiled), step(model))
