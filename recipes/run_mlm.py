#!/usr/bin/env python
"""Masked-language-model pretraining of a longattn encoder, under `accelerate launch` or plain `python`.

Texts (`--text_column`, default `text`) are tokenized, concatenated and cut into `--max_seq_length` blocks (or kept one
per example with `--line_by_line`, or packed whole into rows with `--packing`, attention kept within each text); 15% of
the tokens are picked for prediction, BERT-style. The masks of a training batch are a function of its position in the
run (so a resumed run repeats them), those of an evaluation example a function of the example (so every evaluation,
with any number of processes, scores the same masks).

    longattn-data listops --output_dir data/generated/listops --min_length 100 --max_length 300
    accelerate launch --config_file recipes/configs/cpu_2proc.yaml recipes/run_mlm.py \\
        --train_file data/generated/listops/train.jsonl --validation_file data/generated/listops/validation.jsonl \\
        --config_overrides "attention_type=sliding,sliding_window=32,hidden_size=64,num_hidden_layers=2" \\
        --max_seq_length 512 --output_dir runs/mlm
"""

from __future__ import annotations

from functools import partial

import torch
from transformers import AutoModelForMaskedLM

import longattn  # noqa: F401  (registers the longattn Auto classes)
from longattn.train import training


def main(argv: list[str] | None = None) -> dict:
    args = training.parse_args(build_parser(), argv)
    training.check_packing(args)
    if not 0 < args.mlm_probability < 1:
        raise training.RecipeError(f"--mlm_probability {args.mlm_probability} must be in (0, 1).")
    config = training.load_config(args, task="mlm")
    tokenizer = training.load_tokenizer(args, config)
    if tokenizer.mask_token_id is None:
        raise training.RecipeError("the tokenizer has no mask token, which masked-LM training needs.")
    max_length = training.resolve_max_seq_length(args, config, tokenizer)
    accelerator = training.make_accelerator(args)

    raw = training.load_raw_datasets(args, {"text_column": args.text_column})
    with accelerator.main_process_first():
        processed = training.tokenize_splits(raw, partial(tokenize, args, tokenizer, max_length), args)
        processed = training.arrange_rows(processed, args, max_length)
    training.check_rows_exist(processed, max_length)
    eval_dataset = processed["validation"].add_column("example_index", list(range(len(processed["validation"]))))

    model = training.load_model(args, config, tokenizer, AutoModelForMaskedLM)
    collator = training.PadCollator(
        pad_token_id=training.pad_token_id(tokenizer),
        pad_to_multiple_of=training.length_multiple(model.config),
        max_length=max_length if args.pad_to_max_length else None,
    )
    special_ids = torch.tensor(sorted(set(tokenizer.all_special_ids)))
    masker = partial(mask, args, tokenizer, special_ids=special_ids, vocab_size=model.config.vocab_size)
    results = training.train(
        args,
        accelerator,
        model,
        processed["train"],
        eval_dataset,
        collator,
        evaluate=partial(evaluate, args, accelerator, masker),
        prepare_batch=partial(prepare_batch, masker),
    )
    training.finish(args, accelerator, model, tokenizer, results, task="mlm")
    return results


def build_parser():
    parser = training.recipe_parser(__doc__, task="mlm")
    parser.add_argument("--text_column", default="text")
    parser.add_argument("--mlm_probability", type=float, default=0.15)
    parser.add_argument(
        "--line_by_line", action="store_true", help="one example per text (truncated), instead of concatenated blocks"
    )
    parser.add_argument(
        "--packing",
        action="store_true",
        help="whole texts (truncated) joined into rows of --max_seq_length, attention kept within each text "
        "(position_ids restart per text): no padding, and no attention across texts",
    )
    parser.add_argument(
        "--global_first_token",
        action="store_true",
        help="make the first token of every row global (`global_attention_mask`), as Longformer's <s>; for models "
        "whose attention takes global tokens (the sliding kind)",
    )
    return parser


def tokenize(args, tokenizer, max_length: int, examples):
    if args.line_by_line or args.packing:
        encoded = tokenizer(examples[args.text_column], truncation=True, max_length=max_length)
    else:
        encoded = tokenizer(examples[args.text_column], verbose=False)
    return {"input_ids": encoded["input_ids"]}


def mask(args, tokenizer, batch, draws, *, special_ids: torch.Tensor, vocab_size: int):
    """MLM masking of `batch` from the uniform `draws` `[3, b, n]` (see `training.mask_tokens`)."""
    if args.global_first_token:
        batch["global_attention_mask"] = torch.zeros_like(batch["input_ids"])
        batch["global_attention_mask"][:, 0] = 1
    batch["input_ids"], batch["labels"] = training.mask_tokens(
        batch["input_ids"],
        batch["attention_mask"],
        draws=draws.to(batch["input_ids"].device),
        special_ids=special_ids.to(batch["input_ids"].device),
        mask_token_id=tokenizer.mask_token_id,
        vocab_size=vocab_size,
        probability=args.mlm_probability,
    )
    return batch


def prepare_batch(masker, batch, generator):
    return masker(batch, torch.rand((3, *batch["input_ids"].shape), generator=generator))


def evaluate(args, accelerator, masker, model, dataloader) -> dict[str, float]:
    rows = []
    for batch in training.progress_bar(dataloader, accelerator, "eval"):
        length = batch["input_ids"].shape[1]
        draws = torch.stack(
            [
                torch.rand((3, length), generator=training.batch_generator(args.seed, "eval", i))
                for i in batch.pop("example_index").tolist()
            ],
            dim=1,
        )  # [3, b, n]
        batch = masker(batch, draws)
        logits = model(**batch).logits
        rows.append(accelerator.gather_for_metrics(training.token_stats(logits, batch["labels"])).cpu())
    return training.summarize_token_stats(torch.cat(rows))


if __name__ == "__main__":
    training.run_recipe(main)
