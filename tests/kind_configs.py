"""Tiny per-kind config overrides for the common model tests (tests/test_models.py).

Every registered attention kind must pass the common suite. Small windows / buckets / blocks here make the pattern
actually sparse at the tiny test lengths, so that the model-level checks exercise the real executor. One entry per kind;
a kind without an entry runs with its defaults.
"""

KIND_OVERRIDES: dict[str, dict] = {
    "full": {},
    "adaptive_span": {"adaptive_span_max": [8, 16], "adaptive_span_ramp": 4},
    "deformable": {"deformable_levels": [2, 3], "deformable_points": 3},
    "efficient": {},
    "binary_partition": {"binary_partition_context": [1, 2]},
    "linformer": {"linformer_proj_len": 8, "linformer_sharing": "layerwise"},
    "lsh": {"lsh_bucket_size": 4, "lsh_num_buckets": 4, "lsh_seed": 0},
    "routing": {"routing_num_clusters": 4, "routing_causal_window": 6, "routing_num_local_heads": [0, 1],
                "routing_local_window": 3},
    "reduction": {"reduction_ratio": [3, 4]},
    "synthesizer": {"synthesizer_mode": "factorized_dense", "synthesizer_factor_k": 5, "synthesizer_mix": True},
    "sinkhorn": {"sinkhorn_block_size": [4, 6]},
    "sliding": {"sliding_window": 3, "sliding_dilation": [1, 2]},
    "strided": {"strided_stride": [4, 3]},
    "fixed": {"fixed_block_size": 5, "fixed_num_summary": [2, 1], "fixed_summary_per_head": True},
}
