"""Check and benchmark longattn's GPU back ends: every pattern x back end against the dense reference, then timings.

One command on a CUDA machine:

    python scripts/gpu_check.py                      # checks + benchmarks + 1M-token forward, writes the report
    python scripts/gpu_check.py --skip-bench         # correctness only
    python scripts/gpu_check.py --lengths 4096 16384 --skip-million

Without CUDA it prints why and exits 0 (nothing to check). With xformers missing, or its kernels failing their
smoke test on this torch build, the xformers rows say so (the reasons of `longattn.backends`) and the rest runs.

1. Correctness: for each pattern (sliding, causal sliding, dilated, per-head dilation with global tokens and
   padding, strided, fixed, bucketed blocks, dense with padding) and each back end that can run it (torch,
   flex, xformers), the output and the gradients of q, k, v against `ops.reference_attention` under the
   materialised pattern, in float32, bfloat16 and float16, with tolerances by dtype. The reference itself computes
   in float32 from the same half-precision inputs, so the tolerance measures the kernel, not the input rounding.
2. Benchmarks (bfloat16, batch 1, 16 heads of 64): forward and forward + backward at 4K to 128K for each pattern
   and back end, beside dense SDPA (flash) and the "ideal" time: dense flash time x the pattern's density.
   Time: median of CUDA-event timings after warm-up; peak: `torch.cuda.max_memory_allocated` above the inputs.
3. Every registered attention kind in a 2-layer model (encoder and causal LM), forward + backward in bfloat16:
   finite outputs and gradients, and its time.
4. A forward pass of a 4-layer, hidden-512 sliding-window encoder on 1M tokens in one batch, per back end.

The table is printed and written to `docs/benchmarks_gpu.md` (with the date, the GPU and the software versions).
FlexAttention compiles for every pattern and length, so a first full run takes a while; under a time limit per
command, split it (`--skip-bench`, then `--skip-checks --skip-million --lengths ...`, with `--out` per part).
"""

from __future__ import annotations

import argparse
import datetime
import math
import platform
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from longattn import backends, executor_flex, executor_xformers, ops, patterns  # noqa: E402  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# (rtol, atol) of outputs and gradients against the float32 reference on the same inputs.
TOLERANCE = {torch.float32: (2e-4, 2e-4), torch.bfloat16: (3e-2, 3e-2), torch.float16: (5e-3, 5e-3)}
BACKENDS = ("torch", "flex", "xformers", "triton")  # triton: run with TRITON_INTERPRET unset (compiled kernels)
DEVICE = "cuda"  # `--device cpu` dry-runs the script's own logic on tiny sizes (FlexAttention then declines grads)


# ------------------------------------------------------------------------------------------------ the cases
@dataclass
class Case:
    """A pattern with its dense mask and its runner per back end.

    Attributes:
        name: Row label.
        mask_fn: `mask_fn(b, n, device) -> MaskFn` over absolute positions (the reference materialises it).
        run: `run(backend, q, k, v, masks) -> out`, or raises ValueError with the dispatcher's reasons.
        density: `density(n) -> float`, about the visible fraction of the n x n score matrix (for the ideal
            time).
        buckets: For content-based blocks, `buckets(b, h, n, device)` (the reference masks "same bucket").
    """

    name: str
    mask_fn: Callable
    run: Callable
    density: Callable[[int], float]
    buckets: Callable | None = None


def _masks(b: int, n: int, device, *, padding: bool, global_tokens: bool):
    key_padding_mask = global_mask = None
    if padding:
        key_padding_mask = torch.ones(b, n, dtype=torch.bool, device=device)
        key_padding_mask[-1, n - n // 10 :] = False
    if global_tokens:
        global_mask = torch.zeros(b, n, dtype=torch.bool, device=device)
        global_mask[:, 0] = True
        global_mask[:, n // 2] = True
    return key_padding_mask, global_mask


def _sliding_case(name, *, window, dilation=1, causal=False, padding=False, global_tokens=False):
    def pattern(b, n, device):
        key_padding_mask, global_mask = _masks(b, n, device, padding=padding, global_tokens=global_tokens)
        return patterns.sliding_window_pattern(
            window=window, dilation=dilation, causal=causal, key_padding_mask=key_padding_mask, global_mask=global_mask
        )

    def run(backend, q, k, v):
        b, _, n, _ = q.shape
        key_padding_mask, global_mask = _masks(b, n, q.device, padding=padding, global_tokens=global_tokens)
        return ops.sliding_window_attention(
            q,
            k,
            v,
            window=window,
            dilation=dilation,
            causal=causal,
            key_padding_mask=key_padding_mask,
            global_mask=global_mask,
            backend=backend,
        )

    def density(n):
        return min(1.0, ((1 if causal else 2) * window + 1) / n)

    return Case(name, pattern, run, density)


def _strided_case(name, *, stride, causal):
    def pattern(b, n, device):
        if not hasattr(patterns, "strided_pattern"):
            raise ValueError("longattn.patterns.strided_pattern does not exist in this checkout")
        return patterns.strided_pattern(stride=stride, causal=causal)

    def run(backend, q, k, v):
        return ops.strided_attention(q, k, v, stride=stride, causal=causal, backend=backend)

    def density(n):
        return min(1.0, ((1 if causal else 2) * (stride + n / stride)) / n)

    return Case(name, pattern, run, density)


def _fixed_case(name, *, block_size, num_summary, causal):
    def pattern(b, n, device):
        if not hasattr(patterns, "fixed_pattern"):
            raise ValueError("longattn.patterns.fixed_pattern does not exist in this checkout")
        return patterns.fixed_pattern(block_size=block_size, num_summary=num_summary, causal=causal)

    def run(backend, q, k, v):
        return ops.fixed_attention(
            q, k, v, block_size=block_size, num_summary=num_summary, causal=causal, backend=backend
        )

    def density(n):
        return min(1.0, (block_size + num_summary * n / block_size) / n / (2 if causal else 1))

    return Case(name, pattern, run, density)


def _bucket_case(name, *, num_buckets):
    def buckets(b, h, n, device):
        generator = torch.Generator(device=device).manual_seed(0)
        return torch.randint(0, num_buckets, (b, h, n), device=device, generator=generator)

    def pattern(b, n, device):
        raise NotImplementedError  # content-based: the mask is built from the buckets in `reference`

    def run(backend, q, k, v):
        b, h, n, d = q.shape
        if backend != "xformers":
            raise ValueError(f"bucketed attention is an xformers mapping here; {backend!r} runs it in the kinds")
        _require(backend, q, k, v, "blocks")
        return executor_xformers.bucketed_attention(q, k, v, buckets=buckets(b, h, n, q.device), scale=d**-0.5)

    return Case(name, pattern, run, lambda n: 1.0 / num_buckets, buckets=buckets)


def _full_case(name, *, causal, padding):
    def pattern(b, n, device):
        key_padding_mask, _ = _masks(b, n, device, padding=padding, global_tokens=False)
        parts = [patterns.causal_mask()] if causal else []
        if key_padding_mask is not None:
            parts.append(patterns.key_padding_predicate(key_padding_mask))
        return patterns.and_masks(*parts)

    def run(backend, q, k, v):
        b, _, n, _ = q.shape
        key_padding_mask, _ = _masks(b, n, q.device, padding=padding, global_tokens=False)
        return ops.full_attention(q, k, v, causal=causal, key_padding_mask=key_padding_mask, backend=backend)

    return Case(name, pattern, run, lambda n: 0.5 if causal else 1.0)


def _require(backend, q, k, v, pattern, **fields):
    """Ask the dispatcher, so that a back end that cannot run says why (as the ops functions do)."""
    request = backends.AttentionRequest.for_inputs(q, k, v, pattern=pattern, **fields)
    backends.select_backend(backend, request)


CHECK_CASES = [
    _sliding_case("sliding w64", window=64),
    _sliding_case("sliding w64 causal", window=64, causal=True),
    _sliding_case("dilated w32 d4", window=32, dilation=4),
    _sliding_case(
        "dilated per head + global + padding", window=32, dilation=(1, 1, 2, 4), padding=True, global_tokens=True
    ),
    _sliding_case("sliding causal + global + padding", window=32, causal=True, padding=True, global_tokens=True),
    _strided_case("strided 32", stride=32, causal=False),
    _strided_case("strided 32 causal", stride=32, causal=True),
    _fixed_case("fixed 64/8", block_size=64, num_summary=8, causal=False),
    _fixed_case("fixed 64/8 causal", block_size=64, num_summary=8, causal=True),
    _bucket_case("buckets 16", num_buckets=16),
    _full_case("full + padding", causal=False, padding=True),
    _full_case("full causal", causal=True, padding=False),
]

BENCH_CASES = [
    _sliding_case("sliding w256", window=256),
    _sliding_case("sliding w256 causal", window=256, causal=True),
    _sliding_case("dilated w256 d4", window=256, dilation=4),
    # The Triton back end's targets (issue table): a wider window, a dilation mix across the 16 heads in one call,
    # and one global token with padding (the cost of the global pass against the plain window).
    _sliding_case("sliding w512", window=512),
    _sliding_case("dilation mix 1,2,4,8 w256", window=256, dilation=(1, 2, 4, 8) * 4),
    _sliding_case("sliding w256 + global + padding", window=256, padding=True, global_tokens=True),
    _strided_case("strided 256", stride=256, causal=False),
    _strided_case("strided 256 causal", stride=256, causal=True),
    _fixed_case("fixed 256/16", block_size=256, num_summary=16, causal=False),
    _bucket_case("buckets 64", num_buckets=64),
]


def _selected(cases: list[Case], names: list[str] | None) -> list[Case]:
    """The cases whose name contains one of `names` (all when None)."""
    return [case for case in cases if names is None or any(name in case.name for name in names)]


# ------------------------------------------------------------------------------------------------ correctness
def _reference(case: Case, q, k, v):
    b, h, n, d = q.shape
    if case.buckets is not None:
        buckets = case.buckets(b, h, n, q.device)
        mask = buckets[..., :, None] == buckets[..., None, :]
    else:
        mask = patterns.materialize_mask(
            case.mask_fn(b, n, q.device), batch=b, heads=h, q_len=n, kv_len=n, device=q.device
        )
    return ops.reference_attention(q, k, v, mask, scale=d**-0.5)


def check(case: Case, backend: str, dtype: torch.dtype, *, n: int, heads: int, head_dim: int) -> str:
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, heads, n, head_dim, device=DEVICE, dtype=dtype, requires_grad=True) for _ in range(3))
    grad_out = torch.randn(2, heads, n, head_dim, device=DEVICE, dtype=dtype)
    try:
        expected = _reference(case, q, k, v)
    except ValueError as error:
        return "n/a: " + str(error)[:90]
    expected_grads = torch.autograd.grad(expected, (q, k, v), grad_out)
    try:
        actual = case.run(backend, q, k, v)
        actual_grads = torch.autograd.grad(actual, (q, k, v), grad_out)
    except ValueError as error:
        return "n/a: " + str(error).split(": ", 1)[-1][:90]
    rtol, atol = TOLERANCE[dtype]
    actual, expected = actual.detach(), expected.detach()
    worst = []
    for name, a, e in zip(("out", "dq", "dk", "dv"), (actual, *actual_grads), (expected, *expected_grads), strict=True):
        if not torch.isfinite(a).all():
            return f"FAIL ({name} not finite)"
        allowed = atol + rtol * e.float().abs()
        ratio = float(((a.float() - e.float()).abs() / allowed).max())
        worst.append((ratio, name))
    ratio, name = max(worst)
    return ("ok" if ratio <= 1 else "FAIL") + f" ({name} at {ratio:.2f} of tolerance)"


def run_checks(args) -> tuple[list[str], int]:
    # The reference and the torch executor must not use TF32, or float32 tolerances measure TF32.
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    lines = ["| pattern | dtype | " + " | ".join(BACKENDS) + " |", "|---|---|" + "---|" * len(BACKENDS)]
    failures = 0
    for case in _selected(CHECK_CASES, args.cases):
        for dtype_name in args.dtypes:
            dtype = DTYPES[dtype_name]
            cells = []
            for backend in BACKENDS:
                try:
                    cell = check(case, backend, dtype, n=args.check_length, heads=4, head_dim=64)
                except Exception as error:  # noqa: BLE001 - report and go on
                    cell = f"ERROR {type(error).__name__}: {str(error).splitlines()[0][:80] if str(error) else ''}"
                    if args.verbose:
                        traceback.print_exc()
                failures += cell.startswith(("FAIL", "ERROR"))
                cells.append(cell)
            line = f"| {case.name} | {dtype_name} | " + " | ".join(cells) + " |"
            print(line, flush=True)
            lines.append(line)
    print(f"correctness: {failures} failure(s)", flush=True)
    return lines, failures


# ------------------------------------------------------------------------------------------------ benchmarks
def _time(fn, *, warmup: int, repeats: int) -> tuple[float, float]:
    """Median milliseconds of `fn()` and its peak memory in MB above what was allocated before."""
    for _ in range(warmup):
        fn()
    if DEVICE != "cuda":
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1000)
        return statistics.median(times), math.nan
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    times = []
    for _ in range(repeats):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        stop.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(stop))
    return statistics.median(times), (torch.cuda.max_memory_allocated() - base) / 2**20


def _step(run, q, k, v, mode):
    if mode == "fwd":

        def step():
            with torch.no_grad():
                run(q, k, v)
    else:

        def step():
            out = run(q, k, v)
            out.backward(torch.ones_like(out))

    return step


def _dense_flash(q, k, v):
    from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: PLC0415

    with sdpa_kernel([SDPBackend.FLASH_ATTENTION] if DEVICE == "cuda" else [SDPBackend.MATH]):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v)


def run_benchmarks(args) -> list[str]:
    heads, head_dim, dtype = 16, 64, torch.bfloat16
    lines = [
        "| pattern | n | mode | dense flash ms | ideal ms | "
        + " | ".join(f"{b} ms (MB)" for b in BACKENDS)
        + " | best / ideal | flex / xformers | flex / triton |",
        "|---|---|---|---|---|" + "---|" * len(BACKENDS) + "---|---|---|",
    ]
    for n in args.lengths:
        # Compile FlexAttention afresh for each length: otherwise the second length onwards runs a kernel compiled
        # for symbolic lengths, which is slower than what a user running one length gets.
        torch._dynamo.reset()
        executor_flex._compiled_flex_attention.cache_clear()
        torch.manual_seed(0)
        q, k, v = (torch.randn(1, heads, n, head_dim, device=DEVICE, dtype=dtype, requires_grad=True) for _ in range(3))
        dense = {}
        for mode in args.modes:
            try:
                dense[mode], _ = _time(
                    _step(lambda q, k, v: _dense_flash(q, k, v), q, k, v, mode),
                    warmup=args.warmup,
                    repeats=args.repeats,
                )
            except Exception as error:  # noqa: BLE001
                dense[mode] = math.nan
                print(f"dense flash {n} {mode}: {type(error).__name__}: {error}", flush=True)
        for case in _selected(BENCH_CASES, args.cases):
            for mode in args.modes:
                ideal = dense[mode] * case.density(n)
                cells, times = [], {}
                for backend in BACKENDS:
                    if backend == "torch" and n > args.torch_max_length:
                        cells.append("skipped")
                        continue
                    try:
                        ms, mb = _time(
                            _step(lambda q, k, v, backend=backend: case.run(backend, q, k, v), q, k, v, mode),
                            warmup=args.warmup,
                            repeats=args.repeats,
                        )
                        times[backend] = ms
                        cells.append(f"{ms:.2f} ({mb:.0f})")
                    except ValueError as error:
                        cells.append("n/a")
                        if args.verbose:
                            print(f"  {case.name} {backend}: {error}", flush=True)
                    except Exception as error:  # noqa: BLE001 - out of memory and kernel errors are results too
                        cells.append(f"{type(error).__name__}")
                        if args.verbose:
                            traceback.print_exc()
                    if DEVICE == "cuda":
                        torch.cuda.empty_cache()
                    q.grad = k.grad = v.grad = None
                best = min(times.values()) if times else math.nan
                flex_vs_xformers = times.get("flex", math.nan) / times.get("xformers", math.nan)
                flex_vs_triton = times.get("flex", math.nan) / times.get("triton", math.nan)
                line = (
                    f"| {case.name} | {n} | {mode} | {dense[mode]:.2f} | {ideal:.3f} | "
                    + " | ".join(cells)
                    + f" | {best / ideal:.2f} | {flex_vs_xformers:.2f} | {flex_vs_triton:.2f} |"
                )
                print(line, flush=True)
                lines.append(line)
        del q, k, v
        if DEVICE == "cuda":
            torch.cuda.empty_cache()
    return lines


def run_million(args) -> list[str]:
    """One forward pass of a 4-layer sliding-window encoder on `--million-length` tokens, per back end."""
    from longattn import LongAttnConfig  # noqa: PLC0415
    from longattn.modeling_longattn import LongAttnModel  # noqa: PLC0415

    n = args.million_length
    label = "4 layers, hidden 512, 8 heads, sliding 256"
    input_ids = torch.randint(3, 260, (1, n), device=DEVICE)
    lines = ["| model | tokens | back end | forward s | peak GB |", "|---|---|---|---|---|"]
    for backend in args.million_backends:
        config = LongAttnConfig(
            vocab_size=260,
            hidden_size=512,
            num_hidden_layers=4,
            num_attention_heads=8,
            intermediate_size=2048,
            max_position_embeddings=n,
            attention_type="sliding",
            sliding_window=256,
            attention_backend=backend,
            hidden_dropout_prob=0.0,
        )
        torch.manual_seed(0)
        model = LongAttnModel(config).to(DEVICE, torch.bfloat16).eval()
        name = backend
        if backend == "auto":
            request = backends.AttentionRequest(
                pattern="sliding",
                device=torch.device(DEVICE).type,
                dtype=torch.bfloat16,
                head_dim=64,
                value_head_dim=64,
                q_len=n,
                kv_len=n,
                heads=8,
            )
            name = f"auto -> {backends.select_backend('auto', request)}"
        try:
            with torch.inference_mode():
                model(input_ids[:, :4096])  # compile / warm-up
                if DEVICE == "cuda":
                    torch.cuda.synchronize()
                    torch.cuda.reset_peak_memory_stats()
                start = time.perf_counter()
                out = model(input_ids).last_hidden_state
                finite = bool(torch.isfinite(out).all())  # also waits for the GPU
            seconds = time.perf_counter() - start
            peak = torch.cuda.max_memory_allocated() / 2**30 if DEVICE == "cuda" else math.nan
            line = f"| {label} | {n} | {name} | {seconds:.2f} | {peak:.1f} |"
            if not finite:
                line += " (non-finite output!)"
        except Exception as error:  # noqa: BLE001 - out of memory is a result too
            line = f"| {label} | {n} | {name} | {type(error).__name__}: {str(error)[:120]} | |"
        print(line, flush=True)
        lines.append(line)
        del model
        if DEVICE == "cuda":
            torch.cuda.empty_cache()
    return lines


def run_kinds(args) -> list[str]:
    """Every registered attention kind in a 2-layer model on the GPU: forward + backward, encoder and causal LM.

    Checks that each kind's executors run on CUDA in bfloat16 with finite outputs and gradients, and times them
    (median of `--repeats` after `--warmup`) at `--kinds-length` tokens, hidden 256, 4 heads, batch 1.
    """
    from longattn import LongAttnConfig, available_attention_types  # noqa: PLC0415
    from longattn.modeling_longattn import LongAttnForCausalLM, LongAttnModel  # noqa: PLC0415

    n = args.kinds_length
    lines = ["| kind | encoder fwd+bwd ms (MB) | causal LM fwd+bwd ms (MB) |", "|---|---|---|"]
    input_ids = torch.randint(3, 260, (1, n), device=DEVICE)
    # Every kind on "auto", then the explicit xformers paths that "auto" does not pick yet.
    runs = [(kind, "auto") for kind in available_attention_types()]
    runs += [(kind, "xformers") for kind in ("lsh", "routing", "sinkhorn")]
    for kind, backend in runs:
        cells = []
        for model_class in (LongAttnModel, LongAttnForCausalLM):
            try:
                config = LongAttnConfig(
                    vocab_size=260,
                    hidden_size=256,
                    num_hidden_layers=2,
                    num_attention_heads=4,
                    intermediate_size=1024,
                    max_position_embeddings=n,
                    attention_type=kind,
                    is_decoder=model_class is LongAttnForCausalLM,
                    hidden_dropout_prob=0.0,
                    attention_backend=backend,
                )
                torch.manual_seed(0)
                model = model_class(config).to(DEVICE, torch.bfloat16).train()

                def step(model=model):
                    output = model(input_ids)
                    result = output.logits if hasattr(output, "logits") else output.last_hidden_state
                    result.float().square().mean().backward()
                    return result

                finite = bool(torch.isfinite(step()).all()) and all(
                    bool(torch.isfinite(p.grad).all()) for p in model.parameters() if p.grad is not None
                )
                ms, mb = _time(step, warmup=args.warmup, repeats=args.repeats)
                cells.append(f"{ms:.1f} ({mb:.0f})" + ("" if finite else " NON-FINITE"))
                del model
            except ValueError as error:
                cells.append("n/a: " + str(error)[:80])
            except Exception as error:  # noqa: BLE001 - a failing kind is a result
                cells.append(f"ERROR {type(error).__name__}: {str(error).splitlines()[0][:80] if str(error) else ''}")
                if args.verbose:
                    traceback.print_exc()
            if DEVICE == "cuda":
                torch.cuda.empty_cache()
        line = f"| {kind}{'' if backend == 'auto' else f' ({backend})'} | " + " | ".join(cells) + " |"
        print(line, flush=True)
        lines.append(line)
    return lines


# ------------------------------------------------------------------------------------------------ report
def environment() -> list[str]:
    xformers_version = "not installed"
    try:
        import xformers  # noqa: PLC0415

        xformers_version = xformers.__version__
    except Exception as error:  # noqa: BLE001
        xformers_version = f"import failed ({type(error).__name__})"
    try:
        import triton  # noqa: PLC0415

        triton_version = triton.__version__
    except ImportError:
        triton_version = "not installed"
    request = backends.AttentionRequest(
        pattern="sliding",
        device="cuda",
        dtype=torch.bfloat16,
        head_dim=64,
        value_head_dim=64,
        q_len=4096,
        kv_len=4096,
        requires_grad=True,
    )
    reasons = {name: backends.backend_reasons(name, request) for name in BACKENDS}
    lines = [
        f"- date: {datetime.date.today().isoformat()}",
        f"- GPU: {torch.cuda.get_device_name()} ({torch.cuda.get_device_properties(0).total_memory / 2**30:.0f} GiB)",
        f"- torch {torch.__version__} (CUDA {torch.version.cuda}), xformers {xformers_version}, "
        f"triton {triton_version}, "
        f"Python {platform.python_version()}",
        f"- `auto` for bf16 sliding attention with gradients: `{backends.select_backend('auto', request)}`",
    ]
    for name, why in reasons.items():
        lines.append(f"- {name}: " + ("usable" if not why else "; ".join(why)))
    return lines


def raise_recompile_limit() -> None:
    """Every (pattern, length, mode) compiles FlexAttention again: stay clear of dynamo's recompile limit, past which
    it would silently run the dense eager form."""
    import torch._dynamo  # noqa: PLC0415

    for limit in ("recompile_limit", "cache_size_limit"):
        if hasattr(torch._dynamo.config, limit):
            setattr(torch._dynamo.config, limit, max(256, getattr(torch._dynamo.config, limit)))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=list(DTYPES))
    parser.add_argument("--check-length", type=int, default=1000, help="length of the correctness checks")
    parser.add_argument("--lengths", nargs="+", type=int, default=[4096, 16384, 65536, 131072])
    parser.add_argument("--modes", nargs="+", default=["fwd", "fwdbwd"], choices=["fwd", "fwdbwd"])
    parser.add_argument(
        "--torch-max-length",
        type=int,
        default=65536,
        help="longest length timed on the torch executor (it is the slow fallback)",
    )
    parser.add_argument("--million-length", type=int, default=2**20)
    parser.add_argument(
        "--million-backends", nargs="+", default=["auto", "flex", "xformers"], choices=list(backends.BACKEND_NAMES)
    )
    parser.add_argument(
        "--cases", nargs="+", default=None, help="only the check and benchmark cases whose name contains one of these"
    )
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--skip-checks", action="store_true")
    parser.add_argument("--skip-bench", action="store_true")
    parser.add_argument("--skip-million", action="store_true")
    parser.add_argument("--skip-kinds", action="store_true")
    parser.add_argument("--kinds-length", type=int, default=16384)
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "benchmarks_gpu.md")
    parser.add_argument("--verbose", action="store_true")
    parser.add_argument("--device", default="cuda", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    global DEVICE
    DEVICE = args.device
    raise_recompile_limit()
    if DEVICE == "cuda" and not torch.cuda.is_available():
        print(
            "gpu_check: no CUDA device here (torch.cuda.is_available() is False): nothing to check. "
            "Run this script on a CUDA machine; the CPU test suite covers the dispatcher and the mappings."
        )
        return 0

    env = environment() if DEVICE == "cuda" else [f"- dry run on {DEVICE}: figures mean nothing"]
    print("\n".join(env), flush=True)
    sections = [
        "# GPU back ends: correctness and benchmarks",
        "",
        "Written by `python scripts/gpu_check.py " + " ".join(sys.argv[1:] if argv is None else argv) + "`.",
        "",
        *env,
        "",
    ]
    failures = 0
    if not args.skip_checks:
        lines, failures = run_checks(args)
        sections += [
            "## Correctness against the dense reference (outputs and gradients)",
            "",
            f"Length {args.check_length}, batch 2, 4 heads of 64; tolerance (rtol = atol) "
            + ", ".join(f"{str(d).removeprefix('torch.')} {t[0]:g}" for d, t in TOLERANCE.items())
            + "; `n/a` = the back end declines (its reason follows).",
            "",
            *lines,
            "",
        ]
    if not args.skip_bench:
        sections += [
            "## Benchmarks (bfloat16, batch 1, 16 heads of 64)",
            "",
            "Milliseconds (median) and peak MB above the inputs. ideal = dense flash time x the pattern's "
            "density; best / ideal uses the fastest back end.",
            "",
            *run_benchmarks(args),
            "",
        ]
    if not args.skip_kinds:
        sections += [
            f"## Every attention kind in a model (bfloat16, {args.kinds_length} tokens)",
            "",
            "Two layers, hidden 256, 4 heads, batch 1, `attention_backend='auto'`; forward + backward of a "
            "training step, milliseconds (median) and peak MB above the inputs.",
            "",
            *run_kinds(args),
            "",
        ]
    if not args.skip_million:
        sections += ["## One forward pass at 1M tokens", "", *run_million(args), ""]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(sections))
    print(f"wrote {args.out}", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
