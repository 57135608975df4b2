"""The `longattn` command: one entry point for the tools (`longattn SUBCOMMAND`, `python -m longattn`), whose start
imports neither torch nor transformers (`--help` in well under 1.5 s), and `import longattn`'s registrations."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from child_processes import run

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
