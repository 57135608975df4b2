"""Reformer LSH attention, steps 2 and 4: sorting by bucket, and un-sorting (Kitaev et al. 2020, "Reformer: The
Efficient Transformer").

- `_sorted_rounds`: hash every token (`ops_lsh_hashing.lsh_buckets`), sort each round by (bucket, position) and lay
  the rounds out as one buffer of chunks with zero chunks between them (`_SortedRounds`: the sizes, the permutation
  `order` / `rank`, and the integer index of every query, key and value row and of the output row it answers), so
  that a chunk's keys are a contiguous window of rows (`ops_lsh_chunks`);
- `head_rows`, `gather_rows`: `[b, h, n, d]` as `[b·h·n, d]` rows, and their gather by index (a sort or an un-sort)
  whose backward gathers with the inverse map; `_scatter_index`, `_copy_inverse`, `_grid`, `_at_key_rows` and
  `_same_in_window`: the permutation helpers;
- `_combine_rounds`: the un-sorted rounds `[b, h, r, n, d_v]` merged by their log-sum-exp `[b, h, r, n]`;
- `_LshCall`: one checked call of `ops_lsh.lsh_attention`, what these steps read.

Shape legend as in `ops_lsh`: b batch, h heads, n length, d head dim, r hash rounds, c chunk length, nc chunks per
round, w keys of a chunk's window, U query chunks.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from .ops_lsh_chunks import _windows
from .ops_lsh_hashing import Buckets, document_buckets, hash_factors, lsh_buckets

__all__ = ["gather_rows", "head_rows"]


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
