#!/usr/bin/env python
"""Causal-language-model training of a longattn decoder, under `accelerate launch` or plain `python`.

Texts (`--text_column`, default `text`) are tokenized, each ended with the end-of-text token, concatenated and cut
into `--max_seq_length` blocks (or kept one per example with `--line_by_line`, or packed whole into rows with
`--packing`, attention kept within each text); the model predicts every next token
(causal attention of the configured kind). The tokenizer saved with the model adds no end-of-text token, so a prompt
given to `generate()` is continued rather than ended.
Evaluation reports loss, perplexity and next-token accuracy.

    longattn-data listops --output_dir data/generated/listops --min_length 100 --max_length 300
    accelerate launch --config_file recipes/configs/cpu_2proc.yaml recipes/run_clm.py \\
        --train_file data/generated/listops/train.jsonl --validation_file data/generated/listops/validation.jsonl \\
        --config_overrides "attention_type=sliding,sliding_window=32,hidden_size=64,num_hidden_layers=2" \\
        --max_seq_length 512 --output_dir runs/clm
"""

from __future__ import annotations

from functools import partial

import torch
from transformers import AutoModelForCausalLM

import longattn  # noqa: F401  (registers the longattn Auto classes)
from longattn.train import training


def tokenize_texts(tokenizer, texts: list[str], *, max_length: int | None = None) -> list[list[int]]:
    """Token ids of each text ended with the tokenizer's end-of-text id (the model learns where a text ends; the
    tokenizer itself does not append it, see the module docstring), truncated to `max_length` with the end kept."""
    eos = tokenizer.eos_token_id
    limit = None if max_length is None else max_length - (eos is not None)
    encoded = tokenizer(texts, truncation=limit is not None, max_length=limit, verbose=False)["input_ids"]
    if eos is None:
        return [list(ids) for ids in encoded]
    return [list(ids) if ids and ids[-1] == eos else [*ids, eos] for ids in encoded]


def main(argv: list[str] | None = None) -> dict:
    args = training.parse_args(build_parser(), argv)
    training.check_packing(args)
    config = training.load_config(args, task="clm")
    tokenizer = training.load_tokenizer(args, config)
    max_length = training.resolve_max_seq_length(args, config, tokenizer)
    accelerator = training.make_accelerator(args)

    raw = training.load_raw_datasets(args, {"text_column": args.text_column})
    with accelerator.main_process_first():
        processed = training.tokenize_splits(raw, partial(tokenize, args, tokenizer, max_length), args)
        processed = training.arrange_rows(processed, args, max_length)
    training.check_rows_exist(processed, max_length)

    model = training.load_model(args, config, tokenizer, AutoModelForCausalLM)
    collator = training.PadCollator(
        pad_token_id=training.pad_token_id(tokenizer),
        pad_to_multiple_of=training.length_multiple(model.config),
        max_length=max_length if args.pad_to_max_length else None,
        align_labels=True,
    )
    results = training.train(
        args,
        accelerator,
        model,
        processed["train"],
        processed["validation"],
        collator,
        evaluate=partial(evaluate, accelerator),
    )
    training.finish(args, accelerator, model, tokenizer, results, task="clm")
    return results


def build_parser():
    parser = training.recipe_parser(__doc__, task="clm")
    parser.add_argument("--text_column", default="text")
    parser.add_argument(
        "--line_by_line", action="store_true", help="one example per text (truncated), instead of concatenated blocks"
    )
    parser.add_argument(
        "--packing",
        action="store_true",
        help="whole texts (truncated) joined into rows of --max_seq_length, attention kept within each text "
        "(position_ids restart per text): no padding, and no attention across texts",
    )
    return parser


def tokenize(args, tokenizer, max_length: int, examples):
    ids = tokenize_texts(
        tokenizer,
        examples[args.text_column],
        max_length=max_length if args.line_by_line or args.packing else None,
    )
    return {"input_ids": ids, "labels": [list(row) for row in ids]}


def evaluate(accelerator, model, dataloader) -> dict[str, float]:
    rows = []
    for batch in training.progress_bar(dataloader, accelerator, "eval"):
        logits = model(**batch).logits
        stats = training.token_stats(logits[:, :-1], batch["labels"][:, 1:])  # position t predicts t + 1
        rows.append(accelerator.gather_for_metrics(stats).cpu())
    return training.summarize_token_stats(torch.cat(rows))


if __name__ == "__main__":
    training.run_recipe(main)
