"""`scripts/gpu_run.sh`, the prepared GPU run, dry-run on CPU: its parts and their time limits, the results file
written as results come, the skip messages, the report and the doc converter; the GPU parts skipped.

The figures themselves need a GPU (the script's `tests`, `targets` and `training` parts); what can be computed
without one is checked here: the ideal time's pair count against the materialised pattern, the targets' verdicts,
the pytest lines the tests part reads, the training steps' comparison, and (marked slow) the training part's recipe
steps on CPU.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import child_processes
import pytest
from script_loading import load_script

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def gpu_run():
    return load_script("scripts/gpu_run.py", "longattn_gpu_run_script")


def _records(path: Path, kind: str | None = None) -> list[dict]:
    records = [json.loads(line) for line in path.read_text().splitlines()]
    return [r for r in records if kind is None or r["kind"] == kind]


def test_dry_run_on_cpu_skips_the_gpu_parts_and_writes_results_and_report(gpu_run, tmp_path):
    out = tmp_path / "out"
    env = {**os.environ, "PYTHON": sys.executable, "CUDA_VISIBLE_DEVICES": ""}
    start = time.monotonic()
    result = child_processes.run(
        ["bash", str(REPO / "scripts" / "gpu_run.sh"), "--out", str(out), "--work", str(tmp_path)],
        timeout=120,
        env=env,
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert time.monotonic() - start < 60
    # The parts, their limits within the whole run's 7 minutes.
    (run,) = _records(out / "results.jsonl", "run")
    assert set(run["limits"]) == {"environment", "tests", "targets", "training"}
    assert sum(run["limits"].values()) <= run["total_limit"] <= 420
    parts = {r["name"]: r for r in _records(out / "results.jsonl", "part")}
    assert parts["environment"]["status"] == "ok"
    assert parts["environment"]["seconds"] <= parts["environment"]["limit"]
    for name in ("tests", "targets", "training"):
        assert parts[name]["status"] == "skipped: no CUDA device"
        assert f"SKIPPED part {name}: no CUDA device (torch.cuda.is_available() is False)" in result.stdout
    # The environment, versions read without importing.
    (environment,) = _records(out / "results.jsonl", "environment")
    assert environment["cuda"] is False and environment["triton_interpret"] == "0"
    assert environment["versions"]["torch"] and "deepspeed" in environment["versions"]
    for name, version in environment["versions"].items():
        if version is None:
            assert f"SKIPPED {name}: not installed" in result.stdout
    # Everything printed is in the log; the report renders the results file.
    log = (out / "run.log").read_text()
    assert "=== part environment (limit 30 s)" in log and "packages: torch" in log
    report = (out / "report.md").read_text()
    assert report == gpu_run.render(_records(out / "results.jsonl"))
    assert "| tests | 140 | 0 | skipped: no CUDA device |" in report
    assert "- part training: no CUDA device" in report


def test_a_part_past_its_limit_is_ended_with_what_it_started_and_keeps_what_it_printed(gpu_run, tmp_path):
    # The part prints a result, starts a grandchild in a session of its own (as torch's elastic launcher starts its
    # ranks), then hangs: at its limit both end, and the printed line is in the log.
    pid_file = tmp_path / "grandchild.pid"
    code = (
        "import subprocess, sys, time\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'], start_new_session=True)\n"
        f"open({str(pid_file)!r}, 'w').write(str(child.pid))\n"
        "print('first result', flush=True)\n"
        "time.sleep(120)\n"
    )
    results = gpu_run.Results(tmp_path / "results.jsonl")
    start = time.monotonic()
    with (tmp_path / "run.log").open("a") as log:
        record = gpu_run.run_part("slow", [sys.executable, "-c", code], limit=4, log=log, results=results)
    assert time.monotonic() - start < 15
    assert record["status"] == "timed out after 4 s"
    assert "first result" in (tmp_path / "run.log").read_text()
    assert _records(tmp_path / "results.jsonl", "part") == [record]
    grandchild = int(pid_file.read_text())
    for _ in range(50):  # reaped by init a moment later
        if not Path(f"/proc/{grandchild}").exists() or "Z" in Path(f"/proc/{grandchild}/stat").read_text().split()[2]:
            break
        time.sleep(0.1)
    else:
        pytest.fail("the part's grandchild outlived the part's limit")


def test_a_failing_part_is_a_failure_and_the_next_part_still_runs(gpu_run, tmp_path):
    results = gpu_run.Results(tmp_path / "results.jsonl")
    with (tmp_path / "run.log").open("a") as log:
        failed = gpu_run.run_part("bad", [sys.executable, "-c", "raise SystemExit(3)"], limit=30, log=log,
                                  results=results)  # fmt: skip
        ok = gpu_run.run_part("good", [sys.executable, "-c", "print('fine')"], limit=30, log=log, results=results)
    assert failed["status"] == "failed (exit status 3)" and gpu_run._is_failure(failed)
    assert ok["status"] == "ok" and not gpu_run._is_failure(ok)


def test_part_limits_fit_the_whole_run(gpu_run):
    limits = gpu_run.part_limits(gpu_run.PARTS, gpu_run.TOTAL_LIMIT, {})
    assert limits == {part.name: part.limit for part in gpu_run.PARTS}  # the defaults fit as they are
    assert sum(limits.values()) <= gpu_run.TOTAL_LIMIT - gpu_run.REPORT_RESERVE
    longer = gpu_run.part_limits(gpu_run.PARTS, gpu_run.TOTAL_LIMIT, {"targets": 400})
    assert sum(longer.values()) == pytest.approx(gpu_run.TOTAL_LIMIT - gpu_run.REPORT_RESERVE)
    assert longer["targets"] > limits["targets"] and longer["tests"] < limits["tests"]
    with pytest.raises(SystemExit):
        gpu_run.main(["--limit", "nonsense=3"])


def test_visible_pairs_count_the_materialised_pattern(gpu_run):
    import torch

    from longattn import patterns

    n = 70
    for window, dilation, padded in [(5, (1,), 0), (4, (1, 2, 4, 8), 0), (6, (3,), 9), (3, (2, 1), 7)]:
        key_padding_mask = torch.ones(1, n, dtype=torch.bool)
        key_padding_mask[0, n - padded :] = False
        pattern = patterns.sliding_window_pattern(
            window=window, dilation=dilation if len(dilation) > 1 else dilation[0], key_padding_mask=key_padding_mask
        )
        mask = patterns.materialize_mask(pattern, batch=1, heads=len(dilation), q_len=n, kv_len=n, device="cpu")
        assert gpu_run.visible_pairs(n, window, dilation, padded_keys=padded) == int(mask.sum())
    # Global tokens: a row and a column each, per head; the ideal time is the FLOPs at the matmul rate.
    assert gpu_run.visible_pairs(n, 5, (1,), global_tokens=2) == gpu_run.visible_pairs(n, 5, (1,)) + 2 * 2 * n
    assert gpu_run.ideal_ms(10**9, 64, 1000.0) == pytest.approx(4 * 64 * 3.5 * 10**9 / 1e15 * 1e3)


def test_verdicts_say_met_missed_or_unmeasured(gpu_run):
    plain, mix, masked, _ = (t.name for t in gpu_run.TARGETS)
    rows = {
        plain: {"ideal_ms": 1.0, "ms": {"triton": 1.5, "flex": 3.0}},
        mix: {"ideal_ms": 1.0, "ms": {"triton": 2.0, "flex": 5.0}},
        masked: {"ideal_ms": 1.0, "ms": {}},
    }
    assert [v["met"] for v in gpu_run.verdicts(rows)] == ["yes", "yes", "no", "unmeasured"]
    assert [v["measured"] for v in gpu_run.verdicts(rows)] == [1.5, 2.0, 2.5, None]


def test_pytest_output_lines_become_records(gpu_run):
    parse = gpu_run.parse_pytest_line
    assert parse("tests/test_triton_band.py::test_on_gpu[torch.bfloat16-causal] PASSED          [ 50%]\n") == (
        "test",
        {"id": "tests/test_triton_band.py::test_on_gpu[torch.bfloat16-causal]", "outcome": "PASSED"},
    )
    assert parse("FAILED tests/test_backends.py::test_x[flex] - AssertionError: out differs") == (
        "test-failure",
        {"id": "tests/test_backends.py::test_x[flex]", "message": "AssertionError: out differs"},
    )
    assert parse("SKIPPED [2] tests/test_backends.py:936: could not import 'xformers'") == (
        "skip",
        {"what": "2 test(s) at tests/test_backends.py:936", "why": "could not import 'xformers'"},
    )
    assert parse("=========== 1 failed, 11 passed, 2 skipped in 75.20s (0:01:15) ===========") == (
        "test-summary",
        {"line": "1 failed, 11 passed, 2 skipped in 75.20s (0:01:15)"},
    )
    assert parse("[gw3] [ 75%] FAILED tests/test_packing.py::test_gpu[sliding-causal-flex] \n") == (
        "test",
        {"id": "tests/test_packing.py::test_gpu[sliding-causal-flex]", "outcome": "FAILED"},
    )
    assert parse("collected 14 items") is None
    assert gpu_run.gpu_test_files() == ["tests/test_backends.py", "tests/test_packing.py"]


def test_training_steps_are_compared_with_the_same_step_on_cpu(gpu_run):
    def step(name, status="ok", train=5.70, evaluation=5.11):
        return {"kind": "training-step", "step": name, "status": status, "train_loss": train, "eval_loss": evaluation}

    steps = {s.name: s for s in gpu_run.STEPS}
    ddp, fsdp, zero2, zero3, flex, xformers = (s.name for s in gpu_run.STEPS if not s.cpu)
    records = [
        step("cpu"),
        step(ddp, train=5.71, evaluation=5.12),
        step(fsdp, evaluation=5.30),
        step(zero2, status="skipped: deepspeed not installed"),
        step(zero3, status="failed (exit status 1)"),
        step(flex),
    ]
    rows = {row["step"]: row for row in gpu_run.training_rows(records)}
    assert rows["cpu"]["status"] == "ok"
    assert rows[ddp]["status"] == "ok" and rows[ddp]["eval_loss_difference"] == pytest.approx(0.01)
    assert rows[fsdp]["status"] == "differs from CPU by 0.190 (> 0.05)"
    assert rows[zero2]["status"] == "skipped: deepspeed not installed"
    assert rows[zero3]["status"] == "failed (exit status 1)"
    assert rows[flex]["status"] == "no CPU result (cpu packed) to compare with"
    assert rows[xformers]["status"] == "not finished (the part was cut)"
    assert gpu_run.training_rows([]) == []
    # The GPU steps launch the recipe configs on one process; the CPU steps run the recipe under plain python.
    for s in steps.values():
        command = gpu_run.step_command(s, Path("m"), Path("d"), Path("o"), 29500)
        assert command[command.index("--max_train_steps") + 1] == "1"
        if s.cpu:
            assert "accelerate.commands.launch" not in command and s.reference is None
        else:
            config = Path(command[command.index("--config_file") + 1])
            assert config.exists() and command[command.index("--num_processes") + 1] == "1"
            assert steps[s.reference].cpu and steps[s.reference].packing == s.packing


def test_report_and_doc_converter(gpu_run, tmp_path):
    plain = gpu_run.TARGETS[0].name
    records = [
        {"kind": "run", "command": "scripts/gpu_run.sh --out o", "started": "2026-01-01T00:00:00", "total_limit": 420},
        {"kind": "environment", "cuda": True, "gpu": "NVIDIA H200", "gpu_memory_gib": 140, "capability": "9.0",
         "torch": "2.11.0", "cuda_version": "13.0", "python": "3.12.3", "versions": {"triton": "3.6.0"}},
        {"kind": "backends", "auto": "flex", "backends": {"triton": "usable"}},
        {"kind": "part", "name": "targets", "limit": 130, "seconds": 131.0, "status": "timed out after 130 s"},
        {"kind": "test", "id": "tests/test_a.py::test_b", "outcome": "FAILED"},
        {"kind": "test-failure", "id": "tests/test_a.py::test_b", "message": "AssertionError: grad_q"},
        {"kind": "test-summary", "run": "r", "line": "1 failed in 3.00s"},
        {"kind": "matmul", "tflops": 790.0},
        {"kind": "target-row", "target": plain, "ideal_ms": 1.0},
        {"kind": "timing", "target": plain, "backend": "triton", "ms": 1.5, "peak_mb": 648},
        {"kind": "timing", "target": plain, "backend": "flex", "ms": 3.0},
        {"kind": "timing", "target": plain, "backend": "xformers", "error": "OutOfMemoryError: no"},
    ]  # fmt: skip
    report = gpu_run.render(records)
    assert "- GPU: NVIDIA H200, 140 GiB, compute capability 9.0" in report
    assert "- `auto` for a bf16 sliding window with gradients at 64K: `flex`\n- triton: usable" in report
    assert "| targets | 130 | 131.0 | timed out after 130 s |" in report
    assert "- FAILED `tests/test_a.py::test_b`: AssertionError: grad_q" in report
    assert f"| {plain} | 1.000 | 1.50 (648 MB) | 3.00 | error: OutOfMemoryError: no | n/a | 1.50 | 2.00 | — |" in report
    assert "| window 256: triton at least 1.4x faster than flex | 2.00 | yes |" in report
    results = tmp_path / "results.jsonl"
    results.write_text("".join(json.dumps(r) + "\n" for r in records) + '{"kind": "cut sho')  # a line cut short
    doc = tmp_path / "doc.md"
    doc.write_text(f"# head\n\n{gpu_run.BEGIN}\nold\n{gpu_run.END}\n\n## tail\n")
    assert gpu_run.main(["--to-doc", str(results), "--doc", str(doc)]) == 0
    assert doc.read_text() == f"# head\n\n{gpu_run.BEGIN}\n{report}{gpu_run.END}\n\n## tail\n"
    doc.write_text("no markers\n")
    with pytest.raises(SystemExit, match="no '<!-- gpu_run: begin -->'"):
        gpu_run.write_doc(results, doc)
    # The real page has the section the converter replaces.
    text = (REPO / "docs" / "benchmarks_gpu.md").read_text()
    assert text.count(gpu_run.BEGIN) == 1 and text.index(gpu_run.BEGIN) < text.index(gpu_run.END)


@pytest.mark.slow
def test_training_part_runs_recipe_steps_on_cpu_and_compares_them(gpu_run, tmp_path, monkeypatch):
    # The GPU part's own code with one CPU step, compared with itself: a saved model the step loads, the recipe's
    # flags, all_results.json read back, the comparison (no difference).
    monkeypatch.setattr(gpu_run, "STEPS", (gpu_run.Step("cpu", None, "cpu", cpu=True),))
    monkeypatch.setenv("GPU_RUN_DEADLINE", str(time.time() + 400))
    results = gpu_run.Results(tmp_path / "results.jsonl")
    gpu_run.part_training(results, tmp_path / "work")
    rows = gpu_run.training_rows(_records(tmp_path / "results.jsonl"))
    assert [row["status"] for row in rows] == ["ok"], rows
    assert rows[0]["train_loss_difference"] == 0 and rows[0]["eval_loss_difference"] == 0
    assert rows[0]["distributed_type"] == "NO" and rows[0]["mixed_precision"] == "no"
    assert abs(rows[0]["train_loss"] - rows[0]["eval_loss"]) > 5 * gpu_run.LOSS_TOLERANCE  # the step moves the loss


def test_gpu_run_sh_installs_nothing_and_compiles_triton():
    text = (REPO / "scripts" / "gpu_run.sh").read_text()
    assert "TRITON_INTERPRET=0" in text
    assert not any(word in text for word in ("pip ", "install ", "apt-get", "conda "))
    assert subprocess.run(["bash", "-n", str(REPO / "scripts" / "gpu_run.sh")]).returncode == 0


@pytest.mark.slow
def test_targets_part_runs_on_cpu_at_a_small_size(gpu_run, tmp_path, monkeypatch):
    # The part's own code at 1100 tokens on CPU: the cases of gpu_check, the ideal, each back end timed or declined
    # with its reason (FlexAttention takes no gradients on CPU, xformers needs CUDA, Triton's interpreter no bf16).
    small = dict(DEVICE="cpu", TARGET_LENGTH=1100, TARGET_HEADS=4, TARGET_HEAD_DIM=16, MATMUL_SIZE=128)
    for name, value in small.items():
        monkeypatch.setattr(gpu_run, name, value)
    monkeypatch.setenv("GPU_RUN_DEADLINE", str(time.time() + 300))
    results = gpu_run.Results(tmp_path / "results.jsonl")
    gpu_run.part_targets(results)
    records = _records(tmp_path / "results.jsonl")
    timings = [r for r in records if r["kind"] == "timing"]
    assert {r["target"] for r in timings} == {t.name for t in gpu_run.TARGETS}
    assert all(r["backend"] == "torch" and r["ms"] > 0 for r in timings), timings
    declined = {r["what"] for r in records if r["kind"] == "skip"}
    assert {f"{t.name} on {b}" for t in gpu_run.TARGETS for b in ("flex", "xformers", "triton")} == declined
    ideals = {r["target"]: r["ideal_ms"] for r in records if r["kind"] == "target-row"}
    assert ideals[gpu_run.TARGETS[3].name] > ideals[gpu_run.TARGETS[0].name] > 0  # window 512 over 256
    assert [r["met"] for r in records if r["kind"] == "verdict"] == ["unmeasured"] * 4
    report = gpu_run.render(records)
    assert f"| {gpu_run.TARGETS[0].name} | " in report and "| target | measured | met? |" in report
