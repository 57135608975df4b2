"""The attention interface every kind implements, and what all kinds share.

Shape legend: b batch, h heads, n query length, m key length, d head dim, D hidden size.

A kind subclasses `LongAttnAttention` and declares:
- `attention_type`: its registry name;
- `config_fields`: its own config fields with defaults (flat, prefixed by the kind);
- `validate_config`: the checks of those fields (called once, from `LongAttnConfig.validate_longattn`);
- `attend`: the fast executor for a whole sequence (q, k, v -> out);
- `pattern`: the mask predicate that defines which keys a query sees, used by the dense path (cached decoding, where
  queries are the last positions, and `output_attentions`) and by pictures of the pattern. Content-based kinds, whose
  pattern depends on the input, override `attend_dense` instead.

Parameter names (`q_proj`, `k_proj`, `v_proj`, `o_proj`) are the same for every kind, so a checkpoint reloads under
another `attention_type` with only the kind-specific weights reported missing.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

import torch
from torch import nn

from .numerics import apply_rotary, default_scale
from .ops import reference_attention
from . import patterns
from .patterns import MaskFn, and_masks, causal_mask, materialize_mask


# ---------------------------------------------------------------------------------------------- config checks
def check_int_field(config: Any, field: str, layer_idx: int, *, minimum: int, per: str = "layer") -> int:
    """Validate an integer field that holds one value or a list (one per layer / per head); return this layer's value.

    Raises:
        ValueError: a list of the wrong length, a non-integer or a value below `minimum`.
    """
    value = getattr(config, field)
    expected = config.num_attention_heads if per == "head" else _num_layers_for(config)
    if isinstance(value, (list, tuple)):
        if len(value) != expected:
            raise ValueError(
                f"`{field}`={list(value)!r} has {len(value)} entries: expected one integer or one per {per} "
                f"({expected})."
            )
        values = list(value)
    else:
        values = [value]
    for item in values:
        if not isinstance(item, int) or isinstance(item, bool) or item < minimum:
            raise ValueError(f"`{field}`={value!r} is invalid: expected integers >= {minimum}.")
    return values[layer_idx] if per == "layer" and len(values) > 1 else values[0]


def check_number(
    field: str,
    value: Any,
    *,
    minimum: float,
    maximum: float = math.inf,
    exclusive_minimum: bool = False,
    exclusive_maximum: bool = False,
    optional: bool = False,
) -> None:
    """Validate a real-valued field: an int or float (not a bool), finite, within [minimum, maximum] (bounds made
    exclusive on request); None too when `optional`.

    Raises:
        ValueError: naming the field, the value and the allowed range.
    """
    if optional and value is None:
        return
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if ok:
        ok = (value > minimum if exclusive_minimum else value >= minimum) and (
            value < maximum if exclusive_maximum else value <= maximum
        )
    if not ok:
        low = f"{'(' if exclusive_minimum else '['}{minimum:g}"
        high = "inf)" if maximum == math.inf else f"{maximum:g}{')' if exclusive_maximum else ']'}"
        raise ValueError(
            f"`{field}`={value!r} is invalid: expected a finite number in {low}, {high}{' or None' if optional else ''}."
        )


def _num_layers_for(config: Any) -> int:
    return config.num_hidden_layers


class LongAttnAttention(nn.Module):
    """Multi-head self-attention with a pluggable pattern; the base of every attention kind.

    Args:
        config: A `LongAttnConfig`.
        layer_idx: Index of the layer in its stack (per-layer config fields and the KV cache use it).
        is_causal: Causal self-attention (decoders).
    """

    attention_type: ClassVar[str] = ""
    config_fields: ClassVar[dict[str, Any]] = {}
    backends: ClassVar[tuple[str, ...]] = ("auto", "torch", "reference")
    """Values of `attention_backend` this kind runs on. Every kind has its PyTorch executor (`"torch"`, which
    `"auto"` uses where nothing faster serves it) and its dense form (`"reference"`, `attend_dense`); kinds whose
    pattern the GPU back ends compute (they pass `backend=` to `longattn.ops`) add `"flex"` and `"xformers"`."""

    def __init__(self, config: Any, *, layer_idx: int, is_causal: bool):
        super().__init__()
        self.layer_idx = layer_idx
        self.is_causal = is_causal
        self.num_heads = config.num_attention_heads
        self.head_dim = config.hidden_size // config.num_attention_heads
        self.scale = default_scale(self.head_dim)
        self.dropout_p = config.attention_probs_dropout_prob
        # Kinds that dispatch pass it to `longattn.ops` (`backend=`); configs saved before the field mean "auto".
        self.backend = getattr(config, "attention_backend", "auto")
        self.q_proj = nn.Linear(config.hidden_size, config.hidden_size)
        self.k_proj = nn.Linear(config.hidden_size, config.hidden_size)
        self.v_proj = nn.Linear(config.hidden_size, config.hidden_size)
        self.o_proj = nn.Linear(config.hidden_size, config.hidden_size)

    # -------------------------------------------------------------- what a kind provides
    @classmethod
    def validate_config(cls, config: Any, *, layer_idx: int, is_causal: bool) -> None:
        """Check this kind's fields for layer `layer_idx`; raise `ValueError` naming field, value and allowed."""

    @classmethod
    def check_backend(cls, backend: str) -> None:
        """Raise `ValueError` when this kind cannot run on `backend` (the config's `attention_backend`), rather
        than quietly running it on another."""
        if backend not in cls.backends:
            raise ValueError(
                f"`attention_backend`={backend!r} cannot run `attention_type`={cls.attention_type!r}: this kind runs "
                f"on {', '.join(repr(name) for name in cls.backends)} ('reference' is its dense form). Use 'auto' to "
                "let every layer take the fastest back end it has."
            )

    @classmethod
    def length_multiple(cls, config: Any, *, layer_idx: int) -> int:
        """The length batches are best padded to a multiple of, for layer `layer_idx` (collators use it).

        Every executor accepts any length, so this is never required. A kind whose executor rounds the sequence up
        to whole blocks internally returns its block length: padding the batch there costs no extra work and keeps
        every batch on the whole-block path. Default 1 (padding would only add work).
        """
        return 1

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        key_padding_mask: torch.Tensor | None,
        global_mask: torch.Tensor | None,
    ) -> torch.Tensor:
        """The fast executor: q, k, v `[b, h, n, d]` -> `[b, h, n, d]`."""
        raise NotImplementedError

    def pattern(self, *, key_padding_mask: torch.Tensor | None, global_mask: torch.Tensor | None) -> MaskFn:
        """Which keys each query sees, as a predicate over absolute positions (the default: all keys)."""
        fns = [causal_mask()] if self.is_causal else []
        if key_padding_mask is not None:
            fns.append(patterns.key_padding_mask(key_padding_mask))
        return and_masks(*fns)

    def reset_kind_parameters(self) -> None:
        """Initialise the kind's own parameters and buffers (called by the model's `_init_weights`, also when a
        checkpoint of another kind is loaded); use `transformers.initialization` so loaded weights are kept."""

    def auxiliary_loss(self) -> torch.Tensor | None:
        """A loss term the model adds to its training loss (e.g. adaptive span's L1 penalty); None if none."""
        return None

    # -------------------------------------------------------------- shared machinery
    def split_heads(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        return x.view(b, n, self.num_heads, self.head_dim).transpose(1, 2)  # [b, h, n, d]

    def merge_heads(self, x: torch.Tensor) -> torch.Tensor:
        b, _, n, _ = x.shape
        return x.transpose(1, 2).reshape(b, n, self.num_heads * self.head_dim)  # [b, n, D]

    def project(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v `[b, h, n, d]` from hidden states `[b, n, D]` (LSH overrides this to share q and k)."""
        return (
            self.split_heads(self.q_proj(hidden_states)),
            self.split_heads(self.k_proj(hidden_states)),
            self.split_heads(self.v_proj(hidden_states)),
        )

    def attend_dense(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        key_padding_mask: torch.Tensor | None,
        global_mask: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Attention over all m keys for the n queries that are the *last* n positions, masked by `pattern`.

        Costs O(n * m): used for cached decoding (n is the number of new tokens) and when attention weights are
        requested (`output_attentions=True` materialises the `[b, h, n, m]` weights; that is what was asked for).
        """
        b, _, n, _ = q.shape
        m = k.shape[2]
        mask = materialize_mask(
            self.pattern(key_padding_mask=key_padding_mask, global_mask=global_mask),
            batch=b, heads=self.num_heads, q_len=n, kv_len=m, q_offset=m - n, device=q.device,
        )
        dropout_p = self.dropout_p if self.training else 0.0
        return reference_attention(q, k, v, mask, scale=self.scale, dropout_p=dropout_p, return_weights=True)

    def forward(
        self,
        hidden_states: torch.Tensor,
        *,
        attention_mask: torch.Tensor | None = None,
        global_attention_mask: torch.Tensor | None = None,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        past_key_values: Any = None,
        output_attentions: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Self-attention.

        Args:
            hidden_states: `[b, n, D]`.
            attention_mask: `[b, m]` bool, True = real token, over all keys (cached ones included); None = no padding.
            global_attention_mask: `[b, m]` bool, True = global token (kinds without global tokens ignore it).
            position_embeddings: rotary (cos, sin) `[b, n, d]`, or None with learned absolute positions.
            past_key_values: a transformers `Cache` (decoders), updated in place with this layer's keys and values.
            output_attentions: Also return the attention weights `[b, h, n, m]` (costs O(n * m)).

        Returns:
            (`[b, n, D]` output, weights or None).
        """
        q, k, v = self.project(hidden_states)  # [b, h, n, d]
        if position_embeddings is not None:
            q, k = apply_rotary(q, k, *position_embeddings)
        if past_key_values is not None:
            k, v = past_key_values.update(k, v, self.layer_idx)
        decoding = k.shape[2] != q.shape[2]
        if output_attentions or decoding or self.backend == "reference":
            out, weights = self.attend_dense(q, k, v, key_padding_mask=attention_mask, global_mask=global_attention_mask)
        else:
            out = self.attend(q, k, v, key_padding_mask=attention_mask, global_mask=global_attention_mask)
            weights = None
        return self.o_proj(self.merge_heads(out)), weights
