"""Lengthening pretrained checkpoints (`longattn.lengthen`, `longattn-lengthen`) and fine-tuning them (Trainer, the
recipes). Tiny random-weight models of each family are saved to a folder and lengthened from it (nothing is
downloaded); the families and their batches are those of test_integration_transformers.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from kind_configs import FOUR_HEADS, trainer_arguments
from script_loading import load_script
from test_integration_transformers import build, inputs
from transformers import (
    AutoModel,
    AutoModelForSequenceClassification,
    RobertaConfig,
    RobertaForSequenceClassification,
    Trainer,
)

import longattn  # noqa: F401  (registers the implementation)
from longattn.lengthen import lengthen, max_tokens
from longattn.tokenization_longattn import byte_tokenizer
from longattn.tools import hub
from longattn.tools.lengthen import main as lengthen_main
from longattn.tools.lengthen import save_lengthened
from longattn.train import training

REPO = Path(__file__).resolve().parents[1]
OLD_TOKENS, NEW_TOKENS = 256, 320  # each of these families' tiny configs reads 256 tokens
LENGTHENED = ("bert", "roberta", "gpt2", "llama", "qwen2", "bart")  # llama: 2 key/value heads for 4 query heads


def _tables(model) -> dict[str, torch.Tensor]:
    return {
        name: p.detach().clone()
        for name, p in model.named_parameters()
        if name.endswith(("position_embeddings.weight", "wpe.weight", "embed_positions.weight"))
    }


@pytest.mark.parametrize("family", LENGTHENED)
def test_lengthen_from_a_folder_reads_max_length_and_reloads(family, tmp_path):
    original = build(family)
    original.save_pretrained(tmp_path / "src")
    old_tables = _tables(original)
    rope = {"rope_type": "linear"} if family == "llama" else {}

    model = lengthen(tmp_path / "src", NEW_TOKENS, attention_type="sliding", sliding_window=8, **rope).eval()

    assert type(model) is type(original) and max_tokens(model.config) == NEW_TOKENS
    assert model.config._attn_implementation == "longattn"
    # Longformer's copy; RoBERTa keeps pad + 1 rows in front, BART 2.
    offset = {"roberta": (original.config.pad_token_id or 0) + 1, "bart": 2}.get(family, 0)
    for name, new in _tables(model).items():
        old = old_tables[name]
        assert new.shape[0] == NEW_TOKENS + offset and old.shape[0] == OLD_TOKENS + offset
        torch.testing.assert_close(new[: offset + OLD_TOKENS], old)
        torch.testing.assert_close(new[offset + OLD_TOKENS :], old[offset : offset + NEW_TOKENS - OLD_TOKENS])
    assert bool(_tables(model)) == (family in ("bert", "roberta", "gpt2", "bart"))
    for name, buffer in model.named_buffers():
        if name.endswith(("embeddings.position_ids", "embeddings.token_type_ids")):
            assert buffer.shape == (1, model.config.max_position_embeddings), name
    if family == "llama":  # linear scaling, written as transformers 5.x rope_parameters, reaches the rotation
        assert model.config.rope_parameters["rope_type"] == "linear"
        assert model.config.rope_parameters["factor"] == NEW_TOKENS / OLD_TOKENS
        rotary = model.model.rotary_emb
        torch.testing.assert_close(rotary.inv_freq, original.model.rotary_emb.inv_freq * OLD_TOKENS / NEW_TOKENS)

    batch = inputs(family, length=NEW_TOKENS)  # longer than the original model reads
    with torch.no_grad():
        expected = model(**batch)[0]
    model.save_pretrained(tmp_path / "out")
    reloaded = type(model).from_pretrained(tmp_path / "out").eval()
    assert reloaded.config._attn_implementation == "longattn" and reloaded.config.longattn == model.config.longattn
    with torch.no_grad():
        torch.testing.assert_close(reloaded(**batch)[0], expected)


def test_lengthen_refusals(tmp_path):
    with pytest.raises(ValueError, match="max_length.*shorter than the 256 tokens"):
        lengthen(build("bert"), 128)
    with pytest.raises(ValueError, match="rope_type.*learned position tables"):
        lengthen(build("gpt2"), NEW_TOKENS, rope_type="linear")
    with pytest.raises(ValueError, match="rope_type.*expected one of"):
        lengthen(build("qwen2"), NEW_TOKENS, rope_type="ntk")
    for bad in (0, True):
        with pytest.raises(ValueError, match="max_length"):
            lengthen(build("bert"), bad)
    with pytest.raises(ValueError, match="BertModel is not a lengthened stock model"):
        save_lengthened(build("bert"), tmp_path / "out")


def test_lengthen_warns_that_a_copied_table_does_not_lengthen_a_causal_model(recwarn):
    """GPT-2 and BART (whose decoder table is copied too) are warned; BERT and Llama (rotary) are not."""
    for family, warned in (("gpt2", True), ("bart", True), ("bert", False), ("llama", False)):
        recwarn.clear()
        lengthen(build(family), NEW_TOKENS)
        messages = [str(w.message) for w in recwarn.list if issubclass(w.category, UserWarning)]
        assert any("causal self-attention" in m for m in messages) == warned, (family, messages)


# ------------------------------------------------------------------------------------------ RoBERTa, end to end
@pytest.fixture(scope="module")
def lengthened_roberta(tmp_path_factory) -> Path:
    """A tiny RoBERTa classifier with the byte tokenizer, lengthened by the command line to 320 tokens with a
    sliding window (the README's flow, offline)."""
    root = tmp_path_factory.mktemp("roberta")
    tokenizer = byte_tokenizer(model_max_length=OLD_TOKENS)
    positions = OLD_TOKENS + tokenizer.pad_token_id + 1  # RoBERTa's positions start after the padding id
    config = RobertaConfig(
        **FOUR_HEADS,
        vocab_size=len(tokenizer),
        pad_token_id=tokenizer.pad_token_id,
        max_position_embeddings=positions,
        num_labels=2,
    )
    torch.manual_seed(0)
    RobertaForSequenceClassification(config).save_pretrained(root / "src")
    tokenizer.save_pretrained(root / "src")
    assert (
        lengthen_main(
            [
                str(root / "src"),
                str(root / "out"),
                "--max_length",
                str(NEW_TOKENS),
                "--attention_type",
                "sliding",
                "--sliding_window",
                "8",
            ]
        )
        == 0
    )
    return root / "out"


def test_the_command_line_writes_tokenizer_and_card(lengthened_roberta, capsys):
    tokenizer_config = json.loads((lengthened_roberta / "tokenizer_config.json").read_text())
    assert tokenizer_config["model_max_length"] == NEW_TOKENS
    config = json.loads((lengthened_roberta / "config.json").read_text())
    assert config["max_position_embeddings"] == NEW_TOKENS + 1 and config["attn_implementation"] == "longattn"
    assert config["longattn"] == {"attention_type": "sliding", "sliding_window": 8}
    card = (lengthened_roberta / "README.md").read_text()
    assert "trust_remote_code=True" in card and "pip install longattn\n" not in card
    assert "lengthened from: `src`" in card
    assert str(lengthened_roberta.parent) not in card  # a local source is recorded by its name only
    assert hub.hub_folder_problems(lengthened_roberta) == []
    with pytest.raises(SystemExit):  # a field the longattn dict does not have
        lengthen_main([str(lengthened_roberta), "x", "--max_length", "400", "--sliding_windw", "8"])
    assert "'sliding_windw' (did you mean sliding_window" in capsys.readouterr().err


def test_the_command_line_reports_a_malformed_field_value_as_a_usage_error(capsys):
    """A value the field grammar cannot read (a bare comma list) exits with usage status 2 and names the grammar,
    never a traceback: the check runs before anything is loaded."""
    with pytest.raises(SystemExit) as exit_info:
        lengthen_main(["src", "out", "--max_length", "64", "--sliding_dilation", "1,2"])
    assert exit_info.value.code == 2
    assert "is not of the form key=value" in capsys.readouterr().err


def test_without_longattn_the_folder_fails_to_load(lengthened_roberta):
    code = (
        "import sys\nfrom transformers import AutoModelForSequenceClassification as A\n"
        f"A.from_pretrained({str(lengthened_roberta)!r})\nassert 'longattn' not in sys.modules\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        cwd=lengthened_roberta.parent,
    )
    # transformers' own error about the unknown implementation, never a model silently running full attention
    last = done.stderr.splitlines()[-1]
    assert done.returncode != 0 and 'attn_implementation="longattn"` is not supported' in last, done.stderr[-2000:]


def _record_global_masks(model) -> list[torch.Tensor]:
    seen = []
    model.register_forward_pre_hook(
        lambda module, args, kwargs: seen.append(kwargs.get("global_attention_mask")), with_kwargs=True
    )
    return seen


def test_trainer_fine_tunes_saves_and_reloads(lengthened_roberta, tmp_path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(lengthened_roberta)
    model = AutoModelForSequenceClassification.from_pretrained(lengthened_roberta)
    assert model.config._attn_implementation == "longattn"
    texts = ["a" * 290, "bb", "ccc " * 40, "d" * 300]  # up to 302 tokens: beyond the original 256
    train = [{**tokenizer(text), "label": i % 2} for i, text in enumerate(texts)]
    collator = training.DataCollatorWithGlobalAttention(tokenizer, global_first_token=True)
    seen = _record_global_masks(model)
    args = trainer_arguments(tmp_path / "trainer", per_device_train_batch_size=2, learning_rate=1e-3)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    Trainer(model=model, args=args, train_dataset=train, data_collator=collator).train()
    assert any(not torch.equal(before[name], p) for name, p in model.named_parameters())
    # The global first token reached the model through Trainer's default remove_unused_columns=True.
    assert len(seen) == 2 and all(mask is not None and mask[:, 0].all() and mask[:, 1:].sum() == 0 for mask in seen)

    model.save_pretrained(tmp_path / "tuned")
    reloaded = AutoModelForSequenceClassification.from_pretrained(tmp_path / "tuned").eval()
    model.eval()
    batch = collator([{**tokenizer(text)} for text in texts])
    with torch.no_grad():
        torch.testing.assert_close(reloaded(**batch).logits, model(**batch).logits)
    assert reloaded.config._attn_implementation == "longattn" and reloaded.config.longattn == model.config.longattn


def test_global_attention_collator_pads_ragged_masks():
    tokenizer = byte_tokenizer(padding_side="left")
    features = [
        {**tokenizer("abcd"), "global_attention_mask": [1, 0, 1, 0, 0, 0]},
        {**tokenizer("ab"), "global_attention_mask": [0, 1, 0, 0]},
    ]
    batch = training.DataCollatorWithGlobalAttention(tokenizer)(features)
    assert batch["global_attention_mask"].tolist() == [[1, 0, 1, 0, 0, 0], [0, 0, 0, 1, 0, 0]]
    first = training.DataCollatorWithGlobalAttention(tokenizer, global_first_token=True)(
        [{k: v for k, v in f.items() if k != "global_attention_mask"} for f in features]
    )
    assert first["global_attention_mask"].tolist() == [[1, 0, 0, 0, 0, 0], [0, 0, 1, 0, 0, 0]]


# ------------------------------------------------------------------------------------------ the recipes
def test_recipe_settings_for_a_lengthened_checkpoint(lengthened_roberta, tmp_path):
    parser = training.recipe_parser(None, task="classification")
    argv = ["--train_file", __file__, "--output_dir", str(tmp_path), "--model_name_or_path", str(lengthened_roberta)]
    args = parser.parse_args(
        [*argv, "--config_overrides", "longattn.sliding_window=16,longattn.attention_type=[sliding,full]"]
    )
    config = training.load_config(args, task="classification")
    assert config.longattn == {"attention_type": ["sliding", "full"], "sliding_window": 16}
    assert training.length_multiple(config) >= 1 and training.attention_types(config) == ["sliding", "full"]
    for overrides, message in (
        ("longattn.sliding_windw=16", "sliding_windw"),
        ("longattn.sliding_window=-1", "sliding_window"),
        ("sliding_window=16", "longattn.FIELD"),
    ):
        bad = parser.parse_args([*argv, "--config_overrides", overrides])
        with pytest.raises(training.RecipeError, match=message):
            training.load_config(bad, task="classification")
    # RoBERTa's 321 rows hold 320 tokens (its padding id is 0): the length check counts the offset.
    args.max_seq_length = NEW_TOKENS + 1
    with pytest.raises(training.RecipeError, match="exceeds the 320 tokens"):
        training.resolve_max_seq_length(args, config, None)
    args.max_seq_length = NEW_TOKENS
    assert training.resolve_max_seq_length(args, config, None) == NEW_TOKENS
    with pytest.raises(ValueError, match="no `longattn` dict"):
        hub.save_hub_folder(build("bert"), None, tmp_path / "plain")


def test_classification_recipe_fine_tunes_a_lengthened_roberta(lengthened_roberta, tmp_path, monkeypatch):
    rows = [{"text": "ab " * (90 + i), "label": i % 2} for i in range(8)]  # up to 294 tokens: beyond 256
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    seen = []
    load_model = training.load_model
    monkeypatch.setattr(
        training, "load_model", lambda *a, **k: (m := load_model(*a, **k), seen.append(_record_global_masks(m)))[0]
    )
    recipe = load_script("recipes/run_classification.py", "recipe_classification")
    out = tmp_path / "run"
    results = recipe.main(
        [
            "--model_name_or_path",
            str(lengthened_roberta),
            "--train_file",
            str(tmp_path / "train.jsonl"),
            "--validation_file",
            str(tmp_path / "train.jsonl"),
            "--config_overrides",
            "longattn.sliding_window=4",
            "--output_dir",
            str(out),
            "--per_device_train_batch_size",
            "4",
            "--max_train_steps",
            "2",
        ]
    )
    assert results["train_steps"] == 2 and results["attention_types"] == ["sliding", "sliding"]
    assert seen and all(mask is not None and mask[:, 0].all() and mask[:, 1:].sum() == 0 for mask in seen[0])
    assert hub.hub_folder_problems(out) == [] and "trust_remote_code=True" in (out / "README.md").read_text()
    reloaded = AutoModel.from_pretrained(out)
    assert reloaded.config._attn_implementation == "longattn" and reloaded.config.longattn["sliding_window"] == 4
