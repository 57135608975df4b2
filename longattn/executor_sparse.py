"""Sparse Transformer executors (Child et al. 2019): strided and fixed factorized attention without an n x n matrix.

Shape legend: b batch, h heads, n length (n_q queries, n_k keys), l stride or block length, c summary cells per
block, nb query blocks, q_blk queries per block, m keys gathered per block, d head dim (d_v for values).

Both patterns are a union of two key sets, and each set has a layout in which it is dense:

- strided: A1, the l keys on each side (one side when causal), is a band: `band_layout` with window l. A2, every
  l-th key, is dense inside each residue class mod l: permute the positions into classes and run (causal or
  bidirectional) attention inside each class. Cost O(n · (l + n / l)), O(n · sqrt(n)) for l ~ sqrt(n).
- fixed: A1, the query's own block, is block-diagonal. A2, the summary cells, is one short list of keys shared
  by every query. Cost O(n · (l + c · n / l)).

The parts are `BlockSet`s of one `executor_block_sets.attend_block_sets` call: one softmax over their union, each
chunk's partial attention merged into its queries' output by log-sum-exp, one set of gradients, and no gathered query
or partial output kept for backward (O(n · d) memory besides the chunk workspaces and each part's mask, kept as its
few distinct rows).

A key in both sets must be counted once: the first part takes the pattern restricted to its geometry (`|i - j| <= l`,
or the same block) and the second the pattern restricted to the complement, so every visible key lies in exactly one
part. Visibility itself is always decided by the pattern's `MaskFn` evaluated on original positions
(`evaluate_block_mask`): the geometry arguments only say where visible keys can be, so the dense reference
(`patterns.materialize_mask`) and these executors share one definition.

Both executors take queries q `[b, h, n_q, d]` (the last n_q positions when n_q < n_k), keys k `[b, h, n_k, d]` and
values v `[b, h, n_k, d_v]`, and return the output `[b, h, n_q, d_v]`, zeros for a query that sees no key. Both also
take `scale` (the multiplier of q·k), `dropout_p` (dropout on the attention probabilities) and `bias_fn` (an optional
logit bias of each kept pair, e.g. relative-position logits, evaluated on the positions each part computes and added
to its scores).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .executor_band import band_layout
from .executor_block_sets import BlockSet, attend_block_sets
from .patterns import MaskFn, and_masks, periodic
from .relative_logits import BiasFn

__all__ = ["strided_blocked_attention", "fixed_blocked_attention"]


# ---------------------------------------------------------------------------------------------- geometry predicates
def _within_band(reach: int) -> MaskFn:
    def within_band(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return (q_idx - kv_idx).abs() <= reach

    return periodic(within_band, 1)


def _beyond_band(reach: int) -> MaskFn:
    def beyond_band(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return (q_idx - kv_idx).abs() > reach

    return periodic(beyond_band, 1)


def _same_block(block_size: int, same: bool) -> MaskFn:
    def block_test(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        equal = torch.div(q_idx, block_size, rounding_mode="floor") == torch.div(
            kv_idx, block_size, rounding_mode="floor"
        )
        return equal if same else ~equal

    return periodic(block_test, block_size)


# ---------------------------------------------------------------------------------------------- strided
def _strided_band_set(mask_fn, *, n_q, n_k, stride, causal, block_size, device) -> BlockSet:
    """A1: the pattern restricted to |i - j| <= l, on a band layout."""
    reach = min(stride, n_k)  # a band wider than the sequence gathers nothing more
    layout = band_layout(
        q_len=n_q,
        kv_len=n_k,
        window_left=reach,
        window_right=0 if causal else reach,
        block_size=block_size,
        q_offset=n_k - n_q,
        device=device,
    )
    return BlockSet(
        and_masks(mask_fn, _within_band(stride)), layout.q_pos, layout.q_valid, layout.kv_pos, layout.kv_valid
    )


def _strided_class_sets(mask_fn, *, n_q, n_k, stride, causal, class_block, device) -> list[BlockSet]:
    """A2 beyond the band: dense attention inside each residue class mod l.

    Class r holds the positions r, r + l, r + 2l, ... (step t at position r + t·l). Its queries are cut into
    sub-blocks of `class_block` steps; every sub-block of class r gathers the keys of class r. Causal: sub-block
    s only needs the key steps before its end, so each s is its own set with that many keys (about half the work
    of gathering the whole class). (Permuting q, k, v into class-major layout once and folding classes into the
    head dimension instead measured about 10% slower on CPU.)
    """
    q_offset = n_k - n_q
    classes = min(stride, n_k)
    steps = -(-n_k // stride)  # key steps per class (the last may be past the end for some classes)
    first_step = q_offset // stride
    q_steps = steps - first_step
    rows = min(q_steps, class_block)
    subs = -(-q_steps // rows)
    residue = torch.arange(classes, device=device).view(classes, 1, 1)
    q_step = first_step + torch.arange(subs, device=device).view(1, subs, 1) * rows + torch.arange(rows, device=device)
    q_pos = residue + q_step * stride  # [classes, subs, rows]
    q_valid = (q_pos >= q_offset) & (q_pos < n_k)
    q_pos = q_pos.clamp(q_offset, n_k - 1)
    beyond_fn = and_masks(mask_fn, _beyond_band(stride))

    def class_set(q_pos_set, q_valid_set, key_steps, repeat):
        """Blocks `[nb, rows]` of queries, each gathering `key_steps` steps of its class."""
        kv_pos = (
            torch.arange(classes, device=device).view(classes, 1)
            + torch.arange(key_steps, device=device).view(1, key_steps) * stride
        )  # [classes, m]
        kv_valid = kv_pos < n_k
        kv_pos = kv_pos.clamp(max=n_k - 1)
        if repeat > 1:  # blocks are (class, sub-block) in that order
            kv_pos = kv_pos.repeat_interleave(repeat, dim=0)
            kv_valid = kv_valid.repeat_interleave(repeat, dim=0)
        return BlockSet(beyond_fn, q_pos_set, q_valid_set, kv_pos, kv_valid)

    if causal:
        # Query steps of sub-block s end before first_step + (s + 1)·rows.
        return [
            class_set(q_pos[:, sub], q_valid[:, sub], min(steps, first_step + (sub + 1) * rows), 1)
            for sub in range(subs)
        ]
    return [class_set(q_pos.reshape(classes * subs, rows), q_valid.reshape(classes * subs, rows), steps, subs)]


def strided_blocked_attention(
    q: Tensor, k: Tensor, v: Tensor, *, mask_fn: MaskFn, stride: int, causal: bool, scale: float,
    dropout_p: float = 0.0, block_size: int = 64, class_block: int | None = None, bias_fn: BiasFn | None = None,
) -> Tensor:  # fmt: skip
    """Attention whose visible keys lie in the strided geometry: |i − j| <= l, or (i − j) mod l = 0.

    Band part (|i − j| <= l) on a band layout, class part (same residue mod l, |i − j| > l) dense inside each
    residue class, merged by log-sum-exp. Cost O(n · (l + n / l)) time; no n x n tensor.

    Args:
        q, k, v, scale, dropout_p, bias_fn: As in the module docstring.
        mask_fn: The pattern predicate (e.g. `patterns.strided_pattern(...)`); it must not see keys outside the
            strided geometry.
        stride: The stride l (>= 1).
        causal: No visible key lies after its query (skips gathering those keys).
        block_size: Queries per band block (64 measured fastest on CPU against 32 and 128).
        class_block: Query steps per block inside a residue class; default 128 when causal (each block is its own
            call gathering only earlier keys), 256 otherwise (larger blocks measured faster on CPU).

    Returns:
        The output (module docstring).
    """
    b, h, n_q, _ = q.shape
    n_k = k.shape[2]
    if n_q == 0:
        return q.new_zeros(b, h, 0, v.shape[3])
    if class_block is None:
        class_block = 128 if causal else 256
    geometry = dict(n_q=n_q, n_k=n_k, stride=stride, causal=causal, device=q.device)
    sets = [_strided_band_set(mask_fn, block_size=block_size, **geometry)]
    # A class key beyond the band is at least 2l away from its query: none exists in a sequence of <= 2l keys.
    if n_k - 1 >= 2 * stride:
        sets.extend(_strided_class_sets(mask_fn, class_block=class_block, **geometry))
    out, _ = attend_block_sets(q, k, v, sets, scale=scale, dropout_p=dropout_p, bias_fn=bias_fn)
    return out


# ---------------------------------------------------------------------------------------------- fixed
def _fixed_summary_positions(n_k: int, block_size: int, num_summary: int, group: int, device) -> Tensor:
    """Sorted positions of the summary cells of head group `group`: `[l − (g + 1)·c, l − g·c)` in every block."""
    blocks = -(-n_k // block_size)
    first_cell = block_size - (group + 1) * num_summary
    positions = (
        torch.arange(blocks, device=device).view(blocks, 1) * block_size
        + first_cell
        + torch.arange(num_summary, device=device).view(1, num_summary)
    ).reshape(-1)
    return positions[: _fixed_summary_count(n_k, block_size, num_summary, group)]


def _fixed_summary_count(limit: int, block_size: int, num_summary: int, group: int) -> int:
    """How many summary cells of head group `group` lie before position `limit` (a prefix of the sorted positions).

    Counted from the geometry, not from the positions tensor: a count read back from a tensor would be a host sync
    and break `torch.compile`'s graph. Every block before `limit // l` holds all c cells; block `limit // l` holds
    those of its cells `[l − (g + 1)·c, l − g·c)` that start before `limit`.
    """
    first_cell = block_size - (group + 1) * num_summary
    return (limit // block_size) * num_summary + min(num_summary, max(0, limit % block_size - first_cell))


def _fixed_query_blocks(
    n_q: int, n_k: int, block_size: int, max_block_rows: int, *, device
) -> tuple[Tensor, Tensor, Tensor, int]:
    """The query blocks of `fixed_blocked_attention` (queries: the last `n_q` of `n_k` positions): the pattern blocks
    `first_block ...` that hold a query, each cut into `subs` sub-blocks of at most `max_block_rows` rows.

    Returns:
        `(block_start [nbq], q_pos [nb, rows], q_valid [nb, rows], subs)`: the pattern blocks' first positions, and
        the sub-blocks' query positions and validity (nb = nbq · subs).
    """
    q_offset = n_k - n_q
    first_block = q_offset // block_size
    q_pattern_blocks = -(-n_k // block_size) - first_block
    keys_per_block = min(block_size, n_k)
    rows = min(keys_per_block, max_block_rows)
    subs = -(-keys_per_block // rows)
    block_start = (first_block + torch.arange(q_pattern_blocks, device=device)) * block_size  # [nbq]
    offset_in_block = torch.arange(subs, device=device).view(subs, 1) * rows + torch.arange(rows, device=device).view(
        1, rows
    )  # [subs, rows]
    q_pos = block_start.view(-1, 1, 1) + offset_in_block  # [nbq, subs, rows]
    q_valid = (offset_in_block < block_size) & (q_pos >= q_offset) & (q_pos < n_k)
    q_pos = q_pos.clamp(q_offset, n_k - 1).reshape(-1, rows)  # [nb, rows], nb = nbq · subs
    return block_start, q_pos, q_valid.reshape(-1, rows), subs


def fixed_blocked_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    mask_fn: MaskFn,
    block_size: int,
    num_summary: int,
    summary_per_head: bool = False,
    causal: bool,
    scale: float,
    dropout_p: float = 0.0,
    max_block_rows: int = 256,
    causal_groups: int = 8,
    bias_fn: BiasFn | None = None,
) -> Tensor:
    """Attention whose visible keys lie in the fixed geometry: the query's own block, or a summary cell.

    Block part (same block) block-diagonal; summary part (summary cells of the other blocks) as one dense
    attention of each query block over the gathered summary keys, merged by log-sum-exp. Cost O(n · (l + c·n/l)).

    Args:
        q, k, v, scale, dropout_p, bias_fn: As in the module docstring.
        mask_fn: The pattern predicate (e.g. `patterns.fixed_pattern(...)`); it must not see keys outside the
            fixed geometry.
        block_size: Block length l (>= 1).
        num_summary: Summary cells per block c, in [1, l].
        summary_per_head: Head h's summary cells are sub-block `h mod floor(l / c)` counted from the block end
            (see `patterns.fixed_mask`); heads sharing a sub-block are computed together.
        causal: No visible key lies after its query: query blocks are split into up to `causal_groups` groups,
            each gathering only the summary keys before its last block.
        max_block_rows: Blocks longer than this are split into query sub-blocks of at most this many rows (each
            still gathering its whole block), which bounds the workspace.
        causal_groups: See `causal`.

    Returns:
        The output (module docstring).
    """
    b, h, n_q, d = q.shape
    n_k = k.shape[2]
    device = q.device
    if n_q == 0:
        return q.new_zeros(b, h, 0, v.shape[3])

    block_start, q_pos, q_valid, subs = _fixed_query_blocks(n_q, n_k, block_size, max_block_rows, device=device)
    # Block part: every sub-block gathers its whole pattern block.
    keys_per_block = min(block_size, n_k)
    kv_pos = block_start.view(-1, 1) + torch.arange(keys_per_block, device=device)  # [nbq, m]
    kv_valid = kv_pos < n_k
    kv_pos = kv_pos.clamp(max=n_k - 1).repeat_interleave(subs, dim=0)  # [nb, m]
    kv_valid = kv_valid.repeat_interleave(subs, dim=0)
    sets = [BlockSet(and_masks(mask_fn, _same_block(block_size, True)), q_pos, q_valid, kv_pos, kv_valid)]
    # Summary part: per group of heads sharing summary cells, per group of query blocks sharing a key budget.
    sets += _fixed_summary_sets(
        and_masks(mask_fn, _same_block(block_size, False)),
        q_pos,
        q_valid,
        n_k=n_k,
        num_heads=h,
        block_size=block_size,
        num_summary=num_summary,
        summary_per_head=summary_per_head,
        causal=causal,
        causal_groups=causal_groups,
        first_block=(n_k - n_q) // block_size,
        subs=subs,
    )
    out, _ = attend_block_sets(q, k, v, sets, scale=scale, dropout_p=dropout_p, bias_fn=bias_fn)
    return out


def _fixed_summary_sets(
    other_block_fn: MaskFn,
    q_pos: Tensor,
    q_valid: Tensor,
    *,
    n_k: int,
    num_heads: int,
    block_size: int,
    num_summary: int,
    summary_per_head: bool,
    causal: bool,
    causal_groups: int,
    first_block: int,
    subs: int,
) -> list[BlockSet]:
    """The summary part of `fixed_blocked_attention`: the query sub-blocks `q_pos`, `q_valid` `[nb, rows]` (`subs`
    per pattern block, from pattern block `first_block`) over the summary cells of the other blocks
    (`other_block_fn`), one set per group of heads sharing summary cells and per group of query blocks sharing a
    key budget."""
    device = q_pos.device
    q_pattern_blocks = q_pos.shape[0] // subs
    # The summary keys of a set are shared by all its blocks.
    head_groups = (block_size // num_summary) if summary_per_head else 1
    head_groups = min(head_groups, num_heads)
    group_count = min(q_pattern_blocks, causal_groups) if causal else 1
    # Query-block groups, in pattern blocks: [bounds[i], bounds[i + 1]).
    bounds = [round(i * q_pattern_blocks / group_count) for i in range(group_count + 1)]
    sets = []
    for group in range(head_groups):
        heads = None if head_groups == 1 else torch.arange(group, num_heads, head_groups, device=device)
        positions = _fixed_summary_positions(n_k, block_size, num_summary, group, device)  # [S]
        for start, stop in zip(bounds[:-1], bounds[1:]):
            if causal:
                # The last query block of the group sees summary cells of earlier blocks only.
                keys = _fixed_summary_count((first_block + stop - 1) * block_size, block_size, num_summary, group)
            else:
                keys = positions.shape[0]
            if stop > start and keys > 0:  # a set without keys adds nothing to the union
                blocks = slice(start * subs, stop * subs)
                sets.append(
                    BlockSet(other_block_fn, q_pos[blocks], q_valid[blocks], positions[None, :keys], heads=heads)
                )
    return sets
