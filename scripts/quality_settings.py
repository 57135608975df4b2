"""The settings of the quality studies (`scripts/quality_study.py` runs them, `scripts/quality_report.py` describes
them): the lengthening study's model and schedules, and the kinds study's model, schedule and runs."""

from __future__ import annotations

import os

# --------------------------------------------------------------------------------------------- the lengthening study
ROBERTA = {  # a small byte-level RoBERTa: 4 layers of 128, 4 heads of 32 (about the compute-optimal size here)
    "hidden_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "intermediate_size": 512,
    "hidden_dropout_prob": 0.0,
    "attention_probs_dropout_prob": 0.0,
    "type_vocab_size": 1,
}
SHORT, LONG, WINDOW = 512, 4096, 256
PRETRAIN = {"steps": int(os.environ.get("QS_PRETRAIN_STEPS", 2400)), "batch": 8, "learning_rate": 1e-3, "warmup": 100}
CONTINUE = {
    "steps": int(os.environ.get("QS_CONTINUE_STEPS", 300)),
    "learning_rate": 3e-4,
    "warmup": 30,
}  # tokens per step as in pretraining

# --------------------------------------------------------------------------------------------- the kinds study
EVAL_DURING_TRAINING_BYTES = 160_000
EVAL_TOKENS = 131_072  # of the test split, for longattn-eval: 32 windows of 4,096
KINDS_LENGTH = 2048
KINDS_EVAL_LENGTHS = [128, 512, 2048]
KINDS_EVAL_TOKENS = 65_536  # 32 windows of 2,048 of the test split
KINDS_MODEL = "hidden_size=128,num_hidden_layers=4,num_attention_heads=4,intermediate_size=512,hidden_dropout_prob=0.0"
KINDS_TRAIN = {"steps": 500, "batch": 1, "learning_rate": 1e-3, "warmup": 20, "eval_every": 250}
# (run name, recipe, kind, the kind's own settings): each kind at its defaults except where 2,048 tokens ask otherwise.
KINDS = [
    ("clm-full", "clm", "full", ""),
    ("clm-sliding", "clm", "sliding", "sliding_window=256"),
    ("clm-strided", "clm", "strided", ""),
    ("clm-fixed", "clm", "fixed", ""),
    ("clm-lsh", "clm", "lsh", ""),
    ("clm-routing", "clm", "routing", ""),
    ("clm-sinkhorn", "clm", "sinkhorn", ""),
    ("clm-efficient", "clm", "efficient", ""),
    ("clm-adaptive_span", "clm", "adaptive_span", ""),
    ("clm-binary_partition", "clm", "binary_partition", ""),
    ("clm-synthesizer", "clm", "synthesizer", ""),
    ("mlm-full", "mlm", "full", ""),
    ("mlm-linformer", "mlm", "linformer", ""),
    ("mlm-reduction", "mlm", "reduction", ""),
    ("mlm-deformable", "mlm", "deformable", ""),
]
