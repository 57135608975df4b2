"""BP-Transformer graph self-attention (Ye et al. 2019, "BP-Transformer: Modelling Long-Range Context via Binary
Partitioning"): each token attends to its neighbours and to span nodes of a binary partition tree, at growing scales.

Shape legend: b batch, h heads, n length (m keys: the cached tokens in decoding), d head dim, L levels,
N nodes (n tokens, then the spans of levels 1 .. L-1), nb query blocks of c, m nodes gathered per block.

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

**Executors.** `binary_partition_attention` cuts the queries into blocks of `QUERY_BLOCK` (c = 32); each block
gathers one set of node keys and values (indices into [token keys ; span keys]): at each level the window of nodes
its queries can reach, about 2c + L·(4k + 5) in all, shared by the c queries, so the scores are small matrix products
and never an n x n tensor. The edge type of every (query, gathered node) pair comes from the same predicate as the
dense table, gives the bias and hides the nodes a query does not see. It does not go through
`executor_blocked.attend_blocks`, which takes no additive bias. In training forward keeps only q, k, v (and the
bias and relative tables) for backward, O(n · d): backward pools the spans again and recomputes each chunk's gathered
nodes, scores and probabilities, adding the gathered nodes' gradients back by index (`_BlockedNodes`; with attention
dropout, whose masks must be replayed, `torch.utils.checkpoint` around each chunk). Span levels 1 and 2, 3/4 of the
span rows, are never kept: each chunk reads their nodes as means of the tokens (`_TOKEN_LEVELS`).
`binary_partition_reference` is the dense form: an explicit `[n, N]` edge table over all nodes (cached decoding,
where queries are the last positions of the cache, `output_attentions` with the span weights spread evenly over
their real tokens, the "reference" back end, and the tests).
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint
from transformers import initialization as init

from .attention_base import LongAttnAttention
from .numerics import compute_dtype, hide_logits
from .ops_checks import (
    check_dropout,
    check_flag,
    check_positive_int,
    check_qkv,
    check_scale,
    check_token_mask,
    empty_attention,
    is_empty,
)
from .patterns import first_real_token
from .relative_logits import check_relative_embedding, relative_logit_table
from .tuning import workspace_elements

__all__ = [
    "MAX_LEVELS",
    "QUERY_BLOCK",
    "BinaryPartitionAttention",
    "binary_partition_attention",
    "binary_partition_edges",
    "binary_partition_levels",
    "binary_partition_reference",
    "block_layout",
    "level_offsets",
    "num_levels",
    "num_edge_types",
    "pool_spans",
]

MAX_LEVELS = 32
"""Levels the relative bias table holds (2^31 tokens): fixed, so the parameter does not depend on the length."""

QUERY_BLOCK = 32
"""Queries per block of the blocked executor (a power of two, so that blocks align with the tree)."""

# Elements of one chunk's scores [b, h, blocks, c, m]: an eighth of the blocked executors' workspace budget for this
# machine (`tuning.workspace_elements()`; 2**18, 1 MB, where the budget is 2**21), since its gathered keys and values
# (m x d per block, about twice the c x m scores at d = 64) and their gradients take a few times more, recomputed in
# backward. One layer, forward + backward, one thread, CPU time, median of 2 alternated rounds: 4K tokens 2**17
# 0.97 s, 2**18 0.84 s, 2**19 0.69 s, 2**20 0.76 s, 2**21 1.02 s; 8K tokens 2**18 1.55 s, 2**19 1.43 s, 2**20 1.51 s.
# A quarter of the budget (2**19) would be 8-17% faster, for 12% more peak memory (174 MB against 155 at 4K): kept at
# an eighth, as BP-Transformer's peak is already the largest of the kinds.
_CHUNK_ELEMENTS = workspace_elements() // 8


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
        size = 2**level
        # k nodes, then one more if needed so that the next level starts on a multiple of its node size.
        right.append(torch.div(right[-1] + context * size + 2 * size - 1, 2 * size, rounding_mode="floor") * 2 * size)
        left.append(torch.div(left[-1] - context * size, 2 * size, rounding_mode="floor") * 2 * size)
    return torch.stack(right, dim=1), torch.stack(left, dim=1)


def level_offsets(n: int, levels: int) -> list[int]:
    """Index of each level's first node in the node list [tokens ; level 1 ; level 2 ; ...]; the last entry is N."""
    offsets, total = [0], n
    for level in range(1, levels):
        offsets.append(total)
        total += -(-n // 2**level)
    offsets.append(total)
    return offsets


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


def block_layout(
    n: int, *, context: int, causal: bool, block: int = QUERY_BLOCK, device: torch.device | None = None
) -> tuple[Tensor, Tensor]:
    """The blocked executor's layout: each block of `block` queries gathers one shared set of nodes.

    At level l the queries of block [s, s + c) see nodes of index in [s/2^l − 2(k+1), (s+c)/2^l + 2(k+1)] (a
    right-side cursor moves at most (k+1)·(2^(l+1) − 1) past the query, the left one alike), so the block gathers
    that window of every level: about 2c + L·(4k + 5) nodes, shared by c queries. The edge types come from `_edges`.

    Returns:
        (nodes `[nb, m]` long, indices into the node list; edges `[nb, c, m]` long, -1 where the query does not see
        the node, also for window slots outside the level).
    """
    levels = num_levels(n, context)
    offsets = level_offsets(n, levels)
    blocks = -(-n // block)
    first = torch.arange(blocks, device=device) * block  # [nb]
    nodes, node_level, node_start, exists = [], [], [], []
    reach = 2 * (context + 1)
    for level in range(levels):
        size, count = 2**level, offsets[level + 1] - offsets[level]
        width = max(block // size, 1) + reach * (1 if causal else 2) + 1
        index = torch.div(first, size, rounding_mode="floor")[:, None] - reach + torch.arange(width, device=device)
        exists.append((index >= 0) & (index < count))  # [nb, w]
        nodes.append(offsets[level] + index.clamp(0, count - 1))
        node_level.append(torch.full_like(index, level))
        node_start.append(index * size)
    nodes, exists = torch.cat(nodes, 1), torch.cat(exists, 1)  # [nb, m]
    positions = first[:, None] + torch.arange(block, device=device)  # [nb, c]; positions >= n are padding
    edges = _edges(
        positions,
        torch.cat(node_level, 1)[:, None],
        torch.cat(node_start, 1)[:, None],
        n=n,
        context=context,
        causal=causal,
    )  # [nb, c, m]
    return nodes, edges.masked_fill(~exists[:, None], -1)


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


def _pool_levels(x: Tensor, key_padding_mask: Tensor | None, levels: int, first: int = 1) -> tuple[Tensor, Tensor]:
    """The span nodes alone: the spans of levels first .. L-1 as the mean of their real tokens.

    Args:
        x: `[b, h, n, d]` token keys or values.
        key_padding_mask: `[b, n]` bool, True = real token; None = none.
        first: The lowest level kept (>= 1); the blocked executor reads the levels below from the tokens.

    Returns:
        (spans `[b, h, N - offsets[first], d]` in x's dtype, `level_offsets`' order; counts `[b, N]`, real tokens
        per node, tokens included).
    """
    b, h, n, d = x.shape
    dtype = compute_dtype(x.dtype)
    real = torch.ones(b, n, dtype=dtype, device=x.device) if key_padding_mask is None else key_padding_mask.to(dtype)
    sums, counts = x.to(dtype) * real[:, None, :, None], real  # [b, h, n, d], [b, n]
    span_sums, node_counts = [sums.new_zeros(b, h, 0, d)], [counts]
    for level in range(1, levels):
        if sums.shape[2] % 2:
            sums, counts = F.pad(sums, (0, 0, 0, 1)), F.pad(counts, (0, 1))
        sums = sums.unflatten(2, (-1, 2)).sum(3)  # [b, h, n_l, d]
        counts = counts.unflatten(1, (-1, 2)).sum(2)  # [b, n_l]
        if level >= first:
            span_sums.append(sums)
        node_counts.append(counts)
    counts = torch.cat(node_counts, 1)  # [b, N]
    spans = (
        torch.cat(span_sums, 2)
        / counts[:, level_offsets(n, levels)[min(first, levels)] :].clamp(min=1)[:, None, :, None]
    )
    return spans.to(x.dtype), counts


def pool_spans(x: Tensor, key_padding_mask: Tensor | None, levels: int) -> tuple[Tensor, Tensor, Tensor]:
    """The node list: the tokens, then each level's spans as the mean of their real tokens.

    Args:
        x: `[b, h, n, d]` token keys or values.
        key_padding_mask: `[b, n]` bool, True = real token; None = none.

    Returns:
        (nodes `[b, h, N, d]` in x's dtype; real `[b, N]` bool, False for spans without a real token; counts
        `[b, N]`, real tokens per node).
    """
    spans, counts = _pool_levels(x, key_padding_mask, levels)
    return torch.cat([x, spans], 2), counts > 0, counts  # tokens kept exactly as they are


def _softmax_rows(scores: Tensor, visible: Tensor, dropout_p: float) -> Tensor:
    """Softmax over the last dim with hidden entries masked; rows with no visible entry give zeros."""
    probs = torch.softmax(hide_logits(scores, ~visible), dim=-1) * visible.any(-1, keepdim=True)
    return F.dropout(probs, p=dropout_p) if dropout_p > 0 else probs


@lru_cache(maxsize=4)
def _cached_block_layout(n: int, context: int, causal: bool, device: torch.device) -> tuple[Tensor, Tensor]:
    """`block_layout`, kept narrow: it stays in memory, and in int64 its edge table `[nb, c, m]` is 45 MB at 16K
    tokens (k = 4); edge types fit int16 (at most `num_edge_types`, 1 + 64·(k+1)), node indices int32. Each chunk
    widens its own slice back to int64."""
    nodes, edges = block_layout(n, context=context, causal=causal, device=device)
    narrow = torch.int16 if num_edge_types(context) < 2**15 else torch.int32
    return nodes.to(torch.int32), edges.to(narrow)  # N < 2n nodes: int32 up to 2^30 tokens


def _token_edge_logits(table: Tensor, q_pos: Tensor, node: Tensor, n: int, q_offset: int = 0) -> Tensor:
    """Relative logits of token edges: `table` `[b, h, n_q, 2M + 1]` of the queries at positions q_offset .. read at
    queries `q_pos` (positions) and nodes `node` (indices into the node list, broadcastable with q_pos), 0 for span
    nodes (index >= n). Query positions outside the table (padding slots) are clamped into it."""
    reach = (table.shape[-1] - 1) // 2
    row = (q_pos - q_offset).clamp(0, table.shape[2] - 1)
    token = node < n
    column = (node.clamp(max=n - 1) - q_pos).clamp(-reach, reach) + reach
    return table[:, :, row, column] * token


_TOKEN_LEVELS = 2
"""Span levels 1 .. this one are read from the tokens by each chunk (a level-l node is the mean of its 2^l real
tokens) instead of being pooled and kept: they hold 3/4 of the spans, and a block reads only about
c + 2^l · (2(k+1)·2 + 1) of their tokens, so forward and backward keep n/4 span rows per tensor instead of n."""


def _level_widths(levels: int, context: int, causal: bool, block: int = QUERY_BLOCK) -> list[int]:
    """Columns of each level in `block_layout`'s node sets, level 0 first (the same windows)."""
    reach = 2 * (context + 1)
    return [max(block // 2**level, 1) + reach * (1 if causal else 2) + 1 for level in range(levels)]


class _Chunk:
    """One chunk of query blocks [start, stop) of the blocked executor: its slices of the layout, and its inputs
    gathered from the O(n · d) tensors (queries, tokens, the kept spans), so that forward and backward read the
    same. Node columns: level 0 (tokens), levels 1 .. G (`_TOKEN_LEVELS`, means of tokens), levels above (kept
    spans)."""

    def __init__(self, start: int, stop: int, n: int, nodes: Tensor, edges: Tensor, widths: list[int]):
        self.start, self.stop, self.n = start, stop, n
        self._nodes, self._edges = nodes[start:stop], edges[start:stop]  # views of the (narrow) layout
        self.c = edges.shape[1]
        self.first, self.last = start * self.c, min(n, stop * self.c)  # the queries [first, last)
        levels = len(widths)
        offsets = level_offsets(n, levels)
        self.low = min(_TOKEN_LEVELS, levels - 1)
        columns = [0]
        for width in widths:
            columns.append(columns[-1] + width)
        self.columns = columns  # level l in columns [columns[l], columns[l + 1])
        self.span_base = offsets[self.low + 1]  # node index of the first kept span
        self.tokens = {}  # level -> (node columns, token index [nbc, w, 2^l] unclamped)
        for level in range(1, self.low + 1):
            node = self._nodes[:, columns[level] : columns[level + 1]].long()  # [nbc, w]
            size = 2**level
            token = (node - offsets[level])[..., None] * size + torch.arange(size, device=node.device)
            self.tokens[level] = (node, token)

    @property
    def nodes(self) -> Tensor:
        """Long `[nbc, m]`, widened when used: the chunks of a whole pass exist at once, their int64 copies not."""
        return self._nodes.long()

    @property
    def edges(self) -> Tensor:
        """Long `[nbc, c, m]`, widened when used."""
        return self._edges.long()

    def _token_weights(self, level: int, counts: Tensor) -> tuple[Tensor, Tensor]:
        """(token index `[nbc, w, 2^l]`, weights `[b, nbc, w, 2^l]`) of the level's nodes as means of their real
        tokens (`counts` `[b, N]`, tokens first)."""
        node, token = self.tokens[level]
        index = token.clamp(max=self.n - 1)
        weight = _take(counts, 1, index) * (token < self.n) / _take(counts, 1, node).clamp(min=1)[..., None]
        return index, weight

    def gather(self, tokens: Tensor, spans: Tensor, counts: Tensor) -> Tensor:
        """The node keys or values of the chunk's blocks -> `[b, h, nbc, m, d]` (tokens `[b, h, n, d]`, kept spans
        `[b, h, N - offsets[G + 1], d]`, counts `[b, N]`)."""
        dtype = compute_dtype(tokens.dtype)
        parts = [_take(tokens, 2, self.nodes[:, : self.columns[1]])]
        for level in range(1, self.low + 1):
            index, weight = self._token_weights(level, counts)
            mean = torch.einsum("bhnwrd,bnwr->bhnwd", _take(tokens, 2, index).to(dtype), weight.to(dtype))
            parts.append(mean.to(tokens.dtype))
        parts.append(_take(spans, 2, self.nodes[:, self.columns[self.low + 1] :] - self.span_base))
        return torch.cat(parts, 3)

    def scatter(self, grad: Tensor, grad_tokens: Tensor, grad_spans: Tensor, counts: Tensor) -> None:
        """Adds the gradient of `gather`'s output `[b, h, nbc, m, d]` into the tokens' and kept spans' gradients."""
        dtype = grad_tokens.dtype
        split = self.columns[1]
        grad_tokens.index_add_(2, self.nodes[:, :split].flatten(), grad[:, :, :, :split].flatten(2, 3).to(dtype))
        for level in range(1, self.low + 1):
            index, weight = self._token_weights(level, counts)
            part = grad[:, :, :, self.columns[level] : self.columns[level + 1]].to(dtype)  # [b, h, nbc, w, d]
            shares = part[:, :, :, :, None, :] * weight[:, None, :, :, :, None].to(dtype)  # [b, h, nbc, w, 2^l, d]
            grad_tokens.index_add_(2, index.flatten(), shares.flatten(2, 4))
        split = self.columns[self.low + 1]
        spans = (self.nodes[:, split:] - self.span_base).flatten()
        grad_spans.index_add_(2, spans, grad[:, :, :, split:].flatten(2, 3).to(dtype))

    def blocks(self, x: Tensor) -> Tensor:
        """Rows [first, last) of `[b, h, n, d]` as blocks `[b, h, nbc, c, d]`, the last block padded with zeros."""
        x = x[:, :, self.first : self.last]
        return F.pad(x, (0, 0, 0, (self.stop - self.start) * self.c - x.shape[2])).unflatten(2, (-1, self.c))

    def visible(self, real: Tensor) -> Tensor:
        """`[b, 1, nbc, c, m]`: the edges the queries have to real nodes (`real` `[b, N]`)."""
        return ((self.edges >= 0) & _take(real, 1, self.nodes)[:, :, None, :])[:, None]

    def attend(self, q_blocks, keys, values, relative_bias, table_rows, visible, scale, dropout_p) -> Tensor:
        """q_blocks `[b, h, nbc, c, d]`, keys and values `[b, h, nbc, m, d]`, relative_bias `[h, E]`, the relative
        table's rows [first, last) `[b, h, q, 2M + 1]` or None -> out `[b, h, nbc, c, d]`."""
        dtype = compute_dtype(q_blocks.dtype)
        bias = _take(relative_bias, 1, self.edges.clamp(min=0)).to(dtype)  # [h, nbc, c, m]
        scores = (q_blocks.to(dtype) * scale) @ keys.to(dtype).transpose(-1, -2) + bias  # [b, h, nbc, c, m]
        if table_rows is not None:
            q_pos = torch.arange(self.first, self.stop * self.c, device=q_blocks.device).view(-1, self.c)  # [nbc, c]
            logits = _token_edge_logits(table_rows, q_pos[:, :, None], self.nodes[:, None, :], self.n, self.first)
            scores = scores + logits.to(dtype)
        return (_softmax_rows(scores, visible, dropout_p) @ values.to(dtype)).to(q_blocks.dtype)


def _take(x: Tensor, dim: int, index: Tensor) -> Tensor:
    """`x` indexed by the integer tensor `index` along `dim` (`x[:, index]` for dim 1, `x[:, :, index]` for dim 2):
    the same values through `index_select`, whose contiguous row copies run 2-4x faster on CPU than advanced
    indexing's generic gather."""
    picked = x.index_select(dim, index.flatten())
    return picked.view(*x.shape[:dim], *index.shape, *x.shape[dim + 1 :])


def _layout_chunks(n: int, b: int, h: int, context: int, causal: bool, device: torch.device) -> list[_Chunk]:
    """The blocked layout of n queries cut into chunks of about `_CHUNK_ELEMENTS` scores."""
    if torch.compiler.is_compiling():
        nodes, edges = block_layout(n, context=context, causal=causal, device=device)  # [nb, m], [nb, c, m]
    else:  # the layout depends on the length only: built once per length, not in every layer and step
        nodes, edges = _cached_block_layout(n, context, causal, device)
    blocks, c, m = edges.shape
    step = max(1, _CHUNK_ELEMENTS // max(1, b * h * c * m))
    widths = _level_widths(num_levels(n, context), context, causal, c)
    return [_Chunk(start, min(blocks, start + step), n, nodes, edges, widths) for start in range(0, blocks, step)]


def _attend_chunks(q, k, v, key_padding_mask, relative_bias, table, context, causal, scale, dropout_p, recompute):
    """The blocked executor's forward: spans pooled once, then chunk by chunk -> `[b, h, n, d]`. With `recompute`
    each chunk runs under `torch.utils.checkpoint` (the path with attention dropout, whose masks it replays)."""
    b, h, n, d = q.shape
    levels = num_levels(n, context)
    spans_k, counts = _pool_levels(k, key_padding_mask, levels, _TOKEN_LEVELS + 1)  # [b, h, N', d], [b, N]
    spans_v = _pool_levels(v, key_padding_mask, levels, _TOKEN_LEVELS + 1)[0]
    real = counts > 0
    chunks = _layout_chunks(n, b, h, context, causal, q.device)

    def run(chunk: _Chunk, q, k, v, spans_k, spans_v, relative_bias, table) -> Tensor:
        keys, values = chunk.gather(k, spans_k, counts), chunk.gather(v, spans_v, counts)
        table_rows = None if table is None else table[:, :, chunk.first : chunk.last]
        out = chunk.attend(
            chunk.blocks(q), keys, values, relative_bias, table_rows, chunk.visible(real), scale, dropout_p
        )
        return out.flatten(2, 3)[:, :, : chunk.last - chunk.first]

    if not torch.is_grad_enabled():  # written into one output, no list of chunks and no concatenation
        out = q.new_empty(b, h, n, d)
        for chunk in chunks:
            out[:, :, chunk.first : chunk.last] = run(chunk, q, k, v, spans_k, spans_v, relative_bias, table)
        return out
    args = (q, k, v, spans_k, spans_v, relative_bias, table)
    if recompute:  # recomputed in backward: the gathered keys, values and scores are not kept
        return torch.cat([checkpoint(run, chunk, *args, use_reentrant=False) for chunk in chunks], 2)
    return torch.cat([run(chunk, *args) for chunk in chunks], 2)


class _BlockedNodes(torch.autograd.Function):
    """The blocked executor with its own backward: forward keeps only its inputs (q, k, v `[b, h, n, d]`, the bias
    table and the relative table); backward pools the spans again and recomputes each chunk's gathered nodes,
    scores and probabilities, one chunk at a time, adding the gradients of the gathered nodes into the tokens'
    and spans' gradients by index. Nothing larger than O(n · d) outlives a chunk."""

    @staticmethod
    def forward(ctx, q, k, v, key_padding_mask, relative_bias, table, context, causal, scale):
        ctx.save_for_backward(q, k, v, key_padding_mask, relative_bias, table)
        ctx.settings = (context, causal, scale)
        return _attend_chunks(q, k, v, key_padding_mask, relative_bias, table, context, causal, scale, 0.0, False)

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, key_padding_mask, relative_bias, table = ctx.saved_tensors
        context, causal, scale = ctx.settings
        b, h, n, d = q.shape
        levels = num_levels(n, context)
        spans_k, counts = _pool_levels(k, key_padding_mask, levels, _TOKEN_LEVELS + 1)
        spans_v = _pool_levels(v, key_padding_mask, levels, _TOKEN_LEVELS + 1)[0]
        real = counts > 0
        dtype = compute_dtype(q.dtype)  # gradients gathered from many chunks add up in the compute dtype
        grad_q = torch.empty_like(q)
        grad_k, grad_v = k.new_zeros(k.shape, dtype=dtype), v.new_zeros(v.shape, dtype=dtype)
        grad_spans_k, grad_spans_v = (x.new_zeros(x.shape, dtype=dtype) for x in (spans_k, spans_v))
        grad_bias = torch.zeros_like(relative_bias, dtype=dtype)
        grad_table = None if table is None else torch.zeros_like(table, dtype=dtype)
        for chunk in _layout_chunks(n, b, h, context, causal, q.device):
            leaves = [
                chunk.blocks(q),
                chunk.gather(k, spans_k, counts),
                chunk.gather(v, spans_v, counts),
                relative_bias,
            ]
            if table is not None:
                leaves.append(table[:, :, chunk.first : chunk.last])
            leaves = [x.detach().requires_grad_() for x in leaves]
            with torch.enable_grad():
                out = chunk.attend(
                    *leaves[:4], leaves[4] if table is not None else None, chunk.visible(real), scale, 0.0
                )
            grads = torch.autograd.grad(out, leaves, chunk.blocks(grad_out))
            grad_q[:, :, chunk.first : chunk.last] = grads[0].flatten(2, 3)[:, :, : chunk.last - chunk.first]
            chunk.scatter(grads[1], grad_k, grad_spans_k, counts)
            chunk.scatter(grads[2], grad_v, grad_spans_v, counts)
            grad_bias += grads[3]
            if table is not None:
                grad_table[:, :, chunk.first : chunk.last] += grads[4]
            del leaves, out, grads  # before the next chunk's, not while it is built
        del spans_k, spans_v
        # The spans are linear in the tokens: their gradients go back through the pooling (`_unpool`).
        if grad_spans_k.shape[2]:
            _unpool(grad_k, grad_spans_k, counts, levels, _TOKEN_LEVELS + 1)
            _unpool(grad_v, grad_spans_v, counts, levels, _TOKEN_LEVELS + 1)
        grad_table = None if table is None else grad_table.to(table.dtype)
        return (
            grad_q,
            grad_k.to(k.dtype),
            grad_v.to(v.dtype),
            None,
            grad_bias.to(relative_bias.dtype),
            grad_table,
            None,
            None,
            None,
        )


def _unpool(grad_tokens: Tensor, grad_spans: Tensor, counts: Tensor, levels: int, first: int) -> None:
    """The adjoint of `_pool_levels(.., levels, first)`: adds the gradient of the kept spans `[b, h, N', d]`
    (overwritten), with the node counts `[b, N]`, into the tokens' gradient `[b, h, n, d]` (in place: no temporary
    of the tokens' size).

    A span is the sum of its real tokens over its count, so a real token receives the sum over its ancestor spans
    of their gradient over their count: each level's share over its count, then from the top level down each
    level adds its parent's share (repeated twice), and level `first` gives its share to its 2^first tokens."""
    b, h, n, d = grad_tokens.shape
    sizes = [-(-n // 2**level) for level in range(first, levels)]
    base = level_offsets(n, levels)[first]
    share = grad_spans.div_(counts[:, base:].clamp(min=1)[:, None, :, None]).split(
        sizes, 2
    )  # views, level `first` first
    for level in range(len(sizes) - 2, -1, -1):
        share[level].add_(share[level + 1].repeat_interleave(2, 2)[:, :, : sizes[level]])
    size = 2**first
    whole, real = n // size, counts[:, :n]
    grad_tokens[:, :, : whole * size].view(b, h, whole, size, d).addcmul_(
        share[0][:, :, :whole, None, :], real[:, : whole * size].view(b, 1, whole, size, 1)
    )
    if n > whole * size:  # the last span, cut at n
        grad_tokens[:, :, whole * size :].addcmul_(share[0][:, :, whole:], real[:, None, whole * size :, None])


def _attend_gathered_nodes(q, k, v, key_padding_mask, relative_bias, table, context, causal, scale, dropout_p):
    """`binary_partition_attention`'s blocked executor on token q, k, v `[b, h, n, d]` (padding mask `[b, n]` or
    None) and the relative table `[b, h, n, 2M + 1]` or None -> `[b, h, n, d]`.

    In training it keeps for backward only O(n · d) tensors: `_BlockedNodes`, or, with attention dropout (whose
    masks must be replayed), `torch.utils.checkpoint` around each chunk. `torch.compile` traces the plain chunks."""
    tensors = (q, k, v, relative_bias) + (() if table is None else (table,))
    training = torch.is_grad_enabled() and any(x.requires_grad for x in tensors)
    if training and not torch.compiler.is_compiling():
        if dropout_p == 0:
            return _BlockedNodes.apply(q, k, v, key_padding_mask, relative_bias, table, context, causal, scale)
        return _attend_chunks(q, k, v, key_padding_mask, relative_bias, table, context, causal, scale, dropout_p, True)
    return _attend_chunks(q, k, v, key_padding_mask, relative_bias, table, context, causal, scale, dropout_p, False)


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
    b, h, _, n_k = check_qkv(q, k, v)
    context = check_positive_int("context", context, meaning="nodes per level and side")
    causal, dense = check_flag("causal", causal), check_flag("dense", dense)
    key_padding_mask = check_token_mask("key_padding_mask", key_padding_mask, b, n_k, device=q.device)
    _check_relative_bias(relative_bias, h, context, q.device)
    scale, dropout_p = check_scale(scale, q.shape[-1]), check_dropout(dropout_p)
    relative_embedding = check_relative_embedding(relative_embedding, q)
    if is_empty(q, k):
        return (empty_attention(q, k, v), q.new_zeros(*q.shape[:3], k.shape[2])) if dense else empty_attention(q, k, v)
    # A context of m - 1 nodes per side already shows every key at level 0 (one level, whose edge types do not
    # depend on k): a larger one is clamped to it, never allocated by its size, and reads the same bias columns.
    context = min(context, max(k.shape[2] - 1, 1))
    relative_bias = relative_bias[:, : num_edge_types(context)]
    table = None if relative_embedding is None else relative_logit_table(q, relative_embedding, scale)
    if not dense:
        return _attend_gathered_nodes(
            q, k, v, key_padding_mask, relative_bias, table, context, causal, scale, dropout_p
        )
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
