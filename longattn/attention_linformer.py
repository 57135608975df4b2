"""Linformer (Wang et al. 2020, "Linformer: Self-Attention with Linear Complexity"): the `"linformer"` kind.

Shape legend: b batch, h heads (H: heads that own a projection, h or 1), n length, k projected length, d head dim,
L `max_position_embeddings`.

Multi-head linear attention projects keys and values along the length before scaled dot-product attention:

    head_i = softmax(Q_i (E_iᵀ K_i)ᵀ / sqrt(d)) · (F_iᵀ V_i),      E_i, F_i: [n, k]

so the score matrix is `[n, k]` instead of `[n, n]`: O(n · k) time and memory. (The paper writes E_i K_i with
E_i `[k, n]`; the matrices here are stored transposed, `[L, k]`, so that a shorter input uses their leading rows.)

- E and F are learned for the model's maximum length L; an input of n tokens uses rows 0..n-1. Rows are indexed by
  the position of each token counted over real tokens, so left padding does not shift them.
- Padded keys and values are zeroed *before* the projection, so padded tokens contribute nothing to any projected
  key or value.
- `linformer_sharing` picks the paper's parameter sharing (Section 4): `"none"` (E_i, F_i per head),
  `"headwise"` (one E and one F per layer), `"key_value"` (one E per layer, used for keys and values),
  `"layerwise"` (one E for every Linformer layer of the stack, keys and values).
- Projecting the length mixes all positions, so a query would see the future: Linformer has no causal form and a
  causal (decoder) use is refused when the config is validated.
"""

from __future__ import annotations

import math
import weakref
from typing import Any

import torch
from torch import nn
from transformers import initialization as init

from .attention_base import LongAttnAttention
from .numerics import rotate

# With layerwise sharing, the first Linformer layer of a stack owns E and every later one uses it. Layers are built
# in order, so the owner registered last for a config is the one of the stack being built (a weak reference: the
# table never keeps a model alive).
_LAYERWISE_OWNERS: dict[int, weakref.ReferenceType] = {}


def _first_linformer_layer(config: Any) -> int:
    types = config.layer_attention_types
    return types.index("linformer") if "linformer" in types else 0


class LinformerAttention(LongAttnAttention):
    """The `"linformer"` kind: keys and values projected along the length to `linformer_proj_len` rows.

    Config fields:
        linformer_proj_len: Projected length k (int, or one per layer), default 256. Cost is O(n · k).
        linformer_sharing: `"none"`, `"headwise"` (default), `"key_value"` or `"layerwise"` (see the module doc).

    Parameters besides q/k/v/o_proj: `e_proj` (keys) and, unless E is shared with the values, `f_proj` (values):
    tables `[L, H·k]` with one row per position. Only the first Linformer layer holds `e_proj` with layerwise
    sharing.

    Raises:
        ValueError: (at config time) a causal use, an unknown sharing mode, or a projected length below 1.
    """

    attention_type = "linformer"
    settings = ("proj_len", "sharing")

    def __init__(self, config: Any, *, layer_idx: int, is_causal: bool):
        super().__init__(config, layer_idx=layer_idx, is_causal=is_causal)
        self.max_len = config.max_position_embeddings
        heads = self.num_heads if self.sharing == "none" else 1
        owner = None
        if self.sharing == "layerwise" and layer_idx != _first_linformer_layer(config):
            reference = _LAYERWISE_OWNERS.get(id(config))
            owner = reference() if reference is not None else None
        if owner is not None:
            # Not a submodule: the owner's parameter appears once in the state dict, under the first layer.
            object.__setattr__(self, "_layerwise_owner", owner)
            self.e_proj = self.f_proj = None
        else:
            object.__setattr__(self, "_layerwise_owner", None)
            # A table with one row per position (k numbers per owning head): the transposed E of the paper.
            self.e_proj = nn.Embedding(self.max_len, heads * self.proj_len)
            separate_values = self.sharing in ("none", "headwise")
            self.f_proj = nn.Embedding(self.max_len, heads * self.proj_len) if separate_values else None
            if self.sharing == "layerwise":
                _LAYERWISE_OWNERS[id(config)] = weakref.ref(self)
        self.reset_kind_parameters()

    @torch.no_grad()
    def reset_kind_parameters(self) -> None:
        """Initialise E and F (xavier-like: std 1/sqrt(L + k), as a Linear layer from L to k positions would get)."""
        std = 1.0 / math.sqrt(self.max_len + self.proj_len)
        for table in (self.e_proj, self.f_proj):
            if table is not None:
                init.normal_(table.weight, mean=0.0, std=std)

    def length_projections(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(E, F) tables, each `[L, H·k]`; the same tensor twice when keys and values share it."""
        source = self._layerwise_owner if self._layerwise_owner is not None else self
        e_proj = source.e_proj.weight
        return e_proj, (source.f_proj.weight if source.f_proj is not None else e_proj)

    def projection_rows(
        self, n: int, key_padding_mask: torch.Tensor | None, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows of E and F used by n tokens, each `[b|1, n, H, k]` (one tensor when keys and values share E)."""
        e_table, f_table = self.length_projections()
        e_rows = self._rows(e_table, n, key_padding_mask).to(dtype)
        return e_rows, (e_rows if f_table is e_table else self._rows(f_table, n, key_padding_mask).to(dtype))

    def _rows(self, table: torch.Tensor, n: int, key_padding_mask: torch.Tensor | None) -> torch.Tensor:
        """The rows of a projection table used by n tokens: `[1, n, H, k]`, or `[b, n, H, k]` when padded."""
        if n > self.max_len:
            raise ValueError(
                f"Linformer projections were learned for {self.max_len} positions (`max_position_embeddings`), "
                f"got {n} keys."
            )
        if key_padding_mask is None:
            rows = table[None, :n]  # [1, n, H·k]
        else:
            # Positions counted over real tokens (as the model's position ids): left padding selects the same rows.
            positions = (key_padding_mask.long().cumsum(-1) - 1).clamp(min=0)  # [b, n]
            rows = table[positions]  # [b, n, H·k]
        # Sizes spelled out (no -1): a view of an empty tensor (batch or length 0) cannot infer one.
        return rows.view(rows.shape[0], n, table.shape[1] // self.proj_len, self.proj_len)

    @staticmethod
    def _project(tokens: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """Eᵀ applied along the length: tokens `[b, n, h, d]` (zero on padding), rows `[b|1, n, H, k]` -> `[b, h, k,
        d]`."""
        b, n, h, d = tokens.shape
        if rows.shape[2] == 1:
            # One E for every head: a single [k, n] @ [n, h·d] product per batch row, no per-head copies of E.
            projected = rows[:, :, 0].transpose(1, 2) @ tokens.reshape(b, n, h * d)  # [b, k, h·d]
            return projected.view(b, rows.shape[3], h, d).transpose(1, 2)
        return torch.einsum("bnhk,bnhd->bhkd", rows, tokens)

    def _project_linear(
        self, hidden_states: torch.Tensor, keep: torch.Tensor | None, rows: torch.Tensor, linear: nn.Linear
    ) -> torch.Tensor:
        """Eᵀ (X W + b) for one E shared by the heads, computed as (Eᵀ X) W + (Eᵀ 1) b: `[b, h, k, d]`.

        Projecting the length first makes the linear layer act on k rows instead of n tokens (the same result; the
        bias enters once per real token, weighted by E's rows).
        """
        b = hidden_states.shape[0]
        e_rows = rows[:, :, 0]  # [b|1, n, k]
        x = hidden_states if keep is None else hidden_states * keep
        mixed = e_rows.transpose(1, 2) @ x  # [b, k, D]
        row_sums = e_rows.sum(dim=1) if keep is None else (e_rows * keep).sum(dim=1)  # [b|1, k]
        out = nn.functional.linear(mixed, linear.weight) + row_sums[..., None] * linear.bias  # [b, k, D]
        return out.view(b, e_rows.shape[-1], self.num_heads, self.head_dim).transpose(1, 2)

    def _tokens(self, linear: nn.Linear, hidden_states: torch.Tensor, keep: torch.Tensor | None) -> torch.Tensor:
        b, n, _ = hidden_states.shape
        tokens = linear(hidden_states).view(b, n, self.num_heads, self.head_dim)  # [b, n, h, d]
        # Zero padded tokens before the projection: they then add nothing to any projected row.
        return tokens if keep is None else tokens * keep[..., None]

    def attention_inputs(self, hidden_states, *, key_padding_mask, position_embeddings):
        """Queries per token, keys and values projected along the length: q `[b, h, n, d]`, k̄, v̄ `[b, h, k, d]`.

        Keys and values are projected along the length in the token layout `[b, n, h, d]` (no head transposes of
        length-n tensors). When E is shared by the heads the length is projected before the linear layers (for the
        values always, for the keys when no rotary embedding has to rotate each key at its own position).
        """
        b, n, _ = hidden_states.shape
        dtype = hidden_states.dtype
        e_rows, f_rows = self.projection_rows(n, key_padding_mask, dtype)  # [b|1, n, H, k]
        keep = None if key_padding_mask is None else key_padding_mask[:, :, None].to(dtype)  # [b, n, 1]
        shared = e_rows.shape[2] == 1
        q = self.q_proj(hidden_states).view(b, n, self.num_heads, self.head_dim)  # [b, n, h, d]
        if position_embeddings is not None:
            cos, sin = (t[:, :, None].to(dtype) for t in position_embeddings)  # [b, n, 1, d]
            q = rotate(q, cos, sin)
            keys = self._tokens(self.k_proj, hidden_states, keep)
            k_bar = self._project(rotate(keys, cos, sin), e_rows)
        elif shared:
            k_bar = self._project_linear(hidden_states, keep, e_rows, self.k_proj)
        else:
            k_bar = self._project(self._tokens(self.k_proj, hidden_states, keep), e_rows)
        if shared:
            v_bar = self._project_linear(hidden_states, keep, f_rows, self.v_proj)
        else:
            v_bar = self._project(self._tokens(self.v_proj, hidden_states, keep), f_rows)
        return q.transpose(1, 2), k_bar, v_bar

    def attend_inputs(self, q, k, v, *, hidden_states, key_padding_mask, global_mask, dense):
        """The queries over the projected keys k̄, v̄ `[b, h, k, d]`; with `dense`, the weights on the original
        tokens `[b, h, n, n]`."""
        f_rows = self.projection_rows(q.shape[2], key_padding_mask, q.dtype)[1] if dense else None
        return self._attend_projected(q, k, v, f_rows, key_padding_mask, with_weights=dense)

    def _attend_projected(
        self,
        q: torch.Tensor,
        k_bar: torch.Tensor,
        v_bar: torch.Tensor,
        f_rows: torch.Tensor | None,
        key_padding_mask: torch.Tensor | None,
        *,
        with_weights: bool,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """softmax(Q K̄ᵀ / sqrt(d)) V̄ with q `[b, h, n, d]`, k̄, v̄ `[b, h, k, d]`; optionally the weights `P̄ Fᵀ`.

        The output is `P̄ (Fᵀ V)` = `(P̄ Fᵀ) V`, with P̄ `[b, h, n, k]` the softmax over projected keys, so `P̄ Fᵀ`
        `[b, h, n, n]` is exactly the linear map applied to the values (rows need not sum to 1; padded tokens get 0).
        """
        dropout_p = self.active_dropout_p
        if not with_weights:
            # Every projected key is visible (padding was removed inside the projection): plain SDPA, [n, k] scores.
            return nn.functional.scaled_dot_product_attention(
                q, k_bar, v_bar, dropout_p=dropout_p, scale=self.scale
            ), None
        scores = (q @ k_bar.transpose(-1, -2)).float() * self.scale  # [b, h, n, k]
        probs = torch.softmax(scores, dim=-1).to(q.dtype)
        dropped = nn.functional.dropout(probs, p=dropout_p) if dropout_p > 0 else probs
        out = dropped @ v_bar
        weights = dropped @ f_rows.permute(0, 2, 3, 1)  # [b, h, n, k] @ [b|1, H, k, n] -> [b, h, n, n]
        if key_padding_mask is not None:
            weights = weights * key_padding_mask[:, None, None, :]
        return out, weights

    def project_length(
        self, k: torch.Tensor, v: torch.Tensor, key_padding_mask: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Per-head keys and values `[b, h, n, d]` -> projected `[b, h, k, d]`, and the rows of F used."""
        e_rows, f_rows = self.projection_rows(k.shape[2], key_padding_mask, k.dtype)
        keep = None if key_padding_mask is None else key_padding_mask[:, :, None, None].to(k.dtype)
        k_tokens, v_tokens = k.transpose(1, 2), v.transpose(1, 2)  # [b, n, h, d]
        if keep is not None:
            k_tokens, v_tokens = k_tokens * keep, v_tokens * keep
        return self._project(k_tokens, e_rows), self._project(v_tokens, f_rows), f_rows

    def attend(self, q, k, v, *, key_padding_mask, global_mask):
        """The same attention from per-head q, k, v `[b, h, n, d]` (the interface of every kind; the model's layers
        project the length in `attention_inputs` instead, fused with the linear layers)."""
        k_bar, v_bar, f_rows = self.project_length(k, v, key_padding_mask)
        return self._attend_projected(q, k_bar, v_bar, f_rows, key_padding_mask, with_weights=False)[0]

    def attend_dense(self, q, k, v, *, key_padding_mask, global_mask):
        """`attend` with the weights on the original tokens, `P̄ Fᵀ` `[b, h, n, n]`."""
        k_bar, v_bar, f_rows = self.project_length(k, v, key_padding_mask)
        return self._attend_projected(q, k_bar, v_bar, f_rows, key_padding_mask, with_weights=True)
