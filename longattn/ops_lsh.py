"""Reformer LSH attention (Kitaev et al. 2020, "Reformer: The Efficient Transformer"), functional level.

The `"lsh"` kind (`attention_lsh.LSHAttention`) wraps `lsh_attention`; routing and Sinkhorn attention reuse its
window kernel `attend_windows` and the row gathers.

Shape legend: b batch, h heads, n length (m keys when it differs), d head dim, r hash rounds, nb buckets,
c chunk length (`bucket_size`), nc chunks per round, w keys gathered per chunk.

Queries and keys share one projection (shared-QK). Each hash round rotates the vectors with a random matrix and
takes the bucket `argmax([xR, -xR])` (angular LSH, Andoni et al. 2015), so that vectors pointing the same way tend to
share a bucket. Tokens are sorted by (bucket, position), the sorted sequence is cut into chunks of `bucket_size`,
and every chunk attends to itself and `num_chunks_before` / `num_chunks_after` neighbouring chunks of the same
round. The rounds are combined by their log-sum-exp weights, which equals one softmax over the keys of all rounds
(a key found by two rounds counts twice, as in the paper's implementation).

The sorted rounds are laid out in one buffer with zero chunks between them, so a chunk's keys (itself and its
neighbours) are a contiguous window of rows: `attend_windows` runs the batched matmuls over `[b·h·r·nc, c, w]` on
strided views of that buffer, in cache-sized groups, with a hand-written backward. Routing and Sinkhorn attention
reuse that kernel for their clusters and blocks.

Without dropout, LSH and routing never build that buffer: `attend_gathered_windows` takes the unsorted rows and the
index of every buffer row, gathers one group of chunks at a time (in forward, and again in backward), and merges the
hash rounds (routing: the clusters) of each position by log-sum-exp inside the kernel. Backward then keeps O(n·d)
floats and integer indices, as dense attention through SDPA does, instead of r sorted copies of q, k, v and their
r·n·w probabilities.

Conventions shared with transformers' `ReformerModel` (`LSHSelfAttention`), so that both give the same output at
the same rotations and settings (see tests/test_lsh.py):

- keys are normalised to unit length, and scores are q·k̂ with no 1/sqrt(d) scaling;
- a query attends to itself only when no other key is visible: its own score is replaced by -1e5, so the self key
  gets a weight of exactly 0 in float32 as soon as anything else is visible;
- padding tokens go to an extra bucket after all others, and are masked as keys.

Where this implementation differs, on purpose:

- Chunk neighbours stay inside their hash round and do not wrap around (trax and transformers concatenate the rounds
  and look back circularly, so the first chunk of round 2 sees the last chunk of round 1). Without the wrap the
  output of a real token does not depend on how much padding follows it.
- **Causal LSH.** Sorting the whole sequence and then chunking leaks: where a chunk boundary falls depends on how
  many *later* tokens hashed into lower buckets. Here a causal query sees exactly the most recent
  `bucket_size · num_chunks_before` earlier keys *of its own bucket* (all of them when the bucket holds fewer). In
  the (bucket, position) order these are the nearest preceding entries of the same bucket, so a band over the
  sorted sequence computes them, and which keys they are depends only on earlier tokens.
- The number of buckets is fixed per model (`lsh_num_buckets`, by default derived from
  `max_position_embeddings`), not from the current length, so that padding and cached decoding do not change the
  hashing.

Pattern for one round, 12 tokens, chunks of 3, one chunk before (rows: queries in sorted order, ■ visible):

    ■ ■ ■ ⬚ ⬚ ⬚ ⬚ ⬚ ⬚ ⬚ ⬚ ⬚
    ■ ■ ■ ⬚ ⬚ ⬚ ⬚ ⬚ ⬚ ⬚ ⬚ ⬚      chunk 0 sees itself only (no wrap)
    ■ ■ ■ ⬚ ⬚ ⬚ ⬚ ⬚ ⬚ ⬚ ⬚ ⬚
    ■ ■ ■ ■ ■ ■ ⬚ ⬚ ⬚ ⬚ ⬚ ⬚
    ■ ■ ■ ■ ■ ■ ⬚ ⬚ ⬚ ⬚ ⬚ ⬚      chunk 1 sees chunks 0 and 1
    ...                           (the diagonal, a query's own key, only when nothing else is visible)
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from .backends import select_step_executor
from .executor_families import StepExecutors
from .fused_kernel import current_kernel
from .numerics import HALF_HIDDEN_PENALTY, NO_KEY_LSE, compute_dtype, default_scale, hide_exactly
from .ops_checks import (
    check_document_ids,
    check_dropout,
    check_flag,
    check_positive_int,
    check_qkv,
    check_token_mask,
    empty_attention,
    inert_padding,
    is_empty,
)
from .patterns import document_index
from .relative_logits import check_relative_embedding, materialize_bias, relative_bias, relative_logit_table

__all__ = [
    "RelativeColumns",
    "SELF_SCORE",
    "attend_windows",
    "attend_windows_on_kernel",
    "default_num_buckets",
    "gather_rows",
    "head_rows",
    "lsh_attention",
    "lsh_attention_dense",
    "lsh_buckets",
    "lsh_rotations",
    "normalize_keys",
    "select_windows_executor",
]

SELF_SCORE = -1e5
"""Score of a query's own key (transformers' value in float32): used only when nothing else is visible."""

KEY_NORM_EPS = 1e-6
"""Epsilon of the shared-QK key normalisation `x / sqrt(|x|² + d·eps)` (transformers' convention)."""

# The `backend=` values LSH attention cannot honour, and why: its chunked windows are not a mask over positions.
_UNSUPPORTED_BACKENDS = {
    "flex": "FlexAttention evaluates a predicate over positions, and LSH's keys depend on the sorted hash buckets "
    "and chunk boundaries of each round, merged over rounds by log-sum-exp, with the self key as a fallback",
}

# Rotated vectors are computed in slices of this many positions, so that `[b, h, r, n, nb/2]` never exists at once
# (at 32K tokens and 512 buckets it would take half a gigabyte).
_HASH_SLICE = 4096


# ---------------------------------------------------------------------------------------------- hashing
Buckets = int | tuple[int, ...]
"""Buckets per round: an even int, or even factors whose product is the bucket count (a factorised hash)."""


def default_num_buckets(length: int, bucket_size: int) -> Buckets:
    """The paper's choice, about two buckets per chunk, with transformers' rule for large counts.

    The largest power of two <= 2·length/bucket_size (at least 2). Above 2·max(sqrt(length/bucket_size),
    bucket_size) the count is factorised into two powers of two (the bucket is the pair of two smaller hashes),
    which keeps the rotation, a `[d, Σ factors/2]` matmul per round, far cheaper than the attention itself.
    """
    exponent = max(1, (max(2, (2 * length) // bucket_size)).bit_length() - 1)
    limit = 2 * max(int(math.sqrt(length // bucket_size)), bucket_size)
    if 2**exponent <= limit:
        return 2**exponent
    return (2 ** (exponent // 2), 2 ** (exponent - exponent // 2))


def hash_factors(num_buckets: Buckets) -> tuple[int, ...]:
    factors = (num_buckets,) if not isinstance(num_buckets, (tuple, list)) else tuple(num_buckets)
    if not factors or any(not isinstance(f, int) or isinstance(f, bool) or f < 2 or f % 2 for f in factors):
        raise ValueError(f"num_buckets={num_buckets!r} is invalid: expected an even integer >= 2, or a tuple of them.")
    return factors


def lsh_rotations(
    *,
    heads: int,
    head_dim: int,
    num_hashes: int,
    num_buckets: Buckets,
    seed: int | None = None,
    device: torch.device | str | None = None,
    dtype: torch.dtype = torch.float32,
) -> Tensor:
    """Random rotations for angular LSH, `[h, d, r, Σ factors/2]` (transformers' layout).

    Drawn from a CPU generator seeded with `seed` (so that a seed gives the same rotations on every device, and
    the same as transformers' `ReformerConfig(hash_seed=seed)` in float32); from torch's global generator when
    `seed` is None (fresh rotations on every call, as in the paper).

    Raises:
        ValueError: `num_buckets` is not an even integer >= 2 (or a tuple of them).
    """
    shape = (heads, head_dim, num_hashes, sum(f // 2 for f in hash_factors(num_buckets)))
    if seed is None:
        return torch.randn(shape, device=device, dtype=dtype)
    generator = torch.Generator(device="cpu").manual_seed(seed)
    # device="cpu" explicitly: the generator is a CPU one, also under a `torch.device("meta")` context.
    return torch.randn(shape, generator=generator, dtype=dtype, device="cpu").to(device)


@torch.no_grad()
def lsh_buckets(
    qk: Tensor, rotations: Tensor, *, valid: Tensor | None = None, num_buckets: Buckets | None = None
) -> Tensor:
    """Bucket of every vector in every hash round: `argmax([x·R, -x·R])`, per factor when factorised.

    Args:
        qk: `[b, h, n, d]` shared query/key vectors (not normalised: the argmax does not depend on length).
        rotations: `[h or 1, d, r, Σ factors/2]`.
        valid: Optional bool `[b, n]`, False for padding: those tokens get the extra bucket `nb` (the product of
            the factors), after all others.
        num_buckets: The factors; None = one hash with `2 · rotations.shape[-1]` buckets.

    Returns:
        Long `[b, h, r, n]` in `[0, nb]`.

    Raises:
        ValueError: The factors do not match the size of the rotations.
    """
    b, h, n, _ = qk.shape
    factors = (2 * rotations.shape[-1],) if num_buckets is None else hash_factors(num_buckets)
    if sum(f // 2 for f in factors) != rotations.shape[-1]:
        raise ValueError(
            f"num_buckets={num_buckets!r} needs rotations with {sum(f // 2 for f in factors)} columns, "
            f"got {rotations.shape[-1]}."
        )
    rotations = rotations.to(device=qk.device, dtype=torch.float32).expand(h, -1, -1, -1)
    buckets = torch.zeros(b, h, rotations.shape[2], n, dtype=torch.long, device=qk.device)
    for start in range(0, n, _HASH_SLICE):
        stop = min(n, start + _HASH_SLICE)
        rotated = torch.einsum("bhnd,hdrk->bhrnk", qk[:, :, start:stop].float(), rotations)  # [b, h, r, n', Σf/2]
        column, stride = 0, 1
        for factor in factors:
            half = factor // 2
            part = rotated[..., column : column + half]
            top, top_index = part.max(dim=-1)
            bottom, bottom_index = part.min(dim=-1)
            # argmax over the concatenation [x, -x] without building it; ties go to the first half, as argmax
            # would. Factor i is digit i of the bucket number (transformers' order).
            buckets[..., start:stop] += stride * torch.where(top >= -bottom, top_index, bottom_index + half)
            column, stride = column + half, stride * factor
    if valid is not None:
        buckets.masked_fill_(~valid[:, None, None, :], math.prod(factors))
    return buckets


def document_buckets(buckets: Tensor, document_ids: Tensor, padding_bucket: int) -> tuple[Tensor, int]:
    """Buckets of packed rows that hold one document each: bucket `β · D + document` (D documents per row at most).

    Sorted, the tokens of a bucket are then grouped by document, and equal buckets mean the same document (what
    causal LSH, and routing's clusters, attend within). Padding keeps a bucket after all others.

    Args:
        buckets: Long `[b, h, r, n]` in `[0, padding_bucket]`.
        document_ids: Integer `[b, n]`, contiguous runs of one id per document.
        padding_bucket: The bucket of padding in `buckets`.

    Returns:
        `(buckets [b, h, r, n], padding bucket)`.
    """
    index = document_index(document_ids)  # [b, n], 0 .. D - 1
    documents = int(index.max()) + 1 if index.numel() else 1
    combined = buckets * documents + index[:, None, None, :]
    return torch.where(buckets == padding_bucket, padding_bucket * documents, combined), padding_bucket * documents


def _key_norm_factor(x: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """`(factor, mean_square)` of `normalize_keys` for rows `x [.., d]`: factor = (mean(x²) + eps)^(-1/2) / sqrt(d)."""
    mean_square = x.pow(2).mean(dim=-1, keepdim=True) + eps  # [.., 1]
    return torch.rsqrt(mean_square) / math.sqrt(x.shape[-1]), mean_square


class _NormalizeKeys(torch.autograd.Function):
    """`x / sqrt(|x|² + d·eps)` with a two-pass backward (autograd's chain of pow/mean/rsqrt/div took six)."""

    @staticmethod
    def forward(ctx, x, eps):
        factor, mean_square = _key_norm_factor(x, eps)
        ctx.save_for_backward(x, factor, mean_square)
        return x * factor

    @staticmethod
    def backward(ctx, grad):
        x, factor, mean_square = ctx.saved_tensors
        # y = x·s with s = (mean(x²) + eps)^(-1/2) / sqrt(d):  dx = s·(dy − x·(dy·x) / (d·(mean(x²) + eps)))
        dot = (grad * x).sum(dim=-1, keepdim=True)
        return (grad - x * (dot / (x.shape[-1] * mean_square))) * factor, None


def normalize_keys(qk: Tensor, eps: float = KEY_NORM_EPS) -> Tensor:
    """Keys of shared-QK attention: unit length, `x / sqrt(|x|² + d·eps)` (transformers' epsilon convention)."""
    return _NormalizeKeys.apply(qk, eps)


def head_rows(x: Tensor) -> tuple[Tensor, Callable[[Tensor, Tensor, Tensor], Tensor]]:
    """`x [b, h, n, d]` as a 2-D `[rows, d]` tensor and the row of (batch, head, position) in it.

    No copy when x is contiguous or has heads split from a `[b, n, h·d]` projection (the usual case: then the rows
    are ordered (batch, position, head)); otherwise one contiguous copy. Gathers by row index then cost one
    index_select whatever the layout.
    """
    b, h, n, d = x.shape
    if not x.is_contiguous() and x.transpose(1, 2).is_contiguous():
        return x.transpose(1, 2).reshape(b * n * h, d), lambda bi, hi, pos: (bi * n + pos) * h + hi
    x = x.contiguous()
    return x.view(b * h * n, d), lambda bi, hi, pos: (bi * h + hi) * n + pos


def _select_rows(x: Tensor, index: Tensor) -> Tensor:
    """Rows `x[index]` of a 2-D tensor, zeros where `index` is -1."""
    out = x.index_select(0, index.clamp(min=0))
    empty = (index < 0).nonzero().squeeze(-1)
    if empty.numel():
        out.index_fill_(0, empty, 0.0)
    return out


class _GatherRows(torch.autograd.Function):
    """`out[i] = x[index[i]]` (zeros for -1) whose backward gathers with the inverse map instead of scattering.

    `inverse [g, N]` lists, for each of the g copies of every row of x, the output row holding it (-1: none).
    On CPU a gather is several times faster than the scatter-add autograd would run for index_select.
    """

    @staticmethod
    def forward(ctx, x, index, inverse):
        ctx.save_for_backward(inverse)
        return _select_rows(x, index)

    @staticmethod
    def backward(ctx, grad):
        (inverse,) = ctx.saved_tensors
        grad_x = _select_rows(grad.contiguous(), inverse.reshape(-1))  # [g·N, d]
        if inverse.shape[0] > 1:
            grad_x = grad_x.view(inverse.shape[0], -1, grad_x.shape[-1]).sum(dim=0)
        return grad_x, None, None


def gather_rows(x: Tensor, index: Tensor, inverse: Tensor) -> Tensor:
    """Rows of `x [N, d]` in the order `index [M]` (-1 = a zero row); `inverse [g, N]` as in `_GatherRows`."""
    return _GatherRows.apply(x, index, inverse)


# ---------------------------------------------------------------------------------------------- window kernel
# Score elements per group of windows (16 MB of float32). Groups keep the elementwise passes (bias, exp, normalise)
# over a group's scores near the cache instead of streaming one 64+ MB tensor per pass, and keep the number of ops
# small: every op is one parallel region, and on a shared 2-core machine a region waits for a descheduled thread.
# Measured at 16K tokens (LSH, fwd+bwd): with 2 threads under load 9-12 s with groups of 2**19, 2.2-2.9 s with 2**23;
# with 1 thread the same within noise from 2**19 to 2**23.
_GROUP_ELEMENTS = 2**22
# With `keep_probs=False` (the memory-lean mode) the group buffers are what the kernel adds to peak memory: 4 MB.
_LEAN_GROUP_ELEMENTS = 2**20
# Score elements per group of `attend_gathered_windows` (1 MB of float32): its group holds about eight buffers of
# this size (scores, their gradient, gathered rows and their gradients), all it adds to peak memory.
_GATHERED_GROUP_ELEMENTS = 2**18


def _windows(rows: Tensor, start: int, stop: int, stride: int, width: int) -> Tensor:
    """Windows `start..stop` of `rows [N, d]`: window u is rows `u·stride .. u·stride + width` (they may overlap)."""
    d = rows.shape[-1]
    return rows.as_strided((stop - start, width, d), (stride * d, d, 1), rows.storage_offset() + start * stride * d)


class _WindowAttention(torch.autograd.Function):
    """Softmax attention of B query chunks, chunk u over key rows `u·stride .. u·stride + w`; hand-written backward.

    Overlapping windows are strided views of one key tensor (no copy). Works through the chunks in cache-sized
    groups, so the elementwise passes over a group's scores run in cache. Saves q, k, v, the output and either the
    probabilities or the bias and log-sum-exp to recompute them (no scores or intermediate copies). With D = rowsum(dO
    ∘ O) − dlse: dV = Pᵀ dO,
    dP = dO Vᵀ, dS = P ∘ (dP − D), dQ = dS K·scale, dK = dSᵀ Q·scale, the window gradients added back onto the
    rows they came from. The dlse term lets outputs combined by their log-sum-exp (LSH hash rounds) train.
    """

    @staticmethod
    def forward(ctx, q, k, v, bias, scale, stride, self_column, keep_probs):
        dtype = compute_dtype(q.dtype)
        q_c, k_c, v_c = q.to(dtype).contiguous(), k.to(dtype).contiguous(), v.to(dtype).contiguous()
        n_chunks, c, w = q.shape[0], q.shape[1], bias.shape[-1]
        out = torch.empty(n_chunks, c, v.shape[-1], dtype=dtype, device=q.device)
        lse = torch.empty(n_chunks, c, dtype=dtype, device=q.device)
        step = max(1, (_GROUP_ELEMENTS if keep_probs else _LEAN_GROUP_ELEMENTS) // (c * w))
        # Kept probabilities (B·c·w floats, tens of MB at 16K tokens) save backward one matmul and five elementwise
        # passes per group; without them only a group-sized buffer is used.
        all_probs = torch.empty(n_chunks if keep_probs else min(step, n_chunks), c, w, dtype=dtype, device=q.device)
        for start in range(0, n_chunks, step):
            stop = min(n_chunks, start + step)
            probs = all_probs[start:stop] if keep_probs else all_probs[: stop - start]
            q_group = q_c[start:stop] if scale == 1.0 else q_c[start:stop] * scale
            torch.bmm(q_group, _windows(k_c, start, stop, stride, w).transpose(1, 2), out=probs)
            probs.add_(bias[start:stop])  # -inf where masked: far cheaper than masked_fill_ with a bool mask
            if self_column is not None:
                _self_diagonal(probs, self_column).fill_(SELF_SCORE)
            row_max = probs.amax(dim=-1, keepdim=True)  # [g, c, 1]
            # A row without any visible key would give (-inf) - (-inf) = NaN; shifting it by 0 keeps exp() at 0.
            row_max.masked_fill_(torch.isneginf(row_max), 0.0)
            probs.sub_(row_max).exp_()
            row_sum = probs.sum(dim=-1, keepdim=True)
            lse[start:stop] = (row_max + row_sum.log()).squeeze(-1)  # -inf for rows without keys
            probs.mul_(torch.where(row_sum > 0, row_sum.reciprocal(), torch.zeros_like(row_sum)))
            torch.bmm(probs, _windows(v_c, start, stop, stride, w), out=out[start:stop])
        if keep_probs:
            ctx.save_for_backward(q_c, k_c, v_c, out, all_probs)
        else:
            ctx.save_for_backward(q_c, k_c, v_c, out, bias, lse)
        ctx.scale, ctx.stride, ctx.self_column, ctx.keep_probs = scale, stride, self_column, keep_probs
        ctx.dtypes = (q.dtype, k.dtype, v.dtype)
        return out.to(q.dtype), lse

    @staticmethod
    def backward(ctx, grad_out, grad_lse):
        q, k, v, out, *kept = ctx.saved_tensors
        scale, stride, self_column = ctx.scale, ctx.stride, ctx.self_column
        n_chunks, c, w = q.shape[0], q.shape[1], kept[0].shape[-1]
        if not ctx.keep_probs:
            bias, lse = kept
            # Rows without visible keys have lse = -inf; exp(s - (+inf)) keeps their probabilities at 0.
            lse_shift = lse.masked_fill(torch.isneginf(lse), math.inf).unsqueeze(-1)  # [B, c, 1]
        grad_out = torch.zeros_like(out) if grad_out is None else grad_out.to(out.dtype).contiguous()
        delta = (grad_out * out).sum(dim=-1, keepdim=True)  # [B, c, 1]
        if grad_lse is not None:
            delta = delta - grad_lse.to(out.dtype).unsqueeze(-1)
        grad_q, grad_k, grad_v = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        overlapping = stride < w
        if overlapping:
            # Window part p of chunk u lands on row block u + p. Groups go in order, and each group assigns its
            # last part first (blocks no earlier group reached), then adds the others; only the first blocks,
            # which no last part reaches, and rows after the last window start at zero.
            grad_k[: w - stride].zero_()
            grad_v[: w - stride].zero_()
            grad_k[(n_chunks - 1) * stride + w :].zero_()
            grad_v[(n_chunks - 1) * stride + w :].zero_()
        else:
            grad_k[n_chunks * stride :].zero_()  # rows after the last window (if any) get no gradient
            grad_v[n_chunks * stride :].zero_()
        step = max(1, (_GROUP_ELEMENTS if ctx.keep_probs else _LEAN_GROUP_ELEMENTS) // (c * w))
        grad_buffer = torch.empty(min(step, n_chunks), c, w, dtype=q.dtype, device=q.device)
        probs_buffer = None if ctx.keep_probs else torch.empty_like(grad_buffer)
        for start in range(0, n_chunks, step):
            stop = min(n_chunks, start + step)
            grad_scores = grad_buffer[: stop - start]
            keys, values = _windows(k, start, stop, stride, w), _windows(v, start, stop, stride, w)
            q_group = q[start:stop] if scale == 1.0 else q[start:stop] * scale
            if ctx.keep_probs:
                probs = kept[0][start:stop]
            else:
                probs = probs_buffer[: stop - start]
                torch.bmm(q_group, keys.transpose(1, 2), out=probs)
                probs.add_(bias[start:stop])
                if self_column is not None:
                    _self_diagonal(probs, self_column).fill_(SELF_SCORE)
                probs.sub_(lse_shift[start:stop]).exp_()
            torch.bmm(grad_out[start:stop], values.transpose(1, 2), out=grad_scores)  # dP
            if overlapping:
                grad_values = torch.bmm(probs.transpose(1, 2), grad_out[start:stop])  # [g, w, d_v]
            else:  # windows side by side: write straight into place
                grad_values = grad_v[start * stride : stop * stride].view(stop - start, w, -1)
                torch.bmm(probs.transpose(1, 2), grad_out[start:stop], out=grad_values)
            grad_scores.sub_(delta[start:stop]).mul_(probs)  # dS
            if self_column is not None:
                _self_diagonal(grad_scores, self_column).zero_()  # the self score is a constant
            torch.bmm(grad_scores, keys, out=grad_q[start:stop])
            if not overlapping:
                grad_keys = grad_k[start * stride : stop * stride].view(stop - start, w, -1)
                torch.bmm(grad_scores.transpose(1, 2), q_group, out=grad_keys)  # q_group carries the scale
                continue
            grad_keys = torch.bmm(grad_scores.transpose(1, 2), q_group)  # [g, w, d]
            for part in range(w - stride, -1, -stride):  # window rows part.. of chunk u: rows u·stride + part..
                rows = slice(start * stride + part, (stop - 1) * stride + part + stride)
                if part == w - stride:
                    grad_k[rows] = grad_keys[:, part:].reshape(-1, k.shape[-1])
                    grad_v[rows] = grad_values[:, part:].reshape(-1, v.shape[-1])
                else:
                    grad_k[rows] += grad_keys[:, part : part + stride].reshape(-1, k.shape[-1])
                    grad_v[rows] += grad_values[:, part : part + stride].reshape(-1, v.shape[-1])
        if scale != 1.0:
            grad_q.mul_(scale)
        q_dtype, k_dtype, v_dtype = ctx.dtypes
        return grad_q.to(q_dtype), grad_k.to(k_dtype), grad_v.to(v_dtype), None, None, None, None, None


def _self_diagonal(scores: Tensor, column: int) -> Tensor:
    """View of the entries (i, column + i) of `[g, c, w]` scores: each query's own key."""
    c = scores.shape[1]
    return scores[:, :, column : column + c].diagonal(dim1=1, dim2=2)


def attend_windows(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Tensor,
    *,
    stride: int,
    scale: float,
    dropout_p: float = 0.0,
    self_column: int | None = None,
    keep_probs: bool = True,
) -> tuple[Tensor, Tensor]:
    """Dense attention of B query chunks, each over its own window of key rows: one batched matmul per group.

    Chunk u attends to key rows `u·stride .. u·stride + w`: windows of a sorted sequence that overlap (w > stride,
    as for a chunk and its neighbours) are strided views, never copies. Content-based kinds sort or select their
    tokens, lay the keys out so, and call this. A row with no visible key returns zeros and `lse = -inf`, with
    finite gradients. Memory: besides q, k, v and the output, the B·c·w probabilities (or, with
    `keep_probs=False`, the bias) are kept for backward.

    Args:
        q: `[B, c, d]`.
        k: `[N, d]` key rows, N >= (B - 1)·stride + w.
        v: `[N, d_v]`.
        mask: Bool `[B, c or 1, w]`, True = visible; or a float bias of that shape, 0 = visible and -inf = masked
            (cheaper to build directly for large masks), or any finite logit bias where visible (relative-position
            logits; a bias that requires grad gets its gradient through autograd's path). w is the window length (a
            multiple of `stride` when larger than it).
        stride: Rows between the starts of consecutive windows.
        scale: Multiplier of q·k.
        dropout_p: Dropout on the probabilities (this path keeps autograd's own backward).
        self_column: Reformer's self rule: key `self_column + i` of the window is query i's own key; its score
            becomes the constant `SELF_SCORE` whatever the mask says, so it is attended only when nothing else is.
        keep_probs: Keep the B·c·w probabilities for backward (faster) or recompute them there (B·c·w less memory).

    Returns:
        `(out [B, c, d_v], lse [B, c])`, lse in float32 for half inputs.
    """
    w = mask.shape[-1]
    if w > stride and w % stride:
        raise ValueError(f"overlapping windows must be a multiple of the stride: w={w}, stride={stride}.")
    if mask.dtype == torch.bool:
        bias = hide_exactly(
            torch.zeros(mask.shape, dtype=compute_dtype(q.dtype), device=q.device), ~mask, inplace=True
        )  # added to the scores
    else:
        bias, mask = mask, ~torch.isneginf(mask)
    if dropout_p == 0.0 and not bias.requires_grad:
        return _WindowAttention.apply(q, k, v, bias, float(scale), stride, self_column, keep_probs)
    dtype = compute_dtype(q.dtype)
    keys = _windows(k.contiguous(), 0, q.shape[0], stride, w).to(dtype)  # autograd folds the overlaps back
    values = _windows(v.contiguous(), 0, q.shape[0], stride, w).to(dtype)
    # masked_fill after the bias: a row with no visible key then sends no NaN gradient back (logsumexp of -inf).
    scores = hide_exactly(torch.bmm(q.to(dtype) * scale, keys.transpose(1, 2)) + bias.to(dtype), ~mask)
    if self_column is not None:
        own = torch.zeros_like(scores, dtype=torch.bool)
        _self_diagonal(own, self_column).fill_(True)
        scores = torch.where(own, torch.full_like(scores, SELF_SCORE), scores)
    lse = scores.logsumexp(dim=-1)  # [B, c]
    safe = torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse)
    probs = (scores - safe.unsqueeze(-1)).exp()
    out = torch.bmm(F.dropout(probs, p=dropout_p), values)
    return out.to(q.dtype), lse


# ---------------------------------------------------------------------------------------------- gathered windows
class _WindowLayout(NamedTuple):
    """The keyword arguments of `attend_gathered_windows` but `relative_table` (see there): where its slots and
    window rows come from and what they see. What `_GatheredWindows` reads besides the rows and the table."""

    query_index: Tensor  # [U·c]
    key_index: Tensor  # [R]
    value_index: Tensor  # [R]
    out_index: Tensor  # [U·c]
    n_out: int
    chunk: int  # c
    width: int  # w
    stride: int
    scale: float
    mask: Tensor | None = None  # [U, c or 1, w]
    first: Tensor | None = None  # [U·c]
    last: Tensor | None = None  # [U·c]
    self_column: int | None = None
    key_norm_eps: float | None = None
    query_position: Tensor | None = None  # [U·c]
    key_position: Tensor | None = None  # [R]

    @property
    def n_windows(self) -> int:
        """U, the windows: U·c query slots."""
        return self.query_index.shape[0] // self.chunk

    def relative_columns(self, table: Tensor | None, c: int) -> RelativeColumns | None:
        return RelativeColumns.of(
            table, self.query_position, self.key_position, self.out_index, c, self.stride, self.width
        )


class _GatheredWindows(torch.autograd.Function):
    """Window attention whose query slots, key rows and value rows are gathered from unsorted rows by index, with
    the slots that answer the same output row merged by their log-sum-exp; hand-written backward.

    Forward, per group of windows: gather the group's query and key/value rows, S = Q Kᵀ·scale + bias, per slot
    lse_i and o_i = softmax(S) V; then each output row p is C_p = Σ_i exp(lse_i − L_p) o_i over its slots i, with
    L_p = log Σ_i exp(lse_i): one softmax over the union of the slots' keys (LSH hash rounds, a query routed to
    several clusters). Saved: the unsorted rows (inputs), the integer indices, the mask, one lse per slot, C and
    L: O(n·d) floats plus indices, never a sorted copy or a probability.

    Backward recomputes each group's probabilities. With w_i = exp(lse_i − L_p) the slot's share of row p and
    D_p = rowsum(dC_p ∘ C_p), slot i's gradients are dO_i = w_i dC_p and dlse_i = w_i (dC_p·o_i − D_p), so
    dS = w_i P ∘ (dC_p Vᵀ − D_p): o_i itself is never needed. dQ, dK, dV are added back onto the rows they were
    gathered from (index_add), group by group, so only group-sized buffers exist.

    Shapes: q_rows `[Nq, d]`, k_rows `[Nk, d]`, v_rows `[Nv, d_v]`; query_index, out_index `[U·c]`, key_index,
    value_index `[R]` with R >= (U − 1)·stride + w (-1: an empty slot or a hidden key); mask bool `[U, c or 1, w]`;
    output `[n_out, d_v]`.
    """

    @staticmethod
    def forward(ctx, q_rows, k_rows, v_rows, relative_table, layout: _WindowLayout):
        dtype = compute_dtype(q_rows.dtype)
        c, w, d_v = layout.query_index.shape[0] // layout.n_windows, layout.width, v_rows.shape[-1]
        relative = layout.relative_columns(relative_table, c)
        key_factor = None
        if layout.key_norm_eps is not None:  # `normalize_keys` row by row: x · rsqrt(mean(x²) + eps) / sqrt(d)
            key_factor, _ = _key_norm_factor(k_rows.to(dtype), layout.key_norm_eps)  # [Nk, 1]
        slot_out = torch.empty(layout.n_windows, c, d_v, dtype=dtype, device=q_rows.device)
        slot_lse = torch.empty(layout.n_windows, c, dtype=dtype, device=q_rows.device)
        rows = _GroupRows(q_rows, k_rows, v_rows, key_factor, layout.query_index, layout.key_index, layout.value_index)
        hidden = None if layout.mask is None else ~layout.mask
        for start, stop, scores in _window_groups(layout.n_windows, c, w, dtype, q_rows.device):
            queries, keys, values = rows.group(start, stop, c, layout.stride, w, dtype, layout.scale)
            torch.bmm(queries, keys.transpose(1, 2), out=scores)
            if relative is not None:
                scores.add_(relative.bias(start, stop))
            _hide(scores, start, stop, hidden, layout.first, layout.last, layout.self_column)
            row_max = scores.amax(dim=-1, keepdim=True)  # [g, c, 1]
            # A row without any visible key would give (-inf) - (-inf) = NaN; shifting it by 0 keeps exp() at 0.
            row_max.masked_fill_(torch.isneginf(row_max), 0.0)
            row_sum = scores.sub_(row_max).exp_().sum(dim=-1, keepdim=True)
            slot_lse[start:stop] = (row_max + row_sum.log()).squeeze(-1)  # -inf for rows without keys
            # A row with a visible key sums to >= 1 (its maximum gives exp(0)); one without sums to 0 and stays 0.
            scores.div_(row_sum.clamp_(min=1.0))
            torch.bmm(scores, values, out=slot_out[start:stop])
        slot_lse = slot_lse.view(-1)
        out, lse = _merge_slots(slot_out.view(-1, d_v), slot_lse, layout.out_index, layout.n_out)
        ctx.save_for_backward(*rows, slot_lse, out, lse, relative_table)
        ctx.layout = layout  # integer indices, a bool mask and numbers: nothing autograd tracks
        ctx.shared_keys = k_rows is q_rows  # shared-QK: one gradient buffer for both
        return out.to(q_rows.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        saved = ctx.saved_tensors
        rows = _GroupRows(*saved[: len(_GroupRows._fields)])
        slot_lse, out, lse, relative_table = saved[len(_GroupRows._fields) :]
        q_rows, k_rows, v_rows, key_factor, query_index, key_index, value_index = rows
        layout = ctx.layout
        n_windows, w, scale, stride = layout.n_windows, layout.width, layout.scale, layout.stride
        self_column, out_index = layout.self_column, layout.out_index
        dtype = out.dtype
        c, d, d_v = query_index.shape[0] // n_windows, q_rows.shape[-1], v_rows.shape[-1]
        grad_out = grad_out.to(dtype).contiguous()
        delta = (grad_out * out).sum(dim=-1)  # [n_out]: D_p
        answered = out_index >= 0
        row = out_index.clamp(min=0)
        # w_i, 0 for empty slots and rows without keys; probabilities are exp(s − lse_i), 0 where lse_i = -inf.
        share = (slot_lse - lse[row]).exp().masked_fill_(~answered | torch.isneginf(slot_lse), 0.0)
        lse_shift = slot_lse.masked_fill(torch.isneginf(slot_lse), math.inf).view(n_windows, c, 1)
        share, slot_delta = share.view(n_windows, c, 1), delta[row].view(n_windows, c, 1)
        # One spare row takes the gradients of -1 indices (empty slots, zero key rows).
        grad_q = torch.zeros(q_rows.shape[0] + 1, d, dtype=dtype, device=out.device)
        grad_k = torch.zeros(k_rows.shape[0] + 1, d, dtype=dtype, device=out.device)
        grad_v = torch.zeros(v_rows.shape[0] + 1, d_v, dtype=dtype, device=out.device)
        query_target = torch.where(query_index >= 0, query_index, q_rows.shape[0])
        key_target = torch.where(key_index >= 0, key_index, k_rows.shape[0])
        value_target = torch.where(value_index >= 0, value_index, v_rows.shape[0])
        hidden = None if layout.mask is None else ~layout.mask
        relative = layout.relative_columns(relative_table, c)
        grad_table = None
        if relative is not None and ctx.needs_input_grad[3]:
            grad_table = torch.zeros(relative_table.shape, dtype=dtype, device=out.device)
        for start, stop, probs in _window_groups(n_windows, c, w, dtype, out.device):
            g = stop - start
            queries, keys, values = rows.group(start, stop, c, stride, w, dtype, scale)
            torch.bmm(queries, keys.transpose(1, 2), out=probs)
            if relative is not None:
                probs.add_(relative.bias(start, stop))
            _hide(probs, start, stop, hidden, layout.first, layout.last, self_column)
            probs.sub_(lse_shift[start:stop]).exp_().mul_(share[start:stop])  # w_i · P
            # Empty slots have w_i = 0, so whichever row their gradient is read from adds nothing.
            grad_slot = grad_out.index_select(0, row[start * c : stop * c]).view(g, c, d_v)  # dC_p
            grad_scores = torch.bmm(grad_slot, values.transpose(1, 2)).sub_(slot_delta[start:stop]).mul_(probs)
            if self_column is not None:
                _self_diagonal(grad_scores, self_column).zero_()  # the self score is a constant
            if grad_table is not None:
                relative.add_grad(grad_table, grad_scores, start, stop)
            window_rows = (
                torch.arange(start, stop, device=out.device)[:, None] * stride + torch.arange(w, device=out.device)
            ).view(-1)  # [g·w]
            grad_v.index_add_(0, value_target[window_rows], torch.bmm(probs.transpose(1, 2), grad_slot).view(-1, d_v))
            grad_k.index_add_(0, key_target[window_rows], torch.bmm(grad_scores.transpose(1, 2), queries).view(-1, d))
            grad_q.index_add_(0, query_target[start * c : stop * c], torch.bmm(grad_scores, keys).view(-1, d))
        if scale != 1.0:
            grad_q.mul_(scale)  # the keys' gradient got the scale through the scaled queries
        grad_q, grad_k, grad_v = grad_q[:-1], grad_k[:-1], grad_v[:-1]
        if key_factor is not None:
            # Through y = x·s with s = (mean(x²) + eps)^(-1/2) / sqrt(d):  dx = s·(dy − x·s²·(dy·x)).
            dot = (grad_k * k_rows).sum(dim=-1, keepdim=True)
            grad_k.addcmul_(k_rows, dot.mul_(key_factor.square()), value=-1.0).mul_(key_factor)
        if ctx.shared_keys:
            grad_q.add_(grad_k)
            grad_k = None
        else:
            grad_k = grad_k.to(k_rows.dtype)
        grad_table = None if grad_table is None else grad_table.to(relative_table.dtype)
        return grad_q.to(q_rows.dtype), grad_k, grad_v.to(v_rows.dtype), grad_table, None


class RelativeColumns:
    """Relative-position logits of gathered windows (`longattn.relative_logits`): slot s of window u reads row
    `out_index[s]` of the table `[n_out, 2M + 1]` (the query's own row), at the column of the clipped distance
    `key_position[window row] − query_position[s]`. Index tensors only; the bias of a group is gathered when needed
    (forward, and again in backward), so nothing of size U·c·w is kept."""

    def __init__(self, table, query_position, key_position, out_index, c, stride, w):
        self.table, self.c, self.stride, self.w = table, c, stride, w
        self.reach = (table.shape[1] - 1) // 2
        self.row = out_index.clamp(min=0)  # unanswered slots read row 0: their scores count nowhere
        self.query_position, self.key_position = query_position, key_position

    @classmethod
    def of(cls, table, query_position, key_position, out_index, c, stride, w) -> RelativeColumns | None:
        return None if table is None else cls(table, query_position, key_position, out_index, c, stride, w)

    def _index(self, start: int, stop: int) -> tuple[Tensor, Tensor]:
        c, stride, w = self.c, self.stride, self.w
        rows = self.row[start * c : stop * c].view(-1, c, 1)  # [g, c, 1]
        window_rows = torch.arange(start, stop, device=rows.device)[:, None] * stride + torch.arange(
            w, device=rows.device
        )  # [g, w]
        distance = self.key_position[window_rows][:, None, :] - self.query_position[start * c : stop * c].view(-1, c, 1)
        return rows, distance.clamp_(-self.reach, self.reach).add_(self.reach)  # [g, c, 1], [g, c, w]

    def bias(self, start: int, stop: int) -> Tensor:
        """`[g, c, w]` logits of windows start..stop."""
        rows, column = self._index(start, stop)
        return self.table[rows, column]

    def add_grad(self, grad_table: Tensor, grad_scores: Tensor, start: int, stop: int) -> None:
        """Adds the scores' gradient `[g, c, w]` onto the table entries they read."""
        rows, column = self._index(start, stop)
        grad_table.index_put_((rows.expand_as(column), column), grad_scores.to(grad_table.dtype), accumulate=True)


def _window_groups(n_windows: int, c: int, w: int, dtype: torch.dtype, device: torch.device):
    """`(start, stop, scores)` over groups of windows, `scores` a reused `[stop - start, c, w]` buffer of about
    `_GATHERED_GROUP_ELEMENTS` elements."""
    step = max(1, _GATHERED_GROUP_ELEMENTS // (c * w))
    buffer = torch.empty(min(step, n_windows), c, w, dtype=dtype, device=device)
    for start in range(0, n_windows, step):
        stop = min(n_windows, start + step)
        yield start, stop, buffer[: stop - start]


class _GroupRows(NamedTuple):
    """The rows and indices `_GatheredWindows` reads (saved for backward as they are), and their gather per group of
    windows."""

    q_rows: Tensor  # [Nq, d]
    k_rows: Tensor  # [Nk, d]
    v_rows: Tensor  # [Nv, d_v]
    key_factor: Tensor | None  # [Nk, 1]
    query_index: Tensor  # [U·c]
    key_index: Tensor  # [R]
    value_index: Tensor  # [R]

    def group(
        self, start: int, stop: int, c: int, stride: int, w: int, dtype: torch.dtype, scale: float
    ) -> tuple[Tensor, Tensor, Tensor]:
        """Windows start..stop gathered in `dtype`: queries `[g, c, d]` (times `scale`) and key / value windows
        `[g, w, d]` (keys times `key_factor` when given). A -1 index reads row 0: such a key is hidden by the mask
        and such a slot answers nothing, so its value never counts (and its gradient goes nowhere)."""
        query_index = self.query_index[start * c : stop * c].clamp(min=0)
        queries = self.q_rows.index_select(0, query_index).to(dtype).view(stop - start, c, -1)
        if scale != 1.0:
            queries.mul_(scale)
        span = slice(start * stride, (stop - 1) * stride + w)  # the key rows the group's windows cover
        key_index, value_index = self.key_index[span].clamp(min=0), self.value_index[span].clamp(min=0)
        keys = self.k_rows.index_select(0, key_index).to(dtype)
        if self.key_factor is not None:
            keys.mul_(self.key_factor.index_select(0, key_index))
        values = self.v_rows.index_select(0, value_index).to(dtype)
        return queries, _windows(keys, 0, stop - start, stride, w), _windows(values, 0, stop - start, stride, w)


def _hide(
    scores: Tensor,
    start: int,
    stop: int,
    hidden: Tensor | None,
    first: Tensor | None,
    last: Tensor | None,
    self_column: int | None,
) -> None:
    """Hidden keys of windows start..stop, `scores [g, c, w]`, to -inf (`hidden`: the negated `mask` of
    `attend_gathered_windows`; `first`, `last` as there), then Reformer's self rule (see `attend_windows`)."""
    if hidden is not None and hidden.shape[1] == 1:
        # One mask row per window (routing's used slots, LSH's real keys): adding a `[g, 1, w]` bias of 0 / -inf
        # runs ~10x faster than a `masked_fill_` broadcast over the c query rows (same scores).
        bias = torch.zeros(scores.shape[0], 1, scores.shape[2], dtype=scores.dtype, device=scores.device)
        scores.add_(hide_exactly(bias, hidden[start:stop], inplace=True))
    elif hidden is not None:
        hide_exactly(scores, hidden[start:stop], inplace=True)
    if first is not None:
        c, w = scores.shape[1], scores.shape[2]
        columns = torch.arange(w, device=scores.device)
        lo, hi = first[start * c : stop * c].view(-1, c, 1), last[start * c : stop * c].view(-1, c, 1)
        hide_exactly(scores, (columns < lo) | (columns >= hi), inplace=True)
    if self_column is not None:
        _self_diagonal(scores, self_column).fill_(SELF_SCORE)


def _merge_slots(slot_out: Tensor, slot_lse: Tensor, out_index: Tensor, n_out: int) -> tuple[Tensor, Tensor]:
    """Merge slot outputs `[S, d_v]` with log-normalisers `[S]` into output rows `out_index [S]` (-1: dropped):
    `(out [n_out, d_v], lse [n_out])`, zeros and -inf for rows no slot answers or whose slots saw no key."""
    answered = out_index >= 0
    row = out_index.clamp(min=0)
    lse_answered = slot_lse.masked_fill(~answered, NO_KEY_LSE)
    shift = slot_lse.new_full((n_out,), NO_KEY_LSE).scatter_reduce_(0, row, lse_answered, reduce="amax")
    shift.masked_fill_(torch.isneginf(shift), 0.0)
    weight = (lse_answered - shift[row]).exp_()  # exactly 0 for dropped slots and slots without keys
    total = slot_lse.new_zeros(n_out).index_add_(0, row, weight)
    lse = torch.where(total > 0, shift + total.log(), NO_KEY_LSE)
    weight.div_(torch.where(total > 0, total, 1.0)[row])
    out = slot_out.new_zeros(n_out, slot_out.shape[-1]).index_add_(0, row, slot_out.mul_(weight.unsqueeze(-1)))
    return out, lse


def attend_gathered_windows(
    q_rows: Tensor, k_rows: Tensor, v_rows: Tensor, *, relative_table: Tensor | None = None, **layout: Any
) -> Tensor:
    """`attend_windows` over rows gathered by index, its slots merged into output rows: memory O(n·d) + indices.

    Content-based kinds sort (LSH) or select (routing) their tokens; instead of materialising the sorted copies
    and keeping them (and the probabilities) for backward, they pass the unsorted rows and where each slot comes
    from: slot s of window u (row u·c + s) is query row `query_index[u·c + s]`, window u's keys are rows
    `key_index[u·stride .. u·stride + w]`, and its output goes to row `out_index[u·c + s]`, merged with the other
    slots of that row by log-sum-exp (one softmax over the union of their keys, counted with multiplicity).
    Rows are gathered group by group in forward and again in backward (`_GatheredWindows`), so only
    O(n·d) floats, the indices, the mask and one log-sum-exp per slot are kept. No dropout (use `attend_windows`).

    Which keys a slot sees is given by `mask`, by a range of window columns `first <= j < last` per slot (a
    causal band within a cluster or bucket: two integers per query instead of w flags), or by both. The keywords
    but `relative_table` are declared once, with their defaults, as the fields of `_WindowLayout`.

    Args:
        q_rows: Query rows `[Nq, d]`.
        k_rows: Key rows `[Nk, d]`.
        v_rows: Value rows `[Nv, d_v]`.
        query_index: Long `[U·c]`, the query row of every slot (-1: an empty slot; its `out_index` must be -1).
        key_index: Long `[R]`, R >= (U − 1)·stride + w: the key row of every window row (-1: no key; the mask or
            the column range must hide it).
        value_index: Long `[R]`, likewise for values.
        out_index: Long `[U·c]`, the output row every slot answers (-1: none).
        n_out: Output rows.
        chunk: c, query slots per window (U·c / c windows).
        width: w, key rows per window.
        stride, scale: As in `attend_windows`.
        mask: Bool `[U, c or 1, w]`, True = visible; None: every column (within `first`/`last`).
        first, last: Long `[U·c]`: slot s sees window columns `first[s] <= j < last[s]` only; None: no limit.
        self_column: As in `attend_windows`.
        key_norm_eps: Keys are the rows of k_rows normalised as `normalize_keys(k_rows, key_norm_eps)` (Reformer's
            shared-QK keys), row by row as they are gathered, so no normalised copy is kept; None: as they are.
            Pass the same tensor as q_rows and k_rows for shared queries and keys.
        relative_table: Optional relative-position logits `[n_out, 2M + 1]` (`relative_logits.relative_logit_table`
            of output row p, already scaled), added to the scores differentiably: slot s reads row `out_index[s]`
            at the clipped distance `key_position − query_position`.
        query_position: Long `[U·c]`, the sequence position of every slot (with `relative_table`).
        key_position: Long `[R]`, the sequence position of every window row (any value where there is no key).

    Returns:
        `[n_out, d_v]` in q_rows' dtype; zeros for a row no slot answers or whose slots see no key.
    """
    layout = _WindowLayout(**layout)
    width, stride = layout.width, layout.stride
    if width > stride and width % stride:
        raise ValueError(f"overlapping windows must be a multiple of the stride: w={width}, stride={stride}.")
    if (layout.first is None) != (layout.last is None):
        raise ValueError("`first` and `last` go together: give both (a column range per slot) or neither.")
    if relative_table is not None and (layout.query_position is None or layout.key_position is None):
        raise ValueError("`relative_table` needs `query_position` and `key_position` (where each pair lies).")
    layout = layout._replace(scale=float(layout.scale))
    return _GatheredWindows.apply(q_rows, k_rows, v_rows, relative_table, layout)


# A query's own key under Reformer's self rule, on the kernel: between visible (0) and hidden (-P, P the numerics
# HALF_HIDDEN_PENALTY), so it weighs exactly nothing beside any visible key and everything when only hidden keys are
# left. Whether a row saw a key comes from the mask (and the self column), never from its log-sum-exp.
_SELF_PENALTY = HALF_HIDDEN_PENALTY / 2


class _KernelWindows(torch.autograd.Function):
    """Attention of query chunks over their key windows on the xformers kernel, returning (out, lse) with the
    gradient of both.

    The kernel's backward knows only dO: it computes dS = P ∘ (dP − D) with D = rowsum(dO ∘ O). The log-sum-exp's
    gradient g adds P ∘ g; one extra value column gives it exactly: zeros in V (dP unchanged), -1 in O and g in dO,
    so that D becomes rowsum(dO ∘ O) − g.
    """

    @staticmethod
    def forward(ctx, q, k, v, bias, scale, seen):
        kernel = current_kernel()
        out, lse = kernel.forward(q, k, v, bias, scale=scale)  # [B, c, 1, d_v], [B, 1, c]
        # seen: bool [B, 1, c], the rows the mask (or the self column) shows a key
        out = torch.where(seen.transpose(1, 2)[..., None], out, 0.0)
        lse = torch.where(seen, lse, NO_KEY_LSE)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.bias, ctx.scale, ctx.kernel = bias, scale, kernel
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, grad_lse):
        q, k, v, out, lse = ctx.saved_tensors
        d, d_v = q.shape[-1], v.shape[-1]
        width = -(-(max(d, d_v) + 1) // 8) * 8  # the kernels take one head dim for q, k and v, a multiple of 8
        seen = torch.isfinite(lse)  # [B, 1, c]
        rows = seen.transpose(1, 2)[..., None]  # [B, c, 1, 1]
        grad_out = torch.where(rows, grad_out, 0.0) if grad_out is not None else torch.zeros_like(out)
        g = torch.where(seen, grad_lse, 0.0) if grad_lse is not None else torch.zeros_like(lse)
        extra = torch.zeros(*out.shape[:-1], width - d_v, dtype=out.dtype, device=out.device)
        out_aug, grad_aug = extra.clone(), extra.clone()
        out_aug[..., 0] = -1.0
        grad_aug[..., 0] = g.transpose(1, 2).to(out.dtype)
        dq, dk, dv = ctx.kernel.backward(
            torch.cat([grad_out, grad_aug], dim=-1),
            torch.cat([out, out_aug], dim=-1),
            torch.where(seen, lse, 0.0),
            F.pad(q, (0, width - d)),
            F.pad(k, (0, width - d)),
            F.pad(v, (0, width - d_v)),
            ctx.bias,
            scale=ctx.scale,
        )
        return dq[..., :d], dk[..., :d], dv[..., :d_v], None, None, None


def attend_windows_on_kernel(q, k, v, mask, *, stride, scale, dropout_p=0.0, self_column=None) -> tuple[Tensor, Tensor]:
    """`attend_windows` on the xformers kernel (`executor_xformers.current_kernel()`): the same arguments, with their
    types and shapes (less `keep_probs`, a memory choice of the PyTorch kernel) and results.

    The key windows are copied out (`[B, w, d]`; the kernel reads whole tensors, not overlapping views), the mask
    becomes an additive bias (-P for hidden keys, P = `numerics.HALF_HIDDEN_PENALTY`, -P / 2 for the self column, which
    keeps Reformer's rule: the own key counts only when nothing else is visible), and the chunks ride in the
    kernel's batch dim. A row with no visible key returns zeros and `lse = -inf`. Under the self rule a row that
    sees only its own key reports `lse = q·k_self − P / 2` where `attend_windows` reports `SELF_SCORE`;
    both weigh nothing beside a round that sees anything else, and rounds that see only the own key share its value.

    Raises:
        ValueError: `dropout_p > 0` (the kernel's forward with log-sum-exp has no dropout).
    """
    if dropout_p > 0:
        raise ValueError(
            "attention dropout is not available on the xformers windows (its forward with "
            "log-sum-exp has none); set the dropout probability to 0 or use the 'torch' back end."
        )
    w = mask.shape[-1]
    chunks, c, d = q.shape
    visible = mask if mask.dtype == torch.bool else ~torch.isneginf(mask)  # [B, c or 1, w]
    aligned = -(-w // 8) * 8  # bias rows 8-aligned in memory, as the kernels read them
    bias = torch.zeros(chunks, 1, c, aligned, dtype=q.dtype, device=q.device)[..., :w]
    bias.masked_fill_(~visible.unsqueeze(1).expand(chunks, 1, c, w), -HALF_HIDDEN_PENALTY)
    if self_column is not None:
        bias[:, 0, :, self_column : self_column + c].diagonal(dim1=-2, dim2=-1).fill_(-_SELF_PENALTY)
    keys = _windows(k.contiguous(), 0, chunks, stride, w)  # autograd folds the overlapping windows back
    values = _windows(v.contiguous(), 0, chunks, stride, w)
    # Rows that see a key, from the mask: every row when the own key stands in for an empty window.
    seen = visible.any(dim=-1).expand(chunks, c) if self_column is None else visible.new_ones(chunks, c)
    out, lse = _KernelWindows.apply(
        q.unsqueeze(2), keys.unsqueeze(2), values.unsqueeze(2), bias, float(scale), seen.unsqueeze(1)
    )
    return out.squeeze(2), lse.squeeze(1)


def select_windows_executor(
    backend: str,
    steps: StepExecutors,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    key_padding_mask: Tensor | None,
    relative_embedding: Tensor | None,
    dropout_p: float,
    causal: bool,
):
    """`backends.select_step_executor` for a family run on the window executors (pattern "windows":
    `attend_windows` and its kernel) of a call on q, k, v `[b, h, n, d]` with this key padding mask and relative
    embedding (each a tensor or None), dropout and causality: the executor of `steps` that `backend` runs.

    Raises:
        ValueError: As `select_step_executor`, with the reasons the named back end cannot run the call.
    """
    flags = dict(key_padding=key_padding_mask is not None, relative_logits=relative_embedding is not None)
    return select_step_executor(backend, steps, q, k, v, dropout_p=dropout_p, causal=causal, **flags)


# ---------------------------------------------------------------------------------------------- the executor
def _check_rotations(rotations: Tensor, *, heads: int, head_dim: int, num_buckets: Buckets | None) -> None:
    """Refuse rotations that are not a floating-point `[h or 1, d, r, Σ factors/2]` tensor (r >= 1).

    Raises:
        ValueError: Naming `rotations`, its shape or dtype, and the shape expected.
    """
    columns = None if num_buckets is None else sum(f // 2 for f in hash_factors(num_buckets))
    expected = f"[{heads} or 1, {head_dim}, num_hashes >= 1, {columns if columns else 'num_buckets / 2 >= 1'}]"
    if not isinstance(rotations, Tensor) or not rotations.is_floating_point():
        raise ValueError(
            f"rotations must be a floating-point tensor {expected}, got "
            f"{rotations.dtype if isinstance(rotations, Tensor) else type(rotations).__name__}"
        )
    shape = tuple(rotations.shape)
    if (
        len(shape) != 4
        or shape[0] not in (1, heads)
        or shape[1] != head_dim
        or shape[2] < 1
        or shape[3] < 1
        or (columns is not None and shape[3] != columns)
    ):
        raise ValueError(f"rotations must have shape {expected}, got {shape}")


class _LshCall(NamedTuple):
    """One call of `lsh_attention`, checked (`_checked_call`), then with its rotations (`_with_rotations`): what
    its executors read. Its fields are the keyword arguments of `lsh_attention_dense`."""

    rotations: Tensor | None  # [h or 1, d, r, Σ factors/2]; None until drawn
    num_buckets: Buckets | None
    bucket_size: int
    num_chunks_before: int
    num_chunks_after: int
    causal: bool
    key_padding_mask: Tensor | None
    dropout_p: float
    document_ids: Tensor | None
    relative_embedding: Tensor | None


def lsh_attention(
    qk: Tensor, v: Tensor, *, num_hashes: int, bucket_size: int, num_buckets: Buckets | None = None,
    num_chunks_before: int = 1, num_chunks_after: int = 0, causal: bool = False,
    key_padding_mask: Tensor | None = None, rotations: Tensor | None = None, seed: int | None = None,
    dropout_p: float = 0.0, backend: str = "auto", document_ids: Tensor | None = None,
    relative_embedding: Tensor | None = None,
) -> Tensor:  # fmt: skip
    """Reformer LSH attention with shared queries and keys, in O(n·log n + n·r·c·w) time.

    See the module docstring for the mechanism. Costs r·n·(1 + before + after)·c scores per head, never n².

    Args:
        qk: Shared queries/keys `[b, h, n, d]` (before normalisation).
        v: Values `[b, h, n, d_v]`.
        num_hashes: Hash rounds r (ignored when `rotations` is given: its size decides).
        bucket_size: Chunk length c of the sorted sequence.
        num_buckets: Buckets per round: an even int, or a tuple of even factors (a factorised hash). Default:
            `default_num_buckets(n, bucket_size)` without `rotations`, one hash of `2 · rotations.shape[-1]`
            buckets with them.
        num_chunks_before: Earlier chunks each chunk also attends to (causal: the band of earlier keys of the same
            bucket is `bucket_size · num_chunks_before` long).
        num_chunks_after: Later chunks each chunk also attends to (not used when causal).
        causal: A query sees only earlier keys of its own bucket (see the module docstring).
        key_padding_mask: Bool `[b, n]`, True = real token.
        document_ids: Integer `[b, n]`, the document of each token of packed rows (contiguous runs of one id): a
            bucket holds the tokens of one document only (`document_buckets`), and chunk neighbours of another
            document are hidden, so no query attends to another document's key.
        rotations: Explicit rotations `[h or 1, d, r, Σ factors/2]` (e.g. transformers'); override the seed.
        seed: Seed of the rotations (`lsh_rotations`); None = fresh random rotations.
        dropout_p: Dropout on the attention probabilities.
        backend: `"auto"` or `"torch"` (both the windowed kernel), `"xformers"` (the same windows on xformers'
            kernel, `attend_windows_on_kernel`; CUDA, no dropout; `"auto"` does not pick it until it is measured on
            a GPU), or `"reference"`: `lsh_attention_dense` at the same rotations, O(r · n²) memory, for tests (it
            equals the kernel on real tokens; padded queries and the dropout draws may differ). `"flex"` cannot
            run LSH attention. Each back end's executor: `LSH_STEPS`.
        relative_embedding: Optional r `[2M + 1, d]`: relative-position logits (`longattn.relative_logits`), scale
            1/sqrt(d) · q·r of the clipped distance between the original positions of each pair a chunk computes.

    Returns:
        Output `[b, h, n, d_v]`.

    Raises:
        ValueError: qk and v that are not floating-point tensors `[b, h, n, d]`, `[b, h, n, d_v]` of one dtype
            and device, `num_hashes` or `bucket_size` below 1, negative chunk counts, a causal call without an
            earlier chunk, invalid `num_buckets` or `rotations`, a non-bool `causal`, a mask that is not bool
            `[b, n]`, `dropout_p` outside [0, 1), or a `backend` that is unknown or cannot run LSH attention (the
            message says why).
    """
    given = _LshCall(
        rotations, num_buckets, bucket_size, num_chunks_before, num_chunks_after, causal, key_padding_mask,
        dropout_p, document_ids, relative_embedding,
    )  # fmt: skip
    call = _checked_call(qk, v, given, num_hashes=num_hashes, seed=seed, backend=backend)
    if is_empty(qk, qk):
        return empty_attention(qk, qk, v)
    # Padding may hold anything: zeroed, it hashes to a fixed bucket and its value adds nothing. A query whose
    # whole row is padding then attends to its own (zero) value only: zeros, the rule of every op.
    qk, v = inert_padding(call.key_padding_mask, qk, v)
    call = _with_rotations(call, qk, num_hashes=num_hashes, seed=seed)
    attention = select_windows_executor(
        backend, LSH_STEPS, qk, qk, v, call.key_padding_mask, call.relative_embedding, call.dropout_p, call.causal
    )
    return attention(qk, v, call)


def _checked_call(qk: Tensor, v: Tensor, given: _LshCall, *, num_hashes: int, seed: int | None, backend: str):
    """The arguments of `lsh_attention` checked, in its documented order: an `_LshCall` (rotations as given).

    Raises:
        ValueError: As `lsh_attention`.
    """
    b, h, n, _ = check_qkv(qk, qk, v, names=("qk", "qk", "v"))
    d = qk.shape[3]
    bucket_size = check_positive_int(
        "bucket_size", given.bucket_size, meaning="the chunk length of the sorted sequence"
    )
    num_chunks_before = check_positive_int("num_chunks_before", given.num_chunks_before, minimum=0)
    num_chunks_after = check_positive_int("num_chunks_after", given.num_chunks_after, minimum=0)
    causal = check_flag("causal", given.causal)
    if causal and num_chunks_before < 1:
        raise ValueError("causal LSH needs num_chunks_before >= 1 (the band of earlier keys is empty otherwise).")
    key_padding_mask = check_token_mask("key_padding_mask", given.key_padding_mask, b, n, device=qk.device)
    document_ids = check_document_ids(given.document_ids, b, n, device=qk.device)
    dropout_p = check_dropout(given.dropout_p)
    if given.num_buckets is not None:
        hash_factors(given.num_buckets)
    if given.rotations is None:
        check_positive_int("num_hashes", num_hashes, meaning="the number of hash rounds")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise ValueError(f"seed must be an int or None, got {seed!r}")
    else:
        _check_rotations(given.rotations, heads=h, head_dim=d, num_buckets=given.num_buckets)
    LSH_STEPS.check(backend)
    return given._replace(
        bucket_size=bucket_size,
        num_chunks_before=num_chunks_before,
        num_chunks_after=num_chunks_after,
        causal=causal,
        key_padding_mask=key_padding_mask,
        dropout_p=dropout_p,
        document_ids=document_ids,
        relative_embedding=check_relative_embedding(given.relative_embedding, qk),
    )


def _with_rotations(call: _LshCall, qk: Tensor, *, num_hashes: int, seed: int | None) -> _LshCall:
    """`call` with rotations: those given, else drawn (`lsh_rotations`, from `seed`) for its bucket count, by
    default `default_num_buckets` of the length."""
    if call.rotations is not None:
        return call
    _, h, n, d = qk.shape
    num_buckets = default_num_buckets(n, call.bucket_size) if call.num_buckets is None else call.num_buckets
    rotations = lsh_rotations(
        heads=h, head_dim=d, num_hashes=num_hashes, num_buckets=num_buckets, seed=seed, device=qk.device
    )
    return call._replace(rotations=rotations, num_buckets=num_buckets)


# ---------------------------------------------------------------------------------------------- LSH's executors
def _lsh_dense(qk: Tensor, v: Tensor, call: _LshCall) -> Tensor:
    """The `"reference"` back end: the dense form (`lsh_attention_dense`) at the SAME rotations and bucket count,
    so both hash every token alike."""
    out, _ = lsh_attention_dense(qk, qk, v, **call._asdict())
    return out


def _lsh_on_windows(qk: Tensor, v: Tensor, call: _LshCall) -> Tensor:
    """The PyTorch executor (`"auto"`, `"torch"`). Without dropout, neither the sorted copies nor the probabilities
    are kept: the kernel gathers the rows of each group of chunks in forward and again in backward, and merges the
    rounds of every position by log-sum-exp (`attend_gathered_windows`). With dropout, `attend_windows` on the sorted
    copies."""
    rounds = _sorted_rounds(qk, v, call)
    relative = _relative_positions(qk, call, rounds)
    if call.dropout_p == 0.0:
        return _gathered_rounds(qk, v, call, rounds, relative)
    return _copied_rounds(qk, v, call, rounds, relative, attend_windows)


def _lsh_on_kernel(qk: Tensor, v: Tensor, call: _LshCall) -> Tensor:
    """The `"xformers"` back end: the windows of the sorted copies on xformers' kernel (`attend_windows_on_kernel`)."""
    rounds = _sorted_rounds(qk, v, call)
    return _copied_rounds(qk, v, call, rounds, _relative_positions(qk, call, rounds), attend_windows_on_kernel)


LSH_STEPS = StepExecutors(
    "LSH",
    "windows",
    {"torch": _lsh_on_windows, "reference": _lsh_dense, "xformers": _lsh_on_kernel},
    refused=_UNSUPPORTED_BACKENDS,
)
"""LSH attention's executor per back end, `executor(qk, v, call) -> out`: `"auto"` is always the windowed kernel;
`"xformers"` runs its windows as one kernel call (explicit only)."""


class _SortedRounds(NamedTuple):
    """The layout of one call's sorted hash rounds (`_sorted_rounds`): sizes, the rows and integer indices.

    One segment per (batch, head, round), each `gap` zero chunks followed by its nc sorted chunks, plus `before`
    zero chunks in front and `after` at the end. Chunk u's keys, itself and its neighbours, are then the rows
    u·c .. u·c + w of one tensor (a strided window, no copy), and the gaps stand for the chunks beyond a round's
    ends. Gap chunks are also queried (harmlessly; 1/(nc+gap) of the work).
    """

    c: int  # chunk length, clamped to the sequence
    w: int  # keys of a chunk's window
    before: int  # chunks before, clamped
    after: int  # chunks after, clamped (0 when causal)
    n_queries: int  # query chunks U
    qk_rows: Tensor  # [b·h·n, d] (`head_rows`)
    qk_row_of: Callable[[Tensor, Tensor, Tensor], Tensor]
    v_rows: Tensor  # [b·h·n, d_v]
    v_row_of: Callable[[Tensor, Tensor, Tensor], Tensor]
    buckets: Tensor  # [b, h, r, n_pad], the alignment padding in the padding bucket
    padding_bucket: int
    order: Tensor  # [b, h, r, n_pad]: positions by bucket, then position
    rank: Tensor  # [b, h, r, n_pad]: the sorted index of each position
    buffer_row: Tensor  # [b, h, r, n_pad]: query-buffer row of (b, h, r, position)
    query_index: Tensor  # [U·c]: the qk row of each query-buffer row (-1: none)
    key_index: Tensor  # [(before + U + after)·c]: the qk row of each key-buffer row (-1: a zero chunk)
    value_index: Tensor  # likewise, rows of v
    key_rows: Tensor  # [b·h·r·n]: key-buffer rows of the real positions
    out_index: Tensor  # [U·c]: the output row (b · h + head) · n + position each query-buffer row answers
    mask: Tensor  # bool [U, 1 or c, w]: the real keys (of the query's document) of each window


def _sorted_rounds(qk: Tensor, v: Tensor, call: _LshCall) -> _SortedRounds:
    """Hash every token (`lsh_buckets`), sort each round by (bucket, position) and lay the rounds out.

    Sizes beyond the sequence change nothing (one chunk then holds a whole round, and a window never reaches past
    its round), so they are clamped to what the sequence needs instead of being allocated. The bucket count was
    taken from the size as given, so every token hashes as the reference hashes it.
    """
    b, h, n, _ = qk.shape
    r, device = call.rotations.shape[2], qk.device
    c = min(call.bucket_size, n)
    n_chunks = -(-n // c)
    before = min(call.num_chunks_before, n_chunks - 1)
    after = 0 if call.causal else min(call.num_chunks_after, n_chunks - 1)
    n_pad = n_chunks * c
    padding = call.key_padding_mask
    valid = torch.ones(b, n, dtype=torch.bool, device=device) if padding is None else padding.bool()
    segment = before + after + n_chunks  # chunks per segment, its gap first
    n_queries = b * h * r * segment  # query chunks
    w = (before + after + 1) * c
    qk_rows, qk_row_of = head_rows(qk)  # [b·h·n, d] views, and the row of (batch, head, position)
    v_rows, v_row_of = head_rows(v)
    with torch.no_grad():
        buckets, padding_bucket = _padded_buckets(qk, call, valid, n_pad)  # [b, h, r, n_pad]
        positions = torch.arange(n_pad, device=device)
        order = (buckets * n_pad + positions).argsort(dim=-1)  # [b, h, r, n_pad]: by bucket, then position
        rank = torch.empty_like(order).scatter_(-1, order, positions.expand_as(order))  # sorted index of each
        bi, hi, ri = _grid(b, h, r, device)
        first_row = ((bi * h + hi) * r + ri) * segment + before + after  # [b, h, r, 1], first chunk of a segment
        buffer_row = first_row * c + rank  # [b, h, r, n_pad]: query-buffer row of (b, h, r, position)
        real, where = positions[:n], buffer_row[..., :n]
        query_index = _scatter_index(n_queries * c, where, qk_row_of(bi, hi, real))
        value_index = _scatter_index(n_queries * c, where, v_row_of(bi, hi, real))
        # Keys: the query buffer with zero chunks around it.
        key_index, value_index = (
            F.pad(index, (before * c, after * c), value=-1) for index in (query_index, value_index)
        )
        key_rows = before * c + where.reshape(-1)  # key-buffer rows of the real positions
        row_valid = _at_key_rows(valid[:, None, None, :].expand(b, h, r, n), key_rows, key_index.shape[0], False)
        mask = _windows(row_valid[:, None], 0, n_queries, c, w).view(n_queries, 1, w)  # [U, 1, w]
        if call.document_ids is not None and not call.causal:
            # Chunk neighbours may hold another document (causal queries see their own bucket only, one document).
            documents = call.document_ids[:, None, None, :].expand(b, h, r, n)
            row_document = _at_key_rows(documents, key_rows, key_index.shape[0], -1)
            mask = mask & _same_in_window(row_document, before * c, n_queries, c, w)  # [U, c, w]
        out_index = _scatter_index(n_queries * c, where, (bi * h + hi) * n + real)
    return _SortedRounds(
        c, w, before, after, n_queries, qk_rows, qk_row_of, v_rows, v_row_of, buckets, padding_bucket, order, rank,
        buffer_row, query_index, key_index, value_index, key_rows, out_index, mask,
    )  # fmt: skip


def _padded_buckets(qk: Tensor, call: _LshCall, valid: Tensor, n_pad: int) -> tuple[Tensor, int]:
    """The bucket of every position in every round `[b, h, r, n_pad]` (packed documents in buckets of their own),
    the alignment padding in the padding bucket after every real token; and the padding bucket."""
    factors = (2 * call.rotations.shape[-1],) if call.num_buckets is None else hash_factors(call.num_buckets)
    buckets = lsh_buckets(qk, call.rotations, valid=valid, num_buckets=call.num_buckets)  # [b, h, r, n]
    padding_bucket = math.prod(factors)
    if call.document_ids is not None:
        buckets, padding_bucket = document_buckets(buckets, call.document_ids, padding_bucket)
    return F.pad(buckets, (0, n_pad - qk.shape[2]), value=padding_bucket), padding_bucket


def _grid(b: int, h: int, r: int, device: torch.device) -> tuple[Tensor, Tensor, Tensor]:
    """The batch `[b, 1, 1, 1]`, head `[1, h, 1, 1]` and round `[1, 1, r, 1]` indices, to broadcast together."""
    return (
        torch.arange(b, device=device).view(b, 1, 1, 1),
        torch.arange(h, device=device).view(1, h, 1, 1),
        torch.arange(r, device=device).view(1, 1, r, 1),
    )


def _at_key_rows(values: Tensor, key_rows: Tensor, size: int, fill: bool | int) -> Tensor:
    """A `[size]` key-buffer column: `values` `[b, h, r, n]` at the rows `key_rows` of their positions, `fill`
    elsewhere (the zero chunks and gaps)."""
    column = torch.full((size,), fill, dtype=values.dtype, device=values.device)
    column[key_rows] = values.reshape(-1)
    return column


def _same_in_window(column: Tensor, lead: int, n_queries: int, c: int, w: int) -> Tensor:
    """Bool `[U, c, w]`: whether each window key's entry of the key-buffer `column` equals its query's (the query
    buffer is the key buffer after its `lead` rows)."""
    key_value = _windows(column[:, None], 0, n_queries, c, w).view(n_queries, 1, w)
    query_value = column[lead : lead + n_queries * c].view(n_queries, c, 1)
    return key_value == query_value


def _relative_positions(qk: Tensor, call: _LshCall, rounds: _SortedRounds) -> dict[str, Tensor]:
    """The relative-position arguments of the window kernels (`relative_table`, `query_position`, `key_position`),
    none without an embedding: the O(n · M) table of every (batch, head, position), read per pair at the original
    positions; its rows are the output rows `(b · h + head) · n + position`, which `out_index` names."""
    if call.relative_embedding is None:
        return {}
    b, h, n, d = qk.shape
    c = rounds.c
    with torch.no_grad():
        real = torch.arange(n, device=qk.device)
        query_position = _scatter_index(rounds.n_queries * c, rounds.buffer_row[..., :n], real)
        key_position = F.pad(query_position, (rounds.before * c, rounds.after * c), value=-1)
    table = relative_logit_table(qk, call.relative_embedding, default_scale(d)).reshape(b * h * n, -1)
    return dict(relative_table=table, query_position=query_position, key_position=key_position)


def _gathered_rounds(qk: Tensor, v: Tensor, call: _LshCall, rounds: _SortedRounds, relative: dict) -> Tensor:
    """The rounds on `attend_gathered_windows`, which gathers the rows of each group of chunks itself."""
    b, h, n, _ = qk.shape
    c, before = rounds.c, rounds.before
    with torch.no_grad():
        first = last = None
        if call.causal:
            # The visible keys of a causal query are the last (at most before·c) entries of its bucket before
            # it in sorted order: window columns [column − back, column) with column = before·c + slot.
            sorted_buckets = rounds.buckets.gather(-1, rounds.order)
            bucket_start = torch.searchsorted(sorted_buckets, sorted_buckets).gather(-1, rounds.rank)
            back = (rounds.rank - bucket_start).clamp_(max=before * c)  # [b, h, r, n_pad]
            back.masked_fill_(rounds.buckets == rounds.padding_bucket, 0)  # padding sees no key
            column = before * c + rounds.buffer_row % c
            where = rounds.buffer_row[..., :n]
            first = _scatter_index(rounds.n_queries * c, where, (column - back)[..., :n]).clamp_(min=0)
            last = _scatter_index(rounds.n_queries * c, where, column[..., :n]).clamp_(min=0)
    out = attend_gathered_windows(
        rounds.qk_rows,
        rounds.qk_rows,
        rounds.v_rows,
        key_norm_eps=KEY_NORM_EPS,
        query_index=rounds.query_index,
        key_index=rounds.key_index,
        value_index=rounds.value_index,
        out_index=rounds.out_index,
        n_out=b * h * n,
        chunk=c,
        width=rounds.w,
        stride=c,
        scale=1.0,
        mask=None if call.causal else rounds.mask,
        first=first,
        last=last,
        self_column=before * c,
        **relative,
    )
    return out.view(b, h, n, v.shape[-1])


def _copied_rounds(
    qk: Tensor, v: Tensor, call: _LshCall, rounds: _SortedRounds, relative: dict, windows: Callable
) -> Tensor:
    """The rounds on `windows` (`attend_windows` or its kernel) over sorted copies of the rows, merged by
    log-sum-exp (`_combine_rounds`)."""
    b, h, n, d = qk.shape
    d_v, r = v.shape[-1], call.rotations.shape[2]
    c, w, lead, n_queries = rounds.c, rounds.w, rounds.before * rounds.c, rounds.n_queries
    mask = rounds.mask
    with torch.no_grad():
        if call.causal:
            row_bucket = _at_key_rows(rounds.buckets[..., :n], rounds.key_rows, rounds.key_index.shape[0], -1)
            # Sorted distance from query i to window key j is before·c + i − j: strictly earlier, at most
            # before·c back. Gap rows are invalid, so the band never leaves the round.
            distance = lead + torch.arange(c, device=qk.device)[:, None] - torch.arange(w, device=qk.device)
            band = (distance > 0) & (distance <= lead)  # [c, w]
            mask = mask & band & _same_in_window(row_bucket, lead, n_queries, c, w)  # [U, c, w]
        # Backward maps: copy `round` of source row p sits at key-buffer row before·c + buffer_row[.., round, p].
        key_rows = rounds.key_rows.view(b, h, r, n)
        key_inverse = _copy_inverse(rounds.qk_rows, rounds.qk_row_of, key_rows)
        value_inverse = _copy_inverse(rounds.v_rows, rounds.v_row_of, key_rows)
        unsort = rounds.buffer_row[..., :n].reshape(-1)  # [b·h·r·n], where each (b, h, r, position) was answered
        unsort_inverse = _scatter_index(n_queries * c, unsort, torch.arange(unsort.numel(), device=qk.device))
    qk_sorted = gather_rows(rounds.qk_rows, rounds.key_index, key_inverse)  # [rows, d]: zero chunks, the segments
    q_sorted = qk_sorted[lead : lead + n_queries * c].view(n_queries, c, d)
    k_sorted = normalize_keys(qk_sorted)  # zero rows stay zero
    v_sorted = gather_rows(rounds.v_rows, rounds.value_index, value_inverse)  # [rows, d_v]
    if relative:
        columns = RelativeColumns(
            relative["relative_table"], relative["query_position"], relative["key_position"], rounds.out_index, c, c, w
        )
        mask = hide_exactly(columns.bias(0, n_queries), ~mask)  # [U, c, w], differentiable
    out, lse = windows(
        q_sorted, k_sorted, v_sorted, mask, stride=c, scale=1.0, dropout_p=call.dropout_p, self_column=lead
    )  # [U, c, d_v], [U, c]
    out = gather_rows(out.view(-1, d_v), unsort, unsort_inverse.view(1, -1)).view(b, h, r, n, d_v)
    lse = lse.reshape(-1).index_select(0, unsort).view(b, h, r, n)
    return _combine_rounds(out, lse)


def _copy_inverse(rows: Tensor, row_of: Callable, key_rows: Tensor) -> Tensor:
    """`[r, N]`: for each round, the key-buffer row `key_rows [b, h, r, n]` holding the copy of every row of
    `rows [N, ·]` (-1: none), the inverse map `gather_rows` runs backward with."""
    b, h, r, n = key_rows.shape
    bi, hi, ri = _grid(b, h, r, key_rows.device)
    real = torch.arange(n, device=key_rows.device)
    return _scatter_index(r * rows.shape[0], row_of(bi, hi, real) + ri * rows.shape[0], key_rows).view(r, -1)


def _scatter_index(size: int, where: Tensor, what: Tensor) -> Tensor:
    """A long `[size]` of -1 with `what` written at `where` (both broadcast to one shape)."""
    where, what = torch.broadcast_tensors(where, what)
    index = torch.full((size,), -1, dtype=torch.long, device=where.device)
    index[where.reshape(-1)] = what.reshape(-1)
    return index


class _CombineRounds(torch.autograd.Function):
    """Σ_r softmax_r(lse) · out_r with a backward of one pass per round (autograd's einsum/mul chain copied)."""

    @staticmethod
    def forward(ctx, out, lse):
        weights = torch.softmax(lse, dim=2).to(out.dtype).unsqueeze(-1)  # [b, h, r, n, 1]
        combined = out[:, :, 0] * weights[:, :, 0]
        for rnd in range(1, out.shape[2]):
            combined.addcmul_(out[:, :, rnd], weights[:, :, rnd])
        ctx.save_for_backward(out, weights)
        ctx.lse_dtype = lse.dtype
        return combined

    @staticmethod
    def backward(ctx, grad):
        out, weights = ctx.saved_tensors
        grad_out = grad.unsqueeze(2) * weights  # [b, h, r, n, d_v]
        # d/dlse_r of Σ_s w_s·o_s = w_r·(o_r − combined); with g = grad·o: w_r·(g_r − Σ_s w_s g_s).
        dots = (out * grad.unsqueeze(2)).sum(dim=-1, keepdim=True)  # [b, h, r, n, 1]
        grad_lse = weights * (dots - (weights * dots).sum(dim=2, keepdim=True))
        return grad_out, grad_lse.squeeze(-1).to(ctx.lse_dtype)


def _combine_rounds(out: Tensor, lse: Tensor) -> Tensor:
    """Rounds `[b, h, r, n, d_v]` weighted by softmax over their log-normalisers `[b, h, r, n]` -> `[b, h, n, d_v]`.

    Equals one softmax over the union (with multiplicity) of the keys the rounds saw.
    """
    if out.shape[2] == 1:
        return out[:, :, 0]
    return _CombineRounds.apply(out, lse)


# ---------------------------------------------------------------------------------------------- dense form
def lsh_attention_dense(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    rotations: Tensor,
    num_buckets: Buckets | None = None,
    bucket_size: int,
    num_chunks_before: int = 1,
    num_chunks_after: int = 0,
    causal: bool = False,
    key_padding_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    document_ids: Tensor | None = None,
    relative_embedding: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """The same attention as `lsh_attention`, written as dense masked attention in O(r·n·m) (with its weights).

    Used for cached decoding (the n queries are the last n of the m key positions) and for `output_attentions`.
    Causal: a query sees the earlier keys of its bucket that are at most `bucket_size · num_chunks_before` places
    back in the (bucket, position) order. Bidirectional (n = m only): the keys whose sorted chunk is at most
    `num_chunks_before` before / `num_chunks_after` after the query's, within the round.

    Args:
        q: Queries `[b, h, n, d]` (the shared vectors of the last n positions).
        k: Keys `[b, h, m, d]` (the shared vectors, not normalised).
        v: Values `[b, h, m, d_v]`.
        rotations, num_buckets: The hashing the fast path used: its rotations `[h or 1, d, r, Σ factors/2]` and
            bucket count (None: one hash of `2 · rotations.shape[-1]` buckets).
        bucket_size, num_chunks_before, num_chunks_after, causal, key_padding_mask, dropout_p, document_ids,
            relative_embedding: As in `lsh_attention` (`document_ids` `[b, m]`).

    Returns:
        `(out [b, h, n, d_v], weights [b, h, n, m])`, weights summed over the rounds.

    Raises:
        ValueError: A bidirectional call with n != m (it needs every query's sorted position), or a mask that is not
            bool `[b, m]`.
    """
    b, h, n, _ = q.shape
    m = k.shape[2]
    if not causal and n != m:
        raise ValueError(f"bidirectional LSH needs every query (n={n}) to be a key position (m={m}).")
    key_padding_mask = check_token_mask("key_padding_mask", key_padding_mask, b, m, device=q.device)
    document_ids = check_document_ids(document_ids, b, m, device=q.device)
    dtype = compute_dtype(q.dtype)
    valid = torch.ones(b, m, dtype=torch.bool, device=q.device) if key_padding_mask is None else key_padding_mask
    q_pos = torch.arange(m - n, m, device=q.device)
    key_buckets = lsh_buckets(k, rotations, valid=valid, num_buckets=num_buckets)  # [b, h, r, m]
    if document_ids is not None:
        factors = (2 * rotations.shape[-1],) if num_buckets is None else hash_factors(num_buckets)
        key_buckets, _ = document_buckets(key_buckets, document_ids, math.prod(factors))
    query_buckets = key_buckets[..., m - n :]  # shared QK: a query hashes like its key
    same_position = q_pos[:, None] == torch.arange(m, device=q.device)  # [n, m]
    if causal:
        same = (query_buckets[..., :, None] == key_buckets[..., None, :]) & valid[:, None, None, None, :]
        same &= q_pos[:, None] > torch.arange(m, device=q.device)  # [b, h, r, n, m], earlier keys of the bucket
        # Places back in sorted order = same-bucket keys from this one up to the query.
        back = same.flip(-1).cumsum(-1).flip(-1)
        visible = same & (back <= bucket_size * num_chunks_before)
    else:
        rank = key_buckets * m + torch.arange(m, device=q.device)
        rank = rank.argsort(-1).argsort(-1)  # [b, h, r, m], sorted index of each position in its round
        chunk = torch.div(rank, bucket_size, rounding_mode="floor")
        distance = chunk[..., None, :] - chunk[..., :, None]  # [b, h, r, n, m]: key chunk - query chunk
        visible = (distance >= -num_chunks_before) & (distance <= num_chunks_after) & valid[:, None, None, None, :]
        visible &= ~same_position
        if document_ids is not None:  # chunk neighbours may hold another document
            visible &= (document_ids[:, :, None] == document_ids[:, None, :])[:, None, None]
    scores = torch.einsum("bhnd,bhmd->bhnm", q.to(dtype), normalize_keys(k.to(dtype)))  # [b, h, n, m]
    bias_fn = relative_bias(
        q, check_relative_embedding(relative_embedding, q), scale=default_scale(q.shape[-1]), kv_len=m
    )
    if bias_fn is not None:
        scores = scores + materialize_bias(
            bias_fn, batch=b, heads=h, q_len=n, kv_len=m, q_offset=m - n, device=q.device
        )
    scores = scores[:, :, None]  # [b, h, 1, n, m]
    scores = hide_exactly(scores, ~visible)
    lonely = ~visible.any(dim=-1, keepdim=True)  # [b, h, r, n, 1]: only the query's own key is left
    scores = torch.where(lonely & same_position, torch.full_like(scores, SELF_SCORE), scores)
    lse = scores.logsumexp(dim=-1)  # [b, h, r, n]
    probs = (scores - lse.unsqueeze(-1)).exp()
    weights = (probs * torch.softmax(lse, dim=2).unsqueeze(-1)).sum(dim=2)  # [b, h, n, m]
    dropped = F.dropout(weights, p=dropout_p) if dropout_p > 0 else weights
    out = torch.matmul(dropped, v.to(dtype))
    return out.to(q.dtype), dropped.to(q.dtype)
