"""Blocked attention on plain PyTorch: each block of queries attends to its own gathered set of keys.

Shape legend: b batch, h heads, h_kv key/value heads (grouped-query attention: h_kv divides h, query head i reads
key/value head i // (h / h_kv)), n length (n_q queries, n_k keys), nb query blocks, c queries per block, m keys
gathered per block, g global tokens (the most any batch row has), d head dim (d_v for values).

Three layers, each usable on its own:

1. `attend_blocks(q_blocks, k, v, kv_index=..., mask=...) -> (out, lse)`: the generic kernel. Block i of queries
   attends to the keys `kv_index[i]` (or to every key; optionally first to its own block of keys, read in place:
   `own_keys`), restricted by a bool mask. A custom autograd function saves q, k, v, the indices and one bool per
   query row, plus the mask when it is given as a tensor (O(n · m) bytes); a mask given as a function of the chunk
   (`block_mask`) is evaluated again in backward instead. Backward recomputes the probabilities, walking the blocks
   in chunks with reused workspaces, so no [nb, c, m] float tensor is ever kept and peak memory does not grow with
   the length beyond the saved tensors. Sinkhorn's blocks, dilated bands, global queries and other "attend within
   a gathered key set" kinds reuse it.
2. `merge_attention([(out, lse), ...])`: combine partial attentions over disjoint key sets exactly (log-sum-exp).
   `attend_block_sets(q, k, v, [BlockSet, ...])` does it inside the kernel, for a pattern whose parts need different
   block layouts (Sparse Transformer's strided and fixed): one autograd function over all the parts, queries read
   and outputs written by index, chunks merged into the output as they are computed, masks evaluated from each part's
   predicate in forward and again in backward; saved: q, k, v, the output and its log-sum-exp (O(n · d)).
3. `banded_attention(q, k, v, mask_fn=..., window_left=..., ...)`: sliding window, dilated sliding window (per-head
   dilation) and Longformer global tokens, for any pattern predicate whose local part lies inside the band. A plain
   band without dropout on CPU runs `_BandAttention`: torch's fused CPU attention kernel per chunk of blocks, the
   keys of a block read as a strided view of k and v themselves (they are contiguous positions; only the first and
   last chunks copy a small zero-padded piece), key gradients added straight into their tensors; blocks at the
   edges or next to padding / global keys evaluate their masks from the predicate in forward and again in backward
   (nothing n x keys is saved), every other block of an exact band takes one shared band mask. Dilated bands,
   dropout, other devices and compilers use `attend_blocks`.

The block masks are never written by hand: they come from evaluating the pattern's `MaskFn` (see
`longattn.patterns`) on the ORIGINAL positions of each block's queries and gathered keys, so the dense reference
(`materialize_mask`) and this executor share one definition.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
from torch import Tensor

from .numerics import (
    HIDDEN_LOGIT,
    SAFE_LOGIT_BOUND,
    compute_dtype,
    head_groups,
    hide_logits,
    logit_bound,
    merge_attention,
    sees_a_key,
)
from .patterns import MaskFn, and_masks
from .relative_logits import BiasFn, block_bias
from .tuning import workspace_elements

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


def _blocks_per_chunk(rows: int, per_block: int, total_blocks: int) -> int:
    return max(1, min(total_blocks, _CHUNK_ELEMENTS // max(1, rows * per_block)))


def _blocks_per_workspace(per_block: int, total_blocks: int, fixed: int = 0) -> int:
    """Blocks per chunk so that `fixed + blocks · per_block` workspace elements stay within the budget."""
    return max(1, min(total_blocks, (_WORKSPACE_ELEMENTS - fixed) // max(1, per_block)))


class _Workspace:
    """Flat buffers reused by every chunk, viewed at the size each chunk needs (the last chunk may be smaller)."""

    def __init__(self, dtype: torch.dtype, device: torch.device):
        self.dtype, self.device, self.buffers = dtype, device, {}

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


def _rows(t: Tensor) -> tuple[Tensor, Tensor, int]:
    """A `[rows, d]` view of t `[b, h, n, d]` without copying, for gathering and scatter-adding whole rows.

    Works for any layout with a unit stride on d whose other strides are multiples of d, e.g. the `[b, n, h, d]`
    buffer behind the usual `split_heads` transpose; other layouts are copied first.

    Returns:
        `(flat, base, step)`: flat `[rows, d]`; the row of (batch·head i, position p) is `base[i] + p · step`,
        base `[b·h]`.
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
    return flat, base.view(b * h), s2


def _zeros_with_rows(like: Tensor, dtype: torch.dtype) -> tuple[Tensor, tuple[Tensor, Tensor, int]]:
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


def _gather_rows(base: Tensor, step: int, kv_index: Tensor, start: int, stop: int) -> Tensor:
    """Flat row numbers `[b·h_kv·n_blk·m]` of the keys blocks `start:stop` gather, for `_rows` views.

    kv_index `[nb, m]` is shared by the batch rows, `[b, nb, m]` has one per row, `[b, h_kv, nb, m]` one per row and
    key/value head; base `[b·h_kv]` (see `_rows`)."""
    if kv_index.dim() == 2:
        return (base.view(-1, 1) + kv_index[start:stop].reshape(1, -1) * step).view(-1)
    if kv_index.dim() == 4:
        return (base.view(-1, 1) + kv_index[:, :, start:stop].reshape(base.shape[0], -1) * step).view(-1)
    b = kv_index.shape[0]
    return (base.view(b, -1, 1) + kv_index[:, start:stop].reshape(b, 1, -1) * step).view(-1)


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


def _weighted_bound(q: Tensor, k: Tensor, scale: float, bias: Tensor | None, kv_weight: Tensor | None) -> float:
    """`numerics.logit_bound` of a call whose gathered keys may be weighted by `kv_weight` (own keys: weight 1)."""
    if kv_weight is not None and kv_weight.numel():
        scale = abs(scale) * max(1.0, float(kv_weight.detach().abs().amax()))
    return logit_bound(q, k, scale, bias)


class _RepeatedBlockMask:
    """A block mask `[b|1, h|1, nb, c, m]` kept for backward as one template block per batch row and head (its most
    common block), the blocks that see no key, and the few other blocks; rebuilt exactly chunk by chunk as a
    `(start, stop) -> blocks` mask source of `attend_blocks`.

    A band's interior blocks all see their keys in the same slots (the key set moves with the block); the blocks
    inside a row's padding see none; only those at the sequence's edges, across a padding boundary or beside global
    keys differ. 16K tokens under a dilated band of 2 x 256 keys then keep kilobytes per head group instead of
    10 MB. Rebuilding costs a copy of the template per chunk, far less than evaluating the pattern predicate again
    (which made a dilated layer 1.20-1.26x slower).
    """

    def __init__(self, template: Tensor, differs: Tensor, empty: Tensor, stored_blocks: Tensor):
        self.template, self.empty, self.stored_blocks = template, empty, stored_blocks
        self.stored = differs & ~empty
        self.stored_row = (self.stored.flatten().cumsum(0) - 1).view(self.stored.shape)  # where each stored block sits
        self.odd = differs.flatten(0, 1).any(0).tolist()  # per block: any batch row or head not the template

    @staticmethod
    def compress(mask: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor] | None:
        """`(template [b|1, h|1, c, m], differs [b|1, h|1, nb], empty [b|1, h|1, nb], stored_blocks [k, c, m])`:
        each batch row's and head's most common block as its template, which blocks differ from it, which of those
        see no key, and the k others themselves; None when more than half of the blocks must be stored (the mask is
        then as cheap to keep)."""
        b, h, nb, c, m = mask.shape
        step = max(1, _CHUNK_ELEMENTS // max(1, b * h * c * m))  # blocks per slice: bounded temporaries
        slices = [slice(start, start + step) for start in range(0, nb, step)]
        # The most common block, found by a fingerprint of three of its rows: integer weights below 2**20 summed in
        # float64 are exact, so equal blocks get equal fingerprints. It only picks the template (a block unlike
        # most would just store more blocks); the comparison below is exact. All rows: 40 ms at 16K, three: 0.2.
        sampled = torch.tensor(sorted({0, c // 2, c - 1}), device=mask.device)
        generator = torch.Generator().manual_seed(0)
        weights = torch.randint(0, 2**20, (len(sampled) * m,), generator=generator).to(mask.device, torch.float64)
        fingerprints = mask.index_select(3, sampled).reshape(b, h, nb, -1).to(torch.float64) @ weights
        most_common = fingerprints.mode(dim=2).indices  # [b, h]
        rows_b, rows_h = torch.arange(b, device=mask.device), torch.arange(h, device=mask.device)
        template = mask[rows_b[:, None], rows_h[None, :], most_common]  # [b, h, c, m]
        differs = torch.empty(b, h, nb, dtype=torch.bool, device=mask.device)
        empty = torch.empty_like(differs)
        # On the bytes: xor and max are 5x faster than `!=` and `any` on bools.
        bytes_, template_bytes = mask.view(torch.uint8), template.unsqueeze(2).view(torch.uint8)
        for part in slices:
            torch.ne(
                torch.bitwise_xor(bytes_[:, :, part], template_bytes).flatten(3).amax(-1), 0, out=differs[:, :, part]
            )
            torch.eq(bytes_[:, :, part].flatten(3).amax(-1), 0, out=empty[:, :, part])
        stored = differs & ~empty
        if 2 * int(stored.sum()) > stored.numel():
            return None
        return template, differs, empty, mask[stored]

    def __call__(self, start: int, stop: int) -> Tensor:
        b, h, c, m = self.template.shape
        blocks = self.template.unsqueeze(2).expand(b, h, stop - start, c, m)
        if not any(self.odd[start:stop]):
            return blocks
        blocks = blocks.clone()
        blocks[self.empty[:, :, start:stop]] = False
        stored = self.stored[:, :, start:stop]
        blocks[stored] = self.stored_blocks[self.stored_row[:, :, start:stop][stored]]
        return blocks


class _BlockAttention(torch.autograd.Function):
    """Forward and hand-written backward of `attend_blocks` (see there for shapes).

    Saves q, k, v, the integer key sets and weights, and one bool per query row ("sees a key"); a mask given as a tensor
    is saved as its repeated block and the blocks that differ (`_RepeatedBlockMask`; as it is when most blocks differ),
    a mask given as a function of the chunk is evaluated again in backward (nothing n x keys is kept). Backward
    recomputes the probabilities P chunk by chunk and applies dV = Pᵀ dO, dP = dO Vᵀ,
    dS = P ∘ (dP − rowsum(dO ∘ O)) + P ∘ dlse, dQ = dS K · scale, dK = dSᵀ Q · scale; the gradients of gathered keys
    are scatter-added back to their positions, those of the blocks' own keys (`own_keys`) added in place. The dlse
    term lets partial attentions merged by `merge_attention` train.

    Layouts: k, v are read in place (see `_rows`), and the output and gradients are allocated in the layout of
    their counterparts, so the `[b, n, h, d]` views that multi-head layers pass in and get back cost no copies.
    """

    @staticmethod
    def forward(ctx, q_blocks, k, v, kv_index, mask, scale, dropout_p, seed, kv_weight, bias, own_keys):
        b, h, nb, c, _ = q_blocks.shape
        h_kv, d_v = v.shape[1], v.shape[3]
        dtype = compute_dtype(q_blocks.dtype)
        device = q_blocks.device
        # [b, nb, c, h, d_v] memory seen as [b, h, nb, c, d_v]: merging the heads afterwards is then a view.
        out = torch.empty(b, nb, c, h, d_v, dtype=dtype, device=device).permute(0, 3, 1, 2, 4)
        lse = torch.empty(b, h, nb, c, dtype=dtype, device=device)
        # Grouped views [b, h_kv, group, nb, c, ...] of the per-query-head tensors, matching `_Chunk.view6`.
        out6, lse6 = (_split_heads(t, h_kv) for t in (out, lse))
        # None (no mask: every key visible) skips the hidden-score addition and the "row sees no key" zeroing.
        # Otherwise [b|1, h|1, nb, c, 1], filled chunk by chunk (its batch and head dims are the mask's).
        has_key = has_key6 = None
        workspace = _Workspace(dtype, device)
        generator = _dropout_generator(seed, device) if dropout_p > 0 else None
        k_c, v_c = k.to(dtype), v.to(dtype)
        bound = None if mask is None else _weighted_bound(q_blocks, k, scale, bias, kv_weight)
        for chunk in _chunks(q_blocks, k_c, v_c, kv_index, mask, scale, workspace, kv_weight, own_keys):
            start, stop = chunk.start, chunk.stop
            probs = _chunk_scores(chunk, bias, h_kv, workspace, bound)
            score_max = chunk.view6(probs).amax(dim=-1)  # [b, h_kv, group, n_blk, c]
            torch.ops.aten._softmax.out(probs, -1, False, out=probs)
            # The largest probability is exp(score_max - lse): one cheap reduction instead of a separate exp-sum.
            row_lse = score_max - chunk.view6(probs).amax(dim=-1).log()
            if chunk.hidden is not None:
                if has_key is None:
                    b_m, h_kv_m, group_m = chunk.hidden.shape[:3]
                    has_key = torch.empty(b_m, h_kv_m * group_m, nb, c, 1, dtype=torch.bool, device=device)
                    has_key6 = _split_heads(has_key, h_kv)
                chunk_has = has_key6[:, :, :, start:stop]
                torch.logical_not(chunk.hidden.all(dim=-1, keepdim=True), out=chunk_has)
                row_lse = row_lse.masked_fill(~chunk_has[..., 0], -math.inf)
            lse6[:, :, :, start:stop] = row_lse
            if generator is not None:
                keep = workspace.get("keep", chunk.scores_shape).bernoulli_(1.0 - dropout_p, generator=generator)
                probs.mul_(keep.mul_(1.0 / (1.0 - dropout_p)))
            chunk_out = torch.bmm(probs, chunk.values, out=workspace.get("out", chunk.out_shape))
            if has_key6 is None:
                out6[:, :, :, start:stop].copy_(chunk.view6(chunk_out))
            else:
                torch.mul(chunk.view6(chunk_out), has_key6[:, :, :, start:stop], out=out6[:, :, :, start:stop])

        # A mask tensor is kept as its repeated block and the blocks that differ (`_RepeatedBlockMask`) where that is
        # smaller; a mask function is evaluated again in backward.
        saved_mask = mask if isinstance(mask, Tensor) else None
        repeated = None if saved_mask is None else _RepeatedBlockMask.compress(saved_mask)
        if repeated is not None:
            saved_mask = None
        ctx.save_for_backward(q_blocks, k, v, kv_index, saved_mask, has_key, kv_weight, bias, *(repeated or ()))
        ctx.mask_fn = None if isinstance(mask, Tensor) else mask
        ctx.scale, ctx.dropout_p, ctx.seed, ctx.own_keys, ctx.bound = scale, dropout_p, seed, own_keys, bound
        # An unused lse (the common case) then arrives as None in backward instead of a tensor of zeros.
        ctx.set_materialize_grads(False)
        return out.to(q_blocks.dtype), lse

    @staticmethod
    def backward(ctx, grad_out, grad_lse):
        q_blocks, k, v, kv_index, mask, has_key, kv_weight, bias, *repeated = ctx.saved_tensors
        if repeated:
            mask = _RepeatedBlockMask(*repeated)
        elif mask is None:
            mask = ctx.mask_fn
        scale, dropout_p, own_keys = ctx.scale, ctx.dropout_p, ctx.own_keys
        b, h, nb, c, d = q_blocks.shape
        h_kv, d_v = v.shape[1], v.shape[3]
        dtype = compute_dtype(q_blocks.dtype)
        device = q_blocks.device
        if grad_lse is not None:
            grad_lse = grad_lse.to(dtype) if has_key is None else grad_lse.to(dtype) * has_key[..., 0]
            grad_lse = _split_heads(grad_lse.unsqueeze(-1), h_kv)  # [.., nb, c, 1]
        grad_q = torch.empty_like(q_blocks, dtype=dtype)
        grad_q6 = _split_heads(grad_q, h_kv)
        has_key6 = None if has_key is None else _split_heads(has_key, h_kv)
        grad_out6 = None if grad_out is None else _split_heads(grad_out, h_kv)
        grad_k, (grad_k_rows, grad_k_base, grad_k_step) = _zeros_with_rows(k, dtype)
        grad_v, (grad_v_rows, grad_v_base, grad_v_step) = _zeros_with_rows(v, dtype)
        # The blocks' own keys: [b, h_kv, nb, own_keys, d] views of the gradients, added to in place.
        grad_k_own, grad_v_own = (_own_blocks(t, nb, own_keys) for t in (grad_k, grad_v))
        grad_weight = None if kv_weight is None else torch.empty(kv_weight.shape, dtype=dtype, device=device)
        grad_bias = torch.empty(bias.shape, dtype=dtype, device=device) if ctx.needs_input_grad[9] else None
        workspace = _Workspace(dtype, device)
        generator = _dropout_generator(ctx.seed, device) if dropout_p > 0 else None

        for chunk in _chunks(q_blocks, k.to(dtype), v.to(dtype), kv_index, mask, scale, workspace, kv_weight, own_keys):
            start, stop = chunk.start, chunk.stop
            probs = _chunk_scores(chunk, bias, h_kv, workspace, ctx.bound)
            torch.ops.aten._softmax.out(probs, -1, False, out=probs)
            grad_out_chunk = workspace.get("grad_out", chunk.out_shape)
            if grad_out is None:
                grad_out_chunk.zero_()
            elif has_key6 is None:
                chunk.view6(grad_out_chunk).copy_(grad_out6[:, :, :, start:stop])
            else:
                # Rows without a visible key had their output zeroed: their probabilities get no gradient.
                torch.mul(
                    grad_out6[:, :, :, start:stop], has_key6[:, :, :, start:stop], out=chunk.view6(grad_out_chunk)
                )
            grad_scores = workspace.get("grad_scores", chunk.scores_shape)
            torch.bmm(grad_out_chunk, chunk.values.transpose(1, 2), out=grad_scores)  # dP
            if generator is not None:
                keep = workspace.get("keep", chunk.scores_shape).bernoulli_(1.0 - dropout_p, generator=generator)
                grad_scores.mul_(keep.mul_(1.0 / (1.0 - dropout_p)))
            # P ∘ (dP − rowsum(P ∘ dP)); with dropout rowsum(P ∘ dP) is still rowsum(dO ∘ O).
            torch.ops.aten._softmax_backward_data.out(grad_scores, probs, -1, dtype, grad_input=grad_scores)
            if grad_lse is not None:
                chunk.view6(grad_scores).addcmul_(chunk.view6(probs), grad_lse[:, :, :, start:stop])
            if grad_bias is not None:  # the bias is added to the scores as they are: its gradient is dS
                _split_heads(grad_bias, h_kv)[:, :, :, start:stop] = chunk.view6(grad_scores)
            if generator is not None:
                probs.mul_(keep)  # dV needs the dropped probabilities, dS needed the undropped ones
            grad_values, grad_keys, grad_q_chunk = _product_gradients(
                chunk, probs, grad_scores, grad_out_chunk, workspace
            )
            torch.mul(chunk.view6(grad_q_chunk), scale, out=grad_q6[:, :, :, start:stop])
            if kv_index is None:
                grad_k.add_(grad_keys.view(b, h_kv, -1, d))
                grad_v.add_(grad_values.view(b, h_kv, -1, d_v))
                continue
            if own_keys:
                n_blk = stop - start
                grad_k_own[:, :, start:stop] += grad_keys.view(b, h_kv, n_blk, -1, d)[:, :, :, :own_keys]
                grad_v_own[:, :, start:stop] += grad_values.view(b, h_kv, n_blk, -1, d_v)[:, :, :, :own_keys]
            grad_keys, grad_values = _gathered_gradients(chunk, grad_keys, grad_values, grad_weight, workspace)
            grad_k_rows.index_add_(
                0, _gather_rows(grad_k_base, grad_k_step, kv_index, start, stop), grad_keys.reshape(-1, d)
            )
            grad_v_rows.index_add_(
                0, _gather_rows(grad_v_base, grad_v_step, kv_index, start, stop), grad_values.reshape(-1, d_v)
            )

        return (
            grad_q.to(q_blocks.dtype),
            grad_k.to(k.dtype),
            grad_v.to(v.dtype),
            None,
            None,
            None,
            None,
            None,
            None if grad_weight is None else grad_weight.to(kv_weight.dtype),
            None if grad_bias is None else grad_bias.to(bias.dtype),
            None,
        )


def _own_blocks(t: Tensor, nb: int, own_keys: int) -> Tensor | None:
    """The first nb · own_keys positions of t `[b, h, n, d]` as `[b, h, nb, own_keys, d]` (a view), or None."""
    return t[:, :, : nb * own_keys].unflatten(2, (nb, own_keys)) if own_keys else None


def _chunk_scores(chunk: _Chunk, bias: Tensor | None, h_kv: int, workspace: _Workspace, bound: float) -> Tensor:
    """The chunk's scores `[rows, queries, m]` (q is scaled already) plus the bias, hidden keys hidden (`_hide`
    under the call's logit `bound`), in the "probs" workspace (forward and backward compute them alike)."""
    probs = workspace.get("probs", chunk.scores_shape)
    torch.bmm(chunk.q, chunk.keys.transpose(1, 2), out=probs)
    if bias is not None:
        chunk.view6(probs).add_(_split_heads(bias[:, :, chunk.start : chunk.stop], h_kv))
    if chunk.hidden is not None:
        _hide(chunk.view6(probs), chunk.hidden, bound)
    return probs


def _product_gradients(
    chunk: _Chunk,
    probs: Tensor,
    grad_scores: Tensor,
    grad_out_chunk: Tensor,
    workspace: _Workspace,
    accumulate: bool = False,
) -> tuple[Tensor, Tensor, Tensor]:
    """dV = Pᵀ dO, dK = dSᵀ Q and dQ = dS K of a chunk (q and the keys as the chunk holds them: dK and dQ still
    need the scale where the other side was scaled), in the "grad_values", "grad_keys", "grad_q" workspaces; with
    `accumulate`, dV and dK are added to what those workspaces hold (keys shared by the chunks)."""
    grad_values = workspace.get("grad_values", chunk.values.shape)
    grad_keys = workspace.get("grad_keys", chunk.keys.shape)
    if accumulate:
        grad_values.baddbmm_(probs.transpose(1, 2), grad_out_chunk)
        grad_keys.baddbmm_(grad_scores.transpose(1, 2), chunk.q)
    else:
        torch.bmm(probs.transpose(1, 2), grad_out_chunk, out=grad_values)
        torch.bmm(grad_scores.transpose(1, 2), chunk.q, out=grad_keys)
    grad_q = torch.bmm(grad_scores, chunk.keys, out=workspace.get("grad_q", chunk.q.shape))
    return grad_values, grad_keys, grad_q


def _softmax_rows(probs: Tensor) -> Tensor:
    """Softmax of scores `[rows, queries, m]` in place; returns each row's log-sum-exp `[rows·queries]` (finite but
    meaningless where every key is hidden: the mask tells those rows, `_BlockSetAttention` sets them to -inf)."""
    score_max = probs.amax(dim=-1).view(-1)
    torch.ops.aten._softmax.out(probs, -1, False, out=probs)
    # The largest probability is exp(score_max − lse): one cheap reduction instead of a separate exp-sum.
    return score_max - probs.amax(dim=-1).view(-1).log()


def _gathered_gradients(
    chunk: _Chunk, grad_keys: Tensor, grad_values: Tensor, grad_weight: Tensor | None, workspace: _Workspace
) -> tuple[Tensor, Tensor]:
    """The gradients of the chunk's gathered (unweighted) key and value rows `[rows, m − own, d]`, from those of the
    keys and values it attended to `[rows, m, d]`.

    With weights (K_w = w·K, V_w = w·V): writes dw = Σ_d dK_w ∘ K + Σ_d dV_w ∘ V (summed over the keys too where w
    is one per block) into the chunk's slice of grad_weight `[b, h_kv, nb, m − own | 1]`, and returns w·dK_w,
    w·dV_w."""
    own = chunk.own_keys
    grad_keys, grad_values = grad_keys[:, own:], grad_values[:, own:]
    if chunk.weight is None:
        return grad_keys, grad_values
    rows, columns = grad_keys.shape[0], chunk.weight.shape[1]
    product = torch.mul(grad_keys, chunk.raw_keys, out=workspace.get("weight_product", grad_keys.shape))
    dw = product.view(rows, columns, -1).sum(dim=-1)  # [b·h_kv·n_blk, m − own | 1]
    product = torch.mul(grad_values, chunk.raw_values, out=workspace.get("weight_product", grad_values.shape))
    dw += product.view(rows, columns, -1).sum(dim=-1)
    grad_weight[:, :, chunk.start : chunk.stop] = dw.view(grad_weight.shape[0], grad_weight.shape[1], -1, columns)
    weighted_keys = torch.mul(grad_keys, chunk.weight, out=workspace.get("weighted_grad_keys", grad_keys.shape))
    weighted_values = torch.mul(grad_values, chunk.weight, out=workspace.get("weighted_grad_values", grad_values.shape))
    return weighted_keys, weighted_values


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


MaskSource = Tensor | Callable[[int, int], Tensor] | None


def _chunk_mask(mask: MaskSource, start: int, stop: int) -> Tensor | None:
    """Blocks start:stop of a mask given as a tensor `[b|1, h|1, nb, c, m]` or as a function of (start, stop)."""
    if mask is None or isinstance(mask, Tensor):
        return None if mask is None else mask[:, :, start:stop]
    return mask(start, stop)


def _chunks(
    q_blocks, k, v, kv_index, mask: MaskSource, scale: float, workspace: _Workspace, kv_weight=None, own_keys=0
):
    """Yield a `_Chunk` per group of query blocks small enough for the workspace budget."""
    b, h, nb, c, d = q_blocks.shape
    h_kv, n_k, d_v = k.shape[1], k.shape[2], v.shape[3]
    group = h // h_kv
    gathered = 0 if kv_index is None else kv_index.shape[-1]
    m = n_k if kv_index is None else own_keys + gathered
    # Per block: scores and their gradient, the queries, output and query gradients, and (gathered) keys and values
    # with their gradients, plus the gathered rows before weighting and their products with `kv_weight`.
    per_block = 2 * b * h * c * m + 4 * b * h * c * max(d, d_v)
    if kv_index is not None:
        per_block += 4 * b * h_kv * m * max(d, d_v)
        if kv_weight is not None or own_keys:
            per_block += 3 * b * h_kv * gathered * max(d, d_v)
    step = _blocks_per_workspace(per_block, nb)
    if kv_index is None:
        all_keys, all_values = k.reshape(b * h_kv, n_k, d), v.reshape(b * h_kv, n_k, d_v)  # views, usual layouts
    else:
        k_rows, k_base, k_step = _rows(k)
        v_rows, v_base, v_step = _rows(v)
        k_own, v_own = _own_blocks(k, nb, own_keys), _own_blocks(v, nb, own_keys)
    for start in range(0, nb, step):
        stop = min(nb, start + step)
        n_blk = stop - start
        shape6 = (b, h_kv, group, n_blk, c)
        q_chunk = _split_heads(q_blocks[:, :, start:stop], h_kv)  # [b, h_kv, group, n_blk, c, d]
        hidden = None
        mask_chunk = _chunk_mask(mask, start, stop)
        if mask_chunk is not None:
            mask_chunk = _split_heads(mask_chunk, h_kv)
            hidden = torch.logical_not(mask_chunk, out=workspace.get("hidden", mask_chunk.shape, torch.bool))
        if kv_index is None:
            q_scaled = torch.mul(q_chunk, scale, out=workspace.get("q", (b, h_kv, group, n_blk, c, d)))
            yield _Chunk(
                start, stop, q_scaled.view(b * h_kv, group * n_blk * c, d), all_keys, all_values, hidden, shape6
            )
            continue
        # Each block's queries of one group side by side: [b, h_kv, n_blk, group, c, d] memory.
        q_scaled = workspace.get("q", (b, h_kv, n_blk, group, c, d))
        torch.mul(q_chunk, scale, out=q_scaled.transpose(2, 3))
        batches = b * h_kv * n_blk
        # Flat rows of (batch·head, block, key): a dim-0 index_select is ~4x faster than one on dim 2.
        plain = kv_weight is None and not own_keys  # the gathered rows are the keys themselves
        count = batches * gathered
        gathered_keys = torch.index_select(
            k_rows,
            0,
            _gather_rows(k_base, k_step, kv_index, start, stop),
            out=workspace.get("keys" if plain else "gathered_keys", (count, d)),
        ).view(batches, gathered, d)
        gathered_values = torch.index_select(
            v_rows,
            0,
            _gather_rows(v_base, v_step, kv_index, start, stop),
            out=workspace.get("values" if plain else "gathered_values", (count, d_v)),
        ).view(batches, gathered, d_v)
        if plain:
            yield _Chunk(
                start, stop, q_scaled.view(batches, group * c, d), gathered_keys, gathered_values, hidden, shape6
            )
            continue
        # Own keys copied block by block from k (no index), then the gathered rows, weighted where they have weights.
        keys, values = workspace.get("keys", (batches, m, d)), workspace.get("values", (batches, m, d_v))
        if own_keys:
            keys.view(b, h_kv, n_blk, m, d)[:, :, :, :own_keys] = k_own[:, :, start:stop]
            values.view(b, h_kv, n_blk, m, d_v)[:, :, :, :own_keys] = v_own[:, :, start:stop]
        weight = None
        if kv_weight is None:
            keys[:, own_keys:] = gathered_keys
            values[:, own_keys:] = gathered_values
        else:
            weight = kv_weight[:, :, start:stop].reshape(batches, -1, 1).to(keys.dtype)  # [batches, m − own | 1, 1]
            torch.mul(gathered_keys, weight, out=keys[:, own_keys:])
            torch.mul(gathered_values, weight, out=values[:, own_keys:])
        yield _Chunk(
            start,
            stop,
            q_scaled.view(batches, group * c, d),
            keys,
            values,
            hidden,
            shape6,
            raw_keys=gathered_keys,
            raw_values=gathered_values,
            weight=weight,
            own_keys=own_keys,
        )


def attend_blocks(
    q_blocks: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    kv_index: Tensor | None,
    mask: MaskSource,
    scale: float,
    dropout_p: float = 0.0,
    kv_weight: Tensor | None = None,
    bias: Tensor | None = None,
    own_keys: int = 0,
) -> tuple[Tensor, Tensor]:
    """Each block of queries attends to its own set of keys; returns the output and the log-sum-exp.

    Costs O(b · h · nb · c · m) time and O(b · h · (n · d + nb · c)) memory (plus a bias passed as a tensor, which
    is saved, and the blocks of a mask tensor that differ from its repeated block); probabilities are recomputed in
    backward. A query row with no visible key returns zeros
    and `lse = -inf` (gradients stay finite).

    Args:
        q_blocks: Queries `[b, h, nb, c, d]` (any layout, e.g. `q.view(b, h, nb, c, d)` of a transposed view).
        k: Keys `[b, h_kv, n_k, d]`, h_kv dividing h (grouped-query attention: query head i reads key head
            i // (h / h_kv), without repeating k); the usual `[b, n, h_kv, d]`-backed views are read without a copy.
        v: Values `[b, h_kv, n_k, d_v]`, likewise.
        kv_index: Long `[nb, m']`: block i attends to keys `kv_index[i]` (valid positions; mask out padding
            entries); `[b, nb, m']`: one key set per batch row; `[b, h_kv, nb, m']`: one per batch row and key/value
            head (content-based layouts, e.g. Sinkhorn's sorted blocks). m = own_keys + m'. None: every block
            attends to all `n_k` keys (m = n_k) without gathering them.
        mask: Which keys each query may see, True = visible: a bool tensor `[b or 1, h or 1, nb, c, m]` (kept for
            backward as its repeated block and the blocks that differ, see `_RepeatedBlockMask`), or a function
            `(start, stop) -> ` that tensor's blocks start:stop, called per chunk in forward and again in backward,
            so that no n x m tensor is kept (the function should read only O(n) tensors); None: every key is visible
            (no mask is read or negated, and no row can be empty).
        scale: Multiplier of q·k (usually 1/sqrt(d)).
        dropout_p: Dropout on the attention probabilities (0 at evaluation).
        kv_weight: Optional float `[b, h_kv, nb, m']` or `[b, h_kv, nb, 1]` (needs `kv_index`): gathered key j of
            block i enters as `w · k` and `w · v` with w = `kv_weight[..., i, j]` (or one w per block),
            differentiably (Sinkhorn's sorted block, scaled by its sorting weight). None: weight 1 (no extra work).
            The own keys are never weighted.
        bias: Optional float `[b, h, nb, c, m]` added to the scaled scores of the pairs the blocks compute,
            differentiably (its gradient is the scores' gradient): relative-position logits
            (`relative_logits.block_bias`). Saved for backward, O(n · m) floats. None: no bias.
        own_keys: s > 0 (needs `kv_index`): the first s keys of block i are the positions i·s … i·s + s − 1 of k
            and v (a block's own keys, as in Sinkhorn attention), read block by block in place (no index, no
            weight) before the m' gathered ones; nb · s ≤ n_k. 0: every key comes from `kv_index`.

    Returns:
        `(out, lse)`: out `[b, h, nb, c, d_v]` in the dtype of q, stored as `[b, nb, c, h, d_v]` so that merging
        heads is a view; lse `[b, h, nb, c]` (float32 for half inputs), the log of the softmax normaliser of each
        row, for `merge_attention`.

    Raises:
        ValueError: If shapes do not match.
    """
    if q_blocks.dim() != 5 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(
            f"q_blocks must be [b, h, nb, c, d] and k, v [b, h_kv, n_k, d]; got {tuple(q_blocks.shape)}, "
            f"{tuple(k.shape)}, {tuple(v.shape)}"
        )
    b, h, nb, c, d = q_blocks.shape
    if k.shape[0] != b or k.shape[1] == 0 or h % k.shape[1] or v.shape[:3] != k.shape[:3] or k.shape[3] != d:
        raise ValueError(
            f"k, v must be [{b}, h_kv, n_k, {d}] with h_kv dividing {h} to match q_blocks; got "
            f"{tuple(k.shape)}, {tuple(v.shape)}"
        )
    if own_keys < 0 or (own_keys and (kv_index is None or nb * own_keys > k.shape[2])):
        raise ValueError(
            f"own_keys must be 0, or a block size s > 0 with a kv_index and nb * s <= n_k ({nb} * s <= {k.shape[2]}); "
            f"got own_keys={own_keys} with kv_index {None if kv_index is None else tuple(kv_index.shape)}"
        )
    m = k.shape[2] if kv_index is None else own_keys + kv_index.shape[-1]
    if kv_index is not None and (
        kv_index.dim() not in (2, 3, 4) or kv_index.shape[-2] != nb or (kv_index.dim() == 3 and kv_index.shape[0] != b)
    ):
        raise ValueError(f"kv_index must have shape [nb={nb}, m] or [b={b}, nb={nb}, m], got {tuple(kv_index.shape)}")
    if kv_index is not None and kv_index.dim() == 4 and tuple(kv_index.shape[:2]) != (b, k.shape[1]):
        raise ValueError(
            f"kv_index of one key set per head must have shape [b={b}, h_kv={k.shape[1]}, nb={nb}, m], "
            f"got {tuple(kv_index.shape)}"
        )
    if kv_weight is not None and (
        kv_index is None or tuple(kv_weight.shape) not in ((b, k.shape[1], nb, m - own_keys), (b, k.shape[1], nb, 1))
    ):
        raise ValueError(
            f"kv_weight must have shape [b={b}, h_kv={k.shape[1]}, nb={nb}, {m - own_keys} or 1] and comes with a "
            f"kv_index; got {tuple(kv_weight.shape)} with kv_index "
            f"{None if kv_index is None else tuple(kv_index.shape)}"
        )
    if isinstance(mask, Tensor) and (
        mask.dim() != 5
        or mask.shape[0] not in (1, b)
        or mask.shape[1] not in (1, h)
        or tuple(mask.shape[2:]) != (nb, c, m)
    ):
        raise ValueError(f"mask must have shape [{b} or 1, {h} or 1, {nb}, {c}, {m}], got {tuple(mask.shape)}")
    if mask is not None and not isinstance(mask, Tensor) and not callable(mask):
        raise ValueError(f"mask must be a bool tensor, a function of (start, stop) or None; got {type(mask).__name__}")
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p}")
    if bias is not None and tuple(bias.shape) != (b, h, nb, c, m):
        raise ValueError(f"bias must have shape [{b}, {h}, {nb}, {c}, {m}], got {tuple(bias.shape)}")
    arguments = (q_blocks, k, v, kv_index, mask, float(scale), float(dropout_p))
    if torch.compiler.is_compiling():
        return _attend_blocks_traceable(*arguments, kv_weight=kv_weight, bias=bias, own_keys=own_keys)
    seed = int(torch.randint(0, 2**62, (), device="cpu")) if dropout_p > 0 else 0
    return _BlockAttention.apply(*arguments, seed, kv_weight, bias, own_keys)


def _attend_blocks_traceable(
    q_blocks, k, v, kv_index, mask, scale, dropout_p, *, kv_weight=None, bias=None, own_keys=0
) -> tuple[Tensor, Tensor]:
    """`attend_blocks` in plain differentiable ops, for `torch.compile` and `torch.export` (same shapes and values;
    the arguments of `attend_blocks`, validated there).

    The eager kernel's chunk loop, reused workspaces and `out=` writes into strided views are host-side memory
    management: a compiler plans memory itself, and `out=` into strided views neither traces without graph breaks
    nor lowers to inductor. Here autograd derives the backward, and the compiler fuses mask, softmax and products.
    A mask function is evaluated on all the blocks at once.
    """
    dtype = compute_dtype(q_blocks.dtype)
    b, h_kv = k.shape[:2]
    nb = q_blocks.shape[2]
    if mask is not None and not isinstance(mask, Tensor):
        mask = mask(0, nb)
    if own_keys:  # the own keys as an index of their own, with weight 1
        own = torch.arange(nb * own_keys, device=k.device).view(nb, own_keys)
        if kv_weight is not None:
            kv_weight = kv_weight.expand(*kv_weight.shape[:3], kv_index.shape[-1])
            kv_weight = torch.cat([torch.ones_like(kv_weight[..., :1]).expand(-1, -1, -1, own_keys), kv_weight], -1)
        kv_index = torch.cat([own.expand(*kv_index.shape[:-1], own_keys), kv_index], dim=-1)
    if kv_index is None:
        keys, values = k.to(dtype)[:, :, None], v.to(dtype)[:, :, None]  # [b, h_kv, 1, n_k, d]
    elif kv_index.dim() == 4:  # one key set per head: [b, h_kv, nb, m, d]
        keys, values = (
            t.to(dtype)
            .gather(2, kv_index.flatten(2)[..., None].expand(-1, -1, -1, t.shape[3]))
            .view(*kv_index.shape, t.shape[3])
            for t in (k, v)
        )
    else:
        rows = torch.arange(b, device=k.device).view(b, 1, 1)
        index = kv_index.expand(b, *kv_index.shape[-2:])  # [b, nb, m]
        # [b, nb, m, h_kv, d] -> [b, h_kv, nb, m, d]
        keys, values = (t.to(dtype).transpose(1, 2)[rows, index].permute(0, 3, 1, 2, 4) for t in (k, v))
    if kv_weight is not None:
        weight = kv_weight.to(dtype)[..., None]  # [b, h_kv, nb, m | 1, 1]
        keys, values = keys * weight, values * weight
    keys, values = keys[:, :, None], values[:, :, None]  # a group of query heads shares a key/value head
    scores = (_split_heads(q_blocks.to(dtype), h_kv) * scale) @ keys.transpose(-1, -2)  # [b, h_kv, group, nb, c, m]
    scores = scores.flatten(1, 2)  # [b, h, nb, c, m]
    if bias is not None:
        scores = scores + bias.to(dtype)
    if mask is not None:
        scores = hide_logits(scores, ~mask)
    lse = torch.logsumexp(scores, dim=-1)  # [b, h, nb, c]
    probs = torch.nn.functional.dropout(torch.exp(scores - lse[..., None]), p=dropout_p)
    out = (_split_heads(probs, h_kv) @ values).flatten(1, 2)  # [b, h, nb, c, d_v]
    if mask is None:
        return out.to(q_blocks.dtype), lse
    has_key = mask.any(dim=-1)  # [b|1, h|1, nb, c]
    return (out * has_key[..., None]).to(q_blocks.dtype), lse.masked_fill(~has_key, -math.inf)


# ------------------------------------------------------------------------------------------------ block sets
@dataclass(frozen=True)
class BlockSet:
    """One layout of a union pattern: blocks of query positions, each gathering its keys, and the predicate that
    decides visibility (evaluated per chunk, in forward and again in backward: no mask is kept).

    Attributes:
        mask_fn: The predicate of this part (e.g. the pattern restricted to the part's geometry, so that every visible
            key of the union lies in exactly one part).
        q_pos: Long `[nb, c]`, the position of each query slot (queries are the last n_q of n_k positions).
        q_valid: Bool `[nb, c]`, False for padding slots; each valid position appears at most once in a set.
        kv_pos: Long `[nb, m]` (block i gathers the keys `kv_pos[i]`) or `[1, m]` (every block attends to the same m
            keys, gathered once per chunk), positions within range.
        kv_valid: Optional bool like `kv_pos`, False for keys that are never seen.
        heads: Optional long `[h_s]`, the query heads this set serves (the others get nothing from it); needs one
            key/value head per query head. None: every head.
    """

    mask_fn: MaskFn
    q_pos: Tensor
    q_valid: Tensor
    kv_pos: Tensor
    kv_valid: Tensor | None = None
    heads: Tensor | None = None

    def mask(self, batch: int, heads: Tensor, start: int, stop: int) -> Tensor:
        """Bool `[b|1, h_s|1, stop − start, c, m]` of blocks start:stop."""
        return block_mask(
            self.mask_fn,
            batch=batch,
            heads=heads,
            q_pos=self.q_pos[None],
            kv_pos=self.kv_pos[None],
            q_valid=self.q_valid[None],
            kv_valid=None if self.kv_valid is None else self.kv_valid[None],
        )(start, stop)

    def bias(self, bias_fn: BiasFn, batch: int, heads: Tensor, start: int, stop: int) -> Tensor:
        """Float `[b, h_s, stop − start, c, m]`: `bias_fn` on the original positions of blocks start:stop (like
        `mask`; padding slots and keys get a value too, hidden by the mask)."""
        kv_pos = self.kv_pos if self.kv_pos.shape[0] == 1 else self.kv_pos[start:stop]
        return block_bias(bias_fn, batch=batch, heads=heads, q_pos=self.q_pos[None, start:stop], kv_pos=kv_pos[None])


@dataclass
class _SetPlan:
    """A `BlockSet` resolved against q, k, v: the heads it serves, its layout as a `_Chunk` grouping, and the rows
    its slots read (`read`, clamped into range) and write (`write`: padding slots go to an extra row n_q, so that
    they never collide with a real query)."""

    block_set: BlockSet
    heads: Tensor  # [h_s]
    h_kv: int  # key/value heads of the chunk layout (h_s when the set selects heads)
    group: int
    read: Tensor  # [nb, c]
    write: Tensor  # [nb, c]
    shared: bool


def _set_plans(block_sets: Sequence[BlockSet], h: int, h_kv: int, n_q: int, q_offset: int, device) -> list[_SetPlan]:
    plans = []
    for block_set in block_sets:
        row = block_set.q_pos - q_offset
        heads = torch.arange(h, device=device) if block_set.heads is None else block_set.heads
        selects = block_set.heads is not None
        plans.append(
            _SetPlan(
                block_set=block_set,
                heads=heads,
                h_kv=heads.shape[0] if selects else h_kv,
                group=1 if selects else h // h_kv,
                read=torch.where(block_set.q_valid, row, 0),
                write=torch.where(block_set.q_valid, row, n_q),
                shared=block_set.kv_pos.shape[0] == 1,
            )
        )
    return plans


def _head_rows(base: Tensor, plan: _SetPlan, b: int) -> Tensor:
    """`_rows` bases `[b·h]` of the set's heads, `[b, h_s]`."""
    return base.view(b, -1) if plan.block_set.heads is None else base.view(b, -1)[:, plan.heads]


def _query_rows(base: Tensor, step: int, plan: _SetPlan, index: Tensor, start: int, stop: int, b: int) -> Tensor:
    """Flat row numbers of the slots of blocks start:stop for a `_rows` view of a `[b, h, n, ·]` tensor, in the
    chunk's order: `[b, h_kv, n_blk, group, c]` (blocks gathering their own keys) or `[b, h_kv, group, n_blk, c]`
    (shared keys)."""
    base = _head_rows(base, plan, b).reshape(b, plan.h_kv, plan.group)
    slots = index[start:stop] * step  # [n_blk, c]
    if plan.shared:
        return (base[:, :, :, None, None] + slots[None, None, None]).reshape(-1)
    return (base[:, :, None, :, None] + slots[None, None, :, None, :]).reshape(-1)


def _set_chunks(
    q: Tensor, k: Tensor, v: Tensor, plan: _SetPlan, scale: float, workspace: _Workspace, backward: bool = False
):
    """Yield `(chunk, kv_rows)` per group of the set's blocks: the `_Chunk` of gathered (scaled) queries, keys and
    values with the negated mask of the predicate, and the flat rows `_gather_rows` of its keys in k's `_rows` view
    (the same positions index the key gradients).

    Chunks are sized by the workspaces of their pass: backward holds the scores and their gradient, the keys, values
    and their gradients; forward only the scores, keys and values, so its chunks take up to twice the blocks (fewer
    chunks: the mask, gathers and merges per chunk cost the same at any size) without raising the step's peak,
    which comes in backward, where the q, k, v gradients exist."""
    b, _, _, d = q.shape
    d_v = v.shape[3]
    block_set = plan.block_set
    nb, c = block_set.q_pos.shape
    m = block_set.kv_pos.shape[1]
    h_s = plan.h_kv * plan.group
    q_rows, q_base, q_step = _rows(q)
    k_rows, k_base, k_step = _rows(k)
    v_rows, v_base, v_step = _rows(v)
    k_base, v_base = (_head_rows(base, plan, b).reshape(-1) for base in (k_base, v_base))
    buffers = 2 if backward else 1  # scores (and their gradient); keys and values (and their gradients)
    keys_once = 2 * buffers * b * plan.h_kv * m * max(d, d_v) if plan.shared else 0
    per_block = buffers * b * h_s * c * m + 4 * b * h_s * c * max(d, d_v)
    if not plan.shared:
        per_block += 2 * buffers * b * plan.h_kv * m * max(d, d_v)
    step = _blocks_per_workspace(per_block, nb, keys_once)

    def gather_keys(kv_start: int, kv_stop: int) -> tuple[Tensor, Tensor]:
        kv_count = b * plan.h_kv * (kv_stop - kv_start) * m
        key_rows = _gather_rows(k_base, k_step, block_set.kv_pos, kv_start, kv_stop)
        keys = torch.index_select(k_rows, 0, key_rows, out=workspace.get("keys", (kv_count, d)))
        value_rows = _gather_rows(v_base, v_step, block_set.kv_pos, kv_start, kv_stop)
        return keys, torch.index_select(v_rows, 0, value_rows, out=workspace.get("values", (kv_count, d_v)))

    if plan.shared:  # the same keys for every block: gathered once for the set
        keys, values = gather_keys(0, 1)
    for start in range(0, nb, step):
        stop = min(nb, start + step)
        n_blk = stop - start
        shape6 = (b, plan.h_kv, plan.group, n_blk, c)
        hidden6 = _split_heads(block_set.mask(b, plan.heads, start, stop), plan.h_kv)
        hidden6 = torch.logical_not(hidden6, out=workspace.get("hidden", hidden6.shape, torch.bool))
        rows = _query_rows(q_base, q_step, plan, plan.read, start, stop, b)
        q_chunk = torch.index_select(q_rows, 0, rows, out=workspace.get("q", (rows.shape[0], d))).mul_(scale)
        kv_start, kv_stop = (0, 1) if plan.shared else (start, stop)
        if not plan.shared:
            keys, values = gather_keys(start, stop)
        batches = b * plan.h_kv * (kv_stop - kv_start)
        chunk = _Chunk(
            start,
            stop,
            q_chunk.view(batches, -1, d),
            keys.view(batches, m, d),
            values.view(batches, m, d_v),
            hidden6,
            shape6,
        )
        yield chunk, (k_base, k_step, kv_start, kv_stop)


class _BlockSetAttention(torch.autograd.Function):
    """Forward and backward of `attend_block_sets` (see there for shapes).

    Forward merges each chunk's partial attention into the output and log-sum-exp of its queries at once (the
    log-sum-exp merge of `merge_attention`, row by row), so no part's output exists beside the result. Saved: q, k,
    v, the merged output O and log-sum-exp L (O(n · d)); the masks are evaluated again. Backward recomputes each
    chunk's probabilities of the UNION's softmax, P = exp(S − L), and uses D = rowsum(dO ∘ O) of the merged output:
    dV = Pᵀ dO, dS = P ∘ (dO Vᵀ − D) (+ P ∘ dL), dQ = dS K · scale, dK = dSᵀ Q · scale, all parts adding into one set
    of gradients (as `_BandAttention` does with the fused kernel's backward).

    A logit bias (`bias_fn`) is evaluated per chunk like the masks, in forward and again in backward; its gradient
    is dS itself, passed per chunk through the bias's own read (`torch.autograd.grad` of the chunk's bias) to the
    tensors it reads, `bias_tensors` (inputs here, e.g. the O(n · M) relative-logit table), so nothing n x keys is
    kept.
    """

    @staticmethod
    def forward(ctx, q, k, v, plans, scale, dropout_p, seed, bias_fn, *bias_tensors):
        b, h, n_q, _ = q.shape
        d_v = v.shape[3]
        dtype = compute_dtype(q.dtype)
        device = q.device
        # One extra row n_q takes the writes of padding slots. [b, n_q + 1, h, d_v] memory seen as [b, h, n_q + 1, d_v]:
        # merging the heads of the result is a view.
        out = torch.zeros(b, n_q + 1, h, d_v, dtype=dtype, device=device).transpose(1, 2)
        lse = torch.full((b, h, n_q + 1), -math.inf, dtype=dtype, device=device)
        out_rows, out_base, out_step = _rows(out)
        lse_rows, lse_base, lse_step = _rows(lse.unsqueeze(-1))
        workspace = _Workspace(dtype, device)
        generator = _dropout_generator(seed, device) if dropout_p > 0 else None
        # A bias function's values are not bounded in advance: hidden logits are then -inf exactly.
        bound = logit_bound(q, k, scale) if bias_fn is None else None
        k, v = k.to(dtype), v.to(dtype)
        for index, plan in enumerate(plans):
            for chunk, _ in _set_chunks(q.to(dtype), k, v, plan, scale, workspace):
                probs = workspace.get("probs", chunk.scores_shape)
                torch.bmm(chunk.q, chunk.keys.transpose(1, 2), out=probs)
                if bias_fn is not None:
                    chunk.view6(probs).add_(_set_bias(bias_fn, plan, b, chunk))
                _hide(chunk.view6(probs), chunk.hidden, bound)
                row_lse = _softmax_rows(probs)
                # A row whose keys are all hidden (by the mask, whatever its values): no key, lse = -inf.
                chunk.view6(row_lse.view(*chunk.scores_shape[:2], 1)).masked_fill_(_blind_rows(chunk), -math.inf)
                if generator is not None:
                    keep = workspace.get("keep", chunk.scores_shape).bernoulli_(1.0 - dropout_p, generator=generator)
                    probs.mul_(keep.mul_(1.0 / (1.0 - dropout_p)))
                chunk_out = torch.bmm(probs, chunk.values, out=workspace.get("out", chunk.out_shape)).view(-1, d_v)
                write = _query_rows(out_base, out_step, plan, plan.write, chunk.start, chunk.stop, b)
                lse_write = _query_rows(lse_base, lse_step, plan, plan.write, chunk.start, chunk.stop, b)
                if index == 0:  # nothing to merge with yet: the same values as a merge, without reading them
                    chunk_out.masked_fill_((row_lse == -math.inf).unsqueeze(-1), 0.0)  # rows that saw no key
                    out_rows.index_copy_(0, write, chunk_out)
                    lse_rows.view(-1).index_copy_(0, lse_write, row_lse)
                else:
                    _merge_rows(out_rows, lse_rows.view(-1), write, lse_write, chunk_out, row_lse)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.plans, ctx.scale, ctx.dropout_p, ctx.seed, ctx.bound = plans, scale, dropout_p, seed, bound
        # Held by the bias function anyway; read again in backward (through it) for their gradients.
        ctx.bias_fn, ctx.bias_tensors = bias_fn, bias_tensors
        ctx.set_materialize_grads(False)
        return out[:, :, :n_q].to(q.dtype), lse[:, :, :n_q]

    @staticmethod
    def backward(ctx, grad_out, grad_lse):
        q, k, v, out, lse = ctx.saved_tensors
        plans, scale, dropout_p = ctx.plans, ctx.scale, ctx.dropout_p
        b, h, n_q, d = q.shape
        d_v = v.shape[3]
        dtype = compute_dtype(q.dtype)
        device = q.device
        if grad_out is None:
            grad_out = torch.zeros(b, h, n_q, d_v, dtype=dtype, device=device)
        grad_out = grad_out.to(dtype)
        # Per query `[b, h, n_q, 2 | 3]`, side by side so that a chunk reads them with one gather: L with -inf as 0
        # (a chunk's rows that see no key get P = 0 from their mask below), D = rowsum(dO ∘ O), and dL when the
        # log-sum-exp has a gradient.
        stats = torch.empty(b, h, n_q, 2 if grad_lse is None else 3, dtype=dtype, device=device)
        stats[..., 0] = lse[:, :, :n_q]
        stats[..., 0].masked_fill_(stats[..., 0] == -math.inf, 0.0)
        step = max(1, _WORKSPACE_ELEMENTS // max(1, b * h * d_v))
        for start in range(0, n_q, step):  # a slice at a time: no [b, h, n_q, d_v] temporary
            stop = min(n_q, start + step)
            stats[:, :, start:stop, 1] = torch.linalg.vecdot(grad_out[:, :, start:stop], out[:, :, start:stop])
        if grad_lse is not None:
            stats[..., 2] = grad_lse
        stat_rows, stat_base, stat_step = _rows(stats)
        grad_out_rows, grad_out_base, grad_out_step = _rows(grad_out)
        grad_q, (grad_q_rows, grad_q_base, grad_q_step) = _zeros_with_rows(q, dtype)
        grad_k, (grad_k_rows, grad_k_base, grad_k_step) = _zeros_with_rows(k, dtype)
        grad_v, (grad_v_rows, grad_v_base, grad_v_step) = _zeros_with_rows(v, dtype)
        workspace = _Workspace(dtype, device)
        generator = _dropout_generator(ctx.seed, device) if dropout_p > 0 else None
        k_c, v_c = k.to(dtype), v.to(dtype)
        bias_fn = ctx.bias_fn
        wanted = [i for i, need in enumerate(ctx.needs_input_grad[8:]) if need]  # bias tensors needing a gradient
        grad_bias = [None] * len(ctx.bias_tensors)
        for plan in plans:
            kv_pos = plan.block_set.kv_pos
            grad_k_set, grad_v_set = (_head_rows(base, plan, b).reshape(-1) for base in (grad_k_base, grad_v_base))
            chunks = _set_chunks(q.to(dtype), k_c, v_c, plan, scale, workspace, backward=True)
            for chunk, (_, _, kv_start, kv_stop) in chunks:
                # Keys shared by every block of the set: their gradients add up over the chunks in one workspace,
                # scattered back once after the last chunk.
                accumulate = plan.shared and chunk.start > 0
                start, stop = chunk.start, chunk.stop
                batches, queries = chunk.q.shape[:2]

                def gather(rows: Tensor, base: Tensor, step: int, name: str, width: int) -> Tensor:
                    index = _query_rows(base, step, plan, plan.read, start, stop, b)
                    return torch.index_select(rows, 0, index, out=workspace.get(name, (index.shape[0], width)))

                probs = workspace.get("probs", chunk.scores_shape)
                torch.bmm(chunk.q, chunk.keys.transpose(1, 2), out=probs)
                if bias_fn is not None:
                    with torch.enable_grad():  # the chunk's read of the bias tensors, differentiated below
                        bias = _set_bias(bias_fn, plan, b, chunk)
                    chunk.view6(probs).add_(bias.detach())
                _hide(chunk.view6(probs), chunk.hidden, ctx.bound)
                row_stats = gather(stat_rows, stat_base, stat_step, "stats", stats.shape[3]).view(batches, queries, -1)
                row_l, row_d, *row_dl = row_stats.split(1, dim=-1)  # [batches, queries, 1] each
                # P of the union's softmax, exp(S − L), as the chunk's softmax times exp(lse_chunk − L): torch's
                # softmax kernel exponentiates the hidden keys' scores (near HIDDEN_LOGIT) ~10x faster than `exp_`.
                # The chunk's rows that see no key (by their mask) get P = 0.
                row_lse = _softmax_rows(probs).view(batches, queries, 1)
                factor = row_lse.sub_(row_l).exp_()
                chunk.view6(factor).masked_fill_(_blind_rows(chunk), 0.0)
                probs.mul_(factor)
                grad_out_chunk = gather(grad_out_rows, grad_out_base, grad_out_step, "grad_out", d_v)
                grad_out_chunk = grad_out_chunk.view(batches, queries, d_v)
                grad_scores = workspace.get("grad_scores", chunk.scores_shape)
                torch.bmm(grad_out_chunk, chunk.values.transpose(1, 2), out=grad_scores)  # dP
                if generator is not None:
                    keep = workspace.get("keep", chunk.scores_shape).bernoulli_(1.0 - dropout_p, generator=generator)
                    grad_scores.mul_(keep.mul_(1.0 / (1.0 - dropout_p)))
                grad_scores.sub_(row_d).mul_(probs)  # dS = P ∘ (dP − D)
                if row_dl:
                    grad_scores.addcmul_(probs, row_dl[0])
                if wanted:  # the bias adds to the scores: its gradient is dS
                    parts = torch.autograd.grad(
                        bias,
                        [ctx.bias_tensors[i] for i in wanted],
                        chunk.view6(grad_scores),
                        allow_unused=True,
                    )
                    for i, part in zip(wanted, parts):
                        if part is not None:
                            grad_bias[i] = part if grad_bias[i] is None else grad_bias[i].add_(part)
                if generator is not None:
                    probs.mul_(keep)  # dV needs the dropped probabilities, dS needed the undropped ones
                grad_values, grad_keys, grad_q_chunk = _product_gradients(
                    chunk, probs, grad_scores, grad_out_chunk, workspace, accumulate=accumulate
                )
                grad_q_index = _query_rows(grad_q_base, grad_q_step, plan, plan.read, start, stop, b)
                # Padding slots read row 0 of their head: their P, hence their gradients, are exactly 0.
                grad_q_rows.index_add_(0, grad_q_index, grad_q_chunk.view(-1, d), alpha=scale)
                if plan.shared and stop < plan.block_set.q_pos.shape[0]:
                    continue  # more chunks add to the shared keys' gradients
                grad_k_rows.index_add_(
                    0, _gather_rows(grad_k_set, grad_k_step, kv_pos, kv_start, kv_stop), grad_keys.view(-1, d)
                )
                grad_v_rows.index_add_(
                    0, _gather_rows(grad_v_set, grad_v_step, kv_pos, kv_start, kv_stop), grad_values.view(-1, d_v)
                )
        return grad_q.to(q.dtype), grad_k.to(k.dtype), grad_v.to(v.dtype), None, None, None, None, None, *grad_bias


def _blind_rows(chunk: _Chunk) -> Tensor:
    """Bool `[b|1, h_kv|1, group|1, n_blk, c, 1]`: the chunk's query rows whose keys its mask hides all."""
    return ~sees_a_key(chunk.hidden)


def _set_bias(bias_fn: BiasFn, plan: _SetPlan, batch: int, chunk: _Chunk) -> Tensor:
    """The bias of a chunk's pairs as `[b, h_kv, group, n_blk, c, m]`, the layout of `chunk.view6` of its scores."""
    return _split_heads(plan.block_set.bias(bias_fn, batch, plan.heads, chunk.start, chunk.stop), plan.h_kv)


def _merge_rows(out_rows: Tensor, lse_rows: Tensor, write: Tensor, lse_write: Tensor, chunk_out: Tensor, chunk_lse):
    """Merge a chunk's partial attention (chunk_out `[r, d_v]`, chunk_lse `[r]`, -inf where it saw no key) into the
    rows `write` of out_rows `[rows, d_v]` and `lse_write` of lse_rows `[rows]`, by log-sum-exp (as `merge_attention`).
    """
    old_lse = lse_rows.index_select(0, lse_write)
    shift = torch.maximum(old_lse, chunk_lse)
    shift.masked_fill_(shift == -math.inf, 0.0)
    old_weight, new_weight = (old_lse - shift).exp_(), (chunk_lse - shift).exp_()
    total = old_weight + new_weight
    lse_rows.index_copy_(0, lse_write, total.log().add_(shift))
    total.masked_fill_(total == 0, 1.0)
    merged = out_rows.index_select(0, write).mul_(old_weight.div_(total).unsqueeze(-1))
    merged.addcmul_(chunk_out, new_weight.div_(total).unsqueeze(-1))
    out_rows.index_copy_(0, write, merged)


def attend_block_sets(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    block_sets: Sequence[BlockSet],
    *,
    scale: float,
    dropout_p: float = 0.0,
    bias_fn: BiasFn | None = None,
) -> tuple[Tensor, Tensor]:
    """Attention over the union of several block layouts of the same queries (a pattern whose parts need different
    layouts, e.g. the Sparse Transformer's band and residue classes), one softmax over all of them.

    Every visible key must lie in exactly one set (restrict each set's predicate to its own geometry). Costs the sum
    of the sets' `attend_blocks` costs; memory O(b · h · n · d) for q, k, v, the output and one log-sum-exp per
    query (saved for backward), plus workspaces of at most `_WORKSPACE_ELEMENTS`: no mask, no gathered queries and no
    partial output of a set is kept, and the sets' gradients add into one set of gradient tensors.

    Args:
        q: Queries `[b, h, n_q, d]`, the last n_q of the n_k positions.
        k: Keys `[b, h_kv, n_k, d]`, h_kv dividing h (h_kv = h for sets that select heads).
        v: Values `[b, h_kv, n_k, d_v]`.
        block_sets: The `BlockSet`s (a query may appear in several sets, at most once in each).
        scale: Multiplier of q·k.
        dropout_p: Dropout on the attention probabilities.
        bias_fn: Optional logit bias of each pair (relative-position logits, `relative_logits.BiasFn`), evaluated on
            each chunk's positions (forward and again in backward) and added to scale · q·k. Its gradient reaches the
            tensors it lists in `bias_fn.tensors` (`relative_bias_fn` lists its table); a bias function without that
            list runs in plain ops (`_attend_block_sets_traceable`, masks and biases materialised per set), where
            autograd finds its tensors itself.

    Returns:
        `(out, lse)`: out `[b, h, n_q, d_v]` in the dtype of q (stored as `[b, n_q, h, d_v]`, so merging the heads is a
        view; queries that see no key get zeros), lse `[b, h, n_q]` (-inf where no key is seen).

    Raises:
        ValueError: If shapes do not match.
    """
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"q, k, v must be [b, h, n, d]; got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    b, h, n_q, d = q.shape
    h_kv, n_k = k.shape[1], k.shape[2]
    if k.shape[0] != b or h_kv == 0 or h % h_kv or v.shape[:3] != k.shape[:3] or k.shape[3] != d or n_q > n_k:
        raise ValueError(
            f"k, v must be [{b}, h_kv, n_k >= {n_q}, {d}] with h_kv dividing {h}; got {tuple(k.shape)}, "
            f"{tuple(v.shape)}"
        )
    for block_set in block_sets:
        if (
            block_set.q_pos.dim() != 2
            or block_set.kv_pos.dim() != 2
            or block_set.kv_pos.shape[0]
            not in (
                1,
                block_set.q_pos.shape[0],
            )
        ):
            raise ValueError(
                f"block set q_pos must be [nb, c] and kv_pos [nb or 1, m]; got {tuple(block_set.q_pos.shape)}, "
                f"{tuple(block_set.kv_pos.shape)}"
            )
        if block_set.heads is not None and h_kv != h:
            raise ValueError(f"a block set that selects heads needs one key/value head per query head; got h_kv={h_kv}")
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p}")
    bias_tensors = () if bias_fn is None else getattr(bias_fn, "tensors", None)
    if torch.compiler.is_compiling() or bias_tensors is None:
        return _attend_block_sets_traceable(q, k, v, block_sets, scale=scale, dropout_p=dropout_p, bias_fn=bias_fn)
    plans = _set_plans(block_sets, h, h_kv, n_q, n_k - n_q, q.device)
    seed = int(torch.randint(0, 2**62, (), device="cpu")) if dropout_p > 0 else 0
    return _BlockSetAttention.apply(q, k, v, plans, float(scale), float(dropout_p), seed, bias_fn, *bias_tensors)


def _attend_block_sets_traceable(q, k, v, block_sets, *, scale, dropout_p, bias_fn=None):
    """`attend_block_sets` in plain differentiable ops (see `_attend_blocks_traceable`): each set through
    `_attend_blocks_traceable` with its mask (and bias) materialised, scattered to query order, merged by
    `merge_attention`."""
    b, h, n_q, d = q.shape
    q_offset = k.shape[2] - n_q
    partials = []
    for block_set in block_sets:
        nb, c = block_set.q_pos.shape
        heads = torch.arange(h, device=q.device) if block_set.heads is None else block_set.heads
        q_s, k_s, v_s = (q, k, v) if block_set.heads is None else (t.index_select(1, heads) for t in (q, k, v))
        row = block_set.q_pos - q_offset
        q_blocks = q_s.index_select(2, torch.where(block_set.q_valid, row, 0).reshape(-1))
        q_blocks = q_blocks.view(b, heads.shape[0], nb, c, d)
        out_b, lse_b = _attend_blocks_traceable(
            q_blocks,
            k_s,
            v_s,
            kv_index=block_set.kv_pos.expand(nb, -1),
            mask=block_set.mask(b, heads, 0, nb),
            scale=scale,
            dropout_p=dropout_p,
            bias=None if bias_fn is None else block_set.bias(bias_fn, b, heads, 0, nb),
        )
        # Padding slots write to an extra row n_q, cut off below.
        write = torch.where(block_set.q_valid, row, n_q).reshape(1, -1)
        out = q.new_zeros(b, h, n_q + 1, v.shape[3], dtype=out_b.dtype)
        out[:, heads[:, None], write] = out_b.reshape(b, heads.shape[0], nb * c, -1)
        lse = torch.full((b, h, n_q + 1), -math.inf, dtype=lse_b.dtype, device=q.device)
        lse[:, heads[:, None], write] = lse_b.reshape(b, heads.shape[0], nb * c)
        partials.append((out[:, :, :n_q], lse[:, :, :n_q]))
    return merge_attention(partials)


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
    step = nb if torch.compiler.is_compiling() else _blocks_per_chunk(c, m, nb)
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

    Local part, per head group sharing a dilation, over a `band_layout`; the block masks come from `mask_fn`
    evaluated on original positions, with the band copies of global keys hidden. A plain band without dropout on CPU
    runs `_BandAttention` (torch's fused CPU attention per chunk of blocks, keys read as strided views, global keys
    merged by log-sum-exp, masks evaluated again in backward instead of saved). Otherwise (dilation, dropout, other
    devices, compilers) `attend_blocks`: every query block gathers its band keys and its batch row's global keys, one
    softmax. Global queries: a dense row over all keys, O(g · n), written over the local result. `mask_fn` decides
    visibility everywhere; the geometry
    arguments only say where visible keys can be, so they must cover `mask_fn`'s local part.

    Args:
        q: Queries `[b, h, n_q, d]`, the last n_q positions when `n_q < n_k`.
        k: Keys `[b, h_kv, n_k, d]`, h_kv dividing h (grouped-query attention, read without repeating k).
        v: Values `[b, h_kv, n_k, d_v]`.
        mask_fn: The pattern predicate (e.g. `patterns.sliding_window_pattern(...)`).
        window_left: Dilated steps of the band before each query (>= 0).
        window_right: Dilated steps of the band after each query (>= 0).
        dilation: Step between band keys; a sequence gives one per head.
        global_mask: Optional bool `[b, n_k]`, True = global token (must match the one inside `mask_fn`).
        scale: Multiplier of q·k.
        dropout_p: Dropout on the attention probabilities.
        block_size: Queries per block; smaller blocks gather fewer unused keys (c + 2w keys serve c queries),
            larger ones give larger matrix products and fewer steps. None: 128 for `attend_blocks` (fastest for
            w = 256 on a 2-core CPU, 16K tokens, forward + backward: 64 -> 0.59 s, 96 -> 0.63 s, 128 -> 0.50 s), and
            for the fused path `_fused_block_size`.
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
    n_k = k.shape[2]
    q_offset = n_k - n_q
    device = q.device
    out = q.new_empty(b, h, n_q, v.shape[3]) if n_q == 0 else None
    if out is not None:
        return out

    global_index = global_valid = None
    if global_mask is not None:
        global_index, global_valid = global_token_index(global_mask)  # [b, g]
        if global_index.shape[1] == 0:
            global_index = None
    local_fn = mask_fn if global_index is None else and_masks(mask_fn, _not_global_key(global_mask))

    # The fused paths add HIDDEN_LOGIT as a float bias: exact only for bounded logits (`numerics.hide_logits`).
    bounded = (
        bias_fn is None and _fused_band_applies(q, v, 1, dropout_p) and logit_bound(q, k, scale) <= SAFE_LOGIT_BOUND
    )
    groups = head_groups(dilation, h)
    if len(groups) > 1 and k.shape[1] != h:  # per-head dilations split the heads across key/value groups
        k, v = (t.repeat_interleave(h // t.shape[1], dim=1) for t in (k, v))
    group_outputs, group_heads = [], []
    for d, heads in groups:
        heads_t = torch.tensor(heads, device=device)
        if len(heads) == h:
            q_g, k_g, v_g = q, k, v
        else:
            q_g, k_g, v_g = (t.index_select(1, heads_t) for t in (q, k, v))
        hg = len(heads)
        class_len = -(-n_k // d)
        fused = bounded and _fused_band_applies(q_g, v_g, d, dropout_p)
        c = block_size or (_fused_block_size(hg // k_g.shape[1]) if fused else 128)
        # Beyond the length of a residue class the band holds no key; clipping keeps "window >= length" cheap.
        layout = band_layout(
            q_len=n_q,
            kv_len=n_k,
            window_left=min(window_left, class_len),
            window_right=min(window_right, class_len),
            dilation=d,
            block_size=c,
            q_offset=q_offset,
            device=device,
        )
        if fused:
            first_key = q_offset - min(window_left, class_len)
            plan = _BandPlan(
                layout=layout,
                local_fn=local_fn,
                mask_fn=mask_fn,
                heads=heads_t,
                global_index=global_index,
                global_valid=global_valid,
                scale=float(scale),
                first_key=first_key,
                plain=_plain_blocks(
                    layout, first_key, n_k, b, global_mask if global_index is not None else None, key_padding_mask
                )
                if exact_band
                else None,
                global_queries=global_index is not None and len(groups) == 1,
                q_offset=q_offset,
            )
            group_outputs.append(_BandAttention.apply(q_g, k_g, v_g, plan))
            group_heads.extend(heads)
            continue
        global_keys = None if global_index is None else (global_index, global_index, global_valid)
        out_g = band_block_attention(
            q_g,
            k_g,
            v_g,
            layout=layout,
            heads=heads_t,
            local_fn=local_fn,
            mask_fn=mask_fn,
            q_offset=q_offset,
            global_keys=global_keys,
            scale=scale,
            dropout_p=dropout_p,
            bias_fn=bias_fn,
        )
        group_outputs.append(out_g)
        group_heads.extend(heads)

    out = group_outputs[0] if len(group_outputs) == 1 else torch.cat(group_outputs, dim=1)
    if len(group_outputs) > 1:
        out = out.index_select(1, torch.tensor(group_heads, device=device).argsort())
    if global_index is not None and not (len(groups) == 1 and fused):  # else `_BandAttention` wrote their rows
        out = _global_queries(
            q, k, v, out, mask_fn, global_index, global_valid, q_offset, scale, dropout_p, bias_fn, bounded=bounded
        )
    return out


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
        # Every block also gathers its row's g global keys: one softmax over [band keys, global keys], no
        # second pass to merge. [b, nb, m + g]
        global_index, global_pos, global_valid = global_keys
        g = global_index.shape[1]
        kv_index = torch.cat([kv_index.expand(b, nb, -1), global_index[:, None, :].expand(b, nb, g)], dim=2)
        global_key_mask = evaluate_block_mask(
            mask_fn,
            batch=b,
            heads=heads,
            q_pos=q_pos,
            kv_pos=global_pos[:, None, :],
            q_valid=layout.q_valid[None],
            kv_valid=global_valid[:, None, :],
        )  # [b, 1|hg, nb, c, g]
        heads_dim = max(mask.shape[1], global_key_mask.shape[1])
        mask = torch.cat(
            [mask.expand(b, heads_dim, -1, -1, -1), global_key_mask.expand(b, heads_dim, -1, -1, -1)], dim=4
        )  # [b, 1|hg, nb, c, m + g]
        if bias is not None:
            global_bias = block_bias(bias_fn, batch=b, heads=heads, q_pos=q_pos, kv_pos=global_pos[:, None, :])
            bias = torch.cat([bias, global_bias], dim=4)  # [b, hg, nb, c, m + g]
    out_blocks, _ = attend_blocks(
        q_blocks, k, v, kv_index=kv_index, mask=mask, scale=scale, dropout_p=dropout_p, bias=bias
    )  # [b, hg, nb, c, d_v]
    out = out_blocks.reshape(b, hg, nb * c, -1)  # [b, hg, slots, d_v]
    return out[:, :, :n_q] if layout.slot_of_query is None else out.index_select(2, layout.slot_of_query)


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


# ------------------------------------------------------------------------------------------------ fused band path
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
    # instead of by `_global_queries` outside; q_offset is the position of the first query.
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
