"""Weights cross between the base model and every head as BART's do, checkpoints of the earlier seq2seq layout still
load, a checkpoint without its tied embedding leaves nothing on the meta device, and every model trains with
gradient checkpointing (reentrant or not) to the gradients it has without."""

from __future__ import annotations

import functools
import itertools
from pathlib import Path

import pytest
import torch
from kind_configs import bart_sizes, random_ids, tiny_config
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import AutoModel, AutoModelForMaskedLM, AutoModelForSeq2SeqLM

import longattn

FIXTURE = Path(__file__).parent / "fixtures" / "seq2seq_layout_v0"
VOCAB = 40


tiny = functools.partial(
    tiny_config, "sliding", vocab_size=VOCAB, num_decoder_layers=2, max_position_embeddings=64, sliding_window=3
)
ids = functools.partial(random_ids, vocab=VOCAB)


def saved_keys(folder: Path) -> set[str]:
    with safe_open(folder / "model.safetensors", "pt") as file:
        return set(file.keys())


def on_meta(model: torch.nn.Module) -> list[str]:
    tensors = itertools.chain(
        model.named_parameters(remove_duplicate=False), model.named_buffers(remove_duplicate=False)
    )
    return [name for name, tensor in tensors if tensor.device.type == "meta"]


# ---------------------------------------------------------------------------------------------- base <-> heads
def test_auto_model_on_a_seq2seq_folder_is_the_trained_encoder_decoder(tmp_path):
    torch.manual_seed(0)
    seq2seq = longattn.LongAttnForSeq2SeqLM(tiny()).eval()
    seq2seq.save_pretrained(tmp_path)
    base, info = AutoModel.from_pretrained(tmp_path, output_loading_info=True)
    assert type(base) is longattn.LongAttnModel
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    trained = seq2seq.longattn.state_dict()
    assert base.state_dict().keys() == trained.keys()
    for name, tensor in base.state_dict().items():
        torch.testing.assert_close(tensor, trained[name], rtol=0, atol=0, msg=name)
    source, target = ids(2, 11, seed=1), ids(2, 5, seed=2)
    with torch.no_grad():
        head = seq2seq(input_ids=source, decoder_input_ids=target, output_hidden_states=True)
        out = base.eval()(input_ids=source, decoder_input_ids=target)
    torch.testing.assert_close(out.encoder_last_hidden_state, head.encoder_last_hidden_state, rtol=0, atol=0)
    torch.testing.assert_close(out.last_hidden_state, head.decoder_hidden_states[-1], rtol=0, atol=0)


def test_seq2seq_head_loads_the_encoder_of_a_masked_lm_and_back(tmp_path):
    torch.manual_seed(0)
    mlm = longattn.LongAttnForMaskedLM(tiny()).eval()
    mlm.save_pretrained(tmp_path / "mlm")
    seq2seq, info = AutoModelForSeq2SeqLM.from_pretrained(tmp_path / "mlm", output_loading_info=True)
    # Only the decoder is new (its token table is the encoder's, tied).
    assert info["missing_keys"] and all(key.startswith("longattn.decoder.") for key in info["missing_keys"]), info
    source = ids(2, 13, seed=3)
    with torch.no_grad():
        expected = mlm.longattn(input_ids=source).last_hidden_state
        torch.testing.assert_close(
            seq2seq.eval().get_encoder()(input_ids=source).last_hidden_state, expected, rtol=0, atol=0
        )
    decoder_table = seq2seq.get_decoder().embeddings.word_embeddings.weight
    assert decoder_table is seq2seq.longattn.embeddings.word_embeddings.weight
    # An encoder head takes the encoder of a seq2seq checkpoint.
    seq2seq.save_pretrained(tmp_path / "s2s")
    encoder_head = AutoModelForMaskedLM.from_pretrained(tmp_path / "s2s").eval()
    assert encoder_head.longattn.decoder is None
    with torch.no_grad():
        torch.testing.assert_close(encoder_head.longattn(input_ids=source).last_hidden_state, expected, rtol=0, atol=0)


def test_checkpoint_of_the_old_seq2seq_layout_loads_and_resaves_in_the_current_one(tmp_path):
    """The fixture was written by `LongAttnForSeq2SeqLM.save_pretrained` before the layout change (keys
    `encoder.encoder.*`, `encoder.embeddings.*`, `decoder.*`); the outputs stored with it are what that code
    computed."""
    assert any(key.startswith("encoder.encoder.") for key in saved_keys(FIXTURE))
    expected = load_file(FIXTURE / "expected_outputs.safetensors")
    inputs = dict(input_ids=expected["input_ids"], decoder_input_ids=expected["decoder_input_ids"])
    for auto_class in (AutoModelForSeq2SeqLM, AutoModel):
        model, info = auto_class.from_pretrained(FIXTURE, output_loading_info=True)
        assert not info["missing_keys"] and not info["unexpected_keys"], (auto_class.__name__, info)
        assert not on_meta(model)
        with torch.no_grad():
            out = model.eval()(**inputs)
        torch.testing.assert_close(out.encoder_last_hidden_state, expected["encoder_last_hidden_state"])
        if auto_class is AutoModelForSeq2SeqLM:
            torch.testing.assert_close(out.logits, expected["logits"])
            # Saved again, it is written in the current layout (not renamed back to the old one).
            model.save_pretrained(tmp_path / "resaved")
            keys = saved_keys(tmp_path / "resaved")
            assert keys and all(
                key.startswith(("longattn.embeddings.", "longattn.encoder.", "longattn.decoder.")) for key in keys
            ), sorted(keys)
            reloaded = AutoModelForSeq2SeqLM.from_pretrained(tmp_path / "resaved").eval()
            with torch.no_grad():
                torch.testing.assert_close(reloaded(**inputs).logits, expected["logits"])


def test_a_new_base_model_saves_under_its_own_names(tmp_path):
    """The old-layout renaming works on load only: the encoder's `encoder.*` keys are not written as
    `encoder.encoder.*`."""
    for config in (tiny(), tiny(is_encoder_decoder=True)):
        model = longattn.LongAttnModel(config)
        model.save_pretrained(tmp_path)
        keys = saved_keys(tmp_path)
        assert "encoder.layers.0.mlp.fc_in.weight" in keys and "embeddings.word_embeddings.weight" in keys
        assert not any(key.startswith(("encoder.encoder.", "encoder.embeddings.")) for key in keys)


# ---------------------------------------------------------------------------------------------- tied embeddings
@pytest.mark.parametrize(
    "model_class, tie, dropped",
    [
        (longattn.LongAttnForSeq2SeqLM, True, {"longattn.embeddings.word_embeddings.weight"}),
        (longattn.LongAttnForSeq2SeqLM, False, {"lm_head.weight"}),
        (longattn.LongAttnForSeq2SeqLM, False, {"lm_head.weight", "longattn.embeddings.word_embeddings.weight"}),
        (longattn.LongAttnForCausalLM, True, {"longattn.embeddings.word_embeddings.weight"}),
        (longattn.LongAttnForCausalLM, False, {"lm_head.weight"}),
        (longattn.LongAttnModel, True, {"embeddings.word_embeddings.weight"}),
    ],
)
def test_a_missing_tied_or_untied_embedding_is_reported_and_not_left_on_meta(tmp_path, model_class, tie, dropped):
    config = tiny(tie_word_embeddings=tie, is_encoder_decoder=model_class is not longattn.LongAttnForCausalLM)
    model_class(config).save_pretrained(tmp_path)
    weights = load_file(tmp_path / "model.safetensors")
    assert dropped <= weights.keys()
    save_file(
        {k: v for k, v in weights.items() if k not in dropped},
        tmp_path / "model.safetensors",
        metadata={"format": "pt"},
    )
    loaded, info = model_class.from_pretrained(tmp_path, output_loading_info=True)
    assert not on_meta(loaded)
    assert dropped <= set(info["missing_keys"]), info
    embeddings = loaded.get_input_embeddings().weight
    if getattr(loaded, "lm_head", None) is not None:
        assert (loaded.lm_head.weight is embeddings) == tie
    decoder = loaded.get_decoder() if hasattr(loaded, "get_decoder") else None
    if decoder is not None:
        assert decoder.embeddings.word_embeddings.weight is embeddings
    with torch.no_grad():
        out = loaded.eval()(
            input_ids=ids(2, 7, seed=4),
            **({"decoder_input_ids": ids(2, 3, seed=5)} if config.is_encoder_decoder else {}),
        )
    assert torch.isfinite(out[0]).all()


# ---------------------------------------------------------------------------------------------- checkpointing
def _batch(name: str) -> dict[str, torch.Tensor]:
    source = ids(2, 12, seed=6)
    labels = {
        "encoder": {},
        "encoder_decoder": {"decoder_input_ids": ids(2, 5, seed=7)},
        "mlm": {"labels": source},
        "classification": {"labels": torch.tensor([0, 1])},
        "token_classification": {"labels": ids(2, 12, seed=8) % 2},
        "qa": {"start_positions": torch.tensor([1, 3]), "end_positions": torch.tensor([4, 9])},
        "clm": {"labels": source},
        "seq2seq": {"labels": ids(2, 5, seed=9)},
    }[name]
    return {"input_ids": source, **labels}


MODELS = {
    "encoder": (longattn.LongAttnModel, {}),
    "encoder_decoder": (longattn.LongAttnModel, {"is_encoder_decoder": True}),
    "mlm": (longattn.LongAttnForMaskedLM, {}),
    "classification": (longattn.LongAttnForSequenceClassification, {"num_labels": 2}),
    "token_classification": (longattn.LongAttnForTokenClassification, {"num_labels": 2}),
    "qa": (longattn.LongAttnForQuestionAnswering, {}),
    "clm": (longattn.LongAttnForCausalLM, {}),
    "seq2seq": (longattn.LongAttnForSeq2SeqLM, {}),
}


def _gradients(model, batch) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    out = model(**batch)
    loss = out.loss if getattr(out, "loss", None) is not None else out.last_hidden_state.pow(2).mean()
    loss.backward()
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("use_reentrant", [True, False])
@pytest.mark.parametrize("name", list(MODELS))
def test_gradient_checkpointing_gives_the_same_gradients_in_every_model(name, use_reentrant):
    model_class, fields = MODELS[name]
    torch.manual_seed(0)
    model = model_class(tiny(**fields)).train()  # dropout 0: the recomputed forward is the same
    batch = _batch(name)
    expected = _gradients(model, batch)
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": use_reentrant})
    layers = [module for module in model.modules() if isinstance(module, longattn.modeling_longattn.LongAttnLayer)]
    assert len(layers) == (4 if model.config.is_encoder_decoder else 2)
    assert all(layer.gradient_checkpointing for layer in layers)
    got = _gradients(model, batch)
    assert got.keys() == expected.keys()
    for param_name, grad in expected.items():
        torch.testing.assert_close(got[param_name], grad, msg=param_name)


def test_seq2seq_encoder_takes_its_inputs_by_position_or_name_and_ignores_other_model_keywords():
    torch.manual_seed(0)
    encoder = longattn.LongAttnForSeq2SeqLM(tiny()).eval().get_encoder()
    source = ids(2, 9, seed=4)
    mask = torch.ones_like(source)
    mask[0, -2:] = 0
    with torch.no_grad():
        by_name = encoder(input_ids=source, attention_mask=mask, use_cache=True, decoder_input_ids=source)
        by_position = encoder(source, mask)
    torch.testing.assert_close(by_position.last_hidden_state, by_name.last_hidden_state, rtol=0, atol=0)
    assert isinstance(encoder(source, mask, return_dict=False), tuple)
    with pytest.raises(TypeError, match="attention_mask"):
        encoder(source, mask, attention_mask=mask)
    with pytest.raises(TypeError, match="at most 8 positional"):
        encoder(*[None] * 9)


@pytest.mark.parametrize("head", ["base", "lm"])
def test_input_ids_alone_follow_bart_decoder_inputs_shifted_right(head):
    """`BartModel(input_ids=x)` (and `BartForConditionalGeneration` without labels) decode `x` shifted right; the
    longattn model given the same call does the same, with BART's own `shift_tokens_right`."""
    from transformers import BartConfig, BartForConditionalGeneration, BartModel
    from transformers.models.bart.modeling_bart import shift_tokens_right as bart_shift

    torch.manual_seed(0)
    config = tiny(is_encoder_decoder=True)
    model = (longattn.LongAttnModel if head == "base" else longattn.LongAttnForSeq2SeqLM)(config).eval()
    bart_config = BartConfig(
        vocab_size=VOCAB,
        max_position_embeddings=64,
        pad_token_id=config.pad_token_id,
        decoder_start_token_id=config.decoder_start_token_id,
        **bart_sizes(32, layers=1, heads=2, ffn=32),
    )
    bart = (BartModel if head == "base" else BartForConditionalGeneration)(bart_config).eval()
    source = ids(2, 9, seed=3)
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[1, :2] = 0
    with torch.no_grad():
        ours = model(input_ids=source, attention_mask=mask)
        theirs = bart(input_ids=source, attention_mask=mask)
        shifted = bart_shift(source, config.pad_token_id, config.decoder_start_token_id)
        explicit = model(input_ids=source, attention_mask=mask, decoder_input_ids=shifted)
    main = "last_hidden_state" if head == "base" else "logits"
    assert ours[main].shape[:2] == theirs[main].shape[:2] == source.shape
    torch.testing.assert_close(ours[main], explicit[main], rtol=0, atol=0)
    torch.testing.assert_close(ours.encoder_last_hidden_state, explicit.encoder_last_hidden_state, rtol=0, atol=0)
    with pytest.raises(ValueError, match="decoder_input_ids"):  # nothing to shift, as in BART
        model(inputs_embeds=torch.randn(2, 9, 32))
