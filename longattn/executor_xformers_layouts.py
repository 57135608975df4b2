"""longattn's patterns as xformers kernel calls: `XformersLayout`s of `Part`s, and their dense pictures for tests.

Shape legend: b batch, h heads, n length (n_q queries, n_k keys), d head dim; in xformers' own layout a kernel call
takes `[B, M, H, K]` queries and `[B, N, H, K]` keys/values (B calls of M queries over N keys).

xformers kernels skip work natively for a few mask shapes: a local band (`LocalAttentionFromBottomRightMask`),
causal triangles, block-diagonal packs (`BlockDiagonalMask`). A pattern is mapped onto them as an
`XformersLayout`: a list of `Part`s, each one kernel call over gathered query rows and key rows with one bias
(see `executor_xformers` for the patterns' layouts and how the parts run and merge).

Nothing here imports xformers at module import: the bias classes are read from `xformers.ops` when a layout is
built (`_attn_bias`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
from torch import Tensor

from .executor_band import global_token_index
from .fused_kernel import import_xformers_ops
from .numerics import head_groups

__all__ = [
    "Part",
    "XformersLayout",
    "LayoutGrid",
    "residue_classes",
    "sliding_window_layout",
    "strided_layout",
    "fixed_layout",
    "full_layout",
    "bucket_order",
    "materialize_layout",
]


def _attn_bias():
    return import_xformers_ops().fmha.attn_bias


# ----------------------------------------------------------------------------------------------- layouts
@dataclass
class Part:
    """One kernel call: gathered query rows against gathered key rows under one bias.

    Query rows index the flat table of queries `[b · n_q (+1 zero row), h, d]` (row `i · n_q + position −
    q_offset`); key rows the table `[b · n_k (+1 zero row), h, d]`. The extra zero row (index `b · n_q`, or
    `b · n_k`) fills padding slots: its outputs are dropped and, as a key, it must be hidden.

    Attributes:
        q_rows: Long `[B, M]`, or None for every query in order (`[b, n_q]`, no copy).
        k_rows: Long `[B, N]`, or None for every key in order (`[b, n_k]`).
        bias: An xformers bias over `[M, N]`, or None.
        visible: Optional bool `[B or 1, 1, M, N]`: a dense mask passed to the kernel as an additive bias (small
            parts only, e.g. causal global keys); never together with `bias`.
        key_hidden: Optional bool `[B, N]`: keys this part must skip although its bias shows them.
        heads: Optional long `[h_p]`: the heads of this part (per-head dilation); None = all heads.
    """

    q_rows: Tensor | None
    k_rows: Tensor | None
    bias: Any = None
    visible: Tensor | None = None
    key_hidden: Tensor | None = None
    heads: Tensor | None = None


@dataclass
class XformersLayout:
    """A pattern as kernel calls.

    Attributes:
        parts: The calls. Where two parts cover the same (query, head), their key sets are disjoint and their
            results are merged by log-sum-exp.
        disjoint: No (query, head) is covered twice, and no part hides keys or carries a dense bias: each part
            may run as a plain autograd kernel call (with dropout).
        overrides: Calls whose rows replace the result of `parts` (global queries see every key).
        override_rows: Bool `[b, n_q]`, the queries `overrides` answer.
    """

    parts: list[Part]
    disjoint: bool = False
    overrides: list[Part] = field(default_factory=list)
    override_rows: Tensor | None = None


class LayoutGrid(NamedTuple):
    """What a layout covers: `batch` rows of `heads` heads, `q_len` queries (the last of the positions) over `kv_len`
    keys; its index tensors live on `device`."""

    batch: int
    heads: int
    q_len: int
    kv_len: int
    device: torch.device | str | None = None

    @classmethod
    def of(cls, q: Tensor, k: Tensor) -> LayoutGrid:
        """The grid of a call on q `[b, h, n_q, d]`, k `[b, h, n_k, d]`."""
        return cls(q.shape[0], q.shape[1], q.shape[2], k.shape[2], q.device)

    def length(self, layout: str) -> int:
        """n, for a layout of as many queries as keys (queries = keys = the n positions)."""
        if self.q_len != self.kv_len:
            raise ValueError(f"the {layout} layout needs as many queries as keys (got {self.q_len} and {self.kv_len})")
        return self.kv_len


def residue_classes(q_len: int, kv_len: int, modulus: int, *, device=None) -> list[tuple[Tensor, Tensor]]:
    """Positions split into residue classes mod `modulus`, classes of equal size grouped (one batched call each).

    The queries are the last `q_len` of the `kv_len` positions. In class r the queries are the last members of the
    class, so a band over class steps is bottom-right aligned, as `LocalAttentionFromBottomRightMask` is.

    Args:
        q_len: n_q.
        kv_len: n_k.
        modulus: The dilation or the stride.
        device: Device of the position tensors.

    Returns:
        `[(q_pos [R, M], k_pos [R, N]), ...]`, positions in increasing order inside each class; classes without
        a query are left out.
    """
    q_offset = kv_len - q_len
    groups: dict[tuple[int, int], list[int]] = {}
    for residue in range(min(modulus, kv_len)):
        first_query = q_offset + (residue - q_offset) % modulus
        n_queries = len(range(first_query, kv_len, modulus))
        if n_queries:
            groups.setdefault((n_queries, len(range(residue, kv_len, modulus))), []).append(residue)
    result = []
    for (m, n), residues in groups.items():
        residue = torch.tensor(residues, device=device).view(-1, 1)  # [R, 1]
        first_query = q_offset + (residue - q_offset) % modulus
        q_pos = first_query + modulus * torch.arange(m, device=device)  # [R, M]
        k_pos = residue + modulus * torch.arange(n, device=device)  # [R, N]
        result.append((q_pos, k_pos))
    return result


def _rows(positions: Tensor, batch: int, length: int, offset: int = 0) -> Tensor:
    """Flat table rows `[batch · R, C]` of positions `[R, C]` in every batch row."""
    base = torch.arange(batch, device=positions.device).view(batch, 1, 1) * length  # [b, 1, 1]
    return (base + (positions - offset)[None]).reshape(batch * positions.shape[0], positions.shape[1])


def _hidden_keys(hidden: Tensor | None, k_pos: Tensor | None, batch: int) -> Tensor | None:
    """The hidden flags `[batch · R, N]` of key positions `[R, N]` (None positions: every key in order)."""
    if hidden is None:
        return None
    if k_pos is None:
        return hidden
    return hidden[:, k_pos].reshape(batch * k_pos.shape[0], k_pos.shape[1])


def _token_flags(key_padding_mask: Tensor | None, extra: Tensor | None = None) -> Tensor | None:
    hidden = None if key_padding_mask is None else ~key_padding_mask.bool()
    if extra is not None:
        hidden = extra if hidden is None else hidden | extra
    return hidden


def sliding_window_layout(
    grid: LayoutGrid, *, window: int, dilation: int | Sequence[int] = 1, causal: bool = False,
    key_padding_mask: Tensor | None = None, global_mask: Tensor | None = None,
) -> XformersLayout:  # fmt: skip
    """`patterns.sliding_window_pattern` as xformers calls.

    Per head group sharing a dilation and per group of equally long residue classes: a band
    `LocalAttentionFromBottomRightMask(window, window or 0)` over class steps (dilation 1: the sequence itself,
    no copy). Global tokens add a part over the gathered global keys (hidden inside the band, so each key counts
    once) and an override for the global queries (dense over all keys). Padding keys are hidden keys.

    Args:
        grid: The calls' batch, heads, lengths (the queries are the last n_q positions) and device.
        window: Keys on each side (causal: before).
        dilation: Gap between keys, or one per head.
        causal: Keys after the query are hidden.
        key_padding_mask: Bool `[b, n_k]`, True = real token.
        global_mask: Bool `[b, n_k]`, True = global token.

    Returns:
        The layout.
    """
    bias = _attn_bias()
    batch, heads, q_len, kv_len, device = grid
    q_offset = kv_len - q_len
    global_index = global_valid = None
    if global_mask is not None:
        global_index, global_valid = global_token_index(global_mask.bool())  # [b, g]
        if global_index.shape[1] == 0:
            global_index = global_mask = None
    hidden = _token_flags(key_padding_mask, None if global_mask is None else global_mask.bool())
    parts = []
    for d, head_list in head_groups(dilation, heads):
        head_index = None if len(head_list) == heads else torch.tensor(head_list, device=device)
        for q_pos, k_pos in residue_classes(q_len, kv_len, d, device=device):
            n_class = k_pos.shape[1]
            band = bias.LocalAttentionFromBottomRightMask(
                window_left=min(window, n_class), window_right=0 if causal else min(window, n_class)
            )
            if d == 1:  # the one class is the sequence itself
                parts.append(Part(None, None, band, key_hidden=hidden, heads=head_index))
            else:
                parts.append(
                    Part(
                        _rows(q_pos, batch, q_len, q_offset),
                        _rows(k_pos, batch, kv_len),
                        band,
                        key_hidden=_hidden_keys(hidden, k_pos, batch),
                        heads=head_index,
                    )
                )
    layout = XformersLayout(parts, disjoint=hidden is None)
    if global_index is None:
        return layout

    g = global_index.shape[1]
    batch_rows = torch.arange(batch, device=device).view(batch, 1)
    real = None if key_padding_mask is None else key_padding_mask.bool()
    global_hidden = ~global_valid if real is None else ~global_valid | ~real.gather(1, global_index)  # [b, g]
    visible = None
    if causal:
        query_pos = q_offset + torch.arange(q_len, device=device)
        visible = global_index[:, None, None, :] <= query_pos.view(1, 1, q_len, 1)  # [b, 1, n_q, g]
    layout.parts.append(Part(None, batch_rows * kv_len + global_index, visible=visible, key_hidden=global_hidden))

    # Global queries see every (real, and causal: earlier) key: one dense call over all keys per global query.
    is_query = global_valid & (global_index >= q_offset)  # [b, g]
    q_rows = torch.where(is_query, batch_rows * q_len + global_index - q_offset, batch * q_len)  # padding -> zero row
    visible = None
    if causal:
        visible = torch.arange(kv_len, device=device).view(1, 1, 1, kv_len) <= global_index[:, None, :, None]
    layout.overrides = [Part(q_rows, None, visible=visible, key_hidden=None if real is None else ~real)]
    override_rows = torch.zeros(batch, q_len, dtype=torch.bool, device=device)
    override_rows[batch_rows.expand(batch, g)[is_query], (global_index - q_offset)[is_query]] = True
    layout.override_rows = override_rows
    layout.disjoint = False
    return layout


def strided_layout(
    grid: LayoutGrid, *, stride: int, causal: bool = True, key_padding_mask: Tensor | None = None
) -> XformersLayout:
    """Sparse Transformer's strided pattern as xformers calls (queries = keys = the n positions of `grid`).

    Query i sees A1 = {i − l … i} (bidirectional: |i − j| <= l) and A2 = {j : (i − j) mod l = 0} (causal: j <= i).
    Disjoint parts: the band |i − j| < l (causal: i − l < j <= i) on the sequence; the earlier members of i's
    residue class mod l (a causal triangle over the class, shifted by one step so it excludes i); bidirectional
    also the later members (the same over the reversed class).

    Args:
        grid: The calls' batch, heads, lengths and device.
        stride: l >= 1.
        causal: Keys after the query are hidden.
        key_padding_mask: Bool `[b, n]`, True = real token.

    Returns:
        The layout.
    """
    bias = _attn_bias()
    batch, length, device = grid.batch, grid.length("strided"), grid.device
    reach = min(stride - 1, length)
    hidden = _token_flags(key_padding_mask)
    parts = [
        Part(
            None,
            None,
            bias.LocalAttentionFromBottomRightMask(window_left=reach, window_right=0 if causal else reach),
            key_hidden=hidden,
        )
    ]
    for q_pos, k_pos in residue_classes(length, length, stride, device=device):
        if q_pos.shape[1] < 2:
            continue
        # Query step t (t >= 1) against class steps 0 .. t-1: a causal triangle between steps 1.. and steps ..-1;
        # bidirectional, the later members too: the same triangle over the reversed class.
        triangles = [(q_pos[:, 1:], k_pos[:, :-1])]
        if not causal:
            triangles.append((q_pos[:, :-1].flip(1), k_pos[:, 1:].flip(1)))
        for tri_q, tri_k in triangles:
            rows = (_rows(tri_q, batch, length), _rows(tri_k, batch, length))
            parts.append(Part(*rows, bias.LowerTriangularMask(), key_hidden=_hidden_keys(hidden, tri_k, batch)))
    return XformersLayout(parts, disjoint=False)


def fixed_layout(
    grid: LayoutGrid, *, block_size: int, num_summary: int, summary_per_head: bool = False, causal: bool = True,
    key_padding_mask: Tensor | None = None,
) -> XformersLayout:  # fmt: skip
    """Sparse Transformer's fixed pattern as xformers calls (queries = keys = the n positions of `grid`, blocks
    from 0).

    Query i sees A1 = {j : floor(j / l) = floor(i / l)} and A2 = the summary keys {j : j mod l >= l − c} (per
    head: head h owns the c cells `g·c … (g + 1)·c − 1` counted back from the block end, g = h mod floor(l / c)),
    and causal j <= i. Parts, per group of heads sharing summary cells: the blocks (full, or causal triangles) with
    the block's own summary keys hidden, and one call of every query over all summary keys (causal: a dense
    `[n, n · c / l]` mask, the only O(n² · c / l) piece).

    Args:
        grid: The calls' batch, heads, lengths and device.
        block_size: l >= 1.
        num_summary: c, 1 <= c <= l.
        summary_per_head: Summary cells per head group as above; False: the last c cells for every head.
        causal: Keys after the query are hidden.
        key_padding_mask: Bool `[b, n]`, True = real token (blocks still start at position 0).

    Returns:
        The layout.
    """
    bias = _attn_bias()
    batch, heads, length, device = grid.batch, grid.heads, grid.length("fixed"), grid.device
    positions = torch.arange(length, device=device)
    hidden = _token_flags(key_padding_mask)
    n_full = length // block_size
    blocks = []
    if n_full:
        blocks.append(positions[: n_full * block_size].view(n_full, block_size))
    if length % block_size:
        blocks.append(positions[n_full * block_size :].view(1, -1))
    groups = block_size // num_summary if summary_per_head else 1
    from_end = block_size - 1 - positions % block_size  # [n]
    parts = []
    for group in range(min(groups, heads)):
        head_index = None if groups == 1 else torch.arange(group, heads, groups, device=device)
        is_summary = (from_end >= group * num_summary) & (from_end < (group + 1) * num_summary)  # [n]
        block_hidden = _token_flags(key_padding_mask, is_summary.view(1, length).expand(batch, length))
        for block_pos in blocks:
            rows = _rows(block_pos, batch, length)
            parts.append(
                Part(
                    rows,
                    rows,
                    bias.LowerTriangularMask() if causal else None,
                    key_hidden=_hidden_keys(block_hidden, block_pos, batch),
                    heads=head_index,
                )
            )
        summary = positions[is_summary]  # [S]
        if summary.numel():
            visible = (summary.view(1, 1, 1, -1) <= positions.view(1, 1, -1, 1)) if causal else None  # [1, 1, n, S]
            parts.append(
                Part(
                    None,
                    _rows(summary.view(1, -1), batch, length),
                    visible=visible,
                    key_hidden=_hidden_keys(hidden, summary.view(1, -1), batch),
                    heads=head_index,
                )
            )
    return XformersLayout(parts, disjoint=False)


def full_layout(grid: LayoutGrid, *, causal: bool = False, key_padding_mask: Tensor | None = None) -> XformersLayout:
    """Dense attention as one call over `grid` (causal: bottom-right aligned triangle); padding keys hidden."""
    bias = _attn_bias()
    causal_bias = bias.LowerTriangularFromBottomRightMask() if causal else None
    hidden = _token_flags(key_padding_mask)
    return XformersLayout([Part(None, None, causal_bias, key_hidden=hidden)], disjoint=hidden is None)


def bucket_order(buckets: Tensor) -> tuple[Tensor, list[int]]:
    """Sort every (batch, head) row by (bucket, position): content-based kinds as one block-diagonal call.

    LSH buckets, routing clusters and Sinkhorn blocks attend within a bucket. Sorted, the buckets of every row lie
    side by side; packed one after another they are the blocks of a `BlockDiagonalMask` (with `.make_causal()`
    for causal kinds: inside a bucket the order is by position). Reads the bucket sizes back to the host once.

    Args:
        buckets: Long `[b, h, n]`, the bucket of each position, in `[0, num_buckets)`.

    Returns:
        `(order, seqlens)`: order long `[b · h · n]`, the flat `(b, h, n)` index of each sorted slot; seqlens the
        size of every non-empty (batch, head, bucket) block, in order.
    """
    b, h, n = buckets.shape
    num_buckets = int(buckets.max()) + 1 if buckets.numel() else 1
    row = torch.arange(b * h, device=buckets.device).view(b, h, 1)
    key = (row * num_buckets + buckets) * n + torch.arange(n, device=buckets.device)  # [b, h, n], unique
    order = key.reshape(-1).argsort()
    sizes = torch.bincount((row * num_buckets + buckets).reshape(-1), minlength=b * h * num_buckets)
    return order, [int(size) for size in sizes.tolist() if size]


# ----------------------------------------------------------------------------------------------- dense pictures
def materialize_layout(layout: XformersLayout, grid: LayoutGrid) -> tuple[Tensor, Tensor]:
    """The pattern a layout computes, as a dense mask, and how often each (query, key) is covered.

    Evaluates every part's bias (`materialize`), dense mask and hidden keys and scatters them back to original
    positions; overrides replace their rows. For tests: a layout is right when the mask equals the pattern's and
    the count never exceeds 1 (disjoint parts: the log-sum-exp merge counts each key once).

    Returns:
        `(mask, count)`: bool and long `[b, h, n_q, n_k]`.
    """
    count = _coverage(layout.parts, grid)
    if layout.overrides:
        override = _coverage(layout.overrides, grid)
        rows = layout.override_rows[:, None, :, None]
        count = torch.where(rows, override, count)
    return count > 0, count


def _coverage(parts, grid: LayoutGrid) -> Tensor:
    batch, heads, q_len, kv_len, device = grid
    count = torch.zeros(batch, heads, q_len, kv_len, dtype=torch.long, device=device)
    for part in parts:
        q_rows = part.q_rows if part.q_rows is not None else _identity_rows(batch, q_len, device)
        k_rows = part.k_rows if part.k_rows is not None else _identity_rows(batch, kv_len, device)
        m, n = q_rows.shape[1], k_rows.shape[1]
        visible = torch.ones(q_rows.shape[0], 1, m, n, dtype=torch.bool, device=device)
        if part.bias is not None:
            visible = visible & torch.isfinite(part.bias.materialize((m, n), device=device))
        if part.visible is not None:
            visible = visible & part.visible
        if part.key_hidden is not None:
            visible = visible & ~part.key_hidden[:, None, None, :]
        head_index = part.heads if part.heads is not None else torch.arange(heads, device=device)
        for call in range(q_rows.shape[0]):
            q_real = q_rows[call] < batch * q_len
            k_real = k_rows[call] < batch * kv_len
            q_batch, q_pos = q_rows[call][q_real] // q_len, q_rows[call][q_real] % q_len
            k_pos = k_rows[call][k_real] % kv_len
            block = visible[call, 0][q_real][:, k_real].long()  # [m', n']
            b = int(q_batch[0]) if q_batch.numel() else 0
            if q_batch.numel() and not bool((q_batch == b).all()):
                raise ValueError("a kernel call mixes batch rows")
            count[b, head_index[:, None, None], q_pos[None, :, None], k_pos[None, None, :]] += block
    return count


def _identity_rows(batch: int, length: int, device) -> Tensor:
    return torch.arange(batch * length, device=device).view(batch, length)
