"""How each kind's time grows from 8K to 32K tokens, against the growth of the work its pattern needs.

For every kind, a FLOP model (multiply-adds of one forward pass of one attention layer with its projections, the
benchmark's layer: hidden D, h heads of d) counts

- the q/k/v/o projections, 4·n·D²;
- the attention products, 2·h·d per kept (query, key) pair (q·k and p·v), the pairs being what the kind's pattern
  keeps: counted from longattn's own pattern predicates (on 1,024 evenly spaced queries) for the position-based
  kinds (sliding, strided, fixed, adaptive span's window) and from the kind's settings for the content-based ones
  (a query's bucket, cluster or sorted block);
- what the kind adds besides: routing's assignment of n queries and keys to C = n/128 centroids (2·h·n·C·d),
  Sinkhorn's block scores, Linformer's length projections, the efficient kind's d x d state, reduction's convolution,
  BP-Transformer's span pooling, deformable's offset prediction and interpolation.

Backward costs a fixed multiple of forward for every term, so the growth ratio of forward FLOPs is the model's.

Protocol (the issue's): at least 5 runs, each run measuring every kind at every length in a fresh process (the
kinds and lengths alternated, so that slow spells of the shared machine hit all of them), each measurement the best
of `--repeats` after a warm-up; growth per run = time(32K) / time(8K) of that run; the median over runs and the
spread (min - max) are reported. Defaults: one torch thread and the worker's CPU time (`--clock cpu`), which other
processes' load hardly moves, and `--allocator reuse` (glibc unmaps and page-faults afresh every buffer above 32 MB,
a step at 32K that belongs to the allocator, see benchmark.py's ALLOCATORS).

Example:
    python scripts/growth.py --runs 5 --out docs/growth.md
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import benchmark  # noqa: E402  (the sibling script: its registry of kinds and its fresh-process worker)
from flop_models import KINDS, flop_model  # noqa: E402

TARGET = 1.3  # median time growth at most 1.3x the FLOP model's growth


def measure(args: argparse.Namespace) -> dict:
    """runs x kinds x lengths, each in a fresh worker process; returns {kind: {length: [seconds per run]}}."""
    times = {kind: {n: [] for n in args.lengths} for kind in args.kinds}
    layer_args = argparse.Namespace(
        batch=1,
        hidden=args.hidden,
        heads=args.heads,
        window=args.window,
        global_tokens=0,
        repeats=args.repeats,
        wait_idle=0.0,
        timeout=args.timeout,
        tensor_memory=False,
        set=[],
        allocator=args.allocator,
        clock=args.clock,
        threads=args.threads,
    )
    for run in range(args.runs):
        for kind in args.kinds:
            for n in args.lengths:
                result = benchmark.run_one(layer_args, kind, n, "fwdbwd")
                value = result.get("time_s")
                times[kind][n].append(value)
                shown = f"{value:.3f} s" if value is not None else result.get("error")
                print(f"run {run + 1}/{args.runs} {kind:>16} {n:>6}: {shown}", flush=True)
    return times


def report(args: argparse.Namespace, times: dict, command: str) -> str:
    small, large = args.lengths
    lines = [
        f"### Growth from {small} to {large} tokens against the FLOP model",
        "",
        f"- command: `{command}`",
        f"- machine: {benchmark._cpu_name()}, torch threads {args.threads or 'default'}, clock {args.clock}, "
        f"allocator {args.allocator}; {args.runs} runs, kinds and lengths alternated, each a fresh process, best of "
        f"{args.repeats} after a warm-up",
        f"- target: median time growth at most {TARGET}x the FLOP model's growth",
        "",
        f"| kind | FLOP model | model growth | time {small} (median s) | time {large} (median s) | "
        "time growth per run | median (spread) | median / model | target |",
        "|---|---|---:|---:|---:|---|---:|---:|---|",
    ]
    for kind in args.kinds:
        flops_small, formula = flop_model(kind, small, args)
        flops_large, _ = flop_model(kind, large, args)
        model = flops_large / flops_small
        pairs = [(a, b) for a, b in zip(times[kind][small], times[kind][large]) if a and b]
        if not pairs:
            lines.append(f"| {kind} | {formula} | {model:.2f}x | | | failed | | | |")
            continue
        growth = [b / a for a, b in pairs]
        median = statistics.median(growth)
        ratio = median / model
        verdict = "met" if ratio <= TARGET else f"missed by {ratio / TARGET:.2f}x"
        lines.append(
            f"| {kind} | {formula} | {model:.2f}x | {statistics.median(a for a, _ in pairs):.3f} | "
            f"{statistics.median(b for _, b in pairs):.3f} | {', '.join(f'{g:.2f}' for g in growth)} | "
            f"{median:.2f}x ({min(growth):.2f}-{max(growth):.2f}) | {ratio:.2f} | {verdict} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    parser.add_argument("--kinds", nargs="+", default=KINDS, choices=KINDS)
    parser.add_argument("--lengths", nargs=2, type=int, default=[8192, 32768], metavar=("SMALL", "LARGE"))
    parser.add_argument("--runs", type=int, default=5, help="alternated runs (the protocol asks for at least 5)")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per measurement after a warm-up")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--window", type=int, default=256)
    parser.add_argument("--clock", choices=["wall", "cpu"], default="cpu")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--allocator", choices=sorted(benchmark.ALLOCATORS), default="reuse")
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument("--json", type=Path, help="raw times per kind, length and run")
    parser.add_argument("--out", type=Path, help="write the markdown table here (else print it)")
    args = parser.parse_args(argv)
    if args.runs < 1:
        parser.error(f"--runs must be >= 1, got {args.runs}")
    command = "python scripts/growth.py " + " ".join(sys.argv[1:] if argv is None else argv)
    times = measure(args)
    if args.json:
        args.json.write_text(json.dumps({k: {str(n): v for n, v in t.items()} for k, t in times.items()}, indent=1))
    text = report(args, times, command)
    if args.out:
        args.out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
