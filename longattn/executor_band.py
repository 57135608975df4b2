"""The band engine: band layouts, global tokens, and `_BandAttention`, a plain band (plus global keys and queries)
through torch's fused CPU attention kernel, block by block.

Shape legend: b batch, h heads, h_kv key/value heads (grouped-query attention: h_kv divides h), n length (n_q
queries, n_k keys), nb query blocks, c queries per block, m = c + window_left + window_right band keys per block,
g global tokens (the most any batch row has), d head dim (d_v for values).

Longformer's pattern (Beltagy et al. 2020, "Longformer: The Long-Document Transformer"): each query sees a band of
keys around it (a sliding window, dilated per head), global tokens see every key and are seen by every query.

- `band_layout` places the queries in blocks of c and gives each block the keys its band covers; a dilation d splits
  the positions into residue classes mod d so that a dilated window costs the same as a plain one. Every blocked
  path of a band reads it (`executor_blocked.band_block_attention`, `executor_sparse`'s strided band, context
  parallelism); `global_token_index` lists each batch row's global tokens.
- `_BandAttention` (run by `executor_blocked.banded_attention` for a plain band without dropout on CPU): a block's
  keys are contiguous positions, so they are read as an overlapping strided view of k and v themselves (only the
  first and last chunks copy a small zero-padded piece), key gradients are added straight into their tensors, and
  the fused kernel never writes a block's scores to memory. Blocks at the edges or next to padding / global keys
  evaluate their masks from the predicate in forward and again in backward; every other block of an exact band
  takes one shared band mask. The global keys join each block by plain products merged by log-sum-exp, and the
  global tokens' own query rows are replaced by dense rows over every key.

Why: through `attend_blocks` a plain band gathers a copy of its keys and values per block and writes each chunk's
scores to a workspace; the fused kernel reads the keys in place, never writes a block's scores to memory, and
recomputes the probabilities tile by tile in backward (docs/benchmarks.md, "The fused band path"). Saved for
backward: q, k, v, the output and its log-sum-exp (O(n · d)), nothing n x keys.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import torch
from torch import Tensor

from .executor_chunks import _WORKSPACE_ELEMENTS, _Workspace, evaluate_block_mask
from .numerics import HIDDEN_LOGIT, compute_dtype, hide_logits
from .patterns import MaskFn


@dataclass(frozen=True)
class BandLayout:
    """Where each query slot and gathered key of a banded (optionally dilated) attention sits in the sequence.

    Dilation d splits positions into residue classes mod d; within a class, a dilated window of w steps becomes a
    contiguous run of w neighbours. Query blocks hold consecutive members of one class and gather the class
    members within the band around them, so a dilated window costs the same as a plain one.

    Attributes:
        q_pos: Long `[nb, c]`, position of each query slot (clamped into range for padding slots).
        q_valid: Bool `[nb, c]`, False for padding slots.
        kv_pos: Long `[nb, m]`, position of each gathered key (clamped into range for out-of-range keys).
        kv_valid: Bool `[nb, m]`, False for out-of-range keys.
        slot_of_query: Long `[n_q]`, the flat slot (`block · c + i`) of each query, or None when slots are the
            queries in order (dilation 1, n_q a multiple of c).
    """

    q_pos: Tensor
    q_valid: Tensor
    kv_pos: Tensor
    kv_valid: Tensor
    slot_of_query: Tensor | None


def band_layout(
    *,
    q_len: int,
    kv_len: int,
    window_left: int,
    window_right: int,
    dilation: int = 1,
    block_size: int = 64,
    q_offset: int = 0,
    device: torch.device | str | None = None,
) -> BandLayout:
    """Block layout of a band: query p gathers the keys p − d·window_left … p + d·window_right, d apart.

    Blocks of c consecutive queries of one residue class gather the c + window_left + window_right keys of that
    class covering all their bands, so some gathered keys lie outside a given query's band: the pattern
    predicate masks them.

    Args:
        q_len: Number of queries n_q (positions `q_offset … q_offset + n_q − 1`).
        kv_len: Number of keys n_k (positions `0 … n_k − 1`).
        window_left: Dilated steps gathered before each query (>= 0).
        window_right: Dilated steps gathered after each query (>= 0; 0 for causal patterns).
        dilation: Step d between gathered keys (>= 1).
        block_size: Queries per block c (smaller when a class is shorter).
        q_offset: Position of the first query.
        device: Device of the index tensors.

    Returns:
        The `BandLayout`.
    """
    d = dilation
    class_len = max(1, -(-q_len // d))  # queries per residue class, at most
    c = max(1, min(block_size, class_len))
    blocks_per_class = -(-class_len // c)
    span = blocks_per_class * c
    residue = torch.arange(d, device=device).view(d, 1, 1)  # [d, 1, 1]
    # First class step of residue r at or after q_offset: ceil((q_offset - r) / d).
    first_step = torch.div(q_offset - residue + d - 1, d, rounding_mode="floor")  # [d, 1, 1]
    block_step = first_step + torch.arange(blocks_per_class, device=device).view(1, -1, 1) * c  # [d, nbc, 1]
    q_step = block_step + torch.arange(c, device=device).view(1, 1, c)  # [d, nbc, c]
    q_pos = q_step * d + residue
    q_valid = (q_pos >= q_offset) & (q_pos < q_offset + q_len)
    m = c + window_left + window_right
    kv_step = block_step - window_left + torch.arange(m, device=device).view(1, 1, m)  # [d, nbc, m]
    kv_pos = kv_step * d + residue
    kv_valid = (kv_pos >= 0) & (kv_pos < kv_len)
    slot_of_query = None
    if d > 1 or q_len % c != 0:
        position = q_offset + torch.arange(q_len, device=device)
        r = position % d
        slot_of_query = r * span + (torch.div(position, d, rounding_mode="floor") - first_step.view(d)[r])
    return BandLayout(
        q_pos=q_pos.clamp(q_offset, q_offset + q_len - 1).reshape(d * blocks_per_class, c),
        q_valid=q_valid.reshape(d * blocks_per_class, c),
        kv_pos=kv_pos.clamp(0, kv_len - 1).reshape(d * blocks_per_class, m),
        kv_valid=kv_valid.reshape(d * blocks_per_class, m),
        slot_of_query=slot_of_query,
    )


def global_token_index(global_mask: Tensor) -> tuple[Tensor, Tensor]:
    """Positions of the global tokens of each batch row, padded to the row with the most.

    The number of global slots g is a shape read from the data: eagerly one device sync. Under `torch.compile` and
    `torch.export` a value read back would break the graph, so g is the sequence length there (every position could
    be global; the extra slots are invalid): the global part then costs as much as dense attention.

    Args:
        global_mask: Bool `[b, n]`, True = global token.

    Returns:
        `(index, valid)`: long `[b, g]` positions in increasing order (padding slots hold 0) and bool `[b, g]`.
    """
    counts = global_mask.sum(dim=1)  # [b]
    if torch.compiler.is_compiling():
        g = global_mask.shape[1]
    else:
        g = int(counts.max()) if global_mask.numel() else 0
    # A stable sort of "not global" puts the global positions first, in order.
    order = torch.sort((~global_mask).to(torch.uint8), dim=1, stable=True).indices[:, :g]  # [b, g]
    valid = torch.arange(g, device=global_mask.device).view(1, g) < counts.view(-1, 1)
    return order.masked_fill(~valid, 0), valid


# ------------------------------------------------------------------------------------------------ the fused band engine
# torch's fused CPU attention (the kernel behind `scaled_dot_product_attention` on CPU): it never writes a block's
# scores to memory, takes an additive mask and returns the log-sum-exp, and its backward recomputes the
# probabilities tile by tile. It has no dropout, so `banded_attention` with dropout runs `attend_blocks`.
_FLASH_FORWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
_FLASH_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default


# Key-gradient elements [n_blk, h_kv, m, d] of one chunk of the fused band path (the kernel's backward writes one such
# tensor, m/c times the chunk's keys, per call; the additive mask and key/value gradients of a chunk are as large).
# Each chunk costs a dozen Python-level calls, so chunks of one block are slow: one thread, process time, forward +
# backward, blocks of 64, against dense SDPA's work times the window's share: 4K tokens, 12 heads of 64, w = 256 per
# side, global first token: 2**18 (one block a chunk) 2.05x, 2**20 1.85x, 2**21 1.80x; 8K tokens, 16 heads on 4
# key/value heads, causal w = 512: 2**18 1.28x, 2**20 1.18x, 2**21 1.19x. The chunk workspaces, not the length, set
# the memory above the O(n · d) tensors: one layer of hidden 256, 4 heads, w = 256, forward + backward, peak RSS
# (scripts/benchmark.py, one run each): 2**18 53 MB at 4K / 163 MB at 16K, 2**20 73 / 186 MB, 2**21 97 / 204 MB.
# This is the cap; `_band_chunks` also keeps a chunk within an eighth of q's elements (but at least 2 blocks): at 16K
# tokens, 4 heads, tensor peak 167 MB (1.14x full attention's) at 2**20, 157 MB at 2**19 (3 blocks), time within the
# noise (0.44 s vs 0.45 s for the attention alone). Grouped heads (16 on 4 key/value heads) keep the cap.
_BAND_CHUNK_ELEMENTS = _WORKSPACE_ELEMENTS // 2  # 2**20 where the budget is 2**21 (`tuning`)


@dataclass
class _BandPlan:
    """What `_BandAttention` needs besides q, k, v: the block layout of a plain band and the predicates that give
    every chunk's masks (evaluated on original positions in forward, and again in backward instead of being saved).

    Block i's keys are the contiguous positions `first_key + i·c … first_key + i·c + m − 1`: a strided view of k, no
    gather (`_band_keys`). `plain[row][i]` (from `_plain_blocks`) says that block i of batch row `row` sees exactly
    the band geometry, `0 <= key slot − query slot <= m − c`: its mask is `band_bias`, the same for every such block,
    built once instead of evaluated from the predicate; None: every block evaluates the predicate.
    """

    layout: BandLayout
    local_fn: MaskFn
    mask_fn: MaskFn
    heads: Tensor  # [h], original head of each head slot
    global_index: Tensor | None  # [b, g]
    global_valid: Tensor | None  # [b, g]
    scale: float
    first_key: int  # position of block 0's first key: q_offset - window_left
    plain: list[list[bool]] | None = None  # [b][nb]
    # Whether the global tokens' query rows (dense, over every key) are computed here too (`_global_query_rows`)
    # instead of by `executor_blocked._global_queries`; q_offset is the position of the first query.
    global_queries: bool = False
    q_offset: int = 0
    _band_biases: dict = field(default_factory=dict)

    def local_bias(self, batch: int, start: int, stop: int) -> Tensor:
        """Bool `[b|1, h|1, n_blk, c, m]` mask of blocks start:stop against their band keys."""
        layout = self.layout
        keys = layout.kv_pos[None, start:stop], layout.kv_valid[None, start:stop]
        return self._blocks_against(self.local_fn, batch, start, stop, *keys)

    def global_bias(self, batch: int, start: int, stop: int) -> Tensor:
        """Bool `[b, h|1, n_blk, c, g]` mask of blocks start:stop against their row's global keys."""
        keys = self.global_index[:, None, :], self.global_valid[:, None, :]
        return self._blocks_against(self.mask_fn, batch, start, stop, *keys)

    def _blocks_against(
        self, mask_fn: MaskFn, batch: int, start: int, stop: int, kv_pos: Tensor, kv_valid: Tensor
    ) -> Tensor:
        """`mask_fn` on the queries of blocks start:stop against keys at `kv_pos` `[b|1, n_blk|1, m]`."""
        q_pos, q_valid = self.layout.q_pos[None, start:stop], self.layout.q_valid[None, start:stop]
        return evaluate_block_mask(
            mask_fn, batch=batch, heads=self.heads, q_pos=q_pos, kv_pos=kv_pos, q_valid=q_valid, kv_valid=kv_valid
        )

    def is_plain(self, row: int, start: int, stop: int) -> bool:
        return self.plain is not None and all(self.plain[row][start:stop])

    def band_bias(self, group: int, dtype: torch.dtype) -> Tensor:
        """The additive mask of a plain block, `[1, 1, group·c, m]` (one row per stacked query row; the kernel
        broadcasts it over blocks and heads): query slot i sees key slot j when `0 <= j − i <= m − c`."""
        key = (group, dtype)
        if key not in self._band_biases:
            c, m = self.layout.q_pos.shape[1], self.layout.kv_pos.shape[1]
            device = self.layout.q_pos.device
            offset = torch.arange(m, device=device).view(1, m) - torch.arange(c, device=device).view(c, 1)
            visible = (offset >= 0) & (offset <= m - c)  # [c, m]
            bias = torch.zeros(c, m, dtype=dtype, device=device).masked_fill_(~visible, HIDDEN_LOGIT)
            self._band_biases[key] = bias.repeat(group, 1).view(1, 1, group * c, m)
        return self._band_biases[key]


def _plain_blocks(
    layout: BandLayout,
    first_key: int,
    n_k: int,
    batch: int,
    global_mask: Tensor | None,
    key_padding_mask: Tensor | None,
) -> list[list[bool]]:
    """Which blocks of a plain band (dilation 1, `banded_attention(exact_band=True)`) see exactly the band geometry,
    `[b][nb]`: all their queries are real slots, and their m keys lie inside the sequence and hold no global key (those
    are attended separately, so the band hides them) and no padding key. Eager only (the fused path's condition): the
    answer is read back to the host once per call."""
    nb, c = layout.q_pos.shape
    m = layout.kv_pos.shape[1]
    device = layout.q_pos.device
    lo = first_key + torch.arange(nb, device=device) * c  # [nb], first key of each block
    plain = (lo >= 0) & (lo + m <= n_k) & layout.q_valid.all(dim=1)  # [nb]
    special = None if global_mask is None else global_mask.bool()
    if key_padding_mask is not None:
        padding = ~key_padding_mask.bool()
        special = padding if special is None else special | padding
    if special is None:
        return plain.expand(batch, nb).tolist()
    # Keys of a block that are global or padding: a difference of running counts, O(n) per row.
    count = torch.nn.functional.pad(special.long().cumsum(dim=1), (1, 0))  # [b, n_k + 1]
    first, last = lo.clamp(0, n_k), (lo + m).clamp(0, n_k)
    return (plain & (count[:, last] == count[:, first])).expand(batch, nb).tolist()


def _additive(mask: Tensor, row: int, h_kv: int, group: int, workspace: _Workspace, name: str) -> tuple[Tensor, Tensor]:
    """Bool `[b|1, h|1, n_blk, c, m]` -> the additive mask of batch row `row` as the fused kernel reads it,
    `[n_blk, h_kv|1, group·c, m]`: 0 where visible, `HIDDEN_LOGIT` where hidden (finite, so a row that sees
    nothing stays finite; exact for the bounded logits of the fused path), and which rows see a key,
    bool `[n_blk, h_kv|1, group·c]`, from the mask."""
    mask = mask[row if mask.shape[0] > 1 else 0].transpose(0, 1)  # [n_blk, h|1, c, m]
    n_blk, heads, c, m = mask.shape
    # [n_blk, h_kv|1, group, c, m]: one mask row per stacked query row
    mask = mask.unflatten(1, (h_kv, group)) if heads > 1 else mask.unsqueeze(1).expand(n_blk, 1, group, c, m)
    bias = workspace.get(name, mask.shape)
    visible, hidden = (torch.tensor(value, dtype=bias.dtype, device=bias.device) for value in (0.0, HIDDEN_LOGIT))
    torch.where(mask, visible, hidden, out=bias)
    return bias.flatten(2, 3), mask.any(dim=-1).flatten(2, 3)


class _ChunkMasks:
    """The band's predicate mask of one chunk of blocks, evaluated on first use (plain blocks never ask for it)."""

    def __init__(self, plan: _BandPlan, batch: int, start: int, stop: int):
        self.plan, self.batch, self.start, self.stop = plan, batch, start, stop
        self._local = None

    def local(self) -> Tensor:
        if self._local is None:
            self._local = self.plan.local_bias(self.batch, self.start, self.stop)
        return self._local


class _BandAttention(torch.autograd.Function):
    """Forward and backward of a plain band (plus global keys) through torch's fused CPU attention, block by block.

    q `[b, h, n_q, d]`, k `[b, h_kv, n_k, d]`, v `[b, h_kv, n_k, d_v]` -> out `[b, h, n_q, d_v]`. Each block of c
    queries (with its group of query heads stacked as rows, `[n_blk, h_kv, group·c, d]`) attends to the m band keys
    of its key/value head, read as an overlapping strided view of k and v (`_band_keys`), and to its row's g global
    keys by plain products (their mask built once per pass, `_global_additive`); the two partial attentions are merged
    in place by their log-sum-exps. With `plan.global_queries`, the global tokens' own query rows are then replaced by
    their dense rows over every key (`_global_query_forward`). Saved for backward: q, k, v, the output and the
    log-sum-exp (O(n · d)) and the global queries' `[k, h|1, n_k]` bool mask; the masks of blocks at the edges, next to
    padding or global keys are evaluated again from the predicates, every other block takes the plan's one
    `band_bias`. Backward runs the fused backward on the band and the products on the global keys with the MERGED
    output and log-sum-exp: it recomputes P = exp(S − lse) and rowsum(dO ∘ O) from them, which are exactly the merged
    softmax's, so the two parts give the exact gradient; rows that saw nothing and the global queries' rows get no
    band gradient, the latter get their dense rows' (`_global_query_backward`).
    Band key gradients `[n_blk, h_kv, m, d]` are added straight into the key/value gradients by ceil(m / c) strided
    additions. Nothing O(n · d) is allocated besides the output, its log-sum-exp and the gradients; plain blocks of
    one head per key/value head read their queries, output gradients and outputs as views, no copy.
    """

    @staticmethod
    def forward(ctx, q, k, v, plan: _BandPlan):
        b, h, n_q, d = q.shape
        h_kv, d_v = v.shape[1], v.shape[3]
        group = h // h_kv
        nb, c = plan.layout.q_pos.shape
        dtype = compute_dtype(q.dtype)
        glob = None if plan.global_index is None else [_global_rows(t, plan, dtype) for t in (k, v)]
        g_bias_all, g_sees = (None, None) if glob is None else _global_additive(plan, b, h_kv, group, dtype)
        out = torch.empty(b, nb * c, h, d_v, dtype=dtype, device=q.device)  # [b, slots, h, d_v]
        lse = torch.empty(b, nb, h_kv, group * c, dtype=dtype, device=q.device)
        # Which rows see a key, from the masks (never from the log-sum-exp's value); saved for backward.
        has_key = torch.ones(b, nb, h_kv, group * c, dtype=torch.bool, device=q.device)
        workspace = _Workspace(dtype, q.device)
        for step in _band_steps(q, k, v, plan, workspace, dtype):
            start, stop, row, plain, q_chunk, keys, values, bias, sees = step
            o, row_lse = _FLASH_FORWARD(q_chunk, keys, values, attn_mask=bias, scale=plan.scale)
            if glob is not None:
                # Merged by log-sum-exp in place: o ← o · exp(lse − L) + exp(S_g − L) V_g, L the merged lse.
                scores = _global_scores(q_chunk, glob[0][row], g_bias_all[row, start:stop], plan.scale)
                merged = torch.logaddexp(row_lse, torch.logsumexp(scores, dim=-1))  # [n_blk, h_kv, group·c]
                o.mul_((row_lse - merged).exp_().unsqueeze(-1))
                o.add_(torch.matmul(scores.sub_(merged.unsqueeze(-1)).exp_(), glob[1][row]))
                row_lse = merged
            if not plain:
                # A row whose keys the masks hide all: its output is zero, as in `attend_blocks`. (A plain block's
                # queries all see their own key.)
                if glob is not None:
                    sees = sees | g_sees[row, start:stop]
                has_key[row, start:stop] = sees
                o = o * sees.unsqueeze(-1)
            lse[row, start:stop] = row_lse
            _scatter_queries(out, o, row, start, stop, c, group)
        rows = _global_query_rows(plan, q.shape[2], k.shape[2]) if plan.global_queries else None
        if rows is not None:
            _global_query_forward(q, k, v, out, plan, rows, dtype)
        ctx.save_for_backward(q, k, v, out, lse, has_key, *(() if rows is None else (rows[2],)))
        ctx.rows = None if rows is None else rows[:2]
        ctx.plan = plan
        result = out[:, :n_q].transpose(1, 2)  # [b, h, n_q, d_v]
        return result if result.dtype == q.dtype else result.to(q.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse, has_key, *saved_mask = ctx.saved_tensors
        plan = ctx.plan
        b, h, n_q, d = q.shape
        h_kv = v.shape[1]
        group = h // h_kv
        nb, c = plan.layout.q_pos.shape
        dtype = compute_dtype(q.dtype)
        glob = None if plan.global_index is None else [_global_rows(t, plan, dtype) for t in (k, v)]
        grad_q = torch.empty(b, nb * c, h, d, dtype=dtype, device=q.device)
        # In the layout of k and v (e.g. `[b, n, h_kv, d]` memory of a projection): the gradients then flow back
        # into the projections as views, no copy.
        grad_k, grad_v = (torch.zeros_like(t, dtype=dtype, memory_format=torch.preserve_format) for t in (k, v))
        grad_glob = None if glob is None else [torch.zeros_like(t) for t in glob]  # [b, h_kv, g, d]
        g_bias_all = None if glob is None else _global_additive(plan, b, h_kv, group, dtype)[0]
        # Rows of the band that get no gradient: those that saw no key (zeroed in forward) and the global queries
        # (their dense rows replaced the band's). Only blocks that are not plain hold such rows.
        keep = has_key.clone()  # [b, nb, h_kv, group·c]
        if ctx.rows is not None:
            batch_index, slot = ctx.rows
            keep.view(b, nb, h_kv, group, c)[batch_index, slot // c, :, :, slot % c] = False
        workspace = _Workspace(dtype, q.device)
        for step in _band_steps(q, k, v, plan, workspace, dtype):
            start, stop, row, plain, q_chunk, keys, values, bias, _ = step
            grad_out_chunk = _chunk_queries(grad_out, row, start, stop, c, group, workspace, "grad_out", view=plain)
            out_chunk = _chunk_queries(out, row, start, stop, c, group, workspace, "out", slots_first=True, view=plain)
            row_lse = lse[row, start:stop]  # [n_blk, h_kv, group·c]
            if not plain:
                grad_out_chunk.mul_(keep[row, start:stop].unsqueeze(-1))
            grad_q_chunk, grad_keys, grad_values = _FLASH_BACKWARD(
                grad_out_chunk,
                q_chunk,
                keys,
                values,
                out_chunk,
                row_lse,
                0.0,
                False,
                attn_mask=bias,
                scale=plan.scale,
            )
            if glob is not None:
                _global_backward(
                    q_chunk,
                    grad_out_chunk,
                    out_chunk,
                    row_lse,
                    g_bias_all[row, start:stop],
                    glob,
                    row,
                    plan.scale,
                    grad_q_chunk,
                    grad_glob,
                )
            _scatter_queries(grad_q, grad_q_chunk, row, start, stop, c, group)
            _add_band_grad(grad_k[row], grad_keys, plan, start, workspace, "grad_k")
            _add_band_grad(grad_v[row], grad_values, plan, start, workspace, "grad_v")
        if glob is not None:
            index = plan.global_index  # [b, g]; padding slots hold position 0 and got zero gradients
            for grad, grad_g in zip((grad_k, grad_v), grad_glob):
                grad.scatter_add_(2, index[:, None, :, None].expand_as(grad_g), grad_g)
        if ctx.rows is not None:
            _global_query_backward(q, k, v, out, grad_out, grad_q, grad_k, grad_v, plan, (*ctx.rows, *saved_mask))
        grad_q = grad_q[:, :n_q].transpose(1, 2)
        return grad_q.to(q.dtype), grad_k.to(k.dtype), grad_v.to(v.dtype), None


def _global_query_rows(plan: _BandPlan, n_q: int, n_k: int) -> tuple[Tensor, Tensor, Tensor] | None:
    """The global tokens that are queries here and what they see: `(batch_index, slot, mask)`, the first two long
    `[k]` (batch row and query index of each of the k global queries), mask bool `[k, h|1, n_k]` from the predicate.
    None when no global token is a query (e.g. all before q_offset, or only padding slots)."""
    index, valid = plan.global_index, plan.global_valid  # [b, g]
    b, g = index.shape
    query_valid = valid & (index >= plan.q_offset)  # a global token before q_offset is a key only
    batch_index, position = query_valid.nonzero(as_tuple=True)  # [k]: eager only (the fused path's condition)
    if batch_index.numel() == 0:
        return None
    position = index[batch_index, position]  # [k]
    mask = evaluate_block_mask(
        plan.mask_fn,
        batch=b,
        heads=plan.heads,
        q_pos=position.view(1, 1, -1),
        kv_pos=torch.arange(n_k, device=index.device).view(1, 1, n_k),
    )  # [b|1, h|1, 1, k, n_k]: every batch row asked; each query keeps its own row's
    mask = mask[:, :, 0].transpose(1, 2)  # [b|1, k, h|1, n_k]
    mask = mask[batch_index if mask.shape[0] > 1 else 0, torch.arange(batch_index.numel(), device=index.device)]
    return batch_index, position - plan.q_offset, mask  # mask [k, h|1, n_k]


def _head_products(a: Tensor, b: Tensor) -> Tensor:
    """`[H, r, k] @ [H, k, c]` -> `[H, r, c]`, one matrix product per head: `bmm` copies an operand whose heads are
    not whole matrices in memory (k and v in the `[b, n, h, d]` memory of projections, a full-size copy per call),
    while each head alone is a strided matrix the product reads in place."""
    return torch.stack([torch.mm(x, y) for x, y in zip(a, b, strict=True)])


def _global_query_scores(q, k, plan, rows, dtype, row: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Queries `[h_kv, group·k_r, d]` of batch row `row`'s k_r global tokens, its keys `[h_kv, n_k, d]` in the compute
    dtype, their masked probabilities over every key `[h_kv, group·k_r, n_k]` (zero rows where nothing is visible)
    and which of `rows`' entries they are, long `[k_r]`."""
    batch_index, slot, mask = rows
    h, d = q.shape[1], q.shape[3]
    h_kv, n_k = k.shape[1], k.shape[2]
    group = h // h_kv
    mine = (batch_index == row).nonzero().view(-1)  # [k_r]
    # Indexing, not `index_select`, which first copies a strided q (a projection's view) whole.
    q_rows = q[row][:, slot[mine]].to(dtype)  # [h, k_r, d]
    q_rows = q_rows.view(h_kv, group * mine.numel(), d)
    keys = k[row].to(dtype)
    scores = _head_products(q_rows, keys.transpose(1, 2)).mul_(plan.scale)  # [h_kv, group·k_r, n_k]
    visible = mask.index_select(0, mine).transpose(0, 1)  # [h|1, k_r, n_k]
    visible = visible.unflatten(0, (h_kv, group)) if visible.shape[0] > 1 else visible.unsqueeze(0)
    scores = hide_logits(scores.view(h_kv, group, mine.numel(), n_k), ~visible, inplace=True)
    probs = torch.softmax(scores, dim=-1).mul_(visible.any(dim=-1, keepdim=True))  # a row seeing nothing: zeros
    return q_rows, keys, probs.view(h_kv, group * mine.numel(), n_k), mine


def _global_query_forward(q, k, v, out, plan, rows, dtype) -> None:
    """Write the global queries' dense rows (every key the predicate shows them) into `out` `[b, slots, h, d_v]`,
    over the band's result. Plain products per batch row and head: with a handful of query rows the fused kernel's
    full-size zero-filled key gradients and an out-of-place row write cost more than the work."""
    batch_index, slot, _ = rows
    h = q.shape[1]
    for row in batch_index.unique().tolist():
        _, _, probs, mine = _global_query_scores(q, k, plan, rows, dtype, row)
        o = _head_products(probs, v[row].to(dtype))  # [h_kv, group·k_r, d_v]
        out[row, slot[mine]] = o.view(h, mine.numel(), -1).transpose(0, 1)


def _global_query_backward(q, k, v, out, grad_out, grad_q, grad_k, grad_v, plan, rows) -> None:
    """Gradients of the global queries' dense rows: their query gradients written over the band's (which got a
    zero output gradient there), their key and value gradients `dSᵀ Q · scale`, `Pᵀ dO` added in place to grad_k,
    grad_v (one product per head into the gradient's own memory, no full-size temporary)."""
    batch_index, slot, _ = rows
    h, h_kv = q.shape[1], k.shape[1]
    dtype = grad_q.dtype
    for row in batch_index.unique().tolist():
        q_rows, keys, probs, mine = _global_query_scores(q, k, plan, rows, dtype, row)
        index = slot[mine]
        values = v[row].to(dtype)
        # [h_kv, group·k_r, d_v]
        grad_rows, out_rows = (
            t[:, index].to(dtype).view(h_kv, -1, t.shape[2]) for t in (grad_out[row], out[row].transpose(0, 1))
        )
        grad_scores = _head_products(grad_rows, values.transpose(1, 2))  # dP [h_kv, group·k_r, n_k]
        grad_scores.sub_((grad_rows * out_rows).sum(dim=-1, keepdim=True)).mul_(probs)  # dS
        grad_q_rows = _head_products(grad_scores, keys).mul_(plan.scale)
        grad_q[row, index] = grad_q_rows.view(h, mine.numel(), -1).transpose(0, 1)
        for head in range(h_kv):
            grad_k[row, head].addmm_(grad_scores[head].T, q_rows[head], alpha=plan.scale)
            grad_v[row, head].addmm_(probs[head].T, grad_rows[head])


class _BandStep(NamedTuple):
    """One step of `_BandAttention`'s passes: blocks start:stop of batch row `row`."""

    start: int
    stop: int
    row: int
    plain: bool  # every block of the step is plain: the shared band mask, queries read as a view
    q: Tensor  # [n_blk·h_kv, group·c, d]
    keys: Tensor  # [n_blk·h_kv, m, d]
    values: Tensor  # [n_blk·h_kv, m, d_v]
    bias: Tensor  # additive mask of the band keys
    sees: Tensor | None  # bool [n_blk, h_kv|1, group·c]: rows that see a band key (None: plain, all of them)


def _band_steps(q: Tensor, k: Tensor, v: Tensor, plan: _BandPlan, workspace: _Workspace, dtype: torch.dtype):
    """The steps both passes of `_BandAttention` take, in the same order: each chunk of query blocks (`_band_chunks`),
    then each batch row of it, with the row's queries, band keys and values, and the additive band mask."""
    b, h, _, d = q.shape
    h_kv = k.shape[1]
    group = h // h_kv
    nb, c = plan.layout.q_pos.shape
    per_block = h_kv * plan.layout.kv_pos.shape[1] * d
    for start, stop in _band_chunks(nb, per_block, plan.plain, q.numel() // b):
        masks = _ChunkMasks(plan, b, start, stop)
        for row in range(b):
            plain = plan.is_plain(row, start, stop)
            q_chunk = _chunk_queries(q, row, start, stop, c, group, workspace, "q", view=plain)
            keys, values = (
                _band_keys(t, row, plan, start, stop - start, dtype, workspace, name)
                for t, name in ((k, "k"), (v, "v"))
            )
            if plain:
                bias, sees = plan.band_bias(group, dtype), None
            else:
                bias, sees = _additive(masks.local(), row, h_kv, group, workspace, "bias")
            yield _BandStep(start, stop, row, plain, q_chunk, keys, values, bias, sees)


def _band_chunks(nb: int, per_block: int, plain: list[list[bool]] | None, query_elements: int = 0):
    """`(start, stop)` of each chunk of blocks: at most `_BAND_CHUNK_ELEMENTS` key-gradient elements, and no more than
    an eighth of `query_elements` (one batch row of q: the size of the output and of q's gradient, which exist anyway)
    unless that leaves fewer than 2 blocks; blocks that are plain in every batch row never share a chunk with others (a
    chunk takes the shared mask only if all its blocks are plain)."""
    budget = min(_BAND_CHUNK_ELEMENTS, max(2 * per_block, query_elements // 8))
    step = max(1, min(nb, budget // max(1, per_block)))
    every_row = [False] * nb if plain is None else [all(column) for column in zip(*plain)]
    start = 0
    while start < nb:
        stop = start + 1
        while stop < nb and stop - start < step and every_row[stop] == every_row[start]:
            stop += 1
        yield start, stop
        start = stop


def _global_scores(q_chunk: Tensor, g_keys: Tensor, g_bias: Tensor, scale: float) -> Tensor:
    """Masked scores of a chunk's queries `[n_blk, h_kv, rows, d]` against its row's g global keys `[h_kv, g, d]`:
    `[n_blk, h_kv, rows, g]`. Plain products, not the fused kernel: with a handful of keys its per-tile steps cost
    more than the work (measured: forward + backward of one global key, 4K tokens, 12 heads, was about a third of
    the band's time through the kernel)."""
    return torch.matmul(q_chunk, g_keys.transpose(1, 2)).mul_(scale).add_(g_bias)


def _global_backward(q_chunk, grad_out_chunk, out_chunk, row_lse, g_bias, glob, row, scale, grad_q_chunk, grad_glob):
    """Gradient of a chunk's global-key part under the MERGED softmax (out, lse of band and global keys together):
    P = exp(S − lse), dS = P ∘ (dO Vᵀ − rowsum(dO ∘ O)); adds dS K · scale into grad_q_chunk and Σ_blocks dSᵀ Q · scale,
    Pᵀ dO into the row's global key / value gradients `grad_glob` (each `[b, h_kv, g, d]`)."""
    g_keys, g_values = glob[0][row], glob[1][row]  # [h_kv, g, d]
    probs = _global_scores(q_chunk, g_keys, g_bias, scale).sub_(row_lse.unsqueeze(-1)).exp_()  # [n_blk, h_kv, rows, g]
    grad_scores = torch.matmul(grad_out_chunk, g_values.transpose(1, 2))  # dP
    grad_scores.sub_((grad_out_chunk * out_chunk).sum(dim=-1, keepdim=True)).mul_(probs)  # dS
    grad_q_chunk.add_(torch.matmul(grad_scores, g_keys), alpha=scale)
    grad_glob[0][row] += torch.matmul(grad_scores.transpose(2, 3), q_chunk).sum(0).mul_(scale)
    grad_glob[1][row] += torch.matmul(probs.transpose(2, 3), grad_out_chunk).sum(0)


def _global_additive(plan: _BandPlan, b: int, h_kv: int, group: int, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """The additive mask of every block against its row's global keys, `[b, nb, h_kv|1, group·c, g]`, evaluated
    from the predicate once per pass (per chunk, in forward and again in backward, the predicate's dozens of small
    operations cost more than the products they mask), and which rows see a global key, bool
    `[b, nb, h_kv|1, group·c]`."""
    mask = plan.global_bias(b, 0, plan.layout.q_pos.shape[0])  # [b, h|1, nb, c, g]
    mask = mask.expand(b, *mask.shape[1:]).transpose(1, 2)  # [b, nb, h|1, c, g]
    n_blk, heads, c, g = mask.shape[1:]
    if heads > 1:
        mask = mask.unflatten(2, (h_kv, group))  # [b, nb, h_kv, group, c, g]
    else:
        mask = mask.unsqueeze(2).expand(b, n_blk, 1, group, c, g)
    visible, hidden = (torch.tensor(value, dtype=dtype, device=mask.device) for value in (0.0, HIDDEN_LOGIT))
    return torch.where(mask, visible, hidden).flatten(3, 4), mask.any(dim=-1).flatten(3, 4)


def _global_rows(t: Tensor, plan: _BandPlan, dtype: torch.dtype) -> Tensor:
    """The global keys (or values) of each batch row, `[b, h_kv, g, d]`."""
    index = plan.global_index[:, None, :, None].expand(-1, t.shape[1], -1, t.shape[3])
    return t.gather(2, index).to(dtype)


def _chunk_span(plan: _BandPlan, start: int, n_blk: int) -> tuple[int, int]:
    """Positions `lo … hi − 1` of the keys that blocks start … start + n_blk − 1 read: block i reads the m contiguous
    positions from `first_key + i·c` (some may lie outside the sequence on the first and last blocks)."""
    c, m = plan.layout.q_pos.shape[1], plan.layout.kv_pos.shape[1]
    lo = plan.first_key + start * c
    return lo, lo + (n_blk - 1) * c + m


def _block_rows(t: Tensor, first: int, n_blk: int, c: int, width: int) -> Tensor:
    """`t` `[h_kv, rows, d]` (any strides) -> `[n_blk, h_kv, width, d]`, block i holding rows `first + i·c …
    first + i·c + width − 1`: an overlapping strided view, no copy."""
    h_kv, _, d = t.shape
    s_h, s_row, s_d = t.stride()
    return t.as_strided((n_blk, h_kv, width, d), (c * s_row, s_h, s_row, s_d), t.storage_offset() + first * s_row)


def _band_keys(
    t: Tensor, row: int, plan: _BandPlan, start: int, n_blk: int, dtype: torch.dtype, workspace: _Workspace, name: str
) -> Tensor:
    """The m band keys (or values) of blocks start … start + n_blk − 1 of batch row `row`, `[n_blk, h_kv, m, d]`.

    Where all of them lie inside the sequence (every chunk but the first and last ones) they are a strided view of
    `t` `[b, h_kv, n_k, d]` itself; otherwise (or when `t` is not in the compute dtype) the chunk's span is copied into
    a workspace with zeros outside the sequence (those keys are hidden by the mask; zeros keep the scores finite).
    No O(n · d) copy is ever made."""
    c, m = plan.layout.q_pos.shape[1], plan.layout.kv_pos.shape[1]
    lo, hi = _chunk_span(plan, start, n_blk)
    n_k = t.shape[2]
    if lo >= 0 and hi <= n_k and t.dtype == dtype:
        return _block_rows(t[row], lo, n_blk, c, m)
    piece = workspace.get(name, (t.shape[1], hi - lo, t.shape[3]))
    inside_lo, inside_hi = max(lo, 0), min(hi, n_k)
    if inside_lo > lo or inside_hi < hi:
        piece.zero_()
    if inside_hi > inside_lo:
        piece[:, inside_lo - lo : inside_hi - lo].copy_(t[row, :, inside_lo:inside_hi])
    return _block_rows(piece, 0, n_blk, c, m)


def _chunk_queries(t, row, start, stop, c, group, workspace, name, slots_first=False, view=False) -> Tensor:
    """Queries (or output gradients, or saved outputs) of blocks start:stop of one batch row, in the fused
    kernel's layout `[n_blk, h_kv, group·c, d]`.

    t is `[b, h, n, d]`, or `[b, slots, h, d]` with `slots_first`. With `view` (the blocks' rows all lie inside t), one
    head per key/value head, t in the workspace dtype and a unit stride on d, a strided view of t itself, no copy;
    otherwise a copy into a workspace (zero rows past the last query), in `[n_blk, group·c, h_kv, d]` memory: the
    kernel's backward reads its output gradient in that order, so it does not copy it again."""
    if slots_first:
        t = t.transpose(1, 2)
    h, n, d = t.shape[1], t.shape[2], t.shape[3]
    n_blk = stop - start
    if view and group == 1 and t.dtype == workspace.dtype and t.stride(3) == 1 and stop * c <= n:
        return _block_rows(t[row], start * c, n_blk, c, c)  # [h, n, d] -> [n_blk, h, c, d]
    chunk = workspace.get(name, (n_blk, group, c, h // group, d))
    lo, hi = start * c, min(n, stop * c)
    if hi - lo < n_blk * c:
        chunk.zero_()
    source = t[row, :, lo:hi].unflatten(0, (h // group, group))  # [h_kv, group, rows, d]
    target = chunk.permute(3, 1, 0, 2, 4)  # [h_kv, group, n_blk, c, d]
    full, rest = divmod(hi - lo, c)
    if full:
        target[:, :, :full].copy_(source[:, :, : full * c].unflatten(2, (full, c)))
    if rest:
        target[:, :, full, :rest].copy_(source[:, :, full * c :])
    return chunk.permute(0, 3, 1, 2, 4).flatten(2, 3)  # [n_blk, h_kv, group·c, d]


def _scatter_queries(target: Tensor, chunk: Tensor, row: int, start: int, stop: int, c: int, group: int) -> None:
    """Write a chunk `[n_blk, h_kv, group·c, d]` into `target` `[b, slots, h, d]` at blocks start:stop of `row`."""
    n_blk, h_kv, _, d = chunk.shape
    source = chunk.view(n_blk, h_kv, group, c, d).permute(0, 3, 1, 2, 4)  # [n_blk, c, h_kv, group, d]
    target[row, start * c : stop * c].view(n_blk, c, h_kv, group, d).copy_(source)


def _add_band_grad(
    grad: Tensor, grad_blocks: Tensor, plan: _BandPlan, start: int, workspace: _Workspace, name: str
) -> None:
    """Add band key gradients `[n_blk, h_kv, m, d]` of blocks start … to the rows of `grad` `[h_kv, n_k, d]` (one
    batch row) they were read from, pieces of c keys at a time so that within one addition no two blocks touch the
    same row. Straight into `grad` where the chunk's keys lie inside the sequence, else through a workspace piece
    whose rows inside the sequence are then added."""
    n_blk, _, m, _ = grad_blocks.shape
    c = plan.layout.q_pos.shape[1]
    lo, hi = _chunk_span(plan, start, n_blk)
    n_k = grad.shape[1]
    inside = lo >= 0 and hi <= n_k
    target, first = (grad, lo) if inside else (workspace.get(name, (grad.shape[0], hi - lo, grad.shape[2])).zero_(), 0)
    for offset in range(0, m, c):
        width = min(c, m - offset)
        _block_rows(target, first + offset, n_blk, c, width).add_(grad_blocks[:, :, offset : offset + width])
    if not inside:
        inside_lo, inside_hi = max(lo, 0), min(hi, n_k)
        if inside_hi > inside_lo:
            grad[:, inside_lo:inside_hi].add_(target[:, inside_lo - lo : inside_hi - lo])
