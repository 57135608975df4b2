"""The task heads' own layers and losses: the masked-LM and sentence-classification heads, the token and
classification losses, and the attention kinds' auxiliary loss added to a task loss.

Shape legend: b batch, n length, D hidden size, V vocab.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers.activations import ACT2FN
from transformers.loss.loss_utils import ForMaskedLMLoss, fixed_cross_entropy

from .configuration_longattn import LongAttnConfig
from .modeling_inputs import _check_labels


def _with_auxiliary_loss(
    loss: torch.Tensor | None,
    model: Any,
    *,
    labels: torch.Tensor | None = None,
    num_items_in_batch: torch.Tensor | int | None = None,
) -> torch.Tensor | None:
    """Add the attention kinds' auxiliary losses (`model.auxiliary_loss()`, e.g. a `LongAttnModel`'s) to a task loss
    (only when there is a task loss).

    With `num_items_in_batch` (transformers' Trainer: the labelled items of every micro-batch of one optimizer step,
    on every device with `average_tokens_across_devices`) the task loss is this micro-batch's share of the step's
    loss, and the auxiliary loss gets the same share, `labels`' labelled items / `num_items_in_batch`. The shares of
    one step add up to one, so accumulating micro-batches adds the auxiliary loss once, as one large batch does.
    """
    extra = model.auxiliary_loss()
    if loss is None or extra is None:
        return loss
    if num_items_in_batch is not None:
        extra = extra * (labels.ne(-100).sum().to(extra.device) / num_items_in_batch)
    return loss + extra.to(loss.dtype)


class LongAttnLMHead(nn.Module):
    """dense -> activation -> LayerNorm -> vocabulary projection (tied to the token embeddings)."""

    def __init__(self, config: LongAttnConfig):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.act = ACT2FN[config.hidden_act]
        self.layer_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.decoder = nn.Linear(config.hidden_size, config.vocab_size)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.decoder(self.layer_norm(self.act(self.dense(hidden_states))))


def _masked_lm_loss(
    logits: torch.Tensor,
    labels: torch.Tensor | None,
    vocab_size: int,
    *,
    num_items_in_batch: torch.Tensor | int | None = None,
) -> torch.Tensor | None:
    """Token cross-entropy of `logits` `[b, n, V]` against `labels` `[b, n]` (-100 ignored, checked); None without
    labels."""
    _check_labels("labels", labels, [logits.shape[:2]], classes=vocab_size, what="vocab_size")
    if labels is None:
        return None
    return ForMaskedLMLoss(logits, labels.contiguous(), vocab_size, num_items_in_batch=num_items_in_batch)


def _classifier_dropout(config: LongAttnConfig) -> float:
    return config.classifier_dropout if config.classifier_dropout is not None else config.hidden_dropout_prob


class LongAttnClassificationHead(nn.Module):
    """RoBERTa's sentence head, `[b, D] -> [b, num_labels]`: dropout, dense, tanh, dropout, projection to the labels."""

    def __init__(self, config: LongAttnConfig):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.dropout = nn.Dropout(_classifier_dropout(config))
        self.out_proj = nn.Linear(config.hidden_size, config.num_labels)

    def forward(self, pooled: torch.Tensor) -> torch.Tensor:
        return self.out_proj(self.dropout(torch.tanh(self.dense(self.dropout(pooled)))))


def _mean_over_tokens(hidden_states: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
    """`[b, n, D]` -> `[b, D]`: the mean over the real tokens (`attention_mask` `[b, n]`, 1 = token), so that padding
    does not change a sequence's pooled state."""
    if attention_mask is None:
        return hidden_states.mean(dim=1)
    weights = attention_mask.to(hidden_states.dtype).unsqueeze(-1)  # [b, n, 1]
    return (hidden_states * weights).sum(dim=1) / weights.sum(dim=1).clamp_min(1.0)


def _classification_loss(
    config: LongAttnConfig,
    logits: torch.Tensor,
    labels: torch.Tensor | None,
    *,
    num_items_in_batch: torch.Tensor | int | None = None,
) -> torch.Tensor | None:
    """transformers' problem types: regression (1 label), single-label (int labels), multi-label (float labels).

    The mean over labels, or with `num_items_in_batch` (transformers' Trainer, which counts the items of `labels`
    that are not -100: one per example, one per example and label for multi-label and multi-output regression) the
    sum over them divided by it, so that accumulated micro-batches give the loss of one large batch.
    """
    if labels is None:
        return None
    labels = labels.to(logits.device)
    if config.problem_type is None:
        if config.num_labels == 1:
            config.problem_type = "regression"
        elif labels.dtype in (torch.long, torch.int):
            config.problem_type = "single_label_classification"
        else:
            config.problem_type = "multi_label_classification"
    batch, num_labels = logits.shape
    if config.problem_type == "single_label_classification":
        _check_labels("labels", labels, [(batch,), (batch, 1)], classes=num_labels)
    elif config.problem_type == "regression":
        _check_labels("labels", labels, [(batch, num_labels)] + ([(batch,)] if num_labels == 1 else []), integer=False)
    else:
        _check_labels("labels", labels, [(batch, num_labels)], integer=False)
    if config.problem_type == "single_label_classification":
        return fixed_cross_entropy(logits.view(-1, config.num_labels).float(), labels.view(-1), num_items_in_batch)
    reduction = "mean" if num_items_in_batch is None else "sum"
    if config.problem_type == "regression":
        loss = F.mse_loss(logits.float().view(labels.shape), labels.float(), reduction=reduction)
    else:
        loss = F.binary_cross_entropy_with_logits(logits.float(), labels.float(), reduction=reduction)
    return loss if num_items_in_batch is None else loss / num_items_in_batch
