"""Sequence-reduction attention: spatial-reduction attention (Wang et al. 2021, PVT) for 1-D sequences.

Shape legend: b batch, h heads, n length, g reduced length ceil(n / R), d head dim, D hidden size.

PVT shortens the keys and values before attention: SR(x) = LayerNorm(Reshape(x, R) W_S), where Reshape joins R
consecutive tokens into one vector of R·D numbers and W_S projects it back to D. Then

    head_i = Attention(Q W_i^Q, SR(X) W_i^K, SR(X) W_i^V)

so each of the n queries sees g = ceil(n / R) reduced keys: O(n · n / R) time and memory. (PVT reduces a 2-D map by
R along each side, R² tokens per key; on a sequence one group is R tokens.)

Padding is handled inside each group: real tokens are packed by their position counted over real tokens (the
model's position ids) and a group's missing slots are zeros, so padding never shifts the grouping; groups without a
real token are masked keys. A reduced key takes the rotary position of its group's first token.
Every group mixes R consecutive tokens, so a key would leak later tokens to earlier queries: the kind has no causal
form, and a causal (decoder) use is refused when the config is validated.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .attention_base import LongAttnAttention
from .numerics import rotate
from .ops import full_attention, reference_attention
from .ops_checks import check_positive_int, check_token_mask


def pack_groups(
    x: torch.Tensor, key_padding_mask: torch.Tensor | None, ratio: int
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Real tokens packed in order into groups of `ratio` slots, missing slots zero.

    Args:
        x: `[b, n, ...]` per-token features.
        key_padding_mask: Bool `[b, n]`, True = real token; None = all real.
        ratio: Tokens per group R.

    Returns:
        `(groups, group_valid)`: groups `[b, g, R, ...]`; group_valid bool `[b, g]` (a group holds a real token), or
        None when every group of every row does.

    Raises:
        ValueError: `x` is not a tensor of at least 2 dims, `ratio` is not an int >= 1, or `key_padding_mask` is not
            a bool `[b, n]` tensor on x's device.
    """
    if not isinstance(x, torch.Tensor) or x.dim() < 2:
        raise ValueError(f"x must be a tensor [batch, length, ...], got {getattr(x, 'shape', type(x).__name__)}")
    ratio = check_positive_int("ratio", ratio, meaning="tokens per group")
    b, n = x.shape[:2]
    key_padding_mask = check_token_mask("key_padding_mask", key_padding_mask, b, n, device=x.device)
    g = -(-n // ratio)
    if key_padding_mask is None:
        padded = nn.functional.pad(x, (0, 0) * (x.dim() - 2) + (0, g * ratio - n))
        return padded.view(b, g, ratio, *x.shape[2:]), None
    positions = key_padding_mask.long().cumsum(-1) - 1  # [b, n]: slot of each real token
    # Padding tokens go to one extra slot past the end, which is dropped.
    slot = torch.where(key_padding_mask, positions, torch.full_like(positions, g * ratio))
    index = slot.view(b, n, *([1] * (x.dim() - 2))).expand_as(x)
    packed = x.new_zeros(b, g * ratio + 1, *x.shape[2:]).scatter(1, index, x)[:, : g * ratio]
    return packed.view(b, g, ratio, *x.shape[2:]), valid_groups(key_padding_mask, g, ratio)


def valid_groups(key_padding_mask: torch.Tensor, groups: int, ratio: int) -> torch.Tensor:
    """Bool `[b, g]`: the groups of `pack_groups` that hold a real token (real tokens fill the leading slots)."""
    return torch.arange(groups, device=key_padding_mask.device) * ratio < key_padding_mask.sum(-1, keepdim=True)


class ReductionAttention(LongAttnAttention):
    """The `"reduction"` kind: queries over keys and values of the sequence shortened by `reduction_ratio`.

    Config fields:
        reduction_ratio: Tokens per reduced key R (int, or one per layer), default 8. R = 1 is full attention
            (no reduction layers, as in PVT).

    Parameters besides q/k/v/o_proj (R > 1): `reduction_proj` (Linear R·D -> D, the W_S of PVT) and
    `reduction_norm` (LayerNorm).

    `output_attentions=True` returns the weights over the reduced keys, `[b, h, n, g]` (there are no per-token
    weights: every reduced key mixes R tokens).

    Raises:
        ValueError: (at config time) a causal use, or a ratio below 1.
    """

    attention_type = "reduction"
    settings = ("ratio",)

    def __init__(self, config: Any, *, layer_idx: int, is_causal: bool):
        super().__init__(config, layer_idx=layer_idx, is_causal=is_causal)
        if self.ratio > 1:
            self.reduction_proj = nn.Linear(self.ratio * config.hidden_size, config.hidden_size)
            self.reduction_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        else:
            self.reduction_proj = self.reduction_norm = None

    def attend(self, q, k, v, *, key_padding_mask, global_mask):
        """R = 1: no reduction, plain dense attention (the path `attend_inputs` takes only then)."""
        return full_attention(
            q,
            k,
            v,
            key_padding_mask=key_padding_mask,
            **self.layer_arguments("scale", "dropout_p"),
        )

    def used_ratio(self, n: int) -> int:
        """The group length a sequence of n tokens uses: R, or n when R > n (its one group holds zeros past the n
        tokens, which the projection's columns for them would only multiply by zero: they are not read)."""
        return max(1, min(self.ratio, n))

    def reduce(
        self, hidden_states: torch.Tensor, key_padding_mask: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """SR(x) = LayerNorm(Reshape(x, R) W_S): `[b, n, D]` -> (`[b, g, D]`, group_valid `[b, g]` or None)."""
        ratio = self.used_ratio(hidden_states.shape[1])
        groups, group_valid = pack_groups(hidden_states, key_padding_mask, ratio)  # [b, g, R, D]
        b, g = groups.shape[:2]
        # [b, g, R·D], sizes spelled out: a reshape of an empty tensor (batch or length 0) cannot infer a -1.
        flat = groups.reshape(b, g, groups.shape[2:].numel())
        if ratio == self.ratio:
            return self.reduction_norm(self.reduction_proj(flat)), group_valid
        # One group shorter than R: the leading columns of W_S (those of the slots it fills).
        weight = self.reduction_proj.weight[:, : flat.shape[-1]]
        return self.reduction_norm(nn.functional.linear(flat, weight, self.reduction_proj.bias)), group_valid

    def attention_inputs(self, hidden_states, *, key_padding_mask, position_embeddings):
        """Queries per token, keys and values per group: q `[b, h, n, d]`, k, v `[b, h, g, d]` (R = 1: per token)."""
        if self.ratio == 1:
            return super().attention_inputs(
                hidden_states, key_padding_mask=key_padding_mask, position_embeddings=position_embeddings
            )
        q = self.split_heads(self.q_proj(hidden_states))  # [b, h, n, d]
        reduced, _ = self.reduce(hidden_states, key_padding_mask)  # [b, g, D]
        k = self.split_heads(self.k_proj(reduced))  # [b, h, g, d]
        v = self.split_heads(self.v_proj(reduced))
        if position_embeddings is not None:
            cos, sin = position_embeddings  # [b, n, d]
            q = _rotate(q, cos, sin)
            # The rotary position of a reduced key: that of its group's first (real) token.
            ratio = self.used_ratio(hidden_states.shape[1])
            cos_groups, _ = pack_groups(cos, key_padding_mask, ratio)  # [b, g, R, d]
            sin_groups, _ = pack_groups(sin, key_padding_mask, ratio)
            k = _rotate(k, cos_groups[:, :, 0], sin_groups[:, :, 0])
        return q, k, v

    def attend_inputs(self, q, k, v, *, hidden_states, key_padding_mask, global_mask, dense):
        """The n queries over the g reduced keys; with `dense`, the weights over the reduced keys `[b, h, n, g]`."""
        if self.ratio == 1:
            return super().attend_inputs(
                q,
                k,
                v,
                hidden_states=hidden_states,
                key_padding_mask=key_padding_mask,
                global_mask=global_mask,
                dense=dense,
            )
        ratio = self.used_ratio(hidden_states.shape[1])
        group_valid = None if key_padding_mask is None else valid_groups(key_padding_mask, k.shape[2], ratio)
        dropout_p = self.active_dropout_p
        if dense:
            mask = None if group_valid is None else group_valid[:, None, None, :]
            return reference_attention(q, k, v, mask, scale=self.scale, dropout_p=dropout_p, return_weights=True)
        return _attend_reduced(q, k, v, group_valid, scale=self.scale, dropout_p=dropout_p), None


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of `x` `[b, h, n, d]` with cos, sin `[b, n, d]`."""
    cos, sin = cos.unsqueeze(1).to(x.dtype), sin.unsqueeze(1).to(x.dtype)
    return rotate(x, cos, sin)


def _attend_reduced(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    group_valid: torch.Tensor | None,
    *,
    scale: float,
    dropout_p: float,
) -> torch.Tensor:
    """Dense SDPA of n queries over g reduced keys (g < n, so not the ops' "queries are the last keys" layout)."""
    if group_valid is None:
        return nn.functional.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, scale=scale)
    # A row without any real group (a fully padded row) would be NaN in SDPA: let it see every group, then zero it.
    has_keys = group_valid.any(dim=-1)[:, None, None, None]  # [b, 1, 1, 1]
    mask = group_valid[:, None, None, :] | ~has_keys  # [b, 1, 1, g]
    out = nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, scale=scale)
    return out.masked_fill(~has_keys, 0.0)
