"""The `backend=` argument of `longattn.ops` beyond dense and sliding attention: strided, fixed, efficient and LSH.

Runs on CPU, in float64. Every back end of a pattern must equal the dense reference of the SAME predicate, outputs
and gradients; and every test also checks which executor ran (a spy on `longattn.ops`' executor names), so that a
`backend=` that was silently ignored fails rather than comparing the torch executor with itself. The xformers path
runs end to end with its kernel replaced by `executor_xformers.ReferenceKernel` (a dense implementation of the same
contract), on calls the dispatcher admits on CUDA.
"""

from __future__ import annotations

import re

import pytest
import torch
from attention_checks import (
    assert_all_close,
    dense_reference,
    outputs_and_grads,
    random_qkv,
    three_padded_rows,
    xformers_reasons,
)
from kind_configs import tiny_config

from longattn import backends, executor_families, ops, ops_linear, ops_lsh, patterns
from longattn.modeling_longattn import LongAttnModel

B, H, D = 3, 4, 8
SCALE = 0.3
TIGHT = dict(rtol=1e-10, atol=1e-10)

# Executor names as `longattn.ops` calls them, one per back end of the strided and fixed patterns.
EXECUTORS = {
    "reference": "reference_pattern_attention",
    "torch-strided": "strided_blocked_attention",
    "torch-fixed": "fixed_blocked_attention",
    "flex": "flex_pattern_attention",
    "xformers-strided": "xformers_strided_attention",
    "xformers-fixed": "xformers_fixed_attention",
}

# (kind, pattern arguments): strided at two strides, fixed with shared and per-head summary cells.
SPARSE = [
    ("strided", dict(stride=3)),
    ("strided", dict(stride=7)),
    ("fixed", dict(block_size=5, num_summary=2, summary_per_head=False)),
    ("fixed", dict(block_size=6, num_summary=2, summary_per_head=True)),
]
SPARSE_IDS = ["strided-3", "strided-7", "fixed-5-2", "fixed-6-2-per-head"]


def _qkv(n_q, n_k=None, *, requires_grad=True, seed=0):
    return random_qkv(B, H, n_q, D, n_k=n_k, seed=seed, requires_grad=requires_grad)


def _op(kind):
    return {"strided": ops.strided_attention, "fixed": ops.fixed_attention}[kind]


def _pattern(kind, *, causal, key_padding_mask, **arguments):
    make = {"strided": patterns.strided_pattern, "fixed": patterns.fixed_pattern}[kind]
    return make(causal=causal, key_padding_mask=key_padding_mask, **arguments)


def _spy(monkeypatch, targets) -> list[str]:
    """Record the name of each `(module, name)` function in `targets` when it runs, in order."""
    ran = []
    for module, name in targets:
        original = getattr(module, name)

        def spy(*args, _name=name, _original=original, **kwargs):
            ran.append(_name)
            return _original(*args, **kwargs)

        monkeypatch.setattr(module, name, spy)
    return ran


@pytest.fixture
def executed(monkeypatch):
    """The names (values of `EXECUTORS`) of the executors the ops' dispatch ran (`longattn.executor_families`), in
    order; clear it before a call."""
    return _spy(monkeypatch, [(executor_families, name) for name in EXECUTORS.values()])


# ---------------------------------------------------------------------------------------------- strided and fixed
@pytest.mark.parametrize(("kind", "arguments"), SPARSE, ids=SPARSE_IDS)
@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
@pytest.mark.parametrize(("n_q", "n_k"), [(37, 37), (101, 101), (5, 37)], ids=["37", "101", "decode-5-of-37"])
def test_reference_and_torch_back_ends_agree(executed, kind, arguments, causal, n_q, n_k):
    q, k, v = _qkv(n_q, n_k)
    call = dict(causal=causal, key_padding_mask=three_padded_rows(n_k), scale=SCALE, **arguments)
    executed.clear()
    reference = outputs_and_grads(lambda q, k, v: _op(kind)(q, k, v, backend="reference", **call), q, k, v)
    assert executed == [EXECUTORS["reference"]]
    executed.clear()
    torch_path = outputs_and_grads(lambda q, k, v: _op(kind)(q, k, v, backend="torch", **call), q, k, v)
    assert executed == [EXECUTORS[f"torch-{kind}"]]
    assert_all_close(torch_path, reference, **TIGHT)
    # And both are the pattern itself: the reference back end is the dense softmax under the materialised predicate.
    expected = dense_reference(
        _pattern(kind, causal=causal, key_padding_mask=call["key_padding_mask"], **arguments), q, k, v, scale=SCALE
    )
    torch.testing.assert_close(reference[0], expected, **TIGHT)


@pytest.mark.parametrize(("kind", "arguments"), SPARSE, ids=SPARSE_IDS)
@pytest.mark.parametrize("padding", [False, True], ids=["no-padding", "padding"])
def test_default_back_end_on_cpu_is_the_torch_executor_exactly(executed, kind, arguments, padding):
    q, k, v = _qkv(37, requires_grad=False)
    call = dict(causal=True, key_padding_mask=three_padded_rows(37) if padding else None, scale=SCALE, **arguments)
    executed.clear()
    default = _op(kind)(q, k, v, **call)
    assert executed == [EXECUTORS[f"torch-{kind}"]]
    torch.testing.assert_close(default, _op(kind)(q, k, v, backend="torch", **call), rtol=0, atol=0)


@pytest.mark.parametrize(("kind", "arguments"), SPARSE, ids=SPARSE_IDS)
@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
@pytest.mark.parametrize(
    ("n_q", "n_k", "padding"),
    [(37, 37, True), (101, 101, False), (5, 37, True)],
    ids=["37-padding", "101", "decode-5-of-37-padding"],
)
def test_flex_forward_on_cpu_equals_the_reference(executed, kind, arguments, causal, n_q, n_k, padding):
    # FlexAttention has no backward on CPU: inputs that require grad would be refused by the dispatcher.
    q, k, v = _qkv(n_q, n_k, requires_grad=False)
    call = dict(causal=causal, key_padding_mask=three_padded_rows(n_k) if padding else None, scale=SCALE, **arguments)
    expected = _op(kind)(q, k, v, backend="reference", **call)
    executed.clear()
    actual = _op(kind)(q, k, v, backend="flex", **call)
    assert executed == [EXECUTORS["flex"]]
    torch.testing.assert_close(actual, expected, **TIGHT)


@pytest.mark.parametrize(("kind", "arguments"), SPARSE[::2], ids=SPARSE_IDS[::2])
def test_flex_with_inputs_that_require_grad_on_cpu_says_why(kind, arguments):
    q, k, v = _qkv(37)
    with pytest.raises(ValueError, match="no backward on CPU"):
        _op(kind)(q, k, v, backend="flex", **arguments)


@pytest.mark.parametrize(("kind", "arguments"), SPARSE[::2], ids=SPARSE_IDS[::2])
def test_xformers_on_cpu_raises_naming_the_device(kind, arguments):
    q, k, v = _qkv(37, requires_grad=False)
    with pytest.raises(ValueError, match=rf"'xformers' cannot run this '{kind}' attention on cpu.*device 'cpu'"):
        _op(kind)(q, k, v, backend="xformers", **arguments)


@pytest.mark.parametrize(("kind", "arguments"), SPARSE, ids=SPARSE_IDS)
@pytest.mark.parametrize(
    ("causal", "padding"),
    [(False, True), (True, False), (True, True)],
    ids=["bidirectional-padding", "causal", "causal-padding"],
)
def test_xformers_path_equals_the_reference(reference_kernel, executed, kind, arguments, causal, padding):
    if kind == "fixed" and causal and padding:
        pytest.skip("causal fixed attention with padding is not an xformers layout (the dispatcher says why)")
    q, k, v = _qkv(37)
    # Left padding included: the fixed pattern counts blocks from the first real token, the layout from 0.
    call = dict(causal=causal, key_padding_mask=three_padded_rows(37) if padding else None, scale=SCALE, **arguments)
    request = backends.AttentionRequest.for_inputs(q, k, v, pattern=kind, causal=causal, key_padding=padding)
    # The same call in float32 on CUDA: nothing in the layout's own requirements refuses it.
    assert xformers_reasons(request, dtype=torch.float32) == []
    expected = outputs_and_grads(lambda q, k, v: _op(kind)(q, k, v, backend="reference", **call), q, k, v)
    executed.clear()
    actual = outputs_and_grads(lambda q, k, v: _op(kind)(q, k, v, backend="xformers", **call), q, k, v)
    assert executed == [EXECUTORS[f"xformers-{kind}"]]
    assert_all_close(actual, expected, **TIGHT)


@pytest.mark.parametrize("kind", ["strided", "fixed"])
def test_config_backend_reaches_the_sparse_transformer_kinds(executed, kind):
    def model(backend):
        torch.manual_seed(0)
        config = tiny_config(
            kind,
            max_position_embeddings=64,
            strided_stride=3,
            fixed_block_size=4,
            fixed_num_summary=1,
            attention_backend=backend,
        )
        return LongAttnModel(config).eval()

    input_ids = torch.randint(3, 50, (2, 19), generator=torch.Generator().manual_seed(0))
    attention_mask = torch.ones(2, 19, dtype=torch.long)
    attention_mask[1, 14:] = 0
    with torch.no_grad():
        executed.clear()
        expected = model("auto")(input_ids, attention_mask=attention_mask).last_hidden_state
        assert set(executed) == {EXECUTORS[f"torch-{kind}"]}
        for backend in ("reference", "flex"):
            executed.clear()
            actual = model(backend)(input_ids, attention_mask=attention_mask).last_hidden_state
            # "reference" is every kind's dense form (`attend_dense`), which calls no `longattn.ops` executor.
            assert set(executed) == (set() if backend == "reference" else {EXECUTORS[backend]})
            torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)
        with pytest.raises(ValueError, match="'xformers' cannot run"):
            model("xformers")(input_ids, attention_mask=attention_mask)


# ---------------------------------------------------------------------------------------------- efficient and LSH
def _efficient(q, k, v, **kwargs):
    return ops.efficient_attention(q, k, v, key_padding_mask=three_padded_rows(k.shape[2]), **kwargs)


def _lsh(qk, _, v, **kwargs):
    return ops.lsh_attention(
        qk, v, num_hashes=2, bucket_size=4, seed=3, key_padding_mask=three_padded_rows(qk.shape[2]), **kwargs
    )


@pytest.fixture
def dense_forms(monkeypatch):
    """Names of the dense forms efficient and LSH attention ran (their `"reference"` back ends)."""
    return _spy(monkeypatch, [(ops_linear, "efficient_attention_weights"), (ops_lsh, "lsh_attention_dense")])


@pytest.mark.parametrize(
    ("name", "fn", "backend"),
    [
        ("efficient (linear)", _efficient, "flex"),
        ("efficient (linear)", _efficient, "xformers"),
        ("LSH", _lsh, "flex"),
    ],
    ids=["efficient-flex", "efficient-xformers", "lsh-flex"],
)
def test_efficient_and_lsh_refuse_the_kernel_back_ends(name, fn, backend):
    q, k, v = _qkv(37, requires_grad=False)
    message = rf"`backend`='{backend}' cannot run {re.escape(name)} attention: .*use one of \['auto', 'torch'"
    with pytest.raises(ValueError, match=message):
        fn(q, k, v, backend=backend)


def test_lsh_on_xformers_says_why_it_cannot_run_on_cpu():
    q, k, v = _qkv(37, requires_grad=False)
    with pytest.raises(ValueError, match=r"'xformers' cannot run this 'windows' attention on cpu.*device 'cpu'"):
        _lsh(q, k, v, backend="xformers")


@pytest.mark.parametrize("fn", [_efficient, _lsh], ids=["efficient", "lsh"])
def test_efficient_and_lsh_refuse_unknown_back_ends(fn):
    q, k, v = _qkv(37, requires_grad=False)
    with pytest.raises(ValueError, match=r"`backend`='cuda' is unknown: expected one of \['auto'"):
        fn(q, k, v, backend="cuda")


@pytest.mark.parametrize("fn", [_efficient, _lsh], ids=["efficient", "lsh"])
@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
def test_efficient_and_lsh_torch_back_end_is_the_default_exactly(dense_forms, fn, causal):
    q, k, v = _qkv(37, requires_grad=False)
    default = fn(q, k, v, causal=causal)
    torch.testing.assert_close(fn(q, k, v, causal=causal, backend="torch"), default, rtol=0, atol=0)
    torch.testing.assert_close(fn(q, k, v, causal=causal, backend="auto"), default, rtol=0, atol=0)
    assert dense_forms == []


@pytest.mark.parametrize("normalization", ["softmax", "scaling"])
@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
def test_efficient_reference_is_the_dense_form(dense_forms, normalization, causal):
    q, k, v = _qkv(37, 101)
    reference = outputs_and_grads(
        lambda q, k, v: _efficient(q, k, v, normalization=normalization, causal=causal, backend="reference"), q, k, v
    )
    assert dense_forms == ["efficient_attention_weights"]
    dense_forms.clear()
    fast = outputs_and_grads(lambda q, k, v: _efficient(q, k, v, normalization=normalization, causal=causal), q, k, v)
    assert dense_forms == []
    assert_all_close(fast, reference, **TIGHT)


@pytest.mark.parametrize(("causal", "before", "after"), [(False, 1, 1), (True, 2, 0)], ids=["bidirectional", "causal"])
def test_lsh_reference_is_the_dense_form_on_real_tokens(dense_forms, causal, before, after):
    qk, _, v = _qkv(37)
    real = three_padded_rows(37)[:, None, :].expand(B, H, 37)  # padded queries may differ: only real rows are compared
    kwargs = dict(causal=causal, num_chunks_before=before, num_chunks_after=after)
    reference = _lsh(qk, None, v, backend="reference", **kwargs)
    assert dense_forms == ["lsh_attention_dense"]
    fast = _lsh(qk, None, v, **kwargs)
    torch.testing.assert_close(fast[real], reference[real], **TIGHT)
    # Gradients of a loss on the real rows only.
    grad_out = torch.randn(fast.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    grad_out = grad_out * real[..., None]
    actual = torch.autograd.grad(fast, (qk, v), grad_out)
    expected = torch.autograd.grad(reference, (qk, v), grad_out)
    for name, a, e in zip(("grad_qk", "grad_v"), actual, expected, strict=True):
        torch.testing.assert_close(a, e, msg=lambda m, name=name: f"{name}: {m}", **TIGHT)
