"""Attention patterns as pure mask predicates: which keys may each query see?

Shape legend: b batch, h heads, n length (q_len / kv_len when they differ).

A pattern is a `MaskFn`: `mask_fn(b, h, q_idx, kv_idx) -> bool tensor`, where the four arguments are int64 index
tensors that broadcast against each other (e.g. `b` `[b, 1, 1, 1]`, `h` `[1, h, 1, 1]`, `q_idx` `[1, 1, n, 1]`,
`kv_idx` `[1, 1, 1, n]`) and the result broadcasts to their common shape. A predicate only reads positions, so the
same definition feeds every executor: `materialize_mask` builds the dense reference mask from it, and the blocked
executors (`longattn.executor_chunks.evaluate_block_mask`) evaluate it on the original positions of the keys they
gathered per block.
Predicates compose with `and_masks` / `or_masks`; padding, causality and global tokens are just more predicates.

This module depends on torch only (no other longattn module), so every layer above may import it.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

__all__ = [
    "MaskFn",
    "causal_mask",
    "sliding_window_mask",
    "key_padding_predicate",
    "global_token_mask",
    "and_masks",
    "or_masks",
    "sliding_window_pattern",
    "materialize_mask",
    "check_window",
    "check_dilation",
    "check_stride",
    "check_fixed_sizes",
    "strided_mask",
    "fixed_mask",
    "strided_pattern",
    "fixed_pattern",
    "first_real_token",
    "from_first_real_token",
    "mask_period",
    "mask_reach",
    "periodic",
    "same_document_mask",
    "document_starts",
    "document_index",
    "document_layout",
    "DocumentRows",
    "from_document_start",
    "within_documents",
]

MaskFn = Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]
"""`(b, h, q_idx, kv_idx)` broadcastable int64 index tensors -> bool tensor, True = the query may see the key."""


def _named(fn: MaskFn, name: str, *, reach: int | None = None, period: int | None = None) -> MaskFn:
    fn.__name__ = name
    fn.__qualname__ = name
    fn.reach = reach
    fn.period = period
    return fn


def periodic(mask_fn: MaskFn, period: int) -> MaskFn:
    """Declare (on mask_fn itself, which it returns) that shifting both positions by a multiple of `period` never
    changes the predicate: `mask_fn(b, h, q + s·period, kv + s·period) == mask_fn(b, h, q, kv)` for every integer s.
    See `mask_period`."""
    mask_fn.period = period
    return mask_fn


def mask_period(mask_fn: MaskFn) -> int | None:
    """The shift a predicate is invariant under (see `periodic`): 1 for predicates of the distance q − kv alone
    (causal, strided), the block length for block patterns (fixed); None = not known (anything that reads a
    position-indexed tensor, e.g. padding or documents). `and_masks` / `or_masks` keep the least common multiple of
    their parts' periods, None as soon as one part has none. Executors use it to evaluate a predicate once per
    distinct block of a layout (`executor_block_sets`)."""
    return getattr(mask_fn, "period", None)


def mask_reach(mask_fn: MaskFn) -> int | None:
    """The band a predicate stays inside: every visible pair has `|q_pos - kv_pos| <= reach`; None = unbounded.

    Sliding windows declare it (window x dilation); `and_masks` keeps the narrowest band of its parts and
    `or_masks` the widest, unbounded as soon as one part is (global tokens). Executors use it to look for visible
    keys only near the diagonal (e.g. FlexAttention's block mask in O(n · reach) instead of O(n²)).
    """
    return getattr(mask_fn, "reach", None)


def _check_positive_int(value: int, name: str, meaning: str) -> int:
    """`value` if it is an int >= 1 (a bool is not).

    Raises:
        ValueError: Otherwise, naming the argument `name`, the value and what it means (`meaning`).
    """
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an int >= 1 ({meaning}), got {value!r}")
    return value


def check_window(window: int, *, name: str = "window") -> int:
    """Validate a window (keys on each side of a query): an int >= 1, else a ValueError naming `name`."""
    return _check_positive_int(window, name, "keys on each side of a query")


def check_dilation(
    dilation: int | Sequence[int], *, heads: int | None = None, name: str = "dilation"
) -> int | tuple[int, ...]:
    """Validate a dilation: one int for all heads, or one int per head.

    Args:
        dilation: Gap between attended keys, >= 1; or a sequence with one such value per head.
        heads: When given, a per-head sequence must have exactly this many entries.
        name: Argument name used in the error message.

    Returns:
        An int, or a tuple of ints (one per head).

    Raises:
        ValueError: If a value is not an int >= 1, the sequence is empty, or its length differs from `heads`.
    """
    if isinstance(dilation, Sequence) and not isinstance(dilation, (str, bytes)):
        values = tuple(dilation)
        if not values:
            raise ValueError(
                f"{name} must be an int >= 1 or a non-empty sequence of them (one per head), got {dilation!r}"
            )
        for value in values:
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} entries must be ints >= 1, got {dilation!r}")
        if heads is not None and len(values) != heads:
            raise ValueError(
                f"{name} has one entry per head: expected {heads} entries (the number of heads), got {len(values)}: "
                f"{list(values)}"
            )
        return values
    if isinstance(dilation, bool) or not isinstance(dilation, int) or dilation < 1:
        raise ValueError(f"{name} must be an int >= 1 or a sequence of them (one per head), got {dilation!r}")
    return dilation


def causal_mask() -> MaskFn:
    """A query sees itself and the keys before it: `kv_idx <= q_idx`.

    Returns:
        A `MaskFn` named `causal`.
    """

    def causal(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return kv_idx <= q_idx

    return _named(causal, "causal", period=1)


def sliding_window_mask(window: int, dilation: int | Sequence[int] = 1) -> MaskFn:
    """Longformer's (dilated) sliding window: a query sees `window` keys on each side, `dilation` apart.

    `|i - j| <= window * dilation` and `|i - j| % dilation == 0`. Query i therefore sees 2·window + 1 keys
    (fewer at the edges). Window 2, dilation 1 (left) and dilation 2 (right), 7 tokens (row = query, column = key):

        ■ ■ ■ ⬚ ⬚ ⬚ ⬚        ■ ⬚ ■ ⬚ ■ ⬚ ⬚
        ■ ■ ■ ■ ⬚ ⬚ ⬚        ⬚ ■ ⬚ ■ ⬚ ■ ⬚
        ■ ■ ■ ■ ■ ⬚ ⬚        ■ ⬚ ■ ⬚ ■ ⬚ ■
        ⬚ ■ ■ ■ ■ ■ ⬚        ⬚ ■ ⬚ ■ ⬚ ■ ⬚
        ⬚ ⬚ ■ ■ ■ ■ ■        ■ ⬚ ■ ⬚ ■ ⬚ ■
        ⬚ ⬚ ⬚ ■ ■ ■ ■        ⬚ ■ ⬚ ■ ⬚ ■ ⬚
        ⬚ ⬚ ⬚ ⬚ ■ ■ ■        ⬚ ⬚ ■ ⬚ ■ ⬚ ■

    Args:
        window: Keys on each side of the query, >= 1.
        dilation: Gap between attended keys, >= 1; a sequence gives one dilation per head (indexed by `h`),
            so heads can mix local and long-range context as in the Longformer paper.

    Returns:
        A `MaskFn` named `sliding_window_{window}` (with `_dilated_{dilation}` when dilation is not 1).

    Raises:
        ValueError: If `window` or `dilation` is not >= 1.
    """
    window = check_window(window)
    dilation = check_dilation(dilation)

    if isinstance(dilation, int) and dilation == 1:

        def sliding_window(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
            return (q_idx - kv_idx).abs() <= window

        return _named(sliding_window, f"sliding_window_{window}", reach=window)

    if isinstance(dilation, int):
        reach = window * dilation

        def dilated_sliding_window(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
            distance = (q_idx - kv_idx).abs()
            return (distance <= reach) & (distance % dilation == 0)

        return _named(dilated_sliding_window, f"sliding_window_{window}_dilated_{dilation}", reach=reach)

    def per_head_dilated_sliding_window(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        # A chain of scalar `where`s, not an index into a captured tensor: the predicate stays pointwise, which
        # compiled FlexAttention needs (a captured tensor is a host buffer it cannot read inside the kernel).
        head_dilation = h * 0 + dilation[0]
        for head, value in enumerate(dilation[1:], start=1):
            if value != dilation[0]:
                head_dilation = torch.where(h == head, value, head_dilation)
        distance = (q_idx - kv_idx).abs()
        return (distance <= window * head_dilation) & (distance % head_dilation == 0)

    name = "_".join(str(value) for value in dilation)
    return _named(
        per_head_dilated_sliding_window, f"sliding_window_{window}_dilated_{name}", reach=window * max(dilation)
    )


def _token_flags(name: str, mask: Tensor) -> Tensor:
    """A `[b, n]` per-token mask as bool; `ValueError` naming `name` for another rank."""
    if mask.dim() != 2:
        raise ValueError(f"{name} must have shape [batch, length], got {tuple(mask.shape)}")
    return mask.bool()


def key_padding_predicate(key_padding_mask: Tensor) -> MaskFn:
    """Keys that are real tokens (not padding) are visible.

    Args:
        key_padding_mask: Bool `[b, n]`, True = real token.

    Returns:
        A `MaskFn` named `key_padding` that reads `key_padding_mask[b, kv_idx]`.

    Raises:
        ValueError: If `key_padding_mask` is not 2-D.
    """
    padding = _token_flags("key_padding_mask", key_padding_mask)

    def key_padding(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return padding[b, kv_idx]

    return _named(key_padding, "key_padding")


def global_token_mask(global_mask: Tensor) -> MaskFn:
    """Longformer's symmetric global attention: a global query sees every key, every query sees a global key.

    Args:
        global_mask: Bool `[b, n]`, True = global token.

    Returns:
        A `MaskFn` named `global_tokens`: `global_mask[b, q_idx] | global_mask[b, kv_idx]`.

    Raises:
        ValueError: If `global_mask` is not 2-D.
    """
    is_global = _token_flags("global_mask", global_mask)

    def global_tokens(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return is_global[b, q_idx] | is_global[b, kv_idx]

    return _named(global_tokens, "global_tokens")


def _fold_masks(mask_fns: tuple[MaskFn, ...], *, every: bool, reach: int | None) -> MaskFn:
    """The predicates' AND (`every`, True with no predicate) or OR (False with no predicate), named `and(...)` /
    `or(...)` after its parts."""
    combine = operator.and_ if every else operator.or_

    def folded(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        if not mask_fns:
            return torch.full((), every, dtype=torch.bool, device=q_idx.device)
        result = mask_fns[0](b, h, q_idx, kv_idx)
        for fn in mask_fns[1:]:
            result = combine(result, fn(b, h, q_idx, kv_idx))
        return result

    name = ("and(" if every else "or(") + ", ".join(fn.__name__ for fn in mask_fns) + ")"
    periods = [mask_period(fn) for fn in mask_fns]
    period = None if None in periods else math.lcm(*periods)
    return _named(folded, name, reach=reach, period=period)


def and_masks(*mask_fns: MaskFn) -> MaskFn:
    """A key is visible when every predicate in `mask_fns` allows it (no predicate: everything is visible).

    Returns:
        A `MaskFn` named `and(...)` after its parts, in the narrowest band of theirs.
    """
    bounded = [reach for reach in map(mask_reach, mask_fns) if reach is not None]
    return _fold_masks(mask_fns, every=True, reach=min(bounded) if bounded else None)


def or_masks(*mask_fns: MaskFn) -> MaskFn:
    """A key is visible when any predicate in `mask_fns` allows it; with none, nothing is: a `MaskFn` named
    `or(...)` after its parts, unbounded as soon as one part is."""
    reaches = [mask_reach(fn) for fn in mask_fns]
    return _fold_masks(mask_fns, every=False, reach=None if not reaches or None in reaches else max(reaches))


def sliding_window_pattern(
    *,
    window: int,
    dilation: int | Sequence[int] = 1,
    causal: bool = False,
    global_mask: Tensor | None = None,
    key_padding_mask: Tensor | None = None,
    document_ids: Tensor | None = None,
) -> MaskFn:
    """The full Longformer pattern: `(sliding window OR global tokens) AND causal? AND real key? AND same document?`.

    Causality is applied after the global union on purpose: in a causal model a global token still cannot see the
    future, and a query still cannot see a later global token. Likewise the document test comes after the union: a
    global token is global within its own document only.

    Args:
        window: Keys on each side of a query, >= 1.
        dilation: Gap between attended keys (int, or one per head).
        causal: Restrict every query to keys at or before its position.
        global_mask: Optional bool `[b, n]`, True = global token.
        key_padding_mask: Optional bool `[b, n]`, True = real token.
        document_ids: Optional integer `[b, n]`, the document of each token in a packed row (`same_document_mask`).

    Returns:
        The composed `MaskFn`.

    Raises:
        ValueError: For an invalid window, dilation or mask rank.
    """
    local = sliding_window_mask(window, dilation)
    if global_mask is not None:
        local = or_masks(local, global_token_mask(global_mask))
    return _restricted(local, causal=causal, key_padding_mask=key_padding_mask, document_ids=document_ids)


def _restricted(
    mask_fn: MaskFn, *, causal: bool, key_padding_mask: Tensor | None, document_ids: Tensor | None = None
) -> MaskFn:
    """`mask_fn AND causal? AND real key? AND same document?`: a pattern function's last step (`mask_fn` itself when
    none applies)."""
    parts = [mask_fn]
    if causal:
        parts.append(causal_mask())
    if key_padding_mask is not None:
        parts.append(key_padding_predicate(key_padding_mask))
    if document_ids is not None:
        parts.append(same_document_mask(document_ids))
    return parts[0] if len(parts) == 1 else and_masks(*parts)


def materialize_mask(
    mask_fn: MaskFn,
    *,
    batch: int,
    heads: int,
    q_len: int,
    kv_len: int,
    q_offset: int = 0,
    device: torch.device | str | None = None,
) -> Tensor:
    """Evaluate a predicate on every (query, key) pair: the dense mask for reference attention and pictures.

    Costs O(b · h · q_len · kv_len) memory: meant for tests, references, short sequences and plots.

    Args:
        mask_fn: The predicate.
        batch: Batch size b.
        heads: Number of heads h.
        q_len: Number of queries.
        kv_len: Number of keys.
        q_offset: Position of the first query; in cached decoding the queries are the last `q_len` positions, so
            `q_offset = kv_len - q_len`.
        device: Device of the index tensors and of the result.

    Returns:
        Bool `[b, h, q_len, kv_len]`, True = visible.

    Raises:
        ValueError: If a size is negative or `q_offset` is negative.
    """
    for name, value in (
        ("batch", batch),
        ("heads", heads),
        ("q_len", q_len),
        ("kv_len", kv_len),
        ("q_offset", q_offset),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{name} must be an int >= 0, got {value!r}")
    b = torch.arange(batch, device=device).view(batch, 1, 1, 1)
    h = torch.arange(heads, device=device).view(1, heads, 1, 1)
    q_idx = (q_offset + torch.arange(q_len, device=device)).view(1, 1, q_len, 1)
    kv_idx = torch.arange(kv_len, device=device).view(1, 1, 1, kv_len)
    mask = mask_fn(b, h, q_idx, kv_idx)
    return mask.expand(batch, heads, q_len, kv_len).contiguous()


# ---------------------------------------------------------------------------------------------- Sparse Transformer
def check_stride(stride: int, *, name: str = "stride") -> int:
    """Validate the stride l of the strided pattern: an int >= 1, else a ValueError naming `name`."""
    return _check_positive_int(stride, name, "the stride l of the strided pattern")


def check_fixed_sizes(
    block_size: int, num_summary: int, *, names: tuple[str, str] = ("block_size", "num_summary")
) -> tuple[int, int]:
    """Validate the block size l and the number of summary cells c of the fixed pattern.

    Args:
        block_size: Block length l, >= 1.
        num_summary: Summary cells per block c, in [1, l].
        names: Argument names used in the error messages.

    Returns:
        `(block_size, num_summary)` as Python ints.

    Raises:
        ValueError: If `block_size` is not an int >= 1 or `num_summary` is not an int in [1, block_size].
    """
    block_name, summary_name = names
    _check_positive_int(block_size, block_name, "the block length l")
    if isinstance(num_summary, bool) or not isinstance(num_summary, int) or not 1 <= num_summary <= block_size:
        raise ValueError(
            f"{summary_name} must be an int in [1, {block_name}] = [1, {block_size}] (summary cells per block), "
            f"got {num_summary!r}"
        )
    return block_size, num_summary


def strided_mask(stride: int, causal: bool = False) -> MaskFn:
    """Sparse Transformer's strided pattern (Child et al. 2019): the previous l keys and every l-th key.

    Causal (the paper's form): A1 = {max(0, i − l) … i} and A2 = {j <= i : (i − j) mod l = 0}. Bidirectional (for
    encoders): A1 is mirrored, |i − j| <= l, and A2 = {j : (i − j) mod l = 0} keeps both directions. A query sees
    A1 ∪ A2. Stride 3, 9 tokens, causal (left) and bidirectional (right), row = query, column = key:

        ■ ⬚ ⬚ ⬚ ⬚ ⬚ ⬚ ⬚ ⬚        ■ ■ ■ ■ ⬚ ⬚ ■ ⬚ ⬚
        ■ ■ ⬚ ⬚ ⬚ ⬚ ⬚ ⬚ ⬚        ■ ■ ■ ■ ■ ⬚ ⬚ ■ ⬚
        ■ ■ ■ ⬚ ⬚ ⬚ ⬚ ⬚ ⬚        ■ ■ ■ ■ ■ ■ ⬚ ⬚ ■
        ■ ■ ■ ■ ⬚ ⬚ ⬚ ⬚ ⬚        ■ ■ ■ ■ ■ ■ ■ ⬚ ⬚
        ⬚ ■ ■ ■ ■ ⬚ ⬚ ⬚ ⬚        ⬚ ■ ■ ■ ■ ■ ■ ■ ⬚
        ⬚ ⬚ ■ ■ ■ ■ ⬚ ⬚ ⬚        ⬚ ⬚ ■ ■ ■ ■ ■ ■ ■
        ■ ⬚ ⬚ ■ ■ ■ ■ ⬚ ⬚        ■ ⬚ ⬚ ■ ■ ■ ■ ■ ■
        ⬚ ■ ⬚ ⬚ ■ ■ ■ ■ ⬚        ⬚ ■ ⬚ ⬚ ■ ■ ■ ■ ■
        ⬚ ⬚ ■ ⬚ ⬚ ■ ■ ■ ■        ⬚ ⬚ ■ ⬚ ⬚ ■ ■ ■ ■

    Args:
        stride: The stride l, >= 1 (the paper picks l close to sqrt(n)).
        causal: The decoder form (only keys at or before the query).

    Returns:
        A `MaskFn` named `strided_{l}` or `strided_causal_{l}`.

    Raises:
        ValueError: If `stride` is not an int >= 1.
    """
    stride = check_stride(stride)

    if causal:

        def strided_causal(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
            distance = q_idx - kv_idx
            return (distance >= 0) & ((distance <= stride) | (distance % stride == 0))

        return _named(strided_causal, f"strided_causal_{stride}", period=1)

    def strided(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        distance = q_idx - kv_idx
        return (distance.abs() <= stride) | (distance % stride == 0)

    return _named(strided, f"strided_{stride}", period=1)


def fixed_mask(block_size: int, num_summary: int, summary_per_head: bool = False) -> MaskFn:
    """Sparse Transformer's fixed pattern (Child et al. 2019): the query's own block and the summary cells.

    A1 = {j : floor(j / l) = floor(i / l)} (the block of the query) and A2 = {j : j mod l in [l − c, l − 1]} (the
    last c positions of every block, which summarise it). A query sees A1 ∪ A2; compose with `causal_mask` for the
    decoder form (`fixed_pattern` does). Block 4, 2 summary cells, 10 tokens, bidirectional, row = query,
    column = key:

        ■ ■ ■ ■ ⬚ ⬚ ■ ■ ⬚ ⬚
        ■ ■ ■ ■ ⬚ ⬚ ■ ■ ⬚ ⬚
        ■ ■ ■ ■ ⬚ ⬚ ■ ■ ⬚ ⬚
        ■ ■ ■ ■ ⬚ ⬚ ■ ■ ⬚ ⬚
        ⬚ ⬚ ■ ■ ■ ■ ■ ■ ⬚ ⬚
        ⬚ ⬚ ■ ■ ■ ■ ■ ■ ⬚ ⬚
        ⬚ ⬚ ■ ■ ■ ■ ■ ■ ⬚ ⬚
        ⬚ ⬚ ■ ■ ■ ■ ■ ■ ⬚ ⬚
        ⬚ ⬚ ■ ■ ⬚ ⬚ ■ ■ ■ ■
        ⬚ ⬚ ■ ■ ⬚ ⬚ ■ ■ ■ ■

    The source notes write A2 as `j mod l in {t, …, l}` with t = l − c; the paper means the last c cells of each
    block, `[l − c, l − 1]`, which is what this implements.

    Args:
        block_size: Block length l, >= 1.
        num_summary: Summary cells per block c, in [1, l].
        summary_per_head: The paper's multi-head variant: head h summarises with its own sub-block of c cells,
            `j mod l in [l − (g + 1)·c, l − g·c − 1]` with g = h mod floor(l / c), so heads look at distinct
            sub-blocks (cycling once every sub-block is taken). False: every head uses the last c cells.

    Returns:
        A `MaskFn` named `fixed_{l}_{c}` (`_per_head` appended for the per-head variant).

    Raises:
        ValueError: If `block_size` is not >= 1 or `num_summary` is not in [1, block_size].
    """
    block_size, num_summary = check_fixed_sizes(block_size, num_summary)

    if not summary_per_head:
        first_summary = block_size - num_summary

        def fixed(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
            same_block = torch.div(q_idx, block_size, rounding_mode="floor") == torch.div(
                kv_idx, block_size, rounding_mode="floor"
            )
            return same_block | (kv_idx % block_size >= first_summary)

        return _named(fixed, f"fixed_{block_size}_{num_summary}", period=block_size)

    groups = block_size // num_summary

    def fixed_per_head(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        same_block = torch.div(q_idx, block_size, rounding_mode="floor") == torch.div(
            kv_idx, block_size, rounding_mode="floor"
        )
        # Cells counted back from the end of the block: head group g owns [g·c, (g + 1)·c).
        from_end = block_size - 1 - kv_idx % block_size
        group = h % groups
        return same_block | ((from_end >= group * num_summary) & (from_end < (group + 1) * num_summary))

    return _named(fixed_per_head, f"fixed_{block_size}_{num_summary}_per_head", period=block_size)


def first_real_token(key_padding_mask: Tensor) -> Tensor:
    """Index of the first real token of each row (0 for a row without one).

    Args:
        key_padding_mask: Bool `[b, n]`, True = real token.

    Returns:
        Long `[b]`.
    """
    return key_padding_mask.to(torch.uint8).argmax(dim=1)


def from_first_real_token(mask_fn: MaskFn, key_padding_mask: Tensor) -> MaskFn:
    """`mask_fn` on positions counted from each row's first real token: p -> (p − first) mod n.

    Patterns anchored at absolute positions (the fixed pattern's blocks) would move with left padding; counted from
    the first real token they see the same real tokens whatever the padding, like the model's position ids. Left
    padding wraps to the end of the row, where it is still padding.

    Args:
        mask_fn: A predicate over positions.
        key_padding_mask: Bool `[b, n]`, True = real token; n is the length of the row (all keys).

    Returns:
        A `MaskFn` named `{name}_from_first_token`.

    Raises:
        ValueError: If `key_padding_mask` is not 2-D.
    """
    _token_flags("key_padding_mask", key_padding_mask)
    first = first_real_token(key_padding_mask)
    length = key_padding_mask.shape[1]

    def shifted(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        shift = first.to(q_idx.device)[b]
        return mask_fn(b, h, (q_idx - shift) % length, (kv_idx - shift) % length)

    return _named(shifted, f"{mask_fn.__name__}_from_first_token")


# ------------------------------------------------------------------------------------------------ packed documents
def _check_document_ids(document_ids: Tensor) -> Tensor:
    if document_ids.dim() != 2 or document_ids.dtype.is_floating_point or document_ids.dtype == torch.bool:
        raise ValueError(
            f"document_ids must be an integer tensor of shape [batch, length], got {document_ids.dtype} "
            f"{tuple(document_ids.shape)}"
        )
    return document_ids


def same_document_mask(document_ids: Tensor) -> MaskFn:
    """Packed rows: a query sees only the keys of its own document.

    Documents A (3 tokens) and B (2 tokens) packed in one row, ANDed with any pattern:

        ■ ■ ■ ⬚ ⬚
        ■ ■ ■ ⬚ ⬚
        ■ ■ ■ ⬚ ⬚
        ⬚ ⬚ ⬚ ■ ■
        ⬚ ⬚ ⬚ ■ ■

    Args:
        document_ids: Integer `[b, n]`, the document of each token; documents are contiguous runs of one id
            (`longattn.packing.document_ids_from_position_ids` derives them).

    Returns:
        A `MaskFn` named `same_document`: `document_ids[b, q_idx] == document_ids[b, kv_idx]`.

    Raises:
        ValueError: If `document_ids` is not an integer `[b, n]` tensor.
    """
    documents = _check_document_ids(document_ids)

    def same_document(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return documents[b, q_idx] == documents[b, kv_idx]

    return _named(same_document, "same_document")


def document_starts(document_ids: Tensor) -> Tensor:
    """Position of the first token of each token's document.

    Args:
        document_ids: Integer `[b, n]`, contiguous runs of one id per document.

    Returns:
        Long `[b, n]`: for token p, the position where its document begins.
    """
    b, n = _check_document_ids(document_ids).shape
    positions = torch.arange(n, device=document_ids.device).expand(b, n)
    starts = torch.ones_like(document_ids, dtype=torch.bool)
    starts[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]
    return positions.masked_fill(~starts, 0).cummax(dim=1).values


def document_index(document_ids: Tensor) -> Tensor:
    """Each token's document numbered 0, 1, ... from the start of its row (whatever ids the row uses).

    Args:
        document_ids: Integer `[b, n]`, contiguous runs of one id per document.

    Returns:
        Long `[b, n]`.
    """
    begins = torch.ones_like(_check_document_ids(document_ids), dtype=torch.bool)
    begins[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]
    return begins.long().cumsum(dim=1) - 1


def document_layout(document_ids: Tensor, multiple: int) -> tuple[Tensor, Tensor, Tensor]:
    """Slots for packed rows in which every document starts at a multiple of `multiple`.

    Documents of lengths 3 and 2 with `multiple` 4 go to slots `A A A _ B B _ _`: the gaps hold no token. A
    blocked executor whose blocks start at multiples of `multiple` then sees every document's blocks start at its
    first token, as if the document were alone in a row. A row grows by at most `multiple - 1` slots per document.

    Args:
        document_ids: Integer `[b, n]`, contiguous runs of one id per document.
        multiple: Slots every document start is aligned to.

    Returns:
        `(position, real, slot)`: long `[b, s]`, the original position of each slot (0 in gaps); bool `[b, s]`, the
        slots that hold a token; long `[b, n]`, the slot of each position.
    """
    b, n = document_ids.shape
    device = document_ids.device
    index = document_index(document_ids)  # [b, n]
    lengths = torch.zeros(b, int(index.max()) + 1, dtype=torch.long, device=device).scatter_add_(
        1, index, torch.ones_like(index)
    )  # [b, D]
    aligned = -(-lengths // multiple) * multiple  # [b, D]
    offsets = aligned.cumsum(dim=1) - aligned  # [b, D], first slot of each document
    positions = torch.arange(n, device=device).expand(b, n)
    slot = offsets.gather(1, index) + positions - document_starts(document_ids)  # [b, n]
    slots = int(aligned.sum(dim=1).max())
    position = torch.zeros(b, slots, dtype=torch.long, device=device).scatter_(1, slot, positions)
    real = torch.zeros(b, slots, dtype=torch.bool, device=device).scatter_(1, slot, True)
    return position, real, slot


class DocumentRows:
    """Packed documents moved to rows of their own, `[b · D, L]` (D documents per row at most, L the longest), and
    back: for kinds whose state would otherwise run across a whole row (efficient attention's global context), so that
    each document gets exactly what it would get alone, padded at its end.

    Args:
        document_ids: Integer `[b, n]`, contiguous runs of one id per document.
        key_padding_mask: Optional bool `[b, n]`, True = real token.
    """

    def __init__(self, document_ids: Tensor, key_padding_mask: Tensor | None = None):
        b, n = document_ids.shape
        within = torch.arange(n, device=document_ids.device) - document_starts(document_ids)  # [b, n]
        self.length = int(within.max()) + 1  # L, the longest document
        self.position, real, self.slot = document_layout(document_ids, self.length)  # [b, D·L], [b, n]
        self.documents = self.position.shape[1] // self.length
        if key_padding_mask is not None:
            real = real & key_padding_mask.gather(1, self.position)
        self.padding = real.view(b * self.documents, self.length)  # [b·D, L], True = real token

    def split(self, x: Tensor) -> Tensor:
        """`[b, h, n, d]` -> `[b · D, h, L, d]`."""
        b, h, _, d = x.shape
        rows = x.gather(2, self.position[:, None, :, None].expand(b, h, -1, d))  # [b, h, D·L, d]
        return rows.view(b, h, self.documents, self.length, d).transpose(1, 2).reshape(-1, h, self.length, d)

    def merge(self, x: Tensor) -> Tensor:
        """`[b · D, h, L, d]` -> `[b, h, n, d]`."""
        b, n = self.slot.shape
        h, d = x.shape[1], x.shape[3]
        rows = x.view(b, self.documents, h, self.length, d).transpose(1, 2).reshape(b, h, -1, d)  # [b, h, D·L, d]
        return rows.gather(2, self.slot[:, None, :, None].expand(b, h, n, d))

    def merge_weights(self, weights: Tensor) -> Tensor:
        """Per-document weights `[b · D, h, L, L]` -> `[b, h, n, n]`, zero between documents."""
        b, n = self.slot.shape
        h = weights.shape[1]
        blocks = weights.view(b, self.documents, h, self.length, self.length)
        document, within = self.slot // self.length, self.slot % self.length  # [b, n]
        rows = blocks[torch.arange(b, device=weights.device)[:, None], document]  # [b, n, h, L, L]: each query's doc
        rows = rows.gather(3, within[:, :, None, None, None].expand(b, n, h, 1, self.length)).squeeze(3)  # [b,n,h,L]
        keys = rows.gather(3, within[:, None, None, :].expand(b, n, h, n))  # [b, n, h, n]
        same = (document[:, :, None] == document[:, None, :])[:, :, None]  # [b, n, 1, n]
        return (keys * same).transpose(1, 2)  # [b, h, n, n]


def from_document_start(mask_fn: MaskFn, document_ids: Tensor) -> MaskFn:
    """`mask_fn` on positions counted from the start of each token's document, ANDed with `same_document_mask`.

    Patterns anchored at absolute positions (the fixed pattern's blocks) then treat every packed document as a row of
    its own; patterns that read only distances (windows, strides) need the document test alone.

    Args:
        mask_fn: A predicate over positions; it must read no per-position tensor (padding, global tokens), whose
            index would move too.
        document_ids: Integer `[b, n]`, contiguous runs of one id per document.

    Returns:
        A `MaskFn` named `{name}_per_document`.
    """
    start = document_starts(document_ids)
    same = same_document_mask(document_ids)

    def per_document(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return same(b, h, q_idx, kv_idx) & mask_fn(b, h, q_idx - start[b, q_idx], kv_idx - start[b, kv_idx])

    return _named(per_document, f"{mask_fn.__name__}_per_document")


def within_documents(mask_fn: MaskFn, document_ids: Tensor | None) -> MaskFn:
    """`mask_fn AND same_document` (`mask_fn` itself when `document_ids` is None): a pattern made packing-safe."""
    return mask_fn if document_ids is None else and_masks(mask_fn, same_document_mask(document_ids))


def strided_pattern(
    *,
    stride: int,
    causal: bool = False,
    key_padding_mask: Tensor | None = None,
    document_ids: Tensor | None = None,
) -> MaskFn:
    """The full strided pattern: `strided(l, causal) AND real key? AND same document?`.

    The strided sets depend on the distance i − j only, so counting positions from each packed document's start
    (as the pattern requires) changes nothing once keys of other documents are hidden.

    Args:
        stride: The stride l, >= 1.
        causal: The decoder form (only keys at or before the query).
        key_padding_mask: Optional bool `[b, n]`, True = real token.
        document_ids: Optional integer `[b, n]`, the document of each token in a packed row.

    Returns:
        The composed `MaskFn`.

    Raises:
        ValueError: For an invalid stride or mask rank.
    """
    # causal inside the strided predicate
    return _restricted(
        strided_mask(stride, causal), causal=False, key_padding_mask=key_padding_mask, document_ids=document_ids
    )


def fixed_pattern(
    *,
    block_size: int,
    num_summary: int,
    summary_per_head: bool = False,
    causal: bool = False,
    key_padding_mask: Tensor | None = None,
    document_ids: Tensor | None = None,
) -> MaskFn:
    """The full fixed pattern: `fixed(l, c) AND causal? AND real key? AND same document?`.

    With a padding mask, blocks are counted from each row's first real token (`from_first_real_token`), so left
    padding does not move the block boundaries; in packed rows they are counted from each document's start
    (`from_document_start`), so every document sees the blocks it would see alone. Causality is on the actual
    positions.

    Args:
        block_size: Block length l, >= 1.
        num_summary: Summary cells per block c, in [1, l].
        summary_per_head: Distinct summary sub-blocks per head (see `fixed_mask`).
        causal: Restrict every query to keys at or before its position.
        key_padding_mask: Optional bool `[b, n]`, True = real token.
        document_ids: Optional integer `[b, n]`, the document of each token in a packed row.

    Returns:
        The composed `MaskFn`.

    Raises:
        ValueError: For invalid sizes or mask rank.
    """
    blocks = fixed_mask(block_size, num_summary, summary_per_head)
    if document_ids is not None:
        blocks = from_document_start(blocks, document_ids)
    elif key_padding_mask is not None:
        blocks = from_first_real_token(blocks, key_padding_mask)
    return _restricted(blocks, causal=causal, key_padding_mask=key_padding_mask)
