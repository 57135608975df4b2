"""FlexAttention executor: `torch.nn.attention.flex_attention` with a block mask built from the pattern predicate.

Shape legend: b batch, h heads, n length (n_q queries, n_k keys), d head dim (d_v for values).

A longattn pattern is already what FlexAttention calls a `mask_mod`: a predicate `(b, h, q_idx, kv_idx) -> bool`
(`longattn.patterns`). `create_block_mask` evaluates it once per shape into a `BlockMask` (which 128 x 128 tiles
hold a visible key), and the kernel skips the empty tiles. Queries are the last n_q positions, so the predicate is
evaluated at `q_idx + n_k - n_q`.

- Block masks of predicates that read no tensor (sliding window, dilation, causality; named after their
  parameters by `longattn.patterns`) are cached per (name, shape, device); masks that read padding or global-token
  tensors are built per call.
- On CUDA the kernel (and the block-mask construction) is compiled once with `torch.compile`; a new length
  triggers one more compilation with symbolic lengths (torch.compile's default dynamic-shape policy).
- A banded predicate (a sliding window, `patterns.mask_reach`) gets its block mask from the tiles near the
  diagonal only, O(n · reach) work; `create_block_mask` would evaluate every (query, key) pair, which at 1M tokens
  takes longer than the attention itself. Other predicates go through `create_block_mask`.
- On CPU FlexAttention runs eagerly, forward only: it has no backward there (the dispatcher says so when inputs
  require grad), and its eager form computes the dense score matrix, so it is a check, not a fast path.

Tiles are 128 wide, so a dilated or strided pattern, whose visible keys are spread over every tile, skips nothing
here; `executor_xformers` permutes such patterns into dense bands instead.
"""

from __future__ import annotations

import functools
import importlib.util
import warnings
from collections import OrderedDict
from collections.abc import Hashable

import torch
from torch import Tensor

from .patterns import MaskFn, mask_reach
from .relative_logits import BiasFn

__all__ = [
    "flex_pattern_attention",
    "block_mask",
    "banded_block_mask",
    "clear_block_mask_cache",
    "unavailable_reasons",
]

_CACHE_SIZE = 32
BLOCK_SIZE = 128
"""FlexAttention's tile size (its default `_DEFAULT_SPARSE_BLOCK_SIZE`)."""
_BLOCK_MASKS: OrderedDict[Hashable, object] = OrderedDict()


# Read once at import (a search, not an import): `torch.compile` then reads a constant instead of tracing a check.
_FLEX_FOUND = importlib.util.find_spec("torch.nn.attention.flex_attention") is not None


def unavailable_reasons() -> list[str]:
    """Why FlexAttention cannot be used with this torch (empty when it can)."""
    return (
        [] if _FLEX_FOUND else [f"torch {torch.__version__} has no FlexAttention (torch.nn.attention.flex_attention)"]
    )


def _flex():
    from torch.nn.attention import flex_attention as flex  # noqa: PLC0415

    return flex


@functools.lru_cache(maxsize=None)
def _compiled_flex_attention():
    # Default dynamic-shape policy: a second length recompiles once with symbolic lengths instead of once per length
    # (which would reach dynamo's recompile limit and fall back to the dense eager path).
    return torch.compile(_flex().flex_attention)


def clear_block_mask_cache() -> None:
    """Forget every cached block mask."""
    _BLOCK_MASKS.clear()


def block_mask(
    mask_fn: MaskFn,
    *,
    batch: int | None,
    heads: int | None,
    q_len: int,
    kv_len: int,
    device: torch.device,
    cache_key: Hashable | None = None,
):
    """The FlexAttention `BlockMask` of a pattern, queries being the last `q_len` of `kv_len` positions.

    Args:
        mask_fn: The pattern predicate over absolute positions.
        batch: b when the predicate depends on the batch row (padding, global tokens), else None.
        heads: h when it depends on the head (per-head dilation), else None.
        q_len: n_q.
        kv_len: n_k.
        device: Device of the mask.
        cache_key: A key naming the predicate (e.g. its `__name__`); None = do not cache (the predicate reads
            tensors that change from call to call).

    Returns:
        The `BlockMask`.
    """
    key = None if cache_key is None else (cache_key, batch, heads, q_len, kv_len, str(device))
    if key is not None and key in _BLOCK_MASKS:
        _BLOCK_MASKS.move_to_end(key)
        return _BLOCK_MASKS[key]
    q_offset = kv_len - q_len

    def mask_mod(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return mask_fn(b, h, q_idx + q_offset, kv_idx)

    mask_mod.__name__ = getattr(mask_fn, "__name__", "mask_mod")
    reach = mask_reach(mask_fn)
    if reach is not None:
        result = banded_block_mask(
            mask_mod, batch=batch, heads=heads, q_len=q_len, kv_len=kv_len, reach=reach, device=device
        )
    else:
        result = _flex().create_block_mask(
            mask_mod, batch, heads, q_len, kv_len, device=device, _compile=device.type == "cuda"
        )
    if key is not None:
        _BLOCK_MASKS[key] = result
        while len(_BLOCK_MASKS) > _CACHE_SIZE:
            _BLOCK_MASKS.popitem(last=False)
    return result


def banded_block_mask(
    mask_mod: MaskFn,
    *,
    batch: int | None,
    heads: int | None,
    q_len: int,
    kv_len: int,
    reach: int,
    device: torch.device,
    block_size: int = BLOCK_SIZE,
    max_elements: int = 2**26,
):
    """The `BlockMask` of a predicate whose visible pairs satisfy `|q_idx + n_k - n_q - kv_idx| <= reach`.

    Query tile i can only see the key tiles that overlap positions `[i·B + offset - reach, (i+1)·B - 1 + offset +
    reach]`, about `2·reach / B + 2` of them, so only those tiles are evaluated (in chunks of at most
    `max_elements` predicate calls): O(n · reach) work instead of `create_block_mask`'s O(n_q · n_k). A tile is
    full when every pair in it is visible (tiles cut by the sequence end are never full), partial when some are.
    The result equals `create_block_mask`'s (the tests compare them).

    Args:
        mask_mod: Predicate over (b, h, q_idx, kv_idx) with queries counted from 0 (offset applied inside).
        batch: b when the predicate reads the batch index, else None (one mask broadcast over the batch).
        heads: h when it reads the head index, else None.
        q_len: n_q.
        kv_len: n_k.
        reach: The band, in positions.
        device: Device of the mask.
        block_size: Tile size B (FlexAttention's default 128).
        max_elements: Predicate evaluations per chunk (bounds the temporary memory).

    Returns:
        The `BlockMask`.
    """
    q_offset = kv_len - q_len
    n_batch, n_heads = batch or 1, heads or 1
    q_tiles, kv_tiles = -(-q_len // block_size), -(-kv_len // block_size)
    tile = torch.arange(q_tiles, device=device)
    first = ((tile * block_size + q_offset - reach).clamp(min=0) // block_size).clamp(max=kv_tiles - 1)
    last_query = torch.clamp((tile + 1) * block_size - 1, max=q_len - 1) + q_offset
    last = ((last_query + reach) // block_size).clamp(max=kv_tiles - 1)
    width = int((last - first).max()) + 1  # candidate key tiles per query tile
    candidates = first[:, None] + torch.arange(width, device=device)  # [Q, C]
    real_candidate = candidates <= last[:, None]
    candidates = candidates.clamp(max=kv_tiles - 1)

    offsets = torch.arange(block_size, device=device)
    b = torch.arange(n_batch, device=device).view(-1, 1, 1, 1, 1, 1)
    h = torch.arange(n_heads, device=device).view(1, -1, 1, 1, 1, 1)
    partial = torch.zeros(n_batch, n_heads, q_tiles, kv_tiles, dtype=torch.int32, device=device)
    full = torch.zeros_like(partial)
    chunk = max(1, max_elements // (n_batch * n_heads * width * block_size * block_size))
    for start in range(0, q_tiles, chunk):
        rows = slice(start, min(start + chunk, q_tiles))
        q_idx = (tile[rows, None] * block_size + offsets).view(1, 1, -1, 1, block_size, 1)  # [1, 1, Qc, 1, B, 1]
        kv_idx = (candidates[rows, :, None] * block_size + offsets).view(1, 1, *candidates[rows].shape, 1, block_size)
        in_range = (q_idx < q_len) & (kv_idx < kv_len)
        # Out-of-range positions are clamped before the predicate sees them (it may index tensors with them).
        visible = mask_mod(b, h, q_idx.clamp(max=q_len - 1), kv_idx.clamp(max=kv_len - 1)) & in_range
        visible = visible.expand(n_batch, n_heads, *visible.shape[2:])  # [b, h, Qc, C, B, B]
        any_visible = visible.any(dim=(-1, -2)) & real_candidate[rows]
        all_visible = visible.all(dim=(-1, -2)) & real_candidate[rows]
        index = candidates[rows].expand(n_batch, n_heads, -1, -1)
        # Clamped duplicates of a real candidate only add zeros.
        full[:, :, rows].scatter_add_(-1, index, all_visible.int())
        partial[:, :, rows].scatter_add_(-1, index, (any_visible & ~all_visible).int())
    kv_num_blocks, kv_indices = _ordered(partial)
    full_kv_num_blocks, full_kv_indices = _ordered(full)
    return _flex().BlockMask.from_kv_blocks(
        kv_num_blocks,
        kv_indices,
        full_kv_num_blocks,
        full_kv_indices,
        BLOCK_SIZE=block_size,
        mask_mod=mask_mod,
        seq_lengths=(q_len, kv_len),
    )


def _ordered(dense: Tensor) -> tuple[Tensor, Tensor]:
    """Tile flags `[b, h, Q, K]` -> (count per row, the flagged tile indices first): BlockMask's ordered form."""
    flags = (dense > 0).to(torch.int32)
    indices = torch.argsort(flags, dim=-1, descending=True, stable=True)
    return flags.sum(dim=-1, dtype=torch.int32), indices.to(torch.int32)


def flex_pattern_attention(
    q: Tensor, k: Tensor, v: Tensor, *, mask_fn: MaskFn, scale: float, per_batch: bool = False,
    per_head: bool = False, cache_key: Hashable | None = None, bias_fn: BiasFn | None = None,
) -> Tensor:  # fmt: skip
    """Attention under a pattern predicate through FlexAttention: what `executor_reference.reference_pattern_attention`
    computes densely (no dropout), `[b, h, n_q, d_v]`.

    Args:
        q, k, v, mask_fn, scale: As in `reference_pattern_attention` (q: the last n_q positions).
        per_batch: The predicate reads the batch index (padding or global-token masks).
        per_head: The predicate reads the head index (per-head dilation).
        cache_key: Names a predicate that reads no tensor, so its block mask is cached; None = build per call.
        bias_fn: Optional logit bias of each pair (relative-position logits), FlexAttention's `score_mod`.

    Returns:
        The output, as `reference_pattern_attention`'s (zeros for a query that sees no key).
    """
    b, h, n_q, _ = q.shape
    n_k = k.shape[2]
    mask = block_mask(
        mask_fn,
        batch=b if per_batch else None,
        heads=h if per_head else None,
        q_len=n_q,
        kv_len=n_k,
        device=q.device,
        cache_key=cache_key,
    )
    score_mod = None
    if bias_fn is not None:
        q_offset = n_k - n_q

        def score_mod(score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
            return score + bias_fn(b, h, q_idx + q_offset, kv_idx).to(score.dtype)

    if q.device.type == "cuda":
        return _compiled_flex_attention()(q, k, v, block_mask=mask, scale=scale, score_mod=score_mod)
    if not torch.is_grad_enabled():
        # FlexAttention refuses CPU inputs that require grad even when no graph is being recorded.
        q, k, v = q.detach(), k.detach(), v.detach()
    with warnings.catch_warnings():
        # Eager FlexAttention warns that it is not compiled; on CPU that is the documented mode of this executor.
        warnings.filterwarnings("ignore", message=".*flex_attention.*compil.*", category=UserWarning)
        return _flex().flex_attention(q, k, v, block_mask=mask, scale=scale, score_mod=score_mod)
