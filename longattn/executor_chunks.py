"""What the blocked attention engines share: the workspace budget and its reused buffers, row views of `[b, h, n, d]`
tensors, the chunk layout for batched products, and block masks evaluated from the pattern predicate.

Shape legend: b batch, h heads, h_kv key/value heads (grouped-query attention: h_kv divides h, query head i reads
key/value head i // (h / h_kv)), n length (n_q queries, n_k keys), nb query blocks, c queries per block, m keys
gathered per block, d head dim (d_v for values).

The engines (`executor_gathered.attend_blocks`, `executor_block_sets.attend_block_sets`, `executor_band`'s fused
band) keep no scores or probabilities for backward: they walk the query blocks in chunks sized by one budget of
workspace elements (`_WORKSPACE_ELEMENTS`, chosen per machine by `tuning`), every chunk viewing the same flat buffers
(`_Workspace`), and recompute the probabilities in backward. What they share lives here, stated once:

- Row views (`_rows`, `_zeros_with_rows`: a `_RowView`): a `[b, h, n, d]` tensor in any layout with a unit stride
  on d (e.g. the `[b, n, h, d]` memory behind the usual `split_heads` transpose) seen as `[rows, d]`, so that key
  sets are gathered, and their gradients scatter-added, by one dim-0 `index_select` / `index_add_` of the row
  numbers `_RowView.index` gives, without a copy.
- `_Chunk`: one chunk of query blocks laid out for `bmm`, a group of query heads sharing its key/value head's rows
  (keys are gathered once per key/value head, never repeated per query head); `_Chunk.scores` gives its scores and
  `_Chunk.gradients` its dV = Pᵀ dO, dK = dSᵀ Q and dQ = dS K.
- `_Workspace`: the buffers one pass over the chunks reuses, its budget (`_Workspace.blocks_per_chunk`) and its
  dropout stream (`_Workspace.drop`: backward draws forward's masks again, chunk by chunk).
- `evaluate_block_mask` / `block_mask`: the block masks are never written by hand. They come from evaluating the
  pattern's `MaskFn` (`longattn.patterns`) on the ORIGINAL positions of each block's queries and gathered keys, so
  the dense reference (`materialize_mask`) and the engines share one definition; `block_mask` is the same evaluation
  per chunk, in forward and again in backward, so that no n x m mask is kept.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor

from .numerics import hide_logits
from .patterns import MaskFn
from .tuning import workspace_elements

# Elements of ALL the workspaces of one chunk of `attend_blocks` / `attend_block_sets` together: scores and their
# gradient, gathered keys, values and their gradients (and their weighted copies), the chunk's queries, output
# gradients and query gradients. Chosen per machine by `tuning.workspace_elements()`: the largest power of two whose
# float32 bytes fit one core's share of the last-level cache plus its L2, within [2**18, 2**21] (2**21, 8 MB, on a
# 2-core AMD EPYC with 32 MB of L3 and 512 KB of L2 per core; evidence in docs/benchmarks.md, "Chunk sizes per
# machine"). Budgeting the scores alone let blocks that gather more keys than they hold queries (Sinkhorn: 2s keys of
# 64 for s = 64 queries) keep 42 MB of workspaces at 16K tokens, a third of what full attention's whole step adds.
_WORKSPACE_ELEMENTS = workspace_elements()


# Elements of one chunk of `evaluate_block_mask` (it sized the blocked executor's score chunks before
# `_WORKSPACE_ELEMENTS`): half the workspace budget (2**20 where that is 2**21). Measured on a 2-core CPU (16K tokens,
# 4 heads): chunks of 2**20..2**21 elements were fastest, 2**22 was 1.5x slower, and a bmm writing into a fresh large
# tensor instead of a reused buffer was 2x slower (page faults on first touch).
_CHUNK_ELEMENTS = _WORKSPACE_ELEMENTS // 2


def _mask_blocks_per_chunk(rows: int, per_block: int, total_blocks: int) -> int:
    """Blocks per slice of a mask-sized temporary (`rows · per_block` elements a block) within `_CHUNK_ELEMENTS`."""
    return max(1, min(total_blocks, _CHUNK_ELEMENTS // max(1, rows * per_block)))


class _Workspace:
    """What one pass over the chunks reuses: flat buffers, viewed at the size each chunk needs (the last chunk may be
    smaller), and the pass's dropout stream.

    Dropout masks are drawn chunk by chunk from one generator seeded with the call's `seed`, so that backward, walking
    the chunks in the same order, draws forward's masks again instead of keeping them.
    """

    def __init__(self, dtype: torch.dtype, device: torch.device, *, dropout_p: float = 0.0, seed: int | None = None):
        self.dtype, self.device, self.buffers = dtype, device, {}
        self.dropout_p = dropout_p
        self.generator = _dropout_generator(seed, device) if dropout_p > 0 else None

    @staticmethod
    def blocks_per_chunk(per_block: int, total_blocks: int, fixed: int = 0) -> int:
        """Blocks per chunk so that `fixed + blocks · per_block` workspace elements stay within the budget."""
        return max(1, min(total_blocks, (_WORKSPACE_ELEMENTS - fixed) // max(1, per_block)))

    def drop(self, x: Tensor) -> Tensor | None:
        """Dropout on a chunk's probabilities (or their gradient) x, in place: x · keep / (1 − p) with the pass's next
        mask. Returns that scaled mask (the "keep" workspace), None without dropout (x unchanged)."""
        if self.generator is None:
            return None
        keep = self.get("keep", x.shape).bernoulli_(1.0 - self.dropout_p, generator=self.generator)
        x.mul_(keep.mul_(1.0 / (1.0 - self.dropout_p)))
        return keep

    def get(self, name: str, shape: Sequence[int], dtype: torch.dtype | None = None) -> Tensor:
        size = math.prod(shape)
        buffer = self.buffers.get(name)
        if buffer is None or buffer.numel() < size:
            buffer = self.buffers[name] = torch.empty(size, dtype=dtype or self.dtype, device=self.device)
        return buffer[:size].view(*shape)


def _row_strides(t: Tensor) -> tuple[int, int, int] | None:
    """Strides of t `[b, h, n, d]` in rows of d, or None when its layout is not row-addressable (see `_rows`).

    Decided from the shape and strides alone (no data pointers), so that `torch.compile` traces it without a break.
    """
    d = t.shape[3]
    strides = [0 if size == 1 else stride for size, stride in zip(t.shape, t.stride())]
    if d == 0 or (d > 1 and strides[3] != 1) or any(stride % d for stride in strides[:3]):
        return None
    return strides[0] // d, strides[1] // d, strides[2] // d


class _RowView(NamedTuple):
    """A `[b, h, n, d]` tensor seen as `flat` `[rows, d]` (`_rows`): the row of (batch·head i, position p) is
    `base[i] + p · step`, base `[b·h]`."""

    flat: Tensor
    base: Tensor
    step: int

    def index(self, kv_index: Tensor, start: int, stop: int) -> Tensor:
        """Flat row numbers `[b·h·n_blk·m]` of the keys that blocks `start:stop` gather.

        kv_index `[nb, m]` is shared by the batch rows, `[b, nb, m]` has one per row, `[b, h, nb, m]` one per row and
        head (h: the heads of this view, e.g. the key/value heads)."""
        base, step = self.base, self.step
        if kv_index.dim() == 2:
            return (base.view(-1, 1) + kv_index[start:stop].reshape(1, -1) * step).view(-1)
        if kv_index.dim() == 4:
            return (base.view(-1, 1) + kv_index[:, :, start:stop].reshape(base.shape[0], -1) * step).view(-1)
        b = kv_index.shape[0]
        return (base.view(b, -1, 1) + kv_index[:, start:stop].reshape(b, 1, -1) * step).view(-1)


def _rows(t: Tensor) -> _RowView:
    """A `[rows, d]` view of t `[b, h, n, d]` without copying, for gathering and scatter-adding whole rows.

    Works for any layout with a unit stride on d whose other strides are multiples of d, e.g. the `[b, n, h, d]`
    buffer behind the usual `split_heads` transpose; other layouts are copied first.

    Returns:
        A `_RowView` `(flat, base, step)`: flat `[rows, d]`; the row of (batch·head i, position p) is
        `base[i] + p · step`, base `[b·h]`.
    """
    b, h, n, d = t.shape
    row_strides = _row_strides(t)
    if row_strides is None:
        t = t.contiguous()
        row_strides = _row_strides(t)
    s0, s1, s2 = row_strides
    rows = (b - 1) * s0 + (h - 1) * s1 + (n - 1) * s2 + 1
    flat = t.as_strided((rows, d), (d, 1))
    base = torch.arange(b, device=t.device).view(b, 1) * s0 + torch.arange(h, device=t.device).view(1, h) * s1
    return _RowView(flat, base.view(b * h), s2)


def _zeros_with_rows(like: Tensor, dtype: torch.dtype) -> tuple[Tensor, _RowView]:
    """Zeros shaped like `like`, in its layout when that is row-addressable without gaps (so gradients of
    transposed views come back as the same views), and their `_rows` view."""
    zeros = torch.zeros_like(like, dtype=dtype)
    b, h, n, _ = zeros.shape
    row_strides = _row_strides(zeros)
    # A gap (or an overlap) between rows would make the `[rows, d]` view cover other memory than `zeros`.
    span = None if row_strides is None else sum((size - 1) * stride for size, stride in zip((b, h, n), row_strides)) + 1
    if span != b * h * n:
        zeros = torch.zeros(like.shape, dtype=dtype, device=like.device)
    return zeros, _rows(zeros)


def _split_heads(t: Tensor, h_kv: int) -> Tensor:
    """`[b, h|1, ...]` -> `[b, h_kv|1, h / h_kv|1, ...]` (a view): query heads grouped by the key/value head they
    read."""
    return t.unsqueeze(2) if t.shape[1] == 1 else t.unflatten(1, (h_kv, t.shape[1] // h_kv))


def _dropout_generator(seed: int, device: torch.device) -> torch.Generator:
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return generator


def _hide(scores: Tensor, hidden: Tensor, bound: float | None) -> None:
    """Hide the scores of hidden keys in place by `numerics.hide_logits`; hidden: bool, broadcastable; bound: the
    call's `logit_bound` (None: unknown).

    Under the safe bound that adds HIDDEN_LOGIT as the mask's bytes (uint8), ~3x faster than adding the bool tensor
    and several times faster than masked_fill_ (69 vs 223 µs for [4, 128, 1024] scores on one thread, against the
    bool addition); beyond it (huge logits), -inf exactly. Rows without a visible key are told from the mask.
    """
    hide_logits(scores, hidden, bound=bound, inplace=True)


@dataclass
class _Chunk:
    """One chunk of query blocks, laid out for `bmm`; a group of query heads shares one key/value head's rows.

    Gathered keys: q `[b·h_kv·n_blk, group·c, d]`, keys `[b·h_kv·n_blk, m, d]`, values `[b·h_kv·n_blk, m, d_v]`.
    All keys: q `[b·h_kv, group·n_blk·c, d]` against keys `[b·h_kv, n_k, d]`. Keys are thus gathered (and their
    gradients scatter-added) once per key/value head, never repeated per query head. q is already multiplied by
    the scale (cheaper on [c, d] than on the scores); `hidden` is the negated mask of the chunk,
    `[b|1, h_kv|1, group|1, n_blk, c, m]`, or None when every key is visible.
    """

    start: int
    stop: int
    q: Tensor
    keys: Tensor
    values: Tensor
    hidden: Tensor | None
    shape6: tuple[int, int, int, int, int]  # (b, h_kv, group, n_blk, c)
    # With `kv_weight`: the gathered part of keys and values above is weighted; these are the gathered rows before
    # weighting `[b·h_kv·n_blk, m − own_keys, d]` and the weights `[b·h_kv·n_blk, m − own_keys | 1, 1]`.
    raw_keys: Tensor | None = None
    raw_values: Tensor | None = None
    weight: Tensor | None = None
    own_keys: int = 0  # the first own_keys keys of each block are its own (`attend_blocks`), then the gathered ones

    @property
    def scores_shape(self) -> tuple[int, int, int]:
        return (self.q.shape[0], self.q.shape[1], self.keys.shape[1])

    @property
    def out_shape(self) -> tuple[int, int, int]:
        return (self.q.shape[0], self.q.shape[1], self.values.shape[2])

    def view6(self, tensor: Tensor) -> Tensor:
        """A bmm result `[rows, queries, last]` as `[b, h_kv, group, n_blk, c, last]` (a view)."""
        b, h_kv, group, n_blk, c = self.shape6
        if self.q.shape[0] == b * h_kv:  # all keys: the group is outside the blocks
            return tensor.view(b, h_kv, group, n_blk, c, tensor.shape[-1])
        return tensor.view(b, h_kv, n_blk, group, c, tensor.shape[-1]).transpose(2, 3)

    def scores(self, bias6: Tensor | None, workspace: _Workspace, bound: float | None) -> Tensor:
        """The chunk's scores `[rows, queries, m]` (q is scaled already) plus the bias (`[b, h_kv, group, n_blk, c, m]`,
        the layout of `view6`; None: no bias), hidden keys hidden (`_hide` under the call's logit `bound`), in the
        "probs" workspace (forward and backward compute them alike)."""
        probs = workspace.get("probs", self.scores_shape)
        torch.bmm(self.q, self.keys.transpose(1, 2), out=probs)
        if bias6 is not None:
            self.view6(probs).add_(bias6)
        if self.hidden is not None:
            _hide(self.view6(probs), self.hidden, bound)
        return probs

    def gradients(
        self, probs: Tensor, grad_scores: Tensor, grad_out: Tensor, workspace: _Workspace, accumulate: bool = False
    ) -> tuple[Tensor, Tensor, Tensor]:
        """dV = Pᵀ dO, dK = dSᵀ Q and dQ = dS K of the chunk (q and the keys as the chunk holds them: dK and dQ still
        need the scale where the other side was scaled), in the "grad_values", "grad_keys", "grad_q" workspaces;
        with `accumulate`, dV and dK are added to what those workspaces hold (keys shared by the chunks)."""
        grad_values = workspace.get("grad_values", self.values.shape)
        grad_keys = workspace.get("grad_keys", self.keys.shape)
        if accumulate:
            grad_values.baddbmm_(probs.transpose(1, 2), grad_out)
            grad_keys.baddbmm_(grad_scores.transpose(1, 2), self.q)
        else:
            torch.bmm(probs.transpose(1, 2), grad_out, out=grad_values)
            torch.bmm(grad_scores.transpose(1, 2), self.q, out=grad_keys)
        grad_q = torch.bmm(grad_scores, self.keys, out=workspace.get("grad_q", self.q.shape))
        return grad_values, grad_keys, grad_q


def block_mask(
    mask_fn: MaskFn, *, batch: int, heads: Tensor, **positions: Tensor | None
) -> Callable[[int, int], Tensor]:
    """`evaluate_block_mask` as a function of (start, stop) giving blocks start:stop: a `mask` for `attend_blocks`
    that is evaluated per chunk, in forward and again in backward, so that no n x m bool tensor is kept.

    Args: as `evaluate_block_mask`; `positions` are its `q_pos`, `kv_pos`, `q_valid`, `kv_valid` (`[b or 1, nb, ·]`;
    keys `[b or 1, 1, m]` are shared by all blocks and are not cut).
    """

    def blocks(start: int, stop: int) -> Tensor:
        def rows(t: Tensor | None) -> Tensor | None:
            return t if t is None or t.shape[1] == 1 else t[:, start:stop]

        return evaluate_block_mask(
            mask_fn, batch=batch, heads=heads, **{name: rows(t) for name, t in positions.items()}
        )

    return blocks


def evaluate_block_mask(
    mask_fn: MaskFn,
    *,
    batch: int,
    heads: Tensor,
    q_pos: Tensor,
    kv_pos: Tensor,
    q_valid: Tensor | None = None,
    kv_valid: Tensor | None = None,
) -> Tensor:
    """Evaluate a pattern predicate on the original positions of blocked queries and gathered keys.

    Evaluated in chunks of blocks so the int64 intermediates of the predicate stay small.

    Args:
        mask_fn: The pattern predicate.
        batch: Batch size b.
        heads: Long `[h]`, the original head index of each head slot (the predicate may depend on it).
        q_pos: Long `[b or 1, nb, c]`, position of each query slot (within range).
        kv_pos: Long `[b or 1, nb or 1, m]`, position of each gathered key (within range).
        q_valid: Optional bool like `q_pos`: False for padding slots (they see nothing).
        kv_valid: Optional bool like `kv_pos`: False for padding keys (never seen).

    Returns:
        Bool `[b or 1, h or 1, nb, c, m]`, the dims b and h only when the predicate depends on them.
    """
    nb, c = q_pos.shape[1], q_pos.shape[2]
    m = kv_pos.shape[2]
    batch_index = torch.arange(batch, device=q_pos.device).view(batch, 1, 1, 1, 1)
    head_index = heads.view(1, -1, 1, 1, 1)
    # Compiled: one chunk. The compiler fuses the predicate (no int64 intermediates are kept), and chunks written into
    # `result` miscompile in inductor's CPU code for bool masks (torch 2.13).
    step = nb if torch.compiler.is_compiling() else _mask_blocks_per_chunk(c, m, nb)
    result = None
    for start in range(0, nb, step):
        stop = min(nb, start + step)
        q_idx = q_pos[:, start:stop, :, None].unsqueeze(1)  # [b|1, 1, n_blk, c, 1]
        kv_slice = kv_pos if kv_pos.shape[1] == 1 else kv_pos[:, start:stop]
        kv_idx = kv_slice[:, :, None, :].unsqueeze(1)  # [b|1, 1, n_blk|1, 1, m]
        chunk = mask_fn(batch_index, head_index, q_idx, kv_idx)
        if q_valid is not None:
            chunk = chunk & q_valid[:, None, start:stop, :, None]
        if kv_valid is not None:
            kv_valid_slice = kv_valid if kv_valid.shape[1] == 1 else kv_valid[:, start:stop]
            chunk = chunk & kv_valid_slice[:, None, :, None, :]
        chunk = chunk.reshape((1,) * (5 - chunk.dim()) + tuple(chunk.shape))
        if stop - start == nb:
            return chunk
        if result is None:
            result = torch.empty(chunk.shape[0], chunk.shape[1], nb, c, m, dtype=torch.bool, device=q_pos.device)
        result[:, :, start:stop] = chunk
    return result
