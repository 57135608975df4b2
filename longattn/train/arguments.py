"""A recipe's arguments: the shared flags, their checks (everything that can be checked before loading anything), and
what they load: the config (with --config_overrides), the tokenizer and the model."""

from __future__ import annotations

import argparse
import math
import shlex
import sys
from pathlib import Path
from typing import Any

from .. import config_overrides
from ..attention_registry import attention_class
from ..configuration_longattn import LongAttnConfig, check_override_fields
from ..tokenization_longattn import byte_tokenizer
from ..tools.command_line import CommandLineParser, redact_argv, redact_values, secret_values
from ..tools.hub import is_stock_longattn
from . import context_parallel as cp_lib
from .checkpoints import CHECKPOINTS_DIR, STATE_FILE, list_checkpoints
from .inputs import DATA_EXTENSIONS
from .records import RecipeError, one_line, recorded_value

TASKS = ("mlm", "classification", "clm", "seq2seq")


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


class _OneLineParser(CommandLineParser):
    """`CommandLineParser` (no abbreviations), and a usage error is one line (`prog: error: ... (see --help)`) like
    every other recipe error."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {one_line(message)} (see --help)\n")


def recipe_parser(description: str | None, *, task: str) -> argparse.ArgumentParser:
    """The flags every recipe shares (transformers' `no_trainer` names); a recipe adds its own to the result."""
    if task not in TASKS:
        raise ValueError(f"task={task!r}: expected one of {list(TASKS)}.")
    parser = _OneLineParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.set_defaults(task=task)
    _add_data_flags(parser.add_argument_group("data"))
    _add_model_flags(parser.add_argument_group("model"))
    _add_training_flags(parser.add_argument_group("training"))
    _add_hub_flags(parser.add_argument_group("hub"))
    return parser


def _add_data_flags(data) -> None:
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


def _add_model_flags(model) -> None:
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


def _add_training_flags(train) -> None:
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


def _add_hub_flags(hub) -> None:
    hub.add_argument("--push_to_hub", action="store_true", help="upload the final folder (create_repo + upload_folder)")
    hub.add_argument("--hub_model_id", help="the repository to push to (default: the output_dir's name)")
    hub.add_argument("--hub_token", help="a Hub token (default: the logged-in one)")
    hub.add_argument("--hub_private_repo", action="store_true")


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
    _check_data_flags(args)
    _check_numbers(args)
    _check_context_parallel(args)
    _check_ranges(args)
    _check_combinations(args)
    _check_output_dir(args)
    return args


def _check_data_flags(args: argparse.Namespace) -> None:
    """--dataset_name or data files that exist, of a format `datasets` reads, both of one format."""
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


def _check_numbers(args: argparse.Namespace) -> None:
    """Counts, sizes and rates in their ranges."""
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


def _check_context_parallel(args: argparse.Namespace) -> None:
    """--context_parallel N > 1 only for the recipes that split sequences, and not over a stream."""
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


def _check_ranges(args: argparse.Namespace) -> None:
    """The remaining numbers: the validation share, warm-up, the shuffle buffer, the checkpoint interval."""
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


def _check_combinations(args: argparse.Namespace) -> None:
    """A checkpoint to resume from that is one, a model from one source, a tracker for --with_tracking."""
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


def _check_output_dir(args: argparse.Namespace) -> None:
    """An output folder with an earlier run's checkpoints is resumed or overwritten, never mixed with a new run."""
    checkpoints = Path(args.output_dir) / CHECKPOINTS_DIR
    if args.resume_from_checkpoint is None and not args.overwrite_output_dir and list_checkpoints(checkpoints):
        raise RecipeError(
            f"{checkpoints} holds checkpoints of an earlier run: pass --resume_from_checkpoint latest "
            f"to continue it, or --overwrite_output_dir to start over."
        )


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
        raise RecipeError(one_line(error)) from None
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
        raise RecipeError(f"cannot load the tokenizer {source!r}: {one_line(error)}") from None


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
        raise RecipeError(one_line(error)) from None
    if len(tokenizer) > model.get_input_embeddings().num_embeddings:
        model.resize_token_embeddings(len(tokenizer))
    if args.gradient_checkpointing:
        # transformers 5 renamed it; the old name warns that it goes away in v6
        getattr(model, "activation_checkpointing_enable", model.gradient_checkpointing_enable)()
    if args.context_parallel > 1:
        try:
            cp_lib.check_context_parallel(model)
        except ValueError as error:
            raise RecipeError(f"--context_parallel {args.context_parallel}: {one_line(error)}") from None
    return model


def is_longattn(model_or_config) -> bool:
    """Whether a model (or config) is one of longattn's own classes, not a stock family running its kinds."""
    config = getattr(model_or_config, "config", model_or_config)
    return getattr(config, "model_type", None) == LongAttnConfig.model_type
