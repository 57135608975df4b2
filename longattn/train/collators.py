"""Collators of the recipes (and of a `transformers.Trainer` run): padding to the attention's block multiple, global
tokens for stock models, and BERT's masking with randomness the caller owns.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from transformers import DataCollatorWithPadding


class PadCollator:
    """Pads `input_ids` / `attention_mask` to the longest in the batch rounded up to `pad_to_multiple_of`, or to
    `max_length` when given. Sequence `labels` are padded with -100: to the input length when `align_labels` (causal
    LM), else to their own longest rounded up to `labels_multiple`, with a `decoder_attention_mask` (seq2seq). Other
    per-token fields (`global_attention_mask`) are padded with 0; scalar fields become tensors.

    Args:
        pad_token_id: The padding id of the inputs.
        pad_to_multiple_of: The attention's block multiple (`length_multiple`).
        labels_multiple: The multiple for seq2seq `labels` (the decoder's).
        max_length: Pad the inputs to exactly this length (`--pad_to_max_length`).
        align_labels: Labels are per input token (causal LM).
    """

    def __init__(
        self,
        *,
        pad_token_id: int,
        pad_to_multiple_of: int = 1,
        labels_multiple: int = 1,
        max_length: int | None = None,
        align_labels: bool = False,
    ):
        self.pad_token_id = pad_token_id
        self.pad_to_multiple_of = pad_to_multiple_of
        self.labels_multiple = labels_multiple
        self.max_length = max_length
        self.align_labels = align_labels

    @staticmethod
    def _target_length(lengths: Iterable[int], multiple: int, fixed: int | None) -> int:
        if fixed is not None:
            return fixed
        longest = max(lengths)
        return -(-longest // multiple) * multiple

    def __call__(self, features: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        batch: dict[str, torch.Tensor] = {}
        length = self._target_length((len(f["input_ids"]) for f in features), self.pad_to_multiple_of, self.max_length)
        batch["input_ids"] = _pad([f["input_ids"] for f in features], length, self.pad_token_id)
        batch["attention_mask"] = _pad([[1] * len(f["input_ids"]) for f in features], length, 0)
        if "labels" in features[0]:
            labels = [f["labels"] for f in features]
            if isinstance(labels[0], list) and self.align_labels:
                batch["labels"] = _pad(labels, length, -100)
            elif isinstance(labels[0], list):
                label_length = self._target_length((len(x) for x in labels), self.labels_multiple, None)
                batch["labels"] = _pad(labels, label_length, -100)
                batch["decoder_attention_mask"] = _pad([[1] * len(x) for x in labels], label_length, 0)
            else:
                batch["labels"] = torch.tensor(labels)
        for key in features[0]:
            if key in batch or key in ("input_ids", "attention_mask", "labels", "token_type_ids"):
                continue
            values = [f[key] for f in features]
            # Per-token fields (global_attention_mask, ...) are padded with 0 like the attention mask.
            batch[key] = _pad(values, length, 0) if isinstance(values[0], list) else torch.tensor(values)
        return batch


class DataCollatorWithGlobalAttention(DataCollatorWithPadding):
    """transformers' `DataCollatorWithPadding` that also hands the model its global tokens: a ragged
    `global_attention_mask` of the features is padded with 0 (on the tokenizer's padding side), and with
    `global_first_token` a batch without one gets the first real token of each row as its global token.

    With `transformers.Trainer`, `global_first_token=True` is how global tokens reach the model under the default
    `remove_unused_columns=True`: Trainer drops every dataset column that `forward` does not name, and a stock
    model's `forward` takes `global_attention_mask` through `**kwargs` only. A per-example column needs
    `TrainingArguments(remove_unused_columns=False)` (and a dataset holding only model inputs).

        collator = DataCollatorWithGlobalAttention(tokenizer, global_first_token=True, pad_to_multiple_of=64)
        Trainer(model=model, args=args, train_dataset=data, data_collator=collator).train()

    Args (besides `DataCollatorWithPadding`'s):
        global_first_token: Make the first real token of each row global when the features have no
            `global_attention_mask` (Longformer's classification convention: `<s>` / `[CLS]` sees everything).
    """

    def __init__(self, tokenizer, *, global_first_token: bool = False, **kwargs: Any):
        super().__init__(tokenizer, **kwargs)
        self.global_first_token = global_first_token

    def __call__(self, features: list[dict[str, Any]]) -> dict[str, Any]:
        rows = [feature.get("global_attention_mask") for feature in features]
        features = [{k: v for k, v in feature.items() if k != "global_attention_mask"} for feature in features]
        batch = super().__call__(features)
        real = batch["attention_mask"].bool()  # [b, n]
        if any(row is not None for row in rows):
            if any(row is None for row in rows):
                raise ValueError("`global_attention_mask` is in some features of the batch but not in others.")
            lengths = real.sum(-1).tolist()
            padded = torch.zeros(real.shape, dtype=torch.long)  # [b, n]
            for i, row in enumerate(rows):
                row = torch.as_tensor(row, dtype=torch.long)[: lengths[i]]
                padded[i, real[i].nonzero()[: len(row), 0]] = row  # the real positions, whichever side pads
            batch["global_attention_mask"] = padded
        elif self.global_first_token:
            first = real.long().argmax(-1)  # [b]: the first real token (left padding included)
            batch["global_attention_mask"] = torch.nn.functional.one_hot(first, real.shape[1]) * real
        return batch


def _pad(rows: list[list[int]], length: int, value: int) -> torch.Tensor:
    out = torch.full((len(rows), length), value, dtype=torch.long)
    for i, row in enumerate(rows):
        row = row[:length]
        out[i, : len(row)] = torch.tensor(row, dtype=torch.long)
    return out


def pad_token_id(tokenizer) -> int:
    """The tokenizer's padding id, else its end-of-sequence id, else 0 (GPT-2-like tokenizers have no pad token)."""
    for value in (tokenizer.pad_token_id, tokenizer.eos_token_id):
        if value is not None:
            return value
    return 0


def mask_tokens(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    *,
    draws: torch.Tensor,
    special_ids: torch.Tensor,
    mask_token_id: int,
    vocab_size: int,
    probability: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """BERT's masking: each real, non-special token is picked with `probability`; a picked token becomes the mask
    token 80% of the time, a random token 10% (kept when the draw is a special id), itself 10%.

    Args:
        input_ids / attention_mask: `[b, n]`.
        draws: `[3, b, n]` uniform numbers in [0, 1) (pick, replacement kind, random id): the caller owns the
            randomness, so masks can be a function of the batch position (training) or of the example (evaluation).
        special_ids: 1-D tensor of ids never masked.
        mask_token_id / vocab_size / probability: As named.

    Returns:
        (masked input_ids `[b, n]`, labels `[b, n]` with -100 where nothing was picked). At least one token of the
        batch is picked, so the loss is always defined.
    """
    maskable = attention_mask.bool() & ~torch.isin(input_ids, special_ids)  # [b, n]
    picked = (draws[0] < probability) & maskable
    if not picked.any() and maskable.any():
        first = maskable.flatten().nonzero()[0]
        picked.view(-1)[first] = True
    labels = input_ids.masked_fill(~picked, -100)
    masked = input_ids.clone()
    masked[picked & (draws[1] < 0.8)] = mask_token_id
    random_ids = (draws[2] * vocab_size).long().clamp_max(vocab_size - 1)
    randomize = picked & (draws[1] >= 0.8) & (draws[1] < 0.9) & ~torch.isin(random_ids, special_ids)
    masked[randomize] = random_ids[randomize]
    return masked, labels


__all__ = ["PadCollator", "DataCollatorWithGlobalAttention", "pad_token_id", "mask_tokens"]
