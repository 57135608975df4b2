"""ListOps as the Long Range Arena has it, through the recipes, on CPU: LRA's split sizes and word-level tokenizer,
the small LRA model config, then the two-step recipe (masked-LM on the training sequences, classification from that
checkpoint, evaluation, the folder loaded with `AutoModel`) on a tiny split. The accuracy targets need a GPU:
scripts/listops.sh runs them and docs/listops.md records them."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from script_loading import load_script
from transformers import AutoConfig, AutoModel, AutoModelForSequenceClassification, AutoTokenizer

import longattn
from longattn.tokenization_longattn import byte_tokenizer
from longattn.train import data, training

REPO = Path(__file__).resolve().parents[1]
SMALL_CONFIG = REPO / "recipes" / "configs" / "listops_lra_small.json"
BASE_CONFIG = REPO / "recipes" / "configs" / "listops_lra_base.json"
TINY_SPLIT = ["--min_length", "20", "--max_length", "60", "--max_depth", "5", "--max_args", "5"]


def test_lra_option_gives_lra_split_sizes_and_explicit_sizes_win(monkeypatch, tmp_path):
    calls = []
    monkeypatch.setattr(data, "generate_task", lambda task, output_dir, **kwargs: calls.append(kwargs) or {})
    assert data.main(["listops", "--lra", "--output_dir", str(tmp_path)]) == 0
    assert data.main(["listops", "--lra", "--num_train", "10", "--output_dir", str(tmp_path)]) == 0
    assert data.main(["listops", "--output_dir", str(tmp_path)]) == 0
    lra = {"num_train": 96_000, "num_validation": 2_000, "num_test": 2_000}
    assert {k: calls[0][k] for k in lra} == lra
    assert {k: calls[1][k] for k in lra} == {**lra, "num_train": 10}
    assert {k: calls[2][k] for k in lra} == {"num_train": 4000, "num_validation": 500, "num_test": 500}
    # LRA's generator flags: depth 10, 10 arguments, 500 < length < 2000, and a fixed seed
    assert {k: calls[0][k] for k in ("max_depth", "max_args", "min_length", "max_length", "seed")} == {
        "max_depth": 10,
        "max_args": 10,
        "min_length": 500,
        "max_length": 2000,
        "seed": 0,
    }


def test_fewer_examples_are_a_prefix_and_labels_follow_the_rules():
    many = data.listops_examples(40, seed=4, min_length=30, max_length=90, max_depth=6, max_args=5)
    assert data.listops_examples(7, seed=4, min_length=30, max_length=90, max_depth=6, max_args=5) == many[:7]
    for example in many:
        tree = data.parse_listops(example["text"])
        assert data.listops_string(tree) == example["text"]
        assert data.listops_value(tree) == example["label"]


def test_word_level_tokenizer_reads_lra_expressions_at_their_length(tmp_path):
    examples = data.listops_examples(4, seed=0)  # LRA's knobs: 500 < tokens < 2000
    tokenizer = data.listops_tokenizer()
    assert len(tokenizer) == 20 and tokenizer.model_max_length == 2001
    assert (tokenizer.pad_token_id, tokenizer.cls_token_id, tokenizer.sep_token_id) == (0, 1, 2)
    assert tokenizer.mask_token_id == 3 and tokenizer.unk_token_id == 4
    tokenizer.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)  # transformers' own format, no custom code
    bytes_ = byte_tokenizer()
    for example in examples:
        words = example["text"].split()
        ids = loaded(example["text"])["input_ids"]
        assert len(ids) == len(words) + 2 <= 2001  # <s> ... </s>
        assert loaded.unk_token_id not in ids
        assert loaded.decode(ids, skip_special_tokens=True) == example["text"]
        assert len(bytes_(example["text"])["input_ids"]) > 2 * len(words)  # the byte tokenizer: 2-3 ids a token
    assert loaded("[MAX 1 <mask> ] x", add_special_tokens=False)["input_ids"] == [15, 6, 3, 19, 4]
    with pytest.raises(ValueError, match="words="):
        longattn.tokenization_longattn.word_level_tokenizer(["a", "a"])


@pytest.mark.parametrize("path, sizes", [(SMALL_CONFIG, (2, 64, 2, 128)), (BASE_CONFIG, (6, 512, 8, 2048))])
def test_lra_model_configs(path, sizes):
    config = AutoConfig.from_pretrained(path)
    assert (config.num_hidden_layers, config.hidden_size, config.num_attention_heads, config.intermediate_size) == sizes
    assert config.vocab_size == len(data.listops_tokenizer()) and config.max_position_embeddings >= 2001
    assert config.classifier_pooling == "mean"


def test_mean_pooling_reads_the_real_tokens_only():
    config = longattn.LongAttnConfig(
        hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64, attention_type="full"
    )
    torch.manual_seed(0)
    ids = torch.randint(4, 260, (1, 6))
    padded = torch.cat([ids, torch.zeros(1, 4, dtype=torch.long)], dim=1)
    mask = torch.cat([torch.ones(1, 6), torch.zeros(1, 4)], dim=1).long()
    for pooling in ("cls", "mean"):
        config.classifier_pooling = pooling
        model = AutoModelForSequenceClassification.from_config(config).eval()
        hidden = model.longattn(input_ids=ids).last_hidden_state
        pooled = {"cls": hidden[:, 0], "mean": hidden.mean(dim=1)}[pooling]
        expected = model.classifier.out_proj(torch.tanh(model.classifier.dense(pooled)))
        with torch.no_grad():
            torch.testing.assert_close(model(input_ids=ids).logits, expected)
            torch.testing.assert_close(model(input_ids=padded, attention_mask=mask).logits, expected)
    with pytest.raises(ValueError, match="classifier_pooling.*'max'.*'cls', 'mean'"):
        longattn.LongAttnConfig(classifier_pooling="max")


def test_experiment_plan_has_the_seeds_and_step_budgets_of_the_targets():
    runs = listops_script().plan(steps=5000, pretrain_steps=3000)
    count = {}
    for run in runs:
        count[run.group, run.kind] = count.get((run.group, run.kind), 0) + 1
    assert count[("scratch", "sliding")] == count[("scratch", "lsh")] == 3 and count[("scratch", "full")] == 1
    assert (
        count[("pretrained", "sliding")] == count[("scratch-same-steps", "sliding")] == count[("mlm", "sliding")] == 2
    )
    names = [run.name for run in runs]
    for run in runs:
        if run.pretrained:  # the masked-LM run comes first, and the scratch run beside it has the same total steps
            assert names.index(run.pretrained) < names.index(run.name) and run.steps == 5000
        if run.group == "scratch-same-steps":
            assert run.steps == 8000
    assert len(set(names)) == len(names)


def test_self_pretraining_then_classification_end_to_end(tmp_path, monkeypatch):
    """The two-step recipe, with the very commands of scripts/listops.py, on a tiny split: generate, masked-LM on the
    training sequences with the word-level tokenizer, classification from that checkpoint, evaluation, the test
    split scored on the folder loaded with the Auto classes, the results table written."""
    script = listops_script()
    for name in ("DATA", "TOKENIZER", "RUNS", "DOC"):
        monkeypatch.setattr(script, name, tmp_path / name.lower())
    (tmp_path / "doc").write_text((REPO / "docs" / "listops.md").read_text())
    sizes = ["--num_train", "24", "--num_validation", "8", "--num_test", "8"]
    argv = ["listops", "--output_dir", str(script.DATA), "--tokenizer_dir", str(script.TOKENIZER), *sizes, *TINY_SPLIT]
    assert data.main(argv) == 0
    settings = script.build_parser().parse_args(
        "--steps 2 --pretrain_steps 2 --batch_size 4 --warmup_steps 0 --eval_steps 2 --checkpointing_steps 1 "
        "--mixed_precision no".split()
    )
    runs = {run.name: run for run in script.plan(settings.steps, settings.pretrain_steps)}
    mlm_run, cls_run = runs["mlm-sliding-s1"], runs["pretrained-sliding-s1"]

    mlm = load_script("recipes/run_mlm.py", "recipe_mlm_listops").main(script.command(mlm_run, settings)[2:])
    assert mlm["train_steps"] == 2 and math.isfinite(mlm["eval_loss"])
    mlm_dir = script.RUNS / mlm_run.name
    assert len(AutoTokenizer.from_pretrained(mlm_dir)) == 20

    at_start = []  # the classifier's encoder as loaded, before its first step
    load_model = training.load_model

    def record(*args, **kwargs):
        model = load_model(*args, **kwargs)
        at_start.append({k: v.detach().clone() for k, v in model.longattn.state_dict().items()})
        return model

    monkeypatch.setattr(training, "load_model", record)
    recipe = load_script("recipes/run_classification.py", "recipe_classification_listops")
    results = recipe.main(script.command(cls_run, settings)[2:])
    pretrained = AutoModel.from_pretrained(mlm_dir).state_dict()
    assert at_start and set(at_start[0]) == set(pretrained)
    for name, tensor in pretrained.items():  # fine-tuning starts from the masked-LM encoder
        torch.testing.assert_close(at_start[0][name], tensor, msg=name)
    assert results["train_steps"] == 2 and math.isfinite(results["eval_loss"])
    assert results["attention_types"] == ["sliding", "sliding"]

    cls_dir = script.RUNS / cls_run.name
    model = AutoModel.from_pretrained(cls_dir)
    assert type(model).__name__ == "LongAttnModel" and model.config.classifier_pooling == "mean"
    assert model.config.vocab_size == 20 and model.config.num_labels == 10
    # the script's evaluation (Auto classes, its own batches) agrees with the recipe's on the same split
    scored = script.evaluate(cls_dir, script.DATA / "validation.jsonl", batch_size=3)
    assert scored["test_accuracy"] == pytest.approx(results["eval_accuracy"]) and scored["test_examples"] == 8
    table = script.report(settings)
    assert "| pretrained-sliding-s1 | pretrained | sliding | 1 | 2 |" in table
    written = (tmp_path / "doc").read_text()
    assert table in written and "awaiting a GPU" not in written.split(script.BEGIN)[1]
    assert json.loads((cls_dir / "test_results.json").read_text())["test_examples"] == 8


def listops_script():
    return load_script("scripts/listops.py", "longattn_listops_script")
