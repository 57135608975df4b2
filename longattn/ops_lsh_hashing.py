"""Reformer LSH attention, step 1: hashing (Kitaev et al. 2020, "Reformer: The Efficient Transformer").

What `ops_lsh.lsh_attention` hashes with, and what its dense form and the kind (`attention_lsh`) share:

- `lsh_rotations`: random rotations `[h, d, r, Σ factors/2]` (transformers' layout), drawn from a seed or not;
- `lsh_buckets`: the bucket `argmax([x·R, -x·R])` of every vector of `[b, h, n, d]` in every round, `[b, h, r, n]`
  (angular LSH, Andoni et al. 2015; a factorised hash digit by digit), padding in an extra bucket after all others;
- `document_buckets`: the buckets of packed rows, one document per bucket;
- `default_num_buckets`, `hash_factors`: the bucket count per round (an even int, or even factors);
- `normalize_keys`: the shared-QK keys `x / sqrt(|x|² + d·eps)`, with a two-pass backward.

Shape legend as in `ops_lsh`: b batch, h heads, n length, d head dim, r hash rounds, nb buckets.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .patterns import document_index

__all__ = [
    "Buckets",
    "KEY_NORM_EPS",
    "default_num_buckets",
    "document_buckets",
    "hash_factors",
    "lsh_buckets",
    "lsh_rotations",
    "normalize_keys",
]

KEY_NORM_EPS = 1e-6
"""Epsilon of the shared-QK key normalisation `x / sqrt(|x|² + d·eps)` (transformers' convention)."""

# Rotated vectors are computed in slices of this many positions, so that `[b, h, r, n, nb/2]` never exists at once
# (at 32K tokens and 512 buckets it would take half a gigabyte).
_HASH_SLICE = 4096

Buckets = int | tuple[int, ...]
"""Buckets per round: an even int, or even factors whose product is the bucket count (a factorised hash)."""


def default_num_buckets(length: int, bucket_size: int) -> Buckets:
    """The paper's choice, about two buckets per chunk, with transformers' rule for large counts.

    The largest power of two <= 2·length/bucket_size (at least 2). Above 2·max(sqrt(length/bucket_size),
    bucket_size) the count is factorised into two powers of two (the bucket is the pair of two smaller hashes),
    which keeps the rotation, a `[d, Σ factors/2]` matmul per round, far cheaper than the attention itself.
    """
    exponent = max(1, (max(2, (2 * length) // bucket_size)).bit_length() - 1)
    limit = 2 * max(int(math.sqrt(length // bucket_size)), bucket_size)
    if 2**exponent <= limit:
        return 2**exponent
    return (2 ** (exponent // 2), 2 ** (exponent - exponent // 2))


def hash_factors(num_buckets: Buckets) -> tuple[int, ...]:
    factors = (num_buckets,) if not isinstance(num_buckets, (tuple, list)) else tuple(num_buckets)
    if not factors or any(not isinstance(f, int) or isinstance(f, bool) or f < 2 or f % 2 for f in factors):
        raise ValueError(f"num_buckets={num_buckets!r} is invalid: expected an even integer >= 2, or a tuple of them.")
    return factors


def lsh_rotations(
    *,
    heads: int,
    head_dim: int,
    num_hashes: int,
    num_buckets: Buckets,
    seed: int | None = None,
    device: torch.device | str | None = None,
    dtype: torch.dtype = torch.float32,
) -> Tensor:
    """Random rotations for angular LSH, `[h, d, r, Σ factors/2]` (transformers' layout).

    Drawn from a CPU generator seeded with `seed` (so that a seed gives the same rotations on every device, and
    the same as transformers' `ReformerConfig(hash_seed=seed)` in float32); from torch's global generator when
    `seed` is None (fresh rotations on every call, as in the paper).

    Raises:
        ValueError: `num_buckets` is not an even integer >= 2 (or a tuple of them).
    """
    shape = (heads, head_dim, num_hashes, sum(f // 2 for f in hash_factors(num_buckets)))
    if seed is None:
        return torch.randn(shape, device=device, dtype=dtype)
    generator = torch.Generator(device="cpu").manual_seed(seed)
    # device="cpu" explicitly: the generator is a CPU one, also under a `torch.device("meta")` context.
    return torch.randn(shape, generator=generator, dtype=dtype, device="cpu").to(device)


@torch.no_grad()
def lsh_buckets(
    qk: Tensor, rotations: Tensor, *, valid: Tensor | None = None, num_buckets: Buckets | None = None
) -> Tensor:
    """Bucket of every vector in every hash round: `argmax([x·R, -x·R])`, per factor when factorised.

    Args:
        qk: `[b, h, n, d]` shared query/key vectors (not normalised: the argmax does not depend on length).
        rotations: `[h or 1, d, r, Σ factors/2]`.
        valid: Optional bool `[b, n]`, False for padding: those tokens get the extra bucket `nb` (the product of
            the factors), after all others.
        num_buckets: The factors; None = one hash with `2 · rotations.shape[-1]` buckets.

    Returns:
        Long `[b, h, r, n]` in `[0, nb]`.

    Raises:
        ValueError: The factors do not match the size of the rotations.
    """
    b, h, n, _ = qk.shape
    factors = (2 * rotations.shape[-1],) if num_buckets is None else hash_factors(num_buckets)
    if sum(f // 2 for f in factors) != rotations.shape[-1]:
        raise ValueError(
            f"num_buckets={num_buckets!r} needs rotations with {sum(f // 2 for f in factors)} columns, "
            f"got {rotations.shape[-1]}."
        )
    rotations = rotations.to(device=qk.device, dtype=torch.float32).expand(h, -1, -1, -1)
    buckets = torch.zeros(b, h, rotations.shape[2], n, dtype=torch.long, device=qk.device)
    for start in range(0, n, _HASH_SLICE):
        stop = min(n, start + _HASH_SLICE)
        rotated = torch.einsum("bhnd,hdrk->bhrnk", qk[:, :, start:stop].float(), rotations)  # [b, h, r, n', Σf/2]
        column, stride = 0, 1
        for factor in factors:
            half = factor // 2
            part = rotated[..., column : column + half]
            top, top_index = part.max(dim=-1)
            bottom, bottom_index = part.min(dim=-1)
            # argmax over the concatenation [x, -x] without building it; ties go to the first half, as argmax
            # would. Factor i is digit i of the bucket number (transformers' order).
            buckets[..., start:stop] += stride * torch.where(top >= -bottom, top_index, bottom_index + half)
            column, stride = column + half, stride * factor
    if valid is not None:
        buckets.masked_fill_(~valid[:, None, None, :], math.prod(factors))
    return buckets


def document_buckets(buckets: Tensor, document_ids: Tensor, padding_bucket: int) -> tuple[Tensor, int]:
    """Buckets of packed rows that hold one document each: bucket `β · D + document` (D documents per row at most).

    Sorted, the tokens of a bucket are then grouped by document, and equal buckets mean the same document (what
    causal LSH, and routing's clusters, attend within). Padding keeps a bucket after all others.

    Args:
        buckets: Long `[b, h, r, n]` in `[0, padding_bucket]`.
        document_ids: Integer `[b, n]`, contiguous runs of one id per document.
        padding_bucket: The bucket of padding in `buckets`.

    Returns:
        `(buckets [b, h, r, n], padding bucket)`.
    """
    index = document_index(document_ids)  # [b, n], 0 .. D - 1
    documents = int(index.max()) + 1 if index.numel() else 1
    combined = buckets * documents + index[:, None, None, :]
    return torch.where(buckets == padding_bucket, padding_bucket * documents, combined), padding_bucket * documents


def _key_norm_factor(x: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """`(factor, mean_square)` of `normalize_keys` for rows `x [.., d]`: factor = (mean(x²) + eps)^(-1/2) / sqrt(d)."""
    mean_square = x.pow(2).mean(dim=-1, keepdim=True) + eps  # [.., 1]
    return torch.rsqrt(mean_square) / math.sqrt(x.shape[-1]), mean_square


class _NormalizeKeys(torch.autograd.Function):
    """`x / sqrt(|x|² + d·eps)` with a two-pass backward (autograd's chain of pow/mean/rsqrt/div took six)."""

    @staticmethod
    def forward(ctx, x, eps):
        factor, mean_square = _key_norm_factor(x, eps)
        ctx.save_for_backward(x, factor, mean_square)
        return x * factor

    @staticmethod
    def backward(ctx, grad):
        x, factor, mean_square = ctx.saved_tensors
        # y = x·s with s = (mean(x²) + eps)^(-1/2) / sqrt(d):  dx = s·(dy − x·(dy·x) / (d·(mean(x²) + eps)))
        dot = (grad * x).sum(dim=-1, keepdim=True)
        return (grad - x * (dot / (x.shape[-1] * mean_square))) * factor, None


def normalize_keys(qk: Tensor, eps: float = KEY_NORM_EPS) -> Tensor:
    """Keys of shared-QK attention: unit length, `x / sqrt(|x|² + d·eps)` (transformers' epsilon convention)."""
    return _NormalizeKeys.apply(qk, eps)
