#!/usr/bin/env python
"""Long-document sequence classification with any longattn attention, under `accelerate launch` or plain `python`.

The first token (`<s>` with the byte tokenizer) is a global token by default, as in Longformer: it sees the whole
document and the whole document sees it, whatever the attention of the other tokens (`--global_attention none` turns
that off); a lengthened stock checkpoint (`longattn-lengthen`, e.g. RoBERTa) gets the same first global token through
its `global_attention_mask`. Data: `text` and `label` columns (`--text_column`, `--label_column`); integer or string
labels are classes;
numbers such as 1.5 are a regression, with `--problem_type regression` (without it they stop the run with an error).
The classes are those of the training data, sorted, or the list `--label_names` gives (required with `--streaming`,
which cannot read the whole training data first).

    longattn-data needle --output_dir data/generated/needle
    accelerate launch --config_file recipes/configs/cpu_2proc.yaml recipes/run_classification.py \\
        --train_file data/generated/needle/train.jsonl --validation_file data/generated/needle/validation.jsonl \\
        --config_overrides "attention_type=sliding,sliding_window=16,hidden_size=64,num_hidden_layers=2" \\
        --output_dir runs/needle
"""

from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F
from transformers import AutoModelForSequenceClassification

import longattn  # noqa: F401  (registers the longattn Auto classes)
from longattn.train import training


def main(argv: list[str] | None = None) -> dict:
    args = training.parse_args(build_parser(), argv)
    if args.packing:
        raise training.RecipeError(
            "--packing is not supported for classification: the model pools one label per row from its first "
            "token, so packed texts would share a label; texts are padded per batch instead (one text per row)."
        )
    check_label_names(args)
    config = training.load_config(args, task="classification")
    tokenizer = training.load_tokenizer(args, config)
    max_length = training.resolve_max_seq_length(args, config, tokenizer)
    accelerator = training.make_accelerator(args)

    columns = {"text_column": args.text_column, "label_column": args.label_column}
    if args.text_pair_column:
        columns["text_pair_column"] = args.text_pair_column
    raw = training.load_raw_datasets(args, columns)  # labels checked: one kind, numbers only for a regression
    label_to_id = set_labels(args, config, raw)
    stock = not training.is_longattn(config)  # a lengthened BERT / RoBERTa / ... (--model_name_or_path)
    with accelerator.main_process_first():
        processed = training.tokenize_splits(
            raw, partial(preprocess, args, tokenizer, max_length, label_to_id, stock=stock), args
        )

    model = training.load_model(args, config, tokenizer, AutoModelForSequenceClassification)
    collator = training.PadCollator(
        pad_token_id=training.pad_token_id(tokenizer),
        pad_to_multiple_of=training.length_multiple(model.config),
        max_length=max_length if args.pad_to_max_length else None,
    )
    results = training.train(
        args,
        accelerator,
        model,
        processed["train"],
        processed["validation"],
        collator,
        evaluate=partial(evaluate, accelerator, is_regression=label_to_id is None),
    )
    training.finish(args, accelerator, model, tokenizer, results, task="classification")
    return results


def build_parser():
    parser = training.recipe_parser(__doc__, task="classification")
    parser.add_argument("--text_column", default="text")
    parser.add_argument("--text_pair_column", help="a second text, encoded as a pair (e.g. question + document)")
    parser.add_argument("--label_column", default="label")
    parser.add_argument(
        "--global_attention",
        choices=("first", "none"),
        default="first",
        help="global attention on the first token (default) or on no token",
    )
    parser.add_argument(
        "--problem_type",
        choices=("single_label_classification", "regression"),
        default="single_label_classification",
        help="regression: one output trained with MSE on numeric labels (a label such as 1.5 is refused without it)",
    )
    parser.add_argument(
        "--label_names",
        type=lambda text: [name.strip() for name in text.split(",")],
        help="the classes, comma-separated, in the order of the model's outputs (e.g. 'negative,positive' or "
        "'0,1,2'); default: the labels of the training data, sorted; required with --streaming",
    )
    parser.add_argument("--packing", action="store_true", help="not supported here: one label per row (see the error)")
    return parser


def set_labels(args, config, raw) -> dict[str, int] | None:
    """The config's problem type and classes; returns `{label text: class id}`, or None for a regression.

    Raises:
        RecipeError: a validation label (or, with --label_names, a training label) that is not a class.
    """
    is_regression = args.problem_type == "regression"
    config.problem_type = "regression" if is_regression else None  # None: the head infers it from the labels
    if is_regression:
        config.num_labels = 1
        return None
    # Labels are looked up by their text, so that `--label_names 0,1` names the integer labels 0 and 1.
    label_list = args.label_names or [str(label) for label in sorted(raw["train"].unique(args.label_column))]
    splits = ("validation",) if args.streaming or not args.label_names else ("train", "validation")
    for split in splits:  # a stream's labels are checked as they are read (`label_id`)
        unseen = sorted({str(label) for label in raw[split].unique(args.label_column)} - set(label_list))
        if unseen:
            where = "in --label_names" if args.label_names else "in the training data"
            raise training.RecipeError(f"{split} labels {unseen[:5]} are not {where} {label_list[:10]}.")
    label_to_id = {label: i for i, label in enumerate(label_list)}
    config.num_labels = len(label_list)
    config.label2id = dict(label_to_id)
    config.id2label = {i: label for label, i in label_to_id.items()}
    return label_to_id


def label_id(args, label_to_id: dict[str, int], label) -> int:
    if str(label) not in label_to_id:  # a label of a streamed training set, met while training
        raise training.RecipeError(
            f"label {label!r} of column {args.label_column!r} is not in --label_names {list(label_to_id)[:10]}."
        )
    return label_to_id[str(label)]


def preprocess(args, tokenizer, max_length: int, label_to_id: dict[str, int] | None, examples, *, stock: bool):
    texts = (examples[args.text_column],)
    if args.text_pair_column:
        texts += (examples[args.text_pair_column],)
    encoded = tokenizer(*texts, truncation=True, max_length=max_length)
    labels = examples[args.label_column]
    if label_to_id is None:  # a regression
        encoded["labels"] = [float(x) for x in labels]
    else:
        encoded["labels"] = [label_id(args, label_to_id, x) for x in labels]
    if args.global_attention == "none":
        encoded["global_attention_mask"] = [[0] * len(ids) for ids in encoded["input_ids"]]
    elif stock:  # a stock model's forward has no global default: the mask names the first token
        encoded["global_attention_mask"] = [[1] + [0] * (len(ids) - 1) for ids in encoded["input_ids"]]
    encoded.pop("token_type_ids", None)
    return encoded


def evaluate(accelerator, model, dataloader, *, is_regression: bool) -> dict[str, float]:
    losses, hits = [], []
    for batch in training.progress_bar(dataloader, accelerator, "eval"):
        logits = model(**batch).logits.float()
        if is_regression:
            loss = F.mse_loss(logits.squeeze(-1), batch["labels"].float(), reduction="none")
            hit = torch.zeros_like(loss)
        else:
            loss = F.cross_entropy(logits, batch["labels"], reduction="none")
            hit = (logits.argmax(-1) == batch["labels"]).float()
        loss, hit = accelerator.gather_for_metrics((loss, hit))
        losses.append(loss.cpu())
        hits.append(hit.cpu())
    metrics = {"loss": torch.cat(losses).mean().item()}
    if not is_regression:
        metrics["accuracy"] = torch.cat(hits).mean().item()
    return metrics


def check_label_names(args) -> None:
    """--label_names: distinct, non-empty names, for classes only; required with --streaming (a stream cannot be
    scanned for its labels before training)."""
    if args.label_names is None:
        if args.streaming and args.problem_type != "regression":
            raise training.RecipeError(
                "--streaming needs --label_names (e.g. --label_names negative,positive): the classes cannot be "
                "read from a stream before training."
            )
        return
    if args.problem_type == "regression":
        raise training.RecipeError("--label_names names classes; a regression (--problem_type regression) has none.")
    if "" in args.label_names or len(set(args.label_names)) != len(args.label_names):
        raise training.RecipeError(
            f"--label_names {','.join(args.label_names)!r}: expected distinct, non-empty names separated by commas."
        )


if __name__ == "__main__":
    training.run_recipe(main)
