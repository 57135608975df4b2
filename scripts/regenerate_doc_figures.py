#!/usr/bin/env python
"""Rerun the CPU commands whose outputs the docs quote, and rewrite the quoted figures in place.

A quoted figure sits between two HTML comments (invisible once rendered), naming its figure set and field:

    accuracy **<!-- figure:quickstart.validation_accuracy -->0.955<!-- /figure -->**

A figure set is one command (e.g. `bash scripts/quickstart.sh`) and the fields read from what it prints or writes;
running a set replaces every marked figure of that set in README.md, recipes/README.md and docs/*.md, so a rerun
updates them. Figures without markers (the minutes-to-hours CPU benchmarks of docs/benchmarks*.md, each with its
date and command; the GPU figures of docs/benchmarks_gpu.md, with their date and device) are not rerun here.

    python scripts/regenerate_doc_figures.py --sets quickstart      # ~10-20 min on 2 CPU cores
    python scripts/regenerate_doc_figures.py                        # every set: about an hour on 2 cores
    python scripts/regenerate_doc_figures.py --check                # markers and sets agree; runs nothing

Runs from the repository root with the `python` running this script (its longattn is the checkout's); data goes
to data/generated/, runs to runs/doc-figures/SET (wiped first). Not part of the test suite:
tests/test_doc_figures.py only checks the markers against the sets defined here.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import resource
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DOCS = ("README.md", "recipes/README.md", "docs/*.md")
RUNS = Path("runs/doc-figures")
MARKER = re.compile(r"<!-- figure:(?P<name>[^ ]*) -->(?P<value>.*?)<!-- /figure -->")
OPEN, CLOSE = "<!-- figure:", "<!-- /figure -->"

# The model part of the recipes' `--config_overrides` (recipes/README.md, "Demo results": `M`).
MODEL = (
    "hidden_size=64,num_hidden_layers=2,num_attention_heads=4,intermediate_size=128,hidden_dropout_prob=0.0,"
    "max_position_embeddings=512"
)
DATA = {
    "needle": [
        "needle",
        "--num_train",
        "6000",
        "--num_validation",
        "200",
        "--num_test",
        "500",
        "--min_length",
        "128",
        "--max_length",
        "256",
    ],
    "listops": [
        "listops",
        "--num_train",
        "4000",
        "--num_validation",
        "200",
        "--num_test",
        "200",
        "--min_length",
        "100",
        "--max_length",
        "300",
    ],
    "needles": [
        "needles",
        "--num_train",
        "8000",
        "--num_validation",
        "200",
        "--num_test",
        "200",
        "--min_length",
        "128",
        "--max_length",
        "256",
    ],
}
TRAINING = ["--per_device_train_batch_size", "16", "--learning_rate", "2e-3", "--num_warmup_steps", "20"]


@dataclass(frozen=True)
class FigureSet:
    """One command and the figures the docs quote from it.

    Attributes:
        command: argv run from the repository root (`{output}` is replaced by the run's output folder).
        metrics: field -> (key of the run's `all_results.json`, format).
        data: the `longattn-data` task the command reads (generated first), if any.
        env: extra environment variables (`{output}` replaced as in `command`).
        parse_stdout: fields read from the command's standard output, beyond `metrics`.
        stdout_fields: the names `parse_stdout` returns.
    Every set also has `date`, `wall_time` and `cpu_time` (minutes; CPU = user time of the command and its children).
    """

    command: list[str]
    metrics: dict[str, tuple[str, str]]
    data: str | None = None
    env: dict[str, str] = field(default_factory=dict)
    parse_stdout: Callable[[str], dict[str, str]] | None = None
    stdout_fields: tuple[str, ...] = ()

    @property
    def fields(self) -> tuple[str, ...]:
        return (*self.metrics, *self.stdout_fields, "date", "wall_time", "cpu_time")


def _quickstart_stdout(stdout: str) -> dict[str, str]:
    """The last line of scripts/quickstart.sh: `validation accuracy V after S steps; test accuracy T on N ...`."""
    found = re.search(r"validation accuracy ([\d.]+) after (\d+) steps; test accuracy ([\d.]+)", stdout)
    if not found:
        raise RuntimeError(f"scripts/quickstart.sh did not print its accuracy line; its output ends:\n{stdout[-2000:]}")
    return {"validation_accuracy": found[1], "steps": found[2], "test_accuracy": found[3]}


def _recipe(script: str, data: str, window: int, steps: int, eval_steps: int, *extra: str) -> list[str]:
    """The recipes/README.md command of a demo run (same flags, output folder replaced)."""
    folder = f"data/generated/{data}"
    return [
        sys.executable,
        f"recipes/{script}",
        "--train_file",
        f"{folder}/train.jsonl",
        "--validation_file",
        f"{folder}/validation.jsonl",
        "--config_overrides",
        f"attention_type=sliding,sliding_window={window},{MODEL}",
        *extra,
        *TRAINING,
        "--max_train_steps",
        str(steps),
        "--eval_steps",
        str(eval_steps),
        "--output_dir",
        "{output}",
    ]


FIGURE_SETS: dict[str, FigureSet] = {
    # The quickstart's own data (seed 0), training and reload test; its setup step is skipped (QUICKSTART_SETUP=0).
    "quickstart": FigureSet(
        command=["bash", "scripts/quickstart.sh"],
        env={"QUICKSTART_SETUP": "0", "QUICKSTART_OUTPUT": "{output}"},
        metrics={"validation_loss": ("eval_loss", "{:.2f}")},
        parse_stdout=_quickstart_stdout,
        stdout_fields=("validation_accuracy", "steps", "test_accuracy"),
    ),
    "needle_local_only": FigureSet(
        command=_recipe("run_classification.py", "needle", 8, 400, 100, "--global_attention", "none"),
        data="needle",
        metrics={"accuracy": ("eval_accuracy", "{:.3f}"), "loss": ("eval_loss", "{:.2f}")},
    ),
    "listops_mlm": FigureSet(
        command=_recipe("run_mlm.py", "listops", 16, 300, 100, "--max_seq_length", "256"),
        data="listops",
        metrics={"accuracy": ("eval_accuracy", "{:.3f}"), "perplexity": ("eval_perplexity", "{:.2f}")},
    ),
    "listops_clm": FigureSet(
        command=_recipe("run_clm.py", "listops", 16, 300, 100, "--max_seq_length", "256"),
        data="listops",
        metrics={"accuracy": ("eval_accuracy", "{:.3f}"), "perplexity": ("eval_perplexity", "{:.2f}")},
    ),
    "needles_seq2seq": FigureSet(
        command=_recipe("run_seq2seq.py", "needles", 8, 500, 250, "--max_target_length", "8"),
        data="needles",
        metrics={
            "exact_match": ("eval_exact_match", "{:.2f}"),
            "rougeL": ("eval_rougeL", "{:.2f}"),
            "token_accuracy": ("eval_token_accuracy", "{:.2f}"),
        },
    ),
}


# ---------------------------------------------------------------------------------------------- markers
def doc_files(root: Path = REPO) -> list[Path]:
    """The documentation files that may quote figures."""
    return sorted(path for pattern in DOCS for path in root.glob(pattern))


def find_markers(text: str, source: str = "<text>") -> list[tuple[str, str, str]]:
    """Every `(set, field, value)` marked in `text`, in order.

    Raises:
        ValueError: a marker opened and never closed, closed without being opened, nested, or whose name is not
            `SET.FIELD`.
    """
    opened, closed = text.count(OPEN), text.count(CLOSE)
    found = MARKER.findall(text)
    if not opened == closed == len(found):
        raise ValueError(
            f"{source}: {opened} `{OPEN}NAME -->` and {closed} `{CLOSE}` markers, {len(found)} pairs: "
            f"every figure must be `{OPEN}SET.FIELD -->VALUE{CLOSE}` on one line, not nested."
        )
    markers = []
    for name, value in found:
        set_name, dot, field_name = name.partition(".")
        if not dot or OPEN in value:
            raise ValueError(f"{source}: figure marker {name!r} is not of the form SET.FIELD (or is nested).")
        markers.append((set_name, field_name, value))
    return markers


def check_markers(root: Path = REPO) -> list[str]:
    """The disagreements between the docs' markers and FIGURE_SETS (empty when they agree): unknown sets or
    fields, malformed markers, and sets that no doc quotes."""
    problems, quoted = [], set()
    for path in doc_files(root):
        source = str(path.relative_to(root))
        try:
            markers = find_markers(path.read_text(encoding="utf-8"), source)
        except ValueError as error:
            problems.append(str(error))
            continue
        for set_name, field_name, _ in markers:
            quoted.add(set_name)
            if set_name not in FIGURE_SETS:
                problems.append(f"{source}: figure set {set_name!r} is unknown; known: {sorted(FIGURE_SETS)}.")
            elif field_name not in FIGURE_SETS[set_name].fields:
                problems.append(
                    f"{source}: figure set {set_name!r} has no field {field_name!r}; it has "
                    f"{list(FIGURE_SETS[set_name].fields)}."
                )
    problems += [f"figure set {name!r} is quoted in no doc" for name in sorted(set(FIGURE_SETS) - quoted)]
    return problems


def rewrite(text: str, figures: dict[str, dict[str, str]]) -> str:
    """`text` with the value of every marked figure of a set in `figures` replaced (others left as they are)."""

    def replace(match: re.Match) -> str:
        set_name, _, field_name = match["name"].partition(".")
        value = figures.get(set_name, {}).get(field_name, match["value"])
        return f"{OPEN}{match['name']} -->{value}{CLOSE}"

    return MARKER.sub(replace, text)


# ---------------------------------------------------------------------------------------------- running
def _environment() -> dict[str, str]:
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    # The checkout's longattn and this interpreter, whatever is installed (a recipe's sys.path[0] is recipes/).
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    return env


def run_set(name: str) -> dict[str, str]:
    """Run figure set `name` (its data first) and return its formatted fields."""
    spec = FIGURE_SETS[name]
    output = RUNS / name
    shutil.rmtree(REPO / output, ignore_errors=True)
    env = _environment()
    env.update({key: value.format(output=output) for key, value in spec.env.items()})
    if spec.data:
        task, *knobs = DATA[spec.data]
        subprocess.run(
            [sys.executable, "-m", "longattn.train.data", task, "--output_dir", f"data/generated/{spec.data}", *knobs],
            cwd=REPO,
            env=env,
            check=True,
        )
    command = [part.format(output=output) for part in spec.command]
    print(f"[{name}] {' '.join(command)}", flush=True)
    cpu_before, start = resource.getrusage(resource.RUSAGE_CHILDREN).ru_utime, time.perf_counter()
    done = subprocess.run(command, cwd=REPO, env=env, stdout=subprocess.PIPE, text=True)
    wall, cpu = time.perf_counter() - start, resource.getrusage(resource.RUSAGE_CHILDREN).ru_utime - cpu_before
    print(done.stdout[-3000:], flush=True)
    if done.returncode:
        raise RuntimeError(f"[{name}] exited with status {done.returncode}")
    results = json.loads((REPO / output / "all_results.json").read_text())
    figures = {field_name: fmt.format(results[key]) for field_name, (key, fmt) in spec.metrics.items()}
    if spec.parse_stdout:
        figures.update(spec.parse_stdout(done.stdout))
    figures.update(
        date=datetime.date.today().isoformat(), wall_time=f"{wall / 60:.1f} min", cpu_time=f"{cpu / 60:.1f} min"
    )
    return figures


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        allow_abbrev=False,
        description=__doc__.splitlines()[0],
        epilog=f"figure sets: {', '.join(FIGURE_SETS)}",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument(
        "--sets",
        nargs="+",
        choices=sorted(FIGURE_SETS),
        default=list(FIGURE_SETS),
        metavar="SET",
        help="figure sets to rerun",
    )
    parser.add_argument("--check", action="store_true", help="only check that the markers and sets agree")
    args = parser.parse_args(argv)
    problems = check_markers()
    if problems:
        sys.exit("\n".join(problems))
    if args.check:
        print(f"figure markers agree with {len(FIGURE_SETS)} figure sets")
        return
    for name in args.sets:
        figures = {name: run_set(name)}
        print(f"[{name}] {figures[name]}", flush=True)
        for path in doc_files():  # after each set, so a later failure keeps the figures already measured
            text = path.read_text(encoding="utf-8")
            if (new := rewrite(text, figures)) != text:
                path.write_text(new, encoding="utf-8")
                print(f"[{name}] rewrote {path.relative_to(REPO)}", flush=True)


if __name__ == "__main__":
    main()
