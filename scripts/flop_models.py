"""The FLOP model of every kind: multiply-adds of one forward pass of one attention layer with its projections (the
benchmark's layer: hidden D, h heads of d). `scripts/growth.py` compares each kind's time growth with it, and
`scripts/benchmark.py` derives each kind's ideal cost from it (see growth.py's docstring for what is counted).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

KINDS = [
    "sliding",
    "strided",
    "fixed",
    "lsh",
    "routing",
    "sinkhorn",
    "sortcut",
    "linformer",
    "efficient",
    "adaptive_span",
    "reduction",
    "binary_partition",
    "deformable",
]


def _pattern_pairs(mask_fn, n: int, samples: int = 1024) -> float:
    """The (query, key) pairs a position predicate keeps: each of `samples` evenly spaced queries (every query when
    n <= samples, an exact count) is evaluated against all n keys, and the mean count scales to n queries (the
    patterns are periodic, so the estimate is within a fraction of a percent). Never n x n."""
    import torch

    zero = torch.zeros(1, 1, 1, 1, dtype=torch.long)
    keys = torch.arange(n).view(1, 1, 1, n)
    queries = torch.linspace(0, n - 1, min(n, samples)).round().long().unique()
    counts = [mask_fn(zero, zero, chunk.view(1, 1, -1, 1), keys).sum() for chunk in queries.split(256)]
    return float(torch.stack(counts).sum()) * n / len(queries)


def flop_model(kind: str, n: int, args: argparse.Namespace) -> tuple[float, str]:
    """(multiply-adds of one forward, the formula in words) of `kind` at length n with the benchmark's settings."""
    from longattn import patterns

    D, h = args.hidden, args.heads
    d = D // h
    projections = 4 * n * D * D
    per_pair = 2 * h * d

    def attention(pairs: float) -> float:
        return projections + per_pair * pairs

    if kind == "sliding":
        return attention(_pattern_pairs(patterns.sliding_window_mask(args.window), n)), f"n·(2w+1), w={args.window}"
    if kind == "strided":
        return attention(_pattern_pairs(patterns.strided_mask(128), n)), "n·(2l−1 + n/l), l=128 (pattern count)"
    if kind == "fixed":
        return attention(_pattern_pairs(patterns.fixed_mask(128, 8), n)), "n·(l + c·n/l), l=128, c=8 (pattern count)"
    if kind == "adaptive_span":
        reach = 256 + 32 - 1  # keys with a non-zero soft mask: distance < S + R (span opened fully)
        pairs = _pattern_pairs(patterns.sliding_window_mask(reach), n)
        return attention(pairs), "n·(2(S+R)−1), S=256, R=32"
    if kind == "lsh":
        hashes, chunk = 2, 64
        return attention(n * hashes * 2 * chunk), "n·r·2c (own and previous chunk), r=2, c=64; sort n log n"
    if kind == "routing":
        clusters = max(1, n // 128)
        assignment = 2 * h * n * clusters * d  # queries and keys against every centroid
        return attention(n * 128) + assignment, "n·k (k=n/C=128) + 2·n·C·d assignment, C=n/128: quadratic"
    if kind in ("sinkhorn", "sortcut"):
        blocks = n // 64
        sort = h * (blocks * blocks * d + blocks * d * d)
        keys = 128  # own + sorted block (Sinkhorn), or the 2 kept sorted blocks (SortCut)
        return attention(n * keys) + sort, "n·2s (s=64) + (n/s)²·d block scores"
    if kind == "linformer":
        k = 256
        return attention(n * k) + 2 * h * n * k * d, "n·k + 2·n·k·d projections, k=256"
    if kind == "efficient":
        return projections + 2 * h * n * d * d, "2·n·d² (the d x d state)"
    if kind == "reduction":
        ratio = 8
        return attention(n * (n // ratio)) + n * D * D, "n·n/R + n·D² reduction, R=8: quadratic"
    if kind == "binary_partition":
        from longattn.attention_binary_partition import num_levels

        context = 4
        nodes = 1 + 2 * context * num_levels(n, context)
        return attention(n * nodes) + n * D, f"n·(1 + 2k·L), k={context}, L=log2(n/k) levels + pooling"
    if kind == "deformable":
        levels, points = 4, 4
        samples = h * levels * points
        prediction = n * D * 3 * samples  # offsets (1) and weights (1) per sample, from the query; reads x2 (lerp)
        return projections + prediction + 2 * n * samples * d + levels * n * D, "n·h·L·P·d + n·D·3hLP, L=P=4"
    raise ValueError(f"no FLOP model for kind {kind!r}; known: {', '.join(KINDS)}")
