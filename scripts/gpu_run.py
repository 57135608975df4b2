"""One prepared GPU run: check and measure every GPU path of longattn in at most 7 minutes, printing as it goes.

    bash scripts/gpu_run.sh --out runs/gpu_run          # on the GPU machine, from a fresh copy of the working tree
    python scripts/gpu_run.py --to-doc runs/gpu_run/results.jsonl    # then, anywhere: docs/benchmarks_gpu.md

The run is made of parts, each in a process of its own with its own time limit (a part past its limit is ended with
every process it started, and the run goes on with the next part), their limits together within the whole run's:

1. `environment`: the GPU, torch, CUDA, Triton, xformers, transformers, accelerate, DeepSpeed and datasets versions,
   what each back end says about a bf16 sliding window, and what the later parts will skip for lack of a package
   (nothing is installed: the GPU machine reaches no package registry).
2. `tests`: `tests/test_triton_band.py` (Triton compiled, interpreter off) and every test marked `gpu`
   (bf16, fp16 and fp32 against the dense reference, outputs and gradients); each test's outcome as it finishes.
3. `targets`: the Triton back end's targets at 64K tokens (bf16, 16 heads of 64, forward + backward): window 256
   and 512, the dilation mix [1, 2, 4, 8] across heads, window 256 with global tokens and padding, on torch / flex /
   xformers / triton, beside the ideal time (the visible pairs' FLOPs at the device's measured dense-matmul rate),
   with the ratios and each target met or not.
4. `training`: one optimizer step of `recipes/run_clm.py` with a small sliding-window model under each recipe config
   on one GPU (DDP, FSDP2, DeepSpeed ZeRO-2 and ZeRO-3), and packed batches on FlexAttention and on xformers, each
   against the same step on CPU (same weights, same batch): the loss of the step and the evaluation loss after it.

Every result is one JSON line appended to `OUT/results.jsonl` the moment it is known (a cut run keeps what it had),
`OUT/run.log` holds everything printed, and `OUT/report.md` is the report rendered from the results file (the same
text `--to-doc` writes into docs/benchmarks_gpu.md). Without CUDA the GPU parts are skipped, each saying why (the
CPU test suite runs the script so, tests/test_gpu_run.py).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "benchmarks_gpu.md"
BEGIN, END = "<!-- gpu_run: begin -->", "<!-- gpu_run: end -->"


@dataclass(frozen=True)
class Part:
    """One part of the run: `limit` seconds at most; `gpu` parts are skipped where CUDA is not available."""

    name: str
    limit: float
    gpu: bool
    what: str


PARTS = (
    Part("environment", 30, False, "versions, back ends, what will be skipped"),
    Part("tests", 140, True, "tests/test_triton_band.py and every gpu-marked test"),
    Part("targets", 130, True, "the targets' table at 64K tokens"),
    Part("training", 100, True, "one step of each recipe config and of packed batches, against CPU"),
)
TOTAL_LIMIT = 420.0  # seconds: 7 minutes for the whole run
REPORT_RESERVE = 10.0  # seconds kept at the end for the report


# ------------------------------------------------------------------------------------------------ results
class Results:
    """The results file: one JSON object per line, appended and flushed as each result is known."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()

    def add(self, kind: str, **fields) -> dict:
        record = {"kind": kind, "part": os.environ.get("GPU_RUN_PART", "run"), **fields}
        with self._lock, self.path.open("a") as f:
            f.write(json.dumps(record, default=str) + "\n")
            f.flush()
        return record

    def skip(self, what: str, why: str) -> None:
        """Record and print what is skipped and why."""
        self.add("skip", what=what, why=why)
        print(f"SKIPPED {what}: {why}", flush=True)


def read_results(path: Path) -> list[dict]:
    """The records of a results file; a line cut short by a killed writer is left out."""
    records = []
    for line in Path(path).read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


# ------------------------------------------------------------------------------------------------ processes
def _children_by_parent() -> dict[int, list[int]]:
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue
        parent = int(text.rpartition(")")[2].split()[1])
        children.setdefault(parent, []).append(int(stat.parent.name))
    return children


def kill_tree(pid: int) -> None:
    """SIGKILL `pid` and every process below it, whatever session each runs in (torch.distributed.elastic puts each
    rank in a session of its own, out of reach of a process-group kill). The tree is stopped first, then killed."""
    for sig in (signal.SIGSTOP, signal.SIGKILL):
        children, tree = _children_by_parent(), [pid]
        for process in tree:
            tree.extend(children.get(process, []))
        for process in tree:
            try:
                os.kill(process, sig)
            except (ProcessLookupError, PermissionError):
                pass


RUNNING: list[int] = []  # the pid of the part running now (the orchestrator's SIGTERM handler ends its tree)


def _end_running_part(signum, frame):
    for pid in RUNNING:
        kill_tree(pid)
    raise SystemExit(128 + signum)


def run_part(name: str, command: list[str], *, limit: float, log, results: Results, env: dict | None = None) -> dict:
    """Run `command` as part `name` for at most `limit` seconds, its output printed and logged line by line as it
    comes; past the limit it is ended with every process it started. Records and returns the part's outcome."""
    start = time.monotonic()
    print(f"=== part {name} (limit {limit:.0f} s)", flush=True)
    log.write(f"=== part {name} (limit {limit:.0f} s)\n")
    process = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        errors="replace",
        bufsize=1,
        cwd=REPO,
        env={**os.environ, **(env or {}), "GPU_RUN_PART": name, "PYTHONUNBUFFERED": "1"},
        start_new_session=True,
    )

    def copy_output():
        for line in process.stdout:
            sys.stdout.write(line)
            sys.stdout.flush()
            log.write(line)
            log.flush()

    reader = threading.Thread(target=copy_output, daemon=True)
    reader.start()
    RUNNING[:] = [process.pid]
    try:
        returncode = process.wait(timeout=limit)
        status = "ok" if returncode == 0 else f"failed (exit status {returncode})"
    except subprocess.TimeoutExpired:
        kill_tree(process.pid)
        process.wait()
        status = f"timed out after {limit:.0f} s"
    RUNNING.clear()
    reader.join(timeout=5)
    seconds = time.monotonic() - start
    print(f"=== part {name}: {status}, {seconds:.1f} s", flush=True)
    log.write(f"=== part {name}: {status}, {seconds:.1f} s\n")
    log.flush()
    return results.add("part", name=name, status=status, seconds=round(seconds, 1), limit=round(limit, 1))


def part_limits(parts, total: float, overrides: dict[str, float]) -> dict[str, float]:
    """Each part's limit: its own (or the override), scaled down together where they would exceed the total."""
    limits = {part.name: overrides.get(part.name, part.limit) for part in parts}
    budget = total - REPORT_RESERVE
    scale = min(1.0, budget / max(sum(limits.values()), 1e-9))
    return {name: limit * scale for name, limit in limits.items()}


def orchestrate(args) -> int:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for stale in ("results.jsonl", "run.log", "report.md"):
        (out / stale).unlink(missing_ok=True)
    results = Results(out / "results.jsonl")
    overrides = dict(args.limit or [])
    parts = [part for part in PARTS if args.parts is None or part.name in args.parts]
    limits = part_limits(parts, args.total, overrides)
    deadline = time.monotonic() + args.total - REPORT_RESERVE
    results.add(
        "run",
        started=datetime.datetime.now().isoformat(timespec="seconds"),
        command=" ".join(["scripts/gpu_run.sh", *(args.argv or [])]),
        total_limit=args.total,
        limits={name: round(limit, 1) for name, limit in limits.items()},
    )
    print(
        f"gpu_run: parts {', '.join(f'{n} ({lim:.0f} s)' for n, lim in limits.items())}; whole run {args.total:.0f} s"
    )
    cuda = None
    signal.signal(signal.SIGTERM, _end_running_part)  # the backstop `timeout` of gpu_run.sh
    with (out / "run.log").open("a") as log:
        for part in parts:
            limit = min(limits[part.name], deadline - time.monotonic())
            if part.gpu and cuda is False:
                results.skip(f"part {part.name}", "no CUDA device (torch.cuda.is_available() is False)")
                results.add("part", name=part.name, status="skipped: no CUDA device", seconds=0, limit=limit)
                continue
            if limit < 5:
                results.skip(f"part {part.name}", "the whole run's time limit is spent")
                results.add("part", name=part.name, status="skipped: no time left", seconds=0, limit=limit)
                continue
            command = [sys.executable, str(Path(__file__).resolve()), "--part", part.name, "--out", str(out)]
            env = {"GPU_RUN_DEADLINE": str(time.time() + limit), "GPU_RUN_WORK": str(args.work)}
            run_part(part.name, command, limit=limit, log=log, results=results, env=env)
            if part.name == "environment":
                found = [r for r in read_results(out / "results.jsonl") if r["kind"] == "environment"]
                cuda = bool(found[-1].get("cuda")) if found else None
    report = render(read_results(out / "results.jsonl"))
    (out / "report.md").write_text(report)
    records = read_results(out / "results.jsonl")
    failed = [r for r in records if _is_failure(r)]
    failed += [r for r in training_rows(records) if r["status"] != "ok" and not r["status"].startswith("skipped")]
    print(f"gpu_run: wrote {out / 'results.jsonl'} and {out / 'report.md'}; {len(failed)} failure(s)", flush=True)
    return 1 if failed else 0


def _is_failure(record: dict) -> bool:
    if record["kind"] == "part":
        return not (record["status"] == "ok" or record["status"].startswith("skipped"))
    if record["kind"] == "test":
        return record["outcome"] in ("FAILED", "ERROR")
    return False


def seconds_left() -> float:
    """Seconds to this part's deadline (set by the orchestrator), a large number when run alone."""
    deadline = os.environ.get("GPU_RUN_DEADLINE")
    return float(deadline) - time.time() if deadline else 1e9


# ------------------------------------------------------------------------------------------------ part 1
PACKAGES = {
    # distribution: what the run skips without it
    "torch": "everything",
    "triton": "the triton back end (tests and timings)",
    "xformers": "the xformers back end: its tests, its timings and the packed xformers step",
    "transformers": "the models and recipes",
    "accelerate": "the recipe steps",
    "datasets": "the recipe steps (the recipes load their data through it)",
    "deepspeed": "the DeepSpeed ZeRO-2 and ZeRO-3 steps",
    "pytest": "the tests part",
    "pytest-timeout": "nothing (the tests then run without a per-test time limit)",
    "pytest-xdist": "nothing (the tests then run in one process, slower)",
}


def package_versions() -> dict[str, str | None]:
    """Installed version of each package of `PACKAGES` (None where it is not installed), without importing it."""
    from importlib import metadata  # noqa: PLC0415

    versions = {}
    for name in PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def part_environment(results: Results) -> None:
    import torch  # noqa: PLC0415

    versions = package_versions()
    cuda = torch.cuda.is_available()
    info = {
        "cuda": cuda,
        "torch": torch.__version__,
        "cuda_version": torch.version.cuda,
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "triton_interpret": os.environ.get("TRITON_INTERPRET", "unset"),
        "versions": versions,
    }
    if cuda:
        properties = torch.cuda.get_device_properties(0)
        info.update(
            gpu=torch.cuda.get_device_name(0),
            gpu_memory_gib=round(properties.total_memory / 2**30),
            capability=f"{properties.major}.{properties.minor}",
            gpus=torch.cuda.device_count(),
            cudnn=torch.backends.cudnn.version(),
        )
    print(
        f"GPU: {info.get('gpu', 'none')}; torch {torch.__version__} (CUDA {torch.version.cuda}); Python "
        f"{info['python']}; TRITON_INTERPRET={info['triton_interpret']}"
    )
    print("packages: " + ", ".join(f"{name} {version or 'not installed'}" for name, version in versions.items()))
    for name, version in versions.items():
        if version is None and name != "torch":
            results.skip(name, f"not installed, and nothing is installed here: skips {PACKAGES[name]}")
    results.add("environment", **info)  # first: the orchestrator reads `cuda` from it, whatever fails below
    if not cuda:
        results.skip("the GPU parts", "no CUDA device (torch.cuda.is_available() is False)")
        return
    found = {}
    if versions["xformers"]:
        try:
            import xformers.ops  # noqa: F401, PLC0415
        except Exception as error:  # noqa: BLE001 - a broken install is a finding
            found["xformers_import"] = f"{type(error).__name__}: {error}"[:300]
            print(f"xformers import: {found['xformers_import']}")
    from longattn import backends  # noqa: PLC0415

    request = backends.AttentionRequest(
        pattern="sliding",
        device="cuda",
        dtype=torch.bfloat16,
        head_dim=64,
        value_head_dim=64,
        q_len=65536,
        kv_len=65536,
        heads=16,
        requires_grad=True,
    )
    found["backends"] = {}
    for name in ("torch", "flex", "xformers", "triton"):
        reasons = backends.backend_reasons(name, request)
        found["backends"][name] = "; ".join(reasons) if reasons else "usable"
        print(f"back end {name}: {found['backends'][name]}")
    found["auto"] = backends.select_backend("auto", request)
    print(f"auto for a bf16 sliding window with gradients: {found['auto']}")
    results.add("backends", **found)


# ------------------------------------------------------------------------------------------------ part 2
OUTCOMES = "PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS"
TEST_LINE = re.compile(rf"^(tests/\S+::\S+) ({OUTCOMES})\b")
XDIST_TEST_LINE = re.compile(rf"^\[gw\d+\] \[\s*\d+%\] ({OUTCOMES}) (tests/\S+::\S+)")
SHORT_SUMMARY = re.compile(r"^(FAILED|ERROR) (tests/\S+)(?: - (.*))?$")
SKIP_SUMMARY = re.compile(r"^SKIPPED \[(\d+)\] (\S+): (.*)$")
FINAL_LINE = re.compile(r"^=+ (.*\d+ \w+.* in [\d.]+s.*) =+$")


TEST_WORKERS = 4


def gpu_test_files() -> list[str]:
    """The test files holding a `gpu`-marked test, tests/test_triton_band.py left out (it runs whole)."""
    return sorted(
        str(path.relative_to(REPO))
        for path in (REPO / "tests").glob("test_*.py")
        if "mark.gpu" in path.read_text() and path.name != "test_triton_band.py"
    )


def parse_pytest_line(line: str) -> tuple[str, dict] | None:
    """A record for one line of `pytest -v -rfEs` output, or None."""
    line = line.rstrip()
    if match := TEST_LINE.match(line):
        return "test", {"id": match[1], "outcome": match[2]}
    if match := XDIST_TEST_LINE.match(line):
        return "test", {"id": match[2], "outcome": match[1]}
    if match := SHORT_SUMMARY.match(line):
        return "test-failure", {"id": match[2], "message": (match[3] or "")[:300]}
    if match := SKIP_SUMMARY.match(line):
        return "skip", {"what": f"{match[1]} test(s) at {match[2]}", "why": match[3][:300]}
    if match := FINAL_LINE.match(line):
        return "test-summary", {"line": match[1]}
    return None


def part_tests(results: Results) -> None:
    if package_versions()["pytest"] is None:
        results.skip("tests", "pytest is not installed")
        return
    runs = [("tests/test_triton_band.py (all of it)", ["tests/test_triton_band.py"])]
    files = gpu_test_files()
    runs.append((f"gpu-marked tests in {', '.join(files)}", ["-m", "gpu", *files]))
    for label, selection in runs:
        left = seconds_left() - 3
        if left < 10:
            results.skip(label, "the tests part's time limit is spent")
            continue
        command = [sys.executable, "-m", "pytest", "-v", "-rfEs", "-p", "no:cacheprovider", "-o", "timeout=100"]
        command += ["-o", "session_timeout=" + str(int(left)), *selection]
        if package_versions()["pytest-xdist"]:  # compiling kernels takes the CPU: four at a time on the GPU machine
            command += ["-n", str(TEST_WORKERS)]
        print("$ " + " ".join(command[1:]), flush=True)
        env = {**os.environ, "TRITON_INTERPRET": "0"}
        process = subprocess.Popen(
            command,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            cwd=REPO,
            env=env,
            errors="replace",
            bufsize=1,
        )
        for line in process.stdout:
            print(line, end="", flush=True)
            if parsed := parse_pytest_line(line):
                kind, fields = parsed
                results.add(kind, run=label, **fields)
        results.add("test-run", run=label, exit_status=process.wait())


# ------------------------------------------------------------------------------------------------ part 3
@dataclass(frozen=True)
class Target:
    """A row of the targets' table: a sliding window at `n` tokens, 16 heads of 64, bf16, forward + backward."""

    name: str
    window: int
    dilation: tuple[int, ...] = (1,)
    padding: bool = False
    global_tokens: bool = False


TARGETS = (
    Target("window 256", 256),
    Target("dilation mix 1,2,4,8 (window 256)", 256, dilation=(1, 2, 4, 8)),
    Target("window 256 + global tokens + padding", 256, padding=True, global_tokens=True),
    Target("window 512", 512),
)
TARGET_BACKENDS = ("triton", "flex", "xformers", "torch")
TARGET_LENGTH, TARGET_HEADS, TARGET_HEAD_DIM = 65536, 16, 64
MATMUL_SIZE = 8192
DEVICE = "cuda"  # tests/test_gpu_run.py runs the targets part on "cpu" at a small length (its code, not its figures)


def visible_pairs(n: int, window: int, dilations, *, padded_keys: int = 0, global_tokens: int = 0) -> int:
    """The (query, key) pairs a bidirectional dilated window sees, summed over heads (one dilation per head).

    Band pairs are exact: offset j * d (|j| <= window) pairs each query i with key i + j * d inside the sequence and
    not among the last `padded_keys` keys (padding is at the end, as `gpu_check._masks` pads). Each global token adds
    its row (every unpadded key) and its column (every query), a slight overcount where they meet the band.
    """
    valid = n - padded_keys
    pairs = 0
    for d in dilations:
        for j in range(-window, window + 1):
            pairs += max(0, min(n, n + j * d, valid) - max(0, j * d))
    return pairs + len(dilations) * global_tokens * (valid + n)


def ideal_ms(pairs: int, head_dim: int, matmul_tflops: float, *, backward: bool = True) -> float:
    """The time of the pairs' FLOPs at the dense matmul rate: the forward is 2 matmuls (QK^T, PV, 4 d FLOPs a pair),
    the backward 5 (QK^T again, dV, dP, dQ, dK), FlashAttention's accounting."""
    flops = 4 * head_dim * pairs * (3.5 if backward else 1.0)
    return flops / (matmul_tflops * 1e12) * 1e3


def verdicts(rows: dict[str, dict]) -> list[dict]:
    """The targets (issue 38) against the measured rows: `rows[target name]["ms"][backend]` in milliseconds and
    `rows[name]["ideal_ms"]`. A target with a missing figure is `unmeasured`."""

    def ms(name, backend):
        return rows.get(name, {}).get("ms", {}).get(backend)

    def verdict(target, value, limit, *, at_most):
        if value is None or not math.isfinite(value):
            return {"target": target, "measured": None, "met": "unmeasured"}
        met = value <= limit if at_most else value >= limit
        return {"target": target, "measured": round(value, 3), "met": "yes" if met else "no"}

    def ratio(a, b):
        return a / b if a is not None and b else None

    plain, mix, masked = (t.name for t in TARGETS[:3])
    return [
        verdict(
            "window 256: triton within 1.6x of the ideal time",
            ratio(ms(plain, "triton"), rows.get(plain, {}).get("ideal_ms")),
            1.6,
            at_most=True,
        ),
        verdict(
            "window 256: triton at least 1.4x faster than flex",
            ratio(ms(plain, "flex"), ms(plain, "triton")),
            1.4,
            at_most=False,
        ),
        verdict(
            "dilation mix: triton at least 3x faster than flex",
            ratio(ms(mix, "flex"), ms(mix, "triton")),
            3.0,
            at_most=False,
        ),
        verdict(
            "global tokens + padding: triton within 1.15x of the plain window",
            ratio(ms(masked, "triton"), ms(plain, "triton")),
            1.15,
            at_most=True,
        ),
    ]


def _synchronize() -> None:
    import torch  # noqa: PLC0415

    if DEVICE == "cuda":
        torch.cuda.synchronize()


def _cell_time(step, *, warmup: int, repeats: int, budget: float) -> tuple[float, float, int]:
    """Median milliseconds of `step()` over up to `repeats` runs after `warmup` (compilation included there), fewer
    where `budget` seconds run out (CUDA events; wall clock off CUDA); the peak MB allocated above what was before
    (nan off CUDA); the number of runs timed."""
    import torch  # noqa: PLC0415

    cuda = DEVICE == "cuda"
    start_wall = time.monotonic()
    for _ in range(warmup):
        step()
    _synchronize()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    times = []
    while len(times) < repeats and (not times or time.monotonic() - start_wall < budget):
        if cuda:
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step()
            stop.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(stop))
        else:
            began = time.perf_counter()
            step()
            times.append((time.perf_counter() - began) * 1e3)
    peak = (torch.cuda.max_memory_allocated() - base) / 2**20 if cuda else math.nan
    return statistics.median(times), peak, len(times)


def matmul_tflops() -> float:
    """The device's dense bf16 matmul rate: `MATMUL_SIZE`^3 products, mean of 10 after 3 warm-ups."""
    import torch  # noqa: PLC0415

    size = MATMUL_SIZE
    a, b = (torch.randn(size, size, device=DEVICE, dtype=torch.bfloat16) for _ in range(2))
    for _ in range(3):
        a @ b
    _synchronize()
    start = time.perf_counter()
    for _ in range(10):
        a @ b
    _synchronize()
    return 2 * size**3 * 10 / (time.perf_counter() - start) / 1e12


def part_targets(results: Results) -> None:
    """The targets' table: first triton and flex on every row (the targets compare them), then xformers and torch;
    each figure recorded as it is measured."""
    import torch  # noqa: PLC0415

    sys.path.insert(0, str(REPO / "scripts"))
    import gpu_check  # noqa: PLC0415

    gpu_check.DEVICE = DEVICE
    gpu_check.raise_recompile_limit()
    rate = matmul_tflops()
    print(f"dense bf16 matmul: {rate:.4g} TFLOP/s", flush=True)
    results.add("matmul", tflops=round(rate, 4))
    n, heads, d = TARGET_LENGTH, TARGET_HEADS, TARGET_HEAD_DIM
    rows, cases = {}, {}
    for target in TARGETS:
        dilation = target.dilation * (heads // len(target.dilation))
        cases[target.name] = gpu_check._sliding_case(
            target.name,
            window=target.window,
            dilation=dilation if len(target.dilation) > 1 else dilation[0],
            padding=target.padding,
            global_tokens=target.global_tokens,
        )
        pairs = visible_pairs(
            n,
            target.window,
            dilation,
            padded_keys=n // 10 if target.padding else 0,
            global_tokens=2 if target.global_tokens else 0,
        )
        rows[target.name] = {"ideal_ms": ideal_ms(pairs, d, rate), "ms": {}}
        results.add(
            "target-row",
            target=target.name,
            ideal_ms=round(rows[target.name]["ideal_ms"], 4),
            pairs=pairs,
            n=n,
            heads=heads,
            head_dim=d,
        )
        print(f"{target.name}: ideal {rows[target.name]['ideal_ms']:.3f} ms", flush=True)
    for backends in (TARGET_BACKENDS[:2], TARGET_BACKENDS[2:]):
        for target in TARGETS:
            torch.manual_seed(0)
            q, k, v = (
                torch.randn(1, heads, n, d, device=DEVICE, dtype=torch.bfloat16, requires_grad=True) for _ in range(3)
            )
            for backend in backends:
                ms = _time_target(results, cases[target.name], backend, q, k, v)
                if ms is not None:
                    rows[target.name]["ms"][backend] = ms
            del q, k, v
            if DEVICE == "cuda":
                torch.cuda.empty_cache()
    for verdict in verdicts(rows):
        results.add("verdict", **verdict)
        print(f"target: {verdict['target']}: {verdict['measured']} -> {verdict['met']}", flush=True)


def _time_target(results: Results, case, backend: str, q, k, v) -> float | None:
    """Forward + backward milliseconds of `case` on `backend`, recorded (None where it declines or fails)."""
    import gpu_check  # noqa: PLC0415
    import torch  # noqa: PLC0415

    budget = min(20.0, seconds_left() - 5)
    if budget < 2:
        results.skip(f"{case.name} on {backend}", "the targets part's time limit is spent")
        return None
    step = gpu_check._step(lambda q, k, v: case.run(backend, q, k, v), q, k, v, "fwdbwd")
    try:
        ms, mb, timed = _cell_time(step, warmup=2, repeats=5, budget=budget)
    except ValueError as error:  # the dispatcher declines, with its reasons
        results.skip(f"{case.name} on {backend}", str(error).split(": ", 1)[-1][:300])
        return None
    except Exception as error:  # noqa: BLE001 - out of memory and kernel errors are results too
        message = f"{type(error).__name__}: {error}"[:300]
        results.add("timing", target=case.name, backend=backend, error=message)
        print(f"{case.name} on {backend}: {message}", flush=True)
        return None
    finally:
        q.grad = k.grad = v.grad = None
        if DEVICE == "cuda":
            torch.cuda.empty_cache()
    peak = round(mb) if math.isfinite(mb) else None
    results.add("timing", target=case.name, backend=backend, ms=round(ms, 3), peak_mb=peak, runs=timed)
    print(f"{case.name} on {backend}: {ms:.2f} ms ({mb:.0f} MB, {timed} runs)", flush=True)
    return ms


# ------------------------------------------------------------------------------------------------ part 4
@dataclass(frozen=True)
class Step:
    """One recipe step: `config` under recipes/configs (None: plain `python`), `reference` the CPU step it is
    compared with, `needs` the packages it cannot run without."""

    name: str
    config: str | None
    reference: str | None
    packing: bool = False
    backend: str | None = None
    needs: tuple[str, ...] = ()
    cpu: bool = False


STEPS = (
    Step("cpu", None, None, cpu=True),
    Step("cpu packed", None, None, packing=True, cpu=True),
    Step("DDP (multi_gpu_bf16.yaml)", "multi_gpu_bf16.yaml", "cpu"),
    Step("FSDP2 (fsdp.yaml)", "fsdp.yaml", "cpu"),
    Step("DeepSpeed ZeRO-2 (deepspeed_zero2.yaml)", "deepspeed_zero2.yaml", "cpu", needs=("deepspeed",)),
    Step("DeepSpeed ZeRO-3 (deepspeed_zero3.yaml)", "deepspeed_zero3.yaml", "cpu", needs=("deepspeed",)),
    Step("packed on flex (gpu_1.yaml, bf16)", "gpu_1.yaml", "cpu packed", packing=True, backend="flex"),
    Step(
        "packed on xformers (gpu_1.yaml, bf16)",
        "gpu_1.yaml",
        "cpu packed",
        packing=True,
        backend="xformers",
        needs=("xformers",),
    ),
)
LOSS_TOLERANCE = 0.05  # absolute, on losses near 5.6 (bf16 autocast on the GPU against float32 on CPU)
RECIPE_ARGS = (
    "--per_device_train_batch_size",
    "4",
    "--per_device_eval_batch_size",
    "8",
    "--max_train_steps",
    "1",
    "--max_seq_length",
    "128",
    "--seed",
    "0",
    "--learning_rate",
    "1e-2",
    "--logging_steps",
    "1",
)


def prepare_training_inputs(work: Path) -> tuple[Path, Path]:
    """A small causal sliding-window model (no dropout, byte tokenizer) saved once, so that every step starts from
    the same weights (ZeRO-3 builds its model partitioned on the GPU: a fresh init there would differ), and ListOps
    texts to train on. Returns the model folder and the data folder."""
    import torch  # noqa: PLC0415

    from longattn import LongAttnConfig, LongAttnForCausalLM  # noqa: PLC0415
    from longattn.tokenization_longattn import byte_tokenizer  # noqa: PLC0415
    from longattn.train import data  # noqa: PLC0415

    model_dir, data_dir = work / "model", work / "data"
    data.generate_task(
        "listops",
        data_dir,
        num_train=16,
        num_validation=8,
        num_test=0,
        seed=0,
        min_length=20,
        max_length=60,
        max_depth=5,
        max_args=5,
    )
    torch.manual_seed(0)
    config = LongAttnConfig(
        vocab_size=260,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=128,
        max_position_embeddings=256,
        attention_type="sliding",
        sliding_window=16,
        is_decoder=True,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    LongAttnForCausalLM(config).save_pretrained(model_dir)
    byte_tokenizer(add_eos_token=False).save_pretrained(model_dir)
    return model_dir, data_dir


def step_command(step: Step, model_dir: Path, data_dir: Path, output_dir: Path, port: int) -> list[str]:
    recipe = str(REPO / "recipes" / "run_clm.py")
    args = [
        "--model_name_or_path",
        str(model_dir),
        "--train_file",
        str(data_dir / "train.jsonl"),
        "--validation_file",
        str(data_dir / "validation.jsonl"),
        "--output_dir",
        str(output_dir),
        *RECIPE_ARGS,
    ]
    if step.packing:
        args.append("--packing")
    if step.backend:
        args += ["--config_overrides", f"attention_backend={step.backend}"]
    if step.config is None:
        return [sys.executable, recipe, *args, "--mixed_precision", "no"]
    launch = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        str(REPO / "recipes" / "configs" / step.config),
        "--num_processes",
        "1",
        "--main_process_port",
        str(port),
    ]
    if step.config == "gpu_1.yaml":
        args += ["--mixed_precision", "bf16"]
    return [*launch, recipe, *args]


STEP_FIELDS = ("train_loss", "eval_loss", "distributed_type", "mixed_precision", "num_processes")


def compare(step: Step, result: dict | None, reference: dict | None) -> dict:
    """The step's row: its losses beside the CPU step's (`result` and `reference` are "training-step" records), and
    whether both losses are within `LOSS_TOLERANCE` of the CPU step's."""
    row = {"step": step.name, "reference": step.reference}
    if result is None:
        return {**row, "status": "not finished (the part was cut)"}
    row.update({key: result[key] for key in STEP_FIELDS if key in result})
    if result["status"] != "ok" or step.reference is None:
        return {**row, "status": result["status"]}
    if reference is None or reference["status"] != "ok":
        return {**row, "status": f"no CPU result ({step.reference}) to compare with"}
    worst = 0.0
    for key in ("train_loss", "eval_loss"):
        row[f"cpu_{key}"] = reference[key]
        difference = abs(result[key] - reference[key])
        row[f"{key}_difference"] = round(difference, 5)
        worst = max(worst, difference)
    row["status"] = "ok" if worst <= LOSS_TOLERANCE else f"differs from CPU by {worst:.3f} (> {LOSS_TOLERANCE})"
    return row


def training_rows(records: list[dict]) -> list[dict]:
    """One row per step of `STEPS` from the "training-step" records of a (possibly cut) run; empty without any."""
    done = {r["step"]: r for r in records if r["kind"] == "training-step"}
    if not done:
        return []
    return [compare(step, done.get(step.name), done.get(step.reference)) for step in STEPS]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def part_training(results: Results, work: Path) -> None:
    versions = package_versions()
    missing = [name for name in ("transformers", "accelerate", "datasets") if versions[name] is None]
    if missing:
        results.skip("every recipe step", f"{', '.join(missing)} not installed (the recipes need it)")
        return
    work.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="gpu_run_", dir=work))
    model_dir, data_dir = prepare_training_inputs(work)
    processes, finished = {}, {}

    def end_steps(*_):  # the orchestrator ends this part: end the recipe runs too (their ranks have own sessions)
        for process, _ in processes.values():
            kill_tree(process.pid)
        sys.exit(143)

    signal.signal(signal.SIGTERM, end_steps)
    for step in STEPS:
        absent = [name for name in step.needs if versions[name] is None]
        if absent:
            why = f"{', '.join(absent)} not installed"
            results.skip(f"step {step.name}", why)
            results.add("training-step", step=step.name, status=f"skipped: {why}")
            continue
        output_dir = work / re.sub(r"\W+", "_", step.name).strip("_")
        env = {k: v for k, v in os.environ.items() if not k.startswith("ACCELERATE_")}
        env.update(OMP_NUM_THREADS="2", TRITON_INTERPRET="0")
        if step.cpu:
            env["CUDA_VISIBLE_DEVICES"] = ""
        command = step_command(step, model_dir, data_dir, output_dir, _free_port())
        with Path(f"{output_dir}.log").open("w") as log:
            process = subprocess.Popen(
                command, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, env=env, start_new_session=True
            )
        processes[step.name] = (process, output_dir)
        print(f"started: {step.name}", flush=True)
    while len(finished) < len(processes):
        for name, (process, output_dir) in processes.items():
            if name in finished or process.poll() is None:
                continue
            finished[name] = process.returncode
            path = output_dir / "all_results.json"
            if process.returncode == 0 and path.exists():
                result = json.loads(path.read_text())
                record = {key: result.get(key) for key in STEP_FIELDS}
                results.add("training-step", step=name, status="ok", **record)
                print(f"finished: {name}: {record}", flush=True)
            else:
                tail = Path(f"{output_dir}.log").read_text(errors="replace")[-1500:]
                results.add("training-step", step=name, status=f"failed (exit status {process.returncode})", log=tail)
                print(f"finished: {name}: exit status {process.returncode}; its log ends:\n{tail}", flush=True)
        if seconds_left() < 4:
            for name, (process, _) in processes.items():
                if name not in finished:
                    kill_tree(process.pid)
                    finished[name] = None
                    results.add("training-step", step=name, status="timed out (the training part's limit)")
            break
        time.sleep(0.5)
    for row in training_rows(read_results(results.path)):
        print(f"{row['step']}: {row['status']}", flush=True)


# ------------------------------------------------------------------------------------------------ report
def _fmt(value, digits=2) -> str:
    if value is None:
        return "—"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def render(records: list[dict]) -> str:
    """The report (Markdown) of a results file: the text between the gpu_run markers of docs/benchmarks_gpu.md."""
    of = {}
    for record in records:
        of.setdefault(record["kind"], []).append(record)
    run = (of.get("run") or [{}])[0]
    env = (of.get("environment") or [{}])[-1]
    lines = [f"### The latest run: `{run.get('command', 'scripts/gpu_run.sh')}`", ""]
    lines.append(f"- started {run.get('started', '?')}; whole-run limit {_fmt(run.get('total_limit'), 0)} s")
    if env:
        versions = env.get("versions", {})
        lines.append(
            f"- GPU: {env.get('gpu', 'none (no CUDA device)')}"
            + (f", {env['gpu_memory_gib']} GiB, compute capability {env['capability']}" if "gpu" in env else "")
        )
        lines.append(
            f"- torch {env.get('torch')} (CUDA {env.get('cuda_version')}), Python {env.get('python')}, "
            + ", ".join(f"{n} {v or 'not installed'}" for n, v in versions.items() if n != "torch")
        )
    found = (of.get("backends") or [{}])[-1]
    if "auto" in found:
        lines.append(f"- `auto` for a bf16 sliding window with gradients at 64K: `{found['auto']}`")
    for name, why in found.get("backends", {}).items():
        lines.append(f"- {name}: {why}")
    if "xformers_import" in found:
        lines.append(f"- xformers import: {found['xformers_import']}")
    lines += ["", "| part | limit s | took s | status |", "|---|---|---|---|"]
    lines += [
        f"| {r['name']} | {_fmt(r['limit'], 0)} | {_fmt(r['seconds'], 1)} | {r['status']} |" for r in of.get("part", [])
    ]
    if of.get("skip"):
        lines += ["", "Skipped:", ""] + [f"- {r['what']}: {r['why']}" for r in of["skip"]]
    if of.get("test") or of.get("test-summary"):
        tests = of.get("test", [])
        counts = {}
        for record in tests:
            counts[record["outcome"]] = counts.get(record["outcome"], 0) + 1
        lines += ["", "#### Tests (Triton compiled, `TRITON_INTERPRET=0`)", ""]
        lines += [f"- {r['run']}: {r['line']}" for r in of.get("test-summary", [])]
        lines.append("- outcomes: " + ", ".join(f"{count} {outcome.lower()}" for outcome, count in counts.items()))
        failures = {r["id"]: r["message"] for r in of.get("test-failure", [])}
        for record in tests:
            if record["outcome"] in ("FAILED", "ERROR"):
                lines.append(f"- {record['outcome']} `{record['id']}`: {failures.get(record['id'], '')}")
    if of.get("timing") or of.get("target-row"):
        rate = (of.get("matmul") or [{}])[-1].get("tflops")
        shape = (of.get("target-row") or [{}])[0]
        n, heads, d = (shape.get(key, "?") for key in ("n", "heads", "head_dim"))
        lines += [
            "",
            f"#### Targets at {n} tokens (bf16, {heads} heads of {d}, forward + backward)",
            "",
            "Milliseconds (median of up to 5 runs after 2 warm-ups, CUDA events; peak MB above the inputs). "
            "ideal = the visible pairs' FLOPs (forward 4·d a pair, backward 2.5x the forward) at the measured dense "
            f"bf16 matmul rate, {_fmt(rate, 0)} TFLOP/s.",
            "",
        ]
        header = "| pattern | ideal ms | " + " | ".join(f"{b} ms" for b in TARGET_BACKENDS)
        lines += [
            header + " | triton / ideal | flex / triton | flex / xformers |",
            "|---|---|" + "---|" * len(TARGET_BACKENDS) + "---|---|---|",
        ]
        cells = {}
        for record in of.get("timing", []):
            if "ms" in record:
                peak = record.get("peak_mb")
                cell = f"{record['ms']:.2f}" + (f" ({peak} MB)" if peak is not None else "")
            else:
                cell = f"error: {record['error'][:60]}"
            cells[(record["target"], record["backend"])] = (cell, record.get("ms"))
        ideals = {r["target"]: r["ideal_ms"] for r in of.get("target-row", [])}
        for target in TARGETS:
            if target.name not in ideals and not any(key[0] == target.name for key in cells):
                continue
            ms = {b: cells.get((target.name, b), ("", None))[1] for b in TARGET_BACKENDS}
            ideal = ideals.get(target.name)

            def ratio(a, b):
                return _fmt(a / b) if a is not None and b else "—"

            lines.append(
                f"| {target.name} | {_fmt(ideal, 3)} | "
                + " | ".join(cells.get((target.name, b), ("n/a",))[0] for b in TARGET_BACKENDS)
                + f" | {ratio(ms['triton'], ideal)} | {ratio(ms['flex'], ms['triton'])} | "
                f"{ratio(ms['flex'], ms['xformers'])} |"
            )
    if of.get("timing") or of.get("target-row"):
        # From the figures themselves, so that a part cut before its end still says where each target stands.
        rows = {r["target"]: {"ideal_ms": r["ideal_ms"], "ms": {}} for r in of.get("target-row", [])}
        for record in of.get("timing", []):
            if "ms" in record:
                rows.setdefault(record["target"], {"ms": {}})["ms"][record["backend"]] = record["ms"]
        lines += ["", "| target | measured | met? |", "|---|---|---|"]
        lines += [f"| {v['target']} | {_fmt(v['measured'])} | {v['met']} |" for v in verdicts(rows)]
    if rows := training_rows(records):
        lines += [
            "",
            "#### One training step per recipe config on one GPU, against the same step on CPU",
            "",
            f"`recipes/run_clm.py`, 2 layers, hidden 64, causal sliding window 16, batch 4 x 128 tokens, one "
            f"AdamW step at lr 1e-2 from the same saved weights; GPU steps in bf16 autocast, CPU in float32. "
            f"Agreement: both losses within {LOSS_TOLERANCE} of the CPU step's.",
            "",
            "| step | accelerate ran | train loss (CPU) | eval loss after the step (CPU) | status |",
            "|---|---|---|---|---|",
        ]
        for r in rows:
            ran = f"{r.get('distributed_type', '—')}, {r.get('mixed_precision', '—')}" if "train_loss" in r else "—"
            train = f"{_fmt(r.get('train_loss'), 4)} ({_fmt(r.get('cpu_train_loss'), 4)})"
            evaluation = f"{_fmt(r.get('eval_loss'), 4)} ({_fmt(r.get('cpu_eval_loss'), 4)})"
            lines.append(f"| {r['step']} | {ran} | {train} | {evaluation} | {r['status']} |")
    return "\n".join(lines) + "\n"


def write_doc(results_path: Path, doc: Path = DOC) -> str:
    """Replace the text between the gpu_run markers of `doc` with the report of `results_path`."""
    text = doc.read_text()
    if BEGIN not in text or END not in text:
        raise SystemExit(f"{doc} has no '{BEGIN}' ... '{END}' section to replace")
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    report = render(read_results(results_path))
    doc.write_text(f"{head}{BEGIN}\n{report}{END}{tail}")
    return report


# ------------------------------------------------------------------------------------------------ main
def _limit(text: str) -> tuple[str, float]:
    name, _, seconds = text.partition("=")
    if name not in {part.name for part in PARTS} or not seconds:
        raise argparse.ArgumentTypeError(f"expected PART=SECONDS with PART one of {[p.name for p in PARTS]}")
    return name, float(seconds)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--out", type=Path, default=REPO / "runs" / "gpu_run", help="the results folder")
    parser.add_argument("--parts", nargs="+", choices=[p.name for p in PARTS], help="only these parts (default all)")
    parser.add_argument("--limit", type=_limit, action="append", help="PART=SECONDS: another limit for a part")
    parser.add_argument("--total", type=float, default=TOTAL_LIMIT, help="the whole run's limit in seconds")
    parser.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()), help="scratch space (training)")
    parser.add_argument("--to-doc", type=Path, metavar="RESULTS", help="write RESULTS' report into --doc and stop")
    parser.add_argument("--doc", type=Path, default=DOC, help=argparse.SUPPRESS)
    parser.add_argument("--part", choices=[p.name for p in PARTS], help=argparse.SUPPRESS)  # one part, in-process
    args = parser.parse_args(argv)
    args.argv = sys.argv[1:] if argv is None else argv
    if args.to_doc:
        print(write_doc(args.to_doc, args.doc))
        return 0
    if args.part is None:
        return orchestrate(args)
    results = Results(args.out / "results.jsonl")
    if args.part != "environment":
        import torch  # noqa: PLC0415

        if not torch.cuda.is_available():
            results.skip(f"part {args.part}", "no CUDA device (torch.cuda.is_available() is False)")
            return 0
    if args.part == "environment":
        part_environment(results)
    elif args.part == "tests":
        part_tests(results)
    elif args.part == "targets":
        part_targets(results)
    else:
        part_training(results, Path(os.environ.get("GPU_RUN_WORK", args.work)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
