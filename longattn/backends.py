"""Attention back ends and the dispatcher: which kernel computes a pattern, and why not the others.

Shape legend: b batch, h heads, n length (n_q queries, n_k keys), d head dim (d_v for values).

A pattern (`longattn.patterns`) says which keys a query sees; a back end computes it:

- `"reference"`: dense softmax under the materialised mask (`executor_reference`), O(n_q · n_k) memory; the
  ground truth every other back end is tested against. Never chosen by `"auto"`.
- `"torch"`: the PyTorch executors (`executor_blocked`, SDPA for dense attention); every device, dtype and mode.
- `"flex"`: `torch.nn.attention.flex_attention` with a block mask built from the same predicate
  (`executor_flex`). On CUDA it is compiled; on CPU it runs eagerly, forward only.
- `"xformers"`: xformers' memory-efficient kernels (`executor_xformers`), CUDA only, the optional extra
  `pip install xformers`. Sliding windows map to local-attention biases; dilated and strided patterns
  become local or block layouts after permuting the sequence into residue classes; global tokens and summary
  columns are separate parts merged by log-sum-exp.
- `"triton"`: longattn's own Triton kernels for the sliding window (`executor_triton`): per-head dilation in one
  launch, causal, padding, grouped-query heads read in place, global tokens merged by log-sum-exp; forward and
  backward. CUDA, or CPU under Triton's interpreter (`TRITON_INTERPRET=1`, for tests); the optional extra
  `pip install triton`. Not measured on a GPU yet, so `"auto"` never picks it.

Each back end declares what it supports and, for a given `AttentionRequest`, returns the reasons it cannot run
(`reasons_not_supported`), in the manner of xformers' operator dispatch. `select_backend` raises `ValueError`
with those reasons when an explicitly requested back end cannot run, and for `"auto"` takes the first of
`AUTO_ORDER` that can (xformers, then FlexAttention, then the PyTorch executor), logging its choice once per kind
of request. One measured exception: an undilated sliding window without global tokens or padding goes to
FlexAttention, which ran it faster than xformers' FlashAttention-2 band on an H100 (`docs/benchmarks_gpu.md`).
On CPU `"auto"` is always the PyTorch executor.

Each back end also declares, per pattern family, the executor it runs (`Backend.executors`, functions of
`executor_families` of one signature); `select_executor` returns the chosen back end's executor, which the pattern
functions of `ops` call without knowing its name. The families whose kinds run steps of their own declare their
executors per back end in their functional module (`executor_families.StepExecutors`), and `select_step_executor`
returns the chosen one; `runs_dense_form` says which back end runs a kind in its dense form. No other module
chooses what to run by a back end's name.
"""

from __future__ import annotations

import importlib.util
import logging
import os
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor

# The back-end names are checked by the configuration too, which imports no executor: they live in its table.
from .attention_fields import BACKEND_NAMES, check_backend_name
from .executor_families import (
    Executor,
    StepExecutors,
    flex_executor,
    reference_executor,
    torch_fixed,
    torch_full,
    torch_sliding,
    torch_strided,
    triton_sliding,
    xformers_fixed,
    xformers_full,
    xformers_sliding,
    xformers_strided,
)
from .executor_flex import unavailable_reasons as flex_unavailable_reasons
from .executor_xformers import documents_supported as xformers_documents_supported
from .executor_xformers import needs_tensor_bias
from .executor_xformers import probe_reasons as xformers_probe_reasons
from .executor_xformers import request_reasons as xformers_request_reasons
from .executor_xformers import unavailable_reasons as xformers_unavailable_reasons

__all__ = [
    "BACKEND_NAMES",
    "AUTO_ORDER",
    "PATTERN_FAMILIES",
    "AttentionRequest",
    "Backend",
    "BACKENDS",
    "check_backend_name",
    "backend_reasons",
    "select_backend",
    "select_executor",
    "select_named_backend",
    "select_step_executor",
    "runs_dense_form",
]

logger = logging.getLogger(__name__)

AUTO_ORDER = ("xformers", "flex", "torch")
"""The order in which `"auto"` tries the back ends: fastest first."""

_AUTO_STEPS = "torch"
"""What `"auto"` runs for the families whose kinds run their own steps, until another back end is measured for them."""

PATTERN_FAMILIES = ("full", "sliding", "strided", "fixed", "blocks", "windows", "sinkhorn")
"""Pattern families a request can name: dense, (dilated) sliding window with global tokens, Sparse Transformer
strided and fixed, within-bucket blocks after sorting (`executor_xformers.bucketed_attention`), the key windows of
sorted chunks that LSH and routing attend with (`ops_lsh.attend_windows`), and Sinkhorn's blocks (each query block
over its own and its sorted key block, or SortCut's kept blocks)."""


@dataclass(frozen=True)
class AttentionRequest:
    """What one attention call needs from a back end (the facts the back ends decide on).

    Attributes:
        pattern: Pattern family, one of `PATTERN_FAMILIES`.
        device: Device type of q (`"cpu"`, `"cuda"`, ...).
        dtype: dtype of q, k, v.
        head_dim: d, the head dim of q and k.
        value_head_dim: d_v, the head dim of v.
        q_len: n_q; the queries are the last n_q of the n_k positions.
        kv_len: n_k.
        batch: b.
        heads: h.
        causal: Keys after the query are hidden.
        dropout: Attention dropout is active (p > 0).
        requires_grad: Gradients will flow into q, k or v.
        key_padding: A key padding mask is given.
        global_tokens: A global-token mask is given.
        documents: Rows are packed documents (`document_ids` is given): no query sees another document's keys.
        dilation: Sliding-window dilation: an int, or a tuple with one per head.
        relative_logits: Relative-position logits are added to the kept pairs' scores (`relative_logits`).
    """

    pattern: str
    device: str
    dtype: torch.dtype
    head_dim: int
    value_head_dim: int
    q_len: int
    kv_len: int
    batch: int = 1
    heads: int = 1
    causal: bool = False
    dropout: bool = False
    requires_grad: bool = False
    key_padding: bool = False
    global_tokens: bool = False
    documents: bool = False
    dilation: int | tuple[int, ...] = 1
    relative_logits: bool = False

    @classmethod
    def for_inputs(
        cls, q: Tensor, k: Tensor, v: Tensor, *, pattern: str, dropout_p: float = 0.0, **fields
    ) -> "AttentionRequest":
        """The request of a call on q `[b, h, n_q, d]`, k `[b, h, n_k, d]`, v `[b, h, n_k, d_v]`.

        Args:
            q: Queries.
            k: Keys.
            v: Values.
            pattern: Pattern family.
            dropout_p: Attention dropout probability of the call.
            **fields: The other `AttentionRequest` fields (`causal`, `key_padding`, ...).

        Returns:
            The request.
        """
        requires_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
        dilation = fields.pop("dilation", 1)
        if not isinstance(dilation, int):
            dilation = tuple(dilation)
        return cls(
            pattern=pattern,
            device=q.device.type,
            dtype=q.dtype,
            head_dim=q.shape[-1],
            value_head_dim=v.shape[-1],
            q_len=q.shape[2],
            kv_len=k.shape[2],
            batch=q.shape[0],
            heads=q.shape[1],
            dropout=dropout_p > 0,
            requires_grad=requires_grad,
            dilation=dilation,
            **fields,
        )


class Backend:
    """A back end: what it supports, the executor it runs for each pattern family, and the reasons it cannot serve
    a request.

    Subclasses set `name`, `patterns` (the pattern families it computes), `executors` (the executor of each family
    the pattern functions of `ops` dispatch, `executor_families`; the families whose kinds run their own steps,
    blocks, windows and Sinkhorn's, declare theirs per back end in a `StepExecutors`, see `select_step_executor`),
    `dense_form` and `devices`, and extend `reasons_not_supported`. `auto_reasons` adds reasons that keep `"auto"`
    away without forbidding an explicit request (e.g. FlexAttention on CPU runs, but densely).
    """

    name: ClassVar[str] = ""
    patterns: ClassVar[tuple[str, ...]] = PATTERN_FAMILIES
    executors: ClassVar[dict[str, Executor]] = {}
    dense_form: ClassVar[bool] = False
    """It runs an attention kind in its dense form (`attend_dense`, every key, with the weights): `runs_dense_form`."""
    devices: ClassVar[tuple[str, ...] | None] = None  # None: every device
    summary: ClassVar[str] = ""

    def reasons_not_supported(self, request: AttentionRequest) -> list[str]:
        """Why this back end cannot run `request`; empty when it can."""
        reasons = []
        if request.pattern not in self.patterns:
            reasons.append(f"pattern {request.pattern!r} is not served (serves {list(self.patterns)})")
        if self.devices is not None and request.device not in self.devices:
            reasons.append(f"device {request.device!r} is not supported (needs {' or '.join(self.devices)})")
        return reasons

    def auto_reasons(self, request: AttentionRequest) -> list[str]:
        """Extra reasons for `"auto"` to pass this back end over (it would run, but not fast)."""
        return []

    def executor(self, pattern: str) -> Executor:
        """The executor this back end runs for `pattern`.

        Raises:
            ValueError: If the family has no executor here (a kind's own family: see `select_named_backend`).
        """
        if pattern not in self.executors:
            raise ValueError(
                f"back end {self.name!r} has no executor for pattern {pattern!r}: {sorted(self.executors)}"
            )
        return self.executors[pattern]


class ReferenceBackend(Backend):
    name = "reference"
    summary = "dense softmax under the materialised mask; every device, dtype and mode; O(n_q · n_k) memory"
    executors = {family: reference_executor for family in ("full", "sliding", "strided", "fixed")}
    dense_form = True

    def auto_reasons(self, request):
        return ["the dense reference is for tests and short sequences"]


class TorchBackend(Backend):
    name = "torch"
    summary = "PyTorch executors (blocked/banded with hand-written backward, SDPA for dense); every device and mode"
    executors = {"full": torch_full, "sliding": torch_sliding, "strided": torch_strided, "fixed": torch_fixed}


class FlexBackend(Backend):
    name = "flex"
    patterns = ("full", "sliding", "strided", "fixed")
    devices = ("cuda", "cpu")
    summary = "FlexAttention with a block mask from the pattern predicate; compiled on CUDA; CPU forward only"
    executors = {family: flex_executor for family in patterns}

    def reasons_not_supported(self, request):
        reasons = super().reasons_not_supported(request)
        reasons += flex_unavailable_reasons()
        if request.dropout:
            reasons.append("FlexAttention has no attention dropout (set the dropout probability to 0 or use 'torch')")
        if request.device == "cpu" and request.requires_grad:
            reasons.append("FlexAttention has no backward on CPU (inputs require grad)")
        if request.device == "cuda" and request.dtype not in (torch.float16, torch.bfloat16, torch.float32):
            reasons.append(f"FlexAttention's CUDA kernels take float16, bfloat16 or float32, not {request.dtype}")
        return reasons

    def auto_reasons(self, request):
        if request.device != "cuda":
            return ["'auto' uses FlexAttention on CUDA only: elsewhere it runs eagerly over the dense score matrix"]
        if request.pattern == "full" and not request.key_padding:
            return ["dense attention without padding skips nothing: SDPA's flash kernel is faster"]
        return []


class XformersBackend(Backend):
    name = "xformers"
    patterns = ("full", "sliding", "strided", "fixed", "blocks", "windows", "sinkhorn")
    devices = ("cuda",)
    summary = (
        "xformers memory-efficient kernels: local / block-diagonal biases, residue-class permutations, "
        "log-sum-exp merges; CUDA only"
    )
    executors = {
        "full": xformers_full,
        "sliding": xformers_sliding,
        "strided": xformers_strided,
        "fixed": xformers_fixed,
    }

    def reasons_not_supported(self, request):
        reasons = super().reasons_not_supported(request)
        if request.relative_logits:
            # Its kernels take a dense [b, h, n_q, n_k] bias only: that would be the n x n table the sparse
            # layouts exist to avoid.
            reasons.append(
                "xformers takes relative-position logits only as a dense [b, h, n_q, n_k] bias (use 'torch', "
                "'flex' or 'reference'; 'auto' picks one of them)"
            )
        missing = xformers_unavailable_reasons()
        if missing:
            return reasons + missing
        if request.documents and not xformers_documents_supported(
            pattern=request.pattern,
            causal=request.causal,
            key_padding=request.key_padding,
            global_tokens=request.global_tokens,
            dilation=request.dilation,
            q_len=request.q_len,
            kv_len=request.kv_len,
        ):
            reasons.append(
                "packed documents map to xformers' block-diagonal biases only for full and undilated sliding-window "
                "attention without global tokens, padding or cached queries"
            )
        reasons += xformers_request_reasons(
            pattern=request.pattern,
            dtype=request.dtype,
            head_dim=request.head_dim,
            value_head_dim=request.value_head_dim,
            q_len=request.q_len,
            kv_len=request.kv_len,
            batch=request.batch,
            causal=request.causal,
            dropout=request.dropout,
            key_padding=request.key_padding,
            global_tokens=request.global_tokens,
            dilation=request.dilation,
        )
        if not reasons and request.device == "cuda":
            # Only now touch the GPU: a tiny forward and backward of every layout this request needs.
            reasons += xformers_probe_reasons(
                request.dtype,
                needs_tensor_bias=needs_tensor_bias(
                    pattern=request.pattern, causal=request.causal, global_tokens=request.global_tokens
                ),
            )
        return reasons

    def auto_reasons(self, request):
        if request.pattern == "full" and not request.key_padding:
            return ["dense attention without padding: SDPA runs the same flash kernel without a layout copy"]
        if request.pattern in ("sinkhorn", "windows"):
            return [
                f"the {request.pattern!r} mapping has not been run on a GPU yet: 'auto' keeps the PyTorch "
                "executor (ask for 'xformers' to use it)"
            ]
        dilations = {request.dilation} if isinstance(request.dilation, int) else set(request.dilation)
        undilated = dilations == {1}
        if (
            request.pattern == "sliding"
            and undilated
            and not request.global_tokens
            and not request.key_padding
            and not BACKENDS["flex"].reasons_not_supported(request)
        ):
            # Measured on an H100 with xformers 0.0.35 on PyTorch's FlashAttention-2 (docs/benchmarks_gpu.md): a plain
            # band is FlexAttention's best case, and the permutations that make xformers win need a dilation.
            return ["an undilated window runs faster on FlexAttention's block-sparse kernel (1.2-2.5x on an H100)"]
        return []


class TritonBackend(Backend):
    name = "triton"
    patterns = ("sliding",)
    devices = ("cuda", "cpu")
    summary = (
        "Triton band kernels: per-head dilation by strided class addressing, grouped-query heads in place, global "
        "tokens merged by log-sum-exp; CUDA, or CPU under TRITON_INTERPRET=1 (tests)"
    )
    executors = {"sliding": triton_sliding}

    def reasons_not_supported(self, request):
        reasons = super().reasons_not_supported(request)
        # A search, not an import: triton is imported only when its kernels run (`executor_triton`).
        if importlib.util.find_spec("triton") is None:
            reasons.append("triton is not installed (pip install triton)")
        interpreted = os.environ.get("TRITON_INTERPRET", "0") == "1"
        if request.device == "cpu" and not interpreted:
            reasons.append(
                "on CPU Triton kernels run only under its interpreter (TRITON_INTERPRET=1 set before triton is "
                "imported), a correctness check"
            )
        if request.dtype not in (torch.float16, torch.bfloat16, torch.float32):
            reasons.append(f"the Triton kernels take float16, bfloat16 or float32, not {request.dtype}")
        elif request.dtype == torch.bfloat16 and request.device == "cpu":
            reasons.append("Triton's interpreter computes bfloat16 wrongly: use float16 or float32 on CPU")
        if request.dropout:
            reasons.append("the Triton kernels have no attention dropout (set the dropout probability to 0)")
        if request.relative_logits:
            reasons.append("the Triton kernels take no relative-position logits (use 'torch', 'flex' or 'reference')")
        if request.documents:
            reasons.append("the Triton kernels take no packed documents (use 'torch', 'flex' or 'reference')")
        if request.q_len != request.kv_len:
            reasons.append(
                f"the Triton kernels need as many queries as keys (got {request.q_len} and {request.kv_len})"
            )
        if max(request.head_dim, request.value_head_dim) > 256:
            reasons.append(
                f"the Triton kernels take head dims up to 256 (got {request.head_dim} and {request.value_head_dim})"
            )
        return reasons

    def auto_reasons(self, request):
        return ["the Triton kernels have not been measured on a GPU yet: 'auto' does not pick them (ask for 'triton')"]


BACKENDS: dict[str, Backend] = {
    backend.name: backend
    for backend in (ReferenceBackend(), TorchBackend(), FlexBackend(), XformersBackend(), TritonBackend())
}


def backend_reasons(name: str, request: AttentionRequest) -> list[str]:
    """The reasons back end `name` cannot run `request` (empty when it can).

    Raises:
        ValueError: If `name` is not a back end (`"auto"` is not one).
    """
    if name not in BACKENDS:
        raise ValueError(f"backend {name!r} is unknown: expected one of {sorted(BACKENDS)}.")
    return BACKENDS[name].reasons_not_supported(request)


_LOGGED: set[tuple] = set()


def select_backend(name: str, request: AttentionRequest) -> str:
    """The back end that computes `request`.

    Args:
        name: A back-end name, or `"auto"` for the fastest that can run.
        request: The call's facts.

    Returns:
        The chosen back-end name (never `"auto"`).

    Raises:
        ValueError: If `name` is unknown, or names a back end that cannot run `request` (the message lists the
            reasons).
    """
    check_backend_name(name)
    if name != "auto":
        reasons = BACKENDS[name].reasons_not_supported(request)
        if reasons:
            raise ValueError(
                f"attention back end {name!r} cannot run this {request.pattern!r} attention on "
                f"{request.device}/{str(request.dtype).removeprefix('torch.')}: " + "; ".join(reasons) + "."
            )
        return name
    passed_over = []
    for candidate in AUTO_ORDER:
        backend = BACKENDS[candidate]
        reasons = backend.reasons_not_supported(request) + backend.auto_reasons(request)
        if not reasons:
            if not torch.compiler.is_compiling():  # a side effect: `torch.compile` would break the graph here
                _log_choice(candidate, request, passed_over)
            return candidate
        passed_over.append(f"{candidate}: " + "; ".join(reasons))
    raise AssertionError("the 'torch' back end serves every request")  # pragma: no cover


def select_executor(name: str, request: AttentionRequest) -> Executor:
    """The executor that computes `request`: that of the back end `select_backend` chooses, for its pattern family.

    Raises:
        ValueError: As `select_backend`.
    """
    return BACKENDS[select_backend(name, request)].executor(request.pattern)


def select_named_backend(name: str, q: Tensor, k: Tensor, v: Tensor, **request: Any) -> str:
    """`select_backend` for kinds whose `"auto"` is the PyTorch executor until another back end is measured for them:
    `"auto"` gives `"torch"` without building a request (nothing to dispatch on the hot path), and a named back end is
    checked against `AttentionRequest.for_inputs(q, k, v, **request)`.

    Raises:
        ValueError: As `select_backend`.
    """
    if name == "auto":
        return _AUTO_STEPS
    return select_backend(name, AttentionRequest.for_inputs(q, k, v, **request))


def select_step_executor(name: str, steps: StepExecutors, q: Tensor, k: Tensor, v: Tensor, **request: Any):
    """The executor back end `name` runs for a family whose kind runs its own steps: its entry of `steps.executors`.

    `"auto"` is the PyTorch executor's, chosen without building a request (`select_named_backend`); a named back end
    is first checked against the call's request for `steps.pattern` (`AttentionRequest.for_inputs(q, k, v,
    **request)`), or, for a family that is no pattern, only looked up.

    Raises:
        ValueError: As `select_backend`, with the reasons a named back end cannot run the call, or when the back end
            has no executor in `steps` (the message names those that have one, and `steps.note`).
    """
    if steps.pattern is None:
        choice = _AUTO_STEPS if name == "auto" else check_backend_name(name)
    else:
        choice = select_named_backend(name, q, k, v, pattern=steps.pattern, **request)
    if choice not in steps.executors:
        allowed = [repr(item) for item in ("auto", *steps.executors)]
        raise ValueError(
            f"`backend`={name!r} cannot run {steps.attention} attention here: use {', '.join(allowed[:-1])} or "
            f"{allowed[-1]}{steps.note}."
        )
    return steps.executors[choice]


def runs_dense_form(name: str) -> bool:
    """Whether back end `name` (or `"auto"`) computes an attention kind in its dense form, the kind's `attend_dense`
    over every key with its weights, rather than its own executor: the `"reference"` back end does."""
    return name in BACKENDS and BACKENDS[name].dense_form


def _log_choice(name: str, request: AttentionRequest, passed_over: list[str]) -> None:
    key = (name, request.pattern, request.device, request.dtype, request.causal, request.requires_grad)
    if key in _LOGGED:
        return
    _LOGGED.add(key)
    why = f" (passed over: {' | '.join(passed_over)})" if passed_over else ""
    logger.info(
        "longattn: attention back end %r for %r attention on %s/%s%s",
        name,
        request.pattern,
        request.device,
        str(request.dtype).removeprefix("torch."),
        why,
    )
