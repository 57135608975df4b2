"""Sparse Sinkhorn attention and SortCut (Tay et al. 2020, "Sparse Sinkhorn Attention"): the `"sinkhorn"` kind.

The kind's settings and its hook; the attention itself (the sorting network, Sinkhorn balancing, SortCut, the
causal form, the block pattern) is `ops_sinkhorn`'s, whose functions are importable from here too.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from .attention_base import LongAttnAttention
from .ops_sinkhorn import log_sinkhorn, sinkhorn_attention, sinkhorn_attention_dense, sinkhorn_sort_matrix

__all__ = [
    "SinkhornAttention",
    "log_sinkhorn",
    "sinkhorn_attention",
    "sinkhorn_attention_dense",
    "sinkhorn_sort_matrix",
]


# ---------------------------------------------------------------------------------------------- the module
class SinkhornAttention(LongAttnAttention):
    """The `"sinkhorn"` kind: Sparse Sinkhorn attention, or SortCut with `sinkhorn_sortcut`.

    Config fields (ints may be one value or one per layer):
        sinkhorn_block_size (64): tokens per block s.
        sinkhorn_iterations (5): Sinkhorn balancing rounds.
        sinkhorn_temperature (0.75): divides the sorting scores (the paper's τ).
        sinkhorn_sortcut (None): SortCut budget p (blocks kept after sorting); None = Sinkhorn attention. Encoders
            only: a causal layer with SortCut is refused at config time.

    Parameters: `sort_proj` (the sorting network's W, d x d, shared by the heads) besides q/k/v/o.
    """

    attention_type = "sinkhorn"
    supports_packing = True
    settings = ("block_size", "iterations", "temperature", "sortcut")

    def __init__(self, config: Any, *, layer_idx: int, is_causal: bool):
        super().__init__(config, layer_idx=layer_idx, is_causal=is_causal)
        self.sort_proj = nn.Linear(self.head_dim, self.head_dim, bias=False)

    @classmethod
    def length_multiple(cls, config, *, layer_idx):
        # The sequence is padded to whole blocks inside (`ops_sinkhorn._prepare`): a batch padded there costs no
        # extra work.
        return config.per_layer("sinkhorn_block_size", layer_idx)

    def _kwargs(self) -> dict:
        return dict(
            sort_weight=self.sort_proj.weight.T,
            block_size=self.block_size,
            iterations=self.iterations,
            temperature=self.temperature,
            causal=self.is_causal,
            sortcut=self.sortcut,
            scale=self.scale,
            noise=self.training,
            dropout_p=self.dropout_p if self.training else 0.0,
            relative_embedding=self.relative_weight,
        )

    def attend(self, q, k, v, *, key_padding_mask, global_mask, document_ids=None):
        return sinkhorn_attention(
            q,
            k,
            v,
            key_padding_mask=key_padding_mask,
            backend=self.backend,
            document_ids=document_ids,
            **self._kwargs(),
        )

    def attend_dense(self, q, k, v, *, key_padding_mask, global_mask, document_ids=None):
        return sinkhorn_attention_dense(
            q, k, v, key_padding_mask=key_padding_mask, document_ids=document_ids, **self._kwargs()
        )
