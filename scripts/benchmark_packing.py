#!/usr/bin/env python
"""Real (non-pad) tokens per CPU-second of masked-LM training steps: `--packing` rows against `--line_by_line` padding
(random order, and grouped by length), at the same rows of `--max_seq_length` per batch.

Documents are random token ids with lengths log-uniform from 64 to `--max_seq_length` (a length-skewed corpus). Each
layout is batched exactly as the recipes batch it (`training.pack_documents`, `training.PadCollator` padding to the
longest row rounded up to the attention's block multiple; length grouping sorts mega-batches of 50 batches by length,
as transformers' `LengthGroupedSampler` does). Every step is a forward, backward and AdamW step of
`LongAttnForMaskedLM` with BERT masking. Time is the process CPU time on one thread (`torch.set_num_threads(1)`), so
other processes on a shared machine do not enter it.

    python scripts/benchmark_packing.py --max_seq_length 1024 --batch_size 8 --steps 6
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time

import torch

from longattn import LongAttnConfig, LongAttnForMaskedLM
from longattn.train import training

MASK_ID, SPECIAL = 3, torch.tensor([0, 1, 2, 3])


def documents(count: int, max_length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    lengths = [round(math.exp(rng.uniform(math.log(64), math.log(max_length)))) for _ in range(count)]
    return [[rng.randrange(4, vocab) for _ in range(n)] for n in lengths]


def batches(layout: str, docs: list[list[int]], *, batch_size: int, max_length: int, multiple: int, seed: int):
    """Batches of `layout` ("padded", "grouped", "packed", or "packed_across": the packed rows without
    `position_ids`, attention running across documents, to isolate the cost of the document predicate) as the
    recipes' collator builds them."""
    rng = random.Random(seed)
    collator = training.PadCollator(pad_token_id=0, pad_to_multiple_of=multiple)
    if layout.startswith("packed"):
        packed = training.pack_documents({"input_ids": docs}, block_size=max_length)
        rows = [
            {"input_ids": ids, "position_ids": pos} for ids, pos in zip(packed["input_ids"], packed["position_ids"])
        ]
        if layout == "packed_across":
            rows = [{"input_ids": row["input_ids"]} for row in rows]
        rng.shuffle(rows)
    else:
        rows = [{"input_ids": ids} for ids in docs]
        rng.shuffle(rows)
        if layout == "grouped":
            mega = 50 * batch_size
            rows = [
                r
                for i in range(0, len(rows), mega)
                for r in sorted(rows[i : i + mega], key=lambda r: -len(r["input_ids"]))
            ]
    out = [collator(rows[i : i + batch_size]) for i in range(0, len(rows) - batch_size + 1, batch_size)]
    if layout == "grouped":
        rng.shuffle(out)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        allow_abbrev=False, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--max_seq_length", type=int, default=1024)
    parser.add_argument("--batch_size", type=int, default=8)
    parser.add_argument("--steps", type=int, default=6, help="timed steps per layout (after one warm-up step)")
    parser.add_argument("--documents", type=int, default=400)
    parser.add_argument("--window", type=int, default=64)
    parser.add_argument("--hidden_size", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    config = LongAttnConfig(
        vocab_size=512,
        hidden_size=args.hidden_size,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=4 * args.hidden_size,
        max_position_embeddings=args.max_seq_length,
        attention_type="sliding",
        sliding_window=args.window,
    )
    docs = documents(args.documents, args.max_seq_length, config.vocab_size, args.seed)
    results = {}
    for layout in ("padded", "grouped", "packed", "packed_across"):
        torch.manual_seed(args.seed)
        model = LongAttnForMaskedLM(config).train()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        data = batches(
            layout, docs, batch_size=args.batch_size, max_length=args.max_seq_length, multiple=1, seed=args.seed
        )
        real = slots = 0
        cpu = 0.0
        for step, batch in enumerate(data[: args.steps + 1]):
            generator = torch.Generator().manual_seed(step)
            draws = torch.rand((3, *batch["input_ids"].shape), generator=generator)
            batch["input_ids"], batch["labels"] = training.mask_tokens(
                batch["input_ids"],
                batch["attention_mask"],
                draws=draws,
                special_ids=SPECIAL,
                mask_token_id=MASK_ID,
                vocab_size=config.vocab_size,
                probability=0.15,
            )
            start = time.process_time()
            model(**batch).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            if step:  # the first step warms up
                cpu += time.process_time() - start
                real += int(batch["attention_mask"].sum())
                slots += batch["input_ids"].numel()
        results[layout] = {
            "real_tokens_per_cpu_s": real / cpu,
            "real_fraction": real / slots,
            "cpu_s": cpu,
            "real_tokens": real,
        }
    for layout in ("padded", "grouped", "packed_across"):
        results[f"packed_vs_{layout}"] = (
            results["packed"]["real_tokens_per_cpu_s"] / results[layout]["real_tokens_per_cpu_s"]
        )
    print(json.dumps({"args": vars(args), "results": results}, indent=2))


if __name__ == "__main__":
    main()
