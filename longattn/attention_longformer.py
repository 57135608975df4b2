"""Longformer attention (Beltagy et al. 2020): sliding window, dilated sliding window and global tokens.

Shape legend: b batch, h heads, n length, d head dim.

A query at position i sees the keys i ± dilation·m for m = 0..window (causal: only the earlier ones and itself);
global tokens (`global_attention_mask`) see every key and are seen by every query (causality still holds). The pattern
is `longattn.patterns.sliding_window_pattern`; the executor (`longattn.ops.sliding_window_attention`) costs
O(n · window).

Unlike Longformer, global tokens reuse the layer's q/k/v projections instead of separate `query_global` etc.: every
parameter then receives a gradient whether or not a batch has global tokens (DDP with
`find_unused_parameters=False` works), and a checkpoint keeps the parameter names of every other kind.
"""

from __future__ import annotations

from typing import Any

from .attention_base import LongAttnAttention
from .ops import sliding_window_attention
from .patterns import sliding_window_pattern


class LongformerAttention(LongAttnAttention):
    """The `"sliding"` kind. Config fields: `sliding_window` (keys on each side; int or one per layer) and
    `sliding_dilation` (int or one per head)."""

    attention_type = "sliding"

    def __init__(self, config: Any, *, layer_idx: int, is_causal: bool):
        super().__init__(config, layer_idx=layer_idx, is_causal=is_causal)
        self.window = config.per_layer("sliding_window", layer_idx)
        dilation = config.sliding_dilation
        self.dilation = list(dilation) if isinstance(dilation, (list, tuple)) else dilation

    def _pattern_arguments(self, key_padding_mask, global_mask) -> dict[str, Any]:
        """The settings the pattern and its executor (`sliding_window_attention`) share."""
        return dict(
            window=self.window,
            dilation=self.dilation,
            causal=self.is_causal,
            global_mask=global_mask,
            key_padding_mask=key_padding_mask,
        )

    def pattern(self, *, key_padding_mask, global_mask):
        return sliding_window_pattern(**self._pattern_arguments(key_padding_mask, global_mask))

    def attend(self, q, k, v, *, key_padding_mask, global_mask):
        pattern = self._pattern_arguments(key_padding_mask, global_mask)
        return sliding_window_attention(q, k, v, **pattern, **self.op_arguments())
