"""Routing attention (Roy et al. 2021, "Efficient Content-Based Sparse Attention with Routing Transformers"),
functional level.

The `"routing"` kind (`attention_routing.RoutingAttention`) wraps `routing_attention`, its dense form and the local
heads' attention, and moves its centroids with `cluster_statistics`.

Shape legend: b batch, h heads (hr routing heads, hl local heads), n length (m keys when it differs), d head dim,
C clusters, k members per cluster, W causal window, T query tasks, c query chunk.

Queries and keys are routed by online spherical k-means: both are normalised to unit length and compared with C
centroids (one set per head, a persistent buffer saved with the model). During training each centroid follows the
unit vectors it holds (the members it took in a balanced cluster; in the causal form, those nearest to it) by an
exponential moving average and is renormalised (`routing_ema_decay`). The update is applied when gradients flow
back through the layer, so that gradient checkpointing, which runs the forward pass twice, still updates once and
recomputes with the centroids of the first pass.

**Bidirectional (encoders), balanced clusters as in the paper.** Every centroid takes its k = ceil(n/C) most
similar queries and its k most similar keys (n counts real tokens only), and the queries of a cluster attend to its
keys: one batched matmul over `[b·hr·C, k, k]`. A query taken by several clusters attends to the keys of all of
them, as one softmax over their union (each cluster's output weighted by its log-sum-exp); a query no centroid took
gets a zero output from its routing heads (the paper's local heads cover it).

**Causal (decoders).** Balancing over the whole sequence leaks: whether a centroid takes an early token would
depend on how many later tokens compete for it. Here a causal query sees exactly the most recent W keys (at or
before its position) assigned to its own nearest centroid, all of them if the cluster has fewer
(`routing_causal_window`); which keys those are depends only on earlier tokens. Keys are sorted by (cluster,
position); a query's keys are then one contiguous run of at most W sorted keys, which lies inside two consecutive
blocks of W. Queries, sorted the same way, are packed into tasks of at most c = W/2 queries sharing their two key
blocks, so each task is one dense `[c, 2W]` attention, and there are at most n/c + n/W tasks per head.

**Local heads.** As in the paper, the last `routing_num_local_heads` heads attend to a local window instead
(`routing_local_window` keys on each side, or before in a decoder), through `ops.sliding_window_attention`; their
dense form is `local_attention_dense`.

The window executor of each back end is declared once, in `ROUTING_WINDOWS`.
"""

from __future__ import annotations

import functools
import math
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from .executor_families import StepExecutors
from .numerics import EXACTLY_HIDDEN, NO_KEY_LSE, compute_dtype, hide_exactly
from .ops_checks import check_attention_inputs, check_positive_int, check_token_mask, empty_attention, is_empty
from .ops_lsh_chunks import attend_windows, attend_windows_on_kernel, select_windows_executor
from .ops_lsh_gathered import RelativeColumns, attend_gathered_windows
from .ops_lsh_sorting import gather_rows, head_rows
from .patterns import document_index
from .relative_logits import materialize_bias, relative_bias, relative_logit_table

__all__ = [
    "ROUTING_WINDOWS",
    "cluster_statistics",
    "local_attention_dense",
    "routing_attention",
    "routing_attention_dense",
]

ROUTING_WINDOWS = StepExecutors(
    "routing",
    "windows",
    {"torch": attend_windows, "xformers": attend_windows_on_kernel},
    note=" (the kind's dense form is `routing_attention_dense`)",
)
"""The window executor each back end runs routing's clusters and tasks on: the PyTorch kernel (`"auto"`, `"torch"`;
without dropout its gathered form, `attend_gathered_windows`), or the same windows on xformers' kernel (CUDA, no
dropout), which `"auto"` does not pick until it is measured on a GPU."""


# ---------------------------------------------------------------------------------------------- clustering
def _unit(x: Tensor) -> Tensor:
    return F.normalize(x.detach().float(), dim=-1)


def _top_members(scores: Tensor, size: int) -> Tensor:
    """The indices `[R, size]` of the `size` largest scores of each row of `scores [R, n]`, largest first: the same
    members as `scores.topk(size)` (ties aside), found with two top-ks over about 2·sqrt(n·size) scores per row
    instead of one over n.

    The row is cut into g strips of G scores (and a rest of n - g·G < g); group j holds score j of every strip. The
    `size` largest group maxima are `size` scores, so the size-th largest score is at least the smallest of them, and
    each of the `size` largest scores lies in one of those `size` groups or in the rest. One top-k runs over the G
    maxima (taken in one vectorised pass), one over the scores of the chosen groups and the rest that are at least the
    smallest chosen maximum.
    """
    rows, n = scores.shape
    group, width = _strips(n, size)
    if group < 4:  # too little to gain
        return scores.topk(size, dim=-1).indices
    maxima = scores[:, : group * width].view(rows, group, width).amax(dim=1)  # [R, G]
    best = maxima.topk(size, dim=-1, sorted=False)  # the `size` best groups [R, size], in any order
    columns = _candidate_columns(best.indices, group, width, n)
    return _largest(scores.gather(-1, columns), columns, best.values, size)  # [R, size·g + rest] candidates


def _strips(n: int, size: int) -> tuple[int, int]:
    """(g, G): g strips of G positions (and a rest of n - g·G < g) for picking the `size` largest of n scores."""
    group = int(math.sqrt(n / size))  # g, minimises G + size·g
    return group, n // max(group, 1)


def _candidate_columns(best: Tensor, group: int, width: int, n: int) -> Tensor:
    """The positions `[R, size·g + rest]` of the chosen groups `best [R, size]` (group j: position j of every strip),
    then the rest after the last whole strip: the only places the `size` largest scores can be."""
    rows = best.shape[0]
    columns = (best.unsqueeze(-1) + torch.arange(0, group * width, width, device=best.device)).view(rows, -1)
    if group * width < n:
        columns = torch.cat([columns, torch.arange(group * width, n, device=best.device).expand(rows, -1)], dim=-1)
    return columns


def _largest(values: Tensor, columns: Tensor, maxima: Tensor, size: int) -> Tensor:
    """The columns `[R, size]` of the `size` largest candidate `values [R, M]` (at `columns [R, M]`) of each row,
    largest first, given the `size` chosen group maxima `[R, size]` (see `_top_members`)."""
    rows = values.shape[0]
    # Only scores at least the smallest chosen maximum can be among the `size` largest: typically few more than
    # `size` of them (about 140 of 2048 at 32K tokens). Packed to the left of each row (as wide as the row keeping
    # most), the last top-k reads only those.
    keep = values >= maxima.amin(dim=-1, keepdim=True)
    slot = keep.cumsum(dim=-1)
    kept = int(slot[:, -1].max())
    slot = torch.where(keep, slot - 1, kept)  # the others go to a last column, cut off
    packed = values.new_full((rows, kept + 1), EXACTLY_HIDDEN).scatter_(-1, slot, values)[:, :kept]
    packed_columns = columns.new_zeros((rows, kept + 1)).scatter_(-1, slot, columns)[:, :kept]
    return packed_columns.gather(-1, packed.topk(size, dim=-1).indices)


def _nearest(x: Tensor, centroids: Tensor) -> Tensor:
    """Index of the nearest centroid `[b, h, n]`; the length of x does not change which one, so no normalising."""
    return torch.matmul(x.detach().float(), centroids.float().transpose(-1, -2)).argmax(-1)


def _balanced_members(x: Tensor, centroids: Tensor, valid: Tensor | None, size: int) -> tuple[Tensor, Tensor]:
    """Each centroid's `size` most similar real positions `[b, h, C, size]` (by cosine, most similar first), and which
    slots count `[b, 1, 1, size]` (the first ceil(real_b / C) of them, real_b the number of real tokens of row b).

    Args:
        x: Queries or keys `[b, h, n, d]` (compared by cosine: their norms do not count).
        centroids: Unit centroids `[h, C, d]`.
        valid: Bool `[b, n]`, True = real token, or None.
        size: Members per centroid, at most n.
    """
    b, h, n, _ = x.shape
    clusters = centroids.shape[1]
    device = x.device
    top = torch.empty(b, h, clusters, size, dtype=torch.long, device=device)
    rows, row_of = head_rows(x.detach().float())  # [b·h·n, d]: norms of contiguous rows, 8x faster than per head
    inverse_norm = rows.norm(dim=-1).clamp_min(1e-12).reciprocal()  # F.normalize's eps
    positions = torch.arange(n, device=device)
    group, width = _strips(n, size)  # g strips of G positions, as in `_top_members`
    if group < 4:  # too little to gain from the grouped selection: `_top_members` is one plain top-k
        for bi in range(b):
            for hi in range(h):
                unit = x[bi, hi].detach().float() * inverse_norm[row_of(bi, hi, positions)].unsqueeze(-1)  # [n, d]
                block = torch.matmul(centroids[hi].float(), unit.T)  # [C, n]
                if valid is not None:
                    hide_exactly(block, ~valid[bi], inplace=True)
                top[bi, hi] = _top_members(block, size)
    else:
        # Similarities position-major, `[n, C]`, a strip of G positions at a time: `[G, d] @ [d, C]` with the small
        # centroid matrix as the reused operand ran 1.5-2.5x faster than `[C, d] @ [d, n]` (same values, bit for bit),
        # and the group maxima of `_top_members` (score j of every strip) are a running maximum of the strips, taken
        # while the strip is still in cache.
        scores = torch.empty(n, clusters, dtype=torch.float32, device=device)
        maxima = torch.empty(width, clusters, dtype=torch.float32, device=device)  # [G, C]
        strips = [(start, min(n, start + width)) for start in range(0, n, width)]  # g strips, then the rest
        for bi in range(b):
            for hi in range(h):
                unit = x[bi, hi].detach().float() * inverse_norm[row_of(bi, hi, positions)].unsqueeze(-1)  # [n, d]
                transposed = centroids[hi].float().T  # [d, C]
                for strip, (start, stop) in enumerate(strips):
                    part = torch.matmul(unit[start:stop], transposed, out=scores[start:stop])
                    if valid is not None:
                        hide_exactly(part, ~valid[bi, start:stop, None], inplace=True)
                    if strip == 0:
                        maxima.copy_(part)
                    elif strip < group:
                        torch.maximum(maxima, part, out=maxima)
                best = maxima.T.topk(size, dim=-1, sorted=False)  # the `size` best groups of each centroid [C, size]
                columns = _candidate_columns(best.indices, group, width, n)
                offsets = torch.arange(clusters, device=device).unsqueeze(-1)
                values = scores.view(-1).take(columns * clusters + offsets)  # [C, size·g + rest] candidates
                top[bi, hi] = _largest(values, columns, best.values, size)
    real = torch.full((b,), n, device=device) if valid is None else valid.sum(-1)
    per_row = torch.div(real + clusters - 1, clusters, rounding_mode="floor")  # ceil(real / C)
    used = torch.arange(size, device=device) < per_row.view(-1, 1, 1, 1)
    return top, used


def _statistics(*members: tuple[Tensor, Tensor], clusters: int) -> tuple[Tensor, Tensor]:
    """Sums `[h, C, d]` and counts `[h, C]` of unit vectors `[b, h, n, d]` by centroid `[b, h, n]` (-1: none)."""
    h, d = members[0][0].shape[1], members[0][0].shape[-1]
    device = members[0][0].device
    sums = torch.zeros(h * clusters + 1, d, dtype=torch.float32, device=device)
    counts = torch.zeros(h * clusters + 1, dtype=torch.float32, device=device)
    for unit, cluster in members:
        index = cluster + torch.arange(h, device=device).view(1, h, 1) * clusters
        index = torch.where(cluster >= 0, index, h * clusters).reshape(-1)  # -1 -> a discarded slot
        sums.index_add_(0, index, unit.reshape(-1, d))
        counts.index_add_(0, index, torch.ones_like(index, dtype=torch.float32))
    return sums[:-1].view(h, clusters, d), counts[:-1].view(h, clusters)


def _empty_statistics(x: Tensor, clusters: int) -> tuple[Tensor, Tensor]:
    """The statistics of no member: zero sums `[h, C, d]` and counts `[h, C]` (batch or length 0)."""
    h, d = x.shape[1], x.shape[-1]
    return x.new_zeros(h, clusters, d, dtype=torch.float32), x.new_zeros(h, clusters, dtype=torch.float32)


def _member_statistics(x: Tensor, top: Tensor, used: Tensor) -> tuple[Tensor, Tensor]:
    """Sums `[h, C, d]` and counts `[h, C]` of the unit vectors of the members each centroid took (balanced clusters:
    `top [b, h, C, k]`, `used [b, 1, 1, k]`), for x `[b, h, n, d]`.

    One `embedding_bag` adds each cluster's member rows up where they lie, weighted by 1/|x| (making them unit
    vectors) times `used`: no gathered `[b, h, C, k, d]` copy of the members.
    """
    b, h, clusters, size = top.shape
    rows, row_of = head_rows(x.detach().float())  # [b·h·n, d] in some order, and the row of (batch, head, position)
    index = row_of(
        torch.arange(b, device=x.device).view(b, 1, 1, 1), torch.arange(h, device=x.device).view(1, h, 1, 1), top
    )  # [b, h, C, k]
    inverse_norm = rows.norm(dim=-1).clamp_min(1e-12).reciprocal()  # F.normalize's eps
    weight = inverse_norm[index] * used
    sums = F.embedding_bag(index.view(-1, size), rows, mode="sum", per_sample_weights=weight.view(-1, size))
    counts = used.sum(-1, dtype=torch.float32).sum(0).expand(h, clusters)  # [h, C]: the same for every cluster
    return sums.view(b, h, clusters, -1).sum(0), counts


@torch.no_grad()
def cluster_statistics(
    q: Tensor, k: Tensor, centroids: Tensor, *, causal: bool, key_padding_mask: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """The k-means statistics a routing layer moves its centroids with: the sum and count of the unit queries and
    keys each centroid holds (the members it took in a balanced cluster; in a causal layer the vectors nearest to
    it). Padding counts for nothing.

    Args:
        q: `[b, h, n, d]`.
        k: `[b, h, n, d]`.
        centroids: `[h, C, d]`.
        causal: Which form of routing.
        key_padding_mask: Bool `[b, n]`, True = real token.

    Returns:
        `(sums [h, C, d], counts [h, C])` in float32.

    Raises:
        ValueError: `key_padding_mask` is not a bool `[b, n]` tensor on q's device.
    """
    clusters = centroids.shape[1]
    valid = check_token_mask("key_padding_mask", key_padding_mask, k.shape[0], k.shape[2], device=q.device)
    if is_empty(q, k):
        return _empty_statistics(q, clusters)
    if causal:
        parts = [(_unit(x), _nearest(x, centroids)) for x in (q, k)]
        if valid is not None:
            parts = [(unit, cluster.masked_fill(~valid[:, None, :], -1)) for unit, cluster in parts]
        return _statistics(*parts, clusters=clusters)
    size = -(-q.shape[2] // clusters)
    sums, counts = 0, 0
    for x in (q, k):
        part_sums, part_counts = _member_statistics(x, *_balanced_members(x, centroids, valid, size))
        sums, counts = sums + part_sums, counts + part_counts
    return sums, counts


# ---------------------------------------------------------------------------------------------- executors
def _check_centroids(centroids: Tensor, heads: int, q: Tensor) -> None:
    """Raises ValueError unless `centroids` is a floating `[heads, C, d]` tensor (C >= 1) on q's device."""
    if not isinstance(centroids, Tensor) or not centroids.is_floating_point() or centroids.dim() != 3:
        raise ValueError(
            f"centroids must be a floating-point tensor [heads, clusters, head_dim], got {centroids!r:.80}"
        )
    if centroids.shape[0] != heads or centroids.shape[1] < 1 or centroids.shape[2] != q.shape[-1]:
        raise ValueError(
            f"centroids must have shape [{heads}, clusters >= 1, {q.shape[-1]}] to match q {tuple(q.shape)}, got "
            f"{tuple(centroids.shape)}"
        )
    if centroids.device != q.device:
        raise ValueError(f"centroids are on {centroids.device} but q is on {q.device}: they must share one device")


def routing_attention(
    q: Tensor, k: Tensor, v: Tensor, centroids: Tensor, *, causal: bool, causal_window: int,
    key_padding_mask: Tensor | None = None, scale: float | None = None, dropout_p: float = 0.0,
    return_statistics: bool = False, backend: str = "auto", dense: bool = False,
    document_ids: Tensor | None = None, relative_embedding: Tensor | None = None,
) -> Tensor | tuple[Tensor, tuple[Tensor, Tensor]] | tuple[Tensor, Tensor]:  # fmt: skip
    """Routing attention of every head in q, k, v (see the module docstring); never builds an n x n score.

    Args:
        q: Queries `[b, h, n, d]`.
        k: Keys `[b, h, n, d]`.
        v: Values `[b, h, n, d_v]`.
        centroids: Unit centroids `[h, C, d]`.
        causal: The causal variant (most recent `causal_window` keys of the query's cluster).
        causal_window: W, used when causal.
        key_padding_mask: Bool `[b, n]`, True = real token.
        scale: Multiplier of q·k; default 1/sqrt(d).
        dropout_p: Dropout on the attention probabilities.
        return_statistics: Also return `cluster_statistics` (from the routing itself, at no extra cost).
        backend: `"auto"` or `"torch"`: the windowed PyTorch kernel (`attend_windows`); `"xformers"`: the same
            windows on xformers' kernel (`attend_windows_on_kernel`; CUDA, no dropout), which `"auto"` does not pick
            until it is measured on a GPU (`ROUTING_WINDOWS`).
        dense: The dense form instead (`routing_attention_dense`): `(out, weights [b, h, n, m])`, and q may be
            the last n of m key positions (cached decoding) in the causal form.
        document_ids: Integer `[b, m]`, the document of each token of packed rows: a query attends to the keys of
            its cluster that belong to its own document only (causal: the cluster is split per document, so the
            W most recent keys are of the query's document).
        relative_embedding: Optional r `[2M + 1, d]`: relative-position logits (`longattn.relative_logits`), scale ·
            q·r of the clipped distance between the original positions of each pair a cluster computes.

    Returns:
        Output `[b, h, n, d_v]` (zeros for a query that sees no key; empty for batch or length 0), and
        `(sums, counts)` when asked.

    Raises:
        ValueError: Naming the argument: q, k, v that are not 4-d floating tensors of matching shapes, `centroids`
            that are not a floating `[h, C, d]` tensor on q's device, a non-bool `causal` or `dense`, a
            `causal_window` below 1, a non-finite `scale`, `dropout_p` outside [0, 1); a `key_padding_mask` that is
            not a bool `[b, n]` tensor on q's device, or a `backend` that cannot run it.
    """
    given = check_attention_inputs(
        q, k, v, scale=scale, dropout_p=dropout_p, key_padding_mask=key_padding_mask, document_ids=document_ids,
        relative_embedding=relative_embedding, flags={"causal": causal, "dense": dense},
    )  # fmt: skip
    _check_centroids(centroids, given.heads, q)
    causal_window = check_positive_int("causal_window", causal_window, meaning="keys of the query's cluster")
    # A window of more keys than there are changes nothing: clamped, never allocated (the causal tasks are [c, 2W]).
    causal_window = min(causal_window, max(given.keys, 1))
    scale, dropout_p, valid = given.scale, given.dropout_p, given.key_padding_mask
    documents, relative_embedding = given.document_ids, given.relative_embedding
    if dense:
        return _dense_routing(
            q, k, v, centroids, causal, causal_window, valid, scale, dropout_p, documents, relative_embedding
        )
    if is_empty(q, k):
        out = empty_attention(q, k, v)
        return (out, _empty_statistics(q, centroids.shape[1])) if return_statistics else out
    windows = select_windows_executor(backend, ROUTING_WINDOWS, q, k, v, valid, relative_embedding, dropout_p, causal)
    with torch.no_grad():
        clusters = _causal_clusters if causal else _balanced_clusters
        attend, statistics = clusters(q, k, centroids, valid, documents, causal_window, statistics=return_statistics)
    # The O(n · M) relative table `[b, h, n, 2M + 1]`, read per computed pair at the original positions.
    table = None if relative_embedding is None else relative_logit_table(q, relative_embedding, scale)
    out = attend(q, k, v, scale=scale, dropout_p=dropout_p, windows=windows, table=table)
    return (out, statistics) if return_statistics else out


def _causal_clusters(q, k, centroids, valid, documents, window, *, statistics: bool):
    """Causal routing's clusters: each query and key to its nearest centroid (with packed rows, one cluster per
    (centroid, document)). Returns `_causal_routing` on them, `attend(q, k, v, **settings)`, and `(sums, counts)`
    or None."""
    clusters = centroids.shape[1]
    query_cluster, key_cluster = _nearest(q, centroids), _nearest(k, centroids)
    if valid is not None:
        query_cluster.masked_fill_(~valid[:, None, :], -1)
        key_cluster.masked_fill_(~valid[:, None, :], -1)
    sums_counts = (
        _statistics((_unit(q), query_cluster), (_unit(k), key_cluster), clusters=clusters) if statistics else None
    )
    if documents is not None:  # one cluster per (cluster, document): its recent keys are the document's
        index = document_index(documents)[:, None, :]  # [b, 1, n]
        per_document = int(index.max()) + 1
        query_cluster = torch.where(query_cluster >= 0, query_cluster * per_document + index, -1)
        key_cluster = torch.where(key_cluster >= 0, key_cluster * per_document + index, -1)
        clusters = clusters * per_document
    attend = functools.partial(
        _causal_routing, query_cluster=query_cluster, key_cluster=key_cluster, clusters=clusters, window=window
    )
    return attend, sums_counts


def _balanced_clusters(q, k, centroids, valid, documents, window, *, statistics: bool):
    """Bidirectional routing's balanced clusters: every centroid takes its k most similar queries and keys
    (`_balanced_members`; `window` is the causal form's). Returns `_balanced_routing` on them,
    `attend(q, k, v, **settings)`, and `(sums, counts)` or None."""
    size = -(-q.shape[2] // centroids.shape[1])  # k for the full length; shorter rows use fewer slots
    query_top, used = _balanced_members(q, centroids, valid, size)
    key_top, _ = _balanced_members(k, centroids, valid, size)
    sums_counts = None
    if statistics:
        (q_sums, q_counts), (k_sums, k_counts) = (
            _member_statistics(q, query_top, used),
            _member_statistics(k, key_top, used),
        )
        sums_counts = (q_sums + k_sums, q_counts + k_counts)
    attend = functools.partial(_balanced_routing, query_top=query_top, key_top=key_top, used=used, documents=documents)
    return attend, sums_counts


def _heads(x: Tensor) -> list[Tensor]:
    """The heads of x `[b, h, n, d]` as `[b·n, d]` row tensors: views when the heads were split from a `[b, n, h·d]`
    projection (the usual case) or b = 1. Through one `unbind`, whose backward stacks the heads' gradients into one
    tensor; slicing a head out instead would add each head's gradient into a zero tensor of the full size."""
    b, h, n, d = x.shape
    if x.transpose(1, 2).is_contiguous():
        return [head.reshape(b * n, d) for head in x.transpose(1, 2).unbind(2)]
    return [head.reshape(b * n, d) for head in x.unbind(1)]


def _balanced_routing(
    q, k, v, query_top, key_top, used, *, scale, dropout_p, windows=attend_windows, documents=None, table=None
):
    """Attention inside the balanced clusters `[b, h, C, k]` of queries and keys; a query in several clusters
    gets one softmax over the union of their keys.

    One head at a time: every tensor of a head's attention (gathered rows, probabilities, gradients) is then 1/h of
    the size, small enough to be reused from the allocator's heap; at 32K tokens and 4 heads, tensors of all heads
    at once are 32 MB or more, each mapped and page-faulted in afresh, which made up a third of the time.
    """
    b, _, n, _ = q.shape
    outs = [
        _balanced_head(
            q_h,
            k_h,
            v_h,
            query_top[:, head],
            key_top[:, head],
            used,
            n=n,
            scale=scale,
            dropout_p=dropout_p,
            windows=windows,
            documents=documents,
            table=None if table is None else table[:, head].reshape(b * n, -1),
        )
        for head, (q_h, k_h, v_h) in enumerate(zip(_heads(q), _heads(k), _heads(v), strict=True))
    ]
    return torch.stack(outs, dim=1).view(b, n, len(outs), -1).transpose(1, 2).to(q.dtype)  # merge_heads: no copy


def _balanced_head(
    q, k, v, query_top, key_top, used, *, n, scale, dropout_p, windows=attend_windows, documents=None, table=None
):
    """One head: rows q, k `[b·n, d]`, v `[b·n, d_v]`, clusters `[b, C, k]`, `used [b, 1, 1, k]`, documents
    `[b, n]` or None, relative table `[b·n, 2M + 1]` or None; output `[b·n, d_v]` in float32 for half inputs."""
    d, d_v = q.shape[-1], v.shape[-1]
    b, clusters, size = query_top.shape
    with torch.no_grad():
        first = (torch.arange(b, device=q.device) * n).view(b, 1, 1)  # the row of (batch, position 0)
        query_index, key_index = (query_top + first).reshape(-1), (key_top + first).reshape(-1)  # [b·C·k]
        slot_used = used.view(b, 1, size).expand(b, clusters, size)
        slots = torch.where(slot_used.reshape(-1), query_index, -1)  # an unused slot answers nothing
        key_mask = slot_used.reshape(-1, 1, size)  # [b·C, 1, k]
        if documents is not None:  # a cluster may hold several documents: its queries see their own document's keys
            query_document = documents.gather(1, query_top.reshape(b, -1)).view(-1, size, 1)
            key_document = documents.gather(1, key_top.reshape(b, -1)).view(-1, 1, size)
            key_mask = key_mask & (query_document == key_document)  # [b·C, k, k]
    relative = {}
    if table is not None:  # table rows are the rows (batch, position) `slots` name
        relative = dict(relative_table=table, query_position=query_top.reshape(-1), key_position=key_top.reshape(-1))
    if windows is attend_windows and dropout_p == 0.0:
        # Memory O(n·d) + indices: the kernel gathers each group's rows itself (in forward and again in backward)
        # and merges the clusters of a query by log-sum-exp, so no gathered copy or probability is kept.
        return attend_gathered_windows(
            q,
            k,
            v,
            query_index=slots,
            key_index=key_index,
            value_index=key_index,
            out_index=slots,
            n_out=b * n,
            chunk=size,
            width=size,
            stride=size,
            scale=scale,
            mask=key_mask,
            **relative,
        )
    mask = slot_used.reshape(-1, 1, size)
    if relative:
        columns = RelativeColumns(table, relative["query_position"], relative["key_position"], slots, size, size, size)
        mask = hide_exactly(columns.bias(0, b * clusters), ~mask)  # [b·C, k, k], differentiable
    out, lse = windows(
        q.index_select(0, query_index).view(-1, size, d),
        k.index_select(0, key_index),
        v.index_select(0, key_index),
        mask,
        stride=size,
        scale=scale,
        dropout_p=dropout_p,
    )  # [b·C, k, d_v], [b·C, k]
    # A query in several clusters: one softmax over the union of their keys, i.e. each cluster's output weighted by
    # exp(lse) / (the sum of exp(lse) over the query's clusters). The weights are one scalar per slot, so only the
    # weighted outputs are added up per query.
    compute = compute_dtype(q.dtype)
    slot_used = slot_used.reshape(-1)
    with torch.no_grad():
        shift = torch.full((b * n,), NO_KEY_LSE, dtype=lse.dtype, device=q.device).scatter_reduce(
            0, query_index, lse.detach().reshape(-1).masked_fill(~slot_used, NO_KEY_LSE), reduce="amax"
        )
        shift = shift.masked_fill(torch.isneginf(shift), 0.0)[query_index]  # the largest lse of each slot's query
    weight = ((lse.reshape(-1) - shift).exp() * slot_used).to(compute)  # exactly 0 where lse = -inf or unused
    total = torch.zeros(b * n, dtype=compute, device=q.device).index_add(0, query_index, weight)[query_index]
    weight = weight / torch.where(total > 0, total, 1.0)
    return torch.zeros(b * n, d_v, dtype=compute, device=q.device).index_add(
        0, query_index, out.reshape(-1, d_v).to(compute) * weight.unsqueeze(-1)
    )


class _CausalTasks(NamedTuple):
    """The tasks of causal routing (`_causal_tasks`): index tensors of the sorted queries and their key windows.

    Queries sorted by (cluster, position) are packed into tasks of at most c of them that share a key block; a
    task's keys are the sorted keys (block − 1)·W .. (block + 1)·W, and each query sees the column range
    [first, last) of them.
    """

    chunk: int  # c, queries per task
    n_tasks: int  # T per (batch, head)
    query_order: Tensor  # [b, h, n]: the position of each sorted query
    query_row: Tensor  # [b, h, n]: the buffer row of each sorted query
    source_row: Tensor  # [b, h, n]: the row of q (`head_rows`) of each sorted query
    query_index: Tensor  # [b·h·T·c]: the row of q of each buffer row (-1: an empty slot)
    out_index: Tensor  # [b·h·T·c]: the output row (b · h + head) · n + position of each buffer row (-1: none)
    key_position: Tensor  # [b, h, T, 2W]: the position of each task's keys
    in_range: Tensor  # bool [b, h, T, 2W]: the sorted key exists
    first: Tensor  # [b, h, n]: each sorted query's first visible column
    last: Tensor  # [b, h, n]: one past its last visible column

    def window_rows(self, row_of, missing: int) -> Tensor:
        """The row (`row_of`, of k or v) of every task's keys `[b·h·T·2W]`, `missing` where no sorted key is."""
        b, h = self.key_position.shape[:2]
        device = self.key_position.device
        bi, hi = torch.arange(b, device=device).view(b, 1, 1, 1), torch.arange(h, device=device).view(1, h, 1, 1)
        return torch.where(self.in_range, row_of(bi, hi, self.key_position), missing).reshape(-1)

    def slots(self, values: Tensor) -> Tensor:
        """`values [b, h, n]` of the sorted queries at their buffer rows `[b·h·T·c]`, 0 in empty slots."""
        buffer = torch.zeros_like(self.query_index)
        buffer[self.query_row.reshape(-1)] = values.reshape(-1)
        return buffer


def _causal_routing(
    q, k, v, query_cluster, key_cluster, *, clusters, window, scale, dropout_p, windows=attend_windows, table=None
):
    """Each query over the most recent `window` keys of its cluster (clusters `[b, h, n]`, -1 = padding); `table`:
    relative logits `[b, h, n, 2M + 1]` or None."""
    b, h, n, _ = q.shape
    rows = (head_rows(q), head_rows(k), head_rows(v))  # ([b·h·n, ·] views, the row of (batch, head, position))
    tasks = _causal_tasks(rows[0][1], query_cluster, key_cluster, clusters=clusters, window=window)
    relative = {}
    if table is not None:  # table rows are the output rows (batch, head, position) `out_index` names
        with torch.no_grad():
            query_position = tasks.slots(tasks.query_order)
        relative = dict(
            relative_table=table.reshape(b * h * n, -1),
            query_position=query_position,
            key_position=tasks.key_position.reshape(-1),
        )
    if windows is attend_windows and dropout_p == 0.0:
        return _causal_gathered(rows, tasks, relative, window=window, scale=scale).view(b, h, n, -1)
    return _causal_on_windows(
        q, rows, tasks, relative, window=window, scale=scale, dropout_p=dropout_p, windows=windows
    )


@torch.no_grad()
def _causal_tasks(q_row_of, query_cluster: Tensor, key_cluster: Tensor, *, clusters: int, window: int) -> _CausalTasks:
    """Sort queries and keys by (cluster, position) and pack the queries into tasks (`_CausalTasks`)."""
    b, h, n = query_cluster.shape
    device = query_cluster.device
    chunk = max(1, window // 2)  # queries per task
    n_tasks = -(-n // chunk) + -(-n // window)  # one task per chunk, plus one more per change of key block
    positions = torch.arange(n, device=device)
    # Padded keys go to cluster C (after all others), padded queries to C + 1: they see no key.
    key_cluster = torch.where(key_cluster >= 0, key_cluster, clusters)
    query_cluster = torch.where(query_cluster >= 0, query_cluster, clusters + 1)
    key_value, key_order = (key_cluster * n + positions).sort(dim=-1)  # [b, h, n] by (cluster, position)
    query_value, query_order = (query_cluster * n + positions).sort(dim=-1)
    # The query's keys: sorted keys [lo, hi): its cluster, at or before its position, the last W of them.
    hi = torch.searchsorted(key_value, query_value, right=True)
    cluster_start = torch.searchsorted(key_value, torch.div(query_value, n, rounding_mode="floor") * n)
    lo = torch.maximum(cluster_start, hi - window)
    block = torch.div((hi - 1).clamp(min=0), window, rounding_mode="floor")  # [b, h, n], keys in blocks
    # Tasks: consecutive sorted queries in one chunk and with the same key block.
    index = positions.expand(b, h, n)
    starts = (index % chunk == 0) | F.pad(block[..., 1:] != block[..., :-1], (1, 0), value=True)
    task = starts.long().cumsum(-1) - 1  # [b, h, n]
    slot = index - torch.cummax(torch.where(starts, index, 0), dim=-1).values
    bh = torch.arange(b, device=device).view(b, 1, 1) * h + torch.arange(h, device=device).view(1, h, 1)
    query_row = (bh * n_tasks + task) * chunk + slot  # [b, h, n] buffer row of each sorted query
    task_block = torch.zeros(b * h * n_tasks, dtype=torch.long, device=device)
    task_block[(bh * n_tasks + task).reshape(-1)] = block.reshape(-1)
    task_block = task_block.view(b, h, n_tasks)
    # Keys of a task: sorted keys (block - 1)·W .. (block + 1)·W.
    key_rank = (task_block.unsqueeze(-1) - 1) * window + torch.arange(2 * window, device=device)  # [b,h,T,2W]
    in_range = (key_rank >= 0) & (key_rank < n)
    key_position = key_order.gather(-1, key_rank.clamp(0, n - 1).view(b, h, -1)).view_as(key_rank)
    # Visible columns of each query row: [lo, hi) relative to its task's first key.
    base = (task_block.gather(-1, task) - 1) * window  # [b, h, n]
    batch, head = torch.arange(b, device=device).view(b, 1, 1), torch.arange(h, device=device).view(1, h, 1)
    source_row = q_row_of(batch, head, query_order)  # [b, h, n] row of q of each sorted query
    query_index = torch.full((b * h * n_tasks * chunk,), -1, dtype=torch.long, device=device)
    query_index[query_row.reshape(-1)] = source_row.reshape(-1)
    out_index = torch.full_like(query_index, -1)
    out_index[query_row.reshape(-1)] = (bh * n + query_order).reshape(-1)
    return _CausalTasks(
        chunk, n_tasks, query_order, query_row, source_row, query_index, out_index, key_position, in_range,
        lo - base, hi - base,
    )  # fmt: skip


def _causal_gathered(rows, tasks: _CausalTasks, relative: dict, *, window: int, scale: float) -> Tensor:
    """The tasks on `attend_gathered_windows`: memory O(n·d) + indices, the kernel gathers each task's rows itself,
    and a query's visible keys are its column range [first, last), two integers instead of a row of 2W flags.
    Returns `[b·h·n, d_v]`."""
    (q_rows, _), (k_rows, k_row_of), (v_rows, v_row_of) = rows
    with torch.no_grad():
        first_slot, last_slot = tasks.slots(tasks.first), tasks.slots(tasks.last)
    return attend_gathered_windows(
        q_rows,
        k_rows,
        v_rows,
        query_index=tasks.query_index,
        key_index=tasks.window_rows(k_row_of, -1),
        value_index=tasks.window_rows(v_row_of, -1),
        out_index=tasks.out_index,
        n_out=tasks.query_order.numel(),
        chunk=tasks.chunk,
        width=2 * window,
        stride=2 * window,
        scale=scale,
        first=first_slot,
        last=last_slot,
        **relative,
    )


def _causal_on_windows(
    q: Tensor, rows, tasks: _CausalTasks, relative: dict, *, window: int, scale: float, dropout_p: float, windows
) -> Tensor:
    """The tasks on `windows` (`attend_windows` or its kernel) over gathered copies of their rows."""
    b, h, n, d = q.shape
    (q_rows, _), (k_rows, k_row_of), (v_rows, v_row_of) = rows
    d_v = v_rows.shape[-1]
    chunk = tasks.chunk
    device = q.device
    with torch.no_grad():
        # A key can serve several tasks: plain index_select (its backward adds the copies up), a zero row last.
        key_index = tasks.window_rows(k_row_of, k_rows.shape[0])
        value_index = tasks.window_rows(v_row_of, v_rows.shape[0])
        bias = _visible_bias(tasks, window, compute_dtype(q.dtype))  # [b·h·T, c, 2W]
    if relative:
        columns = RelativeColumns(
            relative["relative_table"],
            relative["query_position"],
            relative["key_position"],
            tasks.out_index,
            chunk,
            2 * window,
            2 * window,
        )
        bias = bias + columns.bias(0, bias.shape[0])  # differentiable; -inf stays -inf
    with torch.no_grad():
        # Original position p of (b, h) is sorted query rank[p]; its buffer row, and the inverse for backward.
        index = torch.arange(n, device=device).expand(b, h, n)
        rank = torch.empty_like(tasks.query_order).scatter_(-1, tasks.query_order, index)
        answer_row = tasks.query_row.gather(-1, rank).reshape(-1)  # [b·h·n]
        query_inverse = torch.full((1, q_rows.shape[0]), -1, dtype=torch.long, device=device)
        query_inverse[0, tasks.source_row.reshape(-1)] = tasks.query_row.reshape(-1)
        answer_inverse = torch.full((1, b * h * tasks.n_tasks * chunk), -1, dtype=torch.long, device=device)
        answer_inverse[0, answer_row] = torch.arange(b * h * n, device=device)
    keys = torch.cat([k_rows, k_rows.new_zeros(1, d)]).index_select(0, key_index)  # [b·h·T·2W, d]
    values = torch.cat([v_rows, v_rows.new_zeros(1, d_v)]).index_select(0, value_index)
    out, _ = windows(
        gather_rows(q_rows, tasks.query_index, query_inverse).view(-1, chunk, d),
        keys,
        values,
        bias,
        stride=2 * window,
        scale=scale,
        dropout_p=dropout_p,
    )  # [b·h·T, c, d_v]
    return gather_rows(out.reshape(-1, d_v), answer_row, answer_inverse).view(b, h, n, d_v)


def _visible_bias(tasks: _CausalTasks, window: int, dtype: torch.dtype) -> Tensor:
    """The additive bias `[b·h·T, c, 2W]` the window kernel takes, 0 on each query's columns [first, last) and
    -inf elsewhere and in empty slots, written directly (a bool mask would be converted at 4x the cost)."""
    device = tasks.first.device
    columns = torch.arange(2 * window, device=device)
    visible = (columns >= tasks.first.unsqueeze(-1)) & (columns < tasks.last.unsqueeze(-1))  # [b, h, n, 2W]
    bias = torch.full((tasks.query_index.shape[0], 2 * window), EXACTLY_HIDDEN, dtype=dtype, device=device)
    visible_bias = hide_exactly(torch.zeros((), dtype=dtype, device=device), ~visible)  # [b, h, n, 2W]
    bias[tasks.query_row.reshape(-1)] = visible_bias.reshape(-1, 2 * window)
    return bias.view(-1, tasks.chunk, 2 * window)


# ---------------------------------------------------------------------------------------------- dense form
def routing_attention_dense(
    q: Tensor, k: Tensor, v: Tensor, centroids: Tensor, **settings: Any
) -> tuple[Tensor, Tensor]:
    """The same attention as `routing_attention`, as dense masked attention over `[b, h, n, m]` (with weights).

    Causal: query t (one of the last n of m positions) sees the keys j <= t of its cluster with at most W such keys
    in [j, t]. Bidirectional (n = m): the balanced clusters, written as one softmax with the bias
    log(number of clusters that took both query i and key j). Takes the keyword arguments of `routing_attention`
    (`dense=True` there; `return_statistics` and `backend` do not apply).

    Returns:
        `(out [b, h, n, d_v], weights [b, h, n, m])`.

    Raises:
        ValueError: `key_padding_mask` is not a bool `[b, m]` tensor on q's device.
    """
    return routing_attention(q, k, v, centroids, dense=True, **settings)


def _dense_routing(
    q,
    k,
    v,
    centroids,
    causal,
    causal_window,
    key_padding_mask,
    scale,
    dropout_p,
    documents=None,
    relative_embedding=None,
):
    """`routing_attention_dense` after the checks (key_padding_mask and documents checked, scale resolved)."""
    if is_empty(q, k):
        return empty_attention(q, k, v), q.new_zeros(*q.shape[:3], k.shape[2])
    b, h, n, d = q.shape
    m = k.shape[2]
    dtype = compute_dtype(q.dtype)
    valid = torch.ones(b, m, dtype=torch.bool, device=q.device) if key_padding_mask is None else key_padding_mask
    scores = torch.einsum("bhnd,bhmd->bhnm", q.to(dtype), k.to(dtype)) * scale
    scores = scores + _dense_relative(q, relative_embedding, scale, m)
    same_document = None
    if documents is not None:
        same_document = (documents[:, m - n :, None] == documents[:, None, :])[:, None]  # [b, 1, n, m]
    if causal:
        key_cluster = _nearest(k, centroids)  # [b, h, m]
        query_cluster = _nearest(q, centroids)  # [b, h, n]
        q_pos = torch.arange(m - n, m, device=q.device)
        same = (query_cluster[..., :, None] == key_cluster[..., None, :]) & valid[:, None, None, :]
        if same_document is not None:
            same &= same_document
        same &= q_pos[:, None] >= torch.arange(m, device=q.device)
        back = same.flip(-1).cumsum(-1).flip(-1)  # same-cluster keys from this one up to the query
        bias = hide_exactly(torch.zeros_like(scores), ~(same & (back <= causal_window)), inplace=True)
        query_valid = valid[:, m - n :]
    else:
        if n != m:
            raise ValueError(f"bidirectional routing needs every query (n={n}) to be a key position (m={m}).")
        clusters = centroids.shape[1]
        size = -(-m // clusters)
        query_top, used = _balanced_members(q, centroids, valid, size)
        key_top, _ = _balanced_members(k, centroids, valid, size)
        used = used.expand(b, h, clusters, size).float()
        query_member = torch.zeros(b, h, clusters, m, device=q.device).scatter_(-1, query_top, used)
        key_member = torch.zeros(b, h, clusters, m, device=q.device).scatter_(-1, key_top, used)
        count = torch.einsum("bhci,bhcj->bhij", query_member, key_member)  # clusters that hold both
        if same_document is not None:
            count = count * same_document
        bias = count.to(dtype).log()  # -inf where no cluster holds both
        query_valid = torch.ones(b, n, dtype=torch.bool, device=q.device)
    scores = scores + bias
    sees = ~torch.isneginf(scores).all(dim=-1, keepdim=True)
    weights = torch.softmax(scores.masked_fill(~sees, 0.0), dim=-1) * sees
    weights = weights * query_valid[:, None, :, None] if causal else weights
    dropped = F.dropout(weights, p=dropout_p) if dropout_p > 0 else weights
    return torch.matmul(dropped, v.to(dtype)).to(q.dtype), dropped.to(q.dtype)


def local_attention_dense(
    q: Tensor, k: Tensor, v: Tensor, *, window: int, causal: bool, key_padding_mask: Tensor | None,
    document_ids: Tensor | None, scale: float, dropout_p: float, relative_embedding: Tensor | None = None,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    """The local heads' attention in its dense form (`ops.sliding_window_attention` is the fast one), with weights.

    Each query, the last n of m positions, sees the keys at most `window` away (before it, or itself, when causal)
    that are real and of its own document. `key_padding_mask` (bool `[b, m]`) and `document_ids` (`[b, m]`) are
    checked by the caller (`routing_attention_dense`).

    Returns:
        `(out [b, h, n, d_v], weights [b, h, n, m])`; zeros for a query without a visible key.
    """
    n, m = q.shape[2], k.shape[2]
    q_pos = torch.arange(m - n, m, device=q.device)[:, None]
    k_pos = torch.arange(m, device=q.device)
    near = (q_pos - k_pos).abs() <= window
    if causal:
        near = near & (k_pos <= q_pos)
    mask = near[None, None]
    if key_padding_mask is not None:
        mask = mask & key_padding_mask[:, None, None, :]
    if document_ids is not None:
        mask = mask & (document_ids[:, m - n :, None] == document_ids[:, None, :])[:, None]
    return _masked_attention(q, k, v, mask, scale, dropout_p, relative_embedding=relative_embedding)


def _dense_relative(q: Tensor, embedding: Tensor | None, scale: float, m: int) -> Tensor | float:
    """The relative logits of queries q `[b, h, n, d]` (the last n of m positions) for every key: `[b, h, n, m]`,
    or 0 without an embedding."""
    if embedding is None:
        return 0.0
    b, h, n, _ = q.shape
    bias_fn = relative_bias(q, embedding, scale=scale, kv_len=m)
    return materialize_bias(bias_fn, batch=b, heads=h, q_len=n, kv_len=m, q_offset=m - n, device=q.device)


def _masked_attention(q, k, v, mask, scale, dropout_p, relative_embedding=None):
    """Dense attention under a bool mask `[b|1, h|1, n, m]`, zeros for rows without a visible key."""
    dtype = compute_dtype(q.dtype)
    scores = torch.einsum("bhnd,bhmd->bhnm", q.to(dtype), k.to(dtype)) * scale
    scores = scores + _dense_relative(q, relative_embedding, scale, k.shape[2])
    scores = hide_exactly(scores, ~mask)
    sees = mask.any(dim=-1, keepdim=True)
    weights = torch.softmax(scores.masked_fill(~sees, 0.0), dim=-1) * sees
    dropped = F.dropout(weights, p=dropout_p) if dropout_p > 0 else weights
    return torch.matmul(dropped, v.to(dtype)).to(q.dtype), dropped.to(q.dtype)
