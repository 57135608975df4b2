"""Tiny configs for the tests: the common sizes (`SIZES`) and one base (`TINY`), per-kind overrides for the common
model tests, the training loop's model, offline `TrainingArguments`, and the cases of a config-validation test.

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
# Hidden 32, 2 layers, 2 heads, intermediate 64: the size of transformers' common model tests. The tests' tiny
# models (here, in attention_checks.py and in the test files) start from it.
SIZES: dict = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64)
NO_DROPOUT: dict = dict(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
# `SIZES` in 4 heads of 8: the stock models' tests.
FOUR_HEADS: dict = {**SIZES, "num_attention_heads": 4}
# `SIZES` with no dropout, 128 positions.
TINY: dict = dict(vocab_size=VOCAB, **SIZES, max_position_embeddings=128, **NO_DROPOUT)


def bart_sizes(hidden: int, *, layers: int, heads: int, ffn: int) -> dict:
    """`BartConfig`'s size fields, the encoder's and the decoder's alike: width `hidden`, `layers` layers of `heads`
    heads, feed-forward width `ffn`."""
    sides = {"layers": layers, "attention_heads": heads, "ffn_dim": ffn}
    return {
        "d_model": hidden,
        **{f"{side}_{name}": value for side in ("encoder", "decoder") for name, value in sides.items()},
    }


def tiny_causal_lm_config(**fields) -> LongAttnConfig:
    """The training loop's model: a causal LM of 12 tokens, one sliding-window layer (window 2) of hidden 16 in 2
    heads, intermediate 32; `fields` added."""
    sizes = dict(vocab_size=12, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32)
    return LongAttnConfig(**sizes, is_decoder=True, attention_type="sliding", sliding_window=2, **fields)


def tiny_config(kind: str = "full", **fields) -> LongAttnConfig:
    """A tiny `LongAttnConfig` of attention `kind`: `TINY` under `fields`."""
    return LongAttnConfig(**{**TINY, "attention_type": kind, **fields})


def kind_config(kind: str, **fields) -> LongAttnConfig:
    """`tiny_config` with the kind's `KIND_OVERRIDES` (a sparse pattern at the test lengths), under `fields`."""
    return tiny_config(kind, **{**KIND_OVERRIDES.get(kind, {}), **fields})


def random_ids(batch: int, length: int, seed: int = 0, vocab: int = VOCAB) -> torch.Tensor:
    """Token ids `[batch, length]` in `[4, vocab)` (above the special tokens), from a seeded generator."""
    return torch.randint(4, vocab, (batch, length), generator=torch.Generator().manual_seed(seed))


def refused_values(bad: dict[str, list]) -> list[tuple[dict, str]]:
    """`(fields, message)` cases for a test that a config refuses a bad value naming the field: one case a value of
    `bad` (field -> the values it refuses), the field alone set to it, its name the message."""
    return [({field: value}, field) for field, values in bad.items() for value in values]


def trainer_arguments(output_dir, **fields):
    """transformers' `TrainingArguments` of a short offline run on CPU into `output_dir`: 2 steps, a log line a
    step, no report and no checkpoint; `fields` over them."""
    from transformers import TrainingArguments

    offline = dict(max_steps=2, logging_steps=1, report_to=[], save_strategy="no", use_cpu=True)
    return TrainingArguments(**{"output_dir": str(output_dir), **offline, **fields})
