"""Blocked attention over gathered key sets: `attend_blocks`, each block of queries attends to its own set of keys.

Shape legend: b batch, h heads, h_kv key/value heads (grouped-query attention: h_kv divides h, query head i reads
key/value head i // (h / h_kv)), n length (n_k keys), nb query blocks, c queries per block, m keys gathered per block
(m' of them by index after s own keys), d head dim (d_v for values).

`attend_blocks(q_blocks, k, v, kv_index=..., mask=...) -> (out, lse)` is the generic kernel of every "attend within a
gathered key set" kind: Sinkhorn's sorted blocks (Tay et al. 2020, "Sparse Sinkhorn Attention": a block's own keys
read in place, `own_keys`, then its sorted block, weighted by the sorting weight, `kv_weight`), dilated bands and
bands with global keys (`executor_blocked.band_block_attention`, also per context-parallel shard), global queries
over every key (`kv_index=None`). Block i of queries attends to the keys `kv_index[i]` (one key set for the batch, per
batch row, or per batch row and key/value head), restricted by a bool mask, with an optional additive bias
(relative-position logits).

Why a hand-written backward: autograd through the gathered keys would keep the `[nb, c, m]` scores, probabilities
and gathered copies of k and v of every block for backward, O(n · m) floats per head. `_BlockAttention` saves q, k,
v, the integer key sets and weights, and one bool per query row; a mask given as a tensor is kept as its repeated
block and the blocks that differ (`_RepeatedBlockMask`), a mask given as a function of the chunk
(`executor_chunks.block_mask`) is evaluated again in backward. Backward recomputes the probabilities chunk by chunk
in reused workspaces (`executor_chunks`), so peak memory does not grow with the length beyond the saved tensors.
Under `torch.compile` and `torch.export` the same function runs in plain differentiable ops
(`_attend_blocks_traceable`), whose memory the compiler plans.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from .executor_chunks import _Chunk, _mask_blocks_per_chunk, _rows, _split_heads, _Workspace, _zeros_with_rows
from .numerics import NO_KEY_LSE, compute_dtype, hide_logits, logit_bound


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
        step = _mask_blocks_per_chunk(b * h * c, m, nb)  # blocks per slice: bounded temporaries
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
        workspace = _Workspace(dtype, device, dropout_p=dropout_p, seed=seed)
        k_c, v_c = k.to(dtype), v.to(dtype)
        bound = None if mask is None else _weighted_bound(q_blocks, k, scale, bias, kv_weight)
        for chunk in _chunks(q_blocks, k_c, v_c, kv_index, mask, scale, workspace, kv_weight, own_keys):
            start, stop = chunk.start, chunk.stop
            probs = chunk.scores(_chunk_bias(bias, chunk, h_kv), workspace, bound)
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
                row_lse = row_lse.masked_fill(~chunk_has[..., 0], NO_KEY_LSE)
            lse6[:, :, :, start:stop] = row_lse
            workspace.drop(probs)
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
        nb, h_kv = q_blocks.shape[2], v.shape[1]
        dtype = compute_dtype(q_blocks.dtype)
        device = q_blocks.device
        if grad_lse is not None:
            grad_lse = grad_lse.to(dtype) if has_key is None else grad_lse.to(dtype) * has_key[..., 0]
            grad_lse = _split_heads(grad_lse.unsqueeze(-1), h_kv)  # [.., nb, c, 1]
        grad_q = torch.empty_like(q_blocks, dtype=dtype)
        grad_q6 = _split_heads(grad_q, h_kv)
        has_key6 = None if has_key is None else _split_heads(has_key, h_kv)
        grad_out6 = None if grad_out is None else _split_heads(grad_out, h_kv)
        grads = _KeyGradients(k, v, kv_weight, nb, own_keys, dtype, device)
        grad_bias = torch.empty(bias.shape, dtype=dtype, device=device) if ctx.needs_input_grad[9] else None
        workspace = _Workspace(dtype, device, dropout_p=dropout_p, seed=ctx.seed)

        for chunk in _chunks(q_blocks, k.to(dtype), v.to(dtype), kv_index, mask, scale, workspace, kv_weight, own_keys):
            start, stop = chunk.start, chunk.stop
            probs = chunk.scores(_chunk_bias(bias, chunk, h_kv), workspace, ctx.bound)
            torch.ops.aten._softmax.out(probs, -1, False, out=probs)
            grad_out_chunk = _chunk_grad_out(chunk, grad_out6, has_key6, workspace)
            grad_scores = workspace.get("grad_scores", chunk.scores_shape)
            torch.bmm(grad_out_chunk, chunk.values.transpose(1, 2), out=grad_scores)  # dP
            keep = workspace.drop(grad_scores)  # forward's mask, drawn again
            # P ∘ (dP − rowsum(P ∘ dP)); with dropout rowsum(P ∘ dP) is still rowsum(dO ∘ O).
            torch.ops.aten._softmax_backward_data.out(grad_scores, probs, -1, dtype, grad_input=grad_scores)
            if grad_lse is not None:
                chunk.view6(grad_scores).addcmul_(chunk.view6(probs), grad_lse[:, :, :, start:stop])
            if grad_bias is not None:  # the bias is added to the scores as they are: its gradient is dS
                _split_heads(grad_bias, h_kv)[:, :, :, start:stop] = chunk.view6(grad_scores)
            if keep is not None:
                probs.mul_(keep)  # dV needs the dropped probabilities, dS needed the undropped ones
            grad_values, grad_keys, grad_q_chunk = chunk.gradients(probs, grad_scores, grad_out_chunk, workspace)
            torch.mul(chunk.view6(grad_q_chunk), scale, out=grad_q6[:, :, :, start:stop])
            grads.add(chunk, kv_index, grad_keys, grad_values, workspace)

        return (
            grad_q.to(q_blocks.dtype),
            grads.k.to(k.dtype),
            grads.v.to(v.dtype),
            None,
            None,
            None,
            None,
            None,
            None if grads.weight is None else grads.weight.to(kv_weight.dtype),
            None if grad_bias is None else grad_bias.to(bias.dtype),
            None,
        )


def _chunk_grad_out(chunk: _Chunk, grad_out6: Tensor | None, has_key6: Tensor | None, workspace: _Workspace) -> Tensor:
    """The output gradient of a chunk's rows `[rows, queries, d_v]` in the "grad_out" workspace, from grad_out6
    `[b, h_kv, group, nb, c, d_v]` (None: zeros); rows without a visible key (has_key6 False) had their output
    zeroed, so their probabilities get no gradient."""
    grad_out_chunk = workspace.get("grad_out", chunk.out_shape)
    start, stop = chunk.start, chunk.stop
    if grad_out6 is None:
        grad_out_chunk.zero_()
    elif has_key6 is None:
        chunk.view6(grad_out_chunk).copy_(grad_out6[:, :, :, start:stop])
    else:
        torch.mul(grad_out6[:, :, :, start:stop], has_key6[:, :, :, start:stop], out=chunk.view6(grad_out_chunk))
    return grad_out_chunk


class _KeyGradients:
    """The key and value gradients of `_BlockAttention.backward`, zeros in the layouts of k and v (see
    `_zeros_with_rows`), and the gradient of `kv_weight`; `add` adds each chunk's to the rows it read."""

    def __init__(self, k: Tensor, v: Tensor, kv_weight: Tensor | None, nb: int, own_keys: int, dtype, device):
        self.k, self.k_view = _zeros_with_rows(k, dtype)
        self.v, self.v_view = _zeros_with_rows(v, dtype)
        # The blocks' own keys: [b, h_kv, nb, own_keys, d] views of the gradients, added to in place.
        self.own_keys = own_keys
        self.k_own, self.v_own = (_own_blocks(t, nb, own_keys) for t in (self.k, self.v))
        self.weight = None if kv_weight is None else torch.empty(kv_weight.shape, dtype=dtype, device=device)

    def add(self, chunk: _Chunk, kv_index: Tensor | None, grad_keys: Tensor, grad_values: Tensor, workspace) -> None:
        """Add the gradients `[rows, m, d]` of the keys and values a chunk attended to: all keys in place, own keys
        block by block, gathered ones scatter-added to their rows (unweighted, `_gathered_gradients`)."""
        b, h_kv, _, d = self.k.shape
        d_v = self.v.shape[3]
        start, stop = chunk.start, chunk.stop
        if kv_index is None:
            self.k.add_(grad_keys.view(b, h_kv, -1, d))
            self.v.add_(grad_values.view(b, h_kv, -1, d_v))
            return
        if self.own_keys:
            own, n_blk = self.own_keys, stop - start
            self.k_own[:, :, start:stop] += grad_keys.view(b, h_kv, n_blk, -1, d)[:, :, :, :own]
            self.v_own[:, :, start:stop] += grad_values.view(b, h_kv, n_blk, -1, d_v)[:, :, :, :own]
        grad_keys, grad_values = _gathered_gradients(chunk, grad_keys, grad_values, self.weight, workspace)
        for view, grad, width in ((self.k_view, grad_keys, d), (self.v_view, grad_values, d_v)):
            view.flat.index_add_(0, view.index(kv_index, start, stop), grad.reshape(-1, width))


def _own_blocks(t: Tensor, nb: int, own_keys: int) -> Tensor | None:
    """The first nb · own_keys positions of t `[b, h, n, d]` as `[b, h, nb, own_keys, d]` (a view), or None."""
    return t[:, :, : nb * own_keys].unflatten(2, (nb, own_keys)) if own_keys else None


def _chunk_bias(bias: Tensor | None, chunk: _Chunk, h_kv: int) -> Tensor | None:
    """The chunk's blocks of a bias `[b, h, nb, c, m]` in the layout of `chunk.view6` (None without a bias)."""
    return None if bias is None else _split_heads(bias[:, :, chunk.start : chunk.stop], h_kv)


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
    step = _Workspace.blocks_per_chunk(_elements_per_block(q_blocks, k, v, kv_index, kv_weight, own_keys), nb)
    if kv_index is None:
        all_keys, all_values = k.reshape(b * h_kv, n_k, d), v.reshape(b * h_kv, n_k, d_v)  # views, usual layouts
    else:
        k_view, v_view = _rows(k), _rows(v)
        own = (_own_blocks(k, nb, own_keys), _own_blocks(v, nb, own_keys)) if own_keys else None
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
            k_view.flat, 0, k_view.index(kv_index, start, stop),
            out=workspace.get("keys" if plain else "gathered_keys", (count, d)),
        ).view(batches, gathered, d)  # fmt: skip
        gathered_values = torch.index_select(
            v_view.flat, 0, v_view.index(kv_index, start, stop),
            out=workspace.get("values" if plain else "gathered_values", (count, d_v)),
        ).view(batches, gathered, d_v)  # fmt: skip
        if plain:
            yield _Chunk(
                start, stop, q_scaled.view(batches, group * c, d), gathered_keys, gathered_values, hidden, shape6
            )
            continue
        keys, values, weight = _own_and_weighted(gathered_keys, gathered_values, own, kv_weight, start, stop, workspace)
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


def _elements_per_block(q_blocks: Tensor, k: Tensor, v: Tensor, kv_index, kv_weight, own_keys: int) -> int:
    """Workspace elements of one query block in `_chunks`: scores and their gradient, the queries, output and query
    gradients, and (gathered) keys and values with their gradients, plus the gathered rows before weighting and their
    products with `kv_weight`."""
    b, h, _, c, d = q_blocks.shape
    h_kv, width = k.shape[1], max(d, v.shape[3])
    gathered = 0 if kv_index is None else kv_index.shape[-1]
    m = k.shape[2] if kv_index is None else own_keys + gathered
    per_block = 2 * b * h * c * m + 4 * b * h * c * width
    if kv_index is not None:
        per_block += 4 * b * h_kv * m * width
        if kv_weight is not None or own_keys:
            per_block += 3 * b * h_kv * gathered * width
    return per_block


def _own_and_weighted(
    gathered_keys: Tensor,
    gathered_values: Tensor,
    own: tuple[Tensor, Tensor] | None,
    kv_weight: Tensor | None,
    start: int,
    stop: int,
    workspace: _Workspace,
) -> tuple[Tensor, Tensor, Tensor | None]:
    """The keys and values `[batches, m, d]` that blocks start:stop attend to, in the "keys" and "values" workspaces:
    each block's own keys copied block by block from k (no index; `own` holds the `_own_blocks` of k and v, None
    without own keys), then its gathered rows `[batches, m', d]`, weighted where they have weights; and those weights
    `[batches, m' | 1, 1]` (None without `kv_weight`)."""
    batches, gathered, d = gathered_keys.shape
    d_v = gathered_values.shape[2]
    own_keys = 0 if own is None else own[0].shape[3]
    m = own_keys + gathered
    keys, values = workspace.get("keys", (batches, m, d)), workspace.get("values", (batches, m, d_v))
    if own is not None:
        (b, h_kv), (k_own, v_own) = own[0].shape[:2], own
        keys.view(b, h_kv, -1, m, d)[:, :, :, :own_keys] = k_own[:, :, start:stop]
        values.view(b, h_kv, -1, m, d_v)[:, :, :, :own_keys] = v_own[:, :, start:stop]
    weight = None
    if kv_weight is None:
        keys[:, own_keys:] = gathered_keys
        values[:, own_keys:] = gathered_values
    else:
        weight = kv_weight[:, :, start:stop].reshape(batches, -1, 1).to(keys.dtype)  # [batches, m − own | 1, 1]
        torch.mul(gathered_keys, weight, out=keys[:, own_keys:])
        torch.mul(gathered_values, weight, out=values[:, own_keys:])
    return keys, values, weight


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
    _check_blocks(q_blocks, k, v, kv_index, mask, dropout_p, kv_weight, bias, own_keys)
    arguments = (q_blocks, k, v, kv_index, mask, float(scale), float(dropout_p))
    if torch.compiler.is_compiling():
        return _attend_blocks_traceable(*arguments, kv_weight=kv_weight, bias=bias, own_keys=own_keys)
    seed = int(torch.randint(0, 2**62, (), device="cpu")) if dropout_p > 0 else 0
    return _BlockAttention.apply(*arguments, seed, kv_weight, bias, own_keys)


def _check_blocks(q_blocks, k, v, kv_index, mask, dropout_p, kv_weight, bias, own_keys) -> None:
    """Raise ValueError unless the arguments of `attend_blocks` have the shapes it documents."""
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
    return (out * has_key[..., None]).to(q_blocks.dtype), lse.masked_fill(~has_key, NO_KEY_LSE)
