"""Start-up cost of longattn against `import torch, transformers`, in fresh processes, with medians of a few rounds.

    python scripts/import_time.py                  # docs/benchmarks.md, "Start-up time"
    python scripts/import_time.py --repeat 5
    python scripts/import_time.py --source DIR     # another checkout's longattn (PYTHONPATH=DIR), e.g. a "before"

Each round runs every case once, in turn, each in a fresh interpreter under `-X importtime`:

- `import torch, transformers`: the baseline (transformers' top level is lazy: no model machinery);
- `import torch, transformers, longattn`: the budget is 1 s more than the baseline;
- the same, then `longattn.register()`: what the registrations cost where they happen (the first use, or here);
- `python -m longattn --help`: the command's start (budget 1.5 s).

Measures per run: wall clock around the process, the CPU time it used (user + system, from `getrusage`: the one
that load on a shared machine moves least), the `-X importtime` total (the cumulative microseconds of every
top-level import, wall clock inside the process) and the trace's line of the top-level `longattn` import itself.
The table gives the median of the rounds, and each case's excess over the baseline and its ratio to it, each paired
with the baseline run of the same round.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CASES = {
    "import torch, transformers": ["-c", "import torch, transformers"],
    "import torch, transformers, longattn": ["-c", "import torch, transformers, longattn"],
    "... then longattn.register()": ["-c", "import torch, transformers, longattn; longattn.register()"],
    "python -m longattn --help": ["-m", "longattn", "--help"],
}
BASELINE = "import torch, transformers"


def importtime_totals(stderr: str) -> tuple[float, float]:
    """Seconds: the cumulative time of every top-level import in a `-X importtime` trace (`import time: self |
    cumulative | name`, a top-level import's name unindented), and that of the top-level `longattn` alone."""
    total = own = 0
    for line in stderr.splitlines():
        if line.startswith("import time:") and "|" in line:
            _, cumulative, name = line[len("import time:") :].split("|")
            if not name.startswith("  ") and cumulative.strip().isdigit():
                total += int(cumulative)
                own += int(cumulative) if name.strip() == "longattn" else 0
    return total / 1e6, own / 1e6


def run_once(arguments: list[str], env: dict, cwd: Path) -> tuple[float, float, float, float]:
    """(wall s, CPU s, importtime s, importtime of `longattn` s) of one fresh interpreter."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-X", "importtime", *arguments], env=env, cwd=cwd, capture_output=True, text=True
    )
    wall = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode != 0:
        raise RuntimeError(f"{arguments} failed:\n{done.stderr[-3000:]}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu, *importtime_totals(done.stderr)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--repeat", type=int, default=3, help="rounds (default 3); the table gives medians")
    parser.add_argument("--source", type=Path, default=REPO, help="the folder holding the longattn package to time")
    args = parser.parse_args(argv)
    source = args.source.resolve()
    # Run from the source folder: `-c` and `-m` put the working directory first on sys.path.
    env = {**os.environ, "PYTHONPATH": str(source), "TRANSFORMERS_VERBOSITY": "error"}
    runs: dict[str, list[tuple[float, float, float, float]]] = {case: [] for case in CASES}
    for round_ in range(args.repeat):
        for case, arguments in CASES.items():
            runs[case].append(run_once(arguments, env, source))
            print(f"round {round_ + 1}: {case}: " + ", ".join(f"{x:.2f} s" for x in runs[case][-1]), file=sys.stderr)
    try:
        load = " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        load = "?"
    print(f"{args.repeat} rounds, medians; load average at the end {load} on {os.cpu_count()} CPUs\n")
    print(f"longattn from {source}\n")
    print("| case | wall | CPU (user + system) | `-X importtime` total | `longattn`'s own line in the trace |")
    print("| --- | --- | --- | --- | --- |")
    for case, values in runs.items():
        cells = []
        for i in range(3):
            median = statistics.median(run[i] for run in values)
            if case == BASELINE:
                cells.append(f"{median:.2f} s")
                continue
            # The excess and the ratio pair each run with the same round's baseline; the median is then taken.
            excess = statistics.median(run[i] - ref[i] for run, ref in zip(values, runs[BASELINE]))
            ratio = statistics.median(run[i] / ref[i] for run, ref in zip(values, runs[BASELINE]))
            cells.append(f"{median:.2f} s ({excess:+.2f} s, {ratio:.2f}x)")
        own = statistics.median(run[3] for run in values)
        cells.append(f"{own:.2f} s" if own else "-")
        print(f"| `{case}` | " + " | ".join(cells) + " |")
    print("\n(excess over the baseline, ratio to it)")


if __name__ == "__main__":
    main()
