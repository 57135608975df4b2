"""Process CPU time of one band attention layer on one thread: this checkout against a git revision, interleaved.

Wall clock is useless on a shared, loaded machine; the process time of a single-threaded run is what the CPU spent on
this process alone, so it stays comparable under load. Each shape is timed forward + backward (a random output
gradient into q, k and v), best of `--repeats`, every path of a round run one after the other in ONE process, so
slow phases of the machine hit all of them alike. Dense SDPA on the same shape gives the ideal: the band's share of
dense attention's work.

Shapes (q, k, v are `[b, n, h, d]` projections seen as `[b, h, n, d]`, as a model passes them):
- `roberta`: `[1, 12, 4096, 64]`, window 256 per side, global first token; ideal = dense SDPA x 512 / 4096.
- `llama`: q `[1, 16, 8192, 64]`, k and v on 4 key/value heads, causal window 512; ideal = causal dense SDPA x
  512 / 4096 (keys per query over causal dense's average). `llama-16k`: the same at 16384 tokens (the model set's
  length), ideal = causal dense SDPA x 512 / 8192.
- `sliding-4k`, `sliding-16k`: scripts/benchmark.py's `sliding` kind core, `[1, 4, n, 64]`, window 256 per side, no
  global token (the "after vs before" of docs/benchmarks.md).

Examples:
    python scripts/band_layer_timing.py --shapes roberta llama --against main
    python scripts/band_layer_timing.py --shapes sliding-4k sliding-16k --against f007ca9 main --no-ideal
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

# name: (heads, key/value heads, length, window, causal, global first token, dense share of the ideal)
SHAPES = {
    "roberta": (12, 12, 4096, 256, False, True, 512 / 4096),
    "llama": (16, 4, 8192, 512, True, False, 512 / 4096),
    "llama-16k": (16, 4, 16384, 512, True, False, 512 / 8192),
    "roberta-noglobal": (12, 12, 4096, 256, False, False, 512 / 4096),
    "sliding-4k": (4, 4, 4096, 256, False, False, 512 / 4096),
    "sliding-16k": (4, 4, 16384, 256, False, False, 512 / 16384),
}


def load_revision(revision: str, folder: Path, name: str) -> types.ModuleType:
    """The `ops` module of git revision `revision`, imported as package `name` (its `__init__` is not run, so nothing
    is registered twice with transformers)."""
    folder.mkdir()
    archive = subprocess.run(["git", "-C", str(REPO), "archive", revision, "longattn"], check=True, capture_output=True)
    subprocess.run(["tar", "-x", "-C", str(folder)], input=archive.stdout, check=True)
    package = types.ModuleType(name)
    package.__path__ = [str(folder / "longattn")]
    sys.modules[name] = package
    return importlib.import_module(f"{name}.ops")


def inputs(shape: str):
    heads, kv_heads, n, window, causal, global_first, _ = SHAPES[shape]
    generator = torch.Generator().manual_seed(0)
    q, k, v = (
        torch.randn(1, n, h, 64, generator=generator).transpose(1, 2).requires_grad_()
        for h in (heads, kv_heads, kv_heads)
    )
    # As a model passes it: the gradient of the `[b, n, h, d]` output projection input, seen as `[b, h, n, d]`.
    grad = torch.randn(1, n, heads, 64, generator=generator).transpose(1, 2)
    global_mask = None
    if global_first:
        global_mask = torch.zeros(1, n, dtype=torch.bool)
        global_mask[:, 0] = True
    return q, k, v, grad, dict(window=window, causal=causal, global_mask=global_mask)


def band_step(ops, shape: str):
    q, k, v, grad, kwargs = inputs(shape)

    def step():
        out = ops.sliding_window_attention(q, k, v, **kwargs)
        out.backward(grad)
        q.grad = k.grad = v.grad = None

    return step


def dense_step(shape: str):
    heads, kv_heads, _, _, causal, _, _ = SHAPES[shape]
    q, k, v, grad, _ = inputs(shape)
    # The dense reference reads full heads: repeat k and v outside the timed step (the ideal is the kernel's work).
    k, v = (t.detach().repeat_interleave(heads // kv_heads, dim=1).requires_grad_() for t in (k, v))

    def step():
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
        out.backward(grad)
        q.grad = k.grad = v.grad = None

    return step


def timed(step) -> float:
    start = time.process_time()
    step()
    return time.process_time() - start


def main() -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=["roberta", "llama"])
    parser.add_argument("--against", nargs="*", default=[], help="git revisions to time side by side (main, f007ca9)")
    parser.add_argument("--repeats", type=int, default=3, help="rounds; each path's best round is reported")
    parser.add_argument("--no-ideal", action="store_true", help="skip dense SDPA (the ideal)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    import longattn.ops as ops_after

    with tempfile.TemporaryDirectory() as folder:
        before = {
            revision: load_revision(revision, Path(folder) / str(i), f"longattn_before_{i}")
            for i, revision in enumerate(args.against)
        }
        print(f"{datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC, torch {torch.__version__}, 1 thread")
        for shape in args.shapes:
            paths = {revision: band_step(ops_before, shape) for revision, ops_before in before.items()}
            paths["after"] = band_step(ops_after, shape)
            if not args.no_ideal:
                paths["dense"] = dense_step(shape)
            for step in paths.values():
                step()  # warm-up
            best = {name: float("inf") for name in paths}
            for _ in range(args.repeats):
                for name, step in paths.items():
                    best[name] = min(best[name], timed(step))
            ideal = None if args.no_ideal else best["dense"] * SHAPES[shape][-1]
            print(f"{shape}: forward + backward, process time, best of {args.repeats}")
            for name, seconds in best.items():
                ratio = "" if ideal is None or name == "dense" else f"  {seconds / ideal:.2f}x ideal"
                print(f"  {name:>10}: {seconds:.3f} s{ratio}")
            for revision in before:
                print(f"  after / {revision}: {best['after'] / best[revision]:.3f}")


if __name__ == "__main__":
    main()
