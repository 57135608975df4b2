"""Tiny configs for the tests: one base (`TINY`), and per-kind overrides for the common model tests.

Every registered attention kind must pass the common suite (tests/test_models.py). Small windows / buckets / blocks in
`KIND_OVERRIDES` make the pattern actually sparse at the tiny test lengths, so that the model-level checks exercise
the real executor. One entry per kind; a kind without an entry runs with its defaults.
"""

from __future__ import annotations

import torch

from longattn import LongAttnConfig

KIND_OVERRIDES: dict[str, dict] = {
    "full": {},
    "adaptive_span": {"adaptive_span_max": [8, 16], "adaptive_span_ramp": 4},
    "deformable": {"deformable_levels": [2, 3], "deformable_points": 3},
    "efficient": {},
    "binary_partition": {"binary_partition_context": [1, 2]},
    "linformer": {"linformer_proj_len": 8, "linformer_sharing": "layerwise"},
    "lsh": {"lsh_bucket_size": 4, "lsh_num_buckets": 4, "lsh_seed": 0},
    "routing": {
        "routing_num_clusters": 4,
        "routing_causal_window": 6,
        "routing_num_local_heads": [0, 1],
        "routing_local_window": 3,
    },
    "reduction": {"reduction_ratio": [3, 4]},
    "synthesizer": {"synthesizer_mode": "factorized_dense", "synthesizer_factor_k": 5, "synthesizer_mix": True},
    "sinkhorn": {"sinkhorn_block_size": [4, 6]},
    "sliding": {"sliding_window": 3, "sliding_dilation": [1, 2]},
    "strided": {"strided_stride": [4, 3]},
    "fixed": {"fixed_block_size": 5, "fixed_num_summary": [2, 1], "fixed_summary_per_head": True},
}

VOCAB = 50
# Hidden 32, 2 layers, 2 heads, no dropout: the size of transformers' common model tests.
TINY: dict = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=2,
    intermediate_size=64,
    max_position_embeddings=128,
    hidden_dropout_prob=0.0,
    attention_probs_dropout_prob=0.0,
)


def tiny_config(kind: str = "full", **fields) -> LongAttnConfig:
    """A tiny `LongAttnConfig` of attention `kind`: `TINY` under `fields`."""
    return LongAttnConfig(**{**TINY, "attention_type": kind, **fields})


def kind_config(kind: str, **fields) -> LongAttnConfig:
    """`tiny_config` with the kind's `KIND_OVERRIDES` (a sparse pattern at the test lengths), under `fields`."""
    return tiny_config(kind, **{**KIND_OVERRIDES.get(kind, {}), **fields})


def random_ids(batch: int, length: int, seed: int = 0, vocab: int = VOCAB) -> torch.Tensor:
    """Token ids `[batch, length]` in `[4, vocab)` (above the special tokens), from a seeded generator."""
    return torch.randint(4, vocab, (batch, length), generator=torch.Generator().manual_seed(seed))
