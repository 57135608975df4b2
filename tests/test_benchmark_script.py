"""`scripts/benchmark.py`: its `--set` overrides reach the measured layer, bad items are refused, peer packages are
measured only where installed (else a one-line error says how to install them), `--help` shows the defaults, and
`--against REV` measures the longattn kinds again with the package exported from REV, interleaved, with ratios."""

import importlib.machinery
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import child_processes
import pytest
from script_loading import load_script

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "benchmark.py"


@pytest.fixture(scope="module")
def benchmark():
    return load_script("scripts/benchmark.py", "longattn_benchmark_script")


def _layer_args(benchmark, **fields):
    """The script's arguments for one small layer: hidden 32 in 2 heads, batch 1, window 16, no global token, no
    `--set` item; `fields` over them."""
    return benchmark.argparse.Namespace(
        **{"hidden": 32, "heads": 2, "batch": 1, "window": 16, "global_tokens": 0, "set": [], **fields}
    )


def _worker_args(benchmark, tree):
    """`_layer_args` as `run_one` reads them: one repeat, no wait, 60 s, glibc, old rows import from `tree`."""
    worker = dict(repeats=1, wait_idle=0.0, timeout=60.0, tensor_memory=False, allocator="glibc", against_tree=tree)
    return _layer_args(benchmark, **worker)


def test_overrides_are_parsed_in_the_recipes_grammar(benchmark):
    assert benchmark.config_overrides(
        ["fixed_num_summary=1", "lsh_seed=null", "attention_backend=torch", "sliding_dilation=[1,2]"]
    ) == {
        "fixed_num_summary": 1,
        "lsh_seed": None,
        "attention_backend": "torch",
        "sliding_dilation": [1, 2],
    }
    with pytest.raises(ValueError, match="FIELD=VALUE"):
        benchmark.config_overrides(["fixed_num_summary"])


def test_misspelt_field_is_refused(benchmark):
    # LongAttnConfig itself would keep the typo as an attribute and the run would measure the registered setting.
    expected = r"--set: unknown config field\(s\) 'fixed_num_sumary' \(did you mean fixed_num_summary"
    with pytest.raises(ValueError, match=expected):
        benchmark.config_overrides(["fixed_num_sumary=1"])


def test_override_wins_over_the_registered_setting(benchmark):
    args = _layer_args(benchmark, length=256, set=["fixed_num_summary=2"])
    layer = benchmark.IMPLS["fixed"].build(args)
    assert layer.module.num_summary == 2  # registered as 8
    args.set = []
    assert benchmark.IMPLS["fixed"].build(args).module.num_summary == 8


def test_attention_dropout_is_off_unless_set(benchmark):
    args = _layer_args(benchmark, length=256)
    assert benchmark.IMPLS["sliding"].build(args).module.dropout_p == 0.0
    args.set = ["attention_probs_dropout_prob=0.1"]  # was a TypeError: the field was also passed by the script
    assert benchmark.IMPLS["sliding"].build(args).module.dropout_p == 0.1


def test_bad_item_is_a_usage_error():
    completed = child_processes.run([sys.executable, str(SCRIPT), "--impls", "fixed", "--set", "oops"], timeout=120)
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
    completed = child_processes.run([sys.executable, str(SCRIPT), "--help"], timeout=120, check=True)
    text = " ".join(completed.stdout.split())  # argparse wraps lines
    assert "keys on each side of a query (default: 256)" in text
    assert "(default: hf-longformer)" in text and "(default: [1024, 4096, 16384])" in text
    assert 'pip install torch==2.13.0 && pip install -e ".[bench]"' in text


def test_model_report_compares_attention_cost_with_its_ideal(benchmark):
    """`--models`: attention cost = time - floor, ideal = (sdpa - floor) x window share (causal: over n/2 keys)."""
    assert benchmark.ideal_fraction(benchmark.MODEL_SETS["roberta-4k"], 4096) == 512 / 4096
    assert benchmark.ideal_fraction(benchmark.MODEL_SETS["llama-16k"], 16384) == 512 / 8192
    args = benchmark.argparse.Namespace(models="roberta-4k", repeats=1, new_tokens=256)
    results = [
        {"impl": impl, "length": 4096, "time_s": t, "peak_rss_mb": mb, "threads": 2}
        for impl, t, mb in (
            ("longformer", 40.0, 9000),
            ("sdpa", 28.0, 4000),
            ("floor", 12.0, 3800),
            ("longattn", 15.0, 3900),
        )
    ]
    text = benchmark.model_report(args, results, "python scripts/benchmark.py --models roberta-4k")
    assert "| longattn | 15.0 | 3900 | 3.0 | 1.50x | 2.67x | 0.97 |" in text  # ideal (28 - 12) / 8 = 2 s
    assert "Ideal attention cost: 2.00 s." in text


def test_model_rounds_alternate_rows_and_report_the_median(benchmark, monkeypatch, tmp_path):
    """`--rounds 3`: rows measured round by round (sdpa, floor, sdpa, floor, ...), each row's median round counts."""
    launched, times = [], {"sdpa": iter([30.0, 10.0, 20.0]), "floor": iter([5.0, 7.0, 6.0])}

    def run_model_row(args, row, length):
        launched.append((row, args.clock, args.threads))
        return {"impl": row, "length": length, "time_s": next(times[row]), "peak_rss_mb": 100.0, "threads": 1}

    monkeypatch.setattr(benchmark, "run_model_row", run_model_row)
    out = tmp_path / "report.json"
    benchmark.main(
        ["--models", "roberta-4k", "--rows", "sdpa", "floor", "--rounds", "3", "--clock", "cpu", "--threads", "1"]
        + ["--json", str(out)]
    )
    assert launched == [("sdpa", "cpu", 1), ("floor", "cpu", 1)] * 3
    results = {r["impl"]: r for r in json.loads(out.read_text())}
    assert results["sdpa"]["time_s"] == 20.0 and results["sdpa"]["round_times_s"] == [30.0, 10.0, 20.0]
    assert results["floor"]["time_s"] == 6.0


def test_longattn_rows_are_the_longattn_kinds(benchmark):
    """`--against` duplicates exactly the longattn kinds (peers and transformers' layers are measured once)."""
    assert benchmark.LONGATTN_IMPLS == {
        name for name, impl in benchmark.IMPLS.items() if impl.description.startswith("longattn ")
    }


def test_against_interleaves_old_rows_that_import_the_exported_tree(benchmark, monkeypatch):
    launched = []

    def run_one(args, impl, length, mode, compiled=False):
        command, env = benchmark.worker_launch(args, impl, length, mode, compiled)
        root = Path(env[benchmark.PACKAGE_ROOT_VARIABLE])
        launched.append((impl, command, root, (root / "longattn" / "__init__.py").is_file()))
        return {"impl": impl, "length": length, "mode": mode, "error": "not run"}

    monkeypatch.setattr(benchmark, "run_one", run_one)
    benchmark.main(
        ["--lengths", "64", "128", "--mode", "fwd", "--impls", "full", "hf-longformer", "sliding", "--against", "HEAD"]
    )
    head = subprocess.run(
        ["git", "-C", str(benchmark.REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
    ).stdout.strip()
    rows = [f"full@{head}", "full", "hf-longformer", f"sliding@{head}", "sliding"]
    assert [impl for impl, *_ in launched] == rows * 2  # old just before new at every length; the peer once
    exported = {root for impl, _, root, _ in launched if "@" in impl}
    assert len(exported) == 1
    (export,) = exported
    assert not export.is_relative_to(benchmark.REPO)
    for impl, command, root, has_package in launched:
        # The worker script is the current one, measuring the plain kind; only the package comes from the export.
        assert command[1] == str(SCRIPT) and command[command.index("--impl") + 1] == impl.partition("@")[0]
        assert root == (export if "@" in impl else benchmark.REPO) and has_package
    assert not export.exists()  # removed when the run ends


def test_against_refuses_unknown_revisions_and_runs_without_kinds(benchmark, monkeypatch, capsys):
    measured = _record_runs(benchmark, monkeypatch)
    for argv, message in (
        (["--impls", "full", "--against", "no-such-revision"], "is not a git revision"),
        (["--impls", "hf-longformer", "--against", "HEAD"], "give at least one of"),
    ):
        with pytest.raises(SystemExit) as exit_info:
            benchmark.main(["--lengths", "64", "--mode", "fwd", *argv])
        assert exit_info.value.code == 2 and message in capsys.readouterr().err
    assert measured == []


def test_worker_that_imported_another_longattn_is_an_error(benchmark, monkeypatch, tmp_path):
    args = _worker_args(benchmark, tmp_path)
    imported = str(benchmark.REPO / "longattn" / "__init__.py")  # this checkout's package, not the export's

    def run(command, **kwargs):
        result = {"impl": "full", "length": 64, "mode": "fwd", "time_s": 1.0, "longattn_file": imported}
        return subprocess.CompletedProcess(command, 0, stdout=json.dumps(result), stderr="")

    monkeypatch.setattr(benchmark.subprocess, "run", run)
    assert "error" not in benchmark.run_one(args, "full", 64, "fwd")
    old = benchmark.run_one(args, "full@abc1234", 64, "fwd")
    assert old["impl"] == "full@abc1234" and old["error"] == f"imported longattn from {imported}, not from {tmp_path}"


def test_kind_or_field_missing_in_a_revision_is_an_error(benchmark):
    args = _layer_args(benchmark, length=64)
    with pytest.raises(ValueError, match="kind 'no_such_kind' does not exist in this revision of longattn"):
        benchmark._longattn_kind("no_such_kind")(args)
    with pytest.raises(ValueError, match="config field.s. no_such_field do not exist in this revision"):
        benchmark._longattn_kind("full", no_such_field=1)(args)


def _report_args(benchmark, impls, mode, lengths, **fields):
    """`_layer_args` as `report` reads them: `impls` against the baseline `full` in `mode` at `lengths`, glibc, not
    compiled; `fields` over them."""
    report = dict(impls=impls, mode=[mode], lengths=lengths, baseline="full", allocator="glibc", compile=False)
    return _layer_args(benchmark, **report, **fields)


def test_report_has_after_vs_before_ratios(benchmark):
    against = dict(against="main~1", against_hash="abc1234", after="working tree at def5678")
    args = _report_args(benchmark, ["full", "sliding", "routing"], "fwd", [64, 128], repeats=3, **against)

    def row(impl, length, time_s, peak):
        return {
            "impl": impl,
            "length": length,
            "mode": "fwd",
            "time_s": time_s,
            "peak_rss_mb": peak,
            "tensor_peak_mb": peak / 2,
            "other_load": 0.0,
        }

    results = [
        row("full@abc1234", 64, 2.0, 10),
        row("full", 64, 1.0, 5),
        row("full@abc1234", 128, 2.0, 10),
        row("full", 128, 4.0, 10),
        row("sliding@abc1234", 64, 1.0, 10),
        row("sliding", 64, 1.0, 10),
        {
            "impl": "routing@abc1234",
            "length": 64,
            "mode": "fwd",
            "error": "ValueError: kind 'routing' does not exist in this revision of longattn",
        },
        row("routing", 64, 1.0, 10),
    ]
    text = benchmark.report(args, results, "python scripts/benchmark.py --against main~1")
    assert "After: working tree at def5678; before: `main~1` (abc1234)." in text
    assert "| full | 64 | 2.000 | 1.000 | 0.50 | 10 | 5 | 0.50 | 0.50 |" in text
    assert "| full | 128 | 2.000 | 4.000 | 2.00 | 10 | 10 | 1.00 | 1.00 |" in text
    assert "| routing | 64 | before: ValueError: kind 'routing' does not exist in this revision of longattn |" in text
    assert "geometric mean over the lengths: `full` 1.00, `sliding` 1.00." in text
    table = text.split("### after vs before")[0]
    assert table.index("| full@abc1234 | 64 |") < table.index("| full | 64 |") < table.index("| sliding@abc1234 | 64 |")


@pytest.mark.slow  # one worker process: imports torch and transformers (about 4 s of CPU)
def test_real_worker_of_an_old_row_imports_the_export(benchmark, tmp_path):
    """One real worker (length 64) of `full@HEAD` measures the package exported from git, not this checkout's."""
    short = benchmark.export_revision("HEAD", tmp_path)
    args = _worker_args(benchmark, tmp_path)
    result = benchmark.run_one(args, f"full@{short}", 64, "fwd")
    assert "error" not in result, result
    assert Path(result["longattn_file"]) == tmp_path.resolve() / "longattn" / "__init__.py"


def test_attention_work_comes_from_the_growth_models(benchmark):
    """Dense: 2·D per (query, key) pair; a kind: growth.py's FLOP model without the projections; else None."""
    args = benchmark.argparse.Namespace(hidden=32, heads=2, window=16)
    assert benchmark.attention_work("full", 256, args) == 2 * 32 * 256**2
    assert benchmark.attention_work("lsh", 256, args) == 2 * 32 * 256 * 2 * 2 * 64  # n·r·2c pairs
    sliding = benchmark.attention_work("sliding", 256, args)
    assert 2 * 32 * 256 * 20 < sliding < 2 * 32 * 256 * 33  # at most 2w + 1 keys a query, fewer at the ends
    assert benchmark.attention_work("synthesizer", 256, args) is None


def _layer_row(impl, length, time_s, peak=10.0, mode="fwdbwd"):
    return {"impl": impl, "length": length, "mode": mode, "time_s": time_s, "peak_rss_mb": peak, "other_load": 0.0}


def test_report_has_cost_over_ideal_for_every_kind(benchmark):
    """ideal = floor + (full - floor) x share; time / ideal and attention cost / ideal attention per kind."""
    args = _report_args(benchmark, ["floor", "full", "lsh", "synthesizer"], "fwdbwd", [512], repeats=1, rounds=3)
    # lsh at 512 tokens keeps 2 hashes x 128 keys a query: share 256 / 512 = 0.5 of dense.
    results = [
        _layer_row("floor", 512, 1.0, peak=5.0),
        _layer_row("full", 512, 5.0, peak=20.0),
        _layer_row("lsh", 512, 4.5, peak=22.0),
        _layer_row("synthesizer", 512, 6.0),
    ]
    text = benchmark.report(args, results, "python scripts/benchmark.py")
    section = text.split("### cost / ideal (fwdbwd)")[1]
    assert "| full | 512 | 5.000 | 1.0000 | 5.000 | 1.00x | 1.00x | 1.00 |" in section
    # ideal 1 + 4 x 0.5 = 3 s: 1.5x; attention 3.5 s over 2 s: 1.75x; peak 22 / 20
    assert "| lsh | 512 | 4.500 | 0.5000 | 3.000 | 1.50x | 1.75x | 1.10 |" in section
    assert "| synthesizer | 512 | 6.000 | — | — | — | — | 0.50 |" in section
    assert "| floor |" not in section
    assert "At 512 tokens, 1 of 1 kinds within 1.5x their ideal." in section
    assert "the median of 3 rounds" in text and "vector extensions:" in text

    results[2] = _layer_row("lsh", 512, 6.0)
    section = benchmark.report(args, results, "python scripts/benchmark.py").split("### cost / ideal")[1]
    assert "At 512 tokens, 0 of 1 kinds within 1.5x their ideal; above it: `lsh` 2.00x." in section
    # Without the floor there is no ideal.
    section = benchmark.report(args, results[1:], "python scripts/benchmark.py").split("### cost / ideal")[1]
    assert "| lsh | 512 | 6.000 | — |" in section and "No ideal: measure the rows `floor` and `full`" in section


def test_layer_rounds_alternate_rows_and_report_the_median(benchmark, monkeypatch, tmp_path):
    """`--rounds 3` on the one-layer table: every row once per round, in turn; each row's median round counts."""
    launched, times = [], {"floor": iter([1.0, 3.0, 2.0]), "full": iter([9.0, 5.0, 7.0])}

    def run_one(args, impl, length, mode, compiled=False):
        launched.append(impl)
        return {**_layer_row(impl, length, next(times[impl]), mode=mode), "tensor_peak_mb": None}

    monkeypatch.setattr(benchmark, "run_one", run_one)
    out = tmp_path / "report.json"
    benchmark.main(
        ["--lengths", "64", "--mode", "fwdbwd", "--impls", "floor", "full", "--rounds", "3", "--json", str(out)]
        + ["--baseline", "full", "--hidden", "32", "--heads", "2", "--window", "16"]
    )
    assert launched == ["floor", "full"] * 3
    results = {r["impl"]: r for r in json.loads(out.read_text())}
    assert results["floor"]["time_s"] == 2.0 and results["floor"]["round_times_s"] == [1.0, 3.0, 2.0]
    assert results["full"]["time_s"] == 7.0


def test_floor_keeps_the_projections_and_drops_the_attention(benchmark):
    import torch

    args = _layer_args(benchmark, length=64)
    assert "floor" not in benchmark.LONGATTN_IMPLS  # measured once, not again on an `--against` revision
    layer = benchmark.IMPLS["floor"].build(args)
    x = torch.randn(1, 64, 32, requires_grad=True)
    module = layer.module
    expected = module.o_proj(module.v_proj(x))
    torch.testing.assert_close(layer(x), expected)
    layer(x).sum().backward()
    assert module.q_proj.weight.grad is not None and module.k_proj.weight.grad is not None
