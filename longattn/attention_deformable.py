"""Deformable attention (Zhu et al. 2021, "Deformable DETR") on sequences: the `"deformable"` kind.

Shape legend: b batch, h heads, n length, L levels, P points per level, S = L·P samples of a head, g_l cells of
level l, T = Σ_l g_l cells of all levels, d head dim, D hidden size.

A query does not compare itself with keys: it reads the values at a few learned fractional positions around its
reference point, on several scales (the seed's multi-scale deformable attention, in 1-D):

    out_q = o_proj( concat_h  Σ_l Σ_p  A[h, q, l, p] · V_{h,l}( ref_l(q) + Δ[h, q, l, p] ) )

- Levels: level l (0 .. L-1) is the value sequence average-pooled over groups of 2^l tokens, so level 0 is the
  tokens themselves (the seed's feature maps at strides 8 .. 64, here strides 1 .. 2^(L-1)). The values are pooled
  after `v_proj`, which equals pooling the hidden states first: `v_proj` is affine and the average weights sum to 1.
- Offsets Δ and logits of A are linear in the query token's hidden state (`offset_proj`, `weight_proj`: the seed's
  W'' z_q and W''' z_q). A is ONE softmax per head over all L·P samples, levels and points together (Deformable
  DETR's normalisation), so the levels compete for the query's attention.
- Reference point: queries live on the finest level; token i's centre (i + 0.5) in level-l cells, minus 0.5 (cell j's
  centre is at j), ref_l(i) = (i + 0.5) / 2^l - 0.5. Offsets are in cells of their level (Deformable DETR normalises
  each level's offsets by that level's size).
- V_{h,l}(x): linear interpolation between cells floor(x) and floor(x) + 1, with weights 1 - frac(x) and frac(x), the
  hat function max(0, 1 - |x - j|) over cells j. A cell outside the row's real cells reads zero (grid_sample's zero
  padding in Deformable DETR): the weight of a padded or out-of-range neighbour is zero, so padding is never sampled.
- Padding: positions are counted over real tokens (as the model's position ids) and the real tokens are packed to the
  front before pooling; a group averages only its real tokens (the row's last group may hold fewer than 2^l). A padded
  row therefore gives its real tokens the outputs of the same row without padding, left or right padded.

There are no keys: q·k is never computed, so the kind builds no `q_proj` / `k_proj` and takes no rotary
embedding (relative offsets around a reference point carry the position; learned absolute positions enter through
the hidden states the offsets are read from).

Cost: O(n · L · P · d) for the samples, plus the O(n · D · h · L · P) offset and weight projections; the fast
path never builds an `[n, n]` tensor. In training it keeps only v, the offsets and the weights for backward
(O(n · d) and O(n · h · L · P)); backward pools the levels again and recomputes the neighbours, interpolation
weights and gathered cells one chunk of queries at a time (`_Sampling`).
The dense form (`output_attentions=True`, the "reference" back end) makes the linear map explicit, `[b, h, n, n]`,
with the hat-function interpolation matrix and the pooling matrix of each level.

No causal form: a pooled cell averages later tokens, and interpolation reads cell floor(x) + 1, which may lie in the
future. A decoder use is refused when the config is validated.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn
from transformers import initialization as init

from .attention_base import LongAttnAttention
from .attention_reduction import pack_groups
from .numerics import compute_dtype


def level_ratios(levels: int) -> list[int]:
    """Tokens per cell of each level: 1, 2, 4, ..., 2^(levels-1)."""
    return [2**level for level in range(levels)]


def real_lengths(key_padding_mask: Tensor | None, batch: int, n: int, device: torch.device) -> Tensor:
    """Real tokens per row, long `[b]`."""
    if key_padding_mask is None:
        return torch.full((batch,), n, dtype=torch.long, device=device)
    return key_padding_mask.sum(-1)


def token_positions(key_padding_mask: Tensor | None, batch: int, n: int, device: torch.device) -> Tensor:
    """Each token's position counted over real tokens (padded tokens: that of the real token before, or 0), `[b, n]`."""
    if key_padding_mask is None:
        return torch.arange(n, device=device).expand(batch, n)
    return (key_padding_mask.long().cumsum(-1) - 1).clamp(min=0)


def _packed(v: Tensor, key_padding_mask: Tensor | None) -> Tensor:
    """`[b, h, n, d]` with each row's real tokens packed to the front in order, zeros after (v itself if no mask)."""
    if key_padding_mask is None:
        return v
    return pack_groups(v.transpose(1, 2), key_padding_mask, 1)[0][:, :, 0].transpose(1, 2)


def _counts(length: Tensor, g: int, ratio: int) -> Tensor:
    """Real tokens in each of the g cells of `ratio` tokens, `[b, g]` (a row's last cell may hold fewer)."""
    return (length[:, None] - torch.arange(g, device=length.device) * ratio).clamp(0, ratio)


def pool_levels(v: Tensor, key_padding_mask: Tensor | None, levels: int) -> tuple[Tensor, list[int]]:
    """The value pyramid: level l averages groups of 2^l real tokens, packed to the front of the row.

    Built level from level (each level's sums are the pairwise sums of the one below), written into one tensor:
    O(n · d) work and no per-level copy of the tokens.

    Args:
        v: `[b, h, n, d]` per-token values.
        key_padding_mask: Bool `[b, n]`, True = real token; None = all real.
        levels: L.

    Returns:
        `(cells, sizes)`: the levels' cells concatenated, `[b, h, T, d]` (cells past a row's real cells are zero);
        sizes `[g_0, ..., g_{L-1}]`, g_l = ceil(n / 2^l).
    """
    b, h, n, d = v.shape
    tokens = _packed(v, key_padding_mask)  # [b, h, n, d], real tokens first, zeros after
    length = real_lengths(key_padding_mask, b, n, v.device)
    sizes = [-(-n // ratio) for ratio in level_ratios(levels)]
    cells = v.new_zeros(b, h, sum(sizes), d)
    cells[:, :, :n] = tokens  # level 0: the tokens themselves
    sums, start = tokens.to(compute_dtype(v.dtype)), n
    for g, ratio in zip(sizes[1:], level_ratios(levels)[1:], strict=True):
        if sums.shape[2] % 2:
            sums = nn.functional.pad(sums, (0, 0, 0, 1))
        sums = sums.unflatten(2, (sums.shape[2] // 2, 2)).sum(3)  # [b, h, g, d]
        # A group averages its real tokens only; a group without any (past the row's end) stays zero.
        cells[:, :, start : start + g] = sums / _counts(length, g, ratio).clamp(min=1)[:, None, :, None]
        start += g
    return cells, sizes


def _unpool_levels(grad_cells: Tensor, key_padding_mask: Tensor | None, sizes: list[int]) -> Tensor:
    """The adjoint of `pool_levels`: the gradient of the cells `[b, h, T, d]` (overwritten) taken back to the
    values -> `[b, h, n, d]`. A cell is the sum of its packed tokens over its count, so a packed token receives the
    sum over the cells above it of their gradient over their count: from the top level down, each level adds its
    parent's share repeated twice; then the packed slots go back to their tokens (padding receives nothing)."""
    b, h, _, d = grad_cells.shape
    n = sizes[0]
    length = real_lengths(key_padding_mask, b, n, grad_cells.device)
    share = grad_cells.split(sizes, 2)  # views, level 0 first
    for level in range(1, len(sizes)):  # every share over its own count first, then passed down
        share[level].div_(_counts(length, sizes[level], 2**level).clamp(min=1)[:, None, :, None])
    for level in range(len(sizes) - 1, 0, -1):
        share[level - 1].add_(share[level].repeat_interleave(2, 2)[:, :, : sizes[level - 1]])
    if key_padding_mask is None:
        return share[0]
    slot = (key_padding_mask.long().cumsum(-1) - 1).clamp(min=0)  # [b, n]: the packed slot of each real token
    grad = share[0].gather(2, slot[:, None, :, None].expand(b, h, n, d))
    return grad * key_padding_mask[:, None, :, None]


def sampling_positions(offsets: Tensor, query_positions: Tensor) -> Tensor:
    """Fractional sampling positions in the cells of each level: ref_l(i) + Δ, `[b, h, n, L, P]`.

    Args:
        offsets: `[b, h, n, L, P]` in cells of each level, in the compute dtype (float32 for half inputs: a bf16
            position cannot tell 1000.25 from 1000).
        query_positions: Long `[b, n]`, each query's position counted over real tokens.
    """
    ratios = torch.tensor(level_ratios(offsets.shape[3]), dtype=offsets.dtype, device=offsets.device)  # [L]
    reference = (query_positions[:, None, :, None].to(offsets.dtype) + 0.5) / ratios - 0.5  # [b, 1, n, L]
    return reference[..., None] + offsets


def real_cells(key_padding_mask: Tensor | None, batch: int, n: int, levels: int, device: torch.device) -> Tensor:
    """Cells of each level holding a real token, long `[b, L]`: ceil(real length / 2^l)."""
    length = real_lengths(key_padding_mask, batch, n, device)
    ratios = torch.tensor(level_ratios(levels), device=device)
    return torch.div(length[:, None] + ratios - 1, ratios, rounding_mode="floor")


# Samples (rows x heads x queries x 2·L·P neighbours) per chunk of the training path: its gathered cells
# `[samples, d]` and their gradients are about 4 MB each at d = 64, recomputed chunk by chunk in backward.
_CHUNK_SAMPLES = 2**14


def _neighbours(offsets: Tensor, probs: Tensor, positions: Tensor, limit: Tensor, sizes: list[int]):
    """The two cells each sample reads and their coefficients, for a slice of the queries.

    Args:
        offsets, probs: `[b, h, q, L, P]` (compute dtype).
        positions: Long `[b, q]`, the queries' positions counted over real tokens.
        limit: Long `[b, L]`, each level's real cells (`real_cells`).
        sizes: Cells of each level.

    Returns:
        (index `[b, h, q, L, P, 2]` into the levels' concatenated cells; weight `[b, h, q, L, P, 2]`, the
        interpolation weights; inside `[b, h, q, L, P, 2]` bool, the neighbour is a real cell).
    """
    position = sampling_positions(offsets, positions)  # [b, h, q, L, P]
    # Interpolation has kinks at integers: floor carries no gradient, the fraction carries it to the offsets.
    left = position.detach().floor()
    frac = position - left
    neighbour = torch.stack((left, left + 1), dim=-1).long()  # [b, h, q, L, P, 2]
    weight = torch.stack((1 - frac, frac), dim=-1)  # [b, h, q, L, P, 2]
    # A neighbour outside the row's real cells reads zero: its weight is dropped, its index clamped into range.
    inside = (neighbour >= 0) & (neighbour < limit[:, None, None, :, None, None])
    size = torch.tensor(sizes, device=offsets.device)[:, None, None]  # [L, 1, 1]
    start = size.cumsum(0) - size  # [L, 1, 1]: first cell of each level in the concatenation
    return start + torch.minimum(neighbour.clamp(min=0), size - 1), weight, inside


def _read(cells: Tensor, index: Tensor, coef: Tensor) -> Tensor:
    """Σ over each query's 2·L·P neighbours of coef · cell: cells `[b, h, T, d]`, index and coef
    `[b, h, q, L, P, 2]` -> `[b, h, q, d]`.

    One weighted bag of cells per (row, head, query): embedding_bag sums them without materialising the
    `[b, h, q, 2·L·P, d]` samples (several times faster than gather + matmul on CPU). Sizes spelled out, no -1: a
    view of an empty tensor (batch or length 0) cannot infer one."""
    b, h, total, d = cells.shape
    q, s2 = index.shape[2], index.shape[3] * index.shape[4] * index.shape[5]
    row = (torch.arange(b * h, device=cells.device) * total).view(b, h, 1, 1, 1, 1)  # first cell of each (row, head)
    out = nn.functional.embedding_bag(
        (index + row).reshape(b * h * q, s2),
        cells.reshape(b * h * total, d),
        per_sample_weights=coef.reshape(b * h * q, s2),
        mode="sum",
    )
    return out.view(b, h, q, d)


class _Sampling(torch.autograd.Function):
    """`deformable_attention` in training: forward keeps only its inputs (v `[b, h, n, d]`, offsets and weights
    `[b, h, n, L, P]`); backward pools the levels again and recomputes each chunk of queries' neighbours,
    interpolation weights and gathered cells, so no per-sample tensor of all queries is ever kept."""

    @staticmethod
    def forward(ctx, v, offsets, probs, key_padding_mask):
        ctx.save_for_backward(v, offsets, probs, key_padding_mask)
        return _sample_chunks(v, offsets, probs, key_padding_mask)

    @staticmethod
    def backward(ctx, grad_out):
        v, offsets, probs, key_padding_mask = ctx.saved_tensors
        b, h, n, d = v.shape
        levels = offsets.shape[3]
        cells, sizes = pool_levels(v, key_padding_mask, levels)  # [b, h, T, d]
        positions = token_positions(key_padding_mask, b, n, v.device)
        limit = real_cells(key_padding_mask, b, n, levels, v.device)
        grad_cells = torch.zeros_like(cells).view(b * h * sum(sizes), d)
        grad_offsets, grad_probs = torch.zeros_like(offsets), torch.zeros_like(probs)
        row = (torch.arange(b * h, device=v.device) * sum(sizes)).view(b, h, 1, 1, 1, 1)
        flat = cells.view(b * h * sum(sizes), d)
        for rows in _query_chunks(offsets):
            index, weight, inside = _neighbours(
                offsets[:, :, rows], probs[:, :, rows], positions[:, rows], limit, sizes
            )
            index = (index + row).flatten(3)  # [b, h, q, S2]: rows of the flattened cells
            weight, inside = weight.flatten(3), inside.flatten(3)
            p = probs[:, :, rows, :, :, None].expand(*offsets[:, :, rows].shape, 2).flatten(3)  # [b, h, q, S2]
            coef = (p * weight * inside).to(v.dtype)
            go = grad_out[:, :, rows]  # [b, h, q, d]
            # out = Σ_s coef_s · cell_s: the cells receive coef · grad, each coefficient cell · grad.
            grad_cells.index_add_(0, index.flatten(), (coef[..., None] * go[:, :, :, None, :]).flatten(0, 3))
            grad_coef = flat[index].mul_(go[:, :, :, None, :]).sum(-1).to(probs.dtype) * inside  # [b, h, q, S2]
            grad_probs[:, :, rows] = (grad_coef * weight).unflatten(3, (*offsets.shape[3:], 2)).sum(-1)
            grad_weight = (grad_coef * p).unflatten(3, (*offsets.shape[3:], 2))  # [b, h, q, L, P, 2]
            grad_offsets[:, :, rows] = grad_weight[..., 1] - grad_weight[..., 0]  # weight = (1 - frac, frac)
        del cells, flat
        grad_v = _unpool_levels(grad_cells.view(b, h, sum(sizes), d), key_padding_mask, sizes)
        return grad_v, grad_offsets, grad_probs, None


def _query_chunks(offsets: Tensor) -> list[slice]:
    """Slices of the queries with about `_CHUNK_SAMPLES` neighbours each (offsets `[b, h, n, L, P]`)."""
    b, h, n, levels, points = offsets.shape
    step = max(1, _CHUNK_SAMPLES // max(1, b * h * 2 * levels * points))
    return [slice(start, min(n, start + step)) for start in range(0, n, step)]


def _sample_chunks(v: Tensor, offsets: Tensor, probs: Tensor, key_padding_mask: Tensor | None) -> Tensor:
    """`deformable_attention` without autograd, chunk by chunk of queries into one output `[b, h, n, d]`."""
    b, h, n, d = v.shape
    levels = offsets.shape[3]
    cells, sizes = pool_levels(v, key_padding_mask, levels)
    positions = token_positions(key_padding_mask, b, n, v.device)
    limit = real_cells(key_padding_mask, b, n, levels, v.device)
    out = v.new_empty(b, h, n, d)
    for rows in _query_chunks(offsets):
        index, weight, inside = _neighbours(offsets[:, :, rows], probs[:, :, rows], positions[:, rows], limit, sizes)
        coef = (probs[:, :, rows, :, :, None] * weight * inside).to(v.dtype)
        out[:, :, rows] = _read(cells, index, coef)
    return out


def deformable_attention(v: Tensor, offsets: Tensor, probs: Tensor, key_padding_mask: Tensor | None) -> Tensor:
    """The fast path: each query's L·P weighted samples, read by gathering two neighbouring cells per sample.

    In training (`_Sampling`) only v, offsets and probs are kept for backward, all O(n · d); under `torch.compile`
    autograd traces the plain computation.

    Args:
        v: `[b, h, n, d]` per-token values.
        offsets: `[b, h, n, L, P]`, in cells of each level (compute dtype).
        probs: `[b, h, n, L, P]`, the attention weights A (one softmax over L·P, after dropout).
        key_padding_mask: Bool `[b, n]`, True = real token; None = all real.

    Returns:
        `[b, h, n, d]`; never an `[n, n]` tensor, nor the `[b, h, n, 2·L·P, d]` samples.
    """
    if not torch.compiler.is_compiling():
        if torch.is_grad_enabled() and any(x.requires_grad for x in (v, offsets, probs)):
            return _Sampling.apply(v, offsets, probs, key_padding_mask)
        return _sample_chunks(v, offsets, probs, key_padding_mask)
    b, h, n, d = v.shape
    levels = offsets.shape[3]
    cells, sizes = pool_levels(v, key_padding_mask, levels)  # [b, h, T, d]
    positions = token_positions(key_padding_mask, b, n, v.device)
    index, weight, inside = _neighbours(
        offsets, probs, positions, real_cells(key_padding_mask, b, n, levels, v.device), sizes
    )
    return _read(cells, index, (probs[..., None] * weight * inside).to(v.dtype))


def deformable_weights(offsets: Tensor, probs: Tensor, key_padding_mask: Tensor | None, n: int) -> Tensor:
    """The dense form: the linear map from the per-token values to the output, `[b, h, n, n]` (O(n²): for tests,
    `output_attentions` and the "reference" back end).

    Σ_l Σ_p A[.., l, p] · hat_l[.., p, :] @ pool_l, with hat_l `[b, h, n, P, g_l]` = max(0, 1 - |x - j|) over the
    level's real cells j, and pool_l `[b, g_l, n]` the averaging matrix of real tokens into cells.

    Args:
        offsets, probs: `[b, h, n, L, P]` as for `deformable_attention`.
        key_padding_mask: Bool `[b, n]`, True = real token; None = all real.
        n: Tokens per row.
    """
    b, levels = offsets.shape[0], offsets.shape[3]
    device, dtype = offsets.device, probs.dtype
    positions = token_positions(key_padding_mask, b, n, device)  # [b, n]
    real = torch.ones(b, n, dtype=torch.bool, device=device) if key_padding_mask is None else key_padding_mask
    x = sampling_positions(offsets, positions).to(dtype)  # [b, h, n, L, P]
    limit = real_cells(key_padding_mask, b, n, levels, device)  # [b, L]
    weights = probs.new_zeros(b, offsets.shape[1], n, n)
    for level, ratio in enumerate(level_ratios(levels)):
        cell = torch.arange(-(-n // ratio), device=device)  # [g]
        hat = (1 - (x[:, :, :, level, :, None] - cell).abs()).clamp(min=0)  # [b, h, n, P, g]
        hat = hat * (cell < limit[:, level, None])[:, None, None, None, :]
        member = real[:, None, :] & (positions[:, None, :] // ratio == cell[None, :, None])  # [b, g, n]
        pool = member.to(dtype) / member.sum(-1, keepdim=True).clamp(min=1)  # [b, g, n]
        weights = weights + torch.einsum("bhnp,bhnpg,bgt->bhnt", probs[:, :, :, level], hat, pool)
    return weights


class DeformableAttention(LongAttnAttention):
    """The `"deformable"` kind: each query reads `deformable_points` interpolated samples on each of
    `deformable_levels` pooled levels, at offsets and with weights linear in its hidden state.

    Config fields:
        deformable_levels: L, levels of the value pyramid, level l pooling 2^l tokens per cell (int, or one per
            layer), default 4 (as Deformable DETR).
        deformable_points: P, samples per head and level (int, or one per layer), default 4 (as Deformable DETR).

    Parameters besides v_proj, o_proj (no q_proj / k_proj: there are no keys): `offset_proj` (Linear D -> h·L·P,
    the offsets) and `weight_proj` (Linear D -> h·L·P, the logits of A). As in Deformable DETR both start with zero
    weights: uniform A, and the points of head m starting at 1, 2, ..., P cells from the reference, to the right for
    even heads and to the left for odd ones (the 1-D form of DETR's one direction per head).

    `output_attentions=True` returns the linear map from the per-token values to the output, `[b, h, n, n]`
    (interpolation and pooling made explicit; rows sum to less than 1 where samples fall outside the row).

    Raises:
        ValueError: (at config time) a causal use, or levels / points below 1.
    """

    attention_type = "deformable"
    settings = ("levels", "points")

    def __init__(self, config: Any, *, layer_idx: int, is_causal: bool):
        super().__init__(config, layer_idx=layer_idx, is_causal=is_causal)
        self.q_proj = self.k_proj = None  # no keys, no q·k: every parameter the kind owns is trained
        samples = self.num_heads * self.levels * self.points
        self.offset_proj = nn.Linear(config.hidden_size, samples)
        self.weight_proj = nn.Linear(config.hidden_size, samples)
        self.reset_kind_parameters()

    @torch.no_grad()
    def reset_kind_parameters(self) -> None:
        """Deformable DETR's start: zero weights, uniform A, head m's points 1..P cells to its side of the reference."""
        init.zeros_(self.offset_proj.weight)
        init.zeros_(self.weight_proj.weight)
        init.zeros_(self.weight_proj.bias)
        # Deformable DETR points head m in direction 2πm/M at distances 1..P; a line has two directions.
        direction = 1.0 - 2.0 * (torch.arange(self.num_heads) % 2)  # [h]: +1, -1, +1, ...
        distance = torch.arange(1, self.points + 1, dtype=torch.float32)  # [P]
        start = (direction[:, None, None] * distance).expand(self.num_heads, self.levels, self.points)  # [h, L, P]
        init.copy_(self.offset_proj.bias, start.reshape(-1).to(self.offset_proj.bias))

    def sampling(self, hidden_states: Tensor) -> tuple[Tensor, Tensor]:
        """Offsets and attention weights from the query tokens `[b, n, D]`: each `[b, h, n, L, P]`, in the compute
        dtype; the weights after one softmax over L·P and (in training) dropout."""
        b, n, _ = hidden_states.shape
        dtype = compute_dtype(hidden_states.dtype)
        shape = (b, n, self.num_heads, self.levels, self.points)
        offsets = self.offset_proj(hidden_states).view(shape).transpose(1, 2).to(dtype)  # [b, h, n, L, P]
        # Sizes spelled out (no -1): a view of an empty tensor (batch or length 0) cannot infer one.
        logits = self.weight_proj(hidden_states).view(b, n, self.num_heads, self.levels * self.points)
        logits = logits.transpose(1, 2).to(dtype)
        probs = torch.softmax(logits, dim=-1)  # [b, h, n, L·P]: one softmax over every level and point
        if self.training and self.dropout_p > 0:
            probs = nn.functional.dropout(probs, p=self.dropout_p)
        return offsets, probs.view(b, self.num_heads, n, self.levels, self.points)

    def attention_inputs(self, hidden_states, *, key_padding_mask, position_embeddings):
        """No queries and no keys: the values `[b, h, n, d]` (returned as k too; the kind has no cache to fill)."""
        v = self.split_heads(self.v_proj(hidden_states))  # [b, h, n, d]
        return None, v, v

    def attend_inputs(self, q, k, v, *, hidden_states, key_padding_mask, global_mask, dense):
        """The samples of each query; with `dense`, through the explicit `[b, h, n, n]` map, returned as weights."""
        offsets, probs = self.sampling(hidden_states)
        if dense:
            weights = deformable_weights(offsets, probs, key_padding_mask, v.shape[2]).to(v.dtype)
            return weights @ v, weights
        return deformable_attention(v, offsets, probs, key_padding_mask), None
