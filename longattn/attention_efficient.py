"""Efficient attention (Shen et al. 2021, "Efficient Attention: Attention with Linear Complexities"): the `"efficient"`
kind.

Shape legend: b batch, h heads, n query length, m key length, d head dim.

Queries are normalised over their features and keys over their positions, and the product is taken as
`ρ_q(Q) (ρ_k(K)ᵀ V)`: the `[d, d]` global context replaces the `[n, m]` attention matrix, so time and memory are
linear in length. The kernel is `longattn.ops.efficient_attention` (see `longattn.ops_linear` for the formulas);
decoders use its causal form (prefix sums over key chunks), so the kind works in every stack.
"""

from __future__ import annotations

from .attention_base import LongAttnAttention
from .ops_linear import efficient_attention, efficient_attention_weights
from .patterns import DocumentRows


class EfficientAttention(LongAttnAttention):
    """The `"efficient"` kind: linear attention `ρ_q(Q) (ρ_k(K)ᵀ V)` in O(n · d²).

    Config fields:
        efficient_normalization: `"softmax"` (default; softmax over each query's features and over each key
            feature's positions, the paper's main variant) or `"scaling"` (divide by the number of visible keys:
            exactly dot-product attention with scaling normalisation, the paper's equivalence).

    There is no `[n, m]` probability matrix in the fast path, so `attention_probs_dropout_prob` does not apply here.
    `output_attentions=True` and cached decoding make the equivalent matrix `ρ_q(Q) ρ_k(K)ᵀ` explicit
    (`longattn.ops_linear.efficient_attention_weights`, O(n · m · d)).
    """

    attention_type = "efficient"
    supports_packing = True
    """Packed documents: each moved to a row of its own (`patterns.DocumentRows`), so that its global context (its
    running state, causal) starts afresh, as for the document alone."""
    settings = ("normalization",)

    def attend(self, q, k, v, *, key_padding_mask, global_mask, document_ids=None):
        if document_ids is not None:
            rows = DocumentRows(document_ids, key_padding_mask)
            return rows.merge(
                self.attend(
                    rows.split(q), rows.split(k), rows.split(v), key_padding_mask=rows.padding, global_mask=None
                )
            )
        return efficient_attention(
            q, k, v, normalization=self.normalization, causal=self.is_causal, key_padding_mask=key_padding_mask
        )

    def attend_dense(self, q, k, v, *, key_padding_mask, global_mask, document_ids=None):
        """The n queries (the last n positions) against all m keys through the explicit `[b, h, n, m]` weights."""
        if document_ids is not None:
            rows = DocumentRows(document_ids, key_padding_mask)
            weights = efficient_attention_weights(
                rows.split(q),
                rows.split(k),
                normalization=self.normalization,
                causal=self.is_causal,
                key_padding_mask=rows.padding,
            )
            weights = rows.merge_weights(weights)
        else:
            weights = efficient_attention_weights(
                q, k, normalization=self.normalization, causal=self.is_causal, key_padding_mask=key_padding_mask
            )
        out = (weights @ v.to(weights.dtype)).to(q.dtype)
        return out, weights.to(q.dtype)
