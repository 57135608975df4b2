"""Bad input to the public functional attentions (`longattn.ops`), walked systematically with a fixed seed.

Every op x every argument x a list of bad values must raise `ValueError` whose message names the argument; empty
inputs (batch, heads or length 0) and random valid inputs must give an output of the right shape without NaN, and a
backward with gradients of the inputs' shapes. Never another exception type, never NaN.
"""

from __future__ import annotations

import argparse
import ast
import functools
import json
import math
import re
from pathlib import Path

import pytest
import torch
from kind_configs import KIND_OVERRIDES, SIZES
from script_loading import load_script

import longattn
from longattn import ops
from longattn.tools import hub
from longattn.tools.command_line import CommandLineParser, is_secret_flag
from longattn.train import data, training

B, H, N, D = 2, 2, 6, 4
VOCAB, HIDDEN, MAX_POSITIONS = 64, 16, 32


def _small_config(kind: str, **fields) -> longattn.LongAttnConfig:
    """A `kind` model of `VOCAB` tokens, `HIDDEN` in 2 heads, intermediate 32, `MAX_POSITIONS`; `fields` added."""
    small = dict(vocab_size=VOCAB, hidden_size=HIDDEN, num_attention_heads=2, intermediate_size=32)
    return longattn.LongAttnConfig(**small, max_position_embeddings=MAX_POSITIONS, attention_type=kind, **fields)


def _tensors(generator: torch.Generator, b: int = B, h: int = H, n_q: int = N, n_k: int = N, d: int = D):
    q = torch.randn(b, h, n_q, d, generator=generator)
    k = torch.randn(b, h, n_k, d, generator=generator)
    v = torch.randn(b, h, n_k, d, generator=generator)
    return q, k, v


# Each op: how to call it from one dict of arguments, and its default arguments on q, k, v. LSH is shared-QK: its
# `qk` is q (k is not passed).
OPS = {
    "full_attention": (lambda a: ops.full_attention(**a), {}),
    "sliding_window_attention": (lambda a: ops.sliding_window_attention(**a), {"window": 2}),
    "strided_attention": (lambda a: ops.strided_attention(**a), {"stride": 2}),
    "fixed_attention": (lambda a: ops.fixed_attention(**a), {"block_size": 3, "num_summary": 1}),
    "efficient_attention": (lambda a: ops.efficient_attention(**a), {}),
    "lsh_attention": (lambda a: ops.lsh_attention(a.pop("q"), **a), {"num_hashes": 2, "bucket_size": 2, "seed": 0}),
    "reference_attention": (lambda a: ops.reference_attention(**a), {"mask": None}),
}
# The keyword arguments each op takes besides q, k, v (LSH takes no k).
ARGUMENTS = {
    "full_attention": {"causal", "global_mask", "key_padding_mask", "scale", "dropout_p", "backend"},
    "sliding_window_attention": {
        "window",
        "dilation",
        "causal",
        "global_mask",
        "key_padding_mask",
        "scale",
        "dropout_p",
        "backend",
    },
    "strided_attention": {"stride", "causal", "key_padding_mask", "scale", "dropout_p", "backend"},
    "fixed_attention": {
        "block_size",
        "num_summary",
        "causal",
        "summary_per_head",
        "key_padding_mask",
        "scale",
        "dropout_p",
        "backend",
    },
    "efficient_attention": {"normalization", "causal", "key_padding_mask", "backend"},
    "lsh_attention": {
        "num_hashes",
        "bucket_size",
        "num_buckets",
        "num_chunks_before",
        "num_chunks_after",
        "causal",
        "key_padding_mask",
        "rotations",
        "seed",
        "dropout_p",
        "backend",
    },
    "reference_attention": {"mask", "scale", "dropout_p", "return_weights"},
}


def _arguments(op: str, q, k, v) -> dict:
    arguments = {"q": q, "v": v, **OPS[op][1]}
    if op != "lsh_attention":
        arguments["k"] = k
    return arguments


def _run(op: str, arguments: dict):
    return OPS[op][0](dict(arguments))


def _bad_tensor_values(q: torch.Tensor, *, head_dim_fixed: bool, length_fixed: bool) -> list:
    """Bad values for one of q, k, v (the others stay good); another head_dim or length only where they must match."""
    d = q.shape[3]
    return (
        [
            q[0],  # 3-d
            q.unsqueeze(0),  # 5-d
            q.tolist(),  # not a tensor
            q.to(torch.long),  # not floating point
            q.to(torch.float64),  # another dtype than the others
            q.to("meta"),  # another device
            q[..., :0],  # head_dim 0
            q[:1],  # another batch
            q[:, :1],  # other heads
        ]
        + ([q[..., : d - 1]] if head_dim_fixed else [])
        + ([torch.cat([q, q], dim=2)] if length_fixed else [])
    )


def _bad_token_masks(b: int, n: int) -> list:
    keep = torch.ones(b, n, dtype=torch.bool)
    keep[0, -1] = False
    return [
        torch.zeros(b, n).masked_fill(~keep, -math.inf),  # additive float mask (SDPA's float convention)
        keep.float(),  # 1/0 float mask
        keep.long(),  # 1/0 int mask
        keep[:, :-1],  # wrong length
        keep[:1],  # wrong batch
        keep[0],  # 1-d
        keep[:, None],  # 3-d
        keep.to("meta"),  # wrong device
        keep.tolist(),  # not a tensor
    ]


SIZE_VALUES = [0, -1, 2.5, True, "3", None]
BAD_VALUES = {
    "causal": [1, 0, torch.tensor(1), torch.tensor(True), "yes", None],
    "summary_per_head": [1, "no", None],
    "return_weights": [1, None],
    "window": SIZE_VALUES,
    "stride": SIZE_VALUES,
    "block_size": SIZE_VALUES,
    "num_summary": SIZE_VALUES + [4],  # 4 > block_size 3
    "num_hashes": SIZE_VALUES,
    "bucket_size": SIZE_VALUES,
    "num_chunks_before": [-1, 1.5, True, "1", None],
    "num_chunks_after": [-1, 1.5, True, "1", None],
    "num_buckets": [3, 0, -2, (2, 3), True, 2.0, "4"],
    "seed": [1.5, "0", True],
    "dilation": [0, -1, 1.5, True, [1], [1, 0], [], "2"],
    "scale": [math.nan, math.inf, "0.5", True, torch.tensor(0.5)],
    "dropout_p": [-0.1, 1.0, math.nan, "0.1", True, None],
    "backend": ["cuda", "", 3, None],
    "normalization": ["bogus", None, 1],
}


def _bad_cases():
    """(op, argument, index of the bad value): the whole walk, one pytest case per op and argument."""
    for op in OPS:
        for argument in sorted(ARGUMENTS[op]) + (["q", "v"] if op == "lsh_attention" else ["q", "k", "v"]):
            yield op, argument


def _bad_values(op: str, argument: str, q, k, v) -> list:
    if argument in ("q", "k", "v"):
        # v may have another head_dim (d_v), and so may LSH's qk; reference attention and non-causal full attention
        # (cross-attention) take any number of queries (see `test_full_attention_takes_more_queries_than_keys...`).
        head_dim_fixed = argument == "k" or (argument == "q" and op != "lsh_attention")
        length_fixed = not (argument == "q" and op in ("reference_attention", "full_attention"))
        return _bad_tensor_values(
            {"q": q, "k": k, "v": v}[argument], head_dim_fixed=head_dim_fixed, length_fixed=length_fixed
        )
    if argument in ("key_padding_mask", "global_mask"):
        return _bad_token_masks(q.shape[0], k.shape[2])
    if argument == "mask":
        keep = torch.rand(B, 1, N, N) > 0.3
        return [
            torch.zeros(keep.shape).masked_fill(~keep, -math.inf),
            keep.float(),
            keep.long(),
            keep[..., :-1],
            keep[None],
            keep.to("meta"),
            keep.tolist(),
        ]
    if argument == "rotations":
        good = longattn.ops_lsh.lsh_rotations(heads=H, head_dim=D, num_hashes=2, num_buckets=4, seed=0)
        return [good[0], good[:, :-1], good.long(), good[:, :, :0], torch.cat([good, good]), good.tolist()]
    return BAD_VALUES[argument]


def _name_in(argument: str, message: str) -> bool:
    name = "qk" if argument == "q" and "qk" in message else argument
    return re.search(rf"\b{re.escape(name)}\b", message) is not None


@pytest.mark.parametrize(("op", "argument"), list(_bad_cases()))
def test_bad_argument_raises_value_error_naming_it(op, argument):
    generator = torch.Generator().manual_seed(0)
    q, k, v = _tensors(generator)
    for value in _bad_values(op, argument, q, k, v):
        arguments = _arguments(op, q, k, v)
        arguments[argument] = value
        with pytest.raises(ValueError) as raised:
            _run(op, arguments)
        assert _name_in(argument, str(raised.value)), (op, argument, value, str(raised.value))


@pytest.mark.parametrize(
    ("op", "name"), [(op, name) for op in OPS for name in ("key_padding_mask", "global_mask") if name in ARGUMENTS[op]]
)
def test_float_mask_is_refused_with_how_to_convert(op, name):
    """An additive float mask (0 keep, -inf drop) used to be read inverted by `.bool()`; a 1/0 mask is refused too."""
    generator = torch.Generator().manual_seed(1)
    q, k, v = _tensors(generator)
    keep = torch.ones(B, N, dtype=torch.bool)
    keep[1, :2] = False
    for mask in (torch.zeros(B, N).masked_fill(~keep, -math.inf), keep.to(torch.float16), keep.to(torch.int64)):
        with pytest.raises(ValueError, match=rf"{name} must be a bool tensor \(True = attend") as raised:
            _run(op, {**_arguments(op, q, k, v), name: mask})
        assert f"`{name} == 0`" in str(raised.value) and f"`{name}.bool()`" in str(raised.value)
    # The bool mask the message asks for gives what the 0/-inf mask meant: the masked keys take no part.
    additive = torch.zeros(B, N).masked_fill(~keep, -math.inf)
    out = _run(op, {**_arguments(op, q, k, v), name: additive == 0})
    assert torch.isfinite(out).all()


def test_reference_attention_refuses_a_float_mask_and_checks_its_shape():
    generator = torch.Generator().manual_seed(2)
    q, k, v = _tensors(generator)
    visible = torch.ones(N, N, dtype=torch.bool).tril()
    additive = torch.zeros(N, N).masked_fill(~visible, -math.inf)
    with pytest.raises(ValueError, match=r"mask must be a bool tensor .*`mask == 0`"):
        ops.reference_attention(q, k, v, additive)
    with pytest.raises(ValueError, match=r"mask must be broadcastable to \[b, h, n_q, n_k\]"):
        ops.reference_attention(q, k, v, visible[:, :-1])
    torch.testing.assert_close(
        ops.reference_attention(q, k, v, additive == 0), ops.full_attention(q, k, v, causal=True)
    )


def test_full_attention_takes_more_queries_than_keys_unless_causal():
    """Cross-attention (a seq2seq decoder longer than its encoder input) has more queries than keys; causal
    attention aligns queries with the last keys, so there it is refused."""
    generator = torch.Generator().manual_seed(6)
    q, k, v = _tensors(generator, n_q=N + 3)
    k, v = k[:, :, :N], v[:, :, :N]
    torch.testing.assert_close(ops.full_attention(q, k, v), ops.reference_attention(q, k, v, None))
    keep = torch.ones(B, N, dtype=torch.bool)
    keep[0, :2] = False
    for backend in ("auto", "reference"):
        torch.testing.assert_close(
            ops.full_attention(q, k, v, key_padding_mask=keep, backend=backend),
            ops.reference_attention(q, k, v, keep[:, None, None, :]),
        )
    with pytest.raises(ValueError, match=r"\bq has more positions"):
        ops.full_attention(q, k, v, causal=True)


EMPTY_SHAPES = [  # (b, h, n_q, n_k)
    (0, H, N, N),
    (B, 0, N, N),
    (B, H, 0, 0),
    (B, H, 0, N),  # no query (cached decoding of nothing)
]


@pytest.mark.parametrize("op", list(OPS))
@pytest.mark.parametrize("shape", EMPTY_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_empty_inputs_give_empty_outputs_and_gradients(op, shape):
    b, h, n_q, n_k = shape
    if op == "lsh_attention" and n_q != n_k:
        pytest.skip("LSH attention is shared-QK: queries are every key position")
    generator = torch.Generator().manual_seed(3)
    for causal in (False, True):
        q, k, v = (t.requires_grad_() for t in _tensors(generator, b, h, n_q, n_k))
        arguments = _arguments(op, q, k, v)
        if op != "reference_attention":
            arguments["causal"] = causal
        if "key_padding_mask" in ARGUMENTS[op]:
            arguments["key_padding_mask"] = torch.ones(b, n_k, dtype=torch.bool)
        out = _run(op, arguments)
        assert out.shape == (b, h, n_q, D)
        assert not out.isnan().any()
        out.sum().backward()
        for tensor in (q, v) if op == "lsh_attention" else (q, k, v):
            assert tensor.grad is not None and tensor.grad.shape == tensor.shape
            assert not tensor.grad.isnan().any()


def _random_valid_arguments(op: str, generator: torch.Generator) -> dict:
    """Random small valid inputs: lengths 1..9, queries the last n_q keys, masks with fully padded rows."""

    def draw(low: int, high: int) -> int:
        return int(torch.randint(low, high + 1, (1,), generator=generator))

    n_k = draw(1, 9)
    n_q = n_k if op == "lsh_attention" else draw(1, n_k)
    q, k, v = _tensors(generator, draw(1, 2), draw(1, 3), n_q, n_k, draw(1, 5))
    arguments = _arguments(op, q, k, v)
    b, h = q.shape[:2]
    if "causal" in ARGUMENTS[op]:
        arguments["causal"] = bool(draw(0, 1))
    for name in ("key_padding_mask", "global_mask"):
        if name in ARGUMENTS[op] and draw(0, 1):
            arguments[name] = torch.rand(b, n_k, generator=generator) > 0.5
    if op == "reference_attention":
        arguments["mask"] = torch.rand(b, 1, n_q, n_k, generator=generator) > 0.5
    sizes = {"window": (1, 10), "stride": (1, 10), "bucket_size": (1, 10), "num_hashes": (1, 3)}
    for name, (low, high) in sizes.items():
        if name in ARGUMENTS[op]:
            arguments[name] = draw(low, high)
    if op == "fixed_attention":
        arguments["block_size"] = draw(1, 10)
        arguments["num_summary"] = draw(1, arguments["block_size"])
    if op == "sliding_window_attention" and draw(0, 1):
        arguments["dilation"] = [draw(1, 3) for _ in range(h)]
    if op == "efficient_attention":
        arguments["normalization"] = ("softmax", "scaling")[draw(0, 1)]
    if "backend" in ARGUMENTS[op] and draw(0, 1):
        arguments["backend"] = "reference"
    return arguments


@pytest.mark.parametrize("op", list(OPS))
def test_random_valid_inputs_give_finite_outputs(op):
    generator = torch.Generator().manual_seed(4)
    for _ in range(8):
        arguments = _random_valid_arguments(op, generator)
        q, v = arguments["q"].requires_grad_(), arguments["v"].requires_grad_()
        out = _run(op, arguments)
        assert out.shape == (*q.shape[:3], v.shape[3])
        assert torch.isfinite(out).all(), arguments
        out.sum().backward()
        assert torch.isfinite(q.grad).all() and torch.isfinite(v.grad).all()


@pytest.mark.parametrize("kind", ["full", "sliding", "strided", "fixed", "lsh", "efficient"])
def test_model_forward_bad_shapes_and_empty_inputs(kind):
    """The model forwards over the kinds built on `ops`: wrong shapes are refused, empty batches give empty outputs."""
    fields = dict(sliding_window=2, strided_stride=2, fixed_block_size=4, fixed_num_summary=1, **KIND_OVERRIDES["lsh"])
    model = longattn.LongAttnModel(_small_config(kind, num_hidden_layers=1, **fields)).eval()
    ids = torch.ones(2, 8, dtype=torch.long)
    with pytest.raises(ValueError, match="attention_mask"):
        model(input_ids=ids, attention_mask=torch.ones(2, 7, dtype=torch.long))
    with pytest.raises(ValueError, match="input_ids"):
        model(input_ids=ids[0])
    for empty in (ids[:0], ids[:, :0]):
        assert model(input_ids=empty).last_hidden_state.shape == (*empty.shape, 16)


# ---------------------------------------------------------------------------------------------- model forwards
HEADS = [
    longattn.LongAttnModel,
    longattn.LongAttnForMaskedLM,
    longattn.LongAttnForSequenceClassification,
    longattn.LongAttnForTokenClassification,
    longattn.LongAttnForQuestionAnswering,
    longattn.LongAttnForCausalLM,
    longattn.LongAttnForSeq2SeqLM,
]


@functools.lru_cache(maxsize=None)
def _tiny_models(kind: str, **config_overrides) -> tuple:
    """One tiny model per head class for `kind` (heads whose decoder the kind cannot be are left out); built once,
    shared by the tests (they run the models in eval mode and change no weight)."""
    models = []
    for head in HEADS:
        config = _small_config(kind, num_hidden_layers=2, **KIND_OVERRIDES.get(kind, {}), **config_overrides)
        try:
            models.append(head(config).eval())
        except ValueError:  # e.g. Linformer or reduction as a causal decoder: refused by the config, by design
            assert head is longattn.LongAttnForCausalLM
    return tuple(models)


def _label_arguments(model, b: int, n: int) -> dict:
    """Labels of a wrong shape for `model`'s head (one token or one class too many), by argument name."""
    wrong = torch.zeros(b, n + 1, dtype=torch.long)
    if isinstance(model, longattn.LongAttnForSequenceClassification):
        return {"labels": torch.zeros(b, 3, dtype=torch.long)}
    if isinstance(model, longattn.LongAttnForQuestionAnswering):
        return {"start_positions": wrong, "end_positions": torch.zeros(b, dtype=torch.long)}
    if isinstance(model, longattn.LongAttnModel):
        return {}
    return {"labels": wrong}


def _bad_model_inputs(model, b: int = 2, n: int = 8) -> list[tuple[str, dict]]:
    """(argument the message must name, keyword arguments) for `model`'s forward; none of these was a ValueError
    naming its argument before (float ids, out-of-range ids, wrong embeddings, masks that are not tensors or on
    another device, positions of the wrong shape or dtype, labels of the wrong shape, missing decoder inputs)."""
    ids = torch.randint(0, VOCAB, (b, n), generator=torch.Generator().manual_seed(5))
    mask = torch.ones(b, n, dtype=torch.long)
    seq2seq = isinstance(model, longattn.LongAttnForSeq2SeqLM) or model.config.is_encoder_decoder
    decoder = {"decoder_input_ids": ids[:, :5]} if seq2seq else {}
    cases = [
        ("input_ids", {"input_ids": ids.float()}),
        ("input_ids", {"input_ids": ids.masked_fill(ids == ids[0, 0], VOCAB)}),  # == vocab_size
        ("input_ids", {"input_ids": ids.masked_fill(ids == ids[0, 0], -1)}),
        ("inputs_embeds", {"inputs_embeds": torch.randn(b, n, HIDDEN + 1)}),
        ("inputs_embeds", {"inputs_embeds": torch.ones(b, n, HIDDEN, dtype=torch.long)}),
        ("inputs_embeds", {"inputs_embeds": torch.randn(b, n, HIDDEN, dtype=torch.float64)}),
        ("attention_mask", {"input_ids": ids, "attention_mask": mask.tolist()}),
        ("attention_mask", {"input_ids": ids, "attention_mask": mask.to("meta")}),
        ("global_attention_mask", {"input_ids": ids, "global_attention_mask": mask.tolist()}),
    ]
    if not isinstance(model, longattn.LongAttnForSeq2SeqLM):  # the seq2seq head takes no position_ids
        cases += [
            ("position_ids", {"input_ids": ids, "position_ids": torch.arange(n - 1).expand(b, n - 1)}),
            ("position_ids", {"input_ids": ids, "position_ids": torch.arange(n).expand(b, n).float()}),
            ("position_ids", {"input_ids": ids, "position_ids": torch.arange(n).expand(b, n).tolist()}),
        ]
    cases = [(name, {**decoder, **arguments}) for name, arguments in cases]
    if seq2seq:
        cases += [
            # neither decoder inputs nor labels nor input_ids to shift right (BART's contract)
            ("decoder_input_ids", {"inputs_embeds": torch.randn(b, n, HIDDEN)}),
            ("decoder_input_ids", {"input_ids": ids, "decoder_input_ids": ids[:, :5].float()}),
            ("decoder_input_ids", {"input_ids": ids, "decoder_input_ids": ids[:, :5] + VOCAB}),
            ("decoder_inputs_embeds", {"input_ids": ids, "decoder_inputs_embeds": torch.randn(b, 5, HIDDEN - 1)}),
            ("decoder_attention_mask", {"input_ids": ids, **decoder, "decoder_attention_mask": mask[:, :5].tolist()}),
        ]
    for name, labels in _label_arguments(model, b, 5 if seq2seq else n).items():
        if labels.shape[-1] != b or name != "end_positions":
            cases.append((name, {"input_ids": ids, **decoder, name: labels}))
    return cases


@pytest.mark.parametrize("kind", longattn.available_attention_types())
def test_model_forward_bad_input_names_the_argument(kind):
    """Every kind, every head: bad token ids, embeddings, positions, masks, labels and decoder inputs are refused
    with a ValueError naming the argument (before: RuntimeError, IndexError, AttributeError or silent acceptance)."""
    for model in _tiny_models(kind):
        for argument, arguments in _bad_model_inputs(model):
            with pytest.raises(ValueError) as raised:
                model(**arguments)
            message = str(raised.value)
            assert _name_in(argument, message), (kind, type(model).__name__, argument, message)
        # Out-of-range ids: the message gives the offending value and the vocabulary size.
        with pytest.raises(ValueError, match=rf"`input_ids` holds {VOCAB + 3}: .*vocab_size={VOCAB}"):
            model(
                input_ids=torch.full((1, 4), VOCAB + 3),
                **(
                    {"decoder_input_ids": torch.ones(1, 2, dtype=torch.long)} if model.config.is_encoder_decoder else {}
                ),
            )
        # A sequence longer than the limit: the message gives the length and the limit.
        with pytest.raises(
            ValueError,
            match=rf"length {MAX_POSITIONS + 1} exceeds `max_position_embeddings`="
            rf"{MAX_POSITIONS}",
        ):
            model(
                input_ids=torch.ones(1, MAX_POSITIONS + 1, dtype=torch.long),
                **(
                    {"decoder_input_ids": torch.ones(1, 2, dtype=torch.long)} if model.config.is_encoder_decoder else {}
                ),
            )


def test_every_head_reads_the_token_ids_once_per_forward(monkeypatch):
    """The range check of the ids is one host sync (`torch.aminmax`): a head that reads the shapes first (sequence
    classification, for its default global token) must not check the values a second time."""
    calls = []
    aminmax = torch.aminmax
    monkeypatch.setattr(torch, "aminmax", lambda tensor: calls.append(tensor.shape) or aminmax(tensor))
    for model in _tiny_models("full"):
        calls.clear()
        decoder = {"decoder_input_ids": torch.ones(1, 2, dtype=torch.long)} if model.config.is_encoder_decoder else {}
        model(input_ids=torch.ones(1, 4, dtype=torch.long), **decoder)
        assert len(calls) == 1 + bool(decoder), (type(model).__name__, calls)


def test_learned_positions_out_of_range_are_refused():
    """With learned absolute positions `position_ids` index a table: values outside it are a ValueError, not an
    IndexError."""
    model = _tiny_models("full", position_embedding_type="learned")[0]
    ids = torch.ones(1, 4, dtype=torch.long)
    for positions in (torch.tensor([[0, 1, 2, MAX_POSITIONS]]), torch.tensor([[-1, 0, 1, 2]])):
        with pytest.raises(ValueError, match=rf"`position_ids` holds .*max_position_embeddings={MAX_POSITIONS}"):
            model(input_ids=ids, position_ids=positions)


def _main_output(model, outputs) -> torch.Tensor:
    if isinstance(model, longattn.LongAttnForQuestionAnswering):
        return outputs.start_logits
    return outputs.last_hidden_state if isinstance(model, longattn.LongAttnModel) else outputs.logits


@pytest.mark.parametrize("kind", longattn.available_attention_types())
def test_model_forward_empty_batch_or_length_gives_empty_outputs(kind):
    """Batch 0 or length 0 through every head: outputs of the right shape, no NaN (before: 6 kinds crashed)."""
    for model in _tiny_models(kind):
        config = model.config
        for b, n in ((0, 8), (2, 0)):
            arguments = {"input_ids": torch.ones(b, n, dtype=torch.long)}
            if config.is_encoder_decoder:
                arguments["decoder_input_ids"] = torch.ones(b, 3, dtype=torch.long)
            if isinstance(model, longattn.LongAttnForSequenceClassification) and n == 0:
                with pytest.raises(ValueError, match="input_ids"):  # no first token to classify from
                    model(**arguments)
                continue
            out = _main_output(model, model(**arguments))
            expected = {
                longattn.LongAttnModel: (b, 3 if config.is_encoder_decoder else n, HIDDEN),
                longattn.LongAttnForMaskedLM: (b, n, VOCAB),
                longattn.LongAttnForSequenceClassification: (b, config.num_labels),
                longattn.LongAttnForTokenClassification: (b, n, config.num_labels),
                longattn.LongAttnForQuestionAnswering: (b, n),
                longattn.LongAttnForCausalLM: (b, n, VOCAB),
                longattn.LongAttnForSeq2SeqLM: (b, 3, VOCAB),
            }[type(model)]
            assert out.shape == expected, (kind, type(model).__name__, b, n)
            assert not out.isnan().any(), (kind, type(model).__name__, b, n)


def _kind_functions(h: int = H, d: int = D) -> dict:
    """The public functions of the content-based and reduced kinds that take a `key_padding_mask`, called on q, k, v."""
    from longattn.attention_adaptive_span import adaptive_span_attention, adaptive_span_reference
    from longattn.attention_reduction import pack_groups
    from longattn.attention_routing import cluster_statistics, routing_attention, routing_attention_dense
    from longattn.attention_sinkhorn import sinkhorn_attention, sinkhorn_attention_dense

    centroids = torch.nn.functional.normalize(torch.randn(h, 2, d, generator=torch.Generator().manual_seed(7)), dim=-1)
    routing = {"centroids": centroids, "causal": False, "causal_window": 4}
    sinkhorn = {"sort_weight": torch.eye(d), "block_size": 2, "iterations": 2, "temperature": 0.75}
    span = {"span": torch.full((h,), 3.0), "max_span": 4, "ramp": 2, "causal": False}
    return {
        "routing_attention": lambda q, k, v, mask: routing_attention(q, k, v, key_padding_mask=mask, **routing),
        "routing_attention_dense": lambda q, k, v, mask: routing_attention_dense(
            q, k, v, key_padding_mask=mask, **routing
        )[0],
        "cluster_statistics": lambda q, k, v, mask: cluster_statistics(
            q, k, centroids, causal=False, key_padding_mask=mask
        ),
        "sinkhorn_attention": lambda q, k, v, mask: sinkhorn_attention(q, k, v, key_padding_mask=mask, **sinkhorn),
        "sinkhorn_attention_dense": lambda q, k, v, mask: sinkhorn_attention_dense(
            q, k, v, key_padding_mask=mask, **sinkhorn
        )[0],
        "adaptive_span_attention": lambda q, k, v, mask: adaptive_span_attention(
            q, k, v, key_padding_mask=mask, **span
        ),
        "adaptive_span_reference": lambda q, k, v, mask: adaptive_span_reference(
            q, k, v, key_padding_mask=mask, **span
        )[0],
        "pack_groups": lambda q, k, v, mask: pack_groups(q.transpose(1, 2), mask, 2)[0],
    }


@pytest.mark.parametrize("function", list(_kind_functions()))
def test_kind_functions_refuse_non_bool_masks_and_take_empty_inputs(function):
    """The kinds' own functions used to call `.bool()` on their masks, reading an additive float mask (0 keep,
    -inf drop) inverted; they now refuse non-bool masks as the ops do. Batch or length 0 gives empty outputs."""
    call = _kind_functions()[function]
    q, k, v = _tensors(torch.Generator().manual_seed(8))
    keep = torch.ones(B, N, dtype=torch.bool)
    keep[0, :2] = False
    for mask in (
        torch.zeros(B, N).masked_fill(~keep, -math.inf),
        keep.float(),
        keep.long(),
        keep[:, :-1],
        keep.to("meta"),
    ):
        with pytest.raises(ValueError, match=r"\bkey_padding_mask\b"):
            call(q, k, v, mask)
    assert call(q, k, v, keep) is not None
    for b, n in ((0, N), (B, 0)):
        q, k, v = _tensors(torch.Generator().manual_seed(9), b=b, n_q=n, n_k=n)
        out = call(q, k, v, torch.ones(b, n, dtype=torch.bool))
        if function == "cluster_statistics":  # (sums, counts) of no member
            assert out[0].shape == (H, 2, D) and not out[0].any() and not out[1].any()
        elif function == "pack_groups":  # [b, groups, ratio, h, d]
            assert out.shape == (b, -(-n // 2), 2, H, D)
        else:
            assert out.shape == (b, H, n, D)


def test_seq2seq_decoder_longer_than_its_encoder_input():
    """Cross-attention has more queries than keys when the target is longer than the source (it used to be refused
    as if queries had to be the last keys)."""
    model = _tiny_models("full")[-1]
    assert isinstance(model, longattn.LongAttnForSeq2SeqLM)
    logits = model(
        input_ids=torch.ones(2, 4, dtype=torch.long),
        decoder_input_ids=torch.ones(2, 9, dtype=torch.long),
        attention_mask=torch.tensor([[1, 1, 1, 1], [0, 1, 1, 1]]),
    ).logits
    assert logits.shape == (2, 9, VOCAB) and torch.isfinite(logits).all()


# ---------------------------------------------------------------------------------------------- command lines
REPO = Path(__file__).resolve().parents[1]
SHIPPED_CODE = [*sorted((REPO / "longattn").rglob("*.py")), *sorted((REPO / "recipes").glob("*.py"))]
SHIPPED_CODE += sorted((REPO / "scripts").glob("*.py"))
FAKE_SECRET = "hf_SecretThatMustNeverBeWritten42"
RECIPES = ("mlm", "classification", "clm", "seq2seq")


def test_every_parser_the_project_ships_takes_no_abbreviation():
    """argparse accepts any unambiguous prefix of a flag (`--hub_tok` for `--hub_token`); every parser of the
    recipes, the `longattn-*` commands and the scripts turns that off (`CommandLineParser` does, and refuses to
    turn it on)."""
    unguarded = []
    for path in SHIPPED_CODE:
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, ast.Call):
                continue
            name = getattr(node.func, "attr", getattr(node.func, "id", None))
            if name != "ArgumentParser":
                continue
            keywords = {k.arg: k.value for k in node.keywords}
            value = keywords.get("allow_abbrev")
            if not (isinstance(value, ast.Constant) and value.value is False):
                unguarded.append(f"{path.relative_to(REPO)}:{node.lineno}")
    assert not unguarded, unguarded
    for parser in (data.build_parser(), CommandLineParser()):
        assert parser.allow_abbrev is False
    with pytest.raises(ValueError, match="allow_abbrev"):
        CommandLineParser(allow_abbrev=True)


def _recipe_parser(recipe: str, monkeypatch) -> argparse.ArgumentParser:
    """The parser `recipes/run_<recipe>.py` builds (caught at its `training.parse_args` call)."""

    class Caught(Exception):
        pass

    def catch(parser, argv=None):
        raise Caught(parser)

    module = load_script(f"recipes/run_{recipe}.py", f"recipe_{recipe}")
    with monkeypatch.context() as patch:
        patch.setattr(training, "parse_args", catch)
        with pytest.raises(Caught) as caught:
            module.main([])
    return caught.value.args[0]


def _secret_options(parser: argparse.ArgumentParser) -> list[str]:
    return [
        flag
        for action in parser._actions
        for flag in action.option_strings
        if flag.startswith("--") and (is_secret_flag(action.dest) or is_secret_flag(flag))
    ]


def _no_secret_under(folder: Path) -> None:
    for path in folder.rglob("*") if folder.exists() else []:
        if path.is_file():
            assert FAKE_SECRET.encode() not in path.read_bytes(), path


@pytest.mark.parametrize("recipe", RECIPES)
def test_recipe_secret_flags_only_as_spelled_and_never_recorded(recipe, tmp_path, monkeypatch, capsys):
    """Every prefix of every secret-bearing option, in both `--flag value` and `--flag=value` forms, stops the
    recipe with a usage error that does not repeat the value, and writes nothing; the full spelling is recorded
    redacted. The output folder is searched byte by byte."""
    train_file = tmp_path / "train.jsonl"
    train_file.write_text(json.dumps({"text": "a b c", "label": 0, "source": "a", "target": "b"}) + "\n")
    output_dir = tmp_path / "out"
    base = [
        "--train_file",
        str(train_file),
        "--output_dir",
        str(output_dir),
        "--config_overrides",
        "hidden_size=32,num_hidden_layers=1,num_attention_heads=2,intermediate_size=64,sliding_window=4",
        "--max_train_steps",
        "1",
    ]
    parser = _recipe_parser(recipe, monkeypatch)
    options = _secret_options(parser)
    assert "--hub_token" in options
    args = training.parse_args(parser, [*base, "--hub_token", FAKE_SECRET])
    assert args.hub_token == FAKE_SECRET and FAKE_SECRET not in args.command
    module = load_script(f"recipes/run_{recipe}.py", f"recipe_{recipe}")
    for option in options:
        for end in range(3, len(option)):
            for form in ([f"{option[:end]}={FAKE_SECRET}"], [option[:end], FAKE_SECRET]):
                with pytest.raises(SystemExit) as exit_info:
                    training.run_recipe(module.main, [*base, *form])
                assert exit_info.value.code == 2, form
                printed = capsys.readouterr()
                assert FAKE_SECRET not in printed.out + printed.err, form
                _no_secret_under(output_dir)


def test_recipe_redacts_a_secret_destination_whatever_its_flag(tmp_path):
    """Redaction by the parsed destination: a secret set through a flag whose spelling does not look secret."""
    train_file = tmp_path / "train.jsonl"
    train_file.write_text(json.dumps({"text": "a"}) + "\n")
    parser = training.recipe_parser(None, task="mlm")
    parser.add_argument("--hf-auth", dest="hub_auth_token")
    argv = ["--train_file", str(train_file), "--output_dir", str(tmp_path / "out"), f"--hf-auth={FAKE_SECRET}"]
    args = training.parse_args(parser, argv)
    assert args.hub_auth_token == FAKE_SECRET
    assert FAKE_SECRET not in args.command and "--hf-auth=REDACTED" in args.command
    assert FAKE_SECRET not in json.dumps(training.recorded_args(args))


def test_longattn_hub_secret_flag_only_as_spelled(tmp_path, capsys):
    """`longattn-hub push --token`: a prefix is a usage error that does not repeat the value."""
    for form in (["--tok", FAKE_SECRET], [f"--to={FAKE_SECRET}"], ["--t", FAKE_SECRET]):
        with pytest.raises(SystemExit) as exit_info:
            hub.main(["push", str(tmp_path), "someone/model", *form])
        assert exit_info.value.code == 2, form
        printed = capsys.readouterr()
        assert FAKE_SECRET not in printed.out + printed.err, form


# ---------------------------------------------------------------------------------------------- stock models
def _stock_bert(attention_type: str):
    from transformers import BertConfig, BertModel

    config = BertConfig(**{**SIZES, "num_attention_heads": 4, "vocab_size": VOCAB, "max_position_embeddings": 64})
    return longattn.apply_longattn(BertModel(config), attention_type=attention_type, sliding_window=2).eval()


def _bad_global_masks(b: int, n: int) -> list:
    ones = torch.ones(b, n)
    return [
        torch.ones(b, n - 3, dtype=torch.bool),  # another length
        torch.ones(b, n + 2, dtype=torch.bool),
        torch.ones(b + 1, n, dtype=torch.bool),  # another batch
        torch.ones(n, dtype=torch.bool),  # no batch dimension
        torch.tensor(1),  # 0-d
        torch.ones(b, 1, n, n, dtype=torch.bool),  # 4-D
        "all",  # not a tensor
        [[1] * n] * b,
        ones * 0.5,  # a float mask of values other than 0 / 1
        ones.masked_fill(ones.bool(), float("nan")),
    ]


@pytest.mark.parametrize("attention_type", ["sliding", "full"])
def test_stock_model_global_attention_mask_checked_as_longattn_models_check_it(attention_type):
    """A stock model running longattn's kinds checks `global_attention_mask` with the check `LongAttnModel` makes
    (`ops_checks.check_input_mask`): `ValueError` naming the argument and its expected shape, both models alike."""
    b, n = 2, 9
    stock = _stock_bert(attention_type)
    own = _tiny_models(attention_type)[0]
    input_ids = torch.ones(b, n, dtype=torch.long)
    for mask in _bad_global_masks(b, n):
        messages = []
        for model in (stock, own):
            with pytest.raises(ValueError, match=r"`global_attention_mask`") as error:
                model(input_ids=input_ids, global_attention_mask=mask)
            messages.append(str(error.value))
        if (
            isinstance(mask, torch.Tensor)
            and mask.dim() != 2
            or isinstance(mask, torch.Tensor)
            and mask.shape != (b, n)
        ):
            assert all(f"[{b}, {n}]" in message for message in messages), messages
        assert messages[0] == messages[1], messages
    good = torch.zeros(b, n, dtype=torch.long)
    good[:, 0] = 1
    assert stock(input_ids=input_ids, global_attention_mask=good).last_hidden_state.isfinite().all()


# ---------------------------------------------------------------------------------------------- config and labels
@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("num_attention_heads", 0),
        ("hidden_size", "32"),
        ("num_attention_heads", "2"),
        ("vocab_size", "64"),
        ("intermediate_size", "64"),
        ("num_hidden_layers", "2"),
        ("pad_token_id", "0"),
        ("eos_token_id", ["2"]),
    ],
)
def test_config_fields_get_longattns_own_value_error(field, value):
    """Checked before transformers' own validators (which divide by the head count and compare token ids with the
    vocabulary): the message names the field, the value and what is allowed."""
    with pytest.raises(ValueError, match=rf"`{field}`={re.escape(repr(value))} is invalid: expected"):
        longattn.LongAttnConfig(**{"hidden_size": 32, "num_attention_heads": 2, field: value})


@pytest.mark.parametrize("kind", ["full", "sliding"])
def test_labels_out_of_range_are_refused_naming_the_limit(kind):
    """Class ids outside [0, num_labels) (token ids outside [0, vocab_size) for the LM heads) raise `ValueError`,
    not an `IndexError` deep in the loss; -100 stays the ignored label."""
    b, n = 2, 6
    input_ids = torch.ones(b, n, dtype=torch.long)
    for model in _tiny_models(kind):
        if isinstance(model, longattn.LongAttnForSequenceClassification):
            limit, shape, what = model.config.num_labels, (b,), "num_labels"
        elif isinstance(model, longattn.LongAttnForTokenClassification):
            limit, shape, what = model.config.num_labels, (b, n), "num_labels"
        elif isinstance(model, (longattn.LongAttnForMaskedLM, longattn.LongAttnForCausalLM)):
            limit, shape, what = VOCAB, (b, n), "vocab_size"
        elif isinstance(model, longattn.LongAttnForSeq2SeqLM):
            limit, shape, what = VOCAB, (b, n), "vocab_size"
        else:
            continue
        for bad in (limit, -1, 10**6):
            labels = torch.zeros(shape, dtype=torch.long)
            labels.view(-1)[-1] = bad
            with pytest.raises(
                ValueError, match=rf"`labels` holds {bad}: expected class ids in \[0, {limit}\) \({what}"
            ):
                model(input_ids=input_ids, labels=labels)
        labels = torch.full(shape, -100, dtype=torch.long)
        labels.view(-1)[-1] = limit - 1  # the last position: the one a causal LM predicts too
        assert torch.isfinite(model(input_ids=input_ids, labels=labels).loss)


# ---------------------------------------------------------------------------------------------- ops: d_v, padding
PATTERN_OPS = {
    "full": lambda q, k, v, **a: ops.full_attention(q, k, v, **a),
    "sliding": lambda q, k, v, **a: ops.sliding_window_attention(q, k, v, window=2, **a),
    "sliding_global": lambda q, k, v, **a: ops.sliding_window_attention(
        q, k, v, window=2, global_mask=torch.arange(k.shape[2]).expand(k.shape[0], -1) == 3, **a
    ),
    "dilated": lambda q, k, v, **a: ops.sliding_window_attention(q, k, v, window=2, dilation=2, **a),
    "strided": lambda q, k, v, **a: ops.strided_attention(q, k, v, stride=3, **a),
    "fixed": lambda q, k, v, **a: ops.fixed_attention(q, k, v, block_size=4, num_summary=1, **a),
    "efficient": lambda q, k, v, **a: ops.efficient_attention(q, k, v, **a),
    # shared-QK: the keys are the queries
    "lsh": lambda q, k, v, **a: ops.lsh_attention(k, v, num_hashes=2, bucket_size=4, seed=0, **a),
}


def _padded_inputs(d_v: int, n: int = 11):
    generator = torch.Generator().manual_seed(5)
    q, k = torch.randn(2, H, n, D, generator=generator), torch.randn(2, H, n, D, generator=generator)
    v = torch.randn(2, H, n, d_v, generator=generator)
    padding = torch.ones(2, n, dtype=torch.bool)
    padding[0, -3:] = False  # right padding
    padding[1, :2] = False  # left padding
    return q, k, v, padding


@pytest.mark.parametrize("backend", ["torch", "reference"])
@pytest.mark.parametrize("d_v", [D, 3, D + 3])
@pytest.mark.parametrize("op", list(PATTERN_OPS))
def test_ops_take_any_value_width_and_padding_that_holds_anything(op, d_v, backend):
    """Every op, every back end on CPU: values of another width than q and k give `[b, h, n, d_v]` equal to the
    reference; NaN / inf written into padded keys and values change no real output; a fully padded row gives
    zeros (the one rule: a query that sees no key returns 0)."""
    run = PATTERN_OPS[op]
    q, k, v, padding = _padded_inputs(d_v)
    clean = run(q, k, v, key_padding_mask=padding, backend=backend)
    assert clean.shape == (2, H, 11, d_v)
    torch.testing.assert_close(clean, run(q, k, v, key_padding_mask=padding, backend="reference"))
    padded = ~padding[:, None, :, None]
    dirty_k = k.masked_fill(padded, float("nan"))
    dirty_v = v.masked_fill(padded, float("inf"))
    dirty = run(q, dirty_k, dirty_v, key_padding_mask=padding, backend=backend)
    real = padding[:, None, :, None].expand_as(dirty)
    torch.testing.assert_close(dirty[real], clean[real])
    none_real = padding.clone()
    none_real[0] = False
    out = run(q, dirty_k, dirty_v, key_padding_mask=none_real, backend=backend)
    assert torch.equal(out[0], torch.zeros_like(out[0])), out[0]


def test_lsh_sizes_beyond_the_sequence_are_clamped_not_allocated():
    """A bucket size or chunk neighbourhood far beyond an 11-token input runs at once (nothing is allocated by the
    configured size) and equals the sizes the sequence needs."""
    q, _, v, padding = _padded_inputs(D)
    common = dict(num_hashes=2, num_buckets=4, seed=0, key_padding_mask=padding, backend="torch")
    needed = ops.lsh_attention(q, v, bucket_size=11, num_chunks_before=0, num_chunks_after=0, **common)
    huge = ops.lsh_attention(q, v, bucket_size=2**40, num_chunks_before=2**40, num_chunks_after=2**40, **common)
    torch.testing.assert_close(huge, needed)
    chunks = ops.lsh_attention(q, v, bucket_size=4, num_chunks_before=2, num_chunks_after=2, **common)
    torch.testing.assert_close(
        ops.lsh_attention(q, v, bucket_size=4, num_chunks_before=2**40, num_chunks_after=2**40, **common), chunks
    )


# ---------------------------------------------------------------------------------- sizes beyond the sequence
HUGE = 2**20
# kind -> (fields: a size far beyond an 11-token input, fields: the size the input needs). Both run the same
# attention; the first must neither allocate nor loop by its size. Sizes that shape a parameter or buffer are at
# most `max_position_embeddings` (128 in the tiny configs) and are refused above it (see the next test).
CLAMPED_SIZES = {
    "routing": (
        {"routing_causal_window": HUGE, "routing_local_window": HUGE, "is_decoder": True},
        {"routing_causal_window": 11, "routing_local_window": 10, "is_decoder": True},
    ),
    "sinkhorn": ({"sinkhorn_block_size": HUGE}, {"sinkhorn_block_size": 11}),
    "binary_partition": ({"binary_partition_context": 128}, {"binary_partition_context": 10}),
    "reduction": ({"reduction_ratio": 128}, {"reduction_ratio": 11}),
    "lsh": (
        {"lsh_bucket_size": HUGE, "lsh_num_chunks_before": HUGE, "lsh_num_chunks_after": HUGE},
        {"lsh_bucket_size": 11, "lsh_num_chunks_before": 0, "lsh_num_chunks_after": 0},
    ),
    "sliding": (
        {"sliding_window": HUGE, "sliding_dilation": [HUGE, 2]},
        {"sliding_window": 10, "sliding_dilation": [11, 2]},
    ),
    "strided": ({"strided_stride": HUGE}, {"strided_stride": 11}),
    "fixed": ({"fixed_block_size": HUGE, "fixed_num_summary": 1}, {"fixed_block_size": 11, "fixed_num_summary": 1}),
}


@pytest.mark.parametrize("kind", list(CLAMPED_SIZES))
def test_sizes_beyond_the_sequence_are_clamped_through_the_model(kind):
    """A window, block, context or group far beyond an 11-token input runs at once and gives what the size the input
    needs gives (parameters shaped by the size: their leading part, all that an 11-token input reads)."""
    import time

    from kind_configs import kind_config, random_ids

    huge_fields, needed_fields = CLAMPED_SIZES[kind]
    common = {"lsh_num_buckets": 4} if kind == "lsh" else {}
    torch.manual_seed(0)
    huge = longattn.LongAttnModel(kind_config(kind, **common, **huge_fields)).eval()
    for parameter in huge.parameters():  # zero-initialised parameters (BP's edge bias) must count too
        torch.nn.init.normal_(parameter, std=0.2)
    needed = longattn.LongAttnModel(kind_config(kind, **common, **needed_fields)).eval()
    state = huge.state_dict()
    needed.load_state_dict(
        {
            name: state[name][tuple(slice(0, size) for size in value.shape)]
            for name, value in needed.state_dict().items()
        }
    )
    ids, mask = random_ids(2, 11), torch.ones(2, 11, dtype=torch.long)
    mask[0, -3:] = 0
    with torch.no_grad():
        start = time.perf_counter()
        out = huge(ids, attention_mask=mask).last_hidden_state
        elapsed = time.perf_counter() - start
        expected = needed(ids, attention_mask=mask).last_hidden_state
    assert elapsed < 10.0, elapsed  # seconds to hours (or out of memory) when allocated by the size
    real = mask.bool()
    torch.testing.assert_close(out[real], expected[real], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(
    ("kind", "field", "allowed"),
    [
        ("routing", "routing_num_clusters", "[1, 128]"),
        ("reduction", "reduction_ratio", "[1, 128]"),
        ("binary_partition", "binary_partition_context", "[1, 128]"),
        ("lsh", "lsh_num_buckets", "[2, 256]"),
        ("linformer", "linformer_proj_len", "[1, 128]"),
        ("synthesizer", "synthesizer_factor_k", "[1, 128]"),
        ("deformable", "deformable_points", "[1, 128]"),
        ("deformable", "deformable_levels", "[1, 8]"),
        ("full", "relative_max_distance", "[1, 128]"),
    ],
)
def test_sizes_that_shape_parameters_are_bounded_at_config_time(kind, field, allowed):
    """A size that shapes a parameter or buffer is allocated at construction whatever the input: beyond what the
    longest sequence can use it is refused when the config is built, naming the field, the value and the range."""
    from kind_configs import kind_config

    extra = {"relative_position_logits": True} if field == "relative_max_distance" else {}
    with pytest.raises(ValueError, match=rf"`{field}`={HUGE} is invalid .*expected integers in {re.escape(allowed)}"):
        kind_config(kind, **extra, **{field: HUGE})
    kind_config(kind, **extra, **{field: int(allowed[1:-1].split(", ")[1])})  # the bound itself is allowed


def test_batches_are_not_padded_past_the_length_limit():
    """A block beyond `max_position_embeddings` is clamped by the executors: batches are not padded to it."""
    from kind_configs import kind_config

    assert training.length_multiple(kind_config("sinkhorn", sinkhorn_block_size=HUGE)) == 1
    assert training.length_multiple(kind_config("sinkhorn", sinkhorn_block_size=4)) == 4


@pytest.mark.parametrize(
    ("argument", "bad"),
    [
        ("ramp", 0),
        ("ramp", 2.5),
        ("max_span", -1),
        ("block_size", 0),
        ("span", torch.full((H + 1,), 3.0)),
        ("span", torch.full((H,), 3, dtype=torch.long)),
        ("span", torch.tensor([3.0, math.nan])),
        ("span", torch.tensor([3.0, math.inf])),
        ("span", [3.0, 3.0]),
        ("causal", "no"),
        ("dropout_p", 1.5),
        ("scale", math.nan),
    ],
)
@pytest.mark.parametrize("dense", [False, True])
def test_adaptive_span_attention_validates_its_arguments(argument, bad, dense):
    """The kind's exported function refuses bad span settings with a ValueError naming the argument (they used to
    run into NaN outputs or errors deep inside)."""
    from longattn.attention_adaptive_span import adaptive_span_attention

    q, k, v = _tensors(torch.Generator().manual_seed(3))
    arguments = {"span": torch.full((H,), 3.0), "max_span": 4, "ramp": 2, "causal": False, "dense": dense}
    with pytest.raises(ValueError, match=rf"\b{argument}\b"):
        adaptive_span_attention(q, k, v, **{**arguments, argument: bad})
    out = adaptive_span_attention(q, k, v, **arguments)
    assert torch.isfinite(out[0] if dense else out).all()


@pytest.mark.parametrize(
    "argument, bad",
    [
        ("q", torch.zeros(B, H, N, D, dtype=torch.long)),
        ("k", torch.zeros(B, H + 1, N, D)),
        ("context", 0),
        ("context", 2.0),
        ("causal", "no"),
        ("key_padding_mask", torch.ones(B, N + 1, dtype=torch.bool)),
        ("key_padding_mask", torch.ones(B, N)),
        ("relative_bias", torch.zeros(H, 3)),
        ("relative_bias", torch.zeros(H + 1, 1 + 2 * 32 * 3)),
        ("relative_bias", torch.zeros(H, 1 + 2 * 32 * 3, dtype=torch.long)),
        ("scale", math.inf),
        ("dropout_p", -0.1),
    ],
)
@pytest.mark.parametrize("dense", [False, True])
def test_binary_partition_attention_validates_its_arguments(argument, bad, dense):
    """The kind's exported function names the bad argument (a wrong bias shape used to fail in an index, a float
    context deep in the layout)."""
    from longattn.attention_binary_partition import binary_partition_attention, num_edge_types

    q, k, v = _tensors(torch.Generator().manual_seed(4))
    arguments = {
        "q": q, "k": k, "v": v, "context": 2, "causal": False, "key_padding_mask": None,
        "relative_bias": torch.zeros(H, num_edge_types(2)), "scale": 0.5, "dense": dense,
    }  # fmt: skip
    with pytest.raises(ValueError, match=rf"\b{argument}\b"):
        binary_partition_attention(**{**arguments, argument: bad})
    out = binary_partition_attention(**arguments)
    assert torch.isfinite(out[0] if dense else out).all()


@pytest.mark.parametrize("argument, bad", [("x", torch.zeros(5)), ("ratio", 0), ("ratio", 2.5)])
def test_pack_groups_validates_its_arguments(argument, bad):
    from longattn.attention_reduction import pack_groups

    arguments = {"x": torch.zeros(2, 5, 3), "key_padding_mask": None, "ratio": 2}
    with pytest.raises(ValueError, match=rf"\b{argument}\b"):
        pack_groups(**{**arguments, argument: bad})
    assert pack_groups(**arguments)[0].shape == (2, 3, 2, 3)


@pytest.mark.parametrize(
    "argument, bad",
    [
        ("q", torch.zeros(B, H, N, D, dtype=torch.long)),
        ("centroids", torch.zeros(H + 1, 2, D)),
        ("centroids", torch.zeros(H, 2, D + 1)),
        ("centroids", torch.zeros(H, 2, D, dtype=torch.long)),
        ("causal", "no"),
        ("causal_window", 0),
        ("scale", math.nan),
        ("dropout_p", 1.0),
    ],
)
@pytest.mark.parametrize("dense", [False, True])
def test_routing_attention_validates_its_arguments(argument, bad, dense):
    """Routing's exported function names the bad argument (a wrong centroid shape used to fail inside a matmul)."""
    from longattn.attention_routing import routing_attention

    q, k, v = _tensors(torch.Generator().manual_seed(5))
    centroids = torch.nn.functional.normalize(torch.randn(H, 2, D, generator=torch.Generator().manual_seed(7)), dim=-1)
    arguments = {"q": q, "k": k, "v": v, "centroids": centroids, "causal": False, "causal_window": 4, "dense": dense}
    with pytest.raises(ValueError, match=rf"\b{argument}\b"):
        routing_attention(**{**arguments, argument: bad})
    out = routing_attention(**arguments)
    assert torch.isfinite(out[0] if dense else out).all()


@pytest.mark.parametrize(
    "argument, bad",
    [
        ("k", torch.zeros(B, H, N, D + 1)),
        ("block_size", 0),
        ("iterations", -1),
        ("temperature", 0.0),
        ("temperature", math.inf),
        ("sortcut", 0),
        ("noise", "yes"),
        ("scale", math.inf),
        ("dropout_p", -0.5),
    ],
)
def test_sinkhorn_attention_validates_its_arguments(argument, bad):
    """Sinkhorn's exported function names the bad argument (a zero temperature used to divide into NaN)."""
    from longattn.attention_sinkhorn import sinkhorn_attention

    q, k, v = _tensors(torch.Generator().manual_seed(6))
    arguments = {"q": q, "k": k, "v": v, "sort_weight": torch.eye(D), "block_size": 2, "iterations": 2,
                 "temperature": 0.75}  # fmt: skip
    with pytest.raises(ValueError, match=rf"\b{argument}\b"):
        sinkhorn_attention(**{**arguments, argument: bad})
    assert torch.isfinite(sinkhorn_attention(**arguments)).all()
