"""Hidden keys are hidden by the mask, never by comparing values: real logits far beyond the finite hidden constant
(about -3e32 in float32 / bfloat16, 1e300 in float64) give what the dense attention gives, on every op of the torch
back end, and the executors tell rows that see no key from their masks.

Shape legend: b batch, h heads, n tokens, d head dim.
"""

from __future__ import annotations

import math

import pytest
import torch

from longattn import ops
from longattn.executor_blocked import attend_blocks
from longattn.patterns import materialize_mask, strided_mask

DTYPES = [torch.float32, torch.bfloat16, torch.float64]
HUGE = {torch.float32: 3e32, torch.bfloat16: 3e32, torch.float64: 1e300}

OPS = {
    "full": (ops.full_attention, dict(causal=True)),
    "sliding": (ops.sliding_window_attention, dict(window=5)),
    "sliding causal": (ops.sliding_window_attention, dict(window=5, causal=True)),
    "sliding global": (ops.sliding_window_attention, dict(window=3)),
    "dilated": (ops.sliding_window_attention, dict(window=5, dilation=2)),
    "strided": (ops.strided_attention, dict(stride=4)),
    "fixed": (ops.fixed_attention, dict(block_size=4, num_summary=1)),
}


def _dense(q, k, v, mask, scale):
    """Softmax attention in float64 over the visible keys (-inf elsewhere), zero rows where none is visible."""
    scores = (q.double() @ k.double().transpose(-1, -2)) * scale
    scores = scores.masked_fill(~mask, -math.inf)
    seen = mask.any(dim=-1, keepdim=True)
    probs = torch.softmax(scores.masked_fill(~seen, 0.0), dim=-1) * seen
    return probs @ v.double()


def _inputs(dtype, magnitude, b=2, h=2, n=37, d=4):
    generator = torch.Generator().manual_seed(0)
    q, k = (torch.randn(b, h, n, d, generator=generator, dtype=torch.float64) for _ in range(2))
    v = torch.randn(b, h, n, d, generator=generator, dtype=torch.float64)
    root = math.sqrt(magnitude)
    return (q * root).to(dtype), (k * root).to(dtype), v.to(dtype)


@pytest.mark.parametrize("name", list(OPS))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("magnitude", ["ordinary", "huge"])
def test_torch_ops_match_the_dense_reference_whatever_the_logits(name, dtype, magnitude):
    fn, arguments = OPS[name]
    q, k, v = _inputs(dtype, 1.0 if magnitude == "ordinary" else HUGE[dtype])
    b, n = q.shape[0], q.shape[2]
    padding = torch.ones(b, n, dtype=torch.bool)
    padding[1, -5:] = False
    extra = {}
    if name == "sliding global":
        extra["global_mask"] = torch.zeros(b, n, dtype=torch.bool)
        extra["global_mask"][:, 0] = True
    out = fn(q, k, v, backend="torch", key_padding_mask=padding, **arguments, **extra)
    expected = fn(
        q.double(), k.double(), v.double(), backend="reference", key_padding_mask=padding, **arguments, **extra
    )
    assert torch.isfinite(out).all()
    tolerance = 2e-2 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(out.double(), expected, atol=tolerance, rtol=tolerance)
    if magnitude == "huge":
        assert out.abs().amax(dim=-1)[padding[:, None, :].expand(b, q.shape[1], n)].min() > 0  # no row zeroed


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_reference_back_end_is_exact_for_huge_logits(dtype):
    """The dense reference itself: the largest visible logit wins, whatever hidden logits hold."""
    q, k, v = _inputs(dtype, HUGE[dtype])
    n = q.shape[2]
    mask = torch.ones(n, n, dtype=torch.bool).tril()
    out = ops.full_attention(q.double(), k.double(), v.double(), causal=True, backend="reference")
    expected = _dense(q, k, v, mask, 1 / math.sqrt(q.shape[-1]))
    torch.testing.assert_close(out, expected)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_attend_blocks_rows_without_keys_come_from_the_mask(dtype):
    """Logits all about -3e32 (below HIDDEN_LOGIT / 2): rows that see a key keep their output, the others are zero."""
    b, h, nb, c, m, d = 1, 2, 3, 4, 6, 4
    big = math.sqrt(HUGE[dtype] / 4) * 2
    q = torch.full((b, h, nb, c, d), big, dtype=torch.float64).to(dtype)
    k = torch.full((b, h, m, d), -big, dtype=torch.float64).to(dtype)
    v = torch.randn(b, h, m, d, dtype=torch.float64).to(dtype)
    mask = torch.rand(1, 1, nb, c, m, generator=torch.Generator().manual_seed(1)) < 0.5
    mask[..., 0, 0, :] = False  # a row that sees nothing
    q.requires_grad_(True)
    out, lse = attend_blocks(q, k, v, kv_index=None, mask=mask, scale=0.5)
    seen = mask.any(dim=-1)  # [1, 1, nb, c]
    expected = (v.double()[:, :, None, None] * mask[..., None]).sum(-2) / mask.sum(-1, keepdim=True).clamp(min=1)
    torch.testing.assert_close(out.double(), expected.expand_as(out), atol=1e-2, rtol=1e-2)
    assert (out.abs().amax(-1) > 0).eq(seen).all()
    assert torch.isneginf(lse[..., ~seen[0, 0]]).all() and torch.isfinite(lse[..., seen[0, 0]]).all()
    out.sum().backward()
    assert torch.isfinite(q.grad).all()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_block_sets_are_exact_and_finite_in_backward_for_huge_logits(dtype):
    q, k, v = _inputs(dtype, HUGE[dtype], b=1, n=16)
    q, k, v = (t.requires_grad_(True) for t in (q, k, v))
    out = ops.strided_attention(q, k, v, stride=4, backend="torch")
    n = q.shape[2]
    mask = materialize_mask(strided_mask(4, causal=True), batch=1, heads=1, q_len=n, kv_len=n)
    expected = _dense(q.detach(), k.detach(), v.detach(), mask, 1 / math.sqrt(q.shape[-1]))
    torch.testing.assert_close(out.double(), expected, atol=2e-2, rtol=2e-2)
    out.float().square().sum().backward()
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))
