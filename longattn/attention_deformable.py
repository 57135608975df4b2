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
path never builds an `[n, n]` tensor. The dense form (`output_attentions=True`, the "reference" back end) makes the
linear map explicit, `[b, h, n, n]`, with the hat-function interpolation matrix and the pooling matrix of each level.

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


def pool_levels(v: Tensor, key_padding_mask: Tensor | None, levels: int) -> tuple[Tensor, list[int]]:
    """The value pyramid: level l averages groups of 2^l real tokens, packed to the front of the row.

    Args:
        v: `[b, h, n, d]` per-token values.
        key_padding_mask: Bool `[b, n]`, True = real token; None = all real.
        levels: L.

    Returns:
        `(cells, sizes)`: the levels' cells concatenated, `[b, h, T, d]` (cells past a row's real cells are zero);
        sizes `[g_0, ..., g_{L-1}]`, g_l = ceil(n / 2^l).
    """
    b, h, n, d = v.shape
    tokens = pack_groups(v.transpose(1, 2), key_padding_mask, 1)[0][:, :, 0]  # [b, n, h, d], real tokens first
    length = real_lengths(key_padding_mask, b, n, v.device)
    pooled, sizes = [], []
    for ratio in level_ratios(levels):
        g = -(-n // ratio)
        groups = nn.functional.pad(tokens, (0, 0, 0, 0, 0, g * ratio - n)).view(b, g, ratio, h, d)
        # A group averages its real tokens only; a group without any (past the row's end) stays zero.
        count = (length[:, None] - torch.arange(g, device=v.device) * ratio).clamp(0, ratio)  # [b, g]
        mean = groups.sum(2) / count.clamp(min=1)[:, :, None, None].to(v.dtype)  # [b, g, h, d]
        pooled.append(mean.transpose(1, 2))  # [b, h, g, d]
        sizes.append(g)
    return torch.cat(pooled, dim=2), sizes


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


def deformable_attention(v: Tensor, offsets: Tensor, probs: Tensor, key_padding_mask: Tensor | None) -> Tensor:
    """The fast path: each query's L·P weighted samples, read by gathering two neighbouring cells per sample.

    Args:
        v: `[b, h, n, d]` per-token values.
        offsets: `[b, h, n, L, P]`, in cells of each level (compute dtype).
        probs: `[b, h, n, L, P]`, the attention weights A (one softmax over L·P, after dropout).
        key_padding_mask: Bool `[b, n]`, True = real token; None = all real.

    Returns:
        `[b, h, n, d]`; never an `[n, n]` tensor, nor the `[b, h, n, 2·L·P, d]` samples.
    """
    b, h, n, d = v.shape
    levels = offsets.shape[3]
    cells, sizes = pool_levels(v, key_padding_mask, levels)  # [b, h, T, d]
    position = sampling_positions(offsets, token_positions(key_padding_mask, b, n, v.device))  # [b, h, n, L, P]
    # Interpolation has kinks at integers: floor carries no gradient, the fraction carries it to the offsets.
    left = position.detach().floor()
    frac = position - left
    neighbour = torch.stack((left, left + 1), dim=-1).long()  # [b, h, n, L, P, 2]
    weight = torch.stack((1 - frac, frac), dim=-1)  # [b, h, n, L, P, 2]
    # A neighbour outside the row's real cells reads zero: its weight is dropped, its index clamped into range.
    limit = real_cells(key_padding_mask, b, n, levels, v.device)[:, None, None, :, None, None]  # [b, 1, 1, L, 1, 1]
    inside = (neighbour >= 0) & (neighbour < limit)
    size = torch.tensor(sizes, device=v.device)[:, None, None]  # [L, 1, 1]
    start = size.cumsum(0) - size  # [L, 1, 1]: first cell of each level in the concatenation
    index = start + torch.minimum(neighbour.clamp(min=0), size - 1)  # [b, h, n, L, P, 2]
    coef = (probs[..., None] * weight * inside).to(v.dtype)  # [b, h, n, L, P, 2]
    # One weighted bag of 2·L·P cells per (row, head, query): embedding_bag sums them without materialising the
    # `[b, h, n, 2·L·P, d]` samples (several times faster than gather + matmul on CPU). Sizes spelled out, no -1:
    # a view of an empty tensor (batch or length 0) cannot infer one.
    s2, total = 2 * offsets.shape[3] * offsets.shape[4], sum(sizes)
    row = (torch.arange(b * h, device=v.device) * total).view(b, h, 1, 1, 1, 1)  # first cell of each (row, head)
    out = nn.functional.embedding_bag(
        (index + row).view(b * h * n, s2),
        cells.reshape(b * h * total, d),
        per_sample_weights=coef.view(b * h * n, s2),
        mode="sum",
    )
    return out.view(b, h, n, d)


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
