"""Time and peak memory of ONE attention layer with its q/k/v/o projections, side by side across implementations.

Every (implementation, length, mode) runs in a fresh subprocess, so each peak-memory figure starts from a clean
process. Implementations live in a registry (`IMPLS`): adding a longattn kind or a peer takes a few lines.

Examples:
    python scripts/benchmark.py --lengths 1024 4096 16384 --impls full sliding hf-longformer local-attention \\
        --mode fwd fwdbwd --out docs/benchmarks.md
    python scripts/benchmark.py --lengths 16384 --impls sliding --mode fwdbwd        # print only
    python scripts/benchmark.py --lengths 1024 4096 --impls full sliding hf-longformer --against main~20
    python scripts/benchmark.py --models roberta-4k      # whole stock models: LongformerModel, sdpa, floor, longattn
    python scripts/benchmark.py --models llama-16k --model-length 8192 --new-tokens 64

The peer packages (local-attention, linformer, reformer-pytorch, routing-transformer, sinkhorn-transformer) are not
installed by scripts/setup.sh; the default run includes a peer only when it is importable. They come with the `bench`
extra, torch pinned first so that pip keeps the CPU build:
    pip install torch==2.13.0 && pip install -e ".[bench]"

Method (also written into the report):
- time: best of `--repeats` runs after one warm-up run, wall clock (`time.perf_counter`), torch's default threads;
  `--clock cpu --threads 1`: the worker's own CPU time on one thread, which other processes' load hardly moves.
- peak MB (RSS): high-water resident memory of the worker (`resource.getrusage(RUSAGE_SELF).ru_maxrss`) minus its
  resident memory just before the first run, when libraries, weights and inputs are already loaded. It counts every
  allocation of the step (tensors, allocator slack, library buffers), not only torch tensors.
- tensor MB: peak of (allocated - freed) torch CPU tensor bytes during one extra, untimed run, from the allocation
  events of `torch.profiler(profile_memory=True)`; "n/a" if this torch build does not expose them.
- `--against REV` (before vs after in one run, so machine noise hits both alike): the tree of git revision REV is
  exported to a temporary folder (`git archive`, removed at the end) and every longattn kind of `--impls` is also
  measured as a row `IMPL@REV` (short hash), just before `IMPL` at each length and mode. Its worker is this script
  with the exported `longattn` package first on `sys.path` (`BENCHMARK_PACKAGE_ROOT`); the parent checks the
  `longattn.__file__` each worker reports. Peers are measured once. Each mode gains an "after vs before" table: time,
  peak RSS and tensor MB of this checkout over REV's, per kind and length, and the geometric mean of the time ratio.
  A kind or config field that REV lacks is a row error, not a crash. With `--models`, the set's `longattn` row gains
  a row `longattn@REV` just before it (the stock model with REV's package), and the report its after-vs-before ratios.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import math
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# The folder whose `longattn` package this process imports: this checkout, or in an `--against` worker the export of
# the old revision (the parent sets the variable; the worker script itself is always the current one).
PACKAGE_ROOT_VARIABLE = "BENCHMARK_PACKAGE_ROOT"
PACKAGE_ROOT = Path(os.environ.get(PACKAGE_ROOT_VARIABLE, REPO))
BASELINE = "hf-longformer"
NOISY = 0.1  # a timing taken while other processes used more than this share of the CPUs is marked with *
INSTALL_PEERS = 'pip install torch==2.13.0 && pip install -e ".[bench]"'  # torch first: pip keeps the CPU build


# ------------------------------------------------------------------------------------------------ the registry
@dataclass(frozen=True)
class Impl:
    """An attention implementation to measure.

    Attributes:
        description: One line for the report.
        build: `build(args) -> layer`, where `layer(hidden_states [b, n, D]) -> [b, n, D]` is an `nn.Module` (or a
            callable holding modules) with its q/k/v/o projections.
        package: `(pip name, import name)` of a peer package that `build` needs and the `bench` extra installs;
            None for longattn kinds and transformers' layers.
    """

    description: str
    build: Callable[[argparse.Namespace], Callable]
    package: tuple[str, str] | None = None


IMPLS: dict[str, Impl] = {}


def register(name: str, description: str, package: tuple[str, str] | None = None):
    def decorator(build):
        IMPLS[name] = Impl(description, build, package)
        return build

    return decorator


def missing_package(impl: str) -> str | None:
    """The pip name of the peer package `impl` needs when it cannot be imported here, else None."""
    package = IMPLS[impl].package
    if package is None or importlib.util.find_spec(package[1]) is not None:
        return None
    return package[0]


def default_impls() -> list[str]:
    """Dense SDPA, longattn's sliding window and transformers' Longformer, plus local-attention if installed."""
    return [impl for impl in ("full", "sliding", BASELINE, "local-attention") if missing_package(impl) is None]


def check_installed(impls: list[str]) -> None:
    """Raise ValueError naming the first requested peer whose package is not installed, and how to install it."""
    for impl in impls:
        if (package := missing_package(impl)) is not None:
            raise ValueError(
                f"implementation {impl} needs the `{package}` package, which is not installed: "
                f"install the peers (the `bench` extra) with `{INSTALL_PEERS}`"
            )


def _longattn_kind(kind: str, **fields):
    """A longattn attention kind built the way the model builds it: the `self_attn` of a `LongAttnLayer(config)`."""

    def build(args):
        # Public entry points only (the config and the model file's layer), stable across revisions, so that an
        # `--against` worker builds the old tree's kind the same way.
        from longattn import LongAttnConfig, available_attention_types
        from longattn.modeling_longattn import LongAttnLayer

        # Linformer sizes E/F by the length; no attention dropout unless `--set` asks for it.
        settings = {"max_position_embeddings": max(args.length, 4096), "attention_probs_dropout_prob": 0.0, **fields}
        settings.update(config_overrides(args.set))  # `--set`: the user's settings win over the registry's
        # An older revision may lack the kind, or a field (the config would keep it as an unused attribute and the
        # row would silently measure another setting): say so instead.
        if kind not in available_attention_types():
            raise ValueError(f"kind {kind!r} does not exist in this revision of longattn")
        unknown = sorted(set(settings) - set(LongAttnConfig().to_dict()))
        if unknown:
            raise ValueError(f"config field(s) {', '.join(unknown)} do not exist in this revision of longattn")
        config = LongAttnConfig(
            hidden_size=args.hidden,
            num_attention_heads=args.heads,
            attention_type=kind,
            **settings,
        )
        layer_kwargs = {"layer_idx": 0, "attention_type": kind, "is_causal": False, "has_cross_attention": False}
        module = LongAttnLayer(config, **layer_kwargs).self_attn
        global_mask = _global_mask(args)

        def layer(hidden_states):
            return module(hidden_states, global_attention_mask=global_mask)[0]

        layer.module = module
        return layer

    return build


def config_overrides(items: list[str]) -> dict:
    """`--set FIELD=VALUE` items as config fields, in the recipes' `--config_overrides` grammar
    (`longattn.config_overrides`: numbers, true/false, none, `[a,b]` lists, else a string)."""
    for item in items:
        if "=" not in item:
            raise ValueError(f"`--set` item {item!r} is not FIELD=VALUE (e.g. fixed_num_summary=1)")
    if not items:
        return {}
    # Imported here: `--help` and a run without `--set` need no longattn (nor torch) in the parent process.
    sys.path.insert(0, str(PACKAGE_ROOT))
    from longattn import LongAttnConfig
    from longattn.config_overrides import parse_config_overrides
    from longattn.configuration_longattn import check_override_fields

    overrides = {}
    for item in items:
        overrides.update(parse_config_overrides(item, flag="--set"))
    # The config keeps unknown keyword arguments as attributes, so a misspelt field would silently measure the
    # registered setting: refuse it here.
    check_override_fields(overrides, LongAttnConfig().to_dict(), where="--set")
    return overrides


def _global_mask(args):
    import torch

    if not args.global_tokens:
        return None
    mask = torch.zeros(args.batch, args.length, dtype=torch.bool)
    mask[:, : args.global_tokens] = True
    return mask


register("full", "longattn `full` kind: dense softmax attention through torch SDPA")(_longattn_kind("full"))


@register("sliding", "longattn `sliding` kind (Longformer pattern, blocked executor), one-sided window `--window`")
def _build_sliding(args):
    return _longattn_kind("sliding", sliding_window=args.window)(args)


register("strided", "longattn `strided` kind (Sparse Transformer, bidirectional form), stride 128 (~sqrt(16K))")(
    _longattn_kind("strided", strided_stride=128)
)
register("fixed", "longattn `fixed` kind (Sparse Transformer, bidirectional form), block 128, 8 summary cells")(
    _longattn_kind("fixed", fixed_block_size=128, fixed_num_summary=8)
)


register("lsh", "longattn `lsh` kind (Reformer): bucket 64, 2 hashes, one chunk before")(
    _longattn_kind("lsh", lsh_bucket_size=64, lsh_num_hashes=2, lsh_seed=0)
)
register("sinkhorn", "longattn `sinkhorn` kind (Sparse Sinkhorn): blocks of 64")(
    _longattn_kind("sinkhorn", sinkhorn_block_size=64)
)
register("sortcut", "longattn `sinkhorn` kind with SortCut budget 2 blocks of 64")(
    _longattn_kind("sinkhorn", sinkhorn_block_size=64, sinkhorn_sortcut=2)
)
register("linformer", "longattn `linformer` kind: k = 256, headwise sharing")(
    _longattn_kind("linformer", linformer_proj_len=256, linformer_sharing="headwise")
)
register("efficient", "longattn `efficient` kind (Shen et al.): softmax normalisation")(_longattn_kind("efficient"))
register("reduction", "longattn `reduction` kind (spatial reduction on sequences): R = 8")(
    _longattn_kind("reduction", reduction_ratio=8)
)
register("binary_partition", "longattn `binary_partition` kind (BP-Transformer): k = 4 nodes per level and side")(
    _longattn_kind("binary_partition", binary_partition_context=4)
)
register("deformable", "longattn `deformable` kind (1-D Deformable DETR): 4 levels, 4 points")(
    _longattn_kind("deformable", deformable_levels=4, deformable_points=4)
)
register("synthesizer", "longattn `synthesizer` kind, dense mode (quadratic by nature)")(
    _longattn_kind("synthesizer", synthesizer_mode="dense")
)


@register("routing", "longattn `routing` kind: length/128 clusters (window 128, as routing-transformer's)")
def _build_routing(args):
    return _longattn_kind("routing", routing_num_clusters=max(1, args.length // 128))(args)


@register("adaptive_span", "longattn `adaptive_span` kind: S = 256, R = 32, spans opened fully (the largest cost)")
def _build_adaptive_span(args):
    layer = _longattn_kind("adaptive_span", adaptive_span_max=256, adaptive_span_ramp=32)(args)
    # A fresh layer starts with z = 0 (only the ramp's keys); a trained one may use its whole span.
    layer.module.span_fraction.data.fill_(1.0)
    return layer


# Every implementation registered above is a longattn kind (built by `_longattn_kind`): `--against REV` measures
# these on the old revision too. Peers and transformers' layers, registered below, are measured once.
LONGATTN_IMPLS = frozenset(IMPLS)


@register(
    "floor",
    "zero-cost stand-in: the `full` kind's layer (q/k/v/o projections, head split and merge) with its attention "
    "replaced by v + 0·(q + k), so backward still reaches the q/k projections; the non-attention part of every "
    "kind's ideal",
)
def _build_floor(args):
    layer = _longattn_kind("full")(args)

    def attend(q, k, v, **kwargs):
        return v + (q + k) * 0.0  # [b, h, n, d]: a zero gradient reaches the q and k projections

    layer.module.attend = attend
    return layer


@register("hf-lsh", "transformers `LSHSelfAttention` (Reformer): chunk 64, 2 hashes, one chunk before + output proj")
def _build_hf_lsh(args):
    from torch import nn
    from transformers import ReformerConfig
    from transformers.models.reformer.modeling_reformer import LSHSelfAttention

    config = ReformerConfig(
        hidden_size=args.hidden,
        num_attention_heads=args.heads,
        attention_head_size=args.hidden // args.heads,
        lsh_attn_chunk_length=64,
        num_hashes=2,
        num_buckets=None,
        lsh_num_chunks_before=1,
        lsh_num_chunks_after=0,
        hash_seed=0,
        is_decoder=False,
        lsh_attention_probs_dropout_prob=0.0,
        max_position_embeddings=max(args.length, 4096),
        attn_layers=["lsh"],
    )
    config.num_buckets = max(2, 2 * args.length // 64 // 2)  # transformers' rule: ~2 buckets per chunk
    attention = LSHSelfAttention(config)
    o_proj = nn.Linear(args.hidden, args.hidden)

    def layer(hidden_states):
        return o_proj(attention(hidden_states)[0])

    layer.module = nn.ModuleList([attention, o_proj])
    return layer


@register(
    "peer-linformer",
    "`linformer` package: LinformerSelfAttention(k=256), one E/F per layer",
    package=("linformer", "linformer"),
)
def _build_peer_linformer(args):
    from linformer import LinformerSelfAttention

    attention = LinformerSelfAttention(
        dim=args.hidden, seq_len=args.length, k=256, heads=args.heads, one_kv_head=False, share_kv=False
    )

    def layer(hidden_states):
        return attention(hidden_states)

    layer.module = attention
    return layer


@register(
    "reformer-lsh",
    "`reformer-pytorch` package: LSHSelfAttention(bucket_size=64, n_hashes=2), shared-QK "
    "projection + v + output (its design: 3 projections), one bucket before",
    package=("reformer-pytorch", "reformer_pytorch"),
)
def _build_reformer_lsh(args):
    from reformer_pytorch import LSHSelfAttention

    attention = LSHSelfAttention(dim=args.hidden, heads=args.heads, bucket_size=64, n_hashes=2, causal=False)

    def layer(hidden_states):
        return attention(hidden_states)

    layer.module = attention
    return layer


def _with_aux_loss():
    """An autograd function `(out, loss) -> out` whose backward also sends a gradient of 1 into the scalar `loss`."""
    import torch

    class WithAuxLoss(torch.autograd.Function):
        @staticmethod
        def forward(ctx, out, loss):
            return out.view_as(out)

        @staticmethod
        def backward(ctx, grad):
            return grad, torch.ones((), dtype=grad.dtype, device=grad.device)

    return WithAuxLoss


@register(
    "routing-transformer",
    "`routing-transformer` package: SelfAttention(window_size=128, i.e. length/128 "
    "clusters, local_attn_heads=0: all heads routed), its k-means commitment loss in the backward",
    package=("routing-transformer", "routing_transformer"),
)
def _build_routing_transformer(args):
    from routing_transformer.routing_transformer import SelfAttention

    attention = SelfAttention(
        dim=args.hidden,
        depth=1,
        max_seq_len=args.length,
        heads=args.heads,
        local_attn_heads=0,
        window_size=128,
        causal=False,
    )

    with_aux_loss = _with_aux_loss()

    def layer(hidden_states):
        out, aux_loss = attention(hidden_states)
        return with_aux_loss.apply(out, aux_loss)

    layer.module = attention
    return layer


@register(
    "sinkhorn-transformer",
    "`sinkhorn-transformer` package: SinkhornSelfAttention(bucket_size=64, "
    "non_permutative=False: Gumbel-Sinkhorn sorting, 5 iterations, temperature 0.75; no local heads)",
    package=("sinkhorn-transformer", "sinkhorn_transformer"),
)
def _build_sinkhorn_transformer(args):
    from sinkhorn_transformer import SinkhornSelfAttention

    attention = SinkhornSelfAttention(
        dim=args.hidden,
        bucket_size=64,
        max_seq_len=args.length,
        heads=args.heads,
        causal=False,
        non_permutative=False,
        n_local_attn_heads=0,
    )

    def layer(hidden_states):
        return attention(hidden_states)

    layer.module = attention
    return layer


@register(
    "hf-longformer",
    "transformers `LongformerSelfAttention` (attention_window = 2·`--window`) + an output projection",
)
def _build_hf_longformer(args):
    import torch
    from torch import nn
    from transformers import LongformerConfig
    from transformers.models.longformer.modeling_longformer import LongformerSelfAttention

    config = LongformerConfig(
        hidden_size=args.hidden,
        num_attention_heads=args.heads,
        attention_window=[2 * args.window],
        attention_probs_dropout_prob=0.0,
    )
    attention = LongformerSelfAttention(config, layer_id=0)
    o_proj = nn.Linear(args.hidden, args.hidden)
    # The 2-D mask LongformerModel hands its layers: 0 = local token, +large = global token, -large = padding.
    global_mask = _global_mask(args)
    mask = torch.zeros(args.batch, args.length)
    if global_mask is not None:
        mask[global_mask] = torch.finfo(mask.dtype).max
    is_index_masked, is_index_global_attn = mask < 0, mask > 0
    is_global_attn = bool(is_index_global_attn.any())

    def layer(hidden_states):
        out = attention(
            hidden_states,
            attention_mask=mask,
            is_index_masked=is_index_masked,
            is_index_global_attn=is_index_global_attn,
            is_global_attn=is_global_attn,
        )[0]
        return o_proj(out)

    layer.module = nn.ModuleList([attention, o_proj])
    return layer


@register(
    "local-attention",
    "`local-attention` package: LocalAttention(window_size=`--window`, look_backward=1, look_forward=1)",
    package=("local-attention", "local_attention"),
)
def _build_local_attention(args):
    from local_attention import LocalAttention
    from torch import nn

    heads, head_dim = args.heads, args.hidden // args.heads
    projections = nn.ModuleDict({name: nn.Linear(args.hidden, args.hidden) for name in ("q", "k", "v", "o")})
    attention = LocalAttention(window_size=args.window, look_backward=1, look_forward=1, causal=False, autopad=True)

    def split(x):
        b, n, _ = x.shape
        return x.view(b, n, heads, head_dim).transpose(1, 2)  # [b, h, n, d]

    def layer(hidden_states):
        q, k, v = (split(projections[name](hidden_states)) for name in ("q", "k", "v"))
        out = attention(q, k, v)  # [b, h, n, d]
        b, _, n, _ = out.shape
        return projections["o"](out.transpose(1, 2).reshape(b, n, args.hidden))

    layer.module = projections
    return layer


# ------------------------------------------------------------------------------------------------ one measurement
def _rss_mb() -> float:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _max_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def _cpu_jiffies() -> tuple[int, int]:
    """(busy, total) jiffies of all CPUs since boot, from /proc/stat."""
    with open("/proc/stat") as stat:
        fields = [int(x) for x in stat.readline().split()[1:]]
    idle = fields[3] + fields[4]  # idle + iowait
    return sum(fields) - idle, sum(fields)


def _own_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _busy_fraction(seconds: float = 1.0) -> float:
    busy0, total0 = _cpu_jiffies()
    time.sleep(seconds)
    busy1, total1 = _cpu_jiffies()
    return (busy1 - busy0) / max(1, total1 - total0)


def wait_until_idle(limit_s: float, threshold: float = 0.1) -> float:
    """Wait (up to `limit_s`) until other processes use less than `threshold` of the CPUs; return the last reading.

    On a shared machine another process's threads compete with torch's and inflate every timing several-fold."""
    deadline = time.monotonic() + limit_s
    busy = _busy_fraction()
    while busy > threshold and time.monotonic() < deadline:
        time.sleep(5)
        busy = _busy_fraction()
    return busy


def _tensor_peak_mb(step) -> float | None:
    """Peak of allocated-minus-freed torch CPU bytes during `step()`, from the profiler's allocation events."""
    from torch.profiler import ProfilerActivity, profile

    try:
        from torch._C._profiler import _EventType
    except ImportError:
        return None
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    allocations = []
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        if node.tag == _EventType.Allocation and str(node.extra_fields.device) == "cpu":
            allocations.append((node.start_time_ns, node.extra_fields.alloc_size))
        stack.extend(node.children)
    if not allocations:
        return None
    current = peak = 0
    for _, size in sorted(allocations):
        current += size
        peak = max(peak, current)
    return peak / 2**20


def worker(args: argparse.Namespace) -> dict:
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    sys.path.insert(0, str(PACKAGE_ROOT))
    torch.manual_seed(0)
    layer = IMPLS[args.impl].build(args)
    longattn = sys.modules.get("longattn")  # the parent checks that it came from the intended tree
    module = layer.module
    if args.compiled:
        layer = torch.compile(layer)  # inductor; the warm-up run below compiles, untimed
    hidden_states = torch.randn(args.batch, args.length, args.hidden, requires_grad=args.mode == "fwdbwd")
    grad = torch.randn(args.batch, args.length, args.hidden) if args.mode == "fwdbwd" else None

    def step():
        if grad is None:
            with torch.no_grad():
                layer(hidden_states)
            return
        layer(hidden_states).backward(grad)
        hidden_states.grad = None
        for parameter in module.parameters():
            parameter.grad = None

    rss_before = _rss_mb()
    if args.wait_idle:
        wait_until_idle(args.wait_idle)
    start = time.perf_counter()
    step()  # warm-up
    warmup = time.perf_counter() - start
    if warmup > args.timeout:
        return {
            "impl": args.impl,
            "length": args.length,
            "mode": args.mode,
            "error": f"one run took {warmup:.0f} s > --timeout",
        }
    # On a shared machine, keep measuring until `repeats` runs had the CPUs to themselves (or patience runs out).
    deadline = time.monotonic() + args.wait_idle
    times, cpu_times, others = [], [], []
    while sum(other <= NOISY for other in others) < args.repeats:
        if len(times) >= args.repeats and time.monotonic() > deadline:
            break
        if args.wait_idle:
            wait_until_idle(max(0.0, deadline - time.monotonic()))
        busy_start, total_start, own_start = *_cpu_jiffies(), _own_cpu_seconds()
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
        busy_end, total_end, own_end = *_cpu_jiffies(), _own_cpu_seconds()
        cpu_times.append(own_end - own_start)
        # CPU share used by OTHER processes during this run: all busy time minus this process's own.
        tick = os.sysconf("SC_CLK_TCK")
        other = (busy_end - busy_start) / tick - (own_end - own_start)
        others.append(max(0.0, other) / max(1e-9, (total_end - total_start) / tick))
    if args.clock == "cpu":  # other processes' load hardly moves the process's own CPU time: every run counts
        times, wall_times = cpu_times, times
    clean = [t for t, other in zip(times, others, strict=True) if other <= NOISY]
    best = min(clean) if clean else min(times)
    peak_rss = _max_rss_mb() - rss_before
    tensor_peak = _tensor_peak_mb(step) if args.tensor_memory else None
    return {
        "impl": args.impl,
        "length": args.length,
        "mode": args.mode,
        "time_s": best,
        "times_s": times,
        # Load from other processes during the reported run (0 = the machine to ourselves).
        "other_load": others[times.index(best)],
        "peak_rss_mb": peak_rss,
        "tensor_peak_mb": tensor_peak,
        "threads": torch.get_num_threads(),
        "clock": args.clock,
        **({"wall_s": wall_times} if args.clock == "cpu" else {}),
        "longattn_file": getattr(longattn, "__file__", None),
    }


# glibc malloc serves blocks above its mmap threshold (raised dynamically, but never above 32 MB) with fresh mmap
# pages and unmaps them on free, so every step page-faults all its large buffers anew: at 32K tokens and hidden 256 an
# activation is exactly 32 MB, at 8K it is 8 MB and reused. That step in the cost curve belongs to the allocator, not
# to any attention, so `--allocator reuse` keeps freed memory in the heap for every implementation alike (the effect
# a caching allocator such as jemalloc or tcmalloc has).
ALLOCATORS = {
    "glibc": {},
    "reuse": {"MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": str(2**40), "MALLOC_TOP_PAD_": str(2**26)},
}


def export_revision(revision: str, folder: Path) -> str:
    """Export the tree of git `revision` of this checkout into `folder` (`git archive | tar -x`).

    Returns:
        The revision's short commit hash.

    Raises:
        ValueError: `revision` names no commit of this repository.
    """
    found = subprocess.run(
        ["git", "-C", str(REPO), "rev-parse", "--verify", "--quiet", "--short", f"{revision}^{{commit}}"],
        capture_output=True,
        text=True,
    )
    if found.returncode != 0:
        raise ValueError(f"--against: {revision!r} is not a git revision of {REPO} (e.g. main~20 or a commit hash)")
    short = found.stdout.strip()
    archive = subprocess.run(["git", "-C", str(REPO), "archive", short], capture_output=True, check=True)
    subprocess.run(["tar", "-x", "-C", str(folder)], input=archive.stdout, check=True)
    return short


def describe_checkout() -> str:
    """This checkout's commit (short hash), and whether its `longattn/` has uncommitted changes."""

    def git(*words):
        return subprocess.run(["git", "-C", str(REPO), *words], capture_output=True, text=True).stdout.strip()

    dirty = git("status", "--porcelain", "--", "longattn")
    return f"working tree at {git('rev-parse', '--short', 'HEAD') or 'unknown commit'}" + (
        " with uncommitted changes to longattn/" if dirty else ""
    )


def measured_rows(args: argparse.Namespace) -> list[str]:
    """The report's rows in measuring order. With `--against`, each longattn kind's old row `IMPL@REV` comes just
    before `IMPL`, so a drift in machine load hits before and after alike; peers are measured once."""
    rows = []
    for impl in args.impls:
        if getattr(args, "against", None) and impl in LONGATTN_IMPLS:
            rows.append(f"{impl}@{args.against_hash}")
        rows.append(impl)
    return rows


def worker_launch(
    args: argparse.Namespace, row: str, length: int, mode: str, compiled: bool = False
) -> tuple[list[str], dict[str, str]]:
    """The command line and environment of the worker that measures `row` (an implementation, or `IMPL@REV`: the
    implementation with the `longattn` package of the `--against` export, `args.against_tree`)."""
    impl, _, revision = row.partition("@")
    command = (
        [
            sys.executable,
            str(Path(__file__).resolve()),
            "--worker",
            "--impl",
            impl,
            "--length",
            str(length),
            "--mode",
            mode,
            "--batch",
            str(args.batch),
            "--hidden",
            str(args.hidden),
            "--heads",
            str(args.heads),
            "--window",
            str(args.window),
            "--global-tokens",
            str(args.global_tokens),
            "--repeats",
            str(args.repeats),
            "--wait-idle",
            str(args.wait_idle),
            "--timeout",
            str(args.timeout),
            "--clock",
            getattr(args, "clock", "wall"),
            "--threads",
            str(getattr(args, "threads", 0)),
        ]
        + (["--no-tensor-memory"] if not args.tensor_memory else [])
        + [f"--set={item}" for item in args.set]
    )
    command += ["--compiled"] if compiled else []
    env = {**os.environ, **ALLOCATORS[args.allocator]}
    env[PACKAGE_ROOT_VARIABLE] = str(args.against_tree if revision else REPO)
    if getattr(args, "threads", 0):
        env["OMP_NUM_THREADS"] = str(args.threads)
    return command, env


def run_one(args: argparse.Namespace, impl: str, length: int, mode: str, compiled: bool = False) -> dict:
    """Measure row `impl` (see `worker_launch`) in a fresh worker; a failure is a result with an "error"."""
    command, env = worker_launch(args, impl, length, mode, compiled)
    result = {"impl": impl, "length": length, "mode": mode}
    try:
        # The worker gives up by itself when one run exceeds --timeout; this bound only catches a hung worker.
        limit = 2 * args.wait_idle + (args.repeats + 2) * args.timeout
        completed = subprocess.run(command, capture_output=True, text=True, timeout=limit, env=env)
    except subprocess.TimeoutExpired:
        return {**result, "error": f"timeout > {args.timeout:g} s"}
    if completed.returncode != 0:
        # A worker killed for memory exits by signal 9; anything else keeps its last line of stderr.
        lines = completed.stderr.strip().splitlines()
        reason = "killed (out of memory?)" if completed.returncode in (-9, 137) else (lines[-1] if lines else "failed")
        return {**result, "error": reason[:120]}
    result = {**json.loads(completed.stdout.strip().splitlines()[-1]), "impl": impl}
    # An `IMPL@REV` row is worth something only if the worker imported the old tree's package, not this checkout's
    # (an installed or editable longattn could win on sys.path).
    root = Path(env[PACKAGE_ROOT_VARIABLE]).resolve()
    imported = result.get("longattn_file")
    if impl.partition("@")[0] in LONGATTN_IMPLS and not (imported and Path(imported).resolve().is_relative_to(root)):
        return {**result, "error": f"imported longattn from {imported}, not from {root}"}
    return result


# ------------------------------------------------------------------------------------------------ whole models
# `--models SET`: stock transformers models, every row of a set in its own subprocess, side by side with ratios.
@dataclass(frozen=True)
class ModelSet:
    """Whole stock models measured side by side (`--models NAME`).

    Attributes:
        description: One line for the report.
        family: "roberta" (encoder) or "llama" (causal decoder).
        length: Tokens per sequence (`--lengths` overrides it).
        window: longattn's keys on each side of a query (causal: earlier keys only).
        rows: Row names, of MODEL_ROWS.
    """

    description: str
    family: str
    length: int
    window: int
    rows: tuple[str, ...]


MODEL_SETS = {
    "roberta-4k": ModelSet(
        "RoBERTa-base geometry (12 layers x 768, 12 heads, intermediate 3072), random weights, batch 1, forward + "
        "backward, no dropout",
        "roberta",
        4096,
        256,
        ("longformer", "sdpa", "floor", "longattn"),
    ),
    "llama-16k": ModelSet(
        "Llama geometry (4 layers x 1024, 16 heads, 4 key/value heads, intermediate 2816), random weights, batch 1, "
        "causal, forward + backward; generation: greedy, batch 1",
        "llama",
        16384,
        512,
        ("sdpa", "floor", "longattn", "generate-sdpa", "generate-longattn"),
    ),
}
MODEL_ROWS = {
    "longformer": "transformers' LongformerModel, longformer-base-4096's geometry: attention_window 512 (256 per "
    "side), global first token",
    "sdpa": "the stock model under `sdpa` (dense attention)",
    "floor": "attention replaced by a near-zero-cost stand-in (returns v + 0·(q + k)): the floor; the zero term "
    "sends a (zero) gradient through the q/k projections, whose backward the attention's cost must not include",
    "floor-v": "the earlier floor (returns v): slightly optimistic, no gradient reaches the q/k projections, so their "
    "backward is counted in every row's attention cost",
    "longattn": "the stock model with `longattn.apply_longattn(attention_type='sliding', sliding_window=W)`, global "
    "first token for the encoder",
    "generate-sdpa": "`generate()` under `sdpa`, the full dynamic cache",
    "generate-longattn": "`generate()` with longattn's sliding window (bounded cache of W + 1 keys per layer)",
}
FLOORS = {"floor": "longattn-benchmark-floor", "floor-v": "longattn-benchmark-floor-v"}


def _register_floor() -> None:
    """Near-zero-cost attentions: what the model costs without any attention. `floor` returns v + 0·(q + k), so that
    backward still runs the q/k projections (as it does under every real attention); `floor-v` returns v alone."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    def value_only(module, query, key, value, attention_mask, **kwargs):
        groups = query.shape[1] // value.shape[1]
        return value.repeat_interleave(groups, dim=1).transpose(1, 2), None  # [b, n, h, d]

    def value_and_zero_qk(module, query, key, value, attention_mask, **kwargs):
        groups = query.shape[1] // value.shape[1]
        zero = (query + key.repeat_interleave(groups, dim=1)) * 0.0  # a zero gradient reaches both projections
        return (value.repeat_interleave(groups, dim=1) + zero).transpose(1, 2), None

    for row, attention in (("floor", value_and_zero_qk), ("floor-v", value_only)):
        AttentionInterface.register(FLOORS[row], attention)
        AttentionMaskInterface.register(FLOORS[row], lambda *args, **kwargs: None)


def _stock_model(model_set: ModelSet, row: str, length: int):
    """The model of one row, in training mode (dropout 0) or eval mode for generation; random weights."""
    import transformers

    sys.path.insert(0, str(PACKAGE_ROOT))  # this checkout, or the `--against` export for a `longattn@REV` row
    import longattn

    _register_floor()
    implementation = FLOORS.get(row, "sdpa")
    if model_set.family == "roberta":
        geometry = dict(
            hidden_size=768,
            num_hidden_layers=12,
            num_attention_heads=12,
            intermediate_size=3072,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
        )
        if row == "longformer":
            config = transformers.LongformerConfig(
                **geometry, attention_window=2 * model_set.window, max_position_embeddings=length + 2
            )
            return transformers.LongformerModel(config)
        config = transformers.RobertaConfig(**geometry, max_position_embeddings=length + 2)
        model = transformers.RobertaModel(config, add_pooling_layer=False)
    else:
        config = transformers.LlamaConfig(
            hidden_size=1024,
            num_hidden_layers=4,
            num_attention_heads=16,
            num_key_value_heads=4,
            intermediate_size=2816,
            max_position_embeddings=length + 512,
            attention_dropout=0.0,
        )
        cls = transformers.LlamaForCausalLM if row.startswith("generate") else transformers.LlamaModel
        model = cls(config)
    model.set_attn_implementation(implementation)
    if row.endswith("longattn"):
        longattn.apply_longattn(model, attention_type="sliding", sliding_window=model_set.window)
    return model.eval() if row.startswith("generate") else model.train()


def _cache_bytes(cache) -> int:
    """Bytes of every key/value tensor a transformers cache holds."""
    return sum(t.nbytes for layer in cache.layers for t in (layer.keys, layer.values) if t is not None)


def model_worker(args: argparse.Namespace) -> dict:
    """One row of a model set: time and peak memory of forward + backward, or of greedy generation."""
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model_set = MODEL_SETS[args.models]
    row = args.impl.partition("@")[0]  # `longattn@REV`: the longattn row with the package of the `--against` export
    model = _stock_model(model_set, row, args.length)
    input_ids = torch.randint(5, model.config.vocab_size, (1, args.length))
    result = {"impl": args.impl, "length": args.length, "mode": "fwdbwd", "threads": torch.get_num_threads()}
    result["longattn_file"] = sys.modules["longattn"].__file__
    rss_before = _rss_mb()
    if args.impl.startswith("generate"):
        return {
            **result,
            "mode": "generate",
            **_measure_generation(model, input_ids, args.new_tokens),
            "peak_rss_mb": _max_rss_mb() - rss_before,
        }
    kwargs = {}
    if model_set.family == "roberta" and row in ("longformer", "longattn"):
        kwargs["global_attention_mask"] = torch.zeros_like(input_ids).index_fill_(1, torch.tensor([0]), 1)
    grad = torch.randn(1, args.length, model.config.hidden_size)

    def step():
        model(input_ids, **kwargs).last_hidden_state.backward(grad)
        model.zero_grad(set_to_none=True)

    wall, cpu = [], []
    for _ in range(args.repeats + 1):  # the first run is the warm-up
        start, start_cpu = time.perf_counter(), _own_cpu_seconds()
        step()
        wall.append(time.perf_counter() - start)
        cpu.append(_own_cpu_seconds() - start_cpu)
    times = cpu if args.clock == "cpu" else wall
    return {
        **result,
        "clock": args.clock,
        "time_s": min(times[1:]),
        "times_s": times,
        "wall_s": wall,
        "cpu_s": cpu,
        "peak_rss_mb": _max_rss_mb() - rss_before,
    }


def _measure_generation(model, input_ids, new_tokens: int) -> dict:
    """Greedy `generate()` of exactly `new_tokens` tokens: prefill and decode timed apart, the cache's bytes."""
    import torch
    from transformers.generation.streamers import BaseStreamer

    class Clock(BaseStreamer):  # `put` gets the prompt, then each new token as it is chosen
        def __init__(self):
            self.stamps = []

        def put(self, value):
            self.stamps.append(time.perf_counter())

        def end(self):
            self.stamps.append(time.perf_counter())

    clock = Clock()
    with torch.no_grad():
        start = time.perf_counter()
        out = model.generate(
            input_ids,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            streamer=clock,
            return_dict_in_generate=True,
            pad_token_id=0,
        )
    prefill = clock.stamps[1] - start  # the first new token comes from the prefill's logits
    decode = clock.stamps[-1] - clock.stamps[1]
    return {
        "prefill_s": prefill,
        "decode_s": decode,
        "decode_tokens_per_s": (new_tokens - 1) / decode,
        "cache_bytes": _cache_bytes(out.past_key_values),
        "time_s": clock.stamps[-1] - start,
    }


def run_model_row(args: argparse.Namespace, row: str, length: int) -> dict:
    command = [
        sys.executable,
        __file__,
        "--worker",
        "--models",
        args.models,
        "--impl",
        row,
        "--length",
        str(length),
        "--repeats",
        str(args.repeats),
        "--new-tokens",
        str(args.new_tokens),
        "--clock",
        args.clock,
        "--threads",
        str(args.threads),
    ]
    env = {**os.environ, **ALLOCATORS[args.allocator]}
    env[PACKAGE_ROOT_VARIABLE] = str(args.against_tree if "@" in row else REPO)
    if args.threads:
        env["OMP_NUM_THREADS"] = str(args.threads)
    completed = subprocess.run(command, capture_output=True, text=True, env=env)
    if completed.returncode != 0:
        lines = completed.stderr.strip().splitlines()
        reason = "killed (out of memory?)" if completed.returncode in (-9, 137) else (lines[-1] if lines else "failed")
        return {"impl": row, "length": length, "error": reason[:200]}
    result = json.loads(completed.stdout.strip().splitlines()[-1])
    root, imported = Path(env[PACKAGE_ROOT_VARIABLE]).resolve(), result.get("longattn_file")
    if "@" in row and not (imported and Path(imported).resolve().is_relative_to(root)):
        return {"impl": row, "length": length, "error": f"imported longattn from {imported}, not from {root}"}
    return result


def _clock_name(args: argparse.Namespace) -> str:
    if getattr(args, "clock", "wall") == "cpu":
        return f"the worker's CPU time, user + system, {getattr(args, 'threads', 0) or 'default'} torch thread(s)"
    return "wall clock"


def _clock_words(args: argparse.Namespace) -> str:
    words = f"{_clock_name(args)}, best of {args.repeats} runs after a warm-up run"
    rounds = getattr(args, "rounds", 1)
    if rounds > 1:
        words += f", median over {rounds} rounds (rows alternated, each run a fresh process)"
    return words


def _median_of_rounds(rounds: list[list[dict]]) -> list[dict]:
    """One result per row: the round whose time is the median of that row's rounds (a row failing in any round keeps
    its error), with every round's time under `round_times_s`."""
    merged = []
    for per_row in zip(*rounds):
        failed = next((r for r in per_row if "error" in r), None)
        if failed is not None:
            merged.append(failed)
            continue
        ordered = sorted(per_row, key=lambda r: r["time_s"])
        merged.append({**ordered[(len(ordered) - 1) // 2], "round_times_s": [r["time_s"] for r in per_row]})
    return merged


def ideal_fraction(model_set: ModelSet, length: int) -> float:
    """The sliding window's share of dense attention's work: keys per query over dense's (causal: its average)."""
    if model_set.family == "llama":
        return min(1.0, model_set.window / (length / 2))
    return min(1.0, 2 * model_set.window / length)


def model_report(args: argparse.Namespace, results: list[dict], command: str) -> str:
    """The markdown section of one model set: each row's time and memory, attention cost against its ideal."""
    model_set = MODEL_SETS[args.models]
    by_row = {r["impl"]: r for r in results if "error" not in r}
    length = results[0]["length"]
    fraction = ideal_fraction(model_set, length)
    sdpa, floor = by_row.get("sdpa"), by_row.get("floor")
    ideal = (sdpa["time_s"] - floor["time_s"]) * fraction if sdpa and floor else None
    lines = [
        f"### `{args.models}`: {length} tokens",
        "",
        f"{model_set.description}; longattn sliding window {model_set.window} "
        + ("earlier keys per query (causal)." if model_set.family == "llama" else "per side."),
        "",
        f"- command: `{command}`",
        f"- machine: {_cpu_name()}, {os.cpu_count()} CPU cores, torch threads {results[0].get('threads', '?')}",
        f"- time: {_clock_words(args)}; peak MB: resident-set high-water mark minus the "
        "resident set before the first run. Attention cost = time - floor's time; its ideal = (sdpa - floor) x "
        f"{fraction:.4g} (the window's keys per query over dense attention's"
        + (", causal average n/2)." if model_set.family == "llama" else ")."),
        "",
        "| row | time (s) | peak MB | attention cost (s) | cost / ideal | speed-up vs longformer | memory vs sdpa |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        row = r["impl"]
        if row.startswith("generate"):
            continue
        if "error" in r:
            lines.append(f"| {row} | {r['error']} | | | | | |")
            continue
        cost = r["time_s"] - floor["time_s"] if floor else None
        ratio = None
        if cost is not None and ideal and row.partition("@")[0] in ("longattn", "longformer"):
            ratio = cost / ideal
        longformer = by_row.get("longformer")
        speedup = longformer["time_s"] / r["time_s"] if longformer else None
        memory = r["peak_rss_mb"] / sdpa["peak_rss_mb"] if sdpa else None
        lines.append(
            f"| {row} | {r['time_s']:.1f} | {r['peak_rss_mb']:.0f} | {_format(cost, '{:.1f}')} | "
            f"{_format(ratio, '{:.2f}x')} | {_format(speedup, '{:.2f}x')} | {_format(memory, '{:.2f}')} |"
        )
    lines += ["", f"Ideal attention cost: {_format(ideal, '{:.2f}')} s."]
    before, after = by_row.get(f"longattn@{getattr(args, 'against_hash', None)}"), by_row.get("longattn")
    if before and after:
        lines += [
            "",
            f"After vs before (`{args.against}` = {args.against_hash}): time {after['time_s'] / before['time_s']:.3f}, "
            f"peak MB {after['peak_rss_mb'] / before['peak_rss_mb']:.3f}"
            + (
                f", attention cost {(after['time_s'] - floor['time_s']) / (before['time_s'] - floor['time_s']):.3f}."
                if floor
                else "."
            ),
        ]
    generated = [r for r in results if r["impl"].startswith("generate")]
    if generated:
        full = by_row.get("generate-sdpa")
        lines += [
            "",
            f"Generation: greedy, batch 1, {args.new_tokens} new tokens after a {length}-token prompt; decode "
            "tokens/s excludes the prefill (the first new token); cache bytes: every key/value tensor of the cache "
            "after generation.",
            "",
            "| row | prefill (s) | decode tokens/s | cache MB | cache vs full | decode speed vs full |",
            "|---|---:|---:|---:|---:|---:|",
        ]
        for r in generated:
            if "error" in r:
                lines.append(f"| {r['impl']} | {r['error']} | | | | |")
                continue
            cache = r["cache_bytes"] / full["cache_bytes"] if full else None
            speed = r["decode_tokens_per_s"] / full["decode_tokens_per_s"] if full else None
            lines.append(
                f"| {r['impl']} | {r['prefill_s']:.1f} | {r['decode_tokens_per_s']:.2f} | "
                f"{r['cache_bytes'] / 2**20:.1f} | {_format(cache, '{:.4f}')} | {_format(speed, '{:.2f}x')} |"
            )
    lines += ["", "Rows:", ""]
    for r in results:
        row, _, revision = r["impl"].partition("@")
        described = MODEL_ROWS[row] + (
            f", with the longattn package of `{args.against}` ({revision})" if revision else ""
        )
        lines.append(f"- `{r['impl']}`: {described}")
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------------------------ the report
def _format(value, pattern):
    return "—" if value is None else pattern.format(value)


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            return next(line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def _vector_extensions() -> str:
    """The CPU's SIMD flags of /proc/cpuinfo (sse4_2, avx, avx2, fma, avx512*, amx*), or "unknown"."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            flags = next(line.split(":", 1)[1].split() for line in cpuinfo if line.startswith("flags"))
    except (OSError, StopIteration):
        return "unknown"
    wanted = [f for f in flags if f in ("sse4_2", "avx", "avx2", "fma") or f.startswith(("avx512", "amx"))]
    return " ".join(wanted) or "none of sse4_2/avx/avx2/avx512"


def _cache_words() -> str:
    """L1d / L2 / L3 sizes per instance as the OS reports them (what longattn's block rule reads)."""
    sys.path.insert(0, str(PACKAGE_ROOT))
    try:
        from longattn import tuning
    except ImportError:  # a revision without the rule
        return "unknown"
    sizes = tuning.cache_sizes()
    return ", ".join(f"{level} {size // 1024} KiB" for level, size in sizes.items()) or "unknown"


def report(args: argparse.Namespace, results: list[dict], command: str) -> str:
    import torch

    by_key = {(r["impl"], r["length"], r["mode"]): r for r in results if not r.get("compiled")}
    cpu = _cpu_name()
    lines = [
        "# Benchmarks",
        "",
        f"One attention layer with its q/k/v/o projections: hidden {args.hidden}, {args.heads} heads of "
        f"{args.hidden // args.heads}, batch {args.batch}, one-sided window {args.window}"
        + (f", {args.global_tokens} global tokens" if args.global_tokens else ", no global tokens")
        + ", float32, no padding.",
        "",
        f"- date: {datetime.date.today().isoformat()}",
        f"- machine: {cpu}, {os.cpu_count()} CPU cores, torch {torch.__version__} ({torch.get_num_threads()} threads)",
        f"- vector extensions: {_vector_extensions()}; caches: {_cache_words()}",
        f"- command: `{command}`",
        f"- allocator: {args.allocator}"
        + (" (glibc defaults)" if args.allocator == "glibc" else " (freed memory kept for reuse, see `ALLOCATORS`)"),
        "",
        "Method: each (implementation, length, mode) runs in a fresh subprocess. **time** is the best of "
        f"{args.repeats} runs after a warm-up run ({_clock_name(args)})"
        + (
            f", the median of {args.rounds} rounds (every row measured once per round, in turn)"
            if getattr(args, "rounds", 1) > 1
            else ""
        )
        + "; `fwdbwd` is forward plus backward of a "
        "random output gradient into the input and every weight. **peak MB** is the worker's resident-set "
        "high-water mark (`getrusage(RUSAGE_SELF).ru_maxrss`) minus its resident set just before the first run "
        "(libraries, weights and inputs loaded): every allocation the step makes, allocator slack included. "
        "**tensor MB** is the peak of allocated-minus-freed torch tensor bytes during one extra untimed run, from "
        "the allocation events of `torch.profiler(profile_memory=True)`. Ratios are against "
        f"`{args.baseline}` at the same length and mode (time: how many times faster; memory: fraction of its peak).",
        "",
        "Implementations:",
        "",
    ]
    lines += [f"- `{name}`: {IMPLS[name].description}" for name in args.impls]
    if getattr(args, "against", None):
        lines += [
            f"- `IMPL@{args.against_hash}`: the same kind with the longattn package of `{args.against}` "
            f"({args.against_hash}), exported from git; each such worker checked that it imported that package"
        ]
    if args.set:
        lines += [
            "",
            "Config fields set for every longattn kind (`--set`, over the settings above): "
            + ", ".join(f"`{item}`" for item in args.set),
        ]
    for mode in args.mode:
        lines += [
            "",
            f"## {mode}",
            "",
            "| impl | length | time (s) | peak MB (RSS) | tensor MB | speed-up vs "
            + args.baseline
            + " | memory vs "
            + args.baseline
            + " |",
            "|---|---:|---:|---:|---:|---:|---:|",
        ]
        for length in args.lengths:
            for impl in measured_rows(args):
                r = by_key.get((impl, length, mode))
                if r is None:
                    continue
                if "error" in r:
                    lines.append(f"| {impl} | {length} | {r['error']} | | | | |")
                    continue
                base = by_key.get((args.baseline, length, mode))
                speedup = memory = None
                if base and "error" not in base:
                    speedup = base["time_s"] / r["time_s"]
                    memory = r["peak_rss_mb"] / base["peak_rss_mb"] if base["peak_rss_mb"] > 0 else None
                noisy = " *" if r.get("other_load", 0.0) > NOISY else ""
                lines.append(
                    f"| {impl} | {length} | {r['time_s']:.3f}{noisy} | {r['peak_rss_mb']:.0f} | "
                    f"{_format(r.get('tensor_peak_mb'), '{:.0f}')} | {_format(speedup, '{:.2f}x')} | "
                    f"{_format(memory, '{:.2f}')} |"
                )
        if any(r.get("other_load", 0.0) > NOISY for r in results if r["mode"] == mode):
            lines += ["", f"\\* other processes used more than {NOISY:.0%} of the CPUs during this measurement."]
        growth = []
        for impl in measured_rows(args):
            small, large = by_key.get((impl, 8192, mode)), by_key.get((impl, 32768, mode))
            if small and large and "error" not in small and "error" not in large:
                growth.append(f"`{impl}` {large['time_s'] / small['time_s']:.2f}x")
        if growth:
            lines += ["", f"Time growth from 8K to 32K tokens (4x the length): {', '.join(growth)}."]
        if "floor" in args.impls or "full" in args.impls:
            lines += cost_vs_ideal(args, by_key, mode)
        if getattr(args, "against", None):
            lines += after_vs_before(args, by_key, mode)
    if args.compile:
        lines += [
            "",
            "## torch.compile",
            "",
            "The same layers under `torch.compile` (inductor, default mode), each in its own worker; "
            "compilation happens in the untimed warm-up run. Speed-up = eager time / compiled time.",
            "",
            "| impl | length | mode | eager (s) | compiled (s) | speed-up |",
            "|---|---:|---|---:|---:|---:|",
        ]
        for r in results:
            eager = by_key.get((r["impl"], r["length"], r["mode"]))
            if not r.get("compiled") or eager is None:
                continue
            if "error" in r or "error" in eager:
                lines.append(f"| {r['impl']} | {r['length']} | {r['mode']} | {r.get('error') or eager['error']} | | |")
                continue
            noisy = " *" if max(r.get("other_load", 0.0), eager.get("other_load", 0.0)) > NOISY else ""
            lines.append(
                f"| {r['impl']} | {r['length']} | {r['mode']} | {eager['time_s']:.3f} | {r['time_s']:.3f}{noisy} "
                f"| {eager['time_s'] / r['time_s']:.2f}x |"
            )
    return "\n".join(lines) + "\n"


IDEAL_TARGET = 1.5  # issue 36: every kind within 1.5x its ideal


def attention_work(kind: str, length: int, args: argparse.Namespace) -> float | None:
    """Multiply-adds of `kind`'s attention in one forward at `length`, its q/k/v/o projections left out: dense
    attention's 2·D per (query, key) pair for `full`, else the FLOP model of scripts/flop_models.py (what the kind's
    pattern keeps, plus what it adds: sorting, pooling, assignment...); None for a kind it has no model of."""
    if kind == "full":
        return 2 * args.hidden * length**2
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import flop_models

    if kind not in flop_models.KINDS:
        return None
    flops, _ = flop_models.flop_model(kind, length, args)
    return flops - 4 * length * args.hidden**2


def ideal_of(args: argparse.Namespace, by_key: dict, impl: str, length: int, mode: str) -> dict | None:
    """The ideal of row `impl` (an `IMPL@REV` row: IMPL's) at `length` and `mode`, from the same run's `floor` and
    `full` rows: floor + (full - floor) x the kind's attention work over dense attention's. None where a row is
    missing or failed, or the kind has no FLOP model."""
    floor, full = by_key.get(("floor", length, mode)), by_key.get(("full", length, mode))
    if not floor or not full or "error" in floor or "error" in full:
        return None
    work = attention_work(impl.partition("@")[0], length, args)
    if work is None:
        return None
    share = work / attention_work("full", length, args)
    dense = full["time_s"] - floor["time_s"]
    return {"share": share, "ideal_s": floor["time_s"] + dense * share, "ideal_attention_s": dense * share}


def cost_vs_ideal(args: argparse.Namespace, by_key: dict, mode: str) -> list[str]:
    """The cost / ideal section of one mode: every kind's time against its ideal (see `ideal_of`)."""
    lines = [
        "",
        f"### cost / ideal ({mode})",
        "",
        "Ideal = floor + (full - floor) x share, share = the kind's attention multiply-adds over dense attention's "
        "(FLOP models of scripts/flop_models.py: the (query, key) pairs its pattern keeps plus what it adds; backward "
        "taken as the same multiple of forward for every term), `floor` and `full` measured in the same run. "
        "Attention cost = time - floor. Peak vs full: the row's peak RSS over `full`'s (memory the step adds).",
        "",
        "| impl | length | time (s) | share of dense | ideal (s) | time / ideal | attention / ideal attention "
        "| peak vs full |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    verdicts = []
    largest = max(args.lengths)
    for length in args.lengths:
        for impl in measured_rows(args):
            r = by_key.get((impl, length, mode))
            if r is None or "error" in r or impl == "floor":
                continue
            ideal = ideal_of(args, by_key, impl, length, mode)
            full = by_key.get(("full", length, mode))
            peak = r["peak_rss_mb"] / full["peak_rss_mb"] if full and full.get("peak_rss_mb", 0) > 0 else None
            if ideal is None:
                lines.append(f"| {impl} | {length} | {r['time_s']:.3f} | — | — | — | — | {_format(peak, '{:.2f}')} |")
                continue
            ratio = r["time_s"] / ideal["ideal_s"]
            floor = by_key[("floor", length, mode)]["time_s"]
            attention = (r["time_s"] - floor) / ideal["ideal_attention_s"] if ideal["ideal_attention_s"] > 0 else None
            lines.append(
                f"| {impl} | {length} | {r['time_s']:.3f} | {ideal['share']:.4f} | {ideal['ideal_s']:.3f} | "
                f"{ratio:.2f}x | {_format(attention, '{:.2f}x')} | {_format(peak, '{:.2f}')} |"
            )
            if length == largest and impl not in ("full",) and "@" not in impl:
                verdicts.append((impl, ratio))
    if verdicts:
        over = [f"`{impl}` {ratio:.2f}x" for impl, ratio in verdicts if ratio > IDEAL_TARGET]
        lines += [
            "",
            f"At {largest} tokens, {len(verdicts) - len(over)} of {len(verdicts)} kinds within {IDEAL_TARGET}x their "
            "ideal" + (f"; above it: {', '.join(over)}." if over else "."),
        ]
    else:
        lines += ["", "No ideal: measure the rows `floor` and `full` in the same run (`--impls floor full ...`)."]
    return lines


def after_vs_before(args: argparse.Namespace, by_key: dict, mode: str) -> list[str]:
    """The `--against` section of one mode: per longattn kind and length, after (this checkout) over before (the old
    revision) for time, peak RSS and tensor MB, and the geometric mean of the time ratio over the lengths."""
    before_name = f"`{args.against}` ({args.against_hash})" if args.against != args.against_hash else args.against_hash
    lines = [
        "",
        f"### after vs before ({mode})",
        "",
        f"After: {args.after}; before: {before_name}. Measured in the same run, each before row just before its after "
        "row. Ratios are after / before: below 1 is faster or smaller after.",
        "",
        "| impl | length | time before (s) | time after (s) | time after/before | peak MB before | peak MB after "
        "| peak after/before | tensor MB after/before |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    time_ratios: dict[str, list[float]] = {}
    for length in args.lengths:
        for impl in (impl for impl in args.impls if impl in LONGATTN_IMPLS):
            before, after = by_key.get((f"{impl}@{args.against_hash}", length, mode)), by_key.get((impl, length, mode))
            if before is None or after is None:
                continue
            if "error" in before or "error" in after:
                reason = "; ".join(
                    f"{side}: {r['error']}" for side, r in (("before", before), ("after", after)) if "error" in r
                )
                lines.append(f"| {impl} | {length} | {reason} | | | | | | |")
                continue
            noisy = " *" if max(before.get("other_load", 0.0), after.get("other_load", 0.0)) > NOISY else ""
            time_ratio = after["time_s"] / before["time_s"]
            time_ratios.setdefault(impl, []).append(time_ratio)
            peak = after["peak_rss_mb"] / before["peak_rss_mb"] if before["peak_rss_mb"] > 0 else None
            tensors = (
                after["tensor_peak_mb"] / before["tensor_peak_mb"]
                if after.get("tensor_peak_mb") is not None and before.get("tensor_peak_mb")
                else None
            )
            lines.append(
                f"| {impl} | {length} | {before['time_s']:.3f} | {after['time_s']:.3f} | {time_ratio:.2f}{noisy} | "
                f"{before['peak_rss_mb']:.0f} | {after['peak_rss_mb']:.0f} | {_format(peak, '{:.2f}')} | "
                f"{_format(tensors, '{:.2f}')} |"
            )
    if time_ratios:
        means = [
            f"`{impl}` {math.exp(sum(map(math.log, ratios)) / len(ratios)):.2f}" for impl, ratios in time_ratios.items()
        ]
        lines += ["", f"Time after/before, geometric mean over the lengths: {', '.join(means)}."]
    return lines


def write_outputs(args: argparse.Namespace, results: list[dict], text: str) -> None:
    """The report to `--out` (else stdout) and the raw results to `--json`."""
    if args.json:
        args.json.write_text(json.dumps(results, indent=1) + "\n")
    if args.out:
        args.out.write_text(text)
        print(f"wrote {args.out}")
    else:
        print(text)


def run_models(args: argparse.Namespace, argv: list[str] | None) -> None:
    """`--models SET`: each row in a fresh subprocess (the worker runs one row), then the report."""
    if args.worker:
        print(json.dumps(model_worker(args)))
        return
    model_set = MODEL_SETS[args.models]
    length = args.model_length or model_set.length
    rows = list(args.rows or model_set.rows)
    if args.against:  # the longattn row of the old revision, measured just before this checkout's
        rows = [name for row in rows for name in ((f"{row}@{args.against_hash}", row) if row == "longattn" else (row,))]
    command = "python scripts/benchmark.py " + " ".join(sys.argv[1:] if argv is None else argv)
    rounds = []
    for round_index in range(args.rounds):  # rows alternated round by round: slow spells of a shared machine hit all
        results = []
        for row in rows:
            result = run_model_row(args, row, length)
            results.append(result)
            print(f"round {round_index + 1} {row:>18} {length:>6}: {json.dumps(result)}", flush=True)
        rounds.append(results)
    results = _median_of_rounds(rounds)
    text = model_report(args, results, command)
    write_outputs(args, results, text)


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """`--help` shows every default, except for on/off flags (their default is their absence)."""

    def _get_help_string(self, action):
        return action.help if action.nargs == 0 else super()._get_help_string(action)


def main(argv: list[str] | None = None) -> None:
    peers = sorted(impl for impl in IMPLS if IMPLS[impl].package)
    parser = argparse.ArgumentParser(
        allow_abbrev=False,
        description=__doc__.split("\n\n")[0],
        formatter_class=_HelpFormatter,
        epilog=f"Peers from other packages ({', '.join(peers)}) are not installed by scripts/setup.sh; install them "
        f"(the `bench` extra of pyproject.toml, torch pinned first) with: {INSTALL_PEERS}",
    )
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096, 16384], help="sequence lengths")
    parser.add_argument(
        "--impls",
        nargs="+",
        default=default_impls(),
        choices=sorted(IMPLS),
        metavar="IMPL",
        help=f"implementations to measure, of: {', '.join(sorted(IMPLS))}; the default takes "
        "local-attention only where it is installed",
    )
    parser.add_argument(
        "--baseline",
        default=BASELINE,
        choices=sorted(IMPLS),
        metavar="IMPL",
        help="the implementation the ratio columns compare against",
    )
    parser.add_argument(
        "--mode",
        nargs="+",
        default=["fwd", "fwdbwd"],
        choices=["fwd", "fwdbwd"],
        help="fwd: forward only; fwdbwd: forward and backward",
    )
    parser.add_argument("--batch", type=int, default=1, help="batch size")
    parser.add_argument("--hidden", type=int, default=256, help="hidden size")
    parser.add_argument("--heads", type=int, default=4, help="attention heads")
    parser.add_argument("--window", type=int, default=256, help="keys on each side of a query")
    parser.add_argument("--global-tokens", type=int, default=0, help="the first N tokens are global (where supported)")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs after the warm-up run (the best counts)")
    parser.add_argument(
        "--timeout",
        type=float,
        default=600.0,
        help="give up on a configuration whose single (warm-up) run takes longer than this many seconds",
    )
    parser.add_argument(
        "--max-length",
        nargs="*",
        default=[],
        metavar="IMPL=N",
        help="skip lengths above N for IMPL (e.g. full=32768), recorded as skipped",
    )
    parser.add_argument(
        "--wait-idle",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="patience per configuration on a shared machine: wait for idle CPUs before each timed run and repeat "
        "disturbed runs, for up to this many seconds (0: time whatever happens)",
    )
    parser.add_argument(
        "--allocator",
        choices=sorted(ALLOCATORS),
        default="glibc",
        help="glibc: its defaults; reuse: keep freed memory instead of unmapping it (see ALLOCATORS)",
    )
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="FIELD=VALUE",
        help="a LongAttnConfig field for every longattn kind of the run, over its registered setting (repeatable; "
        "peers ignore it; values as in the recipes' --config_overrides), e.g. --set fixed_num_summary=1 "
        "--set sliding_dilation=[1,2,4,8]",
    )
    parser.add_argument(
        "--compile",
        action="store_true",
        help="also time every implementation under torch.compile, side by side with eager (compiled speed-up table)",
    )
    parser.add_argument(
        "--against",
        metavar="REV",
        help="also measure every longattn kind of --impls with the longattn package of git revision REV (exported "
        "to a temporary folder), as rows IMPL@REV measured just before IMPL; the report adds after-vs-before ratios. "
        "With --models: a row longattn@REV just before row longattn",
    )
    parser.add_argument(
        "--no-tensor-memory",
        dest="tensor_memory",
        action="store_false",
        help="skip the profiled run that measures the tensor MB column",
    )
    parser.add_argument("--out", type=Path, help="write the markdown report here")
    parser.add_argument("--json", type=Path, help="also write the raw results here")
    parser.add_argument(
        "--models",
        choices=sorted(MODEL_SETS),
        help="measure whole stock models instead of one layer: every row of the set side by side "
        "(" + "; ".join(f"{name}: {s.description}" for name, s in MODEL_SETS.items()) + "); "
        "uses --model-length, --new-tokens, --rows, --repeats, --allocator, --out, --json",
    )
    parser.add_argument("--model-length", type=int, help="tokens per sequence for --models (default: the set's length)")
    parser.add_argument(
        "--new-tokens", type=int, default=256, help="tokens generated by the generation rows of --models"
    )
    parser.add_argument(
        "--rows", nargs="+", metavar="ROW", help=f"only these rows of --models, of: {', '.join(MODEL_ROWS)}"
    )
    parser.add_argument(
        "--clock",
        choices=["wall", "cpu"],
        default="wall",
        help="time by wall clock or by the worker process's CPU time (user + system, all threads); with --threads 1 "
        "CPU time hardly moves with other processes' load, which wall clock does several-fold",
    )
    parser.add_argument("--threads", type=int, default=0, help="torch threads in each worker (0: torch's default)")
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="measure every row (of --models, or every implementation, length and mode) this many times, rows "
        "alternated round by round; the median round counts",
    )
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--compiled", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--impl", help=argparse.SUPPRESS)
    parser.add_argument("--length", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    try:
        config_overrides(args.set)
        if not args.models:
            check_installed([args.impl] if args.worker else [*args.impls, args.baseline])
    except ValueError as error:
        parser.error(str(error))
    if args.against and not args.worker and not args.models and not LONGATTN_IMPLS.intersection(args.impls):
        parser.error(
            f"--against {args.against} compares longattn kinds of the per-layer table: give at least one of "
            f"{', '.join(sorted(LONGATTN_IMPLS))} in --impls (or --models, whose longattn row it then adds)"
        )
    if (
        args.against
        and args.models
        and not args.worker
        and "longattn" not in (args.rows or MODEL_SETS[args.models].rows)
    ):
        parser.error(f"--against {args.against} with --models adds a row before `longattn`: keep row longattn")

    if args.against and not args.worker:
        # Lives until main returns (or the interpreter exits after an error), then the folder is removed.
        export = tempfile.TemporaryDirectory(prefix="benchmark-against-")
        try:
            args.against_hash = export_revision(args.against, Path(export.name))
        except ValueError as error:
            parser.error(str(error))
        args.against_tree, args.after = Path(export.name), describe_checkout()
        print(f"before: {args.against} = {args.against_hash}, exported to {args.against_tree}; after: {args.after}")
    if args.models:
        run_models(args, argv)
        return
    if args.worker:
        args.mode = args.mode[0] if isinstance(args.mode, list) else args.mode
        print(json.dumps(worker(args)))
        return

    max_length = {}
    for item in args.max_length:
        impl, _, value = item.partition("=")
        max_length[impl] = int(value)
    command = "python scripts/benchmark.py " + " ".join(sys.argv[1:] if argv is None else argv)
    compiled_flags = (False, True) if args.compile else (False,)
    runs = [(row, compiled) for row in measured_rows(args) for compiled in compiled_flags]
    rounds = []
    for round_index in range(args.rounds):  # every row once per round: slow spells of a shared machine hit all
        results = []
        for length in args.lengths:
            for mode in args.mode:
                for impl, compiled in runs:
                    limit = max_length.get(impl.partition("@")[0], length)  # an `IMPL@REV` row shares IMPL's limit
                    if length > limit:
                        result = {"impl": impl, "length": length, "mode": mode, "error": f"skipped (> {limit})"}
                    else:
                        result = run_one(args, impl, length, mode, compiled)
                    results.append({**result, "compiled": compiled})
                    shown = result.get("error") or (
                        f"{result['time_s']:.3f} s, peak {result['peak_rss_mb']:.0f} MB RSS, "
                        f"{_format(result.get('tensor_peak_mb'), '{:.0f}')} MB tensors, "
                        f"other load {result['other_load']:.0%}"
                    )
                    where = f"round {round_index + 1} " if args.rounds > 1 else ""
                    name = impl + (" (compiled)" if compiled else "")
                    print(f"{where}{name:>16} {length:>6} {mode:>6}: {shown}", flush=True)
        rounds.append(results)
    results = _median_of_rounds(rounds)
    text = report(args, results, command)
    write_outputs(args, results, text)


if __name__ == "__main__":
    main()
