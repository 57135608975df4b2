"""What every part of a recipe shares: the user error that ends a run with one line, and what the output folder records
(secrets redacted, local paths relative to it, JSON written atomically, the training log)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..tools.command_line import REDACTED, is_secret_flag


class RecipeError(Exception):
    """A user error (a flag, a file, a column): the recipe stops with this one-line message, before training."""


# Flags whose value may name a local file or folder: recorded relative to the output folder (or by name), never as an
# absolute path, since the output folder is what --push_to_hub publishes.
PATH_FLAGS = (
    "output_dir",
    "train_file",
    "validation_file",
    "dataset_name",
    "model_name_or_path",
    "config_name",
    "tokenizer_name",
    "resume_from_checkpoint",
)


LOG_FILE = "train_log.jsonl"


def recorded_path(path: str | Path, output_dir: str | Path) -> str:
    """`path` as the output folder records it: relative to the output folder while that climbs at most two levels
    (`../../data/train.jsonl`), else by its name alone; an absolute path would publish the user's directories."""
    relative = Path(os.path.relpath(Path(path).resolve(), Path(output_dir).resolve()))
    ups = next((i for i, part in enumerate(relative.parts) if part != ".."), len(relative.parts))
    return relative.as_posix() if ups <= 2 else Path(path).name


def recorded_value(output_dir: str | Path) -> Callable[[str, str], str]:
    """`(flag, value) -> value` as recorded: a secret redacted, a local path made relative (`recorded_path`)."""

    def record(flag: str, value: str) -> str:
        name = flag.lstrip("-").replace("-", "_")
        if is_secret_flag(name):
            return REDACTED
        if name == "output_dir" or os.path.isabs(value) or (name in PATH_FLAGS and Path(value).exists()):
            return recorded_path(value, output_dir)
        return value

    return record


def recorded_args(args: argparse.Namespace) -> dict[str, int | float | str | bool]:
    """The scalar arguments as the trackers (TensorBoard, W&B, ... through `init_trackers`) may store them: secrets
    redacted, local paths relative to the output folder."""
    record = recorded_value(args.output_dir)
    return {
        key: record(key, value) if isinstance(value, str) else (REDACTED if is_secret_flag(key) else value)
        for key, value in vars(args).items()
        if isinstance(value, (int, float, str, bool))
    }


def one_line(error: BaseException) -> str:
    return " ".join(str(error).split())


def format_metrics(metrics: dict[str, float]) -> str:
    return ", ".join(f"{k}={v:.4f}" if isinstance(v, float) else f"{k}={v}" for k, v in metrics.items())


def write_json(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)


def log_record(accelerator, path: Path, record: dict[str, Any], args: argparse.Namespace) -> None:
    if args.with_tracking:
        step = record.get("step")
        accelerator.log({k: v for k, v in record.items() if k != "step"}, step=step)
    if accelerator.is_main_process:
        with path.open("a") as f:
            f.write(json.dumps(record) + "\n")


def run_recipe(main: Callable[[list[str] | None], Any], argv: list[str] | None = None) -> None:
    """Run a recipe's `main`; a `RecipeError` ends the process with one line on stderr and exit status 2, an
    `OSError` with one line and exit status 1."""
    try:
        main(argv)
    except (RecipeError, OSError) as error:
        # An OSError (a missing file, an unwritable output folder) is the user's to fix too: one line, no traceback.
        prog = Path(sys.argv[0]).name
        sys.stderr.write(f"{prog}: error: {one_line(error)}\n")
        sys.stderr.flush()
        raise SystemExit(2 if isinstance(error, RecipeError) else 1) from None
