#!/usr/bin/env bash
# The main job, end to end on a fresh machine (2 CPU cores are enough, nothing is downloaded at run time):
#   1. set up .venv (scripts/setup.sh: torch 2.13.0 CPU, then longattn with its extras);
#   2. generate the `needle` long-range task (a digit hidden anywhere in 128-256 bytes of random text) as jsonl;
#   3. train a small sliding-window classifier on it with recipes/run_classification.py (tqdm progress bar,
#      checkpoints every 100 steps: rerunning this script after an interruption continues where it stopped);
#   4. the recipe evaluates and writes the Hub-ready folder (weights, config with auto_map, tokenizer, modeling code,
#      model card);
#   5. a separate Python process that never imports longattn loads that folder with
#      AutoModelForSequenceClassification(trust_remote_code=True) and prints its accuracy on the unseen test split;
#   6. a small sliding-window causal LM trained on a real corpus every machine has (the Python standard library's
#      source, `longattn-data stdlib`), then `longattn-eval` prints its bits per byte by context length on the
#      unseen test files: the loss falls as the window gives each token more context (a table, results.json and a
#      plot in runs/quickstart-stdlib-clm-eval).
# Knobs (environment): QUICKSTART_STEPS (default 400), QUICKSTART_LM_STEPS (default 300), QUICKSTART_LM_OUTPUT, QUICKSTART_OUTPUT (default runs/quickstart-needle),
# QUICKSTART_PROCESSES=2 to train with two processes (accelerate launch, gloo) instead of one,
# QUICKSTART_SETUP=0 to skip step 1 and use the `python` on PATH as it is (scripts/regenerate_doc_figures.py does).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "${QUICKSTART_SETUP:-1}" != 0 ]; then
    bash scripts/setup.sh
    . .venv/bin/activate
fi
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false

DATA=data/generated/needle
OUTPUT=${QUICKSTART_OUTPUT:-runs/quickstart-needle}
STEPS=${QUICKSTART_STEPS:-400}
PROCESSES=${QUICKSTART_PROCESSES:-1}

python -m longattn.train.data needle --output_dir "$DATA" --num_train 6000 --num_validation 200 --num_test 500 \
    --min_length 128 --max_length 256 --seed 0

RECIPE_ARGS=(
    --train_file "$DATA/train.jsonl" --validation_file "$DATA/validation.jsonl"
    --config_overrides "attention_type=sliding,sliding_window=8,hidden_size=64,num_hidden_layers=2,num_attention_heads=4,intermediate_size=128,hidden_dropout_prob=0.0,max_position_embeddings=512"
    --per_device_train_batch_size $((16 / PROCESSES)) --per_device_eval_batch_size 32
    --learning_rate 2e-3 --num_warmup_steps 20 --max_train_steps "$STEPS" --eval_steps 100
    --checkpointing_steps 100 --resume_from_checkpoint latest --output_dir "$OUTPUT"
)
if [ "$PROCESSES" -gt 1 ]; then
    ACCELERATE_USE_CPU=1 accelerate launch --config_file recipes/configs/cpu_2proc.yaml \
        --num_processes "$PROCESSES" recipes/run_classification.py "${RECIPE_ARGS[@]}"
else
    python recipes/run_classification.py "${RECIPE_ARGS[@]}"
fi

# A process with only torch and transformers: longattn is made unimportable, the folder brings its own code.
python - "$OUTPUT" "$DATA/test.jsonl" <<'EOF'
import importlib.abc
import json
import sys


class NoLongattn(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "longattn" or name.startswith("longattn."):
            raise ModuleNotFoundError(f"No module named {name!r}")


sys.meta_path.insert(0, NoLongattn())
import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer

folder, test_file = sys.argv[1], sys.argv[2]
model, info = AutoModelForSequenceClassification.from_pretrained(folder, trust_remote_code=True, output_loading_info=True)
model.eval()
# Every weight of the folder loads into the folder's own classes: a missing one would be drawn at random.
problems = {key: sorted(info[key]) for key in ("missing_keys", "unexpected_keys", "mismatched_keys") if info[key]}
if problems:
    sys.exit(f"{folder} does not load whole: {problems}")
tokenizer = AutoTokenizer.from_pretrained(folder, trust_remote_code=True)
rows = [json.loads(line) for line in open(test_file)]
correct = 0
with torch.no_grad():
    for start in range(0, len(rows), 50):
        chunk = rows[start:start + 50]
        batch = tokenizer([r["text"] for r in chunk], padding=True, return_tensors="pt")
        predictions = model(**batch).logits.argmax(-1).tolist()
        correct += sum(int(model.config.id2label[p]) == r["label"] for p, r in zip(predictions, chunk))
results = json.load(open(f"{folder}/all_results.json"))
print(f"loaded {folder} with {type(model).__name__} from {type(model).__module__} (longattn not imported)")
print(f"validation accuracy {results['eval_accuracy']:.3f} after {results['train_steps']} steps; "
      f"test accuracy {correct / len(rows):.3f} on {len(rows)} unseen examples (chance 0.100)")
EOF

# 6. Does a model use its long context? A causal LM on the standard library's source, scored by context length.
LM_OUTPUT=${QUICKSTART_LM_OUTPUT:-runs/quickstart-stdlib-clm}
python -m longattn.train.data stdlib --output_dir data/stdlib
python recipes/run_clm.py --train_file data/stdlib/train.jsonl --validation_file data/stdlib/validation.jsonl \
    --max_eval_samples 6 \
    --config_overrides "attention_type=sliding,sliding_window=128,hidden_size=64,num_hidden_layers=2,num_attention_heads=4,intermediate_size=256,hidden_dropout_prob=0.0,max_position_embeddings=1024" \
    --max_seq_length 1024 --per_device_train_batch_size 8 --learning_rate 2e-3 --num_warmup_steps 20 \
    --max_train_steps "${QUICKSTART_LM_STEPS:-300}" --eval_steps 100 --checkpointing_steps 100 \
    --resume_from_checkpoint latest --output_dir "$LM_OUTPUT"
python -m longattn.tools.evaluate "$LM_OUTPUT" --corpus data/stdlib/test.jsonl --lengths 16 64 256 1024 \
    --max_tokens 65536 --output_dir "$LM_OUTPUT-eval"
