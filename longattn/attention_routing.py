"""Routing attention (Roy et al. 2021, "Efficient Content-Based Sparse Attention with Routing Transformers"): the
`"routing"` kind.

The kind's settings, its centroids and their moving average, and its hook, which mixes routing heads with local
heads; the attention itself (online spherical k-means, balanced clusters, the causal form, the local heads' dense
form) is `ops_routing`'s, whose functions are importable from here too.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from transformers import initialization as init

from .attention_base import LongAttnAttention
from .ops import sliding_window_attention
from .ops_routing import cluster_statistics, local_attention_dense, routing_attention, routing_attention_dense
from .rank_sync import sum_over_ranks

__all__ = [
    "RoutingAttention",
    "routing_attention",
    "routing_attention_dense",
    "cluster_statistics",
]


# ---------------------------------------------------------------------------------------------- the module
class RoutingAttention(LongAttnAttention):
    """The `"routing"` kind: Routing Transformer attention, optionally mixed with local heads.

    Config fields (ints may be one value or one per layer):
        routing_num_clusters (64): centroids C per head; a balanced cluster holds ceil(n / C) queries and keys.
        routing_num_local_heads (0): the last heads of the layer use local attention instead (the paper mixes
            them, e.g. half the heads); must leave at least one routing head.
        routing_local_window (128): keys on each side (before, in a decoder) of a local head's query.
        routing_causal_window (None): causal layers: keys of its cluster a query sees at most (the most recent);
            None = ceil(max_position_embeddings / routing_num_clusters), the balanced size at full length.
        routing_ema_decay (0.999): decay of the centroids' moving average.

    Buffers: `centroids` `[routing heads, C, d]`, unit vectors, saved with the model.
    """

    attention_type = "routing"
    supports_packing = True
    settings = ("num_clusters", "num_local_heads", "local_window", "causal_window", "ema_decay")

    def __init__(self, config: Any, *, layer_idx: int, is_causal: bool):
        super().__init__(config, layer_idx=layer_idx, is_causal=is_causal)
        self.num_routing_heads = self.num_heads - self.num_local_heads
        if self.causal_window is None:  # the balanced cluster size at full length
            self.causal_window = -(-config.max_position_embeddings // self.num_clusters)
        self.register_buffer(
            "centroids", torch.empty(self.num_routing_heads, self.num_clusters, self.head_dim), persistent=True
        )
        self.reset_kind_parameters()

    def reset_kind_parameters(self) -> None:
        """Fresh centroids: random unit vectors (torch's global generator). Through `transformers.initialization`,
        so centroids loaded from a checkpoint are kept, and missing ones (a checkpoint of another kind) are drawn."""
        if self.centroids.device.type != "meta":
            init.copy_(self.centroids, F.normalize(torch.randn_like(self.centroids, dtype=torch.float32), dim=-1))

    @torch.no_grad()
    def update_centroids(self, sums: Tensor, counts: Tensor) -> None:
        """One step of the moving average: centroids move toward the mean of their members, then renormalise.

        Under `torch.distributed` the statistics are first summed over all ranks (`rank_sync.sum_over_ranks`), so
        every rank takes the same step, that of the whole global batch, and the centroids stay identical.

        Args:
            sums: `[hr, C, d]` sums of unit members (`cluster_statistics`: the members a centroid took).
            counts: `[hr, C]`; centroids without members stay where they are.
        """
        sums, counts = sum_over_ranks(sums, counts)
        has_members = counts > 0
        means = sums / counts.clamp(min=1).unsqueeze(-1)
        moved = F.normalize(self.ema_decay * self.centroids.float() + (1 - self.ema_decay) * means, dim=-1)
        self.centroids.copy_(torch.where(has_members.unsqueeze(-1), moved, self.centroids.float()))

    def _split(self, x: Tensor) -> tuple[Tensor, Tensor]:
        return x[:, : self.num_routing_heads], x[:, self.num_routing_heads :]

    def _route(self, attention, q_r, k_r, v_r, key_padding_mask, document_ids, dropout_p, **extra):
        """`attention` (`routing_attention` or its dense form) on the routing heads `[b, h_r, n, d]`, with this
        layer's centroids and settings."""
        return attention(
            q_r,
            k_r,
            v_r,
            self.centroids,
            causal=self.is_causal,
            causal_window=self.causal_window,
            key_padding_mask=key_padding_mask,
            scale=self.scale,
            dropout_p=dropout_p,
            document_ids=document_ids,
            relative_embedding=self.relative_weight,
            **extra,
        )

    def attend(self, q, k, v, *, key_padding_mask, global_mask, document_ids=None):
        dropout_p = self.active_dropout_p
        (q_r, q_l), (k_r, k_l), (v_r, v_l) = self._split(q), self._split(k), self._split(v)
        # The centroids move when the backward pass reaches this layer (see the module docstring).
        learn = self.training and q_r.requires_grad
        out = self._route(
            routing_attention,
            q_r,
            k_r,
            v_r,
            key_padding_mask,
            document_ids,
            dropout_p,
            return_statistics=learn,
            backend=self.backend,
        )
        if learn:
            out, (sums, counts) = out
            q_r.register_hook(lambda grad: self.update_centroids(sums, counts))
        if self.num_local_heads:
            local = sliding_window_attention(
                q_l,
                k_l,
                v_l,
                window=self.local_window,
                causal=self.is_causal,
                key_padding_mask=key_padding_mask,
                document_ids=document_ids,
                scale=self.scale,
                dropout_p=dropout_p,
                relative_embedding=self.relative_weight,
            )
            out = torch.cat([out, local], dim=1)
        return out

    def attend_dense(self, q, k, v, *, key_padding_mask, global_mask, document_ids=None):
        dropout_p = self.active_dropout_p
        (q_r, q_l), (k_r, k_l), (v_r, v_l) = self._split(q), self._split(k), self._split(v)
        out, weights = self._route(routing_attention_dense, q_r, k_r, v_r, key_padding_mask, document_ids, dropout_p)
        if self.num_local_heads:
            local, local_weights = local_attention_dense(
                q_l,
                k_l,
                v_l,
                window=self.local_window,
                causal=self.is_causal,
                key_padding_mask=key_padding_mask,  # checked by routing_attention_dense
                document_ids=document_ids,
                scale=self.scale,
                dropout_p=dropout_p,
                relative_embedding=self.relative_weight,
            )
            out = torch.cat([out, local], dim=1)
            weights = torch.cat([weights, local_weights], dim=1)
        return out, weights
