"""Reformer LSH attention, step 3: attention of the sorted chunks over their windows of keys (Kitaev et al. 2020,
"Reformer: The Efficient Transformer").

- `attend_windows`: B query chunks `[B, c, d]`, chunk u over the key rows `u·stride .. u·stride + w` of `[N, d]`
  (strided views of the sorted buffer: overlapping windows are never copied), in cache-sized groups with a
  hand-written backward (`_WindowAttention`); it returns `(out [B, c, d_v], lse [B, c])`, the log-sum-exp the hash
  rounds are merged by;
- `attend_windows_on_kernel`: the same windows on the xformers kernel (`_KernelWindows`);
- `select_windows_executor`: the executor of a family run on these windows, for a back end;
- `SELF_SCORE`: the score of a query's own key under Reformer's self rule.

Routing attention (`ops_routing`) runs its clusters on these too. The form that gathers the rows by index instead
of copying them sorted: `ops_lsh_gathered`.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from .backends import select_step_executor
from .executor_families import StepExecutors
from .fused_kernel import current_kernel
from .numerics import HALF_HIDDEN_PENALTY, NO_KEY_LSE, compute_dtype, hide_exactly

__all__ = ["SELF_SCORE", "attend_windows", "attend_windows_on_kernel", "select_windows_executor"]

SELF_SCORE = -1e5
"""Score of a query's own key (transformers' value in float32): used only when nothing else is visible."""


# ---------------------------------------------------------------------------------------------- window kernel
# Score elements per group of windows (16 MB of float32). Groups keep the elementwise passes (bias, exp, normalise)
# over a group's scores near the cache instead of streaming one 64+ MB tensor per pass, and keep the number of ops
# small: every op is one parallel region, and on a shared 2-core machine a region waits for a descheduled thread.
# Measured at 16K tokens (LSH, fwd+bwd): with 2 threads under load 9-12 s with groups of 2**19, 2.2-2.9 s with 2**23;
# with 1 thread the same within noise from 2**19 to 2**23.
_GROUP_ELEMENTS = 2**22
# With `keep_probs=False` (the memory-lean mode) the group buffers are what the kernel adds to peak memory: 4 MB.
_LEAN_GROUP_ELEMENTS = 2**20


def _windows(rows: Tensor, start: int, stop: int, stride: int, width: int) -> Tensor:
    """Windows `start..stop` of `rows [N, d]`: window u is rows `u·stride .. u·stride + width` (they may overlap)."""
    d = rows.shape[-1]
    return rows.as_strided((stop - start, width, d), (stride * d, d, 1), rows.storage_offset() + start * stride * d)


class _WindowAttention(torch.autograd.Function):
    """Softmax attention of B query chunks, chunk u over key rows `u·stride .. u·stride + w`; hand-written backward.

    Overlapping windows are strided views of one key tensor (no copy). Works through the chunks in cache-sized
    groups, so the elementwise passes over a group's scores run in cache. Saves q, k, v, the output and either the
    probabilities or the bias and log-sum-exp to recompute them (no scores or intermediate copies). With D = rowsum(dO
    ∘ O) − dlse: dV = Pᵀ dO,
    dP = dO Vᵀ, dS = P ∘ (dP − D), dQ = dS K·scale, dK = dSᵀ Q·scale, the window gradients added back onto the
    rows they came from. The dlse term lets outputs combined by their log-sum-exp (LSH hash rounds) train.
    """

    @staticmethod
    def forward(ctx, q, k, v, bias, scale, stride, self_column, keep_probs):
        dtype = compute_dtype(q.dtype)
        q_c, k_c, v_c = q.to(dtype).contiguous(), k.to(dtype).contiguous(), v.to(dtype).contiguous()
        n_chunks, c, w = q.shape[0], q.shape[1], bias.shape[-1]
        out = torch.empty(n_chunks, c, v.shape[-1], dtype=dtype, device=q.device)
        lse = torch.empty(n_chunks, c, dtype=dtype, device=q.device)
        step = max(1, (_GROUP_ELEMENTS if keep_probs else _LEAN_GROUP_ELEMENTS) // (c * w))
        # Kept probabilities (B·c·w floats, tens of MB at 16K tokens) save backward one matmul and five elementwise
        # passes per group; without them only a group-sized buffer is used.
        all_probs = torch.empty(n_chunks if keep_probs else min(step, n_chunks), c, w, dtype=dtype, device=q.device)
        for start in range(0, n_chunks, step):
            stop = min(n_chunks, start + step)
            probs = all_probs[start:stop] if keep_probs else all_probs[: stop - start]
            q_group = q_c[start:stop] if scale == 1.0 else q_c[start:stop] * scale
            torch.bmm(q_group, _windows(k_c, start, stop, stride, w).transpose(1, 2), out=probs)
            probs.add_(bias[start:stop])  # -inf where masked: far cheaper than masked_fill_ with a bool mask
            if self_column is not None:
                _self_diagonal(probs, self_column).fill_(SELF_SCORE)
            row_max = probs.amax(dim=-1, keepdim=True)  # [g, c, 1]
            # A row without any visible key would give (-inf) - (-inf) = NaN; shifting it by 0 keeps exp() at 0.
            row_max.masked_fill_(torch.isneginf(row_max), 0.0)
            probs.sub_(row_max).exp_()
            row_sum = probs.sum(dim=-1, keepdim=True)
            lse[start:stop] = (row_max + row_sum.log()).squeeze(-1)  # -inf for rows without keys
            probs.mul_(torch.where(row_sum > 0, row_sum.reciprocal(), torch.zeros_like(row_sum)))
            torch.bmm(probs, _windows(v_c, start, stop, stride, w), out=out[start:stop])
        if keep_probs:
            ctx.save_for_backward(q_c, k_c, v_c, out, all_probs)
        else:
            ctx.save_for_backward(q_c, k_c, v_c, out, bias, lse)
        ctx.scale, ctx.stride, ctx.self_column, ctx.keep_probs = scale, stride, self_column, keep_probs
        ctx.dtypes = (q.dtype, k.dtype, v.dtype)
        return out.to(q.dtype), lse

    @staticmethod
    def backward(ctx, grad_out, grad_lse):
        q, k, v, out, *kept = ctx.saved_tensors
        scale, stride, self_column = ctx.scale, ctx.stride, ctx.self_column
        n_chunks, c, w = q.shape[0], q.shape[1], kept[0].shape[-1]
        if not ctx.keep_probs:
            bias, lse = kept
            # Rows without visible keys have lse = -inf; exp(s - (+inf)) keeps their probabilities at 0.
            lse_shift = lse.masked_fill(torch.isneginf(lse), math.inf).unsqueeze(-1)  # [B, c, 1]
        grad_out = torch.zeros_like(out) if grad_out is None else grad_out.to(out.dtype).contiguous()
        delta = (grad_out * out).sum(dim=-1, keepdim=True)  # [B, c, 1]
        if grad_lse is not None:
            delta = delta - grad_lse.to(out.dtype).unsqueeze(-1)
        grad_q, grad_k, grad_v = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        overlapping = stride < w
        if overlapping:
            # Window part p of chunk u lands on row block u + p. Groups go in order, and each group assigns its
            # last part first (blocks no earlier group reached), then adds the others; only the first blocks,
            # which no last part reaches, and rows after the last window start at zero.
            grad_k[: w - stride].zero_()
            grad_v[: w - stride].zero_()
            grad_k[(n_chunks - 1) * stride + w :].zero_()
            grad_v[(n_chunks - 1) * stride + w :].zero_()
        else:
            grad_k[n_chunks * stride :].zero_()  # rows after the last window (if any) get no gradient
            grad_v[n_chunks * stride :].zero_()
        step = max(1, (_GROUP_ELEMENTS if ctx.keep_probs else _LEAN_GROUP_ELEMENTS) // (c * w))
        grad_buffer = torch.empty(min(step, n_chunks), c, w, dtype=q.dtype, device=q.device)
        probs_buffer = None if ctx.keep_probs else torch.empty_like(grad_buffer)
        for start in range(0, n_chunks, step):
            stop = min(n_chunks, start + step)
            grad_scores = grad_buffer[: stop - start]
            keys, values = _windows(k, start, stop, stride, w), _windows(v, start, stop, stride, w)
            q_group = q[start:stop] if scale == 1.0 else q[start:stop] * scale
            if ctx.keep_probs:
                probs = kept[0][start:stop]
            else:
                probs = probs_buffer[: stop - start]
                torch.bmm(q_group, keys.transpose(1, 2), out=probs)
                probs.add_(bias[start:stop])
                if self_column is not None:
                    _self_diagonal(probs, self_column).fill_(SELF_SCORE)
                probs.sub_(lse_shift[start:stop]).exp_()
            torch.bmm(grad_out[start:stop], values.transpose(1, 2), out=grad_scores)  # dP
            if overlapping:
                grad_values = torch.bmm(probs.transpose(1, 2), grad_out[start:stop])  # [g, w, d_v]
            else:  # windows side by side: write straight into place
                grad_values = grad_v[start * stride : stop * stride].view(stop - start, w, -1)
                torch.bmm(probs.transpose(1, 2), grad_out[start:stop], out=grad_values)
            grad_scores.sub_(delta[start:stop]).mul_(probs)  # dS
            if self_column is not None:
                _self_diagonal(grad_scores, self_column).zero_()  # the self score is a constant
            torch.bmm(grad_scores, keys, out=grad_q[start:stop])
            if not overlapping:
                grad_keys = grad_k[start * stride : stop * stride].view(stop - start, w, -1)
                torch.bmm(grad_scores.transpose(1, 2), q_group, out=grad_keys)  # q_group carries the scale
                continue
            grad_keys = torch.bmm(grad_scores.transpose(1, 2), q_group)  # [g, w, d]
            for part in range(w - stride, -1, -stride):  # window rows part.. of chunk u: rows u·stride + part..
                rows = slice(start * stride + part, (stop - 1) * stride + part + stride)
                if part == w - stride:
                    grad_k[rows] = grad_keys[:, part:].reshape(-1, k.shape[-1])
                    grad_v[rows] = grad_values[:, part:].reshape(-1, v.shape[-1])
                else:
                    grad_k[rows] += grad_keys[:, part : part + stride].reshape(-1, k.shape[-1])
                    grad_v[rows] += grad_values[:, part : part + stride].reshape(-1, v.shape[-1])
        if scale != 1.0:
            grad_q.mul_(scale)
        q_dtype, k_dtype, v_dtype = ctx.dtypes
        return grad_q.to(q_dtype), grad_k.to(k_dtype), grad_v.to(v_dtype), None, None, None, None, None


def _self_diagonal(scores: Tensor, column: int) -> Tensor:
    """View of the entries (i, column + i) of `[g, c, w]` scores: each query's own key."""
    c = scores.shape[1]
    return scores[:, :, column : column + c].diagonal(dim1=1, dim2=2)


def attend_windows(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Tensor,
    *,
    stride: int,
    scale: float,
    dropout_p: float = 0.0,
    self_column: int | None = None,
    keep_probs: bool = True,
) -> tuple[Tensor, Tensor]:
    """Dense attention of B query chunks, each over its own window of key rows: one batched matmul per group.

    Chunk u attends to key rows `u·stride .. u·stride + w`: windows of a sorted sequence that overlap (w > stride,
    as for a chunk and its neighbours) are strided views, never copies. Content-based kinds sort or select their
    tokens, lay the keys out so, and call this. A row with no visible key returns zeros and `lse = -inf`, with
    finite gradients. Memory: besides q, k, v and the output, the B·c·w probabilities (or, with
    `keep_probs=False`, the bias) are kept for backward.

    Args:
        q: `[B, c, d]`.
        k: `[N, d]` key rows, N >= (B - 1)·stride + w.
        v: `[N, d_v]`.
        mask: Bool `[B, c or 1, w]`, True = visible; or a float bias of that shape, 0 = visible and -inf = masked
            (cheaper to build directly for large masks), or any finite logit bias where visible (relative-position
            logits; a bias that requires grad gets its gradient through autograd's path). w is the window length (a
            multiple of `stride` when larger than it).
        stride: Rows between the starts of consecutive windows.
        scale: Multiplier of q·k.
        dropout_p: Dropout on the probabilities (this path keeps autograd's own backward).
        self_column: Reformer's self rule: key `self_column + i` of the window is query i's own key; its score
            becomes the constant `SELF_SCORE` whatever the mask says, so it is attended only when nothing else is.
        keep_probs: Keep the B·c·w probabilities for backward (faster) or recompute them there (B·c·w less memory).

    Returns:
        `(out [B, c, d_v], lse [B, c])`, lse in float32 for half inputs.
    """
    w = mask.shape[-1]
    if w > stride and w % stride:
        raise ValueError(f"overlapping windows must be a multiple of the stride: w={w}, stride={stride}.")
    if mask.dtype == torch.bool:
        bias = hide_exactly(
            torch.zeros(mask.shape, dtype=compute_dtype(q.dtype), device=q.device), ~mask, inplace=True
        )  # added to the scores
    else:
        bias, mask = mask, ~torch.isneginf(mask)
    if dropout_p == 0.0 and not bias.requires_grad:
        return _WindowAttention.apply(q, k, v, bias, float(scale), stride, self_column, keep_probs)
    dtype = compute_dtype(q.dtype)
    keys = _windows(k.contiguous(), 0, q.shape[0], stride, w).to(dtype)  # autograd folds the overlaps back
    values = _windows(v.contiguous(), 0, q.shape[0], stride, w).to(dtype)
    # masked_fill after the bias: a row with no visible key then sends no NaN gradient back (logsumexp of -inf).
    scores = hide_exactly(torch.bmm(q.to(dtype) * scale, keys.transpose(1, 2)) + bias.to(dtype), ~mask)
    if self_column is not None:
        own = torch.zeros_like(scores, dtype=torch.bool)
        _self_diagonal(own, self_column).fill_(True)
        scores = torch.where(own, torch.full_like(scores, SELF_SCORE), scores)
    lse = scores.logsumexp(dim=-1)  # [B, c]
    safe = torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse)
    probs = (scores - safe.unsqueeze(-1)).exp()
    out = torch.bmm(F.dropout(probs, p=dropout_p), values)
    return out.to(q.dtype), lse


# A query's own key under Reformer's self rule, on the kernel: between visible (0) and hidden (-P, P the numerics
# HALF_HIDDEN_PENALTY), so it weighs exactly nothing beside any visible key and everything when only hidden keys are
# left. Whether a row saw a key comes from the mask (and the self column), never from its log-sum-exp.
_SELF_PENALTY = HALF_HIDDEN_PENALTY / 2


class _KernelWindows(torch.autograd.Function):
    """Attention of query chunks over their key windows on the xformers kernel, returning (out, lse) with the
    gradient of both.

    The kernel's backward knows only dO: it computes dS = P ∘ (dP − D) with D = rowsum(dO ∘ O). The log-sum-exp's
    gradient g adds P ∘ g; one extra value column gives it exactly: zeros in V (dP unchanged), -1 in O and g in dO,
    so that D becomes rowsum(dO ∘ O) − g.
    """

    @staticmethod
    def forward(ctx, q, k, v, bias, scale, seen):
        kernel = current_kernel()
        out, lse = kernel.forward(q, k, v, bias, scale=scale)  # [B, c, 1, d_v], [B, 1, c]
        # seen: bool [B, 1, c], the rows the mask (or the self column) shows a key
        out = torch.where(seen.transpose(1, 2)[..., None], out, 0.0)
        lse = torch.where(seen, lse, NO_KEY_LSE)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.bias, ctx.scale, ctx.kernel = bias, scale, kernel
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, grad_lse):
        q, k, v, out, lse = ctx.saved_tensors
        d, d_v = q.shape[-1], v.shape[-1]
        width = -(-(max(d, d_v) + 1) // 8) * 8  # the kernels take one head dim for q, k and v, a multiple of 8
        seen = torch.isfinite(lse)  # [B, 1, c]
        rows = seen.transpose(1, 2)[..., None]  # [B, c, 1, 1]
        grad_out = torch.where(rows, grad_out, 0.0) if grad_out is not None else torch.zeros_like(out)
        g = torch.where(seen, grad_lse, 0.0) if grad_lse is not None else torch.zeros_like(lse)
        extra = torch.zeros(*out.shape[:-1], width - d_v, dtype=out.dtype, device=out.device)
        out_aug, grad_aug = extra.clone(), extra.clone()
        out_aug[..., 0] = -1.0
        grad_aug[..., 0] = g.transpose(1, 2).to(out.dtype)
        dq, dk, dv = ctx.kernel.backward(
            torch.cat([grad_out, grad_aug], dim=-1),
            torch.cat([out, out_aug], dim=-1),
            torch.where(seen, lse, 0.0),
            F.pad(q, (0, width - d)),
            F.pad(k, (0, width - d)),
            F.pad(v, (0, width - d_v)),
            ctx.bias,
            scale=ctx.scale,
        )
        return dq[..., :d], dk[..., :d], dv[..., :d_v], None, None, None


def attend_windows_on_kernel(q, k, v, mask, *, stride, scale, dropout_p=0.0, self_column=None) -> tuple[Tensor, Tensor]:
    """`attend_windows` on the xformers kernel (`executor_xformers.current_kernel()`): the same arguments, with their
    types and shapes (less `keep_probs`, a memory choice of the PyTorch kernel) and results.

    The key windows are copied out (`[B, w, d]`; the kernel reads whole tensors, not overlapping views), the mask
    becomes an additive bias (-P for hidden keys, P = `numerics.HALF_HIDDEN_PENALTY`, -P / 2 for the self column, which
    keeps Reformer's rule: the own key counts only when nothing else is visible), and the chunks ride in the
    kernel's batch dim. A row with no visible key returns zeros and `lse = -inf`. Under the self rule a row that
    sees only its own key reports `lse = q·k_self − P / 2` where `attend_windows` reports `SELF_SCORE`;
    both weigh nothing beside a round that sees anything else, and rounds that see only the own key share its value.

    Raises:
        ValueError: `dropout_p > 0` (the kernel's forward with log-sum-exp has no dropout).
    """
    if dropout_p > 0:
        raise ValueError(
            "attention dropout is not available on the xformers windows (its forward with "
            "log-sum-exp has none); set the dropout probability to 0 or use the 'torch' back end."
        )
    w = mask.shape[-1]
    chunks, c, d = q.shape
    visible = mask if mask.dtype == torch.bool else ~torch.isneginf(mask)  # [B, c or 1, w]
    aligned = -(-w // 8) * 8  # bias rows 8-aligned in memory, as the kernels read them
    bias = torch.zeros(chunks, 1, c, aligned, dtype=q.dtype, device=q.device)[..., :w]
    bias.masked_fill_(~visible.unsqueeze(1).expand(chunks, 1, c, w), -HALF_HIDDEN_PENALTY)
    if self_column is not None:
        bias[:, 0, :, self_column : self_column + c].diagonal(dim1=-2, dim2=-1).fill_(-_SELF_PENALTY)
    keys = _windows(k.contiguous(), 0, chunks, stride, w)  # autograd folds the overlapping windows back
    values = _windows(v.contiguous(), 0, chunks, stride, w)
    # Rows that see a key, from the mask: every row when the own key stands in for an empty window.
    seen = visible.any(dim=-1).expand(chunks, c) if self_column is None else visible.new_ones(chunks, c)
    out, lse = _KernelWindows.apply(
        q.unsqueeze(2), keys.unsqueeze(2), values.unsqueeze(2), bias, float(scale), seen.unsqueeze(1)
    )
    return out.squeeze(2), lse.squeeze(1)


def select_windows_executor(
    backend: str,
    steps: StepExecutors,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    key_padding_mask: Tensor | None,
    relative_embedding: Tensor | None,
    dropout_p: float,
    causal: bool,
):
    """`backends.select_step_executor` for a family run on the window executors (pattern "windows":
    `attend_windows` and its kernel) of a call on q, k, v `[b, h, n, d]` with this key padding mask and relative
    embedding (each a tensor or None), dropout and causality: the executor of `steps` that `backend` runs.

    Raises:
        ValueError: As `select_step_executor`, with the reasons the named back end cannot run the call.
    """
    flags = dict(key_padding=key_padding_mask is not None, relative_logits=relative_embedding is not None)
    return select_step_executor(backend, steps, q, k, v, dropout_p=dropout_p, causal=causal, **flags)
