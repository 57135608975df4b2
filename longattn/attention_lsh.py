"""The `"lsh"` attention kind: Reformer's LSH self-attention (Kitaev et al. 2020) as a layer.

The mechanism, its conventions (shared with transformers' `ReformerModel`) and the causal design are described in
`ops_lsh`, which holds the functional `lsh_attention` and its dense reference; this module adds the config fields,
their validation, the shared query/key projection and the rotations of a layer.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from transformers import initialization as init
from transformers.utils import logging

from .attention_base import LongAttnAttention
from .ops_lsh import default_num_buckets, hash_factors, lsh_attention, lsh_attention_dense, lsh_rotations
from .rank_sync import same_on_every_rank

__all__ = ["LSHAttention", "layer_seed"]

logger = logging.get_logger(__name__)


def layer_seed(seed: int, layer_idx: int, *, decoder_offset: int = 0) -> int:
    """The seed of one layer's eval rotations: `lsh_seed + layer_idx` (+ `num_hidden_layers` in a seq2seq decoder),
    so that layers hash differently while layer 0 keeps `lsh_seed` itself (transformers' `hash_seed`)."""
    return seed + decoder_offset + layer_idx


# ---------------------------------------------------------------------------------------------- the module
class LSHAttention(LongAttnAttention):
    """The `"lsh"` kind: Reformer's LSH self-attention with shared query/key projection.

    Config fields (ints may be one value or one per layer):
        lsh_num_hashes (2): hash rounds.
        lsh_bucket_size (64): chunk length of the sorted sequence (transformers' `lsh_attn_chunk_length`).
        lsh_num_buckets (None): buckets per round, even; None = `default_num_buckets(max_position_embeddings,
            lsh_bucket_size)` (factorised into two hashes when large, like transformers), fixed per model so that
            padding and caching do not change the hashing.
        lsh_num_chunks_before (1), lsh_num_chunks_after (0): neighbouring chunks a chunk also attends to (causal
            layers look back only, and need at least one chunk before).
        lsh_seed (None): seed of the eval rotations: layer i draws them with `layer_seed(lsh_seed, i)`; None
            draws them from torch's generator when the model is created.

    Rotations: in training every call draws fresh ones (the paper: the model learns to be robust to the hashing),
    the same on every rank of a data-parallel run (rank 0's draw, `rank_sync.same_on_every_rank`), so that a global
    batch split across processes is hashed as one process would hash it; in eval the layer uses its own fixed
    rotations, the persistent buffer `eval_rotations` `[h, d, r, Σ factors/2]`, saved with the model, so that eval
    outputs are deterministic, survive a save/reload, and cached decoding equals the full forward pass. A checkpoint
    without that buffer (saved before it existed, or by another attention kind) gets new eval rotations on load, with
    a warning. Explicit rotations `[h, d, r, nb/2]` (e.g. taken from transformers) can be set with `set_rotations`;
    they override both. The layer has `q_proj` (queries and keys), `v_proj` and `o_proj`, but no `k_proj`.
    """

    attention_type = "lsh"
    supports_packing = True
    settings = ("num_hashes", "bucket_size", "num_buckets", "num_chunks_before", "num_chunks_after")

    def __init__(self, config: Any, *, layer_idx: int, is_causal: bool):
        super().__init__(config, layer_idx=layer_idx, is_causal=is_causal)
        # Shared-QK: the key projection is q_proj; a separate k_proj would get no gradient.
        del self.k_proj
        if self.num_buckets is None:
            self.num_buckets = default_num_buckets(config.max_position_embeddings, self.bucket_size)
        self.seed = (
            None
            if config.lsh_seed is None
            else layer_seed(
                config.lsh_seed,
                layer_idx,
                decoder_offset=config.num_hidden_layers if is_causal and config.is_encoder_decoder else 0,
            )
        )
        self.rotations: Tensor | None = None
        columns = sum(factor // 2 for factor in hash_factors(self.num_buckets))
        self.register_buffer("eval_rotations", torch.empty(self.num_heads, self.head_dim, self.num_hashes, columns))
        # transformers' `from_pretrained` builds the model on the meta device, then fills what the checkpoint
        # holds: a buffer still to initialise after that was missing from the checkpoint (see reset_kind_parameters).
        self._built_for_loading = self.eval_rotations.is_meta
        self.reset_kind_parameters()

    @torch.no_grad()
    def reset_kind_parameters(self) -> None:
        """Draw the eval rotations (from this layer's seed, or from torch's generator without `lsh_seed`); kept
        when loaded from a checkpoint."""
        if getattr(self.eval_rotations, "_is_hf_initialized", False):
            return
        if self._built_for_loading and not self.eval_rotations.is_meta:
            logger.warning(
                f"LSH layer {self.layer_idx}: the checkpoint has no `eval_rotations` (it was saved before LSH layers "
                "kept fixed eval rotations, or by another attention kind), so new ones were drawn"
                f"{'' if self.seed is None else f' from lsh_seed (layer seed {self.seed})'}: its eval outputs differ "
                "from those it gave before. Save the model again to keep these."
            )
        init.copy_(self.eval_rotations, self._draw_rotations(seed=self.seed, device="cpu"))

    def _draw_rotations(self, *, seed: int | None, device: torch.device | str) -> Tensor:
        """Rotations `[h, d, r, Σ factors/2]` of this layer's shape, from `seed` (None: torch's generator)."""
        h, d, r = self.num_heads, self.head_dim, self.num_hashes
        return lsh_rotations(heads=h, head_dim=d, num_hashes=r, num_buckets=self.num_buckets, seed=seed, device=device)

    def set_rotations(self, rotations: Tensor | None) -> None:
        """Use these rotations `[h or 1, d, r, Σ factors/2]` instead of seeded or random ones (None: back to those).

        Raises:
            ValueError: The shape does not fit the layer.
        """
        columns = sum(factor // 2 for factor in hash_factors(self.num_buckets))
        if rotations is not None and (
            rotations.dim() != 4
            or rotations.shape[0] not in (1, self.num_heads)
            or rotations.shape[1] != self.head_dim
            or rotations.shape[3] != columns
        ):
            raise ValueError(
                f"rotations must have shape [{self.num_heads} or 1, {self.head_dim}, num_hashes, {columns}] "
                f"(num_buckets={self.num_buckets!r}), got {tuple(rotations.shape)}."
            )
        self.rotations = rotations

    def current_rotations(self, device: torch.device) -> Tensor:
        """The rotations of this call: explicit, else fresh in training, else the layer's fixed eval rotations."""
        if self.rotations is not None:
            return self.rotations.to(device)
        if self.training:
            rotations = self._draw_rotations(seed=None, device=device)
            # Each rank's generator is its own (dropout differs per process): hash with rank 0's draw everywhere.
            return same_on_every_rank(rotations)
        return self.eval_rotations.to(device)

    def project(self, hidden_states):
        qk = self.split_heads(self.q_proj(hidden_states))  # [b, h, n, d]
        return qk, qk, self.split_heads(self.v_proj(hidden_states))

    def _pattern(self, device: torch.device) -> dict[str, Any]:
        """The settings `lsh_attention` and its dense form share, with this call's rotations."""
        return dict(
            rotations=self.current_rotations(device),
            bucket_size=self.bucket_size,
            num_buckets=self.num_buckets,
            num_chunks_before=self.num_chunks_before,
            num_chunks_after=self.num_chunks_after,
            **self.layer_arguments("causal", "dropout_p", "relative_embedding"),
        )

    def attend(self, q, k, v, *, key_padding_mask, global_mask, document_ids=None):
        return lsh_attention(
            q,
            v,
            num_hashes=self.num_hashes,
            key_padding_mask=key_padding_mask,
            backend=self.backend,
            document_ids=document_ids,
            **self._pattern(q.device),
        )

    def attend_dense(self, q, k, v, *, key_padding_mask, global_mask, document_ids=None):
        return lsh_attention_dense(
            q, k, v, key_padding_mask=key_padding_mask, document_ids=document_ids, **self._pattern(q.device)
        )
