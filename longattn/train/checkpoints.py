"""A run's state and its checkpoints: `TrainState` (what one optimizer step hands the next), the atomic save, the
resumption, and the settings a checkpoint records to compare on resumption.

A checkpoint is written into `output_dir/checkpoints/.step_N.partial/` (`accelerator.save_state`, then the position
in `trainer_state.json`), then renamed to `step_N`: a kill during a save leaves a `.partial` folder that resuming
ignores and removes."""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import logging
import os
import re
import shutil
import signal
import sys
from pathlib import Path
from typing import Any

import torch

from ..tools.command_line import is_secret_flag
from . import context_parallel as cp_lib
from .records import (
    LOG_FILE,
    PATH_FLAGS,
    RecipeError,
    one_line,
    recorded_args,
    recorded_path,
    recorded_value,
    write_json,
)

logger = logging.getLogger(__name__)


CHECKPOINTS_DIR = "checkpoints"


STATE_FILE = "trainer_state.json"


_PARTIAL_SUFFIX = ".partial"


_STEP_DIR = re.compile(r"^step_(\d+)$")


# Flags that may change between a run and its resumption without changing what is trained.
_RESUME_FREE_FLAGS = {
    "output_dir",
    "overwrite_output_dir",
    "resume_from_checkpoint",
    "command",
    "with_tracking",
    "report_to",
    "push_to_hub",
    "hub_model_id",
    "hub_private_repo",
    "logging_steps",
    "checkpointing_steps",
    "checkpoints_total_limit",
    "eval_steps",
    "preprocessing_num_workers",
    "max_train_steps",
    "num_train_epochs",
    "per_device_eval_batch_size",
    "trust_remote_code",
    "ddp_find_unused_parameters",
    "gradient_checkpointing",
}


def batch_generator(seed: int, *parts: int | str) -> torch.Generator:
    """A torch Generator seeded from (seed, *parts): the same batch gets the same randomness, resumed or not."""
    return torch.Generator().manual_seed(derived_seed(seed, *parts))


def derived_seed(seed: int, *parts: int | str) -> int:
    digest = hashlib.sha256("/".join(str(p) for p in (seed, *parts)).encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def peak_rss_mb() -> float:
    """This process's peak resident memory in MB since `reset_peak_rss` (Linux: `VmHWM`), else since it started
    (`getrusage`; 0 where the platform reports neither)."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 2**10  # kB
    except OSError:
        pass
    try:
        import resource
    except ImportError:  # Windows
        return 0.0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**20 if sys.platform == "darwin" else peak / 2**10  # bytes on macOS, KiB on Linux


def reset_peak_rss() -> bool:
    """Start the peak resident memory (`peak_rss_mb`) afresh from the current resident set, so that a run's peak
    measures its training, not the tokenisation before it. Linux only (`/proc/self/clear_refs`, value 5); returns
    whether the reset took effect."""
    try:
        with open("/proc/self/clear_refs", "w") as clear_refs:
            clear_refs.write("5")
    except OSError:
        return False
    return True


# The fields of `TrainState` that `trainer_state.json` holds: the position in the run and its running loss, with the
# batch geometry a resumed run must share to repeat it.
_POSITION_FIELDS = (
    "completed_steps",
    "epoch",
    "batch_in_epoch",
    "loss_sum",
    "loss_count",
    "last_loss",
    "global_batch_size",
    "num_processes",
    "train_cpu_seconds",
    "peak_rss_mb",
)


@dataclasses.dataclass
class TrainState:
    """Everything a run carries from one optimizer step to the next, and what a checkpoint restores.

    `accelerator.save_state` writes the prepared objects (model, optimizer, scheduler, data loaders) and the random
    generators of every process; `trainer_state.json` holds the position (`position()`). Randomness inside a step is
    derived from (`seed`, epoch, batch, `process_index`) (`step_seeds`, `batch_generator`), so the position alone
    fixes every draw a resumed step makes.

    A streamed training set (`streaming`) has no length: a pass (`epoch`) ends when a process's share runs out, and
    the position adds the examples each process consumed in the pass (`stream_examples`, one per process), which a
    resumed process reads again and discards (see `longattn.train.streaming`).
    """

    model: Any
    optimizer: torch.optim.Optimizer
    lr_scheduler: Any
    train_dataloader: Any
    eval_dataloader: Any
    max_train_steps: int
    num_epochs: int
    global_batch_size: int
    num_processes: int
    seed: int
    process_index: int
    loss_takes_num_items: bool  # the model normalises its loss by `num_items_in_batch` (`accumulation_step`)
    context_parallel: cp_lib.ContextParallel | None = None  # --context_parallel: this process's group
    completed_steps: int = 0  # optimizer steps
    epoch: int = 0
    batch_in_epoch: int = 0  # batches of `epoch` already consumed (skipped on resumption)
    loss_sum: float = 0.0
    loss_count: int = 0
    last_loss: float | None = None
    run_settings: dict[str, Any] | None = None  # `run_settings`, compared on resumption
    streaming: bool = False  # the training data is a stream
    examples_in_epoch: int = 0  # with `streaming`: examples of `epoch` this process consumed
    stream_examples: list[int] | None = None  # with `streaming`, in a checkpoint: `examples_in_epoch` per process
    metrics: dict[str, float] = dataclasses.field(default_factory=dict)  # of the last evaluation (`eval_*`)
    last_eval_step: int | None = None
    # The compute a run cost, summed over its resumed parts: this process's CPU seconds inside optimizer steps (all
    # its threads; with one thread, what `scripts/benchmark.py --clock cpu` measures) and its peak resident memory.
    train_cpu_seconds: float = 0.0
    peak_rss_mb: float = 0.0

    def count_compute(self, cpu_seconds: float) -> None:
        """Add one step's CPU seconds and take the process's peak resident memory so far."""
        self.train_cpu_seconds += cpu_seconds
        self.peak_rss_mb = max(self.peak_rss_mb, peak_rss_mb())

    def position(self) -> dict[str, Any]:
        """What `trainer_state.json` records (with the run's settings, when recorded)."""
        record = {key: getattr(self, key) for key in _POSITION_FIELDS}
        if self.run_settings is not None:
            record["run_settings"] = self.run_settings
        if self.stream_examples is not None:
            record["stream_examples"] = self.stream_examples
        return record

    def restore_position(self, saved: dict[str, Any]) -> None:
        """Take the position of a checkpoint's `trainer_state.json` (its settings are compared, not taken)."""
        for key in _POSITION_FIELDS:
            if key in saved:
                setattr(self, key, saved[key])
        if saved.get("stream_examples") is not None:
            self.stream_examples = saved["stream_examples"]
            self.examples_in_epoch = self.stream_examples[self.process_index]

    def step_seeds(self, epoch: int, first_batch: int, count: int) -> list[int]:
        """The dropout seeds of `count` micro-batches from batch `first_batch` of `epoch`, in this process."""
        return [derived_seed(self.seed, "train", epoch, first_batch + i, self.process_index) for i in range(count)]


def list_checkpoints(directory: str | Path) -> list[Path]:
    """The complete checkpoints in `directory`, oldest first (a complete one has its `trainer_state.json`)."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    found = []
    for path in directory.iterdir():
        match = _STEP_DIR.match(path.name)
        if match and (path / STATE_FILE).is_file():
            found.append((int(match.group(1)), path))
    return [path for _, path in sorted(found)]


def save_checkpoint(accelerator, args: argparse.Namespace, state: TrainState) -> Path:
    """`accelerator.save_state` (model, optimizer, scheduler, data loaders, random generators) into a `.partial`
    folder, then the training position (`TrainState.position`), then an atomic rename. Old checkpoints beyond
    --checkpoints_total_limit are removed afterwards."""
    directory = Path(args.output_dir) / CHECKPOINTS_DIR
    final = directory / f"step_{state.completed_steps}"
    if state.streaming:  # each process's position in its own share of the stream
        position = torch.tensor([state.examples_in_epoch], device=accelerator.device)
        state.stream_examples = accelerator.gather(position).tolist()
    partial = directory / f".{final.name}{_PARTIAL_SUFFIX}"
    if accelerator.is_main_process:
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(partial))
    accelerator.wait_for_everyone()
    fault_injection("LONGATTN_RECIPE_SIGKILL_IN_SAVE", state.completed_steps)
    if accelerator.is_main_process:
        write_json(partial / STATE_FILE, state.position())
        if final.exists():  # a checkpoint of the same step from an interrupted, now repeated, stretch
            shutil.rmtree(final)
        os.replace(partial, final)
        for old in list_checkpoints(directory)[: -args.checkpoints_total_limit]:
            shutil.rmtree(old, ignore_errors=True)
    accelerator.wait_for_everyone()
    return final


def resume(accelerator, args: argparse.Namespace, state: TrainState) -> Path | None:
    """Load the checkpoint of --resume_from_checkpoint into the prepared objects and `state`; return its folder, or
    None when 'latest' finds no checkpoint (a fresh start).

    With 'latest', a checkpoint that does not load (a truncated `model.safetensors`, a damaged state file) is
    reported with a warning and the next older one is tried. Arguments that differ from those the checkpoint was
    written with (`run_settings`: data contents, model settings, learning rate, ...) are named in a warning.

    Raises:
        RecipeError: the checkpoint was written with another global batch or number of processes; no checkpoint
            loads.
    """
    directory = Path(args.output_dir) / CHECKPOINTS_DIR
    if args.resume_from_checkpoint == "latest":
        candidates = list_checkpoints(directory)[::-1]
        if not candidates:
            logger.info("--resume_from_checkpoint latest: no checkpoint in %s yet, starting from scratch", directory)
            return None
    else:
        candidates = [Path(args.resume_from_checkpoint)]
    failures = []
    for path in candidates:
        shown = recorded_path(path, args.output_dir)
        try:
            saved = json.loads((path / STATE_FILE).read_text())
            _check_resume_batch(saved, state, shown)
            accelerator.load_state(str(path))
        except RecipeError:
            raise
        except Exception as error:  # torch, safetensors and pickle each raise their own type for a damaged file
            failures.append(f"{shown}: {one_line(error)}")
            if path != candidates[-1]:
                logger.warning(
                    "checkpoint %s does not load (%s): falling back to the one before it", shown, one_line(error)[:300]
                )
            continue
        _warn_changed_settings(saved.get("run_settings"), state.run_settings, shown)
        state.restore_position(saved)
        logger.info(
            "resumed from %s: step %d, epoch %d, skipping %d batches",
            shown,
            state.completed_steps,
            state.epoch,
            state.batch_in_epoch,
        )
        return path
    raise RecipeError(f"no checkpoint to resume from loads: {'; '.join(failures)}")


def _check_resume_batch(saved: dict[str, Any], state: TrainState, shown: str) -> None:
    if saved["global_batch_size"] != state.global_batch_size or saved["num_processes"] != state.num_processes:
        raise RecipeError(
            f"{shown} was written with {saved['num_processes']} processes and a global batch of "
            f"{saved['global_batch_size']}; resume with the same (now {state.num_processes} processes, "
            f"global batch {state.global_batch_size}) to repeat the run exactly."
        )


def _warn_changed_settings(saved: dict[str, Any] | None, current: dict[str, Any] | None, shown: str) -> None:
    if saved is None or current is None:  # a checkpoint written before settings were recorded
        return
    changed = [
        f"{key} ({saved.get(key)!r} -> {current.get(key)!r})"
        for key in sorted(set(saved) | set(current))
        if saved.get(key) != current.get(key)
    ]
    if changed:
        logger.warning("resuming from %s with arguments other than it was written with: %s", shown, ", ".join(changed))


def run_settings(args: argparse.Namespace, config) -> dict[str, Any]:
    """What a checkpoint records of the run that wrote it, to compare on resumption: every argument that changes what
    is trained (not --output_dir, --logging_steps, ...; never a secret), data files by name and a SHA-256 of their
    contents, and a SHA-256 of the model's config."""
    record = recorded_value(args.output_dir)
    settings: dict[str, Any] = {}
    for key, value in sorted(vars(args).items()):
        if key in _RESUME_FREE_FLAGS or is_secret_flag(key):
            continue
        if key in PATH_FLAGS and isinstance(value, str) and Path(value).exists():
            value = f"{Path(value).name} (sha256 {_contents_digest(Path(value))[:16]})"
        elif isinstance(value, str):
            value = record(key, value)
        settings[key] = value
    if hasattr(config, "to_json_string"):
        settings["model_config"] = "sha256 " + hashlib.sha256(config.to_json_string().encode()).hexdigest()[:16]
    return settings


def _contents_digest(path: Path) -> str:
    """SHA-256 of a file's bytes, or of a folder's files (relative names and bytes, in name order)."""
    digest = hashlib.sha256()
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    for file in files:
        digest.update(file.relative_to(path).as_posix().encode() if file != path else b"")
        with file.open("rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                digest.update(chunk)
    return digest.hexdigest()


def begin_run(args: argparse.Namespace, accelerator, state: TrainState) -> Path | None:
    """Start the trackers, clear what an earlier run left (its checkpoints with --overwrite_output_dir, interrupted
    saves), record the run's settings, resume with --resume_from_checkpoint and restart the log from the resumed step.

    Returns:
        The checkpoint resumed from, or None for a fresh start.
    """
    if args.with_tracking:
        accelerator.init_trackers(f"longattn-{args.task}", recorded_args(args))
    checkpoints = Path(args.output_dir) / CHECKPOINTS_DIR
    if args.overwrite_output_dir and args.resume_from_checkpoint is None and accelerator.is_main_process:
        shutil.rmtree(checkpoints, ignore_errors=True)
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        _remove_partial_checkpoints(checkpoints)
    resuming = args.resume_from_checkpoint is not None
    if checkpoint_every(args) or args.checkpointing_steps == "epoch" or resuming:
        state.run_settings = run_settings(args, accelerator.unwrap_model(state.model).config)
    resume_path = resume(accelerator, args, state) if resuming else None
    if accelerator.is_main_process:
        _restart_log(Path(args.output_dir) / LOG_FILE, state.completed_steps if resume_path is not None else 0)
    return resume_path


def checkpoint_every(args: argparse.Namespace) -> int | None:
    """--checkpointing_steps as a number of optimizer steps (None for 'epoch' or no checkpoints)."""
    return int(args.checkpointing_steps) if (args.checkpointing_steps or "").isdigit() else None


def _restart_log(path: Path, completed_steps: int) -> None:
    """Keep only the records of `train_log.jsonl` up to `completed_steps`: none for a fresh run (an earlier run's
    log is not appended to), those up to the checkpoint for a resumed one (the interrupted stretch is repeated)."""
    if not path.is_file():
        return
    kept = []
    if completed_steps:
        for line in path.read_text().splitlines():
            try:
                if json.loads(line).get("step", 0) <= completed_steps:
                    kept.append(line + "\n")
            except ValueError:  # a line cut by a kill
                pass
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(kept))
    os.replace(tmp, path)


def _remove_partial_checkpoints(directory: Path) -> None:
    if directory.is_dir():
        for path in directory.iterdir():
            if path.name.endswith(_PARTIAL_SUFFIX):
                shutil.rmtree(path, ignore_errors=True)


def fault_injection(variable: str, step: int) -> None:
    value = os.environ.get(variable)
    if value is not None and value.isdigit() and int(value) == step:
        sys.stdout.flush()
        sys.stderr.flush()
        os.kill(os.getpid(), signal.SIGKILL)
