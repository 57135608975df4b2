"""The common model suite: every registered attention kind passes the same checks (after transformers'
ModelTesterMixin).

Tiny configs (hidden 32, 2 layers, 2 heads); per-kind overrides in tests/kind_configs.py make patterns sparse at these
lengths so the real executors run.
"""

from __future__ import annotations

import pytest
import torch
from attention_checks import assert_no_future_leak
from kind_configs import KIND_OVERRIDES, VOCAB, kind_config, random_ids
from transformers import (
    AutoConfig,
    AutoModel,
    AutoModelForMaskedLM,
    AutoModelForQuestionAnswering,
    AutoModelForSeq2SeqLM,
    AutoModelForSequenceClassification,
    AutoModelForTokenClassification,
)

import longattn
from longattn import LongAttnConfig

KINDS = longattn.available_attention_types()
ENCODER_AUTO_CLASSES = [
    AutoModel,
    AutoModelForMaskedLM,
    AutoModelForSequenceClassification,
    AutoModelForTokenClassification,
    AutoModelForQuestionAnswering,
]


def causal_config_or_skip(kind: str, **overrides) -> LongAttnConfig:
    """A decoder config; kinds that cannot be causal must refuse at config time, then the test is skipped."""
    try:
        return kind_config(kind, is_decoder=True, **overrides)
    except ValueError as error:
        assert "causal" in str(error).lower() or "decoder" in str(error).lower(), error
        pytest.skip(f"{kind} has no causal form ({error})")


def set_seed(seed: int = 0) -> None:
    torch.manual_seed(seed)


# ---------------------------------------------------------------------------------------------- building and loading
@pytest.mark.parametrize("kind", KINDS)
def test_every_head_builds_through_auto_classes(kind):
    config = kind_config(kind)
    ids = random_ids(2, 37)
    for auto_class in ENCODER_AUTO_CLASSES:
        model = auto_class.from_config(config).eval()
        assert type(model).__name__.startswith("LongAttn")
        with torch.no_grad():
            out = model(input_ids=ids)
        first = out[0] if not hasattr(out, "logits") else out.logits
        assert torch.isfinite(first).all()
    seq2seq = AutoModelForSeq2SeqLM.from_config(kind_config(kind)).eval()
    with torch.no_grad():
        out = seq2seq(input_ids=ids, decoder_input_ids=random_ids(2, 5, seed=1))
    assert out.logits.shape == (2, 5, VOCAB)


@pytest.mark.parametrize("kind", KINDS)
def test_save_and_load_round_trip(kind, tmp_path):
    set_seed()
    model = longattn.LongAttnForMaskedLM(kind_config(kind)).eval()
    model.save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors").exists()
    assert AutoConfig.from_pretrained(tmp_path).attention_type == kind
    loaded = AutoModelForMaskedLM.from_pretrained(tmp_path).eval()
    ids = random_ids(2, 41)
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids).logits, model(input_ids=ids).logits, rtol=0, atol=0)
    # The decoder-side classes too (tied embeddings must not break saving).
    for model_class, auto_class in ((longattn.LongAttnForSeq2SeqLM, AutoModelForSeq2SeqLM),):
        model = model_class(kind_config(kind)).eval()
        model.save_pretrained(tmp_path / "s2s")
        loaded = auto_class.from_pretrained(tmp_path / "s2s").eval()
        dec = random_ids(2, 6, seed=3)
        with torch.no_grad():
            torch.testing.assert_close(
                loaded(input_ids=ids, decoder_input_ids=dec).logits,
                model(input_ids=ids, decoder_input_ids=dec).logits,
                rtol=0,
                atol=0,
            )


@pytest.mark.parametrize("kind", KINDS)
def test_eval_mode_is_deterministic(kind):
    model = longattn.LongAttnModel(kind_config(kind, hidden_dropout_prob=0.1)).eval()
    ids = random_ids(2, 33)
    with torch.no_grad():
        torch.testing.assert_close(
            model(input_ids=ids).last_hidden_state, model(input_ids=ids).last_hidden_state, rtol=0, atol=0
        )


# ---------------------------------------------------------------------------------------------- training
def _loss_and_grads(model, ids, labels):
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=labels).loss
    loss.backward()
    return loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("kind", KINDS)
def test_training_step_gives_every_parameter_a_gradient(kind):
    set_seed()
    model = longattn.LongAttnForMaskedLM(kind_config(kind)).train()
    ids = random_ids(2, 45)
    # No global tokens in this batch: every parameter must still receive a gradient (DDP without unused parameters).
    _, grads = _loss_and_grads(model, ids, ids)
    missing = [name for name, p in model.named_parameters() if p.requires_grad and name not in grads]
    assert not missing, f"parameters without gradient: {missing}"
    assert all(torch.isfinite(g).all() for g in grads.values())


@pytest.mark.parametrize("kind", KINDS)
def test_seq2seq_training_step_gives_every_parameter_a_gradient(kind):
    set_seed()
    model = longattn.LongAttnForSeq2SeqLM(kind_config(kind)).train()
    out = model(input_ids=random_ids(2, 39), labels=random_ids(2, 7, seed=5))
    out.loss.backward()
    missing = [name for name, p in model.named_parameters() if p.requires_grad and p.grad is None]
    assert not missing, f"parameters without gradient: {missing}"


@pytest.mark.parametrize("kind", KINDS)
def test_gradient_checkpointing_gives_the_same_gradients(kind):
    set_seed()
    model = longattn.LongAttnForMaskedLM(kind_config(kind)).train()
    ids = random_ids(2, 31)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    set_seed(1)
    loss, grads = _loss_and_grads(model, ids, ids)
    model.load_state_dict(state)
    model.activation_checkpointing_enable()  # transformers 5.x name (the old one is deprecated)
    assert all(layer.gradient_checkpointing for layer in model.longattn.encoder.layers)
    set_seed(1)
    loss_ckpt, grads_ckpt = _loss_and_grads(model, ids, ids)
    torch.testing.assert_close(loss_ckpt, loss)
    assert grads_ckpt.keys() == grads.keys()
    for name in grads:
        torch.testing.assert_close(grads_ckpt[name], grads[name], msg=name)


# ---------------------------------------------------------------------------------------------- invariances
@pytest.mark.parametrize("kind", KINDS)
def test_causal_outputs_do_not_see_the_future(kind):
    set_seed()
    model = longattn.LongAttnForCausalLM(causal_config_or_skip(kind)).eval()
    ids = random_ids(1, 40)
    changed = ids.clone()
    t = 23
    changed[:, t + 1 :] = random_ids(1, 40 - t - 1, seed=9)
    assert_no_future_leak(model, ids, changed, t)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("side", ["right", "left"])
def test_padding_does_not_change_real_tokens(kind, side):
    set_seed()
    model = longattn.LongAttnModel(kind_config(kind)).eval()
    real = random_ids(1, 29)
    pad = torch.zeros(1, 8, dtype=torch.long)
    padded = torch.cat([real, pad], 1) if side == "right" else torch.cat([pad, real], 1)
    mask = (torch.arange(37) < 29) if side == "right" else (torch.arange(37) >= 8)
    with torch.no_grad():
        alone = model(input_ids=real).last_hidden_state
        with_padding = model(input_ids=padded, attention_mask=mask[None].long()).last_hidden_state
    kept = with_padding[:, mask]
    torch.testing.assert_close(kept, alone, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("poison", [float("nan"), float("inf")])
def test_padding_may_hold_anything(kind, poison):
    """NaN or inf in the padded positions' embeddings reaches no real token of any row, for every kind (those that
    sum, pool or project along the length included)."""
    set_seed()
    model = longattn.LongAttnModel(kind_config(kind)).eval()
    embeds = torch.randn(2, 19, model.config.hidden_size)
    mask = torch.ones(2, 19, dtype=torch.long)
    mask[1, 13:] = 0
    poisoned = embeds.clone()
    poisoned[1, 13:] = poison
    with torch.no_grad():
        clean = model(inputs_embeds=embeds, attention_mask=mask).last_hidden_state
        out = model(inputs_embeds=poisoned, attention_mask=mask).last_hidden_state
    torch.testing.assert_close(out[0], clean[0])
    torch.testing.assert_close(out[1, :13], clean[1, :13])


@pytest.mark.parametrize("kind", KINDS)
def test_rows_of_a_batch_are_independent(kind):
    set_seed()
    model = longattn.LongAttnModel(kind_config(kind)).eval()
    ids = random_ids(3, 35)
    mask = torch.ones(3, 35, dtype=torch.long)
    mask[1, 20:] = 0
    with torch.no_grad():
        batched = model(input_ids=ids, attention_mask=mask).last_hidden_state
        for row in range(3):
            single = model(input_ids=ids[row : row + 1], attention_mask=mask[row : row + 1]).last_hidden_state
            torch.testing.assert_close(batched[row : row + 1], single, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("kind", KINDS)
def test_bf16_fully_padded_row_has_no_nan(kind):
    set_seed()
    model = longattn.LongAttnForSequenceClassification(kind_config(kind)).to(torch.bfloat16).train()
    ids = random_ids(2, 27)
    mask = torch.ones(2, 27, dtype=torch.long)
    mask[1] = 0
    out = model(input_ids=ids, attention_mask=mask, labels=torch.tensor([0, 1]))
    assert torch.isfinite(out.logits.float()).all()
    out.loss.backward()
    for name, p in model.named_parameters():
        if p.grad is not None:
            assert torch.isfinite(p.grad.float()).all(), name


# ---------------------------------------------------------------------------------------------- generation
@pytest.mark.parametrize("kind", KINDS)
def test_cached_generation_equals_uncached(kind):
    set_seed()
    # A wide initialisation gives varied continuations: at 0.02 a tiny model repeats one token, which would hide a
    # decoder that ignores its cache (generate passes it as `cache=` since transformers 5.2x).
    model = longattn.LongAttnForCausalLM(causal_config_or_skip(kind, eos_token_id=None, initializer_range=0.5)).eval()
    prompt = random_ids(2, 11)
    kwargs = dict(max_new_tokens=8, do_sample=False, pad_token_id=0)
    cached = model.generate(prompt, use_cache=True, **kwargs)
    uncached = model.generate(prompt, use_cache=False, **kwargs)
    assert cached.shape == (2, 19)
    torch.testing.assert_close(cached, uncached, rtol=0, atol=0)
    with torch.no_grad():  # the cache also gives the same logits as a full forward pass
        full = model(input_ids=cached, use_cache=False).logits
        prefix = model(input_ids=cached[:, :12], use_cache=True)
        step = model(input_ids=cached[:, 12:13], past_key_values=prefix.past_key_values, use_cache=True).logits
    torch.testing.assert_close(step[:, 0], full[:, 12], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kind", KINDS)
def test_seq2seq_cached_generation_equals_uncached(kind):
    set_seed()
    model = longattn.LongAttnForSeq2SeqLM(kind_config(kind, eos_token_id=None, initializer_range=0.5)).eval()
    source = random_ids(2, 33)
    mask = torch.ones_like(source)
    mask[1, 25:] = 0
    kwargs = dict(max_new_tokens=6, do_sample=False, pad_token_id=0, attention_mask=mask)
    cached = model.generate(source, use_cache=True, **kwargs)
    uncached = model.generate(source, use_cache=False, **kwargs)
    torch.testing.assert_close(cached, uncached, rtol=0, atol=0)


# ---------------------------------------------------------------------------------------------- outputs and errors
@pytest.mark.parametrize("kind", KINDS)
def test_hidden_states_and_attentions_are_returned(kind):
    model = longattn.LongAttnModel(kind_config(kind)).eval()
    with torch.no_grad():
        out = model(input_ids=random_ids(2, 19), output_hidden_states=True, output_attentions=True)
    assert len(out.hidden_states) == 3 and out.hidden_states[0].shape == (2, 19, 32)
    assert len(out.attentions) == 2
    assert out.attentions[0].shape[:3] == (2, 2, 19)
    tuple_out = model(input_ids=random_ids(2, 19), return_dict=False)
    assert isinstance(tuple_out, tuple)


def test_checkpoint_reloads_under_another_attention_type(tmp_path):
    model = longattn.LongAttnForMaskedLM(kind_config("full"))
    model.save_pretrained(tmp_path)
    for kind in KINDS:
        reloaded, info = longattn.LongAttnForMaskedLM.from_pretrained(
            tmp_path, attention_type=kind, **KIND_OVERRIDES.get(kind, {}), output_loading_info=True
        )
        shared = [k for k in info["missing_keys"] if any(p in k for p in ("q_proj", "v_proj", "o_proj", "mlp"))]
        assert not shared, f"{kind}: shared parameters missing on reload: {shared}"
        # The kind's own (missing) parameters are initialised, not left as uninitialised memory.
        for name, tensor in reloaded.state_dict().items():
            assert torch.isfinite(tensor).all() and tensor.abs().max() < 1e4, f"{kind}: {name} not initialised"
        torch.testing.assert_close(
            reloaded.longattn.embeddings.word_embeddings.weight,
            model.longattn.embeddings.word_embeddings.weight,
            rtol=0,
            atol=0,
        )


def test_sequence_classification_makes_the_first_token_global():
    config = kind_config("sliding", sliding_window=1, sliding_dilation=1, num_labels=3)
    model = longattn.LongAttnForSequenceClassification(config).eval()
    ids = random_ids(1, 30)
    changed = ids.clone()
    changed[0, -1] = (changed[0, -1] + 1) % VOCAB
    with torch.no_grad():
        # With a window of 1 and 2 layers, token 0 sees the last token only through global attention.
        a, b = model(input_ids=ids).logits, model(input_ids=changed).logits
        assert not torch.allclose(a, b)
        none = torch.zeros(1, 30, dtype=torch.long)
        torch.testing.assert_close(
            model(input_ids=ids, global_attention_mask=none).logits,
            model(input_ids=changed, global_attention_mask=none).logits,
        )


@pytest.mark.parametrize(
    "fields, message",
    [
        (dict(attention_type="nope"), "attention_type"),
        (dict(attention_type=["full", "sliding", "full"]), "attention_type"),
        (dict(sliding_window=0), "sliding_window"),
        (dict(sliding_window=[4, 4, 4]), "sliding_window"),
        (dict(sliding_dilation=0), "sliding_dilation"),
        (dict(sliding_dilation=[1, 2, 3]), "sliding_dilation"),
        (dict(hidden_size=30, num_attention_heads=4), "num_attention_heads"),
        (dict(position_embedding_type="alibi"), "position_embedding_type"),
    ],
)
def test_config_validation_names_the_field(fields, message):
    base = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2)
    base.update(fields)
    with pytest.raises(ValueError, match=message):
        LongAttnConfig(**base)


def test_unknown_attention_lists_the_registered_names():
    with pytest.raises(ValueError) as error:
        LongAttnConfig(attention_type="nope")
    for name in KINDS:
        assert repr(name) in str(error.value)


def test_every_kind_builds_from_its_name_alone():
    for kind in KINDS:
        assert LongAttnConfig(attention_type=kind).layer_attention_types == [kind] * 4


def test_too_long_and_mismatched_inputs_raise():
    model = longattn.LongAttnModel(kind_config("sliding")).eval()
    with pytest.raises(ValueError, match="max_position_embeddings"):
        model(input_ids=random_ids(1, 129))
    with pytest.raises(ValueError, match="attention_mask"):
        model(input_ids=random_ids(1, 20), attention_mask=torch.ones(1, 19, dtype=torch.long))
    with pytest.raises(ValueError, match="global_attention_mask"):
        model(input_ids=random_ids(2, 20), global_attention_mask=torch.ones(1, 20, dtype=torch.long))


def test_learned_positions_and_mixed_layers():
    config = kind_config(
        "full", position_embedding_type="learned", attention_type=["sliding", "full"], sliding_window=[2, 2]
    )
    model = longattn.LongAttnForMaskedLM(config).eval()
    assert [type(layer.self_attn).attention_type for layer in model.longattn.encoder.layers] == ["sliding", "full"]
    ids = random_ids(2, 40)
    mask = torch.ones_like(ids)
    mask[0, :5] = 0  # left padding: positions are counted over real tokens
    with torch.no_grad():
        padded = model(input_ids=ids, attention_mask=mask).logits[0, 5:]
        alone = model(input_ids=ids[:1, 5:]).logits[0]
    torch.testing.assert_close(padded, alone, rtol=1e-4, atol=1e-5)
