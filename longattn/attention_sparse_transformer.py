"""Sparse Transformer attention (Child et al. 2019): strided and fixed factorized patterns.

Shape legend: b batch, h heads, n length, d head dim.

Both kinds compute the union of the paper's two sets A1 ∪ A2 in one head (the paper's "merged" head), in every
head:

- `"strided"` (`strided_stride` l): query i sees the previous l keys and every l-th key before it; encoders use the
  bidirectional form (|i − j| <= l, or (i − j) mod l = 0). Cost O(n · (l + n / l)); the paper picks l ~ sqrt(n).
- `"fixed"` (`fixed_block_size` l, `fixed_num_summary` c, `fixed_summary_per_head`): query i sees its own block
  of l and the last c cells of every block (decoders: only those at or before i). The paper found that giving
  heads distinct summary sub-blocks works better; `fixed_summary_per_head=True` does that (head h uses the c cells
  `h mod floor(l / c)` sub-blocks from the block end), the default False uses the last c cells in every head, as
  the formula in the paper's definition. Cost O(n · (l + c · n / l)).

The patterns are `longattn.patterns.strided_pattern` / `fixed_pattern`; they feed the executors
(`longattn.ops.strided_attention` / `fixed_attention`, on the back end that `attention_backend` picks), the dense
path (cached decoding, `output_attentions`) and the pictures. Global tokens (`global_attention_mask`) are not part
of either pattern and are ignored.
"""

from __future__ import annotations

from typing import Any

from .attention_base import LongAttnAttention
from .ops import fixed_attention, strided_attention
from .patterns import fixed_pattern, strided_pattern


class StridedAttention(LongAttnAttention):
    """The `"strided"` kind. Config field: `strided_stride` (the stride l; int or one per layer)."""

    attention_type = "strided"
    supports_packing = True
    settings = ("stride",)

    def _pattern_arguments(self, key_padding_mask, document_ids=None) -> dict[str, Any]:
        """The settings the pattern and its executor (`strided_attention`) share."""
        return dict(
            stride=self.stride, causal=self.is_causal, key_padding_mask=key_padding_mask, document_ids=document_ids
        )

    def pattern(self, *, key_padding_mask, global_mask, document_ids=None):
        return strided_pattern(**self._pattern_arguments(key_padding_mask, document_ids))

    def attend(self, q, k, v, *, key_padding_mask, global_mask, document_ids=None):
        pattern = self._pattern_arguments(key_padding_mask, document_ids)
        return strided_attention(q, k, v, **pattern, **self.op_arguments())


class FixedAttention(LongAttnAttention):
    """The `"fixed"` kind. Config fields: `fixed_block_size` (l; int or one per layer), `fixed_num_summary` (c, in
    [1, l]; int or one per layer) and `fixed_summary_per_head` (bool: distinct summary sub-blocks per head)."""

    attention_type = "fixed"
    supports_packing = True
    settings = ("block_size", "num_summary", "summary_per_head")

    @classmethod
    def length_multiple(cls, config, *, layer_idx):
        # The executor cuts the sequence into whole pattern blocks (a short last block is padded inside).
        return config.per_layer("fixed_block_size", layer_idx)

    def _pattern_arguments(self, key_padding_mask, document_ids=None) -> dict[str, Any]:
        """The settings the pattern and its executor (`fixed_attention`) share."""
        return dict(
            block_size=self.block_size,
            num_summary=self.num_summary,
            summary_per_head=self.summary_per_head,
            causal=self.is_causal,
            key_padding_mask=key_padding_mask,
            document_ids=document_ids,
        )

    def pattern(self, *, key_padding_mask, global_mask, document_ids=None):
        return fixed_pattern(**self._pattern_arguments(key_padding_mask, document_ids))

    def attend(self, q, k, v, *, key_padding_mask, global_mask, document_ids=None):
        pattern = self._pattern_arguments(key_padding_mask, document_ids)
        return fixed_attention(q, k, v, **pattern, **self.op_arguments())
