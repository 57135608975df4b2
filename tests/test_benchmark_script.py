"""`scripts/benchmark.py`: its `--set` overrides reach the measured layer, bad items are refused, peer packages are
measured only where installed (else a one-line error says how to install them), and `--help` shows the defaults."""

import importlib.machinery
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
from script_loading import load_script

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "benchmark.py"


@pytest.fixture(scope="module")
def benchmark():
    return load_script("scripts/benchmark.py", "longattn_benchmark_script")


def test_overrides_are_parsed_in_the_recipes_grammar(benchmark):
    assert benchmark.config_overrides(["fixed_num_summary=1", "lsh_seed=null", "attention_backend=torch",
                                       "sliding_dilation=[1,2]"]) == {
        "fixed_num_summary": 1, "lsh_seed": None, "attention_backend": "torch", "sliding_dilation": [1, 2],
    }
    with pytest.raises(ValueError, match="FIELD=VALUE"):
        benchmark.config_overrides(["fixed_num_summary"])


def test_misspelt_field_is_refused(benchmark):
    # LongAttnConfig itself would keep the typo as an attribute and the run would measure the registered setting.
    expected = r"--set: unknown config field\(s\) 'fixed_num_sumary' \(did you mean fixed_num_summary"
    with pytest.raises(ValueError, match=expected):
        benchmark.config_overrides(["fixed_num_sumary=1"])


def test_override_wins_over_the_registered_setting(benchmark):
    args = benchmark.argparse.Namespace(
        length=256, hidden=32, heads=2, batch=1, global_tokens=0, window=16, set=["fixed_num_summary=2"],
    )
    layer = benchmark.IMPLS["fixed"].build(args)
    assert layer.module.num_summary == 2  # registered as 8
    args.set = []
    assert benchmark.IMPLS["fixed"].build(args).module.num_summary == 8


def test_bad_item_is_a_usage_error():
    completed = subprocess.run(
        [sys.executable, str(SCRIPT), "--impls", "fixed", "--set", "oops"], capture_output=True, text=True
    )
    assert completed.returncode == 2
    assert "FIELD=VALUE" in completed.stderr


def _record_runs(benchmark, monkeypatch) -> list[str]:
    """Replace the measuring subprocess by a stub; return the list the implementations asked for go into."""
    measured = []

    def run_one(args, impl, length, mode, compiled=False):
        measured.append(impl)
        return {"impl": impl, "length": length, "mode": mode, "error": "not run"}

    monkeypatch.setattr(benchmark, "run_one", run_one)
    return measured


def _installed(name: str):
    """A stand-in module that `importlib.util.find_spec` finds."""
    return importlib.util.module_from_spec(importlib.machinery.ModuleSpec(name, None))


def test_default_run_takes_local_attention_only_where_installed(benchmark, monkeypatch):
    measured = _record_runs(benchmark, monkeypatch)
    monkeypatch.setitem(sys.modules, "local_attention", None)  # not importable, as after scripts/setup.sh
    benchmark.main(["--lengths", "64", "--mode", "fwd"])
    assert measured == ["full", "sliding", "hf-longformer"]

    measured.clear()
    monkeypatch.setitem(sys.modules, "local_attention", _installed("local_attention"))
    benchmark.main(["--lengths", "64", "--mode", "fwd"])
    assert measured == ["full", "sliding", "hf-longformer", "local-attention"]


@pytest.mark.parametrize("flag", ["--impls", "--baseline"])
def test_requested_peer_that_is_missing_is_a_one_line_error(benchmark, monkeypatch, capsys, flag):
    measured = _record_runs(benchmark, monkeypatch)
    monkeypatch.setitem(sys.modules, "reformer_pytorch", None)
    with pytest.raises(SystemExit) as exit_info:
        benchmark.main(["--lengths", "64", "--mode", "fwd", flag, "reformer-lsh"])
    assert exit_info.value.code == 2 and measured == []
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert "reformer-lsh needs the `reformer-pytorch` package" in error
    assert 'pip install torch==2.13.0 && pip install -e ".[bench]"' in error and "`bench` extra" in error


def test_help_shows_defaults_and_how_to_install_the_peers():
    completed = subprocess.run([sys.executable, str(SCRIPT), "--help"], capture_output=True, text=True, check=True)
    text = " ".join(completed.stdout.split())  # argparse wraps lines
    assert "keys on each side of a query (default: 256)" in text
    assert "(default: hf-longformer)" in text and "(default: [1024, 4096, 16384])" in text
    assert 'pip install torch==2.13.0 && pip install -e ".[bench]"' in text


def test_model_report_compares_attention_cost_with_its_ideal(benchmark):
    """`--models`: attention cost = time - floor, ideal = (sdpa - floor) x window share (causal: over n/2 keys)."""
    assert benchmark.ideal_fraction(benchmark.MODEL_SETS["roberta-4k"], 4096) == 512 / 4096
    assert benchmark.ideal_fraction(benchmark.MODEL_SETS["llama-16k"], 16384) == 512 / 8192
    args = benchmark.argparse.Namespace(models="roberta-4k", repeats=1, new_tokens=256)
    results = [{"impl": impl, "length": 4096, "time_s": t, "peak_rss_mb": mb, "threads": 2}
               for impl, t, mb in (("longformer", 40.0, 9000), ("sdpa", 28.0, 4000), ("floor", 12.0, 3800),
                                   ("longattn", 15.0, 3900))]
    text = benchmark.model_report(args, results, "python scripts/benchmark.py --models roberta-4k")
    assert "| longattn | 15.0 | 3900 | 3.0 | 1.50x | 2.67x | 0.97 |" in text  # ideal (28 - 12) / 8 = 2 s
    assert "Ideal attention cost: 2.00 s." in text
