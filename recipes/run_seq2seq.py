#!/usr/bin/env python
"""Encoder-decoder training on source/target pairs (e.g. long-document summarisation), evaluated with generation,
under `accelerate launch` or plain `python`.

The encoder holds the configured attention (`attention_type`, long inputs), the decoder causal self-attention
(`decoder_attention_type`, "full" by default) and dense cross-attention. Data: `source` and `target` columns
(`--source_column`, `--target_column`). Evaluation reports the loss, then generates for every validation example
(greedy, or `--num_beams`) and scores exact match and ROUGE-L F1 (longest common subsequence of words).

    longattn-data needles --output_dir data/generated/needles
    accelerate launch --config_file recipes/configs/cpu_2proc.yaml recipes/run_seq2seq.py \\
        --train_file data/generated/needles/train.jsonl --validation_file data/generated/needles/validation.jsonl \\
        --config_overrides "attention_type=sliding,sliding_window=16,hidden_size=64,num_hidden_layers=2" \\
        --max_target_length 16 --output_dir runs/needles
"""

from __future__ import annotations

from functools import partial

import torch
from transformers import AutoModelForSeq2SeqLM

import longattn  # noqa: F401  (registers the longattn Auto classes)
from longattn.train import training


def rouge_l(prediction: str, reference: str) -> float:
    """ROUGE-L F1 between two texts, on whitespace-separated words."""
    pred, ref = prediction.split(), reference.split()
    if not pred or not ref:
        return float(pred == ref)
    previous = [0] * (len(ref) + 1)
    for word in pred:  # longest common subsequence, one row at a time
        current = [0]
        for j, ref_word in enumerate(ref):
            current.append(previous[j] + 1 if word == ref_word else max(previous[j + 1], current[j]))
        previous = current
    lcs = previous[-1]
    if lcs == 0:
        return 0.0
    precision, recall = lcs / len(pred), lcs / len(ref)
    return 2 * precision * recall / (precision + recall)


def main(argv: list[str] | None = None) -> dict:
    args = training.parse_args(build_parser(), argv)
    if args.num_beams < 1 or args.max_target_length < 1:
        raise training.RecipeError("--num_beams and --max_target_length must be >= 1.")
    config = training.load_config(args, task="seq2seq")
    tokenizer = training.load_tokenizer(args, config)
    max_length = training.resolve_max_seq_length(args, config, tokenizer)
    max_target_length = training.resolve_max_seq_length(args, config, tokenizer, flag="max_target_length")
    accelerator = training.make_accelerator(args)

    raw = training.load_raw_datasets(args, {"source_column": args.source_column, "target_column": args.target_column})
    start_id = config.decoder_start_token_id
    with accelerator.main_process_first():
        processed = training.tokenize_splits(
            raw, partial(preprocess, args, tokenizer, start_id, max_length, max_target_length), args
        )

    model = training.load_model(args, config, tokenizer, AutoModelForSeq2SeqLM)
    pad_id = training.pad_token_id(tokenizer)
    collator = training.PadCollator(
        pad_token_id=pad_id,
        pad_to_multiple_of=training.length_multiple(model.config),
        labels_multiple=training.length_multiple(model.config, decoder=True),
        max_length=max_length if args.pad_to_max_length else None,
    )
    generation = dict(
        max_new_tokens=args.generation_max_length or max_target_length,
        num_beams=args.num_beams,
        do_sample=False,
        decoder_start_token_id=start_id,
        pad_token_id=pad_id,
        synced_gpus=training.shards_parameters(accelerator),  # sharded weights: every forward is collective
    )
    results = training.train(
        args,
        accelerator,
        model,
        processed["train"],
        processed["validation"],
        collator,
        evaluate=partial(evaluate, accelerator, tokenizer, generation),
    )
    training.finish(args, accelerator, model, tokenizer, results, task="seq2seq")
    return results


def build_parser():
    parser = training.recipe_parser(__doc__, task="seq2seq")
    parser.add_argument("--source_column", default="source")
    parser.add_argument("--target_column", default="target")
    parser.add_argument("--max_target_length", type=int, default=128, help="longest target in tokens")
    parser.add_argument(
        "--generation_max_length", type=int, help="most new tokens at evaluation (default: --max_target_length)"
    )
    parser.add_argument("--num_beams", type=int, default=1)
    return parser


def preprocess(args, tokenizer, start_id: int, max_length: int, max_target_length: int, examples):
    encoded = tokenizer(examples[args.source_column], truncation=True, max_length=max_length)
    labels = tokenizer(text_target=examples[args.target_column], truncation=True, max_length=max_target_length + 1)[
        "input_ids"
    ]
    # The decoder input starts with decoder_start_token_id; a tokenizer that also prepends it (the byte
    # tokenizer's <s>) would make the model learn to repeat it.
    labels = [ids[1:] if ids and ids[0] == start_id else ids[:max_target_length] for ids in labels]
    return {"input_ids": encoded["input_ids"], "labels": labels}


def evaluate(accelerator, tokenizer, generation: dict, model, dataloader) -> dict[str, float]:
    """Teacher-forced loss and token accuracy, and exact match and ROUGE-L of generated targets (`generation`: the
    keyword arguments of `generate`)."""
    rows, predictions, references = [], [], []
    generator = accelerator.unwrap_model(model)
    pad_id = generation["pad_token_id"]
    for batch in training.progress_bar(dataloader, accelerator, "eval (generate)"):
        logits = model(**batch).logits
        rows.append(accelerator.gather_for_metrics(training.token_stats(logits, batch["labels"])).cpu())
        generated = generator.generate(
            input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], **generation
        )
        generated = accelerator.pad_across_processes(generated, dim=1, pad_index=pad_id)
        labels = accelerator.pad_across_processes(batch["labels"], dim=1, pad_index=-100)
        generated, labels = accelerator.gather_for_metrics((generated, labels))
        labels = labels.masked_fill(labels == -100, pad_id)
        predictions += tokenizer.batch_decode(generated, skip_special_tokens=True)
        references += tokenizer.batch_decode(labels, skip_special_tokens=True)
    pairs = [(p.strip(), r.strip()) for p, r in zip(predictions, references)]
    metrics = training.summarize_token_stats(torch.cat(rows))
    metrics["token_accuracy"] = metrics.pop("accuracy")  # teacher-forced, next target token
    metrics["exact_match"] = sum(p == r for p, r in pairs) / max(len(pairs), 1)
    metrics["rougeL"] = sum(rouge_l(p, r) for p, r in pairs) / max(len(pairs), 1)
    return metrics


if __name__ == "__main__":
    training.run_recipe(main)
