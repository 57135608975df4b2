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

The parts live in modules of their own, each usable alone: `arguments` (flags, config, tokenizer, model), `launch`
(the Accelerator), `inputs` (data sets, packing, streaming glue), `checkpoints` (`TrainState`, atomic save, resume),
`loop` (`train`, one optimizer step top to bottom) and `results` (metrics, the Hub-ready folder); this module
gathers their public names, as the recipes use them (`training.load_model`, ...).

Importing this module has no side effect (no logging setup, no environment change); `accelerate` is only touched when
a recipe calls `make_accelerator`.
"""

from __future__ import annotations

from ..configuration_longattn import LongAttnConfig
from .arguments import (
    SCHEDULER_TYPES,
    TASKS,
    attention_types,
    is_longattn,
    length_multiple,
    load_config,
    load_model,
    load_tokenizer,
    parse_args,
    parse_config_overrides,
    recipe_parser,
    resolve_max_seq_length,
)
from .checkpoints import (
    CHECKPOINTS_DIR,
    STATE_FILE,
    TrainState,
    batch_generator,
    begin_run,
    list_checkpoints,
    peak_rss_mb,
    reset_peak_rss,
    resume,
    run_settings,
    save_checkpoint,
)
from .collators import DataCollatorWithGlobalAttention, PadCollator, mask_tokens, pad_token_id
from .inputs import (
    DATA_EXTENSIONS,
    arrange_rows,
    check_packing,
    check_rows_exist,
    describe_data,
    group_texts,
    load_raw_datasets,
    pack_documents,
    progress_bar,
    require_columns,
    tokenize_splits,
)
from .launch import (
    TqdmLoggingHandler,
    check_engine,
    configure_deepspeed,
    make_accelerator,
    requested_engine,
    shards_parameters,
)
from .loop import (
    accumulation_step,
    build_optimizer,
    count_loss_items,
    prepare_training,
    run_evaluation,
    train,
    train_epoch,
    train_step,
)
from .records import LOG_FILE, PATH_FLAGS, RecipeError, recorded_args, recorded_path, recorded_value, run_recipe
from .results import finish, summarize, summarize_token_stats, token_stats
from .streaming import is_empty

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
    "tokenize_splits",
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
    # also the names the tests and scripts read as `training.X`
    "LongAttnConfig",
    "TASKS",
    "SCHEDULER_TYPES",
    "DATA_EXTENSIONS",
    "PATH_FLAGS",
    "LOG_FILE",
    "STATE_FILE",
    "CHECKPOINTS_DIR",
    "TqdmLoggingHandler",
    "check_packing",
    "pack_documents",
    "peak_rss_mb",
    "reset_peak_rss",
    "recorded_value",
]
