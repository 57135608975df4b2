"""Per-process peak memory of one training step (forward + backward) of a sliding-window model on ONE long sequence,
split across 1, 2, 4, ... CPU processes with context parallelism (`longattn.context_parallel`, gloo).

    python scripts/context_parallel_memory.py --length 32768 --processes 1 2 4

Each process count runs in freshly spawned processes. In each process: the model (same seed everywhere) and the whole
batch are built, the batch is sharded (`shard_batch`), then the resident memory is read (the baseline) and its
high-water mark reset (`/proc/self/clear_refs`), and one step runs: forward, backward and the gradient sum across
the processes. Peak = high-water mark (`VmHWM`) minus the baseline: every allocation of the step (activations kept
for backward, the halo and the gathered global tokens, workspaces, allocator slack), not the weights, the libraries
or the inputs; glibc keeping or returning freed blocks moves it between runs. Tensor MiB: the peak of allocated minus
freed torch tensor bytes during the same step run again (`scripts/benchmark.py`'s profiler count), which does not.
With 1 process the model runs without context parallelism (its usual fused band path). One thread per process, so
the figures do not depend on how many cores the processes share.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "scripts")]


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, out_dir: str) -> None:
    import torch
    import torch.distributed as dist
    from benchmark import _tensor_peak_mb

    from longattn import LongAttnConfig, LongAttnForMaskedLM
    from longattn.train.context_parallel import (
        enable_context_parallel,
        init_context_parallel,
        reduce_gradients,
        shard_batch,
    )

    torch.set_num_threads(1)
    config = LongAttnConfig(
        vocab_size=260,
        hidden_size=args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        intermediate_size=4 * args.hidden,
        max_position_embeddings=args.length,
        attention_type="sliding",
        sliding_window=args.window,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    torch.manual_seed(0)
    model = LongAttnForMaskedLM(config)
    ids = torch.randint(4, 260, (1, args.length))
    global_mask = torch.zeros_like(ids)
    global_mask[:, 0] = 1
    labels = torch.where(torch.rand(ids.shape) < 0.15, ids, torch.full_like(ids, -100))
    batch = dict(input_ids=ids, global_attention_mask=global_mask, labels=labels)
    count = int(labels.ne(-100).sum())
    cp = None
    if world > 1:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(minutes=30))
        cp = init_context_parallel(world)
        enable_context_parallel(model, cp)
        batch = shard_batch(batch, cp, causal=False)

    def step():
        model.zero_grad(set_to_none=True)
        loss = model(**batch, num_items_in_batch=torch.tensor(count)).loss
        loss.backward()
        if cp is not None:
            reduce_gradients(model, cp.group)

    baseline = _status_kib("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current resident size
    start = time.perf_counter()
    step()
    seconds = time.perf_counter() - start
    peak = _status_kib("VmHWM") - baseline
    tensor_peak = _tensor_peak_mb(step)
    record = {
        "rank": rank,
        "tokens": batch["input_ids"].shape[1],
        "peak_mib": peak / 1024,
        "tensor_mib": tensor_peak,
        "seconds": seconds,
    }
    Path(out_dir, f"{rank}.json").write_text(json.dumps(record))
    if cp is not None:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        allow_abbrev=False, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--length", type=int, default=32768)
    parser.add_argument("--processes", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--window", type=int, default=256)
    args = parser.parse_args(argv)

    import torch.multiprocessing as mp

    print(
        f"length {args.length}, hidden {args.hidden}, {args.layers} layers, {args.heads} heads, window "
        f"{args.window}, one global token, MLM, forward + backward, 1 thread per process\n"
    )
    print("| processes | tokens per process | peak RSS MiB per process | tensor MiB per process | step seconds |")
    print("|---:|---:|---:|---:|---:|")
    for world in args.processes:
        with tempfile.TemporaryDirectory() as out_dir:
            mp.spawn(_worker, args=(world, _free_port(), args, out_dir), nprocs=world)
            records = [json.loads(path.read_text()) for path in sorted(Path(out_dir).glob("*.json"))]
        # The largest over the ranks (the first chunks hold one token more, the first rank the global token).
        peak, tensors, seconds, tokens = (
            max(r[key] for r in records) for key in ("peak_mib", "tensor_mib", "seconds", "tokens")
        )
        print(f"| {world} | {tokens} | {peak:.0f} | {tensors:.0f} | {seconds:.1f} |", flush=True)


if __name__ == "__main__":
    main()
