"""Reformer LSH attention, step 3 without sorted copies: window attention over rows gathered by index (Kitaev et
al. 2020, "Reformer: The Efficient Transformer").

`attend_gathered_windows` takes the unsorted rows (`[Nq, d]`, `[Nk, d]`, `[Nv, d_v]`) and the index of every row of
the sorted buffer (the layout of `ops_lsh_sorting`), gathers one group of chunks at a time, in forward and again in
backward (`_GatheredWindows`, `_GroupRows`), and merges the slots that answer the same output row (LSH's hash
rounds, routing's clusters) by log-sum-exp inside the kernel (`_merge_slots`): `[n_out, d_v]`, keeping O(n·d)
floats and integer indices for backward. `RelativeColumns` reads the relative-position logits of the gathered
windows; `_hide` applies the mask, the causal column ranges and Reformer's self rule (`ops_lsh_chunks.SELF_SCORE`).
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch
from torch import Tensor

from .numerics import NO_KEY_LSE, compute_dtype, hide_exactly
from .ops_lsh_chunks import SELF_SCORE, _self_diagonal, _windows
from .ops_lsh_hashing import _key_norm_factor

__all__ = ["RelativeColumns", "attend_gathered_windows"]

# Score elements per group of `attend_gathered_windows` (1 MB of float32): its group holds about eight buffers of
# this size (scores, their gradient, gathered rows and their gradients), all it adds to peak memory.
_GATHERED_GROUP_ELEMENTS = 2**18


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
