"""Blocked attention on plain PyTorch: the entry points, and `banded_attention`, which runs each head group of a band
on the engine that fits it.

Shape legend: b batch, h heads, h_kv key/value heads (grouped-query attention: h_kv divides h, query head i reads
key/value head i // (h / h_kv)), n length (n_q queries, n_k keys), nb query blocks, c queries per block, m keys
gathered per block, g global tokens (the most any batch row has), d head dim (d_v for values).

Three engines, each with a hand-written backward that recomputes the probabilities chunk by chunk in reused
workspaces (`executor_chunks`), so that nothing n x keys is kept for backward; each is usable on its own:

1. `attend_blocks(q_blocks, k, v, kv_index=..., mask=...) -> (out, lse)` (`executor_gathered`): the generic kernel.
   Block i of queries attends to the keys `kv_index[i]` (or to every key; optionally first to its own block of
   keys, read in place), restricted by a bool mask. Sinkhorn's blocks, dilated bands, global queries and other
   "attend within a gathered key set" kinds reuse it. `merge_attention([(out, lse), ...])` combines partial
   attentions over disjoint key sets exactly (log-sum-exp).
2. `attend_block_sets(q, k, v, [BlockSet, ...])` (`executor_block_sets`): a pattern whose parts need different block
   layouts (Sparse Transformer's strided and fixed), one softmax over all the parts in one autograd function.
3. `_BandAttention` (`executor_band`, with `band_layout` and `global_token_index`): a plain band plus global tokens
   through torch's fused CPU attention kernel, keys read as strided views of k and v.

`banded_attention(q, k, v, mask_fn=..., window_left=..., ...)`, here: sliding window, dilated sliding window
(per-head dilation) and Longformer global tokens (Beltagy et al. 2020), for any pattern predicate whose local part
lies inside the band. A plain band without dropout on CPU runs `_BandAttention`; dilated bands, dropout, a logit
bias, other devices and compilers run `band_block_attention`, i.e. `attend_blocks` with every block gathering its
band keys and its row's global keys. Global queries see every key (`_global_queries`, unless `_BandAttention`
computed them).

The block masks are never written by hand: they come from evaluating the pattern's `MaskFn` (see
`longattn.patterns`) on the ORIGINAL positions of each block's queries and gathered keys
(`executor_chunks.evaluate_block_mask`), so the dense reference (`materialize_mask`) and the engines share one
definition.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from .executor_band import BandLayout, _BandAttention, _BandPlan, _plain_blocks, band_layout, global_token_index
from .executor_block_sets import BlockSet, attend_block_sets
from .executor_chunks import block_mask, evaluate_block_mask
from .executor_gathered import attend_blocks
from .numerics import HIDDEN_LOGIT, SAFE_LOGIT_BOUND, compute_dtype, head_groups, logit_bound, merge_attention
from .patterns import MaskFn, and_masks
from .relative_logits import BiasFn, block_bias

__all__ = [
    "attend_blocks",
    "attend_block_sets",
    "BlockSet",
    "merge_attention",
    "evaluate_block_mask",
    "block_mask",
    "BandLayout",
    "band_layout",
    "banded_attention",
    "band_block_attention",
    "global_token_index",
]


def _not_global_key(is_global: Tensor) -> MaskFn:
    # Global keys are attended through their own gathered set; their copies inside the band are hidden so that
    # every key is counted once in the softmax.
    def not_global_key(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return ~is_global[b, kv_idx]

    return not_global_key


def banded_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    mask_fn: MaskFn,
    window_left: int,
    window_right: int,
    dilation: int | Sequence[int] = 1,
    global_mask: Tensor | None = None,
    scale: float,
    dropout_p: float = 0.0,
    block_size: int | None = None,
    bias_fn: BiasFn | None = None,
    exact_band: bool = False,
    key_padding_mask: Tensor | None = None,
) -> Tensor:
    """Attention whose pattern is a (dilated) band plus optional Longformer global tokens, in O(n · w).

    Each group of heads sharing a dilation runs on the engine that fits it (see the module docstring), over a
    `band_layout`, with block masks from `mask_fn` on original positions and the band copies of global keys hidden;
    global queries get a dense row over all keys, O(g · n), written over the local result. `mask_fn` decides
    visibility everywhere; the geometry arguments only say where visible keys can be, so they must cover `mask_fn`'s
    local part.

    Args:
        q: Queries `[b, h, n_q, d]`, the last n_q positions when `n_q < n_k`.
        k, v: Keys `[b, h_kv, n_k, d]` and values `[b, h_kv, n_k, d_v]`, h_kv dividing h (grouped-query attention,
            read without repeating them).
        mask_fn: The pattern predicate (e.g. `patterns.sliding_window_pattern(...)`).
        window_left, window_right: Dilated steps of the band before / after each query (>= 0).
        dilation: Step between band keys; a sequence gives one per head.
        global_mask: Optional bool `[b, n_k]`, True = global token (must match the one inside `mask_fn`).
        scale: Multiplier of q·k.
        dropout_p: Dropout on the attention probabilities.
        block_size: Queries per block; smaller blocks gather fewer unused keys (c + 2w keys serve c queries),
            larger ones give larger matrix products and fewer steps. None: `_GATHERED_BLOCK_SIZE` for
            `attend_blocks`, `_fused_block_size` for the fused path.
        bias_fn: Optional logit bias of each kept pair (relative-position logits, `relative_logits`), evaluated on
            the same positions as `mask_fn` and added to the scores (`attend_blocks`' `bias`; the fused path takes
            none, so a bias runs `attend_blocks`).
        exact_band: Whether `mask_fn` is exactly Longformer's pattern on the heads of dilation 1 (as
            `patterns.sliding_window_pattern` builds it): a query that is not global sees the keys from
            `window_left` before to `window_right` after it, the global keys and no padding key
            (`key_padding_mask`), nothing else. The fused path then masks the blocks whose keys hold no padding,
            global or out-of-range key with one band mask built once, instead of evaluating `mask_fn` for every
            block in forward and again in backward. False: `mask_fn` is evaluated for every block.
        key_padding_mask: With `exact_band`, the bool `[b, n_k]` real keys (True) that `mask_fn` tests; None: no
            padding.

    Returns:
        Output `[b, h, n_q, d_v]`; queries that see no key get zeros.
    """
    b, h, n_q, _ = q.shape
    if n_q == 0:
        return q.new_empty(b, h, n_q, v.shape[3])
    call = _BandCall(
        mask_fn=mask_fn,
        window_left=window_left,
        window_right=window_right,
        global_mask=global_mask,
        scale=scale,
        dropout_p=dropout_p,
        block_size=block_size,
        bias_fn=bias_fn,
        exact_band=exact_band,
        key_padding_mask=key_padding_mask,
    )
    # The fused paths add HIDDEN_LOGIT as a float bias: exact only for bounded logits (`numerics.hide_logits`).
    bounded = (
        bias_fn is None and _fused_band_applies(q, v, 1, dropout_p) and logit_bound(q, k, scale) <= SAFE_LOGIT_BOUND
    )
    return _band_groups(q, k, v, head_groups(dilation, h), call, bounded)


# Queries per block of `attend_blocks` for a band: fastest for w = 256 on a 2-core CPU, 16K tokens, forward +
# backward: 64 -> 0.59 s, 96 -> 0.63 s, 128 -> 0.50 s.
_GATHERED_BLOCK_SIZE = 128


@dataclass
class _BandCall:
    """The arguments of one `banded_attention` call that every head group shares (explained there), and its global
    tokens."""

    mask_fn: MaskFn
    window_left: int
    window_right: int
    global_mask: Tensor | None
    scale: float
    dropout_p: float
    block_size: int | None
    bias_fn: BiasFn | None
    exact_band: bool
    key_padding_mask: Tensor | None
    global_index: Tensor | None = field(init=False)  # [b, g] (`global_token_index`); None: no global token
    global_valid: Tensor | None = field(init=False)  # [b, g]
    local_fn: MaskFn = field(init=False)  # mask_fn with the band copies of global keys hidden

    def __post_init__(self):
        self.global_index = self.global_valid = None
        if self.global_mask is not None:
            self.global_index, self.global_valid = global_token_index(self.global_mask)  # [b, g]
            if self.global_index.shape[1] == 0:
                self.global_index = None
        hide_global = None if self.global_index is None else _not_global_key(self.global_mask)
        self.local_fn = self.mask_fn if hide_global is None else and_masks(self.mask_fn, hide_global)


def _band_groups(q: Tensor, k: Tensor, v: Tensor, groups, call: _BandCall, bounded: bool) -> Tensor:
    """`banded_attention` by head groups (`numerics.head_groups`: `(dilation, heads)` pairs), each through
    `_band_group`, the heads put back in order; then the global queries' dense rows, unless `_BandAttention` wrote
    them (one group on the fused path). bounded: whether the fused paths may run."""
    h = q.shape[1]
    if len(groups) > 1 and k.shape[1] != h:  # per-head dilations split the heads across key/value groups
        k, v = (t.repeat_interleave(h // t.shape[1], dim=1) for t in (k, v))
    outputs = [_band_group(q, k, v, dilation, heads, call, bounded, len(groups) == 1) for dilation, heads in groups]
    if len(groups) == 1:
        out, fused = outputs[0]
    else:
        order = torch.tensor([head for _, heads in groups for head in heads], device=q.device).argsort()
        out, fused = torch.cat([out_g for out_g, _ in outputs], dim=1).index_select(1, order), False
    if call.global_index is None or fused:  # no global token, or `_BandAttention` wrote their rows
        return out
    q_offset = k.shape[2] - q.shape[2]
    global_tokens = (call.global_index, call.global_valid, q_offset)
    return _global_queries(
        q, k, v, out, call.mask_fn, *global_tokens, call.scale, call.dropout_p, call.bias_fn, bounded=bounded
    )


def _band_group(q, k, v, dilation: int, heads: list[int], call: _BandCall, bounded: bool, one_group: bool):
    """One head group of `banded_attention`, the heads sharing a dilation: `(out [b, hg, n_q, d_v], fused)`, through
    `_BandAttention` where `_fused_band_applies` (fused True), else `band_block_attention`. one_group: every head is
    in this group (a fused group then computes the global queries too)."""
    b, n_q, n_k = q.shape[0], q.shape[2], k.shape[2]
    q_offset = n_k - n_q
    heads_t = torch.tensor(heads, device=q.device)
    if len(heads) != q.shape[1]:
        q, k, v = (t.index_select(1, heads_t) for t in (q, k, v))
    fused = bounded and _fused_band_applies(q, v, dilation, call.dropout_p)
    c = call.block_size or (_fused_block_size(len(heads) // k.shape[1]) if fused else _GATHERED_BLOCK_SIZE)
    # Beyond the length of a residue class the band holds no key; clipping keeps "window >= length" cheap.
    class_len = -(-n_k // dilation)
    window_left, window_right = min(call.window_left, class_len), min(call.window_right, class_len)
    layout = band_layout(
        q_len=n_q, kv_len=n_k, window_left=window_left, window_right=window_right, dilation=dilation, block_size=c,
        q_offset=q_offset, device=q.device,
    )  # fmt: skip
    global_index, global_valid = call.global_index, call.global_valid
    if fused:
        first_key = q_offset - window_left
        plain = None
        if call.exact_band:
            global_mask = call.global_mask if global_index is not None else None
            plain = _plain_blocks(layout, first_key, n_k, b, global_mask, call.key_padding_mask)
        plan = _BandPlan(
            layout=layout,
            local_fn=call.local_fn,
            mask_fn=call.mask_fn,
            heads=heads_t,
            global_index=global_index,
            global_valid=global_valid,
            scale=float(call.scale),
            first_key=first_key,
            plain=plain,
            global_queries=global_index is not None and one_group,
            q_offset=q_offset,
        )
        return _BandAttention.apply(q, k, v, plan), True
    out = band_block_attention(
        q,
        k,
        v,
        layout=layout,
        heads=heads_t,
        local_fn=call.local_fn,
        mask_fn=call.mask_fn,
        q_offset=q_offset,
        global_keys=None if global_index is None else (global_index, global_index, global_valid),
        scale=call.scale,
        dropout_p=call.dropout_p,
        bias_fn=call.bias_fn,
    )
    return out, False


def band_block_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    layout: BandLayout,
    heads: Tensor,
    local_fn: MaskFn,
    mask_fn: MaskFn,
    q_offset: int,
    global_keys: tuple[Tensor, Tensor, Tensor] | None = None,
    position_offset: int = 0,
    scale: float,
    dropout_p: float = 0.0,
    bias_fn: BiasFn | None = None,
) -> Tensor:
    """One head group of a banded attention through `attend_blocks`: every query block gathers its band keys and its
    batch row's global keys, one softmax over both.

    Positions in `layout` count from the first key of `k`; the predicates read them shifted by `position_offset`
    (a context-parallel shard, whose keys start at that position of the whole sequence).

    Args:
        q: Queries `[b, hg, n_q, d]`, the layout's query positions `q_offset … q_offset + n_q − 1`.
        k: Keys `[b, h_kv, n_k, d]` (h_kv dividing hg); v: values `[b, h_kv, n_k, d_v]`.
        layout: The band's `band_layout` (with `q_offset`).
        heads: Long `[hg]`, the original index of each head (the predicates may depend on it).
        local_fn: The predicate of band keys (the band copies of global keys hidden).
        mask_fn: The predicate of global keys.
        q_offset: Index in `k` of the first query.
        global_keys: `(index, position, valid)`, each `[b, g]`: where each global key of a row sits in k, its
            position, and False for padding slots; None = no global token.
        position_offset: Position of `k`'s first key in the sequence the predicates describe.
        scale, dropout_p: As in `attend_blocks`.
        bias_fn: Optional logit bias of each pair (relative-position logits), on the positions the predicates read.

    Returns:
        Output `[b, hg, n_q, d_v]`.
    """
    b, hg, n_q, d = q.shape
    nb, c = layout.q_pos.shape
    if layout.slot_of_query is None:
        q_blocks = q.reshape(b, hg, nb, c, d)
    else:
        q_blocks = q.index_select(2, (layout.q_pos - q_offset).reshape(-1)).view(b, hg, nb, c, d)
    q_pos = layout.q_pos[None] + position_offset  # [1, nb, c]
    kv_pos = layout.kv_pos[None] + position_offset  # [1, nb, m]
    mask = evaluate_block_mask(
        local_fn,
        batch=b,
        heads=heads,
        q_pos=q_pos,
        kv_pos=kv_pos,
        q_valid=layout.q_valid[None],
        kv_valid=layout.kv_valid[None],
    )
    bias = None if bias_fn is None else block_bias(bias_fn, batch=b, heads=heads, q_pos=q_pos, kv_pos=kv_pos)
    kv_index = layout.kv_pos  # [nb, m]
    if global_keys is not None:
        kv_index, mask, bias = _with_global_keys(
            kv_index, mask, bias, global_keys, mask_fn, bias_fn, heads=heads, q_pos=q_pos, q_valid=layout.q_valid[None]
        )
    out_blocks, _ = attend_blocks(
        q_blocks, k, v, kv_index=kv_index, mask=mask, scale=scale, dropout_p=dropout_p, bias=bias
    )  # [b, hg, nb, c, d_v]
    out = out_blocks.reshape(b, hg, nb * c, -1)  # [b, hg, slots, d_v]
    return out[:, :, :n_q] if layout.slot_of_query is None else out.index_select(2, layout.slot_of_query)


def _with_global_keys(kv_index, mask, bias, global_keys, mask_fn, bias_fn, *, heads, q_pos, q_valid):
    """Every block also gathers its row's g global keys: one softmax over [band keys, global keys], no second pass to
    merge. From the band's kv_index `[nb, m]`, mask `[b, 1|hg, nb, c, m]` and bias `[b, hg, nb, c, m]` (or None), the
    same with the global keys appended: `[b, nb, m + g]`, `[b, 1|hg, nb, c, m + g]`, `[b, hg, nb, c, m + g]`."""
    global_index, global_pos, global_valid = global_keys
    (b, g), nb = global_index.shape, kv_index.shape[0]
    kv_index = torch.cat([kv_index.expand(b, nb, -1), global_index[:, None, :].expand(b, nb, g)], dim=2)
    global_key_mask = evaluate_block_mask(
        mask_fn,
        batch=b,
        heads=heads,
        q_pos=q_pos,
        kv_pos=global_pos[:, None, :],
        q_valid=q_valid,
        kv_valid=global_valid[:, None, :],
    )  # [b, 1|hg, nb, c, g]
    heads_dim = max(mask.shape[1], global_key_mask.shape[1])
    mask = torch.cat([mask.expand(b, heads_dim, -1, -1, -1), global_key_mask.expand(b, heads_dim, -1, -1, -1)], dim=4)
    if bias is not None:
        global_bias = block_bias(bias_fn, batch=b, heads=heads, q_pos=q_pos, kv_pos=global_pos[:, None, :])
        bias = torch.cat([bias, global_bias], dim=4)
    return kv_index, mask, bias


def _fused_band_applies(q: Tensor, v: Tensor, dilation: int, dropout_p: float) -> bool:
    """Whether a head group runs `_BandAttention`: eager CPU code (the fused kernel is torch's CPU one; compilers
    trace `attend_blocks`' plain-op form), no dropout (the kernel has none), a plain band (dilation 1), and values as
    wide as the queries (the kernel takes one head size; `attend_blocks` takes any d_v)."""
    return (
        q.device.type == "cpu"
        and dropout_p == 0
        and dilation == 1
        and v.shape[-1] == q.shape[-1]
        and not torch.compiler.is_compiling()
    )


def _fused_block_size(group: int) -> int:
    """Queries per block of the fused path for `group` query heads per key/value head: 64.

    A block reads c + w_left + w_right keys for its c queries, so smaller blocks waste fewer keys; the fused kernel
    tiles a block's group·c stacked query rows by 32 below 192 rows (by 64 from 192 on), so blocks below 32 rows only
    add steps. Measured on one core (process time, forward + backward, against dense SDPA's work times the window's
    share), with the plain blocks' shared mask and chunks of 2**21 elements (2**20 measured the same): 4K tokens, 12
    heads, w = 256 per side, global first token: c = 32 -> 2.17x, 64 -> 1.80x, 128 -> 1.88x; 8K tokens, 16 heads on 4
    key/value heads, causal w = 512: c = 32 -> 1.17x, 64 -> 1.18x, 128 -> 1.35x."""
    return 64


def _global_queries(
    q, k, v, out, mask_fn, global_index, global_valid, q_offset, scale, dropout_p, bias_fn=None, bounded=False
):
    """Global queries see every key: a dense row per global token (O(g · n)), written over the local result.

    Where the fused band path runs (eager CPU code, no dropout, no logit bias) through SDPA, i.e. torch's fused kernel
    with k and v read in place, grouped heads included; elsewhere `attend_blocks`. Both give a row that sees no key
    zeros."""
    b, h, n_q, d = q.shape
    n_k, d_v = k.shape[2], v.shape[3]
    g = global_index.shape[1]
    # A global token before q_offset is a key only (cached decoding): it has no query row here.
    query_valid = global_valid & (global_index >= q_offset)  # [b, g]
    query_row = (global_index - q_offset).clamp(min=0)  # [b, g]
    sdpa = bounded  # SDPA with HIDDEN_LOGIT as its additive mask: bounded logits only
    c = g if sdpa else min(g, 64)
    nb = -(-g // c)
    pad = nb * c - g
    if pad:
        query_row = torch.nn.functional.pad(query_row, (0, pad))
        query_valid = torch.nn.functional.pad(query_valid, (0, pad))
    q_global = q.gather(2, query_row.view(b, 1, nb * c, 1).expand(b, h, nb * c, d)).view(b, h, nb, c, d)
    # Where the global queries and their keys are, for the mask and the relative logits.
    positions = dict(
        batch=b,
        heads=torch.arange(h, device=q.device),
        q_pos=(query_row + q_offset).view(b, nb, c),
        kv_pos=torch.arange(n_k, device=q.device).view(1, 1, n_k),
    )
    mask = evaluate_block_mask(mask_fn, **positions, q_valid=query_valid.view(b, nb, c))  # [b, h|1, nb, c, n_k]
    if sdpa:
        mask = mask[:, :, 0]  # [b, h|1, g, n_k]
        dtype = compute_dtype(q.dtype)
        additive = torch.zeros(mask.shape, dtype=dtype, device=q.device).masked_fill_(~mask, HIDDEN_LOGIT)
        out_global = torch.nn.functional.scaled_dot_product_attention(
            q_global[:, :, 0].to(dtype),
            k.to(dtype),
            v.to(dtype),
            attn_mask=additive,
            scale=scale,
            enable_gqa=k.shape[1] != h,
        )
        out_global = (out_global * mask.any(dim=-1, keepdim=True)).to(q.dtype)  # [b, h, g, d_v]
        # Eager code (the fused path's condition): the valid slots are read back, and their rows written in one
        # out-of-place `index_put` (one copy of out, and one of its gradient in backward).
        batch_index, slot = query_valid.nonzero(as_tuple=True)  # [k]
        rows = (batch_index, query_row[batch_index, slot])
        values = out_global.transpose(1, 2)[batch_index, slot]  # [k, h, d_v]
        return out.transpose(1, 2).index_put(rows, values).transpose(1, 2)
    else:
        bias = None if bias_fn is None else block_bias(bias_fn, **positions)
        out_global, _ = attend_blocks(
            q_global, k, v, kv_index=None, mask=mask, scale=scale, dropout_p=dropout_p, bias=bias
        )
    # Padding slots write to an extra row that is cut off afterwards, so no index is ever written twice.
    target = torch.where(query_valid, query_row, torch.full_like(query_row, n_q))  # [b, g']
    padded = torch.nn.functional.pad(out, (0, 0, 0, 1))  # [b, h, n_q + 1, d_v]
    padded = padded.scatter(2, target.view(b, 1, -1, 1).expand(b, h, nb * c, d_v), out_global.view(b, h, nb * c, d_v))
    return padded[:, :, :n_q]
