"""The launch: the Accelerator of a recipe, the sharding engine the launch asked for (FSDP, DeepSpeed) checked
against the one accelerate would run, and DeepSpeed told the recipe's clipping."""

from __future__ import annotations

import argparse
import importlib.util
import logging
import os
from pathlib import Path

from .records import RecipeError

logger = logging.getLogger(__name__)


class TqdmLoggingHandler(logging.StreamHandler):
    """A stderr handler that writes through `tqdm.write` on a terminal: a line logged while a progress bar is shown
    (the attention back-end choice on the first forward pass, an evaluation) goes above the bar instead of into its
    middle. Into a file or a pipe (a log), the line is written on a line of its own, as it is: `tqdm.write` would
    wrap it in the cursor movements (terminal escape codes) that clear and redraw nested bars."""

    def emit(self, record: logging.LogRecord) -> None:
        from tqdm.auto import tqdm

        try:
            line = self.format(record)
            isatty = getattr(self.stream, "isatty", None)
            if isatty is not None and isatty():
                tqdm.write(line, file=self.stream)
            else:
                bars_shown = bool(getattr(tqdm, "_instances", None))
                self.stream.write(f"\n{line}\n" if bars_shown else f"{line}\n")
                self.flush()
        except Exception:  # as logging.StreamHandler: report, never raise from a log call
            self.handleError(record)


def make_accelerator(args: argparse.Namespace):
    """The Accelerator, with the seedable sampler (shuffling is a function of seed and epoch, so a resumed run sees
    the same order), logging set up for the main process only, and `set_seed(args.seed)`. A launch whose config asks
    for FSDP or DeepSpeed where accelerate would run something else (DDP on CPU) stops first (`check_engine`), and
    DeepSpeed gets the recipe's clipping (`configure_deepspeed`)."""
    import datasets
    import transformers
    from accelerate import Accelerator, DataLoaderConfiguration, DistributedDataParallelKwargs, PartialState
    from accelerate.utils import parse_flag_from_env, set_seed

    engine = requested_engine()
    if engine == "DEEPSPEED" and importlib.util.find_spec("deepspeed") is None:
        raise RecipeError(
            "this run was launched with a DeepSpeed config, but DeepSpeed is not installed (pip install deepspeed; "
            "it needs CUDA GPUs and a compiler). Without it, use recipes/configs/fsdp.yaml on GPUs, or "
            "recipes/configs/cpu_2proc.yaml (DDP) on CPU."
        )
    if engine is not None:
        # Asked of the process state, before the Accelerator: on CPU a hybrid-sharding config does not even build one
        # (accelerate's ParallelismConfig refuses MULTI_CPU with a ValueError that does not say why).
        check_engine(PartialState(cpu=parse_flag_from_env("ACCELERATE_USE_CPU")), engine)
    handlers = [DistributedDataParallelKwargs(find_unused_parameters=True)] if args.ddp_find_unused_parameters else []
    accelerator = Accelerator(
        # `train` accumulates itself (as transformers' Trainer does): the loss of an optimizer step is normalised by
        # the labelled tokens of all its micro-batches, not divided again by the accumulation steps.
        gradient_accumulation_steps=1,
        mixed_precision=args.mixed_precision,
        log_with=args.report_to if args.with_tracking else None,
        project_dir=args.output_dir,
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True, data_seed=args.seed),
        kwargs_handlers=handlers,
    )
    configure_deepspeed(args, accelerator)
    launched = int(os.environ.get("WORLD_SIZE", "1"))
    if launched > accelerator.num_processes:
        raise RecipeError(
            f"{launched} processes were launched but each one runs alone (distributed type "
            f"{accelerator.distributed_type}): on CPU, launch with ACCELERATE_USE_CPU=1 "
            f"(e.g. ACCELERATE_USE_CPU=1 accelerate launch --config_file recipes/configs/cpu_2proc.yaml ...)."
        )
    logging.basicConfig(
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
        level=logging.INFO if accelerator.is_local_main_process else logging.ERROR,
        handlers=[TqdmLoggingHandler()],
    )
    requested = requested_num_processes()
    if accelerator.num_processes == 1 and requested > 1:
        logger.warning(
            "%d processes were asked for but this run has one: `accelerate launch --cpu` (or a config without "
            "multi_cpu/multi_gpu) starts a single process. For %d CPU processes: ACCELERATE_USE_CPU=1 accelerate "
            "launch --multi_gpu --num_processes %d ... (or --config_file recipes/configs/cpu_2proc.yaml).",
            requested,
            requested,
            requested,
        )
    logging.getLogger("accelerate").setLevel(logging.WARNING)  # one line per saved file otherwise
    if accelerator.is_local_main_process:
        datasets.utils.logging.set_verbosity_warning()
        transformers.utils.logging.set_verbosity_warning()
    else:
        datasets.utils.logging.set_verbosity_error()
        datasets.utils.logging.disable_progress_bar()
        transformers.utils.logging.set_verbosity_error()
    set_seed(args.seed)
    if accelerator.is_main_process:
        Path(args.output_dir).mkdir(parents=True, exist_ok=True)
    accelerator.wait_for_everyone()
    return accelerator


def requested_engine() -> str | None:
    """The sharding engine the launch asked for, "FSDP" or "DEEPSPEED" (`accelerate launch` with such a config sets
    `ACCELERATE_USE_FSDP` / `ACCELERATE_USE_DEEPSPEED`), else None."""
    for engine in ("FSDP", "DEEPSPEED"):
        if os.environ.get(f"ACCELERATE_USE_{engine}", "false").lower() == "true":
            return engine
    return None


def check_engine(state, engine: str | None) -> None:
    """Refuse to run with another engine than the one asked for.

    accelerate sets up FSDP and DeepSpeed on accelerators only: on CPU (`ACCELERATE_USE_CPU=1`, or a machine without
    CUDA) it keeps an FSDP or DeepSpeed config's processes but runs them as plain DDP (`MULTI_CPU`), or as one
    unsharded process (`NO`), without a word. A run that shards nothing while its config says it does misleads more
    than it helps (memory, checkpoint layout), so it stops here.

    Args:
        state: accelerate's `PartialState` (or the Accelerator): its `distributed_type` and `num_processes`.
        engine: "FSDP", "DEEPSPEED" or None (`requested_engine`).

    Raises:
        RecipeError: `engine` was asked for and the processes run on CPU or unlaunched, where accelerate does not
            set it up.
    """
    running = str(state.distributed_type).split(".")[-1]
    if engine is None or running not in ("MULTI_CPU", "NO"):
        return
    name = {"FSDP": "FSDP", "DEEPSPEED": "DeepSpeed"}[engine]
    instead = "DDP" if state.num_processes > 1 else "one unsharded process"
    raise RecipeError(
        f"this run was launched with an {name} config, but {name} needs CUDA; on CPU accelerate would run {instead} "
        f"(distributed type {running}) instead. On CPU, launch DDP with recipes/configs/cpu_2proc.yaml "
        f"(ACCELERATE_USE_CPU=1); run the {name} configs on GPUs."
    )


def configure_deepspeed(args: argparse.Namespace, accelerator) -> None:
    """Hand the recipe's settings to DeepSpeed, whose engine clips and steps inside `accelerator.backward`.

    The engine clips at its config's `gradient_clipping`: the recipes' configs leave it out ("auto"), and it is set to
    `--max_grad_norm` here. The recipe accumulates micro-batches itself (`accumulation_step`), so the DeepSpeed config
    must not accumulate as well: its `gradient_accumulation_steps` must be 1 or "auto".

    Raises:
        RecipeError: The DeepSpeed config sets another clipping than `--max_grad_norm`, or accumulates.
    """
    plugin = getattr(accelerator.state, "deepspeed_plugin", None)
    if plugin is None:
        return
    mismatches: list[str] = []
    plugin.fill_match("gradient_clipping", mismatches, gradient_clipping=args.max_grad_norm)
    plugin.fill_match("gradient_accumulation_steps", mismatches, gradient_accumulation_steps=1)
    if mismatches:
        raise RecipeError(
            "the DeepSpeed config disagrees with the recipe: "
            + "; ".join(m.lstrip("- ") for m in mismatches)
            + " (leave gradient_clipping out of the config and set --max_grad_norm; set gradient_accumulation_steps: "
            "1 in the config and --gradient_accumulation_steps on the recipe)"
        )


def shards_parameters(accelerator) -> bool:
    """Whether each process holds only a shard of the weights (FSDP, DeepSpeed ZeRO-3) among several processes: then
    every forward is a collective, and `generate()` needs `synced_gpus=True` so that a process that finished its
    sequences early keeps taking part until all have."""
    if accelerator.num_processes < 2:
        return False
    running = str(accelerator.distributed_type).split(".")[-1]
    plugin = getattr(accelerator.state, "deepspeed_plugin", None)
    return running == "FSDP" or (running == "DEEPSPEED" and plugin is not None and plugin.zero_stage == 3)


def requested_num_processes() -> int:
    """How many processes the launch asked for, where this process can tell: `ACCELERATE_NUM_PROCESSES`, else
    `--num_processes N` on the command line of the `accelerate launch` that started it (Linux `/proc`); else 1."""
    value = os.environ.get("ACCELERATE_NUM_PROCESSES", "")
    if value.isdigit():
        return int(value)
    try:
        parent = Path(f"/proc/{os.getppid()}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return 1
    if not any(word.endswith("accelerate") or word == "accelerate.commands.launch" for word in parent):
        return 1
    for i, word in enumerate(parent):
        if word.endswith(".py"):  # the training script: what follows is its own command line
            break
        name, _, inline = word.partition("=")
        if name == "--num_processes":
            value = inline or (parent[i + 1] if i + 1 < len(parent) else "")
            return int(value) if value.isdigit() else 1
    return 1
