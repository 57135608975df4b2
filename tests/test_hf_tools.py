"""longattn models with transformers' pipelines and with PEFT, as a transformers model behaves with them.

Pipelines (fill-mask, text-classification, token-classification, feature-extraction, text-generation) run on tiny
models with the byte tokenizer, built in code or loaded from a saved folder through the Auto classes; each result is
checked against the model's own forward. PEFT's LoRA trains only its adapters and, for sequence classification, the
`classifier` head (PEFT's default for that task, as for BERT or RoBERTa); the adapter saves and reloads onto a fresh
base, and merging gives the same outputs. Also on a stock model whose attention longattn replaced.
"""

from __future__ import annotations

import pytest
import torch
from datasets import Dataset
from kind_configs import tiny_config
from peft import LoraConfig, PeftModel, TaskType, get_peft_model
from safetensors.torch import load_file, save_file
from test_integration_transformers import build
from transformers import (
    AutoModelForSequenceClassification,
    RobertaConfig,
    RobertaForSequenceClassification,
    Trainer,
    TrainingArguments,
    pipeline,
)

import longattn
from longattn import apply_longattn, lengthen, save_lengthened
from longattn.tokenization_longattn import byte_tokenizer
from longattn.train.collators import DataCollatorWithGlobalAttention

LABELS = {0: "negative", 1: "neutral", 2: "positive"}
TEXTS = ["a long document about nothing in particular", "short one", "a third text, of middling length"]


def _config(**fields) -> longattn.LongAttnConfig:
    """The tiny config (tests/kind_configs.py) with the byte tokenizer's vocabulary and three named labels."""
    labels = dict(id2label=LABELS, label2id={v: k for k, v in LABELS.items()})
    return tiny_config(**{"attention_type": "sliding", "sliding_window": 4, "vocab_size": 260, **labels, **fields})


def _model(model_class, seed: int = 0, **fields):
    torch.manual_seed(seed)
    return model_class(_config(**fields)).eval()


# ---------------------------------------------------------------------------------------------- pipelines
@torch.no_grad()  # the references are forward passes, as the pipeline's
def test_fill_mask_pipeline_scores_are_the_models_probabilities():
    tokenizer, model = byte_tokenizer(), _model(longattn.LongAttnForMaskedLM)
    text = f"abc{tokenizer.mask_token}def"
    results = pipeline("fill-mask", model=model, tokenizer=tokenizer, top_k=3)(text)
    encoded = tokenizer(text, return_tensors="pt")
    position = (encoded["input_ids"][0] == tokenizer.mask_token_id).nonzero().item()
    probabilities = model(**encoded).logits[0, position].softmax(-1)
    top = probabilities.topk(3)
    assert [r["token"] for r in results] == top.indices.tolist()
    assert [r["score"] for r in results] == pytest.approx(top.values.tolist(), rel=1e-5)


@torch.no_grad()  # the references are forward passes, as the pipeline's
def test_text_classification_pipeline_batches_padded_rows_like_single_ones(tmp_path):
    """Through the Auto classes from a saved folder; a batch of 3 (padded to the longest) gives the labels and
    scores of the texts one by one, which are the model's own."""
    tokenizer, model = byte_tokenizer(), _model(longattn.LongAttnForSequenceClassification, num_labels=3)
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    classify = pipeline("text-classification", model=str(tmp_path))
    assert type(classify.model) is longattn.LongAttnForSequenceClassification
    one_by_one = [classify(text)[0] for text in TEXTS]
    batched = classify(TEXTS, batch_size=3)
    for single, together, text in zip(one_by_one, batched, TEXTS, strict=True):
        assert single["label"] == together["label"]
        assert single["score"] == pytest.approx(together["score"], rel=1e-5)
        probabilities = model(**tokenizer(text, return_tensors="pt")).logits[0].softmax(-1)
        assert single["label"] == LABELS[int(probabilities.argmax())]
        assert single["score"] == pytest.approx(float(probabilities.max()), rel=1e-5)


@torch.no_grad()  # the references are forward passes, as the pipeline's
def test_token_classification_pipeline_labels_every_byte():
    tokenizer, model = byte_tokenizer(), _model(longattn.LongAttnForTokenClassification, num_labels=3)
    text = "tokens, one per byte"
    results = pipeline("token-classification", model=model, tokenizer=tokenizer)(text)
    logits = model(**tokenizer(text, return_tensors="pt")).logits[0, 1:-1]  # without <s> and </s>
    expected = [LABELS[int(i)] for i in logits.argmax(-1)]
    # The pipeline drops tokens labelled with the "O" class only when the label is "O": none here.
    assert [r["entity"] for r in results] == expected
    assert [text[r["start"] : r["end"]] for r in results] == list(text)


@torch.no_grad()  # the references are forward passes, as the pipeline's
def test_feature_extraction_pipeline_returns_the_last_hidden_state():
    tokenizer, model = byte_tokenizer(), _model(longattn.LongAttnModel)
    features = pipeline("feature-extraction", model=model, tokenizer=tokenizer, return_tensors=True)(TEXTS[0])
    expected = model(**tokenizer(TEXTS[0], return_tensors="pt")).last_hidden_state
    torch.testing.assert_close(features, expected)


def test_text_generation_pipeline_continues_as_generate_does():
    tokenizer = byte_tokenizer(add_eos_token=False, padding_side="left")
    model = _model(longattn.LongAttnForCausalLM, attention_type="sliding", sliding_window=6)
    generate = pipeline("text-generation", model=model, tokenizer=tokenizer)
    result = generate("the beginning", max_new_tokens=12, do_sample=False, return_full_text=False)[0]
    encoded = tokenizer("the beginning", return_tensors="pt")
    ids = model.generate(**encoded, max_new_tokens=12, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    assert result["generated_text"] == tokenizer.decode(
        ids[0, encoded["input_ids"].shape[1] :], skip_special_tokens=True
    )


# ---------------------------------------------------------------------------------------------- PEFT
def _trained(model, steps: int = 3, **batch):
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model.train()
    for _ in range(steps):
        model(**batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return model.eval()


def _classification_batch():
    tokenizer = byte_tokenizer()
    batch = dict(tokenizer(TEXTS, padding=True, return_tensors="pt"))
    return dict(batch, labels=torch.tensor([0, 1, 2]))


def test_lora_for_sequence_classification_trains_and_saves_the_classifier(tmp_path):
    """PEFT's SEQ_CLS task keeps the head named `classifier` trainable and saves it with the adapter: the pretrained
    backbone loaded again (its head drawn anew) with the adapter computes what the trained model computed, and so
    does the merged model."""
    _model(longattn.LongAttnModel).save_pretrained(tmp_path / "backbone")  # a pretrained model without the task's head
    torch.manual_seed(0)
    base = longattn.LongAttnForSequenceClassification.from_pretrained(tmp_path / "backbone")
    model = get_peft_model(base, LoraConfig(task_type=TaskType.SEQ_CLS, r=4, target_modules=["q_proj", "v_proj"]))
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    assert any("lora_A" in name for name in trainable)
    assert any(".classifier." in name and name.endswith("out_proj.weight") for name in trainable)
    assert not any("self_attn.q_proj.base_layer" in name or "embeddings" in name for name in trainable)
    batch = _classification_batch()
    untrained = model(**batch).logits.detach()
    _trained(model, **batch)
    logits = model(**batch).logits.detach()
    assert not torch.allclose(logits, untrained, atol=1e-4)

    model.save_pretrained(tmp_path / "adapter")
    torch.manual_seed(1)  # another head
    fresh = longattn.LongAttnForSequenceClassification.from_pretrained(tmp_path / "backbone")
    assert not torch.equal(fresh.classifier.out_proj.weight, model.base_model.model.classifier.out_proj.weight)
    reloaded = PeftModel.from_pretrained(fresh, tmp_path / "adapter").eval()
    torch.testing.assert_close(reloaded(**batch).logits, logits)
    merged = model.merge_and_unload()
    assert type(merged) is longattn.LongAttnForSequenceClassification
    torch.testing.assert_close(merged(**batch).logits, logits, atol=1e-5, rtol=1e-5)


def test_classifier_of_the_earlier_layout_loads_into_the_classifier_module(tmp_path):
    """A checkpoint with the sentence head at the top (`dense.*`, `out_proj.*`, before it became `classifier`)
    loads with no missing or unexpected key and the same outputs; saving writes the current names."""
    model = _model(longattn.LongAttnForSequenceClassification, num_labels=3)
    model.save_pretrained(tmp_path)
    weights = load_file(tmp_path / "model.safetensors")
    assert {"classifier.dense.weight", "classifier.out_proj.weight"} <= set(weights)
    old = {key.removeprefix("classifier."): value for key, value in weights.items()}
    save_file(old, tmp_path / "model.safetensors", metadata={"format": "pt"})
    loaded, info = AutoModelForSequenceClassification.from_pretrained(tmp_path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    batch = _classification_batch()
    torch.testing.assert_close(loaded.eval()(**batch).logits, model(**batch).logits)


def test_lora_for_causal_lm_generates_as_the_merged_model():
    tokenizer = byte_tokenizer(add_eos_token=False)
    base = _model(longattn.LongAttnForCausalLM, attention_type=["sliding", "full"], sliding_window=6)
    model = get_peft_model(base, LoraConfig(task_type=TaskType.CAUSAL_LM, r=4, target_modules=["q_proj", "v_proj"]))
    batch = dict(tokenizer(TEXTS[:1], return_tensors="pt"))
    _trained(model, **batch, labels=batch["input_ids"])
    kwargs = dict(max_new_tokens=10, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    with_adapter = model.generate(**batch, **kwargs)
    merged = model.merge_and_unload()
    assert torch.equal(merged.generate(**batch, **kwargs), with_adapter)
    assert torch.equal(merged.generate(**batch, **kwargs, use_cache=False), with_adapter)


def test_lora_for_seq2seq_generates_as_the_merged_model():
    """LoRA on the encoder's, the decoder's and the cross-attention's projections of the encoder-decoder model."""
    base = _model(longattn.LongAttnForSeq2SeqLM)
    model = get_peft_model(base, LoraConfig(task_type=TaskType.SEQ_2_SEQ_LM, r=4, target_modules=["q_proj", "v_proj"]))
    ids = torch.randint(4, 260, (2, 30), generator=torch.Generator().manual_seed(3))
    labels = torch.randint(4, 260, (2, 7), generator=torch.Generator().manual_seed(4))
    _trained(model, input_ids=ids, labels=labels)
    kwargs = dict(max_new_tokens=6, do_sample=False)
    with_adapter = model.generate(input_ids=ids, **kwargs)
    assert torch.equal(model.merge_and_unload().generate(input_ids=ids, **kwargs), with_adapter)


def test_lora_on_a_stock_model_with_longattn_attention():
    """A stock Llama whose attention longattn replaced (a sliding window with relative-position logits): LoRA on its
    projections trains; the kinds' own tables, frozen with the rest of the base, train when named in
    `modules_to_save`; the merged model gives the adapter model's logits and keeps the trained tables."""
    base = apply_longattn(
        build("llama"),
        attention_type="sliding",
        sliding_window=5,
        relative_position_logits=True,
        relative_max_distance=4,
    )  # 4 heads on 2 key/value heads
    lora = LoraConfig(
        task_type=TaskType.CAUSAL_LM, r=4, target_modules=["q_proj", "v_proj"], modules_to_save=["relative_embedding"]
    )
    model = get_peft_model(base, lora)
    ids = torch.randint(3, 100, (2, 40), generator=torch.Generator().manual_seed(2))
    untrained = model(input_ids=ids).logits.detach()
    _trained(model, input_ids=ids, labels=ids)
    logits = model(input_ids=ids).logits.detach()
    assert not torch.allclose(logits, untrained, atol=1e-4)
    merged = model.merge_and_unload()
    assert merged.config._attn_implementation == "longattn"
    tables = [p for name, p in merged.named_parameters() if name.endswith("relative_embedding.weight")]
    assert len(tables) == 2 and all(table.any() for table in tables)  # zero at the start, trained
    torch.testing.assert_close(merged(input_ids=ids).logits, logits, atol=1e-5, rtol=1e-5)


def test_trainer_trains_a_lora_classifier_with_global_tokens(tmp_path):
    """Trainer on a PEFT model: the dataset's ragged `global_attention_mask` column survives
    `remove_unused_columns` (the base model's `forward` names it), is padded by the collator and reaches the model;
    the adapters and the classifier move, the frozen base does not."""
    tokenizer = byte_tokenizer()
    texts = [*TEXTS, "a fourth"] * 2  # 8 rows: 2 steps of 2 micro-batches of 2
    rows = [tokenizer(text) for text in texts]
    data = Dataset.from_dict(
        {
            "input_ids": [row["input_ids"] for row in rows],
            "global_attention_mask": [[1, 0, 1] + [0] * (len(row["input_ids"]) - 3) for row in rows],
            "label": [0, 1, 2, 0, 2, 1, 0, 1],
            "text": texts,  # a column the model does not take: dropped
        }
    )
    base = _model(longattn.LongAttnForSequenceClassification, num_labels=3)
    model = get_peft_model(base, LoraConfig(task_type=TaskType.SEQ_CLS, r=4, target_modules=["q_proj", "v_proj"]))
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    seen = []
    base.register_forward_pre_hook(
        lambda module, args, kwargs: seen.append(kwargs["global_attention_mask"]), with_kwargs=True
    )
    args = TrainingArguments(
        tmp_path, per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=2, learning_rate=1e-2,
        report_to=[], save_strategy="no", use_cpu=True,
    )  # fmt: skip
    collator = DataCollatorWithGlobalAttention(tokenizer)
    Trainer(model=model, args=args, train_dataset=data, data_collator=collator).train()
    assert len(seen) == 4 and all(mask[:, [0, 2]].all() and mask[:, 1].eq(0).all() for mask in seen)
    moved = {name for name, p in model.named_parameters() if not torch.equal(p, before[name])}
    assert any("lora_B" in name for name in moved) and any(".classifier." in name for name in moved)
    assert not any("base_layer" in name or "embeddings" in name or "original_module" in name for name in moved)


@pytest.mark.parametrize(
    "task, model_class, head",
    [
        ("SEQ_CLS", longattn.LongAttnForSequenceClassification, "classifier"),
        ("TOKEN_CLS", longattn.LongAttnForTokenClassification, "classifier"),
        ("QUESTION_ANS", longattn.LongAttnForQuestionAnswering, "qa_outputs"),
    ],
)
def test_peft_finds_each_task_head_by_its_transformers_name(task, model_class, head):
    """PEFT's task classes keep the head trainable by its name in transformers' encoders; LoRA adds to no head."""
    config = LoraConfig(task_type=getattr(TaskType, task), r=4, target_modules=["q_proj", "v_proj"])
    model = get_peft_model(_model(model_class, num_labels=3), config)
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    assert any(f".{head}.modules_to_save." in name for name in trainable), sorted(trainable)


@torch.no_grad()  # the references are forward passes, as the pipeline's
def test_a_lengthened_stock_checkpoint_runs_in_a_pipeline(tmp_path):
    """A RoBERTa classifier lengthened from 64 to 256 tokens (`lengthen` + `save_lengthened`, tokenizer included)
    loads in a text-classification pipeline from its folder, keeps its longattn attention and its raised
    `model_max_length`, and classifies a text longer than the pretrained limit as the model does, in a padded batch
    too."""
    torch.manual_seed(0)
    roberta = RobertaConfig(
        vocab_size=260, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        max_position_embeddings=66, pad_token_id=0, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
        id2label=LABELS, label2id={v: k for k, v in LABELS.items()},
    )  # fmt: skip
    RobertaForSequenceClassification(roberta).save_pretrained(tmp_path / "pretrained")
    tokenizer = byte_tokenizer(model_max_length=64)
    model = lengthen(tmp_path / "pretrained", max_length=256, attention_type="sliding", sliding_window=8)
    save_lengthened(model, tmp_path / "long", tokenizer=tokenizer)
    classify = pipeline("text-classification", model=str(tmp_path / "long"))
    assert classify.model.config._attn_implementation == "longattn" and classify.tokenizer.model_max_length == 256
    text = "a text longer than the pretrained model's 64 tokens, " * 4
    single, batched = classify(text)[0], classify([text, "short"], batch_size=2)[0]
    probabilities = model.eval()(**classify.tokenizer(text, return_tensors="pt")).logits[0].softmax(-1)
    assert single["label"] == batched["label"] == LABELS[int(probabilities.argmax())]
    assert single["score"] == pytest.approx(batched["score"], rel=1e-5)
    assert single["score"] == pytest.approx(float(probabilities.max()), rel=1e-5)
