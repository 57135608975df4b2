"""Longformer attention (Beltagy et al. 2020): sliding window, dilated sliding window and global tokens.

Shape legend: b batch, h heads, n length, d head dim.

A query at position i sees the keys i ± dilation·m for m = 0..window (causal: only the earlier ones and itself);
global tokens (`global_attention_mask`) see every key and are seen by every query (causality still holds). The pattern
is `longattn.patterns.sliding_window_pattern`; the executor (`longattn.ops.sliding_window_attention`) costs
O(n · window).

Unlike Longformer, global tokens reuse the layer's q/k/v projections instead of separate `query_global` etc.: every
parameter then receives a gradient whether or not a batch has global tokens (DDP with
`find_unused_parameters=False` works), and a checkpoint keeps the parameter names of every other kind.

With `longattn.train.context_parallel.enable_context_parallel`, a sequence split across processes attends through
`context_parallel.context_parallel_sliding_attention` (halo exchange, global tokens gathered).
"""

from __future__ import annotations

from typing import Any

from .attention_base import LongAttnAttention
from .context_parallel import ContextParallel, context_parallel_sliding_attention
from .ops import sliding_window_attention
from .patterns import sliding_window_pattern


class LongformerAttention(LongAttnAttention):
    """The `"sliding"` kind. Config fields: `sliding_window` (keys on each side; int or one per layer) and
    `sliding_dilation` (int or one per head)."""

    attention_type = "sliding"
    supports_packing = True
    context_parallel: ContextParallel | None = None
    """The group this layer's sequence is split across (set by `enable_context_parallel`, which lives above the model
    in `longattn.train.context_parallel`)."""
    settings = ("window", "dilation")

    def _pattern_arguments(self, key_padding_mask, global_mask, document_ids=None) -> dict[str, Any]:
        """The settings the pattern and its executor (`sliding_window_attention`) share."""
        return dict(
            window=self.window,
            dilation=self.dilation,
            causal=self.is_causal,
            global_mask=global_mask,
            key_padding_mask=key_padding_mask,
            document_ids=document_ids,
        )

    def pattern(self, *, key_padding_mask, global_mask, document_ids=None):
        return sliding_window_pattern(**self._pattern_arguments(key_padding_mask, global_mask, document_ids))

    def attend(self, q, k, v, *, key_padding_mask, global_mask, document_ids=None):
        pattern = self._pattern_arguments(key_padding_mask, global_mask, document_ids)
        if self.context_parallel is not None:
            if document_ids is not None:
                # A rank sees its own chunk's documents only, and its halo would carry the neighbours' keys of
                # other documents: packed rows have no context-parallel form.
                raise ValueError(
                    "context parallelism cannot run packed documents (`position_ids` that restart, or "
                    "`cu_seq_lens_q`/`cu_seq_lens_k`): split one unpacked sequence per row, or run packed rows "
                    "without enable_context_parallel."
                )
            # Relative-position logits and back ends other than the blocked executor are refused when enabled.
            arguments = self.op_arguments()
            del pattern["document_ids"]
            return context_parallel_sliding_attention(
                q, k, v, **pattern, cp=self.context_parallel, scale=arguments["scale"], dropout_p=arguments["dropout_p"]
            )
        return sliding_window_attention(q, k, v, **pattern, **self.op_arguments())

    def attend_dense(self, q, k, v, *, key_padding_mask, global_mask, document_ids=None):
        if self.context_parallel is not None:
            # The dense form sees only this rank's keys: it would be silently wrong.
            raise ValueError(
                "context parallelism: output_attentions=True and cached decoding need the whole sequence on one "
                "process; run them without enable_context_parallel."
            )
        return super().attend_dense(
            q, k, v, key_padding_mask=key_padding_mask, global_mask=global_mask, document_ids=document_ids
        )
