"""BP-Transformer graph self-attention (Ye et al. 2019, "BP-Transformer: Modelling Long-Range Context via Binary
Partitioning"): each token attends to its neighbours and to span nodes of a binary partition tree, at growing scales.

Shape legend: b batch, h heads, n length (m keys: the cached tokens in decoding), d head dim, L levels,
N nodes (n tokens, then the spans of levels 1 .. L-1), G queries per group, M window nodes per group.

**The tree.** Level l cuts the sequence into aligned spans of 2^l tokens ([t·2^l, (t+1)·2^l), the last one cut at
n); level 0 are the tokens themselves. A query i sees itself and, on each side, `binary_partition_context` (k)
nodes per level, walking outwards from i: on the right, a cursor starts at i + 1; at level l it takes the level-l
nodes from the cursor on, k of them, plus one more when the cursor would otherwise not land on a multiple of
2^(l+1) (so the next level's nodes are aligned), and moves past them. The left side mirrors it from i. The nodes a
query sees are therefore disjoint and together cover the whole sequence; there are at most 1 + 2·(k+1)·L of them,
L = ceil(log2((n-1)/k + 1)), so the cost is O(k · n · log(n/k)). Bidirectional, k = 1, n = 12, query 5 (the level
of the node through which each key is seen; `·` is the query itself)::

    key     0 1 2 3 | 4 | 5 | 6 | 7 | 8 9 10 11
    level   1 1 1 1   0   ·   0   0   1 1 1  1     left: 4, then [2, 4), [0, 2); right: 6, 7, then [8, 10), [10, 12)

Right of 5 the cursor is at 6: level 0 takes 6, plus 7 so that level 1 starts on a multiple of 2 at 8.

The paper takes k nodes per level and side; here a level takes k or k + 1, the extra node being what keeps the
next level on aligned tree nodes with no gap and no overlap (a test checks both for every query of many lengths).

**Causal form** (the paper's language-model setting): only the left side and the query itself; every node seen lies
entirely before the query, so no span contains a future token.

**Span nodes are pooled, not their own hidden states.** In the paper the ~n span nodes carry their own hidden
states, updated layer by layer by attending to their children (n token + n span nodes per layer). Here each layer's
span keys and values are the means of that layer's token keys and values over the span (padded tokens excluded; a
span with no real token is hidden): no extra states, O(n · d) to build all levels, and a span's logit is the mean of
the logits of the tokens it covers. A span therefore summarises the current layer's tokens rather than a state that
accumulated over layers from its children.

**Positions.** Each edge type (side, level, offset within the level, and "self") has a learned per-head bias added to
the logits (`relative_bias` `[h, 1 + 2·32·(k+1)]`, zero at initialisation): the paper's relative positions. They
combine with the model's own positions as follows: rotary is applied to token queries and keys before pooling, so a
span key is the mean of its *rotated* token keys and q_i·k_span is the mean of the rotary logits q_i·R(j−i)k_j over
the span, still a function of relative positions only (fine rotary frequencies average out over long spans, the
bias carries the coarse position). Learned absolute positions are in the hidden states and pool with them. The tree
is counted from each row's first real token (like the model's position ids), so left padding does not move it.

**Relative-position logits** (`relative_position_logits`, `longattn.relative_logits`) are added on the token edges
(the query itself and its level-0 neighbours): scale · q_i · r_{clip(j − i)}, on top of the edge type's bias. A span
node has no single distance to the query; its (side, level, offset) edge type already is its relative position, so
span edges keep that bias alone. The two combine by addition: the edge-type bias is a learned scalar per head, the
relative term depends on the query's content.

**Executors.** `binary_partition_attention` runs level by level (`level_layout`). On each side a query's nodes at
level l are k or k + 1 consecutive level-l nodes, shared by runs of 2^l queries, so the softmax over a query's
disjoint node sets is computed per side as one softmax over a few contiguous windows, one per level: each side's
rows are shifted by the runs' phase, and a group of G rows (`GROUP` = 16, `HIGH_GROUP` = 128 from level
`HIGH_LEVEL` up) reads one window per level, k + 1 nodes where the group lies in one run (G/2^l + k where it spans
several; level 0 is read once, on the left side, as the c + 2k + 2 tokens around the group). The windows of a
group sit side by side, so each group's scores are one small matrix product and never an n x n tensor; the edge
type of every (query, window node) pair comes from the same predicate as the dense table, gives the bias (one
pattern per tier: the tree is the same around every group) and hides the nodes the query does not see. The two
sides' node sets are disjoint: their partial attentions are merged exactly by their log-sum-exp
(`numerics.merge_attention`). In training forward keeps q, k, v (and the bias and relative tables), its output and
log-sum-exp for backward, O(n · d): backward pools the spans again and, chunk by chunk, recomputes each window's
scores, takes the probabilities from the final log-sum-exp (flash-attention style: no side needs the other) and
adds the windows' gradients back into the nodes by index (`_LevelAttention`; with attention dropout, whose masks
must be replayed, `torch.utils.checkpoint` around each chunk).
`binary_partition_reference` is the dense form: an explicit `[n, N]` edge table over all nodes (cached decoding,
where queries are the last positions of the cache, `output_attentions` with the span weights spread evenly over
their real tokens, the "reference" back end, and the tests).
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint
from transformers import initialization as init

from .attention_base import LongAttnAttention
from .attention_binary_partition_levels import (
    LOCAL_LEVELS,
    ChunkNodes,
    add_chunk_grads,
    chunk_index,
    chunk_nodes,
    level_offsets,
    next_cursors,
    pool_levels,
    take,
    unpool,
)
from .numerics import NO_KEY_LSE, compute_dtype, hide_exactly, hide_logits, merge_attention, zero_empty_shift
from .ops_checks import check_attention_inputs, check_positive_int, empty_attention, is_empty
from .patterns import first_real_token
from .relative_logits import relative_logit_table
from .tuning import workspace_elements

__all__ = [
    "MAX_LEVELS",
    "BinaryPartitionAttention",
    "binary_partition_attention",
    "binary_partition_edges",
    "binary_partition_levels",
    "binary_partition_reference",
    "level_layout",
    "level_offsets",
    "num_levels",
    "num_edge_types",
    "pool_spans",
]

MAX_LEVELS = 32
"""Levels the relative bias table holds (2^31 tokens): fixed, so the parameter does not depend on the length."""


def num_levels(n: int, context: int) -> int:
    """Levels L (0 .. L-1) a sequence of n tokens needs: each level adds >= k nodes of 2^l tokens per side, so
    after L levels a side covers >= k·(2^L − 1) >= n − 1 tokens."""
    levels = 1
    while context * (2**levels - 1) < n - 1:
        levels += 1
    return levels


def num_edge_types(context: int) -> int:
    """Edge types of the relative bias: "self", and (side, level, offset) for 2 sides, `MAX_LEVELS` levels and
    offsets 0 .. k (k nodes per level plus the alignment node)."""
    return 1 + 2 * MAX_LEVELS * (context + 1)


def _edge_type(level: Tensor | int, offset: Tensor, left: bool, context: int) -> Tensor:
    """Edge type id of a node at `level` and `offset` (0-based, outwards) on one side; 0 is "self"."""
    level = torch.as_tensor(level).clamp(max=MAX_LEVELS - 1)
    return 1 + 2 * (level * (context + 1) + offset) + int(left)


def _cursors(positions: Tensor, n: int, context: int) -> tuple[Tensor, Tensor]:
    """Where each level starts on each side: the definition every other function reads.

    Args:
        positions: Long `[q]`, the query positions.

    Returns:
        (right `[q, L+1]`: level l's nodes start in [right[l], right[l+1]); left `[q, L+1]`: level l's nodes lie in
        [left[l+1], left[l])).
    """
    right, left = [positions + 1], [positions]
    for level in range(num_levels(n, context)):
        next_right, next_left = next_cursors(right[-1], left[-1], level, context)
        right.append(next_right)
        left.append(next_left)
    return torch.stack(right, dim=1), torch.stack(left, dim=1)


def _edges(positions: Tensor, node_level: Tensor, node_start: Tensor, *, n: int, context: int, causal: bool) -> Tensor:
    """The edge type from each query to each node, -1 where the query does not see it: the one predicate both the
    dense table and the blocked layout evaluate.

    Args:
        positions: Long `[*P]`, query positions.
        node_level, node_start: Long, broadcastable to `[*P, M]`: each node's level and first token.
        n: Tokens in the sequence.

    Returns:
        Long `[*P, M]`.
    """
    right, left = _cursors(positions.flatten(), n, context)  # [Q, L+1]
    right, left = right.view(*positions.shape, -1), left.view(*positions.shape, -1)  # [*P, L+1]
    shape = torch.broadcast_shapes((*positions.shape, 1), node_level.shape)
    level, start = node_level.expand(shape), node_start.expand(shape)
    size = 2**level
    lo_r, hi_r = right.take_along_dim(level, -1), right.take_along_dim(level + 1, -1)
    hi_l, lo_l = left.take_along_dim(level, -1), left.take_along_dim(level + 1, -1)
    in_right = (start >= lo_r) & (start < hi_r) & (not causal)
    in_left = (start >= lo_l) & (start + size <= hi_l)
    edges = torch.full(shape, -1, dtype=torch.long, device=positions.device)
    edges = torch.where(
        in_right, _edge_type(level, torch.div(start - lo_r, size, rounding_mode="floor"), False, context), edges
    )
    edges = torch.where(
        in_left, _edge_type(level, torch.div(hi_l - start, size, rounding_mode="floor") - 1, True, context), edges
    )
    return edges.masked_fill((level == 0) & (start == positions[..., None]), 0)


def binary_partition_edges(m: int, *, context: int, causal: bool, q_offset: int = 0) -> Tensor:
    """The dense form: the edge type from each query to each node, -1 where the query does not see the node.

    Args:
        m: Tokens (keys); the queries are positions q_offset .. m-1.

    Returns:
        Long `[m - q_offset, N]` over the node list [tokens ; level-1 spans ; ...].
    """
    levels = num_levels(m, context)
    offsets = level_offsets(m, levels)
    sizes = [offsets[level + 1] - offsets[level] for level in range(levels)]
    node_level = torch.cat([torch.full((size,), level) for level, size in enumerate(sizes)])  # [N]
    node_start = (torch.arange(offsets[-1]) - torch.tensor(offsets[:-1])[node_level]) * 2**node_level  # [N]
    return _edges(torch.arange(q_offset, m), node_level, node_start, n=m, context=context, causal=causal)


def binary_partition_levels(n: int, *, context: int, causal: bool) -> Tensor:
    """For pictures and tests: the level of the node through which query i sees token j, -1 where it does not.

    Returns:
        Long `[n, n]`.
    """
    edges = binary_partition_edges(n, context=context, causal=causal)  # [n, N]
    levels = num_levels(n, context)
    offsets = level_offsets(n, levels)
    result = torch.full((n, n), -1, dtype=torch.long)
    tokens = torch.arange(n)
    for level in range(levels):
        seen = edges[:, offsets[level] + tokens // 2**level] >= 0  # [n, n]
        result = result.masked_fill(seen & (result >= 0), -2).masked_fill(seen & (result == -1), level)
    return result  # -2 would mark a token covered twice (never, checked by the tests)


def pool_spans(x: Tensor, key_padding_mask: Tensor | None, levels: int) -> tuple[Tensor, Tensor, Tensor]:
    """The node list: the tokens, then each level's spans as the mean of their real tokens.

    Args:
        x: `[b, h, n, d]` token keys or values.
        key_padding_mask: `[b, n]` bool, True = real token; None = none.

    Returns:
        (nodes `[b, h, N, d]` in x's dtype; real `[b, N]` bool, False for spans without a real token; counts
        `[b, N]`, real tokens per node).
    """
    spans, counts = pool_levels(x, key_padding_mask, levels)
    return torch.cat([x, spans], 2), counts > 0, counts  # tokens kept exactly as they are


def _softmax_rows(scores: Tensor, visible: Tensor, dropout_p: float) -> Tensor:
    """Softmax over the last dim with hidden entries masked; rows with no visible entry give zeros."""
    probs = torch.softmax(hide_logits(scores, ~visible), dim=-1) * visible.any(-1, keepdim=True)
    return F.dropout(probs, p=dropout_p) if dropout_p > 0 else probs


def _token_edge_logits(table: Tensor, q_pos: Tensor, node: Tensor, n: int, q_offset: int = 0) -> Tensor:
    """Relative logits of token edges: `table` `[b, h, n_q, 2M + 1]` of the queries at positions q_offset .. read at
    queries `q_pos` (positions) and nodes `node` (indices into the node list, broadcastable with q_pos), 0 for span
    nodes (index >= n). Query positions outside the table (padding slots) are clamped into it."""
    reach = (table.shape[-1] - 1) // 2
    row = (q_pos - q_offset).clamp(0, table.shape[2] - 1)
    token = node < n
    column = (node.clamp(max=n - 1) - q_pos).clamp(-reach, reach) + reach
    return table[:, :, row, column] * token


GROUP = 16
"""Queries per group at the low levels of the level-wise executor (`level_layout`): at level l < log2(c) a group of c
queries reads one window of c/2^l + k nodes (c + 2k + 2 tokens at level 0, both sides); a power of two."""

HIGH_GROUP = 128
"""Queries per group from level `HIGH_LEVEL` up, where runs of 2^l >= c queries share their k + 1 nodes: larger
products for the levels that have the fewest nodes (a power of two, a multiple of `GROUP`)."""

HIGH_LEVEL = 7
"""The first level read by groups of `HIGH_GROUP` queries (2^7 = 128: one window of k + 1 nodes per group)."""


class _Tier(NamedTuple):
    """Levels read by groups of the same size: each group of `group` consecutive rows reads one window per level,
    the windows side by side (M columns)."""

    group: int
    index: Tensor  # long [groups, M]: node indices into the node list [tokens ; spans], each inside its level
    types: Tensor  # long [G, M] (every group alike) or [groups, G, M]: edge type, 0 where hidden
    hidden: Tensor  # bool [groups, G, M]: no edge (another side's node, a node outside its level, a padding row)
    tokens: int  # columns [0, tokens) are level-0 nodes (the tokens), the rest span nodes
    distance: Tensor | None  # long [G, tokens] or [groups, G, tokens]: token position minus query position
    levels: Tensor  # long [M]: the level of each column
    low: int  # the lowest and highest level it reads
    high: int


class _Side(NamedTuple):
    """One side of `level_layout`: row y holds query y - shift; `rows` a multiple of every tier's group."""

    shift: int
    rows: int
    tiers: list[_Tier]


def _pattern(x: Tensor, hidden: Tensor) -> Tensor:
    """`x` `[groups, G, M]` as one `[G, M]` pattern where every group agrees with it on its visible entries (the
    tree is the same around every group, up to translation), else `x` itself; 0 where hidden. Under
    `torch.compile` always `x` (the check reads a value on the host)."""
    x = x.masked_fill(hidden, 0)
    if torch.compiler.is_compiling():
        return x
    lowest = torch.iinfo(x.dtype).min
    pattern = torch.where(hidden, lowest, x).amax(0)  # [G, M]
    pattern = pattern.masked_fill(pattern == lowest, 0)
    return pattern if bool(((x == pattern) | hidden).all()) else x


def _group_size(level: int) -> int:
    return HIGH_GROUP if level >= HIGH_LEVEL else GROUP


def _group_levels(group: int, levels: int, left: bool) -> list[int]:
    """The levels a side's tier of `group` queries reads (level 0 on the left side only)."""
    return [level for level in range(0 if left else 1, levels) if _group_size(level) == group]


def level_layout(n: int, *, context: int, causal: bool, device: torch.device | None = None) -> list[_Side]:
    """The level-wise executor's layout: two sides (one when causal), each a set of query groups that read one
    contiguous window of nodes per level.

    On one side, a query's nodes at level l are k or k + 1 consecutive level-l nodes; the cursor that places them
    moves by one node every 2^l queries (runs of 2^l queries share them), and the runs start at i = k mod 2^l on the
    right and i = -k mod 2^l on the left, the same phase at every level. Each side's rows are therefore shifted by
    that phase (row y holds query y - shift), so that a group of G rows reads one window per level: k + 1 nodes
    where G <= 2^l (the group lies in one run), G/2^l + k where it spans G/2^l runs. Level 0 is read once, by the
    left side: the tokens [left[1], right[1]) around the query (the query itself included), G + 2k + 2 per group.
    The edge types come from `_edges` (the dense table's predicate), each kept by the side that reads it, so the
    two sides together hold every node a query sees exactly once.

    Returns:
        `[left]` (causal) or `[left, right]` `_Side`s.
    """
    levels = num_levels(n, context)
    offsets = level_offsets(n, levels)
    top = max(_group_size(level) for level in range(levels))
    sides = []
    for left in (True,) if causal else (True, False):
        shift = (context if left else -context) % top
        rows = -(-(n + shift) // top) * top
        positions = torch.arange(rows, device=device) - shift
        valid = (positions >= 0) & (positions < n)
        right_cursor, left_cursor = _cursors(positions, n, context)  # [rows, L+1], translation-invariant
        parts: dict[int, list] = {}
        for level in range(levels) if left else range(1, levels):
            size, count, g = 2**level, -(-n // 2**level), _group_size(level)
            groups = rows // g
            if level == 0:  # [left[1], right[1]): both sides and the query itself
                lo, hi = left_cursor[:, 1], right_cursor[:, 1] if not causal else positions + 1
                width = g + (context + 1) * (1 if causal else 2) + (0 if causal else 1)
            elif left:  # [left[l+1], left[l])
                lo = torch.div(left_cursor[:, level + 1], size, rounding_mode="floor")
                hi = torch.div(left_cursor[:, level], size, rounding_mode="floor")
                width = max(g // size, 1) + context
            else:  # [right[l], right[l+1])
                lo = torch.div(right_cursor[:, level], size, rounding_mode="floor")
                hi = torch.div(right_cursor[:, level + 1], size, rounding_mode="floor")
                width = max(g // size, 1) + context
            # the left windows end at the group's nearest node, so that the outward offsets line up across groups
            start = hi.view(groups, g).amax(1) - width if left and level else lo.view(groups, g).amin(1)
            index = start[:, None] + torch.arange(width, device=device)  # [groups, W]
            edges = _edges(
                positions.view(groups, g),
                torch.full((1, 1, width), level, device=device),
                (index * size)[:, None, :],
                n=n,
                context=context,
                causal=causal,
            )  # [groups, G, W]
            mine = (edges % 2 == 0) | (edges <= 2 * (context + 1)) if left else (edges % 2 == 1)
            hidden = ~(
                mine & (edges >= 0) & ((index >= 0) & (index < count))[:, None, :] & valid.view(groups, g)[:, :, None]
            )
            distance = index[:, None, :] - positions.view(groups, g)[:, :, None] if level == 0 else None
            column = torch.full((width,), level, device=device)
            parts.setdefault(g, []).append(
                (offsets[level] + index.clamp(0, count - 1), edges, hidden, column, distance)
            )
        tiers = []
        for g, tier in parts.items():
            index, edges, hidden, column = (torch.cat(x, -1) for x in list(zip(*tier))[:4])
            distance = tier[0][4]  # level 0 comes first in its tier
            tokens = 0 if distance is None else distance.shape[-1]
            distance = None if distance is None else _pattern(distance, hidden[..., :tokens])
            low, high = min(_group_levels(g, levels, left)), max(_group_levels(g, levels, left))
            tiers.append(_Tier(g, index, _pattern(edges, hidden), hidden, tokens, distance, column, low, high))
        if tiers:  # the right side of a one-level tree has no node (level 0 is the left side's)
            sides.append(_Side(shift, rows, tiers))
    return sides


@lru_cache(maxsize=4)
def _cached_level_layout(n: int, context: int, causal: bool, device: torch.device) -> list[_Side]:
    """`level_layout`, built once per length (it depends on nothing else): a few bytes per query and window entry."""
    return level_layout(n, context=context, causal=causal, device=device)


def _layout(n: int, context: int, causal: bool, device: torch.device) -> list[_Side]:
    if torch.compiler.is_compiling():
        return level_layout(n, context=context, causal=causal, device=device)
    return _cached_level_layout(n, context, causal, device)


def _rows(x: Tensor, start: int, stop: int) -> Tensor:
    """Rows [start, stop) of `x` `[b, h, n, ...]` along dim 2, zeros where outside [0, n)."""
    n = x.shape[2]
    a, z = min(max(start, 0), n), max(min(stop, n), 0)
    part = x[:, :, a : max(a, z)]
    before = a - start
    after = stop - start - before - part.shape[2]
    if before or after:
        part = F.pad(part, (0, 0) * (x.dim() - 3) + (before, after))
    return part


_CHUNK_ELEMENTS = workspace_elements() // 8
"""Scores of one chunk of rows (every tier of one side): an eighth of the blocked executors' workspace budget (2**18
where it is 2**21), since a chunk's gathered windows and their gradients take about 8x its scores (M x d per group
of 16 rows). At 16K tokens (one layer, forward + backward, one thread) 2**17 to 2**20 ran within this machine's
noise of each other; the smaller chunk keeps the peak memory down."""


class _Nodes(NamedTuple):
    """Per call: token keys and values `[b, h, n, d]`, the kept span keys and values `[b, h, N - offsets[LOCAL_LEVELS],
    d]` (levels `LOCAL_LEVELS` and up, `level_offsets` order; the levels below are pooled per chunk, `chunk_nodes`),
    real flags `[b, N]` (None without padding), real-token counts `[b, N]`, the padding mask, the context and the
    node list's `level_offsets`."""

    keys: Tensor
    values: Tensor
    spans_k: Tensor
    spans_v: Tensor
    real: Tensor | None
    counts: Tensor
    mask: Tensor | None
    context: int
    offsets: list[int]


def _level_nodes(k: Tensor, v: Tensor, key_padding_mask: Tensor | None, levels: int, context: int) -> _Nodes:
    spans_k, counts = pool_levels(k, key_padding_mask, levels, LOCAL_LEVELS)
    spans_v = pool_levels(v, key_padding_mask, levels, LOCAL_LEVELS)[0]
    real = None if key_padding_mask is None else counts > 0
    offsets = level_offsets(k.shape[2], levels)
    return _Nodes(k, v, spans_k, spans_v, real, counts, key_padding_mask, context, offsets)


def _chunk(nodes: _Nodes, side: _Side, y0: int, rows: int, dtype) -> ChunkNodes | None:
    """The node array (`chunk_nodes`) of one side's rows [y0, y0 + rows), None when no tier of the side reads one."""
    local = [tier.high for tier in side.tiers if tier.low < LOCAL_LEVELS]  # a list: `max(default=)` breaks compile
    if not local:
        return None
    top = max(local)
    n, levels = nodes.keys.shape[2], len(nodes.offsets) - 1
    first, last = max(y0 - side.shift, 0), min(y0 + rows - side.shift, n) - 1
    return chunk_nodes(
        nodes.keys, nodes.values, nodes.mask, (nodes.spans_k, nodes.spans_v), first, last,
        context=nodes.context, levels=levels, top=top, dtype=dtype,
    )  # fmt: skip


def _window_index(nodes: _Nodes, chunk: ChunkNodes | None, tier: _Tier, g0: int, g1: int) -> Tensor:
    """The windows of groups [g0, g1) `[ng, M]` as rows of their source: the chunk's node array, or the kept spans
    for a tier that reads only levels from `LOCAL_LEVELS` up."""
    if tier.low < LOCAL_LEVELS:
        return chunk_index(tier.index[g0:g1], tier.levels, chunk, nodes.offsets)
    return tier.index[g0:g1] - nodes.offsets[min(LOCAL_LEVELS, len(nodes.offsets) - 1)]


def _gather(nodes: _Nodes, chunk: ChunkNodes | None, tier: _Tier, index: Tensor, values: bool) -> Tensor:
    """The keys (or values) of the windows `index` (`_window_index`) -> `[b, h, ng, M, d]`."""
    if tier.low < LOCAL_LEVELS:
        return take(chunk.values if values else chunk.keys, 2, index)
    return take(nodes.spans_v if values else nodes.spans_k, 2, index)


def _chunk_rows(side: _Side, b: int, h: int) -> int:
    """Rows per chunk: a multiple of every tier's group, the scores of all tiers within budget."""
    columns = sum(tier.index.shape[1] for tier in side.tiers)
    top = max(tier.group for tier in side.tiers)
    rows = _CHUNK_ELEMENTS // max(1, b * h * columns)
    return max(top, rows // top * top)


class _Biases(NamedTuple):
    """Per call, per tier: the relative bias `[h, 1, G, M]` or `[h, groups, G, M]`, and the relative table's
    columns of the level-0 nodes (`[G, tokens]` or `[groups, G, tokens]`, None without a table)."""

    bias: list[Tensor]
    columns: list[Tensor | None]


def _side_biases(side: _Side, relative_bias: Tensor, table: Tensor | None, dtype) -> _Biases:
    bias = [take(relative_bias, 1, tier.types).to(dtype) for tier in side.tiers]
    bias = [x[:, None] if x.dim() == 3 else x for x in bias]
    columns = []
    for tier in side.tiers:
        if table is None or not tier.tokens:
            columns.append(None)
            continue
        reach = (table.shape[-1] - 1) // 2
        columns.append(tier.distance.clamp(-reach, reach) + reach)
    return _Biases(bias, columns)


def _tier_scores(q_groups, keys, tier: _Tier, number: int, g0: int, g1: int, biases: _Biases, table_rows, real):
    """Scores `[b, h, ng, G, M]` of one tier for the groups [g0, g1): q·k (q already scaled) + bias (+ relative
    logits on the token columns), hidden entries -inf (`hide_exactly`: the caller guards rows without a visible
    entry). In place on the fresh product: runs without autograd (`_LevelAttention`) or on its own product."""
    scores = q_groups @ keys.transpose(-1, -2)
    bias = biases.bias[number]
    scores.add_(bias if tier.types.dim() == 2 else bias[:, g0:g1])
    columns = biases.columns[number]
    if table_rows is not None and columns is not None:
        b, h, ng, g = scores.shape[:4]
        columns = columns if columns.dim() == 2 else columns[g0:g1]
        logits = table_rows.view(b, h, ng, g, -1).gather(-1, columns.expand(b, h, ng, g, -1))
        scores[..., : tier.tokens].add_(logits.to(scores.dtype))
    hidden = tier.hidden[g0:g1]
    if real is not None:
        hidden = hidden | ~take(real, 1, tier.index[g0:g1])[:, None, :, None, :]
    return hide_exactly(scores, hidden, inplace=True)


def _tier_scores_autograd(q_groups, keys, tier, number, g0, g1, biases, table_rows, real):
    """`_tier_scores` out of place, for autograd (`torch.compile`, attention dropout)."""
    scores = q_groups @ keys.transpose(-1, -2)
    bias = biases.bias[number]
    scores = scores + (bias if tier.types.dim() == 2 else bias[:, g0:g1])
    columns = biases.columns[number]
    if table_rows is not None and columns is not None:
        b, h, ng, g = scores.shape[:4]
        columns = columns if columns.dim() == 2 else columns[g0:g1]
        logits = table_rows.view(b, h, ng, g, -1).gather(-1, columns.expand(b, h, ng, g, -1)).to(scores.dtype)
        scores = torch.cat([scores[..., : tier.tokens] + logits, scores[..., tier.tokens :]], -1)
    hidden = tier.hidden[g0:g1]
    if real is not None:
        hidden = hidden | ~take(real, 1, tier.index[g0:g1])[:, None, :, None, :]
    return hide_exactly(scores, hidden)


def _side_chunk(q_rows, nodes: _Nodes, side: _Side, y0: int, biases: _Biases, table_rows, dropout_p, inplace):
    """One side's attention for rows [y0, y0 + C) (`q_rows` `[b, h, C, d]`, scaled, compute dtype) ->
    (out `[b, h, C, d]`, lse `[b, h, C]`): one softmax over every tier's windows (a shared row maximum), each tier's
    products one batched matmul over its groups."""
    b, h, c, d = q_rows.shape
    scores, windows = [], []
    score = _tier_scores if inplace else _tier_scores_autograd
    chunk = _chunk(nodes, side, y0, c, q_rows.dtype)
    for number, tier in enumerate(side.tiers):
        g0, g1 = y0 // tier.group, (y0 + c) // tier.group
        index = _window_index(nodes, chunk, tier, g0, g1)
        keys = _gather(nodes, chunk, tier, index, False).to(q_rows.dtype)  # [b, h, ng, M, d]
        q_groups = q_rows.unflatten(2, (g1 - g0, tier.group))
        scores.append(score(q_groups, keys, tier, number, g0, g1, biases, table_rows, nodes.real))
        windows.append((tier, g0, g1, index))
    shift = torch.stack([s.detach().amax(-1).view(b, h, c) for s in scores]).amax(0)  # [b, h, C]
    shift = zero_empty_shift(shift, inplace=True)
    total, out = None, None
    for s, (tier, g0, g1, index) in zip(scores, windows, strict=True):
        rows_shift = shift.view(b, h, g1 - g0, tier.group, 1)
        e = s.sub_(rows_shift).exp_() if inplace else torch.exp(s - rows_shift)
        part_total = e.sum(-1).view(b, h, c)
        total = part_total if total is None else total + part_total
        if dropout_p > 0:
            e = F.dropout(e, p=dropout_p)
        values = _gather(nodes, chunk, tier, index, True).to(q_rows.dtype)
        part = (e @ values).view(b, h, c, d)
        out = part if out is None else out + part
    seen = total > 0
    safe = torch.where(seen, total, torch.ones_like(total))
    out = out / safe[..., None]
    lse = torch.where(seen, shift + safe.log(), torch.full_like(total, NO_KEY_LSE))
    return out, lse


def _side_chunk_rows(side: _Side, n: int, b: int, h: int):
    """(y0, r0, r1, a, z) of each chunk of one side: rows [y0, ..) hold queries [r0, r1), of which [a, z) exist."""
    step = _chunk_rows(side, b, h)
    for y0 in range(0, side.rows, step):
        r0, r1 = y0 - side.shift, min(side.rows, y0 + step) - side.shift
        a, z = max(r0, 0), min(r1, n)
        if z > a:
            yield y0, r0, r1, a, z


def _forward_levels(q, k, v, key_padding_mask, relative_bias, table, context, causal, scale, dropout_p, mode):
    """Both sides' chunks, merged (`merge_attention`: the sides' node sets are disjoint) -> (out `[b, h, n, d]`,
    lse `[b, h, n]`) in the compute dtype. `mode`: "inplace" (no autograd: chunks written into one output),
    "autograd" (differentiable ops; traced by `torch.compile`), "checkpoint" (each chunk under
    `torch.utils.checkpoint`, which replays attention dropout's masks in backward)."""
    b, h, n, d = q.shape
    dtype = compute_dtype(q.dtype)
    sides = _layout(n, context, causal, q.device)
    nodes = _level_nodes(k, v, key_padding_mask, num_levels(n, context), context)
    inplace = mode == "inplace"
    out = q.new_zeros(b, h, n, d, dtype=dtype) if inplace else None
    lse = q.new_full((b, h, n), NO_KEY_LSE, dtype=dtype) if inplace else None
    for number, side in enumerate(sides):
        biases = _side_biases(side, relative_bias, table, dtype)
        outs, lses = [], []
        for y0, r0, r1, a, z in _side_chunk_rows(side, n, b, h):
            table_rows = None if table is None else _rows(table, r0, r1)
            q_rows = _rows(q, r0, r1).to(dtype) * scale  # scaled per chunk: no scaled copy of q
            args = (q_rows, nodes, side, y0, biases, table_rows, dropout_p, inplace)
            if mode == "checkpoint":
                part = checkpoint(_side_chunk, *args, use_reentrant=False)
            else:
                part = _side_chunk(*args)
            part = tuple(x[:, :, a - r0 : z - r0] for x in part)
            if not inplace:
                outs.append(part[0])
                lses.append(part[1])
            elif number == 0:
                out[:, :, a:z], lse[:, :, a:z] = part
            else:
                out[:, :, a:z], lse[:, :, a:z] = merge_attention([(out[:, :, a:z], lse[:, :, a:z]), part])
        if not inplace:
            whole = torch.cat(outs, 2), torch.cat(lses, 2)
            out, lse = whole if out is None else merge_attention([(out, lse), whole])
    return out, lse


class _LevelAttention(torch.autograd.Function):
    """The level-wise executor with its own backward (flash-attention style): forward keeps its inputs (q, k, v,
    the bias and relative tables), its output and the log-sum-exp (O(n · d)); backward pools the spans again and,
    chunk by chunk, recomputes each tier's scores, takes the probabilities from the final log-sum-exp
    (exp(s - lse): the sides stay independent) and adds the windows' gradients back into the nodes by index."""

    @staticmethod
    def forward(ctx, q, k, v, key_padding_mask, relative_bias, table, context, causal, scale):
        out, lse = _forward_levels(
            q, k, v, key_padding_mask, relative_bias, table, context, causal, scale, 0.0, "inplace"
        )
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, key_padding_mask, relative_bias, table, out, lse)
        ctx.settings = (context, causal, scale)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, key_padding_mask, relative_bias, table, out, lse = ctx.saved_tensors
        context, causal, scale = ctx.settings
        b, h, n, d = q.shape
        dtype = compute_dtype(q.dtype)
        levels = num_levels(n, context)
        nodes = _level_nodes(k, v, key_padding_mask, levels, context)
        grad_out = grad_out.to(dtype)
        delta = (grad_out * out.to(dtype)).sum(-1)  # [b, h, n]: sum_j p_ij (dO_i · v_j)
        lse = zero_empty_shift(lse)  # a row that sees no key: its scores are all -inf, exp(-inf - 0) = 0
        spans = tuple(x.new_zeros(x.shape, dtype=dtype) for x in (nodes.spans_k, nodes.spans_v))
        grads = _Grads(
            q.new_zeros(q.shape, dtype=dtype), k.new_zeros(k.shape, dtype=dtype), v.new_zeros(v.shape, dtype=dtype),
            spans, torch.zeros_like(relative_bias, dtype=dtype),
            None if table is None else torch.zeros_like(table, dtype=dtype),
        )  # fmt: skip
        for side in _layout(n, context, causal, q.device):
            biases = _side_biases(side, relative_bias, table, dtype)
            for y0, r0, r1, a, z in _side_chunk_rows(side, n, b, h):
                q_rows = _rows(q, r0, r1).to(dtype) * scale
                rows = (q_rows, _rows(grad_out, r0, r1), _rows(delta, r0, r1), _rows(lse, r0, r1))
                table_rows = None if table is None else _rows(table, r0, r1)
                grad_q_rows = torch.zeros_like(q_rows)
                grad_table_rows = None if table is None else torch.zeros_like(table_rows, dtype=dtype)
                chunk = _chunk(nodes, side, y0, q_rows.shape[2], dtype)
                chunk_grads = None if chunk is None else (torch.zeros_like(chunk.keys), torch.zeros_like(chunk.values))
                for number, tier in enumerate(side.tiers):
                    targets = chunk_grads if tier.low < LOCAL_LEVELS else grads.spans
                    args = (nodes, chunk, targets, tier, number, y0, biases, table_rows, grads.bias)
                    _backward_tier(rows, *args, grad_q_rows, grad_table_rows)
                if chunk is not None:
                    add_chunk_grads(grads.k, grads.v, grads.spans, chunk_grads, chunk, levels)
                grads.q[:, :, a:z].add_(grad_q_rows[:, :, a - r0 : z - r0], alpha=scale)  # d(scale·q)/dq
                if grads.table is not None:
                    grads.table[:, :, a:z] += grad_table_rows[:, :, a - r0 : z - r0]
        counts = nodes.counts
        del nodes
        if levels > LOCAL_LEVELS:  # the spans are linear in the tokens: their gradients go back through the pooling
            unpool(grads.k, grads.spans[0], counts, levels, LOCAL_LEVELS)
            unpool(grads.v, grads.spans[1], counts, levels, LOCAL_LEVELS)
        return (
            grads.q.to(q.dtype),
            grads.k.to(k.dtype),
            grads.v.to(v.dtype),
            None,
            grads.bias.to(relative_bias.dtype),
            None if table is None else grads.table.to(table.dtype),
            None,
            None,
            None,
        )


class _Grads(NamedTuple):
    """`_LevelAttention.backward`'s accumulators in the compute dtype: q, k, v `[b, h, n, d]`, the kept spans'
    (keys, values), the relative bias `[h, E]` and the relative table (None without one)."""

    q: Tensor
    k: Tensor
    v: Tensor
    spans: tuple[Tensor, Tensor]
    bias: Tensor
    table: Tensor | None


def _backward_tier(rows, nodes, chunk, targets, tier, number, y0, biases, table_rows, grad_bias, grad_q_rows,
                   grad_table_rows) -> None:  # fmt: skip
    """One tier's gradients for a chunk: `rows` (scaled q, dO, delta, lse) of the chunk's rows; the windows'
    key and value gradients are added into `targets` (the chunk's node arrays or the kept spans, by `_gather`'s
    source), the rows' into `grad_q_rows` and `grad_table_rows`, the bias's into `grad_bias`."""
    q_rows, do_rows, delta_rows, lse_rows = rows
    g = tier.group
    g0, g1 = y0 // g, y0 // g + q_rows.shape[2] // g
    index = _window_index(nodes, chunk, tier, g0, g1)
    keys = _gather(nodes, chunk, tier, index, False).to(q_rows.dtype)  # [b, h, ng, M, d]
    values = _gather(nodes, chunk, tier, index, True).to(q_rows.dtype)
    q_groups, do_groups = q_rows.unflatten(2, (g1 - g0, g)), do_rows.unflatten(2, (g1 - g0, g))
    scores = _tier_scores(q_groups, keys, tier, number, g0, g1, biases, table_rows, nodes.real)
    probs = scores.sub_(lse_rows.unflatten(2, (g1 - g0, g))[..., None]).exp_()
    grad_scores = do_groups @ values.transpose(-1, -2)
    grad_scores.sub_(delta_rows.unflatten(2, (g1 - g0, g))[..., None]).mul_(probs)  # [b, h, ng, G, M]
    index = index.flatten()
    targets[1].index_add_(2, index, (probs.transpose(-1, -2) @ do_groups).flatten(2, 3))
    targets[0].index_add_(2, index, (grad_scores.transpose(-1, -2) @ q_groups).flatten(2, 3))
    grad_q_rows.view(q_groups.shape).add_(grad_scores @ keys)
    per_type = grad_scores.sum(0)  # [h, ng, G, M]
    types = tier.types
    if types.dim() == 2:
        per_type = per_type.sum(1)
    else:
        types = types[g0:g1]
    grad_bias.index_add_(1, types.flatten(), per_type.flatten(1))
    columns = biases.columns[number]
    if grad_table_rows is not None and columns is not None:
        columns = columns if columns.dim() == 2 else columns[g0:g1]
        token_grads = grad_scores[..., : tier.tokens]
        grad_table_rows.view(*q_groups.shape[:4], -1).scatter_add_(-1, columns.expand(*token_grads.shape), token_grads)


def _attend_levels(q, k, v, key_padding_mask, relative_bias, table, context, causal, scale, dropout_p):
    """`binary_partition_attention`'s level-wise executor on token q, k, v `[b, h, n, d]` (padding mask `[b, n]` or
    None) and the relative table `[b, h, n, 2M + 1]` or None -> `[b, h, n, d]`.

    In training it keeps for backward only O(n · d) tensors: `_LevelAttention`, or, with attention dropout (whose
    masks must be replayed), `torch.utils.checkpoint` around each chunk. `torch.compile` traces the plain chunks."""
    tensors = (q, k, v, relative_bias) + (() if table is None else (table,))
    training = torch.is_grad_enabled() and any(x.requires_grad for x in tensors)
    args = (q, k, v, key_padding_mask, relative_bias, table, context, causal, scale)
    if not training:
        return _forward_levels(*args, dropout_p, "inplace")[0].to(q.dtype)
    if torch.compiler.is_compiling():
        return _forward_levels(*args, dropout_p, "autograd")[0].to(q.dtype)
    if dropout_p == 0:
        return _LevelAttention.apply(*args)
    return _forward_levels(*args, dropout_p, "checkpoint")[0].to(q.dtype)


def binary_partition_attention(
    q: Tensor, k: Tensor, v: Tensor, *, context: int, causal: bool, key_padding_mask: Tensor | None,
    relative_bias: Tensor, scale: float, dropout_p: float = 0.0, relative_embedding: Tensor | None = None,
    dense: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:  # fmt: skip
    """The fast executor: blocks of `QUERY_BLOCK` queries attend to their gathered nodes (`block_layout`); with
    `dense`, the dense form. Both share the checks and the pooled span nodes (`pool_spans`).

    Args:
        q, k, v: `[b, h, n, d]` (rotary already applied); with `dense`, q `[b, h, n, d]` may be the last n of the m
            positions of k, v `[b, h, m, d]`.
        context: k, nodes per level and side.
        causal: Only the left side (the paper's language-model setting).
        key_padding_mask: `[b, m]` bool, True = real token; None = none.
        relative_bias: `[h, num_edge_types(context)]`, added to the logits per edge type.
        scale: Multiplier of q·k.
        dropout_p: Dropout on the attention probabilities.
        relative_embedding: Optional r `[2M + 1, d]`: relative-position logits on the token edges (module
            docstring).
        dense: The dense form instead (`binary_partition_reference`): the queries against all N nodes with the
            explicit edge table, and the weights too.

    Returns:
        `[b, h, n, d]`; with `dense`, (out `[b, h, n, d]`, weights `[b, h, n, m]`: each span's weight spread evenly
        over its real tokens, so that `weights @ v == out`).

    Raises:
        ValueError: Naming the argument: q, k, v that are not 4-d floating tensors of matching shapes (q with at
            most as many positions as k), a `context` below 1, a non-bool `causal` or `dense`, a `key_padding_mask`
            that is not a bool `[b, m]` tensor on q's device, a `relative_bias` that is not a floating
            `[h, num_edge_types(context)]` tensor on q's device, a non-finite `scale`, `dropout_p` outside [0, 1).
    """
    given = check_attention_inputs(
        q, k, v, scale=scale, dropout_p=dropout_p, key_padding_mask=key_padding_mask,
        relative_embedding=relative_embedding, flags={"causal": causal, "dense": dense},
    )  # fmt: skip
    context = check_positive_int("context", context, meaning="nodes per level and side")
    _check_relative_bias(relative_bias, given.heads, context, q.device)
    scale, dropout_p, key_padding_mask = given.scale, given.dropout_p, given.key_padding_mask
    relative_embedding = given.relative_embedding
    if is_empty(q, k):
        return (empty_attention(q, k, v), q.new_zeros(*q.shape[:3], k.shape[2])) if dense else empty_attention(q, k, v)
    # A context of m - 1 nodes per side already shows every key at level 0 (one level, whose edge types do not
    # depend on k): a larger one is clamped to it, never allocated by its size, and reads the same bias columns.
    context = min(context, max(k.shape[2] - 1, 1))
    relative_bias = relative_bias[:, : num_edge_types(context)]
    table = None if relative_embedding is None else relative_logit_table(q, relative_embedding, scale)
    if not dense:
        return _attend_levels(q, k, v, key_padding_mask, relative_bias, table, context, causal, scale, dropout_p)
    levels = num_levels(k.shape[2], context)
    nodes_k, real, counts = pool_spans(k, key_padding_mask, levels)  # [b, h, N, d], [b, N]
    nodes_v = pool_spans(v, key_padding_mask, levels)[0]
    n, m = q.shape[2], k.shape[2]
    edges = binary_partition_edges(m, context=context, causal=causal, q_offset=m - n).to(q.device)  # [n, N]
    dtype = compute_dtype(q.dtype)
    bias = relative_bias[:, edges.clamp(min=0)].to(dtype)  # [h, n, N]
    scores = (q.to(dtype) * scale) @ nodes_k.to(dtype).transpose(-1, -2) + bias  # [b, h, n, N]
    if table is not None:  # rows: positions m - n ..
        q_pos = torch.arange(m - n, m, device=q.device)[:, None]  # [n, 1]
        node = torch.arange(edges.shape[1], device=q.device)[None, :]  # [1, N]
        scores = scores + _token_edge_logits(table, q_pos, node, m, q_offset=m - n).to(dtype)
    probs = _softmax_rows(scores, (edges >= 0) & real[:, None, None, :], dropout_p)
    out = (probs @ nodes_v.to(dtype)).to(q.dtype)
    # A span's key and value are the means of its real tokens: its weight, spread over them, gives the same output.
    offsets = level_offsets(m, levels)
    tokens = torch.arange(m, device=q.device)
    token_real = real[:, :m].to(dtype)  # [b, m]
    weights = torch.zeros_like(probs[..., :m])
    for level in range(levels):
        index = offsets[level] + tokens // 2**level  # [m]
        weights = weights + probs[..., index] * (token_real / counts[:, index].clamp(min=1))[:, None, None, :]
    return out, weights.to(q.dtype)


def _check_relative_bias(relative_bias: Tensor, heads: int, context: int, device: torch.device) -> None:
    """Raises ValueError unless `relative_bias` is a floating `[heads, E]` tensor on `device` with at least the
    `num_edge_types(context)` columns the context reads (a larger context's table serves a smaller one: its first
    columns are the same edge types)."""
    needed = num_edge_types(context)
    if not isinstance(relative_bias, Tensor) or not relative_bias.is_floating_point():
        raise ValueError(
            f"relative_bias must be a floating-point tensor [{heads}, >= {needed}], got {relative_bias!r:.80}"
        )
    if relative_bias.dim() != 2 or relative_bias.shape[0] != heads or relative_bias.shape[1] < needed:
        raise ValueError(
            f"relative_bias must have shape [heads, >= num_edge_types(context)] = [{heads}, >= {needed}] for context "
            f"{context}, got {tuple(relative_bias.shape)}"
        )
    if relative_bias.device != device:
        raise ValueError(f"relative_bias is on {relative_bias.device} but q is on {device}: they must share one device")


def binary_partition_reference(q: Tensor, k: Tensor, v: Tensor, **settings: Any) -> tuple[Tensor, Tensor]:
    """The dense form: the n queries (the last n of m positions) against all N nodes, with the explicit edge table.

    Takes the keyword arguments of `binary_partition_attention` (`dense=True` there): q `[b, h, n, d]`; k, v
    `[b, h, m, d]`; key_padding_mask `[b, m]`.

    Returns:
        (out `[b, h, n, d]`, weights `[b, h, n, m]`: each span's weight spread evenly over its real tokens, so that
        `weights @ v == out`).
    """
    return binary_partition_attention(q, k, v, dense=True, **settings)


def _from_first_real_token(run, q: Tensor, k: Tensor, v: Tensor, key_padding_mask: Tensor | None):
    """`run(q, k, v, key_padding_mask) -> (out, weights or None)` on rows rolled left by their first real token.

    The tree is aligned to position 0; counted from each row's first real token instead, left padding does not move
    the spans over the real tokens (like the model's position ids). Left padding wraps to the end of the row, where it
    is still padding. Queries that are the last n_q of n_k positions (decoding) are run as all n_k positions.

    Returns:
        (out `[b, h, n_q, d]`, weights `[b, h, n_q, n_k]` or None), in the original order.
    """
    first = None if key_padding_mask is None else first_real_token(key_padding_mask)  # [b]
    # Reading `first` on the host would break a `torch.compile` graph, so compiled code always rolls.
    if first is None or (not torch.compiler.is_compiling() and not bool(first.any())):
        return run(q, k, v, key_padding_mask)
    b, h, n_q, _ = q.shape
    n_k = k.shape[2]
    positions = torch.arange(n_k, device=q.device).view(1, n_k)
    rolled_index = (positions + first.view(b, 1)) % n_k  # [b, n_k]: original position of each rolled slot
    unrolled_index = (positions - first.view(b, 1)) % n_k  # [b, n_k]: rolled slot of each original position

    def along(x: Tensor, index: Tensor, dim: int) -> Tensor:
        shape = [b, 1, 1, 1]
        shape[dim] = n_k
        return x.gather(dim, index.view(shape).expand(*x.shape[:dim], n_k, *x.shape[dim + 1 :]))

    q = F.pad(q, (0, 0, n_k - n_q, 0))  # [b, h, n_k, d]
    out, weights = run(*(along(x, rolled_index, 2) for x in (q, k, v)), key_padding_mask.gather(1, rolled_index))
    out = along(out, unrolled_index, 2)[:, :, n_k - n_q :]
    if weights is not None:
        weights = along(along(weights, unrolled_index, 2), unrolled_index, 3)[:, :, n_k - n_q :]
    return out, weights


class BinaryPartitionAttention(LongAttnAttention):
    """The `"binary_partition"` kind (BP-Transformer). Config field: `binary_partition_context` (k, nodes per
    level and side; int or one per layer). Parameter besides q/k/v/o_proj: `relative_bias` `[h, edge types]`."""

    attention_type = "binary_partition"
    settings = ("context",)

    def __init__(self, config: Any, *, layer_idx: int, is_causal: bool):
        super().__init__(config, layer_idx=layer_idx, is_causal=is_causal)
        self.relative_bias = nn.Parameter(torch.zeros(self.num_heads, num_edge_types(self.context)))
        self.reset_kind_parameters()

    @torch.no_grad()
    def reset_kind_parameters(self) -> None:
        """No relative bias at initialisation: the positions come from the model's own until it learns one."""
        init.zeros_(self.relative_bias)

    def _kwargs(self) -> dict[str, Any]:
        shared = self.layer_arguments("causal", "scale", "dropout_p", "relative_embedding")
        return dict(context=self.context, relative_bias=self.relative_bias, **shared)

    def attend(self, q, k, v, *, key_padding_mask, global_mask):
        def run(q, k, v, key_padding_mask):
            return binary_partition_attention(q, k, v, key_padding_mask=key_padding_mask, **self._kwargs()), None

        return _from_first_real_token(run, q, k, v, key_padding_mask)[0]

    def attend_dense(self, q, k, v, *, key_padding_mask, global_mask):
        """The dense form (cached decoding, `output_attentions`, "reference"): weights `[b, h, n, m]` over tokens."""

        def run(q, k, v, key_padding_mask):
            return binary_partition_reference(q, k, v, key_padding_mask=key_padding_mask, **self._kwargs())

        return _from_first_real_token(run, q, k, v, key_padding_mask)
