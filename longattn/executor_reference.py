"""The reference back end: dense softmax attention under a materialised mask.

Shape legend: b batch, h heads, n length (n_q queries, n_k keys), d head dim (d_v for values).

`reference_attention` is the readable ground truth every other executor is tested against;
`reference_pattern_attention` is the `"reference"` back end of `longattn.ops`: it materialises a pattern predicate
(`patterns.materialize_mask`) and runs `reference_attention` under it. Both cost O(n_q · n_k) memory: for tests and
short sequences, never chosen by `"auto"`. Queries are the last n_q positions, as everywhere in the ops.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from .numerics import compute_dtype, hide_logits
from .ops_checks import check_bool_mask, check_dropout, check_flag, check_qkv, check_scale
from .patterns import MaskFn, materialize_mask
from .relative_logits import BiasFn, materialize_bias

__all__ = ["reference_attention", "reference_pattern_attention"]


def reference_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Tensor | None,
    *,
    scale: float | None = None,
    dropout_p: float = 0.0,
    return_weights: bool = False,
    bias: Tensor | None = None,
) -> Tensor | tuple[Tensor, Tensor]:
    """Dense softmax attention under an explicit mask: the readable reference every executor is tested against.

    Costs O(n_q · n_k) memory; use it for tests and short sequences.

    Args:
        q: Queries `[b, h, n_q, d]`.
        k: Keys `[b, h, n_k, d]`.
        v: Values `[b, h, n_k, d_v]`.
        mask: Bool broadcastable to `[b, h, n_q, n_k]`, True = visible (e.g. from `patterns.materialize_mask`);
            None = every key visible.
        scale: Multiplier of q·k; default 1/sqrt(d).
        dropout_p: Dropout on the attention probabilities.
        return_weights: Also return the probabilities the output was computed from (after dropout, as
            transformers' eager attention returns them).
        bias: Optional float broadcastable to `[b, h, n_q, n_k]`, added to the scaled scores (relative-position
            logits, `relative_logits.materialize_bias`); None = no bias.

    Returns:
        Output `[b, h, n_q, d_v]`, or `(output, probs)` with probs `[b, h, n_q, n_k]` when `return_weights`.

    Raises:
        ValueError: If q, k, v are not floating-point tensors of matching shapes, dtype and device, `mask` is not a
            bool tensor broadcastable to `[b, h, n_q, n_k]` on their device, `bias` is not a float tensor
            broadcastable to it, `scale` is not finite, or `dropout_p` is outside [0, 1).
    """
    b, h, n_q, n_k = check_qkv(q, k, v, queries_last=False)
    mask = check_bool_mask("mask", mask, device=q.device)
    if mask is not None:
        try:
            if mask.dim() > 4 or torch.broadcast_shapes(mask.shape, (b, h, n_q, n_k)) != (b, h, n_q, n_k):
                raise RuntimeError
        except RuntimeError:
            raise ValueError(
                f"mask must be broadcastable to [b, h, n_q, n_k] = {[b, h, n_q, n_k]}, got {tuple(mask.shape)}"
            ) from None
    if bias is not None and (
        not isinstance(bias, torch.Tensor)
        or not bias.is_floating_point()
        or bias.dim() > 4
        or any(size not in (1, full) for size, full in zip(bias.shape[::-1], (n_k, n_q, h, b)))
    ):
        shape = tuple(bias.shape) if isinstance(bias, torch.Tensor) else type(bias).__name__
        raise ValueError(
            f"bias must be a float tensor broadcastable to [b, h, n_q, n_k] = {[b, h, n_q, n_k]}, got {shape}"
        )
    dropout_p = check_dropout(dropout_p)
    scale = check_scale(scale, q.shape[-1])
    return_weights = check_flag("return_weights", return_weights)
    dtype = compute_dtype(q.dtype)
    scores = torch.matmul(q.to(dtype), k.to(dtype).transpose(-1, -2)) * scale  # [b, h, n_q, n_k]
    if bias is not None:
        scores = scores + bias.to(dtype)
    if mask is not None:
        # Exact for any logits; rows without visible keys stay finite and are zeroed just below.
        scores = hide_logits(scores, ~mask)
    probs = torch.softmax(scores, dim=-1)
    if mask is not None:
        probs = probs * mask
    dropped = F.dropout(probs, p=dropout_p) if dropout_p > 0 else probs
    out = torch.matmul(dropped, v.to(dtype)).to(q.dtype)
    return (out, dropped.to(q.dtype)) if return_weights else out


def reference_pattern_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    mask_fn: MaskFn,
    scale: float,
    dropout_p: float,
    per_head: bool,
    bias_fn: BiasFn | None = None,
) -> Tensor:
    """`reference_attention` under a pattern predicate materialised densely: the `"reference"` back end of the ops.

    Args:
        q: Queries `[b, h, n_q, d]`, the last n_q positions (n_q > n_k only in cross-attention, whose pattern does
            not read query positions).
        k: Keys `[b, h, n_k, d]`.
        v: Values `[b, h, n_k, d_v]`.
        mask_fn: The pattern predicate.
        scale: Multiplier of q·k.
        dropout_p: Dropout on the attention probabilities.
        per_head: The predicate reads the head index (per-head dilation or summary cells): materialise one mask
            per head instead of one shared by all.
        bias_fn: Optional logit bias of each pair (relative-position logits), materialised densely alike.

    Returns:
        Output `[b, h, n_q, d_v]`; a query that sees no key gets zeros.
    """
    b, h, n_q, _ = q.shape
    n_k = k.shape[2]
    mask = materialize_mask(
        mask_fn,
        batch=b,
        heads=h if per_head else 1,
        q_len=n_q,
        kv_len=n_k,
        q_offset=max(n_k - n_q, 0),
        device=q.device,
    )  # [b, h or 1, n_q, n_k]
    bias = None
    if bias_fn is not None:
        bias = materialize_bias(
            bias_fn, batch=b, heads=h, q_len=n_q, kv_len=n_k, q_offset=max(n_k - n_q, 0), device=q.device
        )
    return reference_attention(q, k, v, mask, scale=scale, dropout_p=dropout_p, bias=bias)
