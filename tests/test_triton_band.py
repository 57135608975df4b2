"""The Triton back end (`longattn.executor_triton`) against the dense reference of the same pattern predicate.

On CPU the kernels run under Triton's interpreter (`TRITON_INTERPRET=1`, set by conftest.py before triton is
imported): float32 and float16, small odd lengths that cross the 64-step tiles and end inside one. The GPU tests
(marked `gpu`) run the same comparisons at bfloat16 / float16 / float32 on CUDA with the interpreter off:
`TRITON_INTERPRET=0 pytest -m gpu tests/test_triton_band.py`.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from attention_checks import dense_reference, outputs_and_grads, random_qkv

from longattn import ops, patterns
from longattn.backends import AttentionRequest, backend_reasons, select_backend

pytest.importorskip("triton")

INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"
TOLERANCE = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 3e-2}  # rtol = atol, against float64


def _masks(b, n, *, padding, global_tokens, device="cpu"):
    """Row 0 right-padded with globals at 0 and n - 3; row 1 left-padded with one global inside its band."""
    key_padding_mask = global_mask = None
    if padding:
        key_padding_mask = torch.ones(b, n, dtype=torch.bool, device=device)
        key_padding_mask[0, n - 9 :] = False
        key_padding_mask[-1, :4] = False
    if global_tokens:
        global_mask = torch.zeros(b, n, dtype=torch.bool, device=device)
        global_mask[0, [0, n - 3]] = True
        global_mask[-1, 10] = True
    return key_padding_mask, global_mask


def _check(
    *, n, heads, kv_heads, d, window, dilation, causal, padding, global_tokens, dtype, device="cpu", fn=None
):  # fmt: skip
    """Output and gradients of the Triton back end equal the float64 dense reference on the same inputs."""
    q, k, v = random_qkv(2, heads, n, d, dtype=dtype, requires_grad=False)
    k, v = (t[:, :kv_heads].contiguous() for t in (k, v))
    q, k, v = (t.to(device).requires_grad_() for t in (q, k, v))
    key_padding_mask, global_mask = _masks(2, n, padding=padding, global_tokens=global_tokens, device=device)
    kwargs = dict(window=window, dilation=dilation, causal=causal)
    masks = dict(global_mask=global_mask, key_padding_mask=key_padding_mask)
    mask_fn = patterns.sliding_window_pattern(**kwargs, **masks)
    group = heads // kv_heads

    def triton(q, k, v):
        if fn is not None:
            return fn(q, k, v, **kwargs, **masks)
        return ops.sliding_window_attention(q, k, v, **kwargs, **masks, backend="triton")

    def reference(q, k, v):
        k, v = (t.double().repeat_interleave(group, dim=1) for t in (k, v))
        return dense_reference(mask_fn, q.double(), k, v, scale=d**-0.5)

    actual = outputs_and_grads(triton, q, k, v)
    expected = outputs_and_grads(reference, q, k, v)
    tolerance = TOLERANCE[dtype]
    for name, a, e in zip(("out", "grad_q", "grad_k", "grad_v"), actual, expected, strict=True):
        assert a.dtype == dtype and a.shape == e.shape
        torch.testing.assert_close(
            a.double(), e.double(), rtol=tolerance, atol=tolerance, msg=lambda m, name=name: f"{name}: {m}"
        )


needs_interpreter = pytest.mark.skipif(not INTERPRETED, reason="CPU runs need TRITON_INTERPRET=1 (conftest.py)")


# ----------------------------------------------------------------------------- the kernels, through the interpreter
@needs_interpreter
@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
def test_dilation_mix_gqa_padding_global_tokens(causal):
    # Four dilations in one launch, two query heads per key/value head, padding on both sides, global tokens.
    _check(
        n=131, heads=4, kv_heads=2, d=16, window=5, dilation=[1, 2, 4, 8], causal=causal,
        padding=True, global_tokens=True, dtype=torch.float32,
    )  # fmt: skip


@needs_interpreter
@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
def test_plain_window_across_tiles(causal):
    # 199 positions: three full 64-step tiles and a partial one; the window reaches over a tile boundary.
    _check(
        n=199, heads=2, kv_heads=2, d=32, window=37, dilation=1, causal=causal,
        padding=False, global_tokens=False, dtype=torch.float32,
    )  # fmt: skip


@needs_interpreter
def test_small_tiles_split_every_class():
    # 16-step tiles: each residue class of dilations 2 and 3 spans several tiles, the band crosses them.
    from longattn.executor_triton import triton_sliding_window_attention

    def run(q, k, v, **kwargs):
        return triton_sliding_window_attention(q, k, v, **kwargs, scale=q.shape[-1] ** -0.5, block_m=16, block_n=16)

    _check(
        n=150, heads=2, kv_heads=1, d=16, window=7, dilation=[3, 2], causal=False,
        padding=True, global_tokens=True, dtype=torch.float32, fn=run,
    )  # fmt: skip


@needs_interpreter
def test_float16_causal_with_global_tokens_and_padding():
    _check(
        n=67, heads=2, kv_heads=1, d=16, window=6, dilation=[1, 2], causal=True,
        padding=True, global_tokens=True, dtype=torch.float16,
    )  # fmt: skip


@needs_interpreter
def test_window_over_the_whole_sequence_is_dense_and_empty_rows_are_zero():
    # window >= n: every key; a batch row that is all padding sees nothing: zeros, finite gradients.
    q, k, v = random_qkv(2, 2, 50, 16, dtype=torch.float32)
    padding = torch.ones(2, 50, dtype=torch.bool)
    padding[1] = False
    out = ops.sliding_window_attention(q, k, v, window=60, key_padding_mask=padding, backend="triton")
    dense = ops.full_attention(q, k, v, key_padding_mask=padding, backend="reference")
    torch.testing.assert_close(out, dense, rtol=2e-5, atol=2e-5)
    assert out[1].eq(0).all()
    grads = torch.autograd.grad(out.sum(), (q, k, v))
    assert all(torch.isfinite(grad).all() for grad in grads)


# ------------------------------------------------------------------------------------------------- the dispatcher
def _request(**fields):
    defaults = dict(pattern="sliding", device="cpu", dtype=torch.float32, head_dim=32, value_head_dim=32)
    return AttentionRequest(**{**defaults, "q_len": 256, "kv_len": 256, "heads": 4, **fields})


def test_auto_never_picks_triton():
    # Not measured on a GPU yet: "auto" keeps its order on CPU (interpreter or not) and on CUDA.
    assert select_backend("auto", _request()) == "torch"
    assert "not been measured" in "; ".join(backends_auto_reasons(_request(device="cuda")))


def backends_auto_reasons(request):
    from longattn.backends import BACKENDS

    return BACKENDS["triton"].auto_reasons(request)


@pytest.mark.parametrize(
    ("fields", "reason"),
    [
        (dict(pattern="strided"), "pattern 'strided' is not served"),
        (dict(dropout=True), "no attention dropout"),
        (dict(q_len=8), "as many queries as keys"),
        (dict(dtype=torch.float64), "float16, bfloat16 or float32"),
        (dict(dtype=torch.bfloat16), "interpreter computes bfloat16 wrongly"),
        (dict(head_dim=512), "head dims up to 256"),
        (dict(relative_logits=True), "no relative-position logits"),
        (dict(documents=True), "no packed documents"),
    ],
)
def test_explicit_triton_refuses_what_it_cannot_run(fields, reason):
    assert reason in "; ".join(backend_reasons("triton", _request(**fields)))
    with pytest.raises(ValueError, match="'triton' cannot run"):
        select_backend("triton", _request(**fields))


def test_cpu_without_the_interpreter_is_refused(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert "only under its interpreter" in "; ".join(backend_reasons("triton", _request()))


def test_package_imports_and_runs_without_triton():
    # triton hidden from the import system: longattn imports, the torch back end runs, triton is refused with why.
    code = (
        "import sys; sys.modules['triton'] = None\n"
        "import torch, longattn\nfrom longattn import ops\n"
        "q = torch.randn(1, 2, 40, 8)\n"
        "assert ops.sliding_window_attention(q, q, q, window=4).shape == q.shape\n"
        "try:\n    ops.sliding_window_attention(q, q, q, window=4, backend='triton')\n"
        "except ValueError as error:\n    assert 'triton is not installed' in str(error), error\n"
        "else:\n    raise AssertionError('triton was not refused')\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=os.getcwd())
    assert result.returncode == 0, result.stderr


# ----------------------------------------------------------------------------------------------------- on a GPU
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or INTERPRETED, reason="needs CUDA and TRITON_INTERPRET=0")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
def test_on_gpu_against_the_reference(dtype, causal):
    _check(
        n=1000, heads=4, kv_heads=2, d=64, window=64, dilation=[1, 2, 4, 8], causal=causal,
        padding=True, global_tokens=True, dtype=dtype, device="cuda",
    )  # fmt: skip
