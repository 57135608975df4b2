"""Relative-position logits: a learned embedding of the clipped distance j − i, added to the logits as q·r.

Shape legend: b batch, h heads, n length (n_q queries, n_k keys), d head dim, M the largest distance told apart,
nb query blocks, c queries per block, m keys gathered per block.

Shaw et al. 2018 ("Self-Attention with Relative Position Representations") add to the logit of query i for key j
the content term q_i · r_{clip(j − i, −M, M)}, with 2M + 1 learned vectors r of width d shared by the heads; the
attention-augmented convolution (Bello et al. 2019) uses the same term in 2-D, unclipped, as
l_ij = q_iᵀ (k_j + r_{j − i}) / sqrt(d_k). longattn takes the 1-D form: the logit is scale · q_i · (k_j + r_δ)
with δ = clip(j − i, −M, M), so every distance beyond M on one side shares one vector (the clipping of Shaw et al.,
which keeps the table independent of the length).

Computed only on the pairs a pattern keeps. The O(n · M) table T = scale · q Rᵀ `[b, h, n_q, 2M + 1]` (one product
of the queries with the 2M + 1 vectors) is read per kept pair: the logit bias of (i, j) is T[b, h, i, δ + M]. That
read is a `BiasFn`, `(b, h, q_idx, kv_idx) -> float`, the additive twin of a pattern predicate (FlexAttention's
`score_mod` without the score): an executor evaluates it on the original positions of the queries and keys it
computes q·k for, exactly where it evaluates the pattern predicate, and adds it to those logits. The dense
reference materialises the same function (`materialize_bias`), so a fast executor is tested against the reference
with the same bias, and gradients reach q and r through the gather.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from .numerics import compute_dtype

__all__ = [
    "BiasFn",
    "block_bias",
    "check_relative_embedding",
    "materialize_bias",
    "relative_bias",
    "relative_bias_fn",
    "relative_logit_table",
]

BiasFn = Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]
"""`bias(b, h, q_idx, kv_idx) -> float` logit added to scale · q·k, on broadcastable index tensors (absolute
positions, queries the last n_q of n_k as everywhere in the ops).

A bias function may list the tensors it reads in an attribute `tensors` (`relative_bias_fn` lists its table): an
executor that evaluates the bias again in backward (`executor_block_sets.attend_block_sets`) returns their gradients
through that list; one without it is run in plain differentiable ops."""


def check_relative_embedding(embedding: Tensor | None, q: Tensor) -> Tensor | None:
    """Check a relative embedding `[2M + 1, d]` against q `[b, h, n_q, d]`; None stays None.

    Raises:
        ValueError: naming `relative_embedding`, its shape / dtype / device and what is expected.
    """
    if embedding is None:
        return None
    if not isinstance(embedding, Tensor) or not embedding.is_floating_point():
        raise ValueError(
            f"relative_embedding must be a floating-point tensor [2·max_distance + 1, d], got "
            f"{type(embedding).__name__ if not isinstance(embedding, Tensor) else embedding.dtype}."
        )
    d = q.shape[-1]
    if embedding.dim() != 2 or embedding.shape[0] % 2 != 1 or embedding.shape[1] != d:
        raise ValueError(
            f"relative_embedding must have shape [2·max_distance + 1, d={d}] (an odd number of rows), got "
            f"{tuple(embedding.shape)}."
        )
    if embedding.device != q.device:
        raise ValueError(f"relative_embedding is on {embedding.device}, q on {q.device}: expected the same device.")
    return embedding


def relative_logit_table(q: Tensor, embedding: Tensor, scale: float) -> Tensor:
    """T = scale · q Rᵀ: the relative term of every query for every clipped distance.

    Args:
        q: Queries `[b, h, n_q, d]`.
        embedding: r `[2M + 1, d]`, row δ + M for the distance δ = j − i in [−M, M].
        scale: Multiplier of the logits (the seed's 1/sqrt(d_k) applies to q·k and q·r alike).

    Returns:
        `[b, h, n_q, 2M + 1]` in the compute dtype of q (float32 for half inputs).
    """
    dtype = compute_dtype(q.dtype)
    return torch.matmul(q.to(dtype), embedding.to(dtype).t()) * scale


def relative_bias_fn(table: Tensor, *, q_offset: int) -> BiasFn:
    """The `BiasFn` reading `table` `[b, h, n_q, 2M + 1]` (from `relative_logit_table`) for queries at positions
    `q_offset … q_offset + n_q − 1`.

    Query positions outside that range (padding slots of a block layout, rolled rows) are clamped into it: their
    scores are hidden by the pattern anyway, and the read stays in bounds.
    """
    n_q, width = table.shape[2], table.shape[3]
    reach = (width - 1) // 2

    def relative_position_bias(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        distance = (kv_idx - q_idx).clamp(-reach, reach) + reach
        return table[b, h, (q_idx - q_offset).clamp(0, max(n_q - 1, 0)), distance]

    relative_position_bias.tensors = (table,)  # see `BiasFn`
    return relative_position_bias


def relative_bias(q: Tensor, embedding: Tensor | None, *, scale: float, kv_len: int) -> BiasFn | None:
    """The relative-position `BiasFn` of queries q `[b, h, n_q, d]`, the last n_q of `kv_len` positions (None
    without an embedding)."""
    if embedding is None:
        return None
    return relative_bias_fn(relative_logit_table(q, embedding, scale), q_offset=max(kv_len - q.shape[2], 0))


def materialize_bias(
    bias_fn: BiasFn, *, batch: int, heads: int, q_len: int, kv_len: int, q_offset: int, device: torch.device
) -> Tensor:
    """`bias_fn` on every (query, key) pair: `[b, h, n_q, n_k]`, O(n_q · n_k), for the dense reference (and for
    dense full attention, which computes every pair anyway)."""
    b = torch.arange(batch, device=device).view(batch, 1, 1, 1)
    h = torch.arange(heads, device=device).view(1, heads, 1, 1)
    q_idx = (q_offset + torch.arange(q_len, device=device)).view(1, 1, q_len, 1)
    kv_idx = torch.arange(kv_len, device=device).view(1, 1, 1, kv_len)
    return bias_fn(b, h, q_idx, kv_idx).expand(batch, heads, q_len, kv_len)


def block_bias(bias_fn: BiasFn, *, batch: int, heads: Tensor, q_pos: Tensor, kv_pos: Tensor) -> Tensor:
    """`bias_fn` on the original positions of blocked queries and gathered keys, as `evaluate_block_mask` takes
    them: the additive bias `attend_blocks` adds to the scores it computes, O(b · h · nb · c · m).

    Args:
        bias_fn: The bias.
        batch: Batch size b.
        heads: Long `[h]`, the original head index of each head slot.
        q_pos: Long `[b or 1, nb, c]`, position of each query slot.
        kv_pos: Long `[b or 1, nb or 1, m]` (or `[b, h, nb, m]`, one key set per head), position of each key.

    Returns:
        Float `[b, h, nb, c, m]`.
    """
    nb, c = q_pos.shape[1], q_pos.shape[2]
    b_idx = torch.arange(batch, device=q_pos.device).view(batch, 1, 1, 1, 1)
    h_idx = heads.view(1, -1, 1, 1, 1)
    q_idx = q_pos[:, None, :, :, None]  # [b|1, 1, nb, c, 1]
    kv_idx = kv_pos[:, None, :, None, :] if kv_pos.dim() == 3 else kv_pos[:, :, :, None, :]  # [b|1, 1|h, nb|1, 1, m]
    bias = bias_fn(b_idx, h_idx, q_idx, kv_idx)
    return bias.expand(batch, heads.shape[0], nb, c, kv_idx.shape[-1])
