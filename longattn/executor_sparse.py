"""Sparse Transformer executors (Child et al. 2019): strided and fixed factorized attention without an n x n matrix.

Shape legend: b batch, h heads, n length (n_q queries, n_k keys), l stride or block length, c summary cells per
block, nb query blocks, q_blk queries per block, m keys gathered per block, d head dim (d_v for values).

Both patterns are a union of two key sets, and each set has a layout in which it is dense:

- strided: A1, the l keys on each side (one side when causal), is a band: `band_layout` with window l. A2, every
  l-th key, is dense inside each residue class mod l: permute the positions into classes and run (causal or
  bidirectional) attention inside each class. Cost O(n · (l + n / l)), O(n · sqrt(n)) for l ~ sqrt(n).
- fixed: A1, the query's own block, is block-diagonal. A2, the summary cells, is one short list of keys shared
  by every query. Cost O(n · (l + c · n / l)).

Each part runs through `executor_blocked.attend_blocks` and the parts are combined with `merge_attention`
(log-sum-exp), so the softmax is over the union. A key in both sets must be counted once: the first part takes the
pattern restricted to its geometry (`|i - j| <= l`, or the same block) and the second the pattern restricted to the
complement, so every visible key lies in exactly one part. Visibility itself is always decided by the pattern's
`MaskFn` evaluated on original positions (`evaluate_block_mask`): the geometry arguments only say where visible
keys can be, so the dense reference (`patterns.materialize_mask`) and these executors share one definition.

Both executors take queries q `[b, h, n_q, d]` (the last n_q positions when n_q < n_k), keys k `[b, h, n_k, d]` and
values v `[b, h, n_k, d_v]`, and return the output `[b, h, n_q, d_v]`, zeros for a query that sees no key.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .executor_blocked import attend_blocks, band_layout, evaluate_block_mask
from .numerics import compute_dtype, merge_attention
from .patterns import MaskFn, and_masks
from .relative_logits import BiasFn, block_bias

__all__ = ["strided_blocked_attention", "fixed_blocked_attention"]


# ---------------------------------------------------------------------------------------------- geometry predicates
def _within_band(reach: int) -> MaskFn:
    def within_band(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return (q_idx - kv_idx).abs() <= reach

    return within_band


def _beyond_band(reach: int) -> MaskFn:
    def beyond_band(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return (q_idx - kv_idx).abs() > reach

    return beyond_band


def _same_block(block_size: int, same: bool) -> MaskFn:
    def block_test(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        equal = torch.div(q_idx, block_size, rounding_mode="floor") == torch.div(
            kv_idx, block_size, rounding_mode="floor"
        )
        return equal if same else ~equal

    return block_test


def _empty_partial(q: Tensor, v: Tensor, blocks: int, rows: int) -> tuple[Tensor, Tensor]:
    """A part with no key for these query blocks: zero output, lse = -inf (it drops out of the merge)."""
    b, h = q.shape[:2]
    lse_dtype = compute_dtype(q.dtype)
    return (
        q.new_zeros(b, h, blocks, rows, v.shape[3]),
        torch.full((b, h, blocks, rows), -math.inf, dtype=lse_dtype, device=q.device),
    )


def _gather_queries(q: Tensor, q_pos: Tensor, q_offset: int) -> Tensor:
    """Queries at the (clamped) positions `q_pos` `[nb, q_blk]`, as blocks `[b, h, nb, q_blk, d]`."""
    b, h, _, d = q.shape
    nb, rows = q_pos.shape
    return q.index_select(2, (q_pos - q_offset).reshape(-1)).view(b, h, nb, rows, d)


# ---------------------------------------------------------------------------------------------- strided
def _bias(bias_fn: BiasFn | None, *, batch: int, heads: Tensor, q_pos: Tensor, kv_pos: Tensor) -> Tensor | None:
    """The logit bias of a call's pairs (`relative_logits.block_bias`), or None without a bias."""
    return None if bias_fn is None else block_bias(bias_fn, batch=batch, heads=heads, q_pos=q_pos, kv_pos=kv_pos)


def _strided_band_part(q, k, v, mask_fn, *, stride, causal, scale, dropout_p, block_size, bias_fn):
    """A1: the pattern restricted to |i - j| <= l, on a band layout. Returns out `[b, h, n_q, d_v]`, lse `[b, h,
    n_q]`."""
    b, h, n_q, d = q.shape
    n_k = k.shape[2]
    q_offset = n_k - n_q
    reach = min(stride, n_k)  # a band wider than the sequence gathers nothing more
    layout = band_layout(
        q_len=n_q,
        kv_len=n_k,
        window_left=reach,
        window_right=0 if causal else reach,
        block_size=block_size,
        q_offset=q_offset,
        device=q.device,
    )
    nb, rows = layout.q_pos.shape
    if nb * rows == n_q:
        q_blocks = q.reshape(b, h, nb, rows, d)
    else:
        q_blocks = torch.nn.functional.pad(q, (0, 0, 0, nb * rows - n_q)).view(b, h, nb, rows, d)
    mask = evaluate_block_mask(
        and_masks(mask_fn, _within_band(stride)),
        batch=b,
        heads=torch.arange(h, device=q.device),
        q_pos=layout.q_pos[None],
        kv_pos=layout.kv_pos[None],
        q_valid=layout.q_valid[None],
        kv_valid=layout.kv_valid[None],
    )  # [b|1, h|1, nb, rows, m]
    bias = _bias(
        bias_fn, batch=b, heads=torch.arange(h, device=q.device), q_pos=layout.q_pos[None], kv_pos=layout.kv_pos[None]
    )
    out, lse = attend_blocks(
        q_blocks, k, v, kv_index=layout.kv_pos, mask=mask, scale=scale, dropout_p=dropout_p, bias=bias
    )
    # Dilation 1: slots are the queries in order, then padding slots at the end.
    return out.reshape(b, h, nb * rows, -1)[:, :, :n_q], lse.reshape(b, h, nb * rows)[:, :, :n_q]


def _strided_class_part(q, k, v, mask_fn, *, stride, causal, scale, dropout_p, class_block, bias_fn):
    """A2 beyond the band: dense attention inside each residue class mod l. Returns out, lse in query order.

    Class r holds the positions r, r + l, r + 2l, ... (step t at position r + t·l). Its queries are cut into
    sub-blocks of `class_block` steps; every sub-block of class r gathers the keys of class r. Causal: sub-block
    s only needs the key steps before its end, so each s is its own call with that many keys (about half the work
    of gathering the whole class). (Permuting q, k, v into class-major layout once and folding classes into the
    head dimension instead measured about 10% slower on CPU.)
    """
    b, h, n_q, d = q.shape
    n_k = k.shape[2]
    q_offset = n_k - n_q
    device = q.device
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
    heads = torch.arange(h, device=device)

    def run(q_pos_call, q_valid_call, key_steps, repeat):
        """One attend_blocks call: blocks `[nb, rows]` of queries, each gathering `key_steps` steps of its class."""
        kv_pos = (
            torch.arange(classes, device=device).view(classes, 1)
            + torch.arange(key_steps, device=device).view(1, key_steps) * stride
        )  # [classes, m]
        kv_valid = kv_pos < n_k
        kv_pos = kv_pos.clamp(max=n_k - 1)
        if repeat > 1:  # blocks are (class, sub-block) in that order
            kv_pos = kv_pos.repeat_interleave(repeat, dim=0)
            kv_valid = kv_valid.repeat_interleave(repeat, dim=0)
        mask = evaluate_block_mask(
            beyond_fn,
            batch=b,
            heads=heads,
            q_pos=q_pos_call[None],
            kv_pos=kv_pos[None],
            q_valid=q_valid_call[None],
            kv_valid=kv_valid[None],
        )
        q_blocks = _gather_queries(q, q_pos_call, q_offset)
        bias = _bias(bias_fn, batch=b, heads=heads, q_pos=q_pos_call[None], kv_pos=kv_pos[None])
        return attend_blocks(q_blocks, k, v, kv_index=kv_pos, mask=mask, scale=scale, dropout_p=dropout_p, bias=bias)

    if causal:
        outs, lses = [], []
        for sub in range(subs):
            # Query steps of this sub-block end before first_step + (sub + 1)·rows.
            key_steps = min(steps, first_step + (sub + 1) * rows)
            out, lse = run(q_pos[:, sub], q_valid[:, sub], key_steps, 1)  # [b, h, classes, rows, ...]
            outs.append(out)
            lses.append(lse)
        out = torch.cat(outs, dim=3) if subs > 1 else outs[0]  # [b, h, classes, subs·rows, d_v]
        lse = torch.cat(lses, dim=3) if subs > 1 else lses[0]
    else:
        out, lse = run(q_pos.reshape(classes * subs, rows), q_valid.reshape(classes * subs, rows), steps, subs)
    span = subs * rows
    # Query p sits in class p mod l at step p // l: slot (p mod l) · span + (p // l − first_step).
    position = torch.arange(q_offset, n_k, device=device)
    slot = (position % stride) * span + torch.div(position, stride, rounding_mode="floor") - first_step
    out = out.reshape(b, h, classes * span, -1).index_select(2, slot)
    lse = lse.reshape(b, h, classes * span).index_select(2, slot)
    return out, lse


def strided_blocked_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    mask_fn: MaskFn,
    stride: int,
    causal: bool,
    scale: float,
    dropout_p: float = 0.0,
    block_size: int = 64,
    class_block: int | None = None,
    bias_fn: BiasFn | None = None,
) -> Tensor:
    """Attention whose visible keys lie in the strided geometry: |i − j| <= l, or (i − j) mod l = 0.

    Band part (|i − j| <= l) on a band layout, class part (same residue mod l, |i − j| > l) dense inside each
    residue class, merged by log-sum-exp. Cost O(n · (l + n / l)) time; no n x n tensor.

    Args:
        q, k, v: As in the module docstring.
        mask_fn: The pattern predicate (e.g. `patterns.strided_pattern(...)`); it must not see keys outside the
            strided geometry.
        stride: The stride l (>= 1).
        causal: No visible key lies after its query (skips gathering those keys).
        scale: Multiplier of q·k.
        dropout_p: Dropout on the attention probabilities.
        block_size: Queries per band block (64 measured fastest on CPU against 32 and 128).
        class_block: Query steps per block inside a residue class; default 128 when causal (each block is its own
            call gathering only earlier keys), 256 otherwise (larger blocks measured faster on CPU).
        bias_fn: Optional logit bias of each kept pair (relative-position logits), evaluated on the positions each
            part computes and added to its scores.

    Returns:
        The output (module docstring).
    """
    b, h, n_q, _ = q.shape
    n_k = k.shape[2]
    if n_q == 0:
        return q.new_zeros(b, h, 0, v.shape[3])
    if class_block is None:
        class_block = 128 if causal else 256
    kwargs = dict(stride=stride, causal=causal, scale=scale, dropout_p=dropout_p, bias_fn=bias_fn)
    partials = [_strided_band_part(q, k, v, mask_fn, block_size=block_size, **kwargs)]
    # A class key beyond the band is at least 2l away from its query: none exists in a sequence of <= 2l keys.
    if n_k - 1 >= 2 * stride:
        partials.append(_strided_class_part(q, k, v, mask_fn, class_block=class_block, **kwargs))
    out, _ = merge_attention(partials)
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
        q, k, v: As in the module docstring.
        mask_fn: The pattern predicate (e.g. `patterns.fixed_pattern(...)`); it must not see keys outside the
            fixed geometry.
        block_size: Block length l (>= 1).
        num_summary: Summary cells per block c, in [1, l].
        summary_per_head: Head h's summary cells are sub-block `h mod floor(l / c)` counted from the block end
            (see `patterns.fixed_mask`); heads sharing a sub-block are computed together.
        causal: No visible key lies after its query: query blocks are split into up to `causal_groups` groups,
            each gathering only the summary keys before its last block.
        scale: Multiplier of q·k.
        dropout_p: Dropout on the attention probabilities.
        max_block_rows: Blocks longer than this are split into query sub-blocks of at most this many rows (each
            still gathering its whole block), which bounds the workspace.
        causal_groups: See `causal`.
        bias_fn: Optional logit bias of each kept pair (relative-position logits), evaluated on the positions each
            part computes and added to its scores.

    Returns:
        The output (module docstring).
    """
    b, h, n_q, d = q.shape
    n_k = k.shape[2]
    q_offset = n_k - n_q
    device = q.device
    if n_q == 0:
        return q.new_zeros(b, h, 0, v.shape[3])
    heads = torch.arange(h, device=device)

    # Query blocks: pattern blocks `first_block ...` that hold a query, each cut into `subs` sub-blocks.
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
    q_valid = q_valid.reshape(-1, rows)
    nb = q_pos.shape[0]
    q_blocks = _gather_queries(q, q_pos, q_offset)  # [b, h, nb, rows, d]

    # Block part: every sub-block gathers its whole pattern block.
    kv_pos = block_start.view(-1, 1) + torch.arange(keys_per_block, device=device)  # [nbq, m]
    kv_valid = kv_pos < n_k
    kv_pos = kv_pos.clamp(max=n_k - 1).repeat_interleave(subs, dim=0)  # [nb, m]
    kv_valid = kv_valid.repeat_interleave(subs, dim=0)
    block_mask = evaluate_block_mask(
        and_masks(mask_fn, _same_block(block_size, True)),
        batch=b,
        heads=heads,
        q_pos=q_pos[None],
        kv_pos=kv_pos[None],
        q_valid=q_valid[None],
        kv_valid=kv_valid[None],
    )
    own_block_bias = _bias(bias_fn, batch=b, heads=heads, q_pos=q_pos[None], kv_pos=kv_pos[None])
    block_part = attend_blocks(
        q_blocks, k, v, kv_index=kv_pos, mask=block_mask, scale=scale, dropout_p=dropout_p, bias=own_block_bias
    )

    # Summary part: per group of heads sharing summary cells, per group of query blocks sharing a key budget.
    other_block_fn = and_masks(mask_fn, _same_block(block_size, False))
    head_groups = (block_size // num_summary) if summary_per_head else 1
    head_groups = min(head_groups, h)
    group_count = min(q_pattern_blocks, causal_groups) if causal else 1
    # Query-block groups, in pattern blocks: [bounds[i], bounds[i + 1]).
    bounds = [round(i * q_pattern_blocks / group_count) for i in range(group_count + 1)]
    summary_outs, summary_lses, summary_heads = [], [], []
    for group in range(head_groups):
        group_heads = list(range(group, h, head_groups))
        group_heads_t = torch.tensor(group_heads, device=device)
        if head_groups == 1:
            q_g, k_g, v_g = q_blocks, k, v
        else:
            q_g, k_g, v_g = (t.index_select(1, group_heads_t) for t in (q_blocks, k, v))
        positions = _fixed_summary_positions(n_k, block_size, num_summary, group, device)  # [S]
        outs, lses = [], []
        for start, stop in zip(bounds[:-1], bounds[1:]):
            if stop == start:
                continue
            blocks = slice(start * subs, stop * subs)
            n_blocks = (stop - start) * subs
            if causal:
                # The last query block of the group sees summary cells of earlier blocks only.
                keys = _fixed_summary_count((first_block + stop - 1) * block_size, block_size, num_summary, group)
            else:
                keys = positions.shape[0]
            if keys == 0:
                out, lse = _empty_partial(q_g, v_g, n_blocks, rows)
            else:
                key_pos = positions[:keys]
                k_summary = k_g.index_select(2, key_pos)  # [b, hg, S, d]
                v_summary = v_g.index_select(2, key_pos)  # [b, hg, S, d_v]
                mask = evaluate_block_mask(
                    other_block_fn,
                    batch=b,
                    heads=group_heads_t,
                    q_pos=q_pos[None, blocks],
                    kv_pos=key_pos.view(1, 1, keys),
                    q_valid=q_valid[None, blocks],
                )
                bias = _bias(
                    bias_fn, batch=b, heads=group_heads_t, q_pos=q_pos[None, blocks], kv_pos=key_pos.view(1, 1, keys)
                )
                out, lse = attend_blocks(
                    q_g[:, :, blocks],
                    k_summary,
                    v_summary,
                    kv_index=None,
                    mask=mask,
                    scale=scale,
                    dropout_p=dropout_p,
                    bias=bias,
                )
            outs.append(out)
            lses.append(lse)
        summary_outs.append(torch.cat(outs, dim=2) if len(outs) > 1 else outs[0])  # [b, hg, nb, rows, d_v]
        summary_lses.append(torch.cat(lses, dim=2) if len(lses) > 1 else lses[0])
        summary_heads.extend(group_heads)
    if head_groups == 1:
        summary_part = (summary_outs[0], summary_lses[0])
    else:
        order = torch.tensor(summary_heads, device=device).argsort()
        summary_part = (
            torch.cat(summary_outs, dim=1).index_select(1, order),
            torch.cat(summary_lses, dim=1).index_select(1, order),
        )

    out, _ = merge_attention([block_part, summary_part])  # [b, h, nb, rows, d_v]
    # Query p sits in pattern block p // l − first_block at offset p mod l: slot (p // l − first_block)·subs·rows + p
    # mod l.
    position = torch.arange(q_offset, n_k, device=device)
    slot = (torch.div(position, block_size, rounding_mode="floor") - first_block) * (
        subs * rows
    ) + position % block_size
    return out.reshape(b, h, nb * rows, -1).index_select(2, slot)
