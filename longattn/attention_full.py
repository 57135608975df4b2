"""Dense multi-head attention (Vaswani et al. 2017): the `"full"` kind, and the cross-attention of seq2seq decoders.

Shape legend: b batch, h heads, n query length, m key length, d head dim, D hidden size.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .attention_base import LongAttnAttention
from .ops import full_attention, reference_attention


class FullAttention(LongAttnAttention):
    """Every query sees every (real, and in a decoder earlier) key: O(n^2), the baseline of every other kind."""

    attention_type = "full"
    supports_packing = True

    def attend(self, q, k, v, *, key_padding_mask, global_mask, document_ids=None):
        return full_attention(
            q,
            k,
            v,
            key_padding_mask=key_padding_mask,
            document_ids=document_ids,
            **self.layer_arguments("causal", "scale", "dropout_p", "backend", "relative_embedding"),
        )


class CrossAttention(nn.Module):
    """Decoder-to-encoder attention: n decoder queries over m encoder states, dense (m is long, n is short: O(n * m)).

    The encoder's keys and values are computed once per generation and kept in the cross-attention cache.
    """

    def __init__(self, config: Any, *, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.head_dim = config.hidden_size // config.num_attention_heads
        self.dropout_p = config.attention_probs_dropout_prob
        self.q_proj = nn.Linear(config.hidden_size, config.hidden_size)
        self.k_proj = nn.Linear(config.hidden_size, config.hidden_size)
        self.v_proj = nn.Linear(config.hidden_size, config.hidden_size)
        self.o_proj = nn.Linear(config.hidden_size, config.hidden_size)

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        return x.view(b, n, self.num_heads, self.head_dim).transpose(1, 2)  # [b, h, n, d]

    def forward(
        self,
        hidden_states: torch.Tensor,
        *,
        encoder_hidden_states: torch.Tensor,
        encoder_attention_mask: torch.Tensor | None = None,
        past_key_values: Any = None,
        output_attentions: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """hidden_states `[b, n, D]`, encoder_hidden_states `[b, m, D]`, encoder_attention_mask `[b, m]` bool."""
        q = self._heads(self.q_proj(hidden_states))
        cache = getattr(past_key_values, "cross_attention_cache", None)
        if cache is not None and past_key_values.is_updated.get(self.layer_idx):
            k, v = cache.layers[self.layer_idx].keys, cache.layers[self.layer_idx].values
        else:
            k = self._heads(self.k_proj(encoder_hidden_states))
            v = self._heads(self.v_proj(encoder_hidden_states))
            if cache is not None:
                k, v = cache.update(k, v, self.layer_idx)
                past_key_values.is_updated[self.layer_idx] = True
        dropout_p = self.dropout_p if self.training else 0.0
        if output_attentions:
            mask = torch.ones(1, 1, 1, k.shape[2], dtype=torch.bool, device=q.device)
            if encoder_attention_mask is not None:
                mask = encoder_attention_mask[:, None, None, :]
            out, weights = reference_attention(q, k, v, mask, dropout_p=dropout_p, return_weights=True)
        else:
            out = full_attention(q, k, v, key_padding_mask=encoder_attention_mask, dropout_p=dropout_p)
            weights = None
        b, _, n, _ = out.shape
        return self.o_proj(out.transpose(1, 2).reshape(b, n, self.num_heads * self.head_dim)), weights
