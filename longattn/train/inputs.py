"""The recipes' data: loading (files, a Hub dataset, a stream), column and label checks, packing and blocks, and the
line the model card gives the data."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from . import streaming
from .records import RecipeError, one_line
from .streaming import is_empty

DATA_EXTENSIONS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".txt": "text"}


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
        raise RecipeError(f"cannot load the data: {one_line(error)}") from None
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
        raise RecipeError(f"cannot load the data: {one_line(error)}") from None
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


def tokenize_splits(raw, tokenize: Callable[[dict[str, list]], dict[str, list]], args: argparse.Namespace):
    """`tokenize` mapped over every split in batches, its columns in place of the raw ones; run it under
    `accelerator.main_process_first()` (the map's cache)."""
    return raw.map(
        tokenize,
        batched=True,
        remove_columns=raw["train"].column_names,
        num_proc=args.preprocessing_num_workers,
        desc="tokenize",
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
