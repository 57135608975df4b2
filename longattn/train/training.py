"""The shared plumbing of the `recipes/run_*.py` training scripts: arguments, data, collators, the training loop with
resumable checkpoints, metrics and the final Hub-ready folder. One place, four thin recipes.

A recipe reads top to bottom like transformers' `run_*_no_trainer.py` examples:

    parser = recipe_parser(__doc__, task="mlm")                # shared flags; the recipe adds its own
    args = parse_args(parser, argv)                            # bad flags / missing files -> one-line error
    config = load_config(args, task="mlm")                     # --config_overrides, validated by LongAttnConfig
    tokenizer = load_tokenizer(args, config)                   # the byte tokenizer unless told otherwise
    accelerator = make_accelerator(args)
    raw = load_raw_datasets(args, {"text_column": "text"})     # --dataset_name or json/jsonl/csv/txt; columns checked
    ... tokenize with raw.map ...
    model = load_model(args, config, tokenizer, AutoModelForMaskedLM)
    results = train(args, accelerator, model, train_dataset, eval_dataset, collator, evaluate=..., ...)
    finish(args, accelerator, model, tokenizer, results, task="mlm")   # all_results.json, Hub folder, push

`train` is a handful of steps on one `TrainState` (model, optimizer, scheduler, data loaders, position in the run,
running loss), each usable alone: `prepare_training` (data loaders, `build_optimizer`, schedule, `accelerator.prepare`),
`begin_run` (trackers, clean-up, `resume`), `train_epoch` of `train_step`s, `run_evaluation`, `save_checkpoint` and
`summarize` (the results dict).

Never lose a run: every `--checkpointing_steps` optimizer steps `accelerator.save_state` writes
`output_dir/checkpoints/.step_N.partial/`, the training position goes into `trainer_state.json`, and only then the
folder is renamed to `step_N` (an atomic rename): a kill during a save leaves a `.partial` folder that resuming ignores
and removes. `--resume_from_checkpoint latest` loads the newest complete checkpoint and skips exactly the batches of
the current epoch that were already consumed (`accelerator.skip_first_batches`). Randomness inside a step (dropout,
MLM masking) is seeded from (seed, epoch, batch, process), and the shuffling from (seed, epoch), so a resumed run
repeats the uninterrupted one bit for bit on CPU. A streamed training set (--streaming) resumes the same way, by
replaying each process's stream and skipping the examples it consumed (`longattn.train.streaming`).

Two environment variables exist for the tests of that promise: `LONGATTN_RECIPE_SIGKILL_AT_STEP=N` makes the process
SIGKILL itself right after optimizer step N (and its checkpoint, if one is due), `LONGATTN_RECIPE_SIGKILL_IN_SAVE=N`
kills it in the middle of the checkpoint of step N.

With --gradient_accumulation_steps K, one optimizer step is K batches gathered first: their labelled tokens, counted
over all processes, go to the model as `num_items_in_batch` (transformers' convention), so the step's gradient is
that of one batch K times larger. A resumed run warns about arguments that differ from those its checkpoint was
written with, and 'latest' skips a checkpoint that does not load. What the output folder records of the command line
and the arguments (model card, `all_results.json`, checkpoints, trackers) holds no secret (`--hub_token`, ...) and no
absolute path (`recorded_value`).

Importing this module has no side effect (no logging setup, no environment change); `accelerate` is only touched when
a recipe calls `make_accelerator`.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import importlib.util
import inspect
import itertools
import json
import logging
import math
import os
import re
import shlex
import shutil
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from .. import config_overrides
from ..attention_registry import attention_class
from ..configuration_longattn import LongAttnConfig, check_override_fields
from ..tokenization_longattn import byte_tokenizer
from ..tools.command_line import (
    REDACTED,
    CommandLineParser,
    is_secret_flag,
    redact_argv,
    redact_values,
    secret_values,
)
from ..tools.hub import is_stock_longattn
from . import context_parallel as cp_lib
from . import streaming
from .collators import DataCollatorWithGlobalAttention, PadCollator, mask_tokens, pad_token_id
from .streaming import is_empty

logger = logging.getLogger(__name__)

TASKS = ("mlm", "classification", "clm", "seq2seq")
DATA_EXTENSIONS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".txt": "text"}
SCHEDULER_TYPES = (
    "linear",
    "cosine",
    "cosine_with_restarts",
    "polynomial",
    "constant",
    "constant_with_warmup",
    "inverse_sqrt",
    "warmup_stable_decay",
)
CHECKPOINTS_DIR = "checkpoints"
STATE_FILE = "trainer_state.json"
_PARTIAL_SUFFIX = ".partial"
_STEP_DIR = re.compile(r"^step_(\d+)$")
LOG_FILE = "train_log.jsonl"
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


class RecipeError(Exception):
    """A user error (a flag, a file, a column): the recipe stops with this one-line message, before training."""


class _OneLineParser(CommandLineParser):
    """`CommandLineParser` (no abbreviations), and a usage error is one line (`prog: error: ... (see --help)`) like
    every other recipe error."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {_one_line(message)} (see --help)\n")


# ---------------------------------------------------------------------------------------------- arguments
def recipe_parser(description: str | None, *, task: str) -> argparse.ArgumentParser:
    """The flags every recipe shares (transformers' `no_trainer` names); a recipe adds its own to the result."""
    if task not in TASKS:
        raise ValueError(f"task={task!r}: expected one of {list(TASKS)}.")
    parser = _OneLineParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.set_defaults(task=task)
    data = parser.add_argument_group("data")
    data.add_argument("--dataset_name", help="a dataset on the Hub or a local dataset folder (datasets.load_dataset)")
    data.add_argument("--dataset_config_name", help="the configuration of --dataset_name")
    data.add_argument("--train_file", help="training data: .json / .jsonl / .csv / .txt")
    data.add_argument("--validation_file", help="evaluation data, same format as --train_file")
    data.add_argument(
        "--validation_split_percentage",
        type=int,
        default=5,
        help="without a validation split, hold out this percentage of the training data",
    )
    data.add_argument("--max_train_samples", type=int, help="truncate the training set (debugging, quick runs)")
    data.add_argument("--max_eval_samples", type=int, help="truncate the evaluation set")
    data.add_argument(
        "--max_seq_length",
        type=int,
        help="longest input in tokens (default: the model's max_position_embeddings, at most 4096)",
    )
    data.add_argument(
        "--pad_to_max_length",
        action="store_true",
        help="pad every batch to --max_seq_length (default: to the longest, rounded up to the "
        "attention's block multiple)",
    )
    data.add_argument("--preprocessing_num_workers", type=int, help="processes for datasets.map")
    data.add_argument(
        "--streaming",
        action="store_true",
        help="read the training data as a stream (datasets' IterableDataset), each process its own shard; "
        "needs --max_train_steps",
    )
    data.add_argument(
        "--shuffle_buffer_size",
        type=int,
        default=1000,
        help="with --streaming: examples in the shuffle buffer (0: no shuffling)",
    )

    model = parser.add_argument_group("model")
    model.add_argument("--model_name_or_path", help="a pretrained model (Hub id or folder) to fine-tune")
    model.add_argument("--config_name", help="a config (Hub id or folder) to train from scratch")
    model.add_argument(
        "--config_overrides",
        help="override config fields, transformers' format: \"attention_type=sliding,sliding_window=64,"
        'hidden_size=128"; a list in brackets: "attention_type=[sliding,full]"; the '
        '`longattn` dict of a lengthened stock checkpoint: "longattn.sliding_window=256"',
    )
    model.add_argument("--tokenizer_name", help="a tokenizer (Hub id or folder); default: the model's, else bytes")
    model.add_argument("--trust_remote_code", action="store_true", help="allow custom code from the Hub")
    model.add_argument("--gradient_checkpointing", action="store_true")

    train = parser.add_argument_group("training")
    train.add_argument("--output_dir", required=True, help="the final Hub-ready folder; checkpoints go below it")
    train.add_argument(
        "--overwrite_output_dir",
        action="store_true",
        help="delete the checkpoints of an earlier run in --output_dir instead of refusing to start",
    )
    train.add_argument("--per_device_train_batch_size", type=int, default=8)
    train.add_argument("--per_device_eval_batch_size", type=int, default=8)
    train.add_argument("--gradient_accumulation_steps", type=int, default=1)
    train.add_argument("--learning_rate", type=float, default=5e-4)
    train.add_argument("--weight_decay", type=float, default=0.0)
    train.add_argument("--max_grad_norm", type=float, default=1.0, help="0 disables gradient clipping")
    train.add_argument("--num_train_epochs", type=int, default=3)
    train.add_argument("--max_train_steps", type=int, help="optimizer steps; overrides --num_train_epochs")
    train.add_argument("--lr_scheduler_type", default="linear", choices=SCHEDULER_TYPES)
    train.add_argument("--num_warmup_steps", type=int, default=0)
    train.add_argument("--seed", type=int, default=42)
    train.add_argument(
        "--mixed_precision",
        choices=("no", "fp16", "bf16"),
        help="passed to the Accelerator (default: accelerate's config / launch flag)",
    )
    train.add_argument(
        "--checkpointing_steps", help="save the training state every N optimizer steps, or 'epoch' at each epoch's end"
    )
    train.add_argument("--checkpoints_total_limit", type=int, default=2, help="keep this many checkpoints")
    train.add_argument(
        "--resume_from_checkpoint",
        help="a checkpoint folder, or 'latest' (the newest complete one in output_dir/checkpoints; "
        "starts from scratch when there is none)",
    )
    train.add_argument("--eval_steps", type=int, help="also evaluate every N optimizer steps (default: each epoch)")
    train.add_argument("--logging_steps", type=int, default=10)
    train.add_argument("--with_tracking", action="store_true", help="log to the trackers of --report_to")
    train.add_argument("--report_to", default="all", help="tensorboard, wandb, trackio, ... or all")
    train.add_argument(
        "--context_parallel",
        type=int,
        default=1,
        help="split each sequence across N processes (sliding kinds; MLM and CLM): N divides the processes, the "
        "ranks of each group of N share a batch",
    )
    train.add_argument(
        "--ddp_find_unused_parameters",
        action="store_true",
        help="for attention kinds with parameters some batches do not use",
    )

    hub = parser.add_argument_group("hub")
    hub.add_argument("--push_to_hub", action="store_true", help="upload the final folder (create_repo + upload_folder)")
    hub.add_argument("--hub_model_id", help="the repository to push to (default: the output_dir's name)")
    hub.add_argument("--hub_token", help="a Hub token (default: the logged-in one)")
    hub.add_argument("--hub_private_repo", action="store_true")
    return parser


def parse_args(parser: argparse.ArgumentParser, argv: list[str] | None = None) -> argparse.Namespace:
    """Parse and check everything that can be checked without loading anything.

    Raises:
        RecipeError: a missing or unsupported data file, an impossible number, contradicting flags.
    """
    args = parser.parse_args(argv)
    script = Path(sys.argv[0])
    script = Path(script.parent.name, script.name) if script.parent.name == "recipes" else Path(script.name)
    # What the output folder records of this command: no secret, no absolute path (see `recorded_value`). Secrets
    # are redacted by flag and, whatever spelling set them, by the values their destinations received.
    words = redact_argv(sys.argv[1:] if argv is None else list(argv), recorded_value(args.output_dir))
    args.command = shlex.join([str(script), *redact_values(words, secret_values(parser, args))])
    if args.dataset_name is None and args.train_file is None:
        raise RecipeError("give --train_file (json, jsonl, csv, txt) or --dataset_name.")
    if args.dataset_name is not None and (args.train_file or args.validation_file):
        raise RecipeError("give either --dataset_name or --train_file/--validation_file, not both.")
    builders = set()
    for flag in ("train_file", "validation_file"):
        path = getattr(args, flag)
        if path is None:
            continue
        if not Path(path).is_file():
            raise RecipeError(f"--{flag} {path!r} does not exist.")
        suffix = Path(path).suffix.lower()
        if suffix not in DATA_EXTENSIONS:
            raise RecipeError(
                f"--{flag} {path!r} has an unsupported extension {suffix!r}: expected one of {sorted(DATA_EXTENSIONS)}."
            )
        builders.add(DATA_EXTENSIONS[suffix])
    if len(builders) > 1:
        raise RecipeError("--train_file and --validation_file must have the same format.")
    for flag in (
        "per_device_train_batch_size",
        "per_device_eval_batch_size",
        "gradient_accumulation_steps",
        "num_train_epochs",
        "logging_steps",
        "checkpoints_total_limit",
    ):
        if getattr(args, flag) < 1:
            raise RecipeError(f"--{flag} {getattr(args, flag)} must be >= 1.")
    for flag in ("max_train_steps", "max_seq_length", "max_train_samples", "max_eval_samples", "eval_steps"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            raise RecipeError(f"--{flag} {value} must be >= 1.")
    if args.learning_rate <= 0:
        raise RecipeError(f"--learning_rate {args.learning_rate} must be > 0.")
    if args.context_parallel < 1:
        raise RecipeError(f"--context_parallel {args.context_parallel} must be >= 1.")
    if args.context_parallel > 1 and args.task not in ("mlm", "clm"):
        raise RecipeError(
            f"--context_parallel {args.context_parallel}: only run_mlm.py and run_clm.py split sequences across "
            "processes (a per-sequence label or a decoder needs the whole sequence)."
        )
    if args.context_parallel > 1 and args.streaming:
        raise RecipeError(
            f"--context_parallel {args.context_parallel} with --streaming: a stream is read in a share per process, "
            "and the ranks of a context-parallel group need the same batches; use a local data set."
        )
    if not 0 < args.validation_split_percentage < 100:
        raise RecipeError(f"--validation_split_percentage {args.validation_split_percentage} must be in 1..99.")
    if args.num_warmup_steps < 0:
        raise RecipeError(f"--num_warmup_steps {args.num_warmup_steps} must be >= 0.")
    if args.streaming and args.max_train_steps is None:
        raise RecipeError("--streaming needs --max_train_steps: the length of a stream is unknown until it is read.")
    if args.shuffle_buffer_size < 0:
        raise RecipeError(f"--shuffle_buffer_size {args.shuffle_buffer_size} must be >= 0.")
    if args.checkpointing_steps is not None and args.checkpointing_steps != "epoch":
        if not args.checkpointing_steps.isdigit() or int(args.checkpointing_steps) < 1:
            raise RecipeError(
                f"--checkpointing_steps {args.checkpointing_steps!r}: expected an integer >= 1 or 'epoch'."
            )
    resume = args.resume_from_checkpoint
    if resume not in (None, "latest") and not (Path(resume) / STATE_FILE).is_file():
        raise RecipeError(
            f"--resume_from_checkpoint {resume!r} is not a complete checkpoint "
            f"(no {STATE_FILE}); pass a checkpoint folder or 'latest'."
        )
    if args.model_name_or_path and args.config_name:
        raise RecipeError("give --model_name_or_path (fine-tune) or --config_name (from scratch), not both.")
    if args.with_tracking:
        from accelerate.tracking import get_available_trackers

        if args.report_to == "all" and not get_available_trackers():
            raise RecipeError("--with_tracking found no tracker: install one (e.g. tensorboard) or drop the flag.")
    checkpoints = Path(args.output_dir) / CHECKPOINTS_DIR
    if resume is None and not args.overwrite_output_dir and list_checkpoints(checkpoints):
        raise RecipeError(
            f"{checkpoints} holds checkpoints of an earlier run: pass --resume_from_checkpoint latest "
            f"to continue it, or --overwrite_output_dir to start over."
        )
    return args


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


# ---------------------------------------------------------------------------------------------- config / tokenizer
def parse_config_overrides(overrides: str | None) -> dict[str, Any]:
    """`"a=1,b=x,c=[sliding,full]"` -> `{"a": 1, "b": "x", "c": ["sliding", "full"]}`: the grammar of
    `longattn.config_overrides` (shared with `longattn-visualize`), a malformed item a `RecipeError`."""
    try:
        return config_overrides.parse_config_overrides(overrides)
    except ValueError as error:
        raise RecipeError(str(error)) from None


def load_config(args: argparse.Namespace, *, task: str):
    """The model config: pretrained (--model_name_or_path / --config_name) or a fresh `LongAttnConfig`, with
    --config_overrides applied and the task's stack (causal decoder, encoder-decoder) set, then validated.

    Raises:
        RecipeError: an unknown field, an unknown attention name, any value `LongAttnConfig` rejects.

    A stock family's checkpoint (one lengthened by `longattn.lengthen`) keeps its own config class; its `longattn`
    dict is reached with the dotted form `longattn.sliding_window=256` (see `_stock_config`).
    """
    from transformers import AutoConfig

    overrides = parse_config_overrides(args.config_overrides)
    stack = {
        "clm": {"is_decoder": True, "is_encoder_decoder": False},
        "seq2seq": {"is_decoder": False, "is_encoder_decoder": True},
    }.get(task, {})
    source = args.model_name_or_path or args.config_name
    try:
        if source is None:
            # `longattn.sliding_window=256` (the dotted form for a stock model's `longattn` dict) names the same
            # field as `sliding_window=256` in a longattn config.
            overrides = {key.removeprefix(_DICT_PREFIX): value for key, value in overrides.items()}
            check_override_fields(overrides, LongAttnConfig().to_dict(), where="--config_overrides")
            config = LongAttnConfig(**{**overrides, **stack})
        else:
            config = AutoConfig.from_pretrained(source, trust_remote_code=args.trust_remote_code)
            if not is_longattn(config):
                return _stock_config(config, source, overrides, stack)
            overrides = {key.removeprefix(_DICT_PREFIX): value for key, value in overrides.items()}
            check_override_fields(
                overrides, _settable_fields(config, overrides), where="--config_overrides", hint=f" for {source!r}"
            )
            for key, value in {**overrides, **stack}.items():
                setattr(config, key, value)
            if hasattr(config, "validate_longattn"):
                config.validate_longattn()
    except (ValueError, OSError) as error:
        raise RecipeError(_one_line(error)) from None
    return config


_DICT_PREFIX = "longattn."


def _settable_fields(config, keys) -> set[str]:
    """The fields of a loaded `config` (its attributes: `num_labels` is a property) among `keys`, and the rest of
    its fields (the names a typo is compared with)."""
    return {key for key in keys if hasattr(config, key)} | set(config.to_dict())


def _stock_config(config, source: str, overrides: dict[str, Any], stack: dict[str, Any]):
    """A stock family's config (a checkpoint lengthened by `longattn.lengthen`) with --config_overrides applied:
    `longattn.FIELD=value` sets a field of its `longattn` dict, other keys set config fields; the dict is then
    validated like `LongAttnConfig`.

    Raises:
        RecipeError: an unknown field, a value the kinds reject, or a task the family cannot run.
    """
    from ..integration_transformers import kind_config

    dotted = {key.removeprefix(_DICT_PREFIX): value for key, value in overrides.items() if key.startswith(_DICT_PREFIX)}
    plain = {key: value for key, value in overrides.items() if not key.startswith(_DICT_PREFIX)}
    check_override_fields(
        plain,
        _settable_fields(config, plain),
        where="--config_overrides",
        hint=f" for {source!r} (a field of its `longattn` dict is written `longattn.FIELD=value`)",
    )
    for key, value in plain.items():
        setattr(config, key, value)
    if stack and stack["is_encoder_decoder"] != bool(getattr(config, "is_encoder_decoder", False)):
        raise RecipeError(
            f"{source!r} is a {config.model_type} model, which is "
            f"{'' if config.is_encoder_decoder else 'not '}an encoder-decoder: use the recipe for it."
        )
    if dotted or getattr(config, "longattn", None):
        config.longattn = {**(getattr(config, "longattn", None) or {}), **dotted}
        for stack_name in ("encoder", "decoder") if config.is_encoder_decoder else ("self",):
            kind_config(config, stack_name, is_causal=stack_name == "decoder")
    return config


def load_tokenizer(args: argparse.Namespace, config):
    """--tokenizer_name, else the tokenizer of --model_name_or_path, else the byte tokenizer (offline; for a causal
    LM without the `</s>` it ends other texts with, so that a prompt does not end the text before generation)."""
    from transformers import AutoTokenizer

    source = args.tokenizer_name or args.model_name_or_path
    if source is None:
        return byte_tokenizer(model_max_length=config.max_position_embeddings, add_eos_token=args.task != "clm")
    try:
        return AutoTokenizer.from_pretrained(source, trust_remote_code=args.trust_remote_code)
    except (ValueError, OSError) as error:
        raise RecipeError(f"cannot load the tokenizer {source!r}: {_one_line(error)}") from None


def resolve_max_seq_length(
    args: argparse.Namespace, config, tokenizer, *, flag: str = "max_seq_length", default_cap: int = 4096
) -> int:
    """The length limit of --max_seq_length (or a target-length flag), checked against the model's limit.

    Raises:
        RecipeError: the requested length exceeds `max_position_embeddings`.
    """
    from ..configuration_longattn import max_tokens

    limit = max_tokens(config) or default_cap  # RoBERTa's table holds pad_token_id + 1 rows before the first token
    value = getattr(args, flag)
    if value is None:
        tokenizer_limit = getattr(tokenizer, "model_max_length", None) or limit
        value = min(limit, tokenizer_limit, default_cap)
    elif value > limit:
        if not is_longattn(config):
            raise RecipeError(
                f"--{flag} {value} exceeds the {limit} tokens the model reads (max_position_embeddings="
                f"{config.max_position_embeddings}): pass at most {limit}, or lengthen the checkpoint "
                f"first: longattn-lengthen SRC OUT --max_length {value}."
            )
        raise RecipeError(
            f"--{flag} {value} exceeds the model's limit max_position_embeddings={limit}: pass at most "
            f"{limit}, or train from scratch with --config_overrides max_position_embeddings={value}."
        )
    setattr(args, flag, value)
    return value


def length_multiple(config, *, decoder: bool = False) -> int:
    """The length every batch is padded to a multiple of: the least common multiple of what each layer's attention
    kind asks for (`LongAttnAttention.length_multiple`) in the encoder stack, or the decoder stack with `decoder`."""
    if not is_longattn(config):
        if not is_stock_longattn(config):
            return 1  # a stock model under its own attention
        config = _stock_kind_config(config, decoder=decoder)
        decoder = False
    names = config.decoder_layer_attention_types if decoder else config.layer_attention_types
    multiple = 1
    for layer_idx, name in enumerate(names):
        multiple = math.lcm(multiple, attention_class(name).length_multiple(config, layer_idx=layer_idx))
    # Blocks longer than the longest sequence are clamped by the executors: padding a batch to them would only
    # allocate by the configured size (and pass the model's length limit).
    limit = getattr(config, "max_position_embeddings", None)
    return 1 if isinstance(limit, int) and multiple > limit else multiple


def _stock_kind_config(config, *, decoder: bool = False) -> LongAttnConfig:
    """The `LongAttnConfig` of a stock model's kinds (its `longattn` dict with its geometry): the encoder's or the
    one stack's, or an encoder-decoder's decoder self-attention with `decoder`."""
    from ..integration_transformers import kind_config

    stack = "decoder" if decoder else ("encoder" if getattr(config, "is_encoder_decoder", False) else "self")
    causal = decoder or bool(getattr(config, "is_decoder", False)) or config.model_type not in _ENCODER_MODEL_TYPES
    return kind_config(config, stack, is_causal=causal and stack != "encoder")


# Stock families whose one stack is bidirectional (the others of the supported families are causal decoders).
_ENCODER_MODEL_TYPES = ("bert", "roberta", "xlm-roberta", "camembert", "electra")


def attention_types(config) -> list[str]:
    """The attention kind of each layer (of the encoder, or the one stack), longattn or stock model (none for a
    model that is neither, e.g. a plain `nn.Module` with a bare config)."""
    if not is_longattn(config):
        return list(_stock_kind_config(config).layer_attention_types) if is_stock_longattn(config) else []
    return list(config.layer_attention_types)


# ---------------------------------------------------------------------------------------------- accelerate / data
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


def load_raw_datasets(args: argparse.Namespace, columns: dict[str, str] | None = None):
    """A `DatasetDict` with "train" and "validation" from --dataset_name or the data files (a validation split is
    carved from train when none is given), truncated by --max_train_samples / --max_eval_samples; with --streaming,
    the `streaming.StreamingSplits` of `_streamed_splits`.

    Args:
        columns: `{flag: column}` the recipe reads (`{"text_column": "text"}`), checked before any split so that an
            error names the file and the row as they are there (`require_columns`).
    """
    import datasets
    from datasets import DatasetDict, load_dataset

    stream = getattr(args, "streaming", False)
    try:
        if args.dataset_name is not None:
            raw = load_dataset(args.dataset_name, args.dataset_config_name, streaming=stream)
        else:
            data_files = {"train": args.train_file}
            if args.validation_file:
                data_files["validation"] = args.validation_file
            # Local files convert in moments; their "Generating split" bars would only stand between a bad
            # argument and its one-line error (Hub data sets keep their download bars).
            quiet = not datasets.utils.are_progress_bars_disabled()
            if quiet:
                datasets.utils.disable_progress_bars()
            try:
                raw = load_dataset(
                    DATA_EXTENSIONS[Path(args.train_file).suffix.lower()], data_files=data_files, streaming=stream
                )
            finally:
                if quiet:
                    datasets.utils.enable_progress_bars()
    except Exception as error:  # datasets raises many types for unreadable data; all are user errors here
        raise RecipeError(f"cannot load the data: {_one_line(error)}") from None
    if "train" not in raw:
        raise RecipeError(f"the dataset has no 'train' split (splits: {sorted(raw)}).")
    if stream:
        return _streamed_splits(args, raw, columns)
    if columns:  # the splits the recipe reads: test stands in for a missing validation split
        used = [split for split in ("train", "validation") if split in raw]
        used += ["test"] if "validation" not in raw and "test" in raw else []
        require_columns(
            DatasetDict({split: raw[split] for split in used}),
            columns,
            sources=_data_sources(args, raw),
            problem_type=getattr(args, "problem_type", None),
        )
    if "validation" not in raw:
        if "test" in raw:
            raw["validation"] = raw["test"]
        else:
            split = raw["train"].train_test_split(test_size=args.validation_split_percentage / 100, seed=args.seed)
            raw["train"], raw["validation"] = split["train"], split["test"]
    if args.max_train_samples is not None:
        raw["train"] = raw["train"].select(range(min(args.max_train_samples, len(raw["train"]))))
    if args.max_eval_samples is not None:
        raw["validation"] = raw["validation"].select(range(min(args.max_eval_samples, len(raw["validation"]))))
    for split in ("train", "validation"):
        if len(raw[split]) == 0:
            raise RecipeError(f"the {split} split is empty.")
    return DatasetDict(train=raw["train"], validation=raw["validation"])  # other splits are not tokenized


# With --streaming, the first rows of the training stream are checked before training (the rest as they are read).
_STREAM_CHECKED_ROWS = 100


def _streamed_splits(args: argparse.Namespace, raw, columns: dict[str, str] | None) -> streaming.StreamingSplits:
    """The splits of a streamed run: the training stream (its first --max_train_samples examples), and the evaluation
    split read into memory (at most --max_eval_samples examples) from the validation (or test) split, or else held
    out from the start of the training stream, which then begins after them. The columns are checked on the
    evaluation rows and on the first training rows (`require_columns`).

    Raises:
        RecipeError: no validation split and no --max_eval_samples, an empty split, a bad column or row.
    """
    from datasets import Dataset, DatasetDict

    train = raw["train"]
    held_out = next((raw[split] for split in ("validation", "test") if split in raw), None)
    if held_out is None:
        if args.max_eval_samples is None:
            raise RecipeError(
                "--streaming without a validation split needs --max_eval_samples N: the first N training examples "
                "are held out for evaluation (or give --validation_file)."
            )
        held_out, train = train.take(args.max_eval_samples), train.skip(args.max_eval_samples)
    elif args.max_eval_samples is not None:
        held_out = held_out.take(args.max_eval_samples)
    if args.max_train_samples is not None:
        train = train.take(args.max_train_samples)
    try:
        validation = Dataset.from_list(list(held_out), features=held_out.features)
        head = Dataset.from_list(list(train.take(_STREAM_CHECKED_ROWS)), features=train.features)
        if train.column_names is None:  # a loader that does not declare its features: infer them from the rows
            train = train._resolve_features()
    except Exception as error:  # as in load_raw_datasets: unreadable data is the user's to fix
        raise RecipeError(f"cannot load the data: {_one_line(error)}") from None
    for split, rows in (("train", head), ("validation", validation)):
        if len(rows) == 0:
            raise RecipeError(f"the {split} split is empty.")
    if columns:
        require_columns(
            DatasetDict(train=head, validation=validation),
            columns,
            sources=_data_sources(args, {"train": None, "validation": None}),
            problem_type=getattr(args, "problem_type", None),
        )
    return streaming.StreamingSplits(train=train, validation=validation)


def require_columns(
    raw, columns: dict[str, str], *, sources: dict[str, str] | None = None, problem_type: str | None = None
) -> None:
    """Check that every `{flag: column}` exists in each split, that text columns hold a text in every row and that
    a `label_column` holds labels of one kind: integers or strings (classes), or numbers with
    `problem_type="regression"`.

    Args:
        raw: The splits (a `DatasetDict`).
        columns: `{flag: column}`; the flag `label_column` marks the labels, every other flag a text column.
        sources: `{split: where it comes from}` for the messages (the data file); default: the split's name.
        problem_type: "regression" for float labels.

    Raises:
        RecipeError: one line naming the file (or split), the column, the row (1-based, in that file) and the flag
            that picks another column.
    """
    label_kind = None
    for split in raw:
        source = (sources or {}).get(split)
        where = source or f"the {split} data"
        present = raw[split].column_names
        for flag, column in columns.items():
            if column not in present:
                raise RecipeError(
                    f"column {column!r} is not in the {split} data{f' {source}' if source else ''} "
                    f"(columns: {present}); pick another with --{flag}."
                )
            values = raw[split][column]
            if flag == "label_column":
                label_kind = _check_labels(values, where, column, label_kind, regression=problem_type == "regression")
                continue
            for row, value in enumerate(values, start=1):
                if not isinstance(value, str):
                    raise RecipeError(f"{where}: column {column!r}, row {row}: expected a text, found {value!r}.")


def _label_kind(value: Any) -> str:
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    return "string" if isinstance(value, str) else type(value).__name__


def _check_labels(values: list, where: str, column: str, kind: str | None, *, regression: bool) -> str:
    """The kind of the labels ("number", "string", "boolean"), checked row by row against `kind` (the train split's)."""
    first_row = None
    for row, value in enumerate(values, start=1):
        here = f"{where}: column {column!r}, row {row}"
        if value is None:
            raise RecipeError(f"{here}: the label is missing.")
        if kind is None:
            kind, first_row = _label_kind(value), row
        elif _label_kind(value) != kind:
            seen = f"row {first_row}" if first_row is not None else "the training data"
            raise RecipeError(
                f"{here}: label {value!r} is a {_label_kind(value)}, but {seen} has {kind} labels; "
                f"use one kind of label."
            )
        if regression and kind != "number":
            raise RecipeError(f"{here}: label {value!r} is not a number, which --problem_type regression needs.")
        if not regression and kind == "number" and not float(value).is_integer():
            raise RecipeError(
                f"{here}: label {value!r} is not a class (an integer or a string); pass "
                f"--problem_type regression to train a regression on numbers."
            )
    return kind


def _data_sources(args: argparse.Namespace, raw) -> dict[str, str]:
    """`{split: the file or dataset it comes from}` for error messages."""
    if args.dataset_name is not None:
        return {split: f"{args.dataset_name} ({split} split)" for split in raw}
    return {
        split: path
        for split, path in (("train", args.train_file), ("validation", args.validation_file))
        if path is not None
    }


def group_texts(examples: dict[str, list], block_size: int) -> dict[str, list]:
    """Concatenate tokenized texts and cut them into `block_size` chunks (the remainder is dropped), as in
    transformers' language-modelling examples; use with `datasets.map(batched=True)`."""
    concatenated = {key: sum(examples[key], []) for key in examples}
    total = (len(concatenated["input_ids"]) // block_size) * block_size
    return {
        key: [values[i : i + block_size] for i in range(0, total, block_size)] for key, values in concatenated.items()
    }


def check_packing(args: argparse.Namespace) -> None:
    """Refuse `--packing` with the flags it cannot go with (MLM and CLM recipes).

    Raises:
        RecipeError: `--packing` with `--line_by_line`, or with `--context_parallel` N > 1 (a rank's chunk would cut
            documents and its halo would read another document's keys).
    """
    if not args.packing:
        return
    if args.line_by_line:
        raise RecipeError("--packing and --line_by_line are exclusive: pick one way to lay texts out.")
    if args.context_parallel > 1:
        raise RecipeError(
            f"--packing with --context_parallel {args.context_parallel}: packed rows cannot be split across "
            "processes (documents would be cut and attend across the cut); use one of them."
        )


def arrange_rows(processed, args, max_length: int):
    """The tokenized splits of a language-model recipe as training rows: whole documents packed into rows of
    `max_length` with `--packing`, texts joined into blocks of `max_length` by default, one text a row with
    `--line_by_line`. Run under `accelerator.main_process_first()` (the map's cache); then `check_rows_exist`."""
    if args.line_by_line and not args.packing:
        return processed
    arrange, desc = (pack_documents, "pack into rows of") if args.packing else (group_texts, "blocks of")
    return processed.map(
        arrange,
        batched=True,
        fn_kwargs={"block_size": max_length},
        num_proc=args.preprocessing_num_workers,
        desc=f"{desc} {max_length}",
    )


def check_rows_exist(processed, max_length: int) -> None:
    """Raise RecipeError when the train or validation split made no row (its texts shorter than a block)."""
    for split in ("train", "validation"):
        if is_empty(processed[split]):  # a stream is peeked
            raise RecipeError(
                f"the {split} texts make no block of {max_length} tokens: lower --max_seq_length or pass "
                "--line_by_line."
            )


def pack_documents(examples: dict[str, list], block_size: int) -> dict[str, list]:
    """Join whole tokenized documents into rows of at most `block_size` tokens, with `position_ids` that restart at 0
    for each document (how longattn's models, like transformers' `DataCollatorWithFlattening`, tell packed
    documents apart: attention never crosses from one to another). Use with `datasets.map(batched=True)`.

    Rows are filled first-fit, longest document first, within each `map` batch, so a row wastes little room;
    documents longer than `block_size` are truncated. Sequence `labels` (causal LM) get -100 at every document's
    first token, so no document's last token is trained to predict the next document.

    Returns:
        The columns of `examples` joined per row, and `position_ids`.
    """
    lengths = [min(len(ids), block_size) for ids in examples["input_ids"]]
    rows: list[list[int]] = []  # document indices per row
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        row = next((r for r, free in enumerate(room) if lengths[i] <= free), None)
        if row is None:
            row = len(rows)
            rows.append([])
            room.append(block_size)
        rows[row].append(i)
        room[row] -= lengths[i]
    packed: dict[str, list] = {key: [] for key in examples}
    packed["position_ids"] = []
    for row in rows:
        for key, values in examples.items():
            column = []
            for i in row:
                document = list(values[i][: lengths[i]])
                if key == "labels" and document:
                    document[0] = -100
                column += document
            packed[key].append(column)
        packed["position_ids"].append([p for i in row for p in range(lengths[i])])
    return packed


def progress_bar(iterable, accelerator, desc: str):
    """tqdm on the local main process only."""
    from tqdm.auto import tqdm

    return tqdm(iterable, desc=desc, disable=not accelerator.is_local_main_process, leave=False, dynamic_ncols=True)


def batch_generator(seed: int, *parts: int | str) -> torch.Generator:
    """A torch Generator seeded from (seed, *parts): the same batch gets the same randomness, resumed or not."""
    return torch.Generator().manual_seed(_derived_seed(seed, *parts))


def _derived_seed(seed: int, *parts: int | str) -> int:
    digest = hashlib.sha256("/".join(str(p) for p in (seed, *parts)).encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


# ---------------------------------------------------------------------------------------------- model
def load_model(args: argparse.Namespace, config, tokenizer, auto_class):
    """`auto_class.from_pretrained(--model_name_or_path)` or `auto_class.from_config(config)`; the embeddings grow
    to the tokenizer's size when it is larger; gradient checkpointing on request."""
    if len(tokenizer) > config.vocab_size and args.model_name_or_path is None:
        config.vocab_size = len(tokenizer)
    try:
        if args.model_name_or_path:
            # A stock model running longattn's kinds (its config holds a `longattn` dict) is built with the
            # "longattn" implementation, which attaches the kinds and loads their parameters.
            stock = {"attn_implementation": "longattn"} if is_stock_longattn(config) else {}
            model = auto_class.from_pretrained(
                args.model_name_or_path,
                config=config,
                trust_remote_code=args.trust_remote_code,
                ignore_mismatched_sizes=args.task == "classification",
                **stock,
            )
        else:
            model = auto_class.from_config(config, trust_remote_code=args.trust_remote_code)
    except (ValueError, OSError) as error:
        raise RecipeError(_one_line(error)) from None
    if len(tokenizer) > model.get_input_embeddings().num_embeddings:
        model.resize_token_embeddings(len(tokenizer))
    if args.gradient_checkpointing:
        # transformers 5 renamed it; the old name warns that it goes away in v6
        getattr(model, "activation_checkpointing_enable", model.gradient_checkpointing_enable)()
    if args.context_parallel > 1:
        try:
            cp_lib.check_context_parallel(model)
        except ValueError as error:
            raise RecipeError(f"--context_parallel {args.context_parallel}: {_one_line(error)}") from None
    return model


def is_longattn(model_or_config) -> bool:
    """Whether a model (or config) is one of longattn's own classes, not a stock family running its kinds."""
    config = getattr(model_or_config, "config", model_or_config)
    return getattr(config, "model_type", None) == LongAttnConfig.model_type


def peak_rss_mb() -> float:
    """This process's peak resident memory in MB (`getrusage`; 0 where the platform does not report it)."""
    try:
        import resource
    except ImportError:  # Windows
        return 0.0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**20 if sys.platform == "darwin" else peak / 2**10  # bytes on macOS, KiB on Linux


# ---------------------------------------------------------------------------------------------- the training state
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
        return [_derived_seed(self.seed, "train", epoch, first_batch + i, self.process_index) for i in range(count)]


# ---------------------------------------------------------------------------------------------- checkpoints
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
    _fault_injection("LONGATTN_RECIPE_SIGKILL_IN_SAVE", state.completed_steps)
    if accelerator.is_main_process:
        _write_json(partial / STATE_FILE, state.position())
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
            failures.append(f"{shown}: {_one_line(error)}")
            if path != candidates[-1]:
                logger.warning(
                    "checkpoint %s does not load (%s): falling back to the one before it", shown, _one_line(error)[:300]
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


def _fault_injection(variable: str, step: int) -> None:
    value = os.environ.get(variable)
    if value is not None and value.isdigit() and int(value) == step:
        sys.stdout.flush()
        sys.stderr.flush()
        os.kill(os.getpid(), signal.SIGKILL)


def _write_json(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)


# ---------------------------------------------------------------------------------------------- the training loop
def _accepts_loss_kwargs(model) -> bool:
    """Whether `model.forward` normalises its loss by a `num_items_in_batch` argument (transformers' Trainer test:
    an explicit `accepts_loss_kwargs`, else a `**kwargs` in the signature)."""
    if hasattr(model, "accepts_loss_kwargs"):
        return bool(model.accepts_loss_kwargs)
    return any(p.kind == inspect.Parameter.VAR_KEYWORD for p in inspect.signature(model.forward).parameters.values())


def count_loss_items(batches: list[dict[str, torch.Tensor]], *, shifted_labels: bool) -> torch.Tensor:
    """The labelled items (label != -100) of the micro-batches of one optimizer step, in this process: `shift_labels`
    where a batch has them, else `labels[..., 1:]` when the model shifts its labels (a causal LM: the first label is
    never a target), else every label (one per example for classification)."""
    counts = []
    for batch in batches:
        if "shift_labels" in batch:
            labels = batch["shift_labels"]
        else:
            labels = batch["labels"][..., 1:] if shifted_labels else batch["labels"]
        counts.append(labels.ne(-100).sum())  # on the labels' device: a batch need not hold input_ids
    return torch.stack(counts).sum()


def accumulation_step(
    accelerator,
    model,
    group: list[dict[str, torch.Tensor]],
    *,
    use_num_items: bool,
    shifted_labels: bool,
    seeds: list[int],
    context_parallel: cp_lib.ContextParallel | None = None,
) -> float:
    """Forward and backward over the micro-batches of one optimizer step; return the step's loss (all processes).

    With `use_num_items` (the model takes `num_items_in_batch`, as transformers' heads do), every micro-batch's
    loss is its sum of token losses over the labelled tokens of the whole step across all processes (N), so the
    accumulated gradient is that of one batch of `len(group)` x processes micro-batches, however the labelled tokens
    fall; the loss is multiplied by the number of processes because DDP averages gradients over them (transformers'
    `average_tokens_across_devices`). Without, each micro-batch's mean loss is divided by `len(group)`.

    Args:
        group: The micro-batches, already prepared (MLM masking).
        shifted_labels: The model shifts `labels` itself (causal LM), see `count_loss_items`.
        seeds: One seed per micro-batch for dropout, so that a resumed run repeats the interrupted one.
        context_parallel: Split each micro-batch's sequences across this group (`--context_parallel`): every rank
            takes its chunk (`shift_labels` made before the split), the loss is normalised by the labelled tokens of
            every chunk and batch, and the model, which no DDP wraps, gets its gradients summed over every process
            (`context_parallel.reduce_gradients`).
    """
    if context_parallel is not None:
        group = [cp_lib.shard_batch(batch, context_parallel, causal=shifted_labels) for batch in group]
    num_items = None
    if use_num_items and ("labels" in group[0] or "shift_labels" in group[0]):
        num_items = accelerator.reduce(count_loss_items(group, shifted_labels=shifted_labels), reduction="sum").clamp(
            min=1
        )
    step_loss = torch.zeros((), device=accelerator.device)
    for i, (batch, seed) in enumerate(zip(group, seeds)):
        torch.manual_seed(seed)
        last = i == len(group) - 1
        # Gradients are synchronised across processes on the last micro-batch only: DDP and FSDP skip the others'
        # all-reduce through `no_sync`; DeepSpeed, which steps its engine inside `backward` at a synchronisation
        # boundary, is told which micro-batch is one (as transformers' Trainer does).
        accelerator.gradient_state._set_sync_gradients(last)
        with contextlib.nullcontext() if last else accelerator.no_sync(model):
            if num_items is not None:
                loss = model(**batch, num_items_in_batch=num_items).loss
                # DDP averages over the processes; without DDP (context parallelism) the gradients are summed.
                accelerator.backward(loss * (1 if context_parallel is not None else accelerator.num_processes))
            else:
                loss = model(**batch).loss
                accelerator.backward(loss / len(group))
        step_loss += loss.detach().float()
    if context_parallel is not None:
        cp_lib.reduce_gradients(model)
    if num_items is not None:  # each process holds its share of the step's token mean
        return accelerator.reduce(step_loss, reduction="sum").item()
    return accelerator.reduce(step_loss / len(group), reduction="mean").item()


def build_optimizer(args: argparse.Namespace, model) -> torch.optim.Optimizer:
    """AdamW at --learning_rate with --weight_decay on every parameter but biases and normalisation weights."""
    no_decay = ("bias", "layer_norm.weight", "LayerNorm.weight", "norm.weight")
    groups = [
        {
            "params": [p for n, p in model.named_parameters() if not n.endswith(no_decay)],
            "weight_decay": args.weight_decay,
        },
        {"params": [p for n, p in model.named_parameters() if n.endswith(no_decay)], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=args.learning_rate)


def prepare_training(
    args: argparse.Namespace, accelerator, model, train_dataset, eval_dataset, collate_fn, eval_collate_fn=None
) -> TrainState:
    """The data loaders, optimizer and learning-rate schedule, prepared by accelerate, in a `TrainState` at step 0
    (the arguments are those of `train`)."""
    from torch.utils.data import DataLoader
    from transformers import get_scheduler

    stream = streaming.is_stream(train_dataset)
    train_dataloader = _train_dataloader(args, accelerator, train_dataset, collate_fn)
    eval_dataloader = DataLoader(
        eval_dataset,
        shuffle=False,
        collate_fn=eval_collate_fn or collate_fn,
        batch_size=args.per_device_eval_batch_size,
    )
    optimizer = build_optimizer(args, model)
    context_parallel = _context_parallel_group(args, accelerator)
    data_parallel = accelerator.num_processes // args.context_parallel  # processes that read different batches
    # Steps are counted in optimizer updates; accelerate's prepared scheduler advances num_processes times per update.
    max_train_steps = args.max_train_steps or args.num_train_epochs * math.ceil(
        len(train_dataloader) / data_parallel / args.gradient_accumulation_steps
    )
    lr_scheduler = get_scheduler(
        args.lr_scheduler_type,
        optimizer=optimizer,
        num_warmup_steps=args.num_warmup_steps * accelerator.num_processes,
        num_training_steps=max_train_steps * accelerator.num_processes,
    )
    model, optimizer, train_dataloader, eval_dataloader, lr_scheduler = _prepare(
        accelerator, model, optimizer, train_dataloader, eval_dataloader, lr_scheduler, stream, context_parallel
    )
    global_batch_size = args.per_device_train_batch_size * data_parallel * args.gradient_accumulation_steps
    return TrainState(
        model=model,
        optimizer=optimizer,
        lr_scheduler=lr_scheduler,
        train_dataloader=train_dataloader,
        eval_dataloader=eval_dataloader,
        max_train_steps=max_train_steps,
        # A pass over a stream makes at least one step (`train_epoch` stops the run otherwise).
        num_epochs=max_train_steps
        if stream
        else math.ceil(max_train_steps / math.ceil(len(train_dataloader) / args.gradient_accumulation_steps)),
        global_batch_size=global_batch_size,
        num_processes=accelerator.num_processes,
        seed=args.seed,
        process_index=accelerator.process_index,
        loss_takes_num_items=_accepts_loss_kwargs(accelerator.unwrap_model(model)),
        streaming=stream,
        context_parallel=context_parallel,
    )


def _train_dataloader(args: argparse.Namespace, accelerator, train_dataset, collate_fn: Callable):
    """The training DataLoader: over a `Dataset`, shuffled (by accelerate's seedable sampler once prepared); over a
    stream, this process's shuffled share of it (`streaming.stream_for_process`), in a loader already prepared."""
    from torch.utils.data import DataLoader

    if not streaming.is_stream(train_dataset):
        return DataLoader(
            train_dataset, shuffle=True, collate_fn=collate_fn, batch_size=args.per_device_train_batch_size
        )
    if args.max_train_steps is None:
        raise RecipeError("a streamed training set needs --max_train_steps: its length is unknown until it is read.")
    share = streaming.stream_for_process(
        train_dataset,
        seed=args.seed,
        buffer_size=args.shuffle_buffer_size,
        rank=accelerator.process_index,
        world_size=accelerator.num_processes,
    )
    loader = DataLoader(share, collate_fn=collate_fn, batch_size=args.per_device_train_batch_size)
    return streaming.stream_loader(loader, device=accelerator.device)


def _context_parallel_group(args: argparse.Namespace, accelerator) -> cp_lib.ContextParallel | None:
    """This process's context-parallel group on a (dp, cp) device mesh for --context_parallel N > 1, else None."""
    if args.context_parallel == 1:
        return None
    running = str(accelerator.distributed_type).split(".")[-1]
    if running in ("FSDP", "DEEPSPEED"):
        raise RecipeError(
            f"--context_parallel {args.context_parallel} runs its own gradient reduction, not under {running}: "
            "launch it with a DDP config (recipes/configs/cpu_2proc.yaml, multi_gpu_bf16.yaml)."
        )
    if accelerator.num_processes % args.context_parallel:
        raise RecipeError(
            f"--context_parallel {args.context_parallel} must divide the number of processes "
            f"({accelerator.num_processes}): launch with accelerate launch --num_processes N."
        )
    return cp_lib.init_context_parallel(args.context_parallel, device_type=accelerator.device.type)


def _prepare(accelerator, model, optimizer, train_dataloader, eval_dataloader, lr_scheduler, stream, cp):
    """`accelerator.prepare` of the model, optimizer, data loaders and schedule (`prepare_training`), but for

    - a streamed training set (`stream`): its loader is this process's alone, and must not be prepared again
      (`streaming.stream_loader`);
    - context parallelism (`cp`), which `accelerator.prepare` cannot give: its DDP averages gradients over every
      process (a context-parallel group's shares must be summed: `accumulation_step` reduces them itself), and its
      data loader gives every process a different batch (the ranks of a group must share one). So the model is only
      placed and registered for checkpoints (no DDP), and the data is sharded over the data-parallel group alone
      with accelerate's own `prepare_data_loader`.
    """
    from accelerate.data_loader import prepare_data_loader

    if stream:
        model, optimizer, eval_dataloader, lr_scheduler = accelerator.prepare(
            model, optimizer, eval_dataloader, lr_scheduler
        )
        return model, optimizer, train_dataloader, eval_dataloader, lr_scheduler
    if cp is None:
        return accelerator.prepare(model, optimizer, train_dataloader, eval_dataloader, lr_scheduler)
    model = accelerator.prepare_model(model, evaluation_mode=True)
    cp_lib.enable_context_parallel(model, cp)
    train_dataloader = prepare_data_loader(
        train_dataloader,
        accelerator.device,
        num_processes=cp.dp_size,
        process_index=cp.dp_rank,
        put_on_device=True,
        rng_types=accelerator.rng_types.copy(),
        use_seedable_sampler=True,
        data_seed=accelerator.dataloader_config.data_seed,
    )
    accelerator._dataloaders.append(train_dataloader)  # saved and restored with the checkpoints, as a prepared one
    optimizer, eval_dataloader, lr_scheduler = accelerator.prepare(optimizer, eval_dataloader, lr_scheduler)
    return model, optimizer, train_dataloader, eval_dataloader, lr_scheduler


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
    if _checkpoint_every(args) or args.checkpointing_steps == "epoch" or resuming:
        state.run_settings = run_settings(args, accelerator.unwrap_model(state.model).config)
    resume_path = resume(accelerator, args, state) if resuming else None
    if accelerator.is_main_process:
        _restart_log(Path(args.output_dir) / LOG_FILE, state.completed_steps if resume_path is not None else 0)
    return resume_path


def _checkpoint_every(args: argparse.Namespace) -> int | None:
    """--checkpointing_steps as a number of optimizer steps (None for 'epoch' or no checkpoints)."""
    return int(args.checkpointing_steps) if (args.checkpointing_steps or "").isdigit() else None


def train_step(
    args: argparse.Namespace,
    accelerator,
    state: TrainState,
    group: list[dict[str, torch.Tensor]],
    *,
    epoch: int,
    first_batch: int,
    prepare_batch: Callable[[dict[str, torch.Tensor], torch.Generator], dict[str, torch.Tensor]] | None = None,
) -> float:
    """One optimizer step over `group`, the micro-batches `first_batch`, ... of `epoch`: forward and backward
    (`accumulation_step`), clipping, the optimizer and schedule, then the state's position and running loss.

    Returns:
        The step's loss (all processes).
    """
    if prepare_batch is not None:
        # The ranks of a context-parallel group prepare their shared batch alike (the same MLM masking).
        reader = accelerator.process_index if state.context_parallel is None else state.context_parallel.dp_rank
        group = [
            prepare_batch(batch, batch_generator(args.seed, "batch", epoch, first_batch + i, reader))
            for i, batch in enumerate(group)
        ]
    step_loss = accumulation_step(
        accelerator,
        state.model,
        group,
        use_num_items=state.loss_takes_num_items,
        shifted_labels=args.task == "clm",
        seeds=state.step_seeds(epoch, first_batch, len(group)),
        context_parallel=state.context_parallel,
    )
    if args.max_grad_norm > 0:
        accelerator.clip_grad_norm_(state.model.parameters(), args.max_grad_norm)
    state.optimizer.step()
    state.lr_scheduler.step()
    state.optimizer.zero_grad()
    batch_index = first_batch + len(group)
    state.completed_steps += 1
    state.loss_sum += step_loss
    state.loss_count += 1
    state.last_loss = step_loss
    if state.streaming:  # a short group: a process's share of the stream ran out (`streaming.common_group`)
        end_of_epoch = len(group) < args.gradient_accumulation_steps
        state.examples_in_epoch = 0 if end_of_epoch else state.examples_in_epoch + sum(map(streaming.batch_rows, group))
    else:
        end_of_epoch = batch_index >= len(state.train_dataloader)
    state.epoch, state.batch_in_epoch = (epoch + 1, 0) if end_of_epoch else (epoch, batch_index)
    return step_loss


def run_evaluation(
    args: argparse.Namespace, accelerator, state: TrainState, evaluate: Callable[[Any, Any], dict[str, float]]
) -> dict[str, float]:
    """The recipe's `evaluate(model, eval_dataloader)` without gradients, its metrics prefixed `eval_`, logged and
    kept in `state.metrics`."""
    state.model.eval()
    # With --context_parallel, every process evaluates whole sequences of its own batches (no gradients to keep).
    with torch.no_grad(), cp_lib.context_parallel_paused(state.model):
        result = {f"eval_{k}": v for k, v in evaluate(state.model, state.eval_dataloader).items()}
    state.model.train()
    compute = {"train_cpu_seconds": round(state.train_cpu_seconds, 2), "peak_rss_mb": round(state.peak_rss_mb, 1)}
    _log(accelerator, Path(args.output_dir) / LOG_FILE, {"step": state.completed_steps, **result, **compute}, args)
    logger.info("step %d: %s", state.completed_steps, _fmt(result))
    state.metrics, state.last_eval_step = result, state.completed_steps
    return result


def train_epoch(
    args: argparse.Namespace,
    accelerator,
    state: TrainState,
    epoch: int,
    *,
    evaluate: Callable,
    prepare_batch: Callable | None,
    progress,
) -> None:
    """The optimizer steps of `epoch` (from the batches a resumed run has not seen yet) until its end or
    `max_train_steps`, with the logging, checkpoints and evaluations due after each step."""
    state.model.train()
    state.train_dataloader.set_epoch(epoch)
    skip = state.batch_in_epoch if epoch == state.epoch else 0
    if state.streaming:
        loader = _replayed_stream(state, skip)
    else:
        loader = iter(accelerator.skip_first_batches(state.train_dataloader, skip) if skip else state.train_dataloader)
    batch_index = skip
    # One optimizer step per group of --gradient_accumulation_steps batches (the last group of an epoch may be
    # shorter), gathered first so that the loss is normalised by the labelled tokens of the whole step.
    while group := _next_group(args, accelerator, state, loader):
        started = time.process_time()
        step_loss = train_step(
            args, accelerator, state, group, epoch=epoch, first_batch=batch_index, prepare_batch=prepare_batch
        )
        state.count_compute(time.process_time() - started)
        batch_index += len(group)
        progress.update(1)
        progress.set_postfix(loss=f"{step_loss:.4f}")
        step = state.completed_steps
        if step % args.logging_steps == 0:
            _log(
                accelerator,
                Path(args.output_dir) / LOG_FILE,
                {
                    "step": step,
                    "loss": step_loss,
                    "lr": state.lr_scheduler.get_last_lr()[0],
                    "epoch": epoch,
                    "train_cpu_seconds": round(state.train_cpu_seconds, 2),
                },
                args,
            )
        if (every := _checkpoint_every(args)) and step % every == 0:
            save_checkpoint(accelerator, args, state)
        _fault_injection("LONGATTN_RECIPE_SIGKILL_AT_STEP", step)
        if args.eval_steps and step % args.eval_steps == 0:
            run_evaluation(args, accelerator, state, evaluate)
        if step >= state.max_train_steps:
            break
    else:  # the data ran out before max_train_steps
        if state.streaming:
            _end_stream_pass(state, epoch, batch_index)


def _next_group(args: argparse.Namespace, accelerator, state: TrainState, loader) -> list[dict[str, torch.Tensor]]:
    """The micro-batches of the next optimizer step (fewer at the end of an epoch, none after it); of a stream, as
    many as every process has (`streaming.common_group`)."""
    group = list(itertools.islice(loader, args.gradient_accumulation_steps))
    return streaming.common_group(group, accelerator) if state.streaming else group


def _replayed_stream(state: TrainState, skip: int):
    """The batches of this process's stream for the current pass, after the `skip` batches (`examples_in_epoch`
    examples) a resumed run already trained on: read again and discarded (see `longattn.train.streaming`)."""
    loader = iter(state.train_dataloader)
    if skip:
        replayed = streaming.skip_examples(loader, state.examples_in_epoch)
        if replayed != (skip, state.examples_in_epoch):
            logger.warning(
                "the stream replayed to the checkpoint's position gave %d batches of %d examples where the run had "
                "consumed %d of %d: the data is not what the checkpoint was written with; the resumed run will not "
                "repeat the interrupted one.",
                *replayed,
                skip,
                state.examples_in_epoch,
            )
    return loader


def _end_stream_pass(state: TrainState, epoch: int, batch_index: int) -> None:
    """A pass over the stream ended after `batch_index` batches: the next one starts (reshuffled) at its beginning.

    Raises:
        RecipeError: the pass gave no batch at all (the run would never make a step).
    """
    if batch_index == 0:
        raise RecipeError(
            "the training stream gives no batch (in at least one process's share): it is empty, or (MLM / CLM) "
            "its texts make no block of --max_seq_length tokens."
        )
    if state.epoch == epoch:  # the last step's group was full: `train_step` did not see the end
        state.epoch, state.batch_in_epoch, state.examples_in_epoch = epoch + 1, 0, 0


def summarize(
    args: argparse.Namespace,
    accelerator,
    state: TrainState,
    *,
    runtime: float,
    ranks_seen: list[int],
    resumed_from: Path | None,
    train_samples: int | None,
    validation_samples: int,
) -> dict[str, Any]:
    """The results of a run (see `train`)."""
    return {
        **state.metrics,
        "train_loss": state.loss_sum / max(state.loss_count, 1),
        "train_last_loss": state.last_loss,
        "train_runtime": round(runtime, 2),
        "train_cpu_seconds": round(state.train_cpu_seconds, 2),
        "peak_rss_mb": round(state.peak_rss_mb, 1),
        "train_steps": state.completed_steps,
        # a stream's passes: those finished, and the current one if started
        "epochs": state.epoch + (state.batch_in_epoch > 0) if state.streaming else state.num_epochs,
        "train_samples": train_samples,
        "validation_samples": validation_samples,
        "num_processes": accelerator.num_processes,
        "ranks_seen": ranks_seen,
        "distributed_type": str(accelerator.distributed_type).split(".")[-1],
        "mixed_precision": accelerator.mixed_precision,
        "per_device_train_batch_size": args.per_device_train_batch_size,
        "gradient_accumulation_steps": args.gradient_accumulation_steps,
        "global_batch_size": state.global_batch_size,
        "max_seq_length": args.max_seq_length,
        "attention_types": attention_types(accelerator.unwrap_model(state.model).config),
        "resumed_from": recorded_path(resumed_from, args.output_dir) if resumed_from is not None else None,
        "seed": args.seed,
    }


def train(
    args: argparse.Namespace,
    accelerator,
    model,
    train_dataset,
    eval_dataset,
    collate_fn: Callable,
    *,
    evaluate: Callable[[Any, Any], dict[str, float]],
    prepare_batch: Callable[[dict[str, torch.Tensor], torch.Generator], dict[str, torch.Tensor]] | None = None,
    eval_collate_fn: Callable | None = None,
) -> dict[str, Any]:
    """Train with checkpoints and resumption, evaluate each epoch (and every --eval_steps), return the results.

    Args:
        args: The parsed recipe flags.
        accelerator: From `make_accelerator`.
        model: The model to train (not yet prepared).
        train_dataset / eval_dataset: Tokenized `datasets.Dataset`s; the training set may be a stream (a
            `datasets.IterableDataset`, --streaming), which needs --max_train_steps (see `longattn.train.streaming`).
        collate_fn: Batches features (`PadCollator` or a task's own).
        evaluate: `(model, eval_dataloader) -> metrics` (keys without the `eval_` prefix); runs on every process.
        prepare_batch: `(batch, generator) -> batch` applied to each training batch before the forward pass, with a
            generator seeded by the batch's position (MLM masking).
        eval_collate_fn: A different collator for evaluation.

    Returns:
        The metrics of the last evaluation (`eval_*`), `train_loss` (mean over every optimizer step of the run,
        resumed parts included), `train_last_loss`, `train_runtime` (seconds in this process), `train_steps`,
        `epochs`, `num_processes`, `ranks_seen` (a gather across processes), `global_batch_size`, the model limits
        and `resumed_from` (the checkpoint, relative to the output folder).
    """
    from tqdm.auto import tqdm

    state = prepare_training(args, accelerator, model, train_dataset, eval_dataset, collate_fn, eval_collate_fn)
    resumed_from = begin_run(args, accelerator, state)
    ranks_seen = accelerator.gather(torch.tensor([accelerator.process_index], device=accelerator.device)).tolist()
    logger.info(
        "training: %s, %d processes %s, global batch %d, %d optimizer steps (%s)",
        "a stream" if state.streaming else f"{len(train_dataset)} examples",
        accelerator.num_processes,
        ranks_seen,
        state.global_batch_size,
        state.max_train_steps,
        "as many passes as they need" if state.streaming else f"{state.num_epochs} epochs",
    )
    progress = tqdm(
        total=state.max_train_steps,
        initial=state.completed_steps,
        desc="train",
        disable=not accelerator.is_local_main_process,
        dynamic_ncols=True,
    )
    start = time.perf_counter()
    for epoch in range(state.epoch, state.num_epochs):
        if state.completed_steps >= state.max_train_steps:
            break
        train_epoch(args, accelerator, state, epoch, evaluate=evaluate, prepare_batch=prepare_batch, progress=progress)
        if args.checkpointing_steps == "epoch":
            save_checkpoint(accelerator, args, state)
        if state.last_eval_step != state.completed_steps:
            run_evaluation(args, accelerator, state, evaluate)
    progress.close()
    if state.last_eval_step is None:  # resumed after the last step: nothing trained, evaluate what was loaded
        run_evaluation(args, accelerator, state, evaluate)
    runtime = time.perf_counter() - start
    if args.with_tracking:
        accelerator.end_training()
    return summarize(
        args,
        accelerator,
        state,
        runtime=runtime,
        ranks_seen=ranks_seen,
        resumed_from=resumed_from,
        train_samples=streaming.num_examples(train_dataset),
        validation_samples=len(eval_dataset),
    )


def _log(accelerator, path: Path, record: dict[str, Any], args: argparse.Namespace) -> None:
    if args.with_tracking:
        step = record.get("step")
        accelerator.log({k: v for k, v in record.items() if k != "step"}, step=step)
    if accelerator.is_main_process:
        with path.open("a") as f:
            f.write(json.dumps(record) + "\n")


def _fmt(metrics: dict[str, float]) -> str:
    return ", ".join(f"{k}={v:.4f}" if isinstance(v, float) else f"{k}={v}" for k, v in metrics.items())


def _one_line(error: BaseException) -> str:
    return " ".join(str(error).split())


# ---------------------------------------------------------------------------------------------- metrics helpers
def token_stats(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Per example `[b, 3]`: summed cross-entropy, correct predictions, and counted tokens (labels != -100)."""
    valid = labels != -100  # [b, n]
    safe = labels.clamp(min=0)
    nll = torch.nn.functional.cross_entropy(logits.float().transpose(1, 2), safe, reduction="none")  # [b, n]
    correct = (logits.argmax(-1) == labels) & valid
    return torch.stack([(nll * valid).sum(-1), correct.sum(-1).float(), valid.sum(-1).float()], dim=-1)


def summarize_token_stats(stats: torch.Tensor) -> dict[str, float]:
    """`eval_loss`, `perplexity`, `accuracy` from the gathered `[N, 3]` rows of `token_stats`."""
    loss_sum, correct, count = stats.double().sum(0).tolist()
    loss = loss_sum / max(count, 1.0)
    return {"loss": loss, "perplexity": math.exp(min(loss, 50.0)), "accuracy": correct / max(count, 1.0)}


# ---------------------------------------------------------------------------------------------- the end of a run
def finish(
    args: argparse.Namespace,
    accelerator,
    model,
    tokenizer,
    results: dict[str, Any],
    *,
    task: str,
    dataset_description: str | None = None,
) -> None:
    """Write `all_results.json` and the Hub-ready folder (model, tokenizer, code, model card) in --output_dir, check
    the folder, and push it with --push_to_hub."""
    from ..tools import hub

    accelerator.wait_for_everyone()
    state_dict = accelerator.get_state_dict(model)  # a collective under FSDP: every process takes part
    if accelerator.is_main_process:
        output_dir = Path(args.output_dir)
        results = {**results, "task": task, "command": args.command}
        _write_json(output_dir / "all_results.json", results)
        card = hub.model_card(
            accelerator.unwrap_model(model).config,
            task=task,
            metrics={k: v for k, v in results.items() if k.startswith("eval_") and isinstance(v, (int, float))},
            training_data=dataset_description or describe_data(args),
            command=_launch_command(results, args.command),
            datasets=[args.dataset_name] if args.dataset_name else None,
            extra={
                k: results[k]
                for k in ("train_steps", "global_batch_size", "num_processes", "max_seq_length", "train_runtime")
                if k in results
            },
        )
        hub.save_hub_folder(accelerator.unwrap_model(model), tokenizer, output_dir, card=card, state_dict=state_dict)
        problems = hub.hub_folder_problems(output_dir)
        if problems:
            raise RuntimeError(f"the folder {output_dir} is not Hub-ready: {problems}")
        logger.info(
            "wrote the Hub-ready folder %s: %s",
            output_dir,
            _fmt({k: v for k, v in results.items() if k.startswith("eval_")}),
        )
        if args.push_to_hub:
            repo_id = args.hub_model_id or output_dir.resolve().name
            url = hub.push_folder(output_dir, repo_id, token=args.hub_token, private=args.hub_private_repo)
            logger.info("pushed to %s", url)
    accelerator.wait_for_everyone()


def describe_data(args: argparse.Namespace) -> str:
    """A line for the model card: the dataset or files, with the generator's parameters when `info.json` is next to
    the training file (written by `longattn-data`)."""
    if args.dataset_name:
        return f"`{args.dataset_name}`" + (f" ({args.dataset_config_name})" if args.dataset_config_name else "")
    text = f"local files `{Path(args.train_file).name}`" + (
        f" / `{Path(args.validation_file).name}`" if args.validation_file else ""
    )
    info = Path(args.train_file).parent / "info.json"
    if info.is_file():
        try:
            details = json.loads(info.read_text())
            text += f", generated by `longattn-data {details.get('task')}` with " + ", ".join(
                f"{k}={v}" for k, v in details.items() if k not in ("task", "columns")
            )
        except (ValueError, OSError):
            pass
    return text


def _launch_command(results: dict[str, Any], command: str) -> str:
    if results.get("num_processes", 1) > 1:
        return f"accelerate launch --num_processes {results['num_processes']} {command}"
    return f"python {command}"


def run_recipe(main: Callable[[list[str] | None], Any], argv: list[str] | None = None) -> None:
    """Run a recipe's `main`; a `RecipeError` ends the process with one line on stderr and exit status 2, an
    `OSError` with one line and exit status 1."""
    try:
        main(argv)
    except (RecipeError, OSError) as error:
        # An OSError (a missing file, an unwritable output folder) is the user's to fix too: one line, no traceback.
        prog = Path(sys.argv[0]).name
        sys.stderr.write(f"{prog}: error: {_one_line(error)}\n")
        sys.stderr.flush()
        raise SystemExit(2 if isinstance(error, RecipeError) else 1) from None


__all__ = [
    "RecipeError",
    "recipe_parser",
    "parse_args",
    "parse_config_overrides",
    "load_config",
    "load_tokenizer",
    "resolve_max_seq_length",
    "length_multiple",
    "make_accelerator",
    "requested_engine",
    "check_engine",
    "configure_deepspeed",
    "shards_parameters",
    "load_raw_datasets",
    "require_columns",
    "group_texts",
    "is_empty",
    "arrange_rows",
    "check_rows_exist",
    "PadCollator",
    "DataCollatorWithGlobalAttention",
    "attention_types",
    "pad_token_id",
    "mask_tokens",
    "progress_bar",
    "batch_generator",
    "load_model",
    "is_longattn",
    "list_checkpoints",
    "save_checkpoint",
    "resume",
    "run_settings",
    "recorded_args",
    "recorded_path",
    "count_loss_items",
    "accumulation_step",
    "TrainState",
    "build_optimizer",
    "prepare_training",
    "begin_run",
    "train_step",
    "run_evaluation",
    "train_epoch",
    "summarize",
    "train",
    "token_stats",
    "summarize_token_stats",
    "finish",
    "describe_data",
    "run_recipe",
]
