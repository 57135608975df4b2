"""Hub-ready folders: complete code closure, metadata, a trust_remote_code load in a process that cannot import
longattn (same outputs as the plain load), the folder checker, and the push code path (without network)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from child_processes import WITHOUT_LONGATTN
from huggingface_hub import ModelCard
from kind_configs import KIND_OVERRIDES, SIZES
from transformers import AutoModel, AutoModelForMaskedLM, AutoModelForSeq2SeqLM, AutoTokenizer, BertConfig

import longattn
from longattn import LongAttnConfig
from longattn.attention_registry import ATTENTION_CLASSES
from longattn.tokenization_longattn import byte_tokenizer
from longattn.tools import hub

REPO = Path(__file__).resolve().parents[1]
TINY = dict(**SIZES, max_position_embeddings=128, hidden_dropout_prob=0.0)  # the byte tokenizer's 260 ids

# Runs in a fresh interpreter: longattn is made unimportable (the editable install's finder is shadowed and the repo
# is off sys.path), then every folder is loaded with trust_remote_code and run on the given inputs.
FRESH_LOADER = WITHOUT_LONGATTN + textwrap.dedent(
    """
    import torch
    import transformers

    results = {}
    for item in json.loads(Path(sys.argv[1]).read_text()):
        auto_class = getattr(transformers, item["auto_class"])
        model = auto_class.from_pretrained(item["folder"], trust_remote_code=True).eval()
        assert type(model).__module__.startswith("transformers_modules."), type(model).__module__
        tokenizer = transformers.AutoTokenizer.from_pretrained(item["folder"], trust_remote_code=True)
        inputs = tokenizer(item["texts"], padding=True, return_tensors="pt")
        inputs.pop("token_type_ids", None)
        if "decoder_input_ids" in item:
            inputs["decoder_input_ids"] = torch.tensor(item["decoder_input_ids"])
        torch.manual_seed(0)
        with torch.no_grad():
            results[item["name"]] = model(**inputs)[0]
    assert not any(name == "longattn" or name.startswith("longattn.") for name in sys.modules)
    torch.save(results, sys.argv[2])
    """
)
TEXTS = ["a long document " * 3, "short one"]


def _outputs(model, tokenizer, decoder_input_ids=None) -> torch.Tensor:
    inputs = tokenizer(TEXTS, padding=True, return_tensors="pt")
    if decoder_input_ids is not None:
        inputs["decoder_input_ids"] = torch.tensor(decoder_input_ids)
    torch.manual_seed(0)
    with torch.no_grad():
        return model.eval()(**inputs)[0]


def _save(model, folder: Path, task: str = "mlm") -> Path:
    card = hub.model_card(
        model.config,
        task=task,
        metrics={"eval_accuracy": 0.5, "eval_loss": 1.25},
        training_data="tiny test data",
        command="python recipes/run_x.py --flag",
        extra={"train_steps": 3},
    )
    return hub.save_hub_folder(model, byte_tokenizer(model_max_length=128), folder, card=card)


def test_code_closure_holds_every_registered_kind():
    closure = hub.code_closure()
    for kind_class in ATTENTION_CLASSES.values():
        assert Path(sys.modules[kind_class.__module__].__file__).name in closure, kind_class
    assert {
        "modeling_longattn.py",
        "modeling_blocks.py",
        "modeling_inputs.py",
        "modeling_heads.py",
        "configuration_longattn.py",
        "attention_registry.py",
    } <= set(closure)
    # Every executor the ops dispatch to is a flat sibling the walk reaches.
    assert {
        "ops.py",
        "backends.py",
        "executor_reference.py",
        "executor_blocked.py",
        "executor_chunks.py",
        "executor_gathered.py",
        "executor_block_sets.py",
        "executor_band.py",
        "executor_sparse.py",
        "executor_flex.py",
        "executor_xformers.py",
        "executor_xformers_layouts.py",
        "executor_triton.py",
        "patterns.py",
        "numerics.py",
    } <= set(closure)
    assert "__init__.py" not in closure and "training.py" not in closure and "hub.py" not in closure


def test_saved_folder_is_complete_and_leaves_the_classes_untouched(tmp_path):
    config = LongAttnConfig(**TINY, attention_type=["sliding", "full"], sliding_window=4)
    model = longattn.LongAttnForMaskedLM(config)
    folder = _save(model, tmp_path / "mlm")
    assert hub.hub_folder_problems(folder) == []
    saved = json.loads((folder / "config.json").read_text())
    assert saved["auto_map"] == hub.AUTO_MAP
    assert saved["attention_type"] == ["sliding", "full"]
    for name in hub.code_closure():
        assert (folder / name).is_file(), name
    assert (folder / "model.safetensors").is_file() and (folder / "tokenizer.json").is_file()
    # registered for the Auto classes the transformers way: every save_pretrained writes the same folder
    assert longattn.LongAttnForMaskedLM._auto_class == "AutoModelForMaskedLM"
    assert LongAttnConfig._auto_class == "AutoConfig"
    card = ModelCard.load(folder / "README.md")
    assert card.data.library_name == "transformers"
    assert {"longattn", "attention-sliding", "attention-full", "custom_code"} <= set(card.data.tags)
    assert card.data.pipeline_tag == "fill-mask"
    assert {r.metric_type: r.metric_value for r in card.data.eval_results} == {"accuracy": 0.5, "loss": 1.25}
    assert "| 0 | `sliding` | sliding_window=4" in card.text and "| 1 | `full` |" in card.text
    assert "python recipes/run_x.py --flag" in card.text and "tiny test data" in card.text


def test_a_folder_written_again_gets_the_code_of_its_weights(tmp_path):
    """Saving into a folder that holds modeling code from an earlier save (a resumed run, an older longattn)
    replaces every module: stale code beside new weights would load them into other classes."""
    folder = tmp_path / "again"
    folder.mkdir()
    for name in ("modeling_longattn.py", "attention_base.py", "configuration_longattn.py"):
        (folder / name).write_text("# the code of an earlier version\n")
    model = longattn.LongAttnForSequenceClassification(LongAttnConfig(**TINY, attention_type="sliding"))
    _save(model, folder, task="classification")
    for name in hub.code_closure():
        assert (folder / name).read_bytes() == (hub.PACKAGE_DIR / name).read_bytes(), name


def test_an_unknown_task_is_refused_naming_the_tasks():
    stock = BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64)
    stock.longattn = {"attention_type": "sliding"}
    for config in (LongAttnConfig(**TINY), stock):
        with pytest.raises(ValueError, match=r"`task`='summarize' is unknown: expected one of \['mlm'"):
            hub.model_card(config, task="summarize")


def test_folder_problems_are_reported(tmp_path):
    model = longattn.LongAttnForMaskedLM(LongAttnConfig(**TINY, sliding_window=4))
    folder = _save(model, tmp_path / "ok")
    assert hub.hub_folder_problems(folder) == []

    def broken(name: str) -> Path:
        copy = tmp_path / name
        shutil.copytree(folder, copy)
        return copy

    missing_kind = broken("missing_kind")
    (missing_kind / "attention_longformer.py").unlink()
    assert any("attention_longformer" in p for p in hub.hub_folder_problems(missing_kind))
    package_import = broken("package_import")
    with (package_import / "ops.py").open("a") as f:
        f.write("\nfrom . import visualize\n")
    problems = hub.hub_folder_problems(package_import)
    assert any("from . import visualize" in p for p in problems)
    absolute = broken("absolute")
    with (absolute / "patterns.py").open("a") as f:
        f.write("\nimport longattn.data\n")
    assert any("imports the longattn package" in p for p in hub.hub_folder_problems(absolute))
    no_map = broken("no_map")
    config = json.loads((no_map / "config.json").read_text())
    del config["auto_map"]
    (no_map / "config.json").write_text(json.dumps(config))
    (no_map / "README.md").unlink()
    problems = hub.hub_folder_problems(no_map)
    assert any("auto_map" in p for p in problems) and any("README" in p for p in problems)


def test_trust_remote_code_without_longattn_matches_the_plain_load(tmp_path):
    """Every registered kind, plus a mixed-kind MLM and a seq2seq model, loads in a process that cannot import
    longattn and gives the outputs of the plain load."""
    specs, expected = [], {}
    mixed = longattn.LongAttnForMaskedLM(LongAttnConfig(**TINY, attention_type=["sliding", "full"], sliding_window=4))
    seq2seq = longattn.LongAttnForSeq2SeqLM(LongAttnConfig(**TINY, sliding_window=4))
    models = [
        ("mixed_mlm", mixed, "AutoModelForMaskedLM", AutoModelForMaskedLM, "mlm"),
        ("seq2seq", seq2seq, "AutoModelForSeq2SeqLM", AutoModelForSeq2SeqLM, "seq2seq"),
    ]
    for kind in longattn.available_attention_types():
        config = LongAttnConfig(**{**TINY, "attention_type": kind, **KIND_OVERRIDES.get(kind, {})})
        models.append((f"kind_{kind}", longattn.LongAttnModel(config), "AutoModel", AutoModel, "mlm"))
    decoder_input_ids = [[1, 10, 11], [1, 12, 13]]
    for name, model, auto_name, auto_class, task in models:
        folder = _save(model, tmp_path / name, task=task)
        assert hub.hub_folder_problems(folder) == [], name
        extra = {"decoder_input_ids": decoder_input_ids} if task == "seq2seq" else {}
        specs.append({"name": name, "folder": str(folder), "auto_class": auto_name, "texts": TEXTS, **extra})
        plain = auto_class.from_pretrained(folder)
        assert type(plain).__module__ == "longattn.modeling_longattn"
        expected[name] = _outputs(plain, AutoTokenizer.from_pretrained(folder), extra.get("decoder_input_ids"))
        torch.testing.assert_close(expected[name], _outputs(model, byte_tokenizer(), extra.get("decoder_input_ids")))

    (tmp_path / "spec.json").write_text(json.dumps(specs))
    (tmp_path / "loader.py").write_text(FRESH_LOADER)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(HF_MODULES_CACHE=str(tmp_path / "modules"), HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error")
    done = subprocess.run(
        [sys.executable, str(tmp_path / "loader.py"), str(tmp_path / "spec.json"), str(tmp_path / "out.pt"), str(REPO)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    fresh = torch.load(tmp_path / "out.pt")
    assert set(fresh) == set(expected)
    for name in expected:
        torch.testing.assert_close(fresh[name], expected[name], msg=name)


def test_push_folder_creates_the_repo_and_uploads_without_checkpoints(tmp_path, monkeypatch):
    import huggingface_hub

    calls = {}

    class Url(str):
        repo_id = "someone/tiny-longattn"

    def create_repo(repo_id, **kwargs):
        calls["create_repo"] = (repo_id, kwargs)
        return Url("https://huggingface.co/someone/tiny-longattn")

    def upload_folder(**kwargs):
        calls["upload_folder"] = kwargs

    monkeypatch.setattr(huggingface_hub, "create_repo", create_repo)
    monkeypatch.setattr(huggingface_hub, "upload_folder", upload_folder)
    model = longattn.LongAttnForMaskedLM(LongAttnConfig(**TINY, sliding_window=4))
    folder = _save(model, tmp_path / "push")
    (folder / "checkpoints" / "step_2").mkdir(parents=True)
    url = hub.push_folder(folder, "someone/tiny-longattn", token="t", private=True)
    assert url == "https://huggingface.co/someone/tiny-longattn"
    assert calls["create_repo"] == ("someone/tiny-longattn", {"token": "t", "private": True, "exist_ok": True})
    upload = calls["upload_folder"]
    assert upload["repo_id"] == "someone/tiny-longattn" and Path(upload["folder_path"]) == folder
    assert "checkpoints/**" in upload["ignore_patterns"]
    (folder / "README.md").unlink()
    calls.clear()
    with pytest.raises(ValueError, match="README"):
        hub.push_folder(folder, "someone/tiny-longattn")
    assert not calls
