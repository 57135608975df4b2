"""Context parallelism for the sliding family (sliding, dilated and global tokens): one sequence, split into
contiguous chunks across the processes of a context-parallel group.

Shape legend: b batch, h heads, h_kv key/value heads, n this rank's tokens, N the whole sequence, m keys of the
shard with its halo, g global tokens (the most any batch row has), d head dim (d_v for values), P ranks in the group.

Rank r of P holds tokens `bounds[r] … bounds[r + 1] − 1` (`chunk_bounds`: torch.tensor_split's sizes) and computes
everything but attention on them alone. A query sees keys at most `window · dilation` away (`reach`), plus the global
tokens, so attention needs, besides the rank's own keys and values:

- the halo: the `reach` keys and values before the chunk (and after it, unless causal). They come from whichever
  ranks hold them, in one autograd-aware all-to-all (`_exchange_halo`): only the halo travels, from the neighbours
  when the halo is shorter than a chunk, from further ranks when it is longer (direct, not hop by hop);
- the global tokens' keys and values, from every rank (an autograd-aware all-reduce of the rows each owns);
- for the global queries, which see the whole sequence: every rank attends them to its own keys, and the partial
  results are combined by their log-sum-exp (`numerics.merge_attention`) after an autograd-aware all-gather.

The pattern predicate (`patterns.sliding_window_pattern`) is evaluated on global positions: the padding and global
masks are gathered whole (`[b, N]` bools, the only O(N) state a rank keeps). Gradients flow back through every
collective, so the backward of each rank's share of the loss leaves on each rank its share of every parameter's
gradient: summed over the group (`reduce_gradients`) they are the single-process gradient.

This module is the attention level, which the sliding kind calls and a Hub folder carries: the group
(`ContextParallel`, `init_context_parallel`), the chunks, and `context_parallel_sliding_attention`. Turning it on for
a model (`enable_context_parallel`, which gives each sliding layer the group and the base model global
`position_ids`), cutting a batch into chunks (`shard_batch`) and summing the gradients (`reduce_gradients`) sit above
the model, in `longattn.train.context_parallel`, with an example of a training step. Their old names here still
resolve for one release, with a DeprecationWarning.

Full attention has no halo: each rank would need every key (ring attention). torch's
`torch.distributed.tensor.experimental.context_parallel` does that for the CUDA SDPA kernels and FlexAttention, not on
CPU, and accelerate's context parallelism builds on it and needs FSDP2; other kinds refuse context parallelism here.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

# Collectives that carry gradients back, on gloo as on NCCL (torch.distributed.nn.functional's are deprecated in
# their favour in torch 2.13).
import torch.distributed._functional_collectives as funcol
from torch import Tensor

from ._moved import moved_names
from .executor_band import band_layout, global_token_index
from .executor_blocked import _not_global_key, band_block_attention
from .executor_chunks import evaluate_block_mask
from .executor_gathered import attend_blocks
from .numerics import head_groups, merge_attention
from .patterns import MaskFn, and_masks, check_dilation, check_window, sliding_window_pattern

__all__ = [
    "CONTEXT_PARALLEL_KINDS",
    "ContextParallel",
    "chunk_bounds",
    "context_parallel_sliding_attention",
    "init_context_parallel",
]

# `enable_context_parallel`, `shard_batch`, ... moved up to `longattn.train.context_parallel`: looked up there on first
# use (with a DeprecationWarning), never at import, so this module imports nothing above the attention.
__getattr__ = moved_names(__name__)

CONTEXT_PARALLEL_KINDS = ("sliding",)
"""Attention kinds that run context-parallel: those whose queries see a bounded band plus global tokens."""


@dataclass(frozen=True)
class ContextParallel:
    """The processes that share one batch, each holding a contiguous chunk of its sequences.

    Attributes:
        group: The context-parallel process group (ranks in the order of their chunks).
        dp_group: The data-parallel group of this rank (the ranks holding the same chunk of other batches), or None
            when every process is in one context-parallel group.
    """

    group: dist.ProcessGroup
    dp_group: dist.ProcessGroup | None = None

    @property
    def size(self) -> int:
        return dist.get_world_size(self.group)

    @property
    def rank(self) -> int:
        return dist.get_rank(self.group)

    @property
    def dp_size(self) -> int:
        return 1 if self.dp_group is None else dist.get_world_size(self.dp_group)

    @property
    def dp_rank(self) -> int:
        return 0 if self.dp_group is None else dist.get_rank(self.dp_group)


def init_context_parallel(size: int, *, device_type: str = "cpu") -> ContextParallel:
    """A `(dp, cp)` device mesh over every launched process, `cp` = `size`: the ranks `i·size … i·size + size − 1`
    share a batch (context parallel), the ranks with the same index in their group share nothing but gradients (data
    parallel). Needs `torch.distributed` initialised (gloo on CPU, NCCL on GPU).

    Raises:
        ValueError: `size` not an int >= 1 or not dividing the number of processes.
    """
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    if isinstance(size, bool) or not isinstance(size, int) or size < 1 or world % size:
        raise ValueError(f"context_parallel={size!r}: expected an int >= 1 dividing the number of processes ({world}).")
    mesh = init_device_mesh(device_type, (world // size, size), mesh_dim_names=("dp", "cp"))
    return ContextParallel(group=mesh.get_group("cp"), dp_group=mesh.get_group("dp"))


def chunk_bounds(length: int, size: int) -> list[int]:
    """Where each of `size` contiguous chunks of `length` tokens starts, and `length` last (`size + 1` numbers):
    the chunks of `torch.tensor_split`, the first `length % size` one token longer."""
    step, extra = divmod(length, size)
    return [r * step + min(r, extra) for r in range(size + 1)]


# ------------------------------------------------------------------------------------------------ the attention
@dataclass(frozen=True)
class _Shard:
    """Where this rank's chunk and its halo sit: `bounds` as `chunk_bounds`, the halo of every rank."""

    bounds: list[int]
    left: list[int]  # halo keys before each rank's chunk
    right: list[int]  # halo keys after it
    rank: int

    @classmethod
    def of(cls, lengths: list[int], *, reach: int, causal: bool, rank: int) -> _Shard:
        """The shard of chunks of `lengths` tokens for keys at most `reach` away (causal: before the query only)."""
        bounds = [0, *itertools.accumulate(lengths)]
        total = bounds[-1]
        return cls(
            bounds=bounds,
            left=[min(reach, bounds[r]) for r in range(len(lengths))],
            right=[0 if causal else min(reach, total - bounds[r + 1]) for r in range(len(lengths))],
            rank=rank,
        )

    @property
    def start(self) -> int:
        return self.bounds[self.rank]

    @property
    def stop(self) -> int:
        return self.bounds[self.rank + 1]

    def needs(self, reader: int, owner: int) -> tuple[int, int]:
        """The positions `[lo, hi)` of `owner`'s chunk in `reader`'s halo (empty: lo >= hi)."""
        if owner < reader:
            lo, hi = self.bounds[reader] - self.left[reader], self.bounds[reader]
        elif owner > reader:
            lo, hi = self.bounds[reader + 1], self.bounds[reader + 1] + self.right[reader]
        else:
            return 0, 0
        return max(lo, self.bounds[owner]), min(hi, self.bounds[owner + 1])


def _gather_masks(
    length: int,
    masks: Sequence[tuple[Tensor | None, bool]],
    cp: ContextParallel,
    batch: int,
    device: torch.device,
) -> tuple[list[int], list[Tensor | None]]:
    """Every rank's chunk length, and each mask of `masks` (`(mask, value where None)`, mask `[b, n]` bool or None)
    gathered whole `[b, N]`; a mask that is None on every rank stays None. Two collectives: the lengths (with which
    masks each rank has), then the masks."""
    info = torch.tensor([[length] + [mask is not None for mask, _ in masks]], device=device)  # [1, 1 + masks]
    parts = [torch.empty_like(info) for _ in range(cp.size)]
    dist.all_gather(parts, info, group=cp.group)
    table = torch.cat(parts).tolist()  # [P, 1 + masks]
    lengths = [row[0] for row in table]
    present = [any(row[1 + i] for row in table) for i in range(len(masks))]
    longest = max(lengths)
    # Padded to the longest chunk, since all_gather moves tensors of one shape; cut back to each rank's length.
    stacked = torch.zeros(len(masks), batch, longest, dtype=torch.bool, device=device)
    for i, (mask, absent_value) in enumerate(masks):
        stacked[i, :, :length] = mask if mask is not None else absent_value
    gathered = [torch.empty_like(stacked) for _ in range(cp.size)]
    if any(present):
        dist.all_gather(gathered, stacked, group=cp.group)
    whole = [
        torch.cat([part[i, :, :n] for part, n in zip(gathered, lengths)], dim=1) if present[i] else None
        for i in range(len(masks))
    ]
    return lengths, whole


def _exchange_halo(x: Tensor, shard: _Shard, cp: ContextParallel) -> Tensor:
    """This rank's rows `x` `[n, ...]` with its halo around them, `[left + n + right, ...]`, in one autograd-aware
    all-to-all: each rank sends every other rank the rows of its chunk that the other's halo covers."""
    me, ranks = shard.rank, range(cp.size)
    sends = [shard.needs(reader, me) for reader in ranks]
    receives = [shard.needs(me, owner) for owner in ranks]
    send_sizes = [max(0, hi - lo) for lo, hi in sends]
    receive_sizes = [max(0, hi - lo) for lo, hi in receives]
    outgoing = torch.cat([x[lo - shard.start : lo - shard.start + size] for (lo, _), size in zip(sends, send_sizes)])
    incoming = funcol.all_to_all_single_autograd(outgoing.contiguous(), receive_sizes, send_sizes, cp.group)
    # Chunks are in rank order, so the rows of lower ranks are the halo before, those of higher ranks the one after.
    before = sum(receive_sizes[:me])
    return torch.cat([incoming[:before], x, incoming[before:]])


def _owned_rows(x: Tensor, index: Tensor, owned: Tensor, start: int) -> Tensor:
    """Rows `index` `[b, g]` (global positions) of this rank's `x` `[b, h, n, d]`, zero where not `owned`:
    `[b, h, g, d]`. Summed over the ranks, each row is taken once, from its owner."""
    b, h, n, d = x.shape
    rows = (index - start).clamp(0, max(n - 1, 0))
    picked = x.gather(2, rows.view(b, 1, -1, 1).expand(b, h, rows.shape[1], d))
    return picked * owned.view(b, 1, -1, 1).to(x.dtype)


def context_parallel_sliding_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    cp: ContextParallel,
    window: int,
    dilation: int | Sequence[int] = 1,
    causal: bool = False,
    global_mask: Tensor | None = None,
    key_padding_mask: Tensor | None = None,
    scale: float,
    dropout_p: float = 0.0,
) -> Tensor:
    """`ops.sliding_window_attention` of this rank's chunk of a sequence split across `cp` (a collective: every rank
    of the group calls it with its own chunk, in the same layer).

    Args:
        q: This rank's queries `[b, h, n, d]`.
        k: Its keys `[b, h_kv, n, d]`, h_kv dividing h; v: its values `[b, h_kv, n, d_v]`.
        cp: The context-parallel group.
        window, dilation, causal: As in `ops.sliding_window_attention`.
        global_mask: Bool `[b, n]` over this rank's tokens, True = global token; None = none.
        key_padding_mask: Bool `[b, n]`, True = real token; None = no padding.
        scale, dropout_p: As in `ops.sliding_window_attention`.

    Returns:
        `[b, h, n, d_v]`: the rows of this rank's queries of the single-process attention.

    Raises:
        ValueError: queries and keys of different lengths (cached decoding has no context-parallel form), or an
            invalid window or dilation.
    """
    b, h, n, _ = q.shape
    if k.shape[2] != n:
        raise ValueError(
            f"context-parallel attention needs one query per key (got {n} queries, {k.shape[2]} keys): cached "
            "decoding and output_attentions run on one process."
        )
    window = check_window(window)
    dilation = check_dilation(dilation, heads=h)
    lengths, (padding, is_global) = _gather_masks(n, [(key_padding_mask, True), (global_mask, False)], cp, b, q.device)
    reach = window * (dilation if isinstance(dilation, int) else max(dilation))
    shard = _Shard.of(lengths, reach=reach, causal=causal, rank=cp.rank)
    mask_fn = sliding_window_pattern(
        window=window, dilation=dilation, causal=causal, global_mask=is_global, key_padding_mask=padding
    )

    # Keys and values with their halo: [b, h_kv, m, d + d_v], sequence first for the exchange.
    d_k = k.shape[3]
    kv = torch.cat([k, v], dim=3)  # [b, h_kv, n, d + d_v]: one exchange for both
    kv_halo = _exchange_halo(kv.permute(2, 0, 1, 3), shard, cp).permute(1, 2, 0, 3)  # [b, h_kv, m, d + d_v]
    left = shard.left[cp.rank]
    m = kv_halo.shape[2]

    local_fn, global_keys = mask_fn, None
    rows = None if is_global is None else _global_rows(q, kv, is_global, shard, cp)
    if rows is not None:
        kv_halo, local_fn, global_keys = _append_global_keys(kv_halo, rows, mask_fn, is_global)

    # What every head group shares: its band over this rank's queries and halo keys, and how its blocks are attended.
    band = dict(q_len=n, kv_len=m, window_left=window, window_right=0 if causal else window, q_offset=left)
    attend = dict(local_fn=local_fn, mask_fn=mask_fn, q_offset=left, global_keys=global_keys, scale=scale)
    out = _attend_head_groups(
        q,
        kv_halo[..., :d_k],
        kv_halo[..., d_k:],
        dilation,
        band=band,
        attend=attend,
        position_offset=shard.start - left,
        dropout_p=dropout_p,
    )
    if rows is not None:
        out = _global_queries(
            rows.q, k, v, out, mask_fn, rows.index, rows.valid, rows.owned, shard, cp, scale, dropout_p
        )
    return out


@dataclass
class _GlobalRows:
    """The global tokens of a batch as every rank of the group holds them (g: the most any batch row has)."""

    index: Tensor  # [b, g], their global positions
    valid: Tensor  # [b, g], False on the slots of rows with fewer global tokens
    owned: Tensor  # [b, g], held by this rank
    kv: Tensor  # [b, h_kv, g, d + d_v], their keys and values
    q: Tensor  # [b, h, g, d], their queries


def _global_rows(q: Tensor, kv: Tensor, is_global: Tensor, shard: _Shard, cp: ContextParallel) -> _GlobalRows | None:
    """The global tokens' queries `q` and keys and values `kv` (this rank's, `[b, h, n, d]` and
    `[b, h_kv, n, d + d_v]`) on every rank, from the gathered global mask `is_global` `[b, N]`; None without any.

    Each rank contributes the global rows it holds; the sum over the group has every global token's keys, values
    and queries (and sends their gradients back to their owners)."""
    global_index, global_valid = global_token_index(is_global)  # [b, g], global positions
    if global_index.shape[1] == 0:
        return None
    owned = global_valid & (global_index >= shard.start) & (global_index < shard.stop)  # [b, g]
    kv_global = funcol.all_reduce(_owned_rows(kv, global_index, owned, shard.start), "sum", cp.group)
    q_global = funcol.all_reduce(_owned_rows(q, global_index, owned, shard.start), "sum", cp.group)  # [b, h, g, d]
    return _GlobalRows(index=global_index, valid=global_valid, owned=owned, kv=kv_global, q=q_global)


def _append_global_keys(
    kv_halo: Tensor, rows: _GlobalRows, mask_fn: MaskFn, is_global: Tensor
) -> tuple[Tensor, MaskFn, tuple[Tensor, Tensor, Tensor]]:
    """The keys and values with their halo `kv_halo` `[b, h_kv, m, d + d_v]` followed by the global ones
    (`[b, h_kv, m + g, d + d_v]`), the band's predicate with the global keys' copies inside the band hidden (so
    every key counts once in the softmax), and `band_block_attention`'s `global_keys` (slots, positions, valid)."""
    b, _, m, _ = kv_halo.shape
    g = rows.index.shape[1]
    kv_halo = torch.cat([kv_halo, rows.kv], dim=2)  # global keys after the band's
    slots = (m + torch.arange(g, device=kv_halo.device)).expand(b, g)
    return kv_halo, and_masks(mask_fn, _not_global_key(is_global)), (slots, rows.index, rows.valid)


def _attend_head_groups(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    dilation: int | Sequence[int],
    *,
    band: dict,
    attend: dict,
    position_offset: int,
    dropout_p: float,
) -> Tensor:
    """`band_block_attention` of this rank's queries `q` `[b, h, n, d]` over the keys and values with their halo
    (and the global ones after them) `k`, `v` `[b, h_kv, m (+ g), d]`, one call per group of heads sharing a
    dilation: `band` is `band_layout`'s band, `attend` what every call shares. Returns `[b, h, n, d_v]`, the heads
    in order."""
    h = q.shape[1]
    groups = head_groups(dilation, h)
    if len(groups) > 1 and k.shape[1] != h:  # per-head dilations split the heads across key/value groups
        k, v = (t.repeat_interleave(h // t.shape[1], dim=1) for t in (k, v))
    outputs, order = [], []
    for d, heads in groups:
        heads_t = torch.tensor(heads, device=q.device)
        q_g, k_g, v_g = (q, k, v) if len(heads) == h else (t.index_select(1, heads_t) for t in (q, k, v))
        layout = band_layout(**band, dilation=d, block_size=128, device=q.device)  # banded_attention's block size
        outputs.append(
            band_block_attention(
                q_g,
                k_g,
                v_g,
                layout=layout,
                heads=heads_t,
                position_offset=position_offset,
                dropout_p=dropout_p,
                **attend,
            )
        )
        order.extend(heads)
    if len(outputs) == 1:
        return outputs[0]
    return torch.cat(outputs, dim=1).index_select(1, torch.tensor(order, device=q.device).argsort())


def _global_queries(
    q_global: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    mask_fn: MaskFn,
    global_index: Tensor,
    global_valid: Tensor,
    owned: Tensor,
    shard: _Shard,
    cp: ContextParallel,
    scale: float,
    dropout_p: float,
) -> Tensor:
    """Global queries see the whole sequence: each rank attends all g of them `q_global` `[b, h, g, d]` to its own
    keys `k`, `v` `[b, h_kv, n, d]`, the partial results of the ranks are merged by log-sum-exp, and each rank
    writes the rows of the global tokens it holds over its local result `out` `[b, h, n, d_v]`."""
    b, h, g, _ = q_global.shape
    n, d_v = k.shape[2], v.shape[3]
    mask = evaluate_block_mask(
        mask_fn,
        batch=b,
        heads=torch.arange(h, device=k.device),
        q_pos=global_index.view(b, 1, g),
        kv_pos=(shard.start + torch.arange(n, device=k.device)).view(1, 1, n),
        q_valid=global_valid.view(b, 1, g),
    )  # [b, 1|h, 1, g, n]
    part, lse = attend_blocks(q_global[:, :, None], k, v, kv_index=None, mask=mask, scale=scale, dropout_p=dropout_p)
    # [b, h, 1, g, d_v] and [b, h, 1, g] of every rank, side by side: [P·b, h, 1, g, d_v + 1], in the dtype of the
    # log-sum-exp (float32 for half inputs), so that packing rounds neither.
    packed = torch.cat([part.to(lse.dtype), lse[..., None]], dim=-1)
    every = funcol.all_gather_single_autograd(packed.contiguous(), 0, cp.group).view(cp.size, *packed.shape)
    merged, _ = merge_attention([(every[r, ..., :d_v], every[r, ..., d_v]) for r in range(cp.size)])
    merged = merged.reshape(b, h, g, d_v).to(out.dtype)
    # Rows of global tokens held elsewhere go to an extra row that is cut off, so no row is written twice.
    target = torch.where(owned, global_index - shard.start, torch.full_like(global_index, n))  # [b, g]
    padded = torch.nn.functional.pad(out, (0, 0, 0, 1))  # [b, h, n + 1, d_v]
    padded = padded.scatter(2, target.view(b, 1, g, 1).expand(b, h, g, d_v), merged)
    return padded[:, :, :n]
