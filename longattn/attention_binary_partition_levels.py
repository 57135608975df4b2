"""The node arrays of the BP-Transformer's level-wise executor (`attention_binary_partition`): pooled span nodes,
their adjoint, and the per-chunk node array that the low-level windows read.

Shape legend: b batch, h heads, n length, d head dim, L levels, N nodes (n tokens, then the spans of levels
1 .. L-1), R rows of a chunk's node array.

**Chunk-local nodes.** The spans of levels 1 .. `LOCAL_LEVELS` - 1 hold 7/8 of all span rows but are read only by
the windows of nearby queries: each chunk of rows pools them from its own tokens (`chunk_nodes`), so no call keeps
them for the whole sequence (nor their gradients in backward). A chunk's node array holds, side by side, the tokens
its queries can see, those levels pooled from them, and slices of the kept spans (levels `LOCAL_LEVELS` and up) for
the other levels its groups read: every window of the group tier is then one `index_select` from it, and its
gradient one `index_add_` into a buffer of the chunk's size, added back into the tokens' and spans' gradients once
per chunk (`add_chunk_grads`). The node ranges come from the cursors of the chunk's first and last query: a
query's cursors never move backwards as the query moves right, so every node a query of the chunk sees lies inside
them; the window columns outside them are hidden from every query of the chunk, and are clamped into the array.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from .numerics import compute_dtype

LOCAL_LEVELS = 4
"""Levels 0 .. 3 are read from each chunk's tokens (`chunk_nodes`); the kept spans start at level 4 (n/8 rows)."""


def level_offsets(n: int, levels: int) -> list[int]:
    """Index of each level's first node in the node list [tokens ; level 1 ; level 2 ; ...]; the last entry is N."""
    offsets, total = [0], n
    for level in range(1, levels):
        offsets.append(total)
        total += -(-n // 2**level)
    offsets.append(total)
    return offsets


def take(x: Tensor, dim: int, index: Tensor) -> Tensor:
    """`x` indexed by the integer tensor `index` along `dim` (`x[:, index]` for dim 1, `x[:, :, index]` for dim 2):
    the same values through `index_select`, whose contiguous row copies run 2-4x faster on CPU than advanced
    indexing's generic gather."""
    picked = x.index_select(dim, index.flatten())
    return picked.view(*x.shape[:dim], *index.shape, *x.shape[dim + 1 :])


def pool_levels(x: Tensor, key_padding_mask: Tensor | None, levels: int, first: int = 1) -> tuple[Tensor, Tensor]:
    """The span nodes alone: the spans of levels first .. L-1 as the mean of their real tokens.

    Args:
        x: `[b, h, n, d]` token keys or values.
        key_padding_mask: `[b, n]` bool, True = real token; None = none.
        first: The lowest level kept (>= 1); the levels below are read from the tokens.

    Returns:
        (spans `[b, h, N - offsets[first], d]` in x's dtype, `level_offsets`' order; counts `[b, N]`, real tokens
        per node, tokens included).
    """
    b, h, n, d = x.shape
    dtype = compute_dtype(x.dtype)
    real = torch.ones(b, n, dtype=dtype, device=x.device) if key_padding_mask is None else key_padding_mask.to(dtype)
    offsets = level_offsets(n, levels)
    base = offsets[min(first, levels)]
    # Written level by level into one buffer, divided in place: no full-size temporaries besides the masked tokens.
    spans = x.new_empty(b, h, offsets[-1] - base, d, dtype=dtype)
    sums = x.to(dtype) if key_padding_mask is None else x.to(dtype) * real[:, None, :, None]  # [b, h, n, d]
    counts, node_counts = real, [real]
    for level in range(1, levels):
        if sums.shape[2] % 2:
            sums, counts = F.pad(sums, (0, 0, 0, 1)), F.pad(counts, (0, 1))
        sums = sums[:, :, 0::2] + sums[:, :, 1::2]  # [b, h, n_l, d]; ~5x faster than a sum over pairs on CPU
        counts = counts[:, 0::2] + counts[:, 1::2]  # [b, n_l]
        if level >= first:
            spans[:, :, offsets[level] - base : offsets[level + 1] - base] = sums
        node_counts.append(counts)
    counts = torch.cat(node_counts, 1)  # [b, N]
    spans.div_(counts[:, base:].clamp(min=1)[:, None, :, None])
    return spans.to(x.dtype), counts


def unpool(grad_tokens: Tensor, grad_spans: Tensor, counts: Tensor, levels: int, first: int) -> None:
    """The adjoint of `pool_levels(.., levels, first)`: adds the gradient of the kept spans `[b, h, N', d]`
    (overwritten), with the node counts `[b, N]`, into the tokens' gradient `[b, h, n, d]` (in place: no temporary
    of the tokens' size; a view of a larger gradient along dim 2 works).

    A span is the sum of its real tokens over its count, so a real token receives the sum over its ancestor spans
    of their gradient over their count: each level's share over its count, then from the top level down each
    level adds its parent's share (repeated twice), and level `first` gives its share to its 2^first tokens."""
    b, h, n, d = grad_tokens.shape
    sizes = [-(-n // 2**level) for level in range(first, levels)]
    base = level_offsets(n, levels)[first]
    share = grad_spans.div_(counts[:, base:].clamp(min=1)[:, None, :, None]).split(sizes, 2)  # level `first` first
    for level in range(len(sizes) - 2, -1, -1):
        share[level].add_(share[level + 1].repeat_interleave(2, 2)[:, :, : sizes[level]])
    size = 2**first
    whole, real = n // size, counts[:, :n]
    grad_tokens[:, :, : whole * size].view(b, h, whole, size, d).addcmul_(
        share[0][:, :, :whole, None, :], real[:, : whole * size].view(b, 1, whole, size, 1)
    )
    if n > whole * size:  # the last span, cut at n
        grad_tokens[:, :, whole * size :].addcmul_(share[0][:, :, whole:], real[:, None, whole * size :, None])


def next_cursors(right, left, level: int, context: int):
    """Where level `level + 1` starts on each side, from where level `level` starts (`right`, `left`: ints, or long
    tensors of query positions' cursors): k nodes of size 2^level, then one more if needed so that the next level
    starts on a multiple of its node size. The one statement of the cursor arithmetic (`_cursors` applies it to
    tensors of queries, `cursor_ints` to one query)."""
    size = 2**level
    return (right + context * size + 2 * size - 1) // (2 * size) * 2 * size, (left - context * size) // (
        2 * size
    ) * 2 * size


def cursor_ints(position: int, n: int, context: int, levels: int) -> tuple[list[int], list[int]]:
    """`_cursors` of one query in plain integers: (right, left), L+1 entries each."""
    right, left = [position + 1], [position]
    for level in range(levels):
        next_right, next_left = next_cursors(right[-1], left[-1], level, context)
        right.append(next_right)
        left.append(next_left)
    return right, left


class ChunkNodes(NamedTuple):
    """One chunk's node array (module docstring): keys and values `[b, h, R, d]` in the compute dtype; per level
    l (0 .. top), `starts[l]` the first level-l node it holds, `places[l]` where they begin in it, `sizes[l]` how
    many; tokens [a, z) are its first z - a rows; `counts` `[b, N']` the real tokens of [a, z) and of their pooled
    levels (None without pooled levels)."""

    keys: Tensor
    values: Tensor
    starts: list[int]
    places: list[int]
    sizes: list[int]
    a: int
    z: int
    counts: Tensor | None


def _pool_into(buffer: Tensor, real: Tensor, masked: bool, sizes: list[int], places: list[int], exact) -> Tensor:
    """Pools the tokens in `buffer`'s first rows (`[b, h, R, d]`, padding mask as `real` `[b, t]` in its dtype,
    `masked` when it holds padding) into
    the rows `places[l]` .. of levels l = 1 .. (the mean of their real tokens, summed pairwise level by level as
    `pool_levels` does), rounded through `exact`'s dtype when given; returns the counts `[b, N']` of every level."""
    tokens = buffer[:, :, : sizes[0]]
    sums = tokens * real[:, None, :, None] if masked else tokens
    counts, node_counts = real, [real]
    for level in range(1, len(sizes)):
        if sums.shape[2] % 2:
            sums, counts = F.pad(sums, (0, 0, 0, 1)), F.pad(counts, (0, 1))
        out = buffer[:, :, places[level] : places[level] + sizes[level]]
        # out= does not differentiate, and torch.compile cannot trace it into a strided view: a copy there
        if (torch.is_grad_enabled() and sums.requires_grad) or torch.compiler.is_compiling():
            out.copy_(sums[:, :, 0::2] + sums[:, :, 1::2])
        else:
            torch.add(sums[:, :, 0::2], sums[:, :, 1::2], out=out)
        sums, counts = out, counts[:, 0::2] + counts[:, 1::2]
        node_counts.append(counts)
    counts = torch.cat(node_counts, 1)
    pooled = buffer[:, :, places[1] : places[-1] + sizes[-1]]
    pooled.div_(counts[:, sizes[0] :].clamp(min=1)[:, None, :, None])
    if exact is not None:
        pooled.copy_(pooled.to(exact))
    return counts


def chunk_nodes(k, v, key_padding_mask, spans, first_query, last_query, *, context, levels, top, dtype) -> ChunkNodes:
    """The node array of the chunk whose queries are [first_query, last_query] (`spans`: the kept (keys, values)
    `[b, h, N - offsets[LOCAL_LEVELS], d]`): levels 0 .. `top`, levels below `LOCAL_LEVELS` pooled here."""
    b, h, n, d = k.shape
    offsets = level_offsets(n, levels)
    local = min(LOCAL_LEVELS, levels)
    base = offsets[local]
    right = cursor_ints(last_query, n, context, levels)[0]
    left = cursor_ints(first_query, n, context, levels)[1]
    # levels < local: every node inside the tokens [a, z); a is a multiple of 2^(local - 1), z one or n
    a, z = max(left[local], 0), min(right[local], n)
    starts = [a // 2**level for level in range(local)]
    sizes = [-(-z // 2**level) - a // 2**level for level in range(local)]
    for level in range(local, min(top, levels - 1) + 1):  # slices of the kept spans
        lo = max(left[level + 1], 0) // 2**level
        hi = min(-(-right[level + 1] // 2**level), offsets[level + 1] - offsets[level])
        starts.append(lo)
        sizes.append(max(hi, lo) - lo)
    places = [0]
    for size in sizes[:-1]:
        places.append(places[-1] + size)
    rows = places[-1] + sizes[-1]
    real = k.new_ones(b, z - a, dtype=dtype) if key_padding_mask is None else key_padding_mask[:, a:z].to(dtype)
    arrays, counts = [], None
    for x, kept in zip((k, v), spans, strict=True):
        array = x.new_empty(b, h, rows, d, dtype=dtype)
        array[:, :, : z - a] = x[:, :, a:z]
        if local > 1:
            exact = None if x.dtype == dtype else x.dtype  # rounded like the kept spans
            counts = _pool_into(array, real, key_padding_mask is not None, sizes[:local], places[:local], exact)
        for level in range(local, len(starts)):
            begin = offsets[level] - base + starts[level]
            array[:, :, places[level] : places[level] + sizes[level]] = kept[:, :, begin : begin + sizes[level]]
        arrays.append(array)
    return ChunkNodes(*arrays, starts, places, sizes, a, z, counts)


def chunk_index(index: Tensor, column_levels: Tensor, chunk: ChunkNodes, offsets: list[int]) -> Tensor:
    """Node indices `index` `[groups, M]` (into the node list) as rows of the chunk's node array, the level of each
    column `column_levels` `[M]`: a column outside the array's range of its level (hidden from every query of the
    chunk) is clamped into it."""
    top = len(chunk.starts)
    shift = [offsets[level] + chunk.starts[level] - chunk.places[level] for level in range(top)]
    last = chunk.places[-1] + chunk.sizes[-1] - 1  # an empty level's columns (all hidden) clamp into the array
    low = [min(place, last) for place in chunk.places]
    high = [min(place + max(size, 1) - 1, last) for place, size in zip(chunk.places, chunk.sizes, strict=True)]
    table = torch.tensor([shift, low, high], dtype=index.dtype, device=index.device)[:, column_levels]  # [3, M]
    return torch.minimum(torch.maximum(index - table[0], table[1]), table[2])


def add_chunk_grads(grad_k, grad_v, grad_spans, grad_nodes, chunk: ChunkNodes, levels: int) -> None:
    """The adjoint of `chunk_nodes`: adds the gradient of the chunk's node arrays `grad_nodes` (keys, values)
    `[b, h, R, d]` (overwritten) into the tokens' gradients `[b, h, n, d]` and the kept spans' (keys, values)."""
    n = grad_k.shape[2]
    offsets = level_offsets(n, levels)
    local = min(LOCAL_LEVELS, levels)
    base = offsets[local]
    a, z = chunk.a, chunk.z
    for grad_tokens, grad_kept, grad in zip((grad_k, grad_v), grad_spans, grad_nodes, strict=True):
        for level in range(local, len(chunk.starts)):
            start, place, size = chunk.starts[level], chunk.places[level], chunk.sizes[level]
            begin = offsets[level] - base + start
            grad_kept[:, :, begin : begin + size].add_(grad[:, :, place : place + size])
        if local > 1:
            unpool(grad_tokens[:, :, a:z], grad[:, :, z - a : chunk.places[local - 1] + chunk.sizes[local - 1]],
                   chunk.counts, local, 1)  # fmt: skip
        grad_tokens[:, :, a:z].add_(grad[:, :, : z - a])
