"""The fused attention kernel behind every `backend="xformers"` path, as one injectable object.

Shape legend (xformers' own layout): a call takes queries `[B, M, H, K]` and keys/values `[B, N, H, K]` (B calls of
M queries over N keys, H heads), with an xformers bias or an additive `[B, H, M, N]` tensor bias.

Callers (`executor_xformers`' layouts, LSH and routing windows in `ops_lsh`, Sinkhorn's blocks) call
`current_kernel()`: `XformersKernel` (xformers' memory-efficient attention) by default, replaced with
`use_kernel(...)`, e.g. by `ReferenceKernel`, which implements the same contract in dense PyTorch math so that the
permutations, merges and biases around the kernel run end to end on CPU in the tests.

xformers is imported lazily, through public `xformers.ops` names, and only `xformers_call()` touches its globals:
the one it changes (admitting the PyTorch-kernel operators, see there) is set for the duration of each kernel call
and restored afterwards, exceptions included, so importing or calling longattn leaves xformers as it found it.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from .numerics import compute_dtype

__all__ = ["ReferenceKernel", "XformersKernel", "current_kernel", "import_xformers_ops", "use_kernel", "xformers_call"]


def import_xformers_ops():
    # Optional dependency, imported on first use. Inside `try` on purpose: transformers' remote-code loader ignores
    # imports there, so a Hub folder carrying this file loads without xformers installed.
    try:
        import xformers.ops  # noqa: PLC0415
    except ImportError as error:
        raise ImportError("the xformers back end needs xformers: pip install xformers") from error
    return xformers.ops


@contextlib.contextmanager
def xformers_call() -> Iterator[Any]:
    """`xformers.ops` for one kernel call, its operators on PyTorch's own kernels admitted during the call only.

    An xformers wheel is built against one torch release. Under another, its C++ extension fails to load, and
    xformers then refuses every CUDA operator ("xFormers wasn't build with CUDA support"), although its
    FlashAttention-2 and cutlass operators call PyTorch's kernels (`fa2F@...-pt`, `cutlassF-pt` in
    `python -m xformers.info`, which lists them as available) and need no extension. Only that one refusal is
    lifted (operators that do need the extension still report "operator wasn't built" and are never chosen), by
    setting xformers' module global `fmha.common._built_with_cuda`; it is restored when the block exits, also on an
    exception, so other users of xformers in the process keep its own verdict. Scoping it to the call is enough
    for autograd: xformers picks the backward operator in the forward call, and its backward skips the check.

    Yields:
        The `xformers.ops` module.
    """
    ops = import_xformers_ops()
    common = importlib.import_module("xformers.ops.fmha.common")
    previous = getattr(common, "_built_with_cuda", None)
    cpp_lib = importlib.import_module("xformers._cpp_lib")
    admit = (
        previous is False
        and getattr(cpp_lib, "_cpp_library_load_exception", None) is not None
        and torch.cuda.is_available()
    )
    if admit:
        common._built_with_cuda = True
    try:
        yield ops
    finally:
        if admit:
            common._built_with_cuda = previous


class XformersKernel:
    """xformers' kernels behind the contract every layout uses (`[B, M, H, K]` tensors, an xformers bias or an
    additive `[B, H, M, N]` tensor)."""

    name = "xformers"

    def attention(self, q: Tensor, k: Tensor, v: Tensor, attn_bias: Any, *, p: float, scale: float) -> Tensor:
        """Attention with autograd (and dropout): `[B, M, H, K]` -> `[B, M, H, K_v]`."""
        with xformers_call() as ops:
            return ops.memory_efficient_attention(q, k, v, attn_bias=attn_bias, p=p, scale=scale)

    def forward(self, q: Tensor, k: Tensor, v: Tensor, attn_bias: Any, *, scale: float) -> tuple[Tensor, Tensor]:
        """Output `[B, M, H, K_v]` and log-sum-exp `[B, H, M]` (float32), no autograd."""
        with xformers_call() as ops:
            out, lse = ops.memory_efficient_attention_forward_requires_grad(q, k, v, attn_bias=attn_bias, scale=scale)
        return out, lse[:, :, : q.shape[1]].float()

    def backward(
        self, grad: Tensor, out: Tensor, lse: Tensor, q: Tensor, k: Tensor, v: Tensor, attn_bias: Any, *, scale: float
    ) -> tuple[Tensor, Tensor, Tensor]:
        """Gradients of q, k, v given the output's gradient, the output and the log-sum-exp of every row."""
        with xformers_call() as ops:
            return ops.memory_efficient_attention_backward(
                grad, out, lse.contiguous(), q, k, v, attn_bias=attn_bias, scale=scale
            )


class ReferenceKernel:
    """The same contract in dense PyTorch math, biases materialised: for tests and for checking a GPU's kernels.

    Costs O(B · H · M · N) memory. Computes in float32 for half inputs, float64 for float64 inputs.
    """

    name = "reference"

    @staticmethod
    def _scores(q: Tensor, k: Tensor, attn_bias: Any, scale: float) -> Tensor:
        dtype = compute_dtype(q.dtype)
        scores = torch.einsum("bmhk,bnhk->bhmn", q.to(dtype), k.to(dtype)) * scale  # [B, H, M, N]
        if attn_bias is None:
            return scores
        if isinstance(attn_bias, Tensor):
            return scores + attn_bias.to(dtype)
        return scores + attn_bias.materialize((q.shape[1], k.shape[1]), dtype=dtype, device=q.device)

    @staticmethod
    def _probs(scores: Tensor, lse: Tensor) -> Tensor:
        # Rows without a visible key have lse = -inf: their probabilities are 0, not NaN.
        finite = torch.isfinite(lse)
        return torch.where(finite[..., None], (scores - torch.where(finite, lse, 0.0)[..., None]).exp(), 0.0)

    def attention(self, q, k, v, attn_bias, *, p, scale):
        scores = self._scores(q, k, attn_bias, scale)
        probs = self._probs(scores, scores.logsumexp(dim=-1))
        if p > 0:
            probs = F.dropout(probs, p=p)
        return torch.einsum("bhmn,bnhk->bmhk", probs, v.to(probs.dtype)).to(q.dtype)

    def forward(self, q, k, v, attn_bias, *, scale):
        with torch.no_grad():
            scores = self._scores(q, k, attn_bias, scale)
            lse = scores.logsumexp(dim=-1)  # [B, H, M]
            out = torch.einsum("bhmn,bnhk->bmhk", self._probs(scores, lse), v.to(scores.dtype))
        return out.to(q.dtype), lse

    def backward(self, grad, out, lse, q, k, v, attn_bias, *, scale):
        with torch.no_grad():
            scores = self._scores(q, k, attn_bias, scale)
            dtype = scores.dtype
            probs = self._probs(scores, lse.to(dtype))  # [B, H, M, N]
            grad, out = grad.to(dtype), out.to(dtype)
            grad_v = torch.einsum("bhmn,bmhk->bnhk", probs, grad)
            grad_probs = torch.einsum("bmhk,bnhk->bhmn", grad, v.to(dtype))
            row_dot = (grad * out).sum(dim=-1).transpose(1, 2)  # [B, H, M]
            grad_scores = probs * (grad_probs - row_dot[..., None]) * scale
            grad_q = torch.einsum("bhmn,bnhk->bmhk", grad_scores, k.to(dtype))
            grad_k = torch.einsum("bhmn,bmhk->bnhk", grad_scores, q.to(dtype))
        return grad_q.to(q.dtype), grad_k.to(k.dtype), grad_v.to(v.dtype)


_KERNEL: Any = XformersKernel()


def current_kernel() -> Any:
    """The kernel object every layout calls (xformers' by default)."""
    return _KERNEL


@contextlib.contextmanager
def use_kernel(kernel: Any) -> Iterator[Any]:
    """Run the xformers executor on another kernel with the same contract (e.g. `ReferenceKernel()` on CPU).

    Args:
        kernel: An object with `attention`, `forward` and `backward` like `XformersKernel`.

    Yields:
        The kernel.
    """
    global _KERNEL
    previous, _KERNEL = _KERNEL, kernel
    try:
        yield kernel
    finally:
        _KERNEL = previous
