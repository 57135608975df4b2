"""The contracts transformers' Trainer relies on: losses normalised by `num_items_in_batch` (gradient accumulation gives
the loss and the weights of one large batch), `shift_labels`, and the model-level `attention_mask` conventions.

Tiny models (hidden 32, 2 layers), two optimizer steps, plain SGD: unlike Adam, SGD's update is proportional to the
gradient, so a gradient scaled by the number of accumulation steps shows in the weights.
"""

from __future__ import annotations

import functools
import inspect

import kind_configs
import pytest
import torch
from transformers import Trainer

import longattn

VOCAB = 40
LENGTH = 12


tiny_config = functools.partial(kind_configs.tiny_config, vocab_size=VOCAB, max_position_embeddings=64)


def _examples(head: str, count: int = 16) -> list[dict]:
    """`count` examples whose numbers of labelled tokens differ, so a mean of per-batch means is not the mean."""
    generator = torch.Generator().manual_seed(0)
    examples = []
    for index in range(count):
        ids = torch.randint(4, VOCAB, (LENGTH,), generator=generator)
        labelled = 2 + index % (LENGTH - 3)  # 2 .. LENGTH - 2 labelled tokens
        if head == "classification":
            examples.append({"input_ids": ids, "labels": torch.tensor(index % 3)})
        elif head == "seq2seq":
            labels = torch.randint(4, VOCAB, (LENGTH // 2,), generator=generator)
            labels[labelled // 2 + 1 :] = -100
            examples.append({"input_ids": ids, "labels": labels})
        else:  # masked LM: labels on `labelled` positions; causal LM: the first `labelled` tokens
            labels = ids.clone()
            if head == "masked_lm":
                labels[torch.randperm(LENGTH, generator=generator)[labelled:]] = -100
            else:
                labels[labelled:] = -100
            examples.append({"input_ids": ids, "labels": labels})
    return examples


HEADS = {
    "masked_lm": longattn.LongAttnForMaskedLM,
    "causal_lm": longattn.LongAttnForCausalLM,
    "seq2seq": longattn.LongAttnForSeq2SeqLM,
    "classification": longattn.LongAttnForSequenceClassification,
}


# A penalty large enough to move the loss and the weights visibly.
KIND_FIELDS = {"adaptive_span": dict(adaptive_span_max=8, adaptive_span_ramp=4, adaptive_span_loss_coef=0.05)}


# Plain SGD steps: a constant rate of 0.5, no gradient clipping.
SGD = dict(learning_rate=0.5, optim="sgd", lr_scheduler_type="constant", max_grad_norm=0.0)


def _train(head: str, kind: str, tmp_path, *, batch_size: int, accumulation: int):
    torch.manual_seed(0)
    model = HEADS[head](tiny_config(kind, num_labels=3, **KIND_FIELDS.get(kind, {})))
    batches = dict(per_device_train_batch_size=batch_size, gradient_accumulation_steps=accumulation)
    args = kind_configs.trainer_arguments(
        tmp_path / f"{head}-{batch_size}x{accumulation}",
        eval_strategy="no",
        seed=0,
        disable_tqdm=True,
        **batches,
        **SGD,
    )
    trainer = Trainer(model=model, args=args, train_dataset=_examples(head))
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    return losses, {name: p.detach().clone() for name, p in model.named_parameters()}


@pytest.mark.parametrize(
    "head, kind",
    [
        ("masked_lm", "full"),
        ("causal_lm", "sliding"),
        ("seq2seq", "full"),
        ("classification", "full"),
        # adaptive span adds its L1 penalty (model.auxiliary_loss) once per step, also when accumulating
        ("masked_lm", "adaptive_span"),
    ],
)
def test_gradient_accumulation_equals_one_large_batch(head, kind, tmp_path):
    big_losses, big_weights = _train(head, kind, tmp_path, batch_size=8, accumulation=1)
    small_losses, small_weights = _train(head, kind, tmp_path, batch_size=2, accumulation=4)
    assert len(big_losses) == len(small_losses) == 2
    torch.testing.assert_close(torch.tensor(small_losses), torch.tensor(big_losses), rtol=1e-4, atol=1e-4)
    for name, weight in big_weights.items():
        torch.testing.assert_close(small_weights[name], weight, rtol=1e-4, atol=1e-5, msg=name)


def test_accumulation_across_devices_equals_one_large_batch():
    """What Trainer does on W processes with `average_tokens_across_devices` (its default): `num_items_in_batch` counts
    the labels of every device, each device's loss is multiplied by W and DDP averages the gradients. Two simulated
    devices of two micro-batches each give the gradient of the whole batch, adaptive span's penalty included."""
    config = tiny_config("adaptive_span", **KIND_FIELDS["adaptive_span"])
    examples = _examples("masked_lm", count=8)
    ids = torch.stack([e["input_ids"] for e in examples])
    labels = torch.stack([e["labels"] for e in examples])
    torch.manual_seed(0)
    model = longattn.LongAttnForMaskedLM(config)
    model(input_ids=ids, labels=labels).loss.backward()
    expected = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    world_size, num_items = 2, labels.ne(-100).sum()
    for rows in torch.arange(8).split(2):  # devices 0, 0, 1, 1: two micro-batches each
        loss = model(input_ids=ids[rows], labels=labels[rows], num_items_in_batch=num_items).loss
        (loss * world_size).backward()
    for name, p in model.named_parameters():
        if name in expected:
            torch.testing.assert_close(p.grad / world_size, expected[name], rtol=1e-4, atol=1e-6, msg=name)


def test_loss_is_a_share_of_num_items_in_batch():
    """`num_items_in_batch` (the labelled items of a whole optimizer step) divides the summed loss of a micro-batch."""
    torch.manual_seed(0)
    model = longattn.LongAttnForTokenClassification(tiny_config(num_labels=3)).eval()
    ids = torch.randint(4, VOCAB, (2, LENGTH))
    labels = torch.randint(0, 3, (2, LENGTH))
    labels[0, 5:] = -100
    mean = model(input_ids=ids, labels=labels).loss
    share = model(input_ids=ids, labels=labels, num_items_in_batch=torch.tensor(40)).loss
    labelled = int(labels.ne(-100).sum())
    torch.testing.assert_close(share, mean * labelled / 40)


INPUTS = ["input_ids", "attention_mask", "global_attention_mask", "inputs_embeds", "position_ids"]
FLAGS = ["output_hidden_states", "output_attentions", "return_dict"]
DECODER = ["decoder_input_ids", "decoder_attention_mask", "decoder_inputs_embeds", "encoder_outputs"]


@pytest.mark.parametrize(
    ("name", "parameters"),
    [
        ("LongAttnForMaskedLM", [*INPUTS, "labels", *FLAGS, "num_items_in_batch", "kwargs"]),
        ("LongAttnForSequenceClassification", [*INPUTS, "labels", *FLAGS, "num_items_in_batch", "kwargs"]),
        ("LongAttnForTokenClassification", [*INPUTS, "labels", *FLAGS, "num_items_in_batch", "kwargs"]),
        ("LongAttnForQuestionAnswering", [*INPUTS, "start_positions", "end_positions", *FLAGS, "kwargs"]),
        (
            "LongAttnForCausalLM",
            [*INPUTS, "past_key_values", "use_cache", "labels", *FLAGS]
            + ["logits_to_keep", "shift_labels", "num_items_in_batch", "cache", "kwargs"],
        ),
        (
            "LongAttnForSeq2SeqLM",
            [*INPUTS[:4], *DECODER, "past_key_values", "use_cache", "labels", *FLAGS, "num_items_in_batch", "cache"]
            + ["kwargs"],
        ),
    ],
)
def test_head_forward_signatures_keep_the_names_trainer_and_generate_read(name, parameters):
    """Trainer keeps the dataset columns the forward names (`remove_unused_columns`) and passes `num_items_in_batch`
    when it is one; generate routes model keywords by them. The heads share one body, so their explicit signatures
    (in this order, positional callers included) are what keeps these contracts."""
    signature = inspect.signature(getattr(longattn, name).forward)
    assert list(signature.parameters)[1:] == parameters


def test_question_answering_leaves_normalisation_to_the_trainer():
    """Its mean of start and end losses cannot be split by `num_items_in_batch` (its batches have no `labels`)."""
    assert longattn.LongAttnForQuestionAnswering.accepts_loss_kwargs is False


def test_causal_lm_honours_shift_labels():
    torch.manual_seed(0)
    model = longattn.LongAttnForCausalLM(tiny_config()).eval()
    ids = torch.randint(4, VOCAB, (2, LENGTH))
    shift_labels = torch.randint(4, VOCAB, (2, LENGTH))  # targets of every position, already aligned
    shift_labels[1, 7:] = -100
    with torch.no_grad():
        out = model(input_ids=ids, labels=ids, shift_labels=shift_labels)
    expected = torch.nn.functional.cross_entropy(out.logits.reshape(-1, VOCAB), shift_labels.reshape(-1))
    torch.testing.assert_close(out.loss, expected)
    with torch.no_grad():  # the labels alone keep their meaning (shifted inside)
        default = model(input_ids=ids, labels=ids).loss
    torch.testing.assert_close(
        default, torch.nn.functional.cross_entropy(out.logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
    )


# ---------------------------------------------------------------------------------------------- attention_mask
MASK_KINDS = {
    "full": {},
    "sliding": dict(sliding_window=3, sliding_dilation=[1, 2]),
    "strided": dict(strided_stride=4),
    "lsh": dict(lsh_bucket_size=4, lsh_num_buckets=4, lsh_seed=0),
}


def _padded_batch() -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(4, VOCAB, (2, 20), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, 20, dtype=torch.long)
    mask[1, 13:] = 0
    return ids, mask


@pytest.mark.parametrize("kind", sorted(MASK_KINDS))
def test_float_attention_mask_keeps_its_transformers_meaning(kind):
    """A float 1.0 / 0.0 mask means token / padding, as a long or bool one (transformers' convention)."""
    torch.manual_seed(0)
    model = longattn.LongAttnModel(tiny_config(kind, **MASK_KINDS[kind])).eval()
    ids, mask = _padded_batch()
    with torch.no_grad():
        expected = model(input_ids=ids, attention_mask=mask).last_hidden_state
        for other in (mask.bool(), mask.float(), mask.half()):
            torch.testing.assert_close(model(input_ids=ids, attention_mask=other).last_hidden_state, expected)


def test_additive_float_attention_mask_is_refused():
    """0 keep / -inf drop (SDPA's float convention) would be read the other way round: refused, not inverted."""
    model = longattn.LongAttnModel(tiny_config()).eval()
    ids, mask = _padded_batch()
    additive = torch.zeros(mask.shape).masked_fill(mask == 0, float("-inf"))
    with pytest.raises(ValueError, match="attention_mask.*float mask with values other than 0 and 1"):
        model(input_ids=ids, attention_mask=additive)


@pytest.mark.parametrize("kind", sorted(MASK_KINDS))
def test_4d_attention_mask_is_refused(kind):
    """Which keys a query sees is the kind's pattern; a 4-D mask cannot express it (nor, for `full`, causality and
    positions, which the model derives from the 2-D padding mask): refused with a ValueError for every kind."""
    model = longattn.LongAttnModel(tiny_config(kind, **MASK_KINDS[kind])).eval()
    ids, mask = _padded_batch()
    four_d = mask.bool()[:, None, None, :].expand(2, 1, 20, 20)
    with pytest.raises(ValueError, match="attention_mask.*4-D mask is not supported"):
        model(input_ids=ids, attention_mask=four_d)
