"""`scripts/benchmark.py`: its `--set` overrides reach the measured layer, and bad items are refused."""

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "benchmark.py"


@pytest.fixture(scope="module")
def benchmark():
    spec = importlib.util.spec_from_file_location("longattn_benchmark_script", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_overrides_are_parsed_as_json_else_strings(benchmark):
    assert benchmark.config_overrides(["fixed_num_summary=1", "lsh_seed=null", "attention_backend=torch"]) == {
        "fixed_num_summary": 1, "lsh_seed": None, "attention_backend": "torch",
    }
    with pytest.raises(ValueError, match="FIELD=VALUE"):
        benchmark.config_overrides(["fixed_num_summary"])


def test_misspelt_field_is_refused(benchmark):
    # LongAttnConfig itself would keep the typo as an attribute and the run would measure the registered setting.
    expected = "'fixed_num_sumary' is not a LongAttnConfig field: did you mean fixed_num_summary"
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
