"""Every saved folder is shareable, whatever saved it: in a process where longattn cannot be imported (only torch and
transformers), folders written by plain `save_pretrained`, by `transformers.Trainer`, from a merged LoRA adapter, by
`longattn.lengthen` and by `longattn.apply_longattn` each load with `trust_remote_code=True` and give the outputs of
the process that saved them. A lengthened folder loaded there without `trust_remote_code` fails naming longattn.

One test per path, each with its own child process (the folder's code is what that process runs).
"""

from __future__ import annotations

import json
import os
import sys
import textwrap
from pathlib import Path

import torch
from child_processes import WITHOUT_LONGATTN, run
from datasets import Dataset
from kind_configs import SIZES, tiny_config
from peft import LoraConfig, TaskType, get_peft_model
from test_integration_transformers import build
from transformers import BertConfig, BertForMaskedLM, Trainer, TrainingArguments

import longattn
from longattn.tools import hub

REPO = Path(__file__).resolve().parents[1]
IDS = [[5, 9, 23, 40, 7, 7, 41, 12, 30, 44, 3, 19, 20, 2, 37, 15, 8, 33, 21, 45], [6, 4, 39, 11] + [0] * 16]  # < 50
MASK = [[1] * 20, [1] * 4 + [0] * 16]

# Runs in a fresh interpreter where longattn cannot be imported (a finder refuses it, the repository is off
# sys.path): each folder of the spec is loaded, first without trust_remote_code when the spec says it must fail,
# then with it, and run on the spec's inputs.
LOADER = WITHOUT_LONGATTN + textwrap.dedent(
    """
    import torch
    import transformers

    results, refusals = {}, {}
    for item in json.loads(Path(sys.argv[1]).read_text()):
        auto_class = getattr(transformers, item["auto_class"])
        if item.get("refused_without_trust"):
            try:
                auto_class.from_pretrained(item["folder"])
            except Exception as error:
                refusals[item["name"]] = f"{type(error).__name__}: {error}"
            else:
                refusals[item["name"]] = None
        model = auto_class.from_pretrained(item["folder"], trust_remote_code=True).eval()
        assert type(model).__module__.startswith("transformers_modules."), type(model).__module__
        with torch.no_grad():
            out = model(input_ids=torch.tensor(item["input_ids"]), attention_mask=torch.tensor(item["attention_mask"]))
        results[item["name"]] = out.logits
    assert not any(name == "longattn" or name.startswith("longattn.") for name in sys.modules)
    torch.save({"results": results, "refusals": refusals}, sys.argv[2])
    """
)


def _inputs() -> dict:
    return {"input_ids": torch.tensor(IDS), "attention_mask": torch.tensor(MASK)}


@torch.no_grad()
def _logits(model) -> torch.Tensor:
    return model.eval()(**_inputs()).logits


def load_without_longattn(tmp_path: Path, folder: Path, auto_class: str, *, refused_without_trust: bool = False):
    """(logits, refusal message or None) of `folder` loaded in a child process that cannot import longattn."""
    spec = [
        {
            "name": "model",
            "folder": str(folder),
            "auto_class": auto_class,
            "input_ids": IDS,
            "attention_mask": MASK,
            "refused_without_trust": refused_without_trust,
        }
    ]
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    (tmp_path / "loader.py").write_text(LOADER)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(HF_MODULES_CACHE=str(tmp_path / "modules"), HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error")
    command = [sys.executable, str(tmp_path / "loader.py"), str(tmp_path / "spec.json"), str(tmp_path / "out.pt")]
    done = run([*command, str(REPO)], timeout=600, cwd=tmp_path, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    out = torch.load(tmp_path / "out.pt")
    return out["results"]["model"], out["refusals"].get("model")


def _classifier(seed: int = 0):
    torch.manual_seed(seed)
    return longattn.LongAttnForSequenceClassification(tiny_config("sliding", sliding_window=4, num_labels=3))


def test_a_plain_save_pretrained_folder_loads_without_longattn(tmp_path):
    torch.manual_seed(0)
    model = longattn.LongAttnForMaskedLM(tiny_config(attention_type=["sliding", "full"], sliding_window=4))
    model.save_pretrained(tmp_path / "plain")
    saved = json.loads((tmp_path / "plain" / "config.json").read_text())
    assert saved["auto_map"] == hub.AUTO_MAP  # every head's Auto class, not only the saving one's
    assert {"configuration_longattn.py", "modeling_longattn.py", "attention_longformer.py"} <= {
        path.name for path in (tmp_path / "plain").glob("*.py")
    }
    logits, _ = load_without_longattn(tmp_path, tmp_path / "plain", "AutoModelForMaskedLM")
    torch.testing.assert_close(logits, _logits(model))


def test_a_trainer_folder_loads_without_longattn(tmp_path):
    model = _classifier()
    rows = [{"input_ids": row, "attention_mask": mask, "labels": i % 3} for i, (row, mask) in enumerate(zip(IDS, MASK))]
    args = TrainingArguments(
        str(tmp_path / "run"), max_steps=2, per_device_train_batch_size=2, learning_rate=1e-2, report_to=[]
    )
    trainer = Trainer(model=model, args=args, train_dataset=Dataset.from_list(rows))
    before = _logits(model)
    trainer.train()
    trainer.save_model(str(tmp_path / "trained"))
    expected = _logits(model)
    assert not torch.allclose(before, expected)  # the folder holds the trained weights
    logits, _ = load_without_longattn(tmp_path, tmp_path / "trained", "AutoModelForSequenceClassification")
    torch.testing.assert_close(logits, expected)


def test_a_merged_lora_folder_loads_without_longattn(tmp_path):
    peft_model = get_peft_model(
        _classifier(), LoraConfig(task_type=TaskType.SEQ_CLS, r=4, target_modules=["q_proj", "v_proj"])
    )
    with torch.no_grad():  # a trained adapter: LoRA's B starts at zero, which would merge to nothing
        for name, parameter in peft_model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(std=0.5)
    merged = peft_model.merge_and_unload()
    assert type(merged) is longattn.LongAttnForSequenceClassification
    merged.save_pretrained(tmp_path / "merged")
    expected = _logits(merged)
    assert not torch.allclose(expected, _logits(_classifier()))
    logits, _ = load_without_longattn(tmp_path, tmp_path / "merged", "AutoModelForSequenceClassification")
    torch.testing.assert_close(logits, expected)


def test_a_lengthened_folder_loads_without_longattn_with_trust_remote_code_only(tmp_path):
    torch.manual_seed(0)
    stock = BertForMaskedLM(BertConfig(vocab_size=100, **SIZES, max_position_embeddings=16))
    stock.save_pretrained(tmp_path / "bert")
    model = longattn.lengthen(str(tmp_path / "bert"), 64, attention_type="sliding", sliding_window=4)
    folder = longattn.save_lengthened(model, tmp_path / "bert-64", source=str(tmp_path / "bert"))
    assert type(model) is BertForMaskedLM  # saving shared the code, the model keeps its class
    saved = json.loads((folder / "config.json").read_text())
    assert saved["auto_map"]["AutoModelForMaskedLM"] == "modeling_stock.BertForMaskedLM"
    assert saved["auto_map"]["AutoModel"] == "modeling_stock.BertModel"
    card = (folder / "README.md").read_text()
    assert "trust_remote_code=True" in card and "pip install longattn\n" not in card
    logits, refusal = load_without_longattn(tmp_path, folder, "AutoModelForMaskedLM", refused_without_trust=True)
    torch.testing.assert_close(logits, _logits(model))
    # transformers runs none of the folder's code without trust_remote_code: its own refusal names the implementation
    assert refusal is not None and 'attn_implementation="longattn"' in refusal, refusal


def test_an_apply_longattn_folder_loads_without_longattn(tmp_path):
    model = longattn.apply_longattn(build("llama"), attention_type="strided", strided_stride=4)
    model.save_pretrained(tmp_path / "llama")
    assert hub.hub_folder_problems(tmp_path / "llama") == [
        "no tokenizer (tokenizer.json / tokenizer_config.json)",
        "no model card (README.md)",
    ]
    logits, _ = load_without_longattn(tmp_path, tmp_path / "llama", "AutoModelForCausalLM")
    torch.testing.assert_close(logits, _logits(model))
