"""The `longattn` command: one entry point for the tools (`longattn SUBCOMMAND`, `python -m longattn`), whose start
imports neither torch nor transformers (`--help` in well under 1.5 s), and `import longattn`'s registrations, which
wait for the first use (`longattn._registration`): `import longattn` alone loads no model machinery, and the Auto
classes still load saved longattn and lengthened stock folders in a fresh process."""

from __future__ import annotations

import json
import os
import sys
import textwrap
import time
import types
from pathlib import Path

import torch
from child_processes import run
from transformers import RobertaConfig, RobertaForMaskedLM

import longattn
from longattn import _registration
from longattn.integration_transformers import SUPPORTED_ATTENTION_CLASSES
from longattn.tools import cli

REPO = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": str(REPO)}


def _longattn(*args: str, importtime: bool = False):
    command = [sys.executable, *(["-X", "importtime"] if importtime else []), "-m", "longattn", *args]
    return run(command, timeout=300, env=ENV, cwd=REPO)


def test_help_lists_every_subcommand_without_importing_torch_or_transformers():
    started = time.perf_counter()
    done = _longattn("--help")
    elapsed = time.perf_counter() - started
    assert done.returncode == 0, done.stderr
    for name in ("lengthen", "data", "eval", "hub", "visualize"):
        assert f"  {name} " in done.stdout
    traced = _longattn("--help", importtime=True)
    imported = {line.rpartition("|")[2].strip() for line in traced.stderr.splitlines() if line.startswith("import")}
    assert not {"torch", "transformers", "longattn.modeling_longattn"} & imported, sorted(imported)
    assert elapsed < 15  # the budget is 1.5 s on a quiet machine (docs/benchmarks.md); a loaded CI machine is slower


def test_a_subcommand_runs_the_tools_main():
    done = _longattn("hub", "check", str(REPO / "no-such-folder"))
    assert done.returncode == 1 and "no config.json" in done.stderr


def test_unknown_subcommand_is_a_usage_error():
    assert cli.main(["train"]) == 2


def test_eval_names_its_module_when_it_is_missing(capsys, monkeypatch):
    monkeypatch.setitem(cli.SUBCOMMANDS, "eval", ("longattn.tools.no_such_module", True, "evaluate"))
    assert cli.main(["eval", "folder"]) == 2
    assert "longattn.tools.no_such_module is missing" in capsys.readouterr().err


def test_import_registers_the_auto_classes():
    from transformers import AutoConfig, AutoModelForMaskedLM

    import longattn

    config = AutoConfig.for_model("longattn", hidden_size=32, num_attention_heads=2, num_hidden_layers=1)
    assert type(AutoModelForMaskedLM.from_config(config)) is longattn.LongAttnForMaskedLM


# Runs in a fresh interpreter: `import longattn` first (what it loads is reported), then the folder through the Auto
# classes only, before any longattn class is touched.
LOADER = textwrap.dedent(
    """
    import json, sys
    import longattn

    watched = ("transformers.configuration_utils", "transformers.modeling_utils", "longattn.configuration_longattn",
               "longattn.modeling_longattn", "longattn.integration_transformers")
    report = {"after_import": sorted(name for name in watched if name in sys.modules)}
    import torch
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    kind, folder, ids, out = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), sys.argv[4]
    report["named_before_use"] = "longattn" in CONFIG_MAPPING and not longattn._registration._registered
    outputs = {}
    with torch.no_grad():
        if kind == "longattn":  # the model first: its config is looked up inside from_pretrained
            model = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
            outputs["logits"] = model(input_ids=torch.tensor(ids)).logits
            report["config"] = type(transformers.AutoConfig.from_pretrained(folder)).__name__
            base = transformers.AutoModel.from_pretrained(folder).eval()
            report["base"] = type(base).__name__
            outputs["hidden"] = base(input_ids=torch.tensor(ids)).last_hidden_state
        else:
            report["config"] = type(transformers.AutoConfig.from_pretrained(folder)).__name__
            model = transformers.AutoModelForMaskedLM.from_pretrained(folder).eval()
            report["model"] = f"{type(model).__module__}.{type(model).__name__}"
            report["implementation"] = model.config._attn_implementation
            report["kinds"] = len(longattn.integration_transformers._attached_kinds(model))
            outputs["logits"] = model(input_ids=torch.tensor(ids)).logits
    report["fallback"] = longattn._registration.FALLBACK
    torch.save(outputs, out)
    print(json.dumps(report))
    """
)
IDS = [[5, 9, 23, 40, 7, 7, 41, 12, 30, 44, 3, 19], [6, 4, 39, 11, 8, 33, 21, 45, 2, 37, 15, 20]]  # < 50


def _load_in_fresh_process(tmp_path: Path, kind: str, folder: Path) -> tuple[dict, dict]:
    (tmp_path / "loader.py").write_text(LOADER)
    env = {**ENV, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error"}
    command = [sys.executable, str(tmp_path / "loader.py"), kind, str(folder), json.dumps(IDS), str(tmp_path / "o.pt")]
    done = run(command, timeout=600, env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1]), torch.load(tmp_path / "o.pt")


def test_import_is_cheap_and_the_auto_classes_load_a_saved_longattn_folder(tmp_path):
    """`import longattn` loads neither transformers' model machinery nor longattn's models; the Auto classes then
    load a saved longattn folder (no `trust_remote_code`), the outputs those of the process that saved it."""
    torch.manual_seed(0)
    config = longattn.LongAttnConfig(
        vocab_size=50,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=64,
        attention_type=["sliding", "full"],
        sliding_window=4,
    )
    model = longattn.LongAttnForCausalLM(config).eval()
    model.save_pretrained(tmp_path / "saved")
    with torch.no_grad():
        logits = model(input_ids=torch.tensor(IDS)).logits
        hidden = longattn.LongAttnModel.from_pretrained(tmp_path / "saved").eval()(torch.tensor(IDS)).last_hidden_state

    report, outputs = _load_in_fresh_process(tmp_path, "longattn", tmp_path / "saved")
    assert report["after_import"] == [], report  # neither transformers' model machinery nor longattn's modules
    assert report["named_before_use"] and report["fallback"] is None, report  # the lazy path, not the fallback
    assert (report["config"], report["base"]) == ("LongAttnConfig", "LongAttnModel")
    torch.testing.assert_close(outputs["logits"], logits)
    torch.testing.assert_close(outputs["hidden"], hidden)


def test_after_import_alone_the_auto_classes_load_a_lengthened_stock_folder(tmp_path):
    """A stock RoBERTa running longattn's kinds (`"attn_implementation": "longattn"`) loads in a fresh process after
    `import longattn` alone: transformers' own class, its kinds attached, the outputs of the saving process."""
    config = RobertaConfig(
        vocab_size=50,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        pad_token_id=1,
        max_position_embeddings=66,
    )
    torch.manual_seed(0)
    model = longattn.apply_longattn(RobertaForMaskedLM(config), attention_type="sliding", sliding_window=4).eval()
    model.save_pretrained(tmp_path / "lengthened")
    with torch.no_grad():
        logits = model(input_ids=torch.tensor(IDS)).logits

    report, outputs = _load_in_fresh_process(tmp_path, "stock", tmp_path / "lengthened")
    assert report["after_import"] == [], report
    assert report["named_before_use"] and report["fallback"] is None, report
    assert report["config"] == "RobertaConfig"
    assert report["model"] == "transformers.models.roberta.modeling_roberta.RobertaForMaskedLM", report
    assert (report["implementation"], report["kinds"]) == ("longattn", 2)
    torch.testing.assert_close(outputs["logits"], logits)


def test_the_registration_hooks_watch_every_supported_family():
    """`longattn._registration` names the stock families without importing transformers' model machinery; they
    are the packages of the supported attention classes, whose modeling modules register longattn when imported."""
    assert set(_registration.STOCK_FAMILIES) == set(SUPPORTED_ATTENTION_CLASSES.values())
    assert _registration.FALLBACK is None  # the pinned transformers takes the lazy path


def test_naming_the_config_changes_nothing_where_transformers_differs():
    """The one function reading transformers internals says no (the fallback) for a mapping not built as assumed."""
    plain = types.ModuleType("configuration_auto")
    plain.CONFIG_MAPPING, plain.model_type_to_module_name = {}, lambda model_type: model_type
    assert not _registration.name_config(plain, named=True) and plain.CONFIG_MAPPING == {}


def test_register_stays_public_and_idempotent():
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING, CONFIG_MAPPING_NAMES

    longattn.register()
    longattn.register()
    assert AutoConfig.for_model("longattn").__class__ is longattn.LongAttnConfig
    assert list(CONFIG_MAPPING.keys()).count("longattn") == 1  # the class itself, the lazy name gone
    assert "longattn" not in CONFIG_MAPPING_NAMES  # transformers' own table never named it


def test_longattn_lengthen_stays_the_function():
    """`longattn.lengthen` is the function even once its module (of the same name) is imported."""
    import importlib

    module = importlib.import_module("longattn.lengthen")
    assert isinstance(module, types.ModuleType)
    assert longattn.lengthen is module.lengthen
    from longattn import lengthen

    assert lengthen is module.lengthen


def test_log_lines_into_a_file_hold_no_terminal_escape_codes():
    """The recipes' (and the quickstart's) INFO lines, logged while nested progress bars are shown, written to a log
    file: each on a line of its own, without the cursor movements tqdm uses to redraw bars on a terminal."""
    import io
    import logging

    from tqdm.auto import tqdm

    from longattn.train.training import TqdmLoggingHandler

    log = io.StringIO()
    handler = TqdmLoggingHandler(log)
    handler.setFormatter(logging.Formatter("%(levelname)s %(message)s"))
    record = logging.LogRecord("longattn", logging.INFO, __file__, 1, "step %d: eval_loss=%.2f", (4, 2.3), None)
    with tqdm(total=4, file=log, desc="train") as outer, tqdm(total=2, file=log, desc="eval", leave=False):
        outer.update(1)
        handler.emit(record)
    lines = [line for line in log.getvalue().splitlines() if "INFO" in line]
    assert lines == ["INFO step 4: eval_loss=2.30"]
