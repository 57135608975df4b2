"""The ListOps experiment of docs/listops.md: Long Range Arena ListOps from scratch and with self-pretraining, through
the recipes, on one GPU, in pieces of at most `--deadline` seconds.

    python scripts/listops.py --deadline 540     # work for at most 540 s, then stop; rerun the same command to go on
    python scripts/listops.py --report           # evaluate the finished runs on the test split, write docs/listops.md

Each run writes `runs/listops/NAME/` (the recipes' output folder) and checkpoints every `--checkpointing_steps`; a
rerun skips the finished runs (`all_results.json`) and resumes the current one with `--resume_from_checkpoint latest`,
so keep `runs/listops/` between sessions (the small setting's checkpoints are a few MB). The data is regenerated
when missing (about 25 s of CPU: fixed seeds, the same expressions every time).

The plan (`plan()`), small LRA setting (recipes/configs/listops_lra_small.json), batch 32, length 2,001:

- from scratch, `--steps` steps: `full` (the control, seed 1), `sliding` with the first token global (seeds 1-3),
  `lsh` (Reformer's attention, the content-based kind; seeds 1-3);
- self-pretrained, seeds 1-2: `run_mlm.py` on the training expressions (`--pretrain_steps`), then
  `run_classification.py --model_name_or_path` (`--steps`), with `sliding`; beside each, the scratch run of the same
  total steps (`--pretrain_steps + --steps`).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DATA = REPO / "data/generated/listops-lra"
TOKENIZER = REPO / "data/generated/listops-lra-tokenizer"
RUNS = REPO / "runs/listops"
DOC = REPO / "docs/listops.md"
SMALL_CONFIG = REPO / "recipes/configs/listops_lra_small.json"
LABELS = ",".join(map(str, range(10)))
KINDS = {
    "full": "attention_type=full",
    "sliding": "attention_type=sliding,sliding_window=128",  # the first token is global (the recipe's default)
    "lsh": "attention_type=lsh,lsh_bucket_size=64,lsh_num_hashes=2",
}
TARGETS = {("scratch", "sliding"): 0.38, ("scratch", "lsh"): 0.38, ("pretrained", "sliding"): 0.50}  # full: a control
BEGIN, END = "<!-- listops:results -->", "<!-- /listops:results -->"


@dataclasses.dataclass
class Run:
    name: str  # folder under runs/listops
    recipe: str  # "classification" or "mlm"
    group: str  # "scratch", "pretrained", "scratch-same-steps" or "mlm"
    kind: str
    seed: int
    steps: int
    pretrained: str | None = None  # the masked-LM run a classification starts from


def plan(steps: int, pretrain_steps: int) -> list[Run]:
    """Every run, in the order they are made (a masked-LM run before the classification that starts from it)."""
    runs = [Run("scratch-full-s1", "classification", "scratch", "full", 1, steps)]
    for kind in ("sliding", "lsh"):
        runs += [Run(f"scratch-{kind}-s{seed}", "classification", "scratch", kind, seed, steps) for seed in (1, 2, 3)]
    for seed in (1, 2):
        mlm = f"mlm-sliding-s{seed}"
        runs.append(Run(mlm, "mlm", "mlm", "sliding", seed, pretrain_steps))
        runs.append(Run(f"pretrained-sliding-s{seed}", "classification", "pretrained", "sliding", seed, steps, mlm))
        total = pretrain_steps + steps
        runs.append(
            Run(f"scratch{total}-sliding-s{seed}", "classification", "scratch-same-steps", "sliding", seed, total)
        )
    return runs


def command(run: Run, args: argparse.Namespace) -> list[str]:
    """The recipe command of `run` (always resumable: `latest` starts from scratch when there is no checkpoint)."""
    line = [sys.executable, str(REPO / f"recipes/run_{run.recipe}.py"), "--train_file", str(DATA / "train.jsonl")]
    line += ["--validation_file", str(DATA / "validation.jsonl"), "--output_dir", str(RUNS / run.name)]
    if run.pretrained:
        line += ["--model_name_or_path", str(RUNS / run.pretrained)]
    else:
        line += ["--config_name", str(SMALL_CONFIG), "--tokenizer_name", str(TOKENIZER)]
        line += ["--config_overrides", KINDS[run.kind]]
    line += ["--line_by_line"] if run.recipe == "mlm" else ["--label_names", LABELS]
    line += ["--max_train_steps", str(run.steps), "--per_device_train_batch_size", str(args.batch_size)]
    line += ["--per_device_eval_batch_size", "64", "--learning_rate", str(args.learning_rate)]
    line += ["--num_warmup_steps", str(min(args.warmup_steps, run.steps // 10)), "--weight_decay", "0.01"]
    line += ["--seed", str(run.seed), "--mixed_precision", args.mixed_precision, "--eval_steps", str(args.eval_steps)]
    line += ["--checkpointing_steps", str(args.checkpointing_steps), "--resume_from_checkpoint", "latest"]
    return line


def generate_data() -> None:
    if not (DATA / "test.jsonl").is_file() or not (TOKENIZER / "tokenizer.json").is_file():
        subprocess.run(
            [sys.executable, "-m", "longattn.train.data", "listops", "--lra", "--output_dir", str(DATA)]
            + ["--tokenizer_dir", str(TOKENIZER)],
            check=True,
            cwd=REPO,
        )


def work(args: argparse.Namespace) -> bool:
    """Make the runs of the plan until `--deadline` seconds have passed; True when every run is finished."""
    start = time.monotonic()
    generate_data()
    for run in plan(args.steps, args.pretrain_steps):
        folder = RUNS / run.name
        if (folder / "all_results.json").is_file():
            continue
        left = args.deadline - (time.monotonic() - start)
        if left < 60:
            print(f"stopping before {run.name}: {left:.0f} s left; rerun to go on", flush=True)
            return False
        print(f"{run.name}: {' '.join(command(run, args))}", flush=True)
        began = time.monotonic()
        try:
            subprocess.run(command(run, args), check=True, timeout=left, cwd=REPO)
        except subprocess.TimeoutExpired:
            print(f"{run.name}: stopped at the deadline; rerun to resume it from its last checkpoint", flush=True)
            return False
        finally:
            _add_wall_time(folder, time.monotonic() - began)
    return True


def _add_wall_time(folder: Path, seconds: float) -> None:
    """The run's wall time, summed over the sessions it took (a resumed run's own `train_runtime` is its last part)."""
    path = folder / "wall_time.json"
    if folder.is_dir():
        total = json.loads(path.read_text())["seconds"] if path.is_file() else 0.0
        path.write_text(json.dumps({"seconds": round(total + seconds, 1)}) + "\n")


def evaluate(folder: Path, test_file: Path, *, batch_size: int = 64) -> dict[str, float]:
    """Accuracy of the classifier in `folder` on `test_file`, loaded as a user would (Auto classes, no recipe)."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    import longattn  # noqa: F401  (registers the Auto classes)
    from longattn.train.data import read_jsonl
    from longattn.train.training import length_multiple

    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = AutoModelForSequenceClassification.from_pretrained(folder).to(device).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    multiple = length_multiple(model.config)  # as the recipe's collator pads
    rows = read_jsonl(test_file)
    hits = 0
    for i in range(0, len(rows), batch_size):
        batch = rows[i : i + batch_size]
        texts = [row["text"] for row in batch]
        inputs = tokenizer(texts, padding=True, pad_to_multiple_of=multiple, return_tensors="pt").to(device)
        inputs.pop("token_type_ids", None)
        with torch.no_grad(), torch.autocast(device, dtype=torch.bfloat16, enabled=device == "cuda"):
            predicted = model(**inputs).logits.argmax(-1).tolist()
        hits += sum(model.config.id2label[p] == str(row["label"]) for p, row in zip(predicted, batch))
    return {"test_accuracy": hits / len(rows), "test_examples": len(rows)}


def report(args: argparse.Namespace) -> str:
    """Evaluate every finished classification run on the test split (once) and write the results into DOC."""
    import torch
    import transformers

    rows, by_group, commands = [], {}, []
    for run in plan(args.steps, args.pretrain_steps):
        folder = RUNS / run.name
        if not (folder / "all_results.json").is_file():
            continue
        commands.append(" ".join(["python", *(part.replace(f"{REPO}/", "") for part in command(run, args)[1:])]))
        if run.recipe != "classification":
            continue
        scored = folder / "test_results.json"
        if not scored.is_file():
            scored.write_text(json.dumps(evaluate(folder, DATA / "test.jsonl")) + "\n")
        test = json.loads(scored.read_text())["test_accuracy"]
        results = json.loads((folder / "all_results.json").read_text())
        wall = folder / "wall_time.json"
        minutes = json.loads(wall.read_text())["seconds"] / 60 if wall.is_file() else float("nan")
        by_group.setdefault((run.group, run.kind), []).append(test)
        validation = results.get("eval_accuracy", float("nan"))
        rows.append(
            f"| {run.name} | {run.group} | {run.kind} | {run.seed} | {run.steps} | {validation:.4f} | **{test:.4f}** "
            f"| {minutes:.1f} min |"
        )
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
    lines = [
        f"Measured {datetime.date.today()} on {device}: torch {torch.__version__}, transformers "
        f"{transformers.__version__}, Python {platform.python_version()}.",
        "",
        "| group | kind | seeds | test accuracy, mean ± std over seeds | target | met? |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for (group, kind), accuracies in sorted(by_group.items()):
        spread = statistics.stdev(accuracies) if len(accuracies) > 1 else 0.0
        target = TARGETS.get((group, kind))
        met = "—" if target is None else ("yes" if statistics.mean(accuracies) >= target else "no")
        lines.append(
            f"| {group} | {kind} | {len(accuracies)} | {statistics.mean(accuracies):.4f} ± {spread:.4f} "
            f"| {'—' if target is None else f'{target:.2f}'} | {met} |"
        )
    lines += [
        "",
        "| run | group | kind | seed | steps | validation accuracy | test accuracy | wall time |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
        *rows,
        "",
        "The commands (`scripts/listops.py` with the settings of this report):",
        "",
        "```bash",
        *commands,
        "```",
    ]
    table = "\n".join(lines)
    text = DOC.read_text()
    DOC.write_text(text[: text.index(BEGIN) + len(BEGIN)] + "\n" + table + "\n" + text[text.index(END) :])
    return table


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        allow_abbrev=False, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--deadline", type=float, default=540.0, help="seconds of work in this call")
    parser.add_argument("--report", action="store_true", help="evaluate finished runs on the test split, write the doc")
    parser.add_argument("--steps", type=int, default=5000, help="classification steps (LRA: 5,000)")
    parser.add_argument("--pretrain_steps", type=int, default=5000, help="masked-LM steps of self-pretraining")
    parser.add_argument("--batch_size", type=int, default=32)
    parser.add_argument("--learning_rate", type=float, default=1e-3)
    parser.add_argument("--warmup_steps", type=int, default=500)
    parser.add_argument("--eval_steps", type=int, default=1000)
    parser.add_argument("--checkpointing_steps", type=int, default=500)
    parser.add_argument("--mixed_precision", choices=("no", "bf16", "fp16"), default="bf16")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.report:
        print(report(args))
        return 0
    return 0 if work(args) else 3  # 3: more to do, rerun


if __name__ == "__main__":
    sys.exit(main())
