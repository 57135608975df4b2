"""xformers' memory-efficient kernels for longattn's patterns: layouts, permutations and log-sum-exp merges.

Shape legend: b batch, h heads, n length (n_q queries, n_k keys), d head dim (d_v for values); in xformers' own
layout a kernel call takes `[B, M, H, K]` queries and `[B, N, H, K]` keys/values (B calls of M queries over N keys).

xformers kernels skip work natively for a few mask shapes: a local band (`LocalAttentionFromBottomRightMask`),
causal triangles, block-diagonal packs (`BlockDiagonalMask`). A pattern is mapped onto them as an
`XformersLayout`: a list of `Part`s, each one kernel call over gathered query rows and key rows with one bias (the
layouts are built in `executor_xformers_layouts`, and importable from here):

- sliding window: one part, the band; bottom-right alignment puts the queries at the last positions (decoding).
- dilated window: positions are split into residue classes mod the dilation; inside a class the dilated window is a
  plain band, so each group of equally long classes is one batched band call (the classes ride in the batch dim).
  When the length is a multiple of the dilation and nothing is hidden, the classes are read in place through a
  strided view (`residue_view`), with no gather.
- strided (Sparse Transformer): a band of stride − 1 keys, plus the earlier (and, bidirectional, later) members of
  the query's residue class mod the stride: causal triangles over the permuted classes (the later members by
  reversing the class order).
- fixed: full blocks, plus one part over every summary key.
- global tokens: a part over the gathered global keys, and global queries as a dense call over all keys written
  over the local result.
- LSH buckets, routing clusters, Sinkhorn blocks: sort by (bucket, position), then one `BlockDiagonalMask`
  (`bucketed_attention`).

Parts whose key sets are disjoint are merged exactly by log-sum-exp. Keys a part must skip although its bias would
show them (padding, global keys inside the band, a block's own summary keys) are hidden by one extra head-dim
column: queries get `a`, hidden keys `-a` (`a² · scale = HIDDEN_PENALTY`), visible keys 0, so a hidden key's score
drops by 1e4 (its weight is exactly 0 in float32) and the head dim is padded to a multiple of 8; rows that see
only hidden keys are detected by their log-sum-exp and zeroed. The merged backward calls the kernel's backward once
per part with the merged output and log-sum-exp (exact: the softmax over the union is what each part's keys saw).

Every kernel call goes through one injectable object (`fused_kernel.current_kernel()`, replaced with
`use_kernel(...)`) with xformers' contract `[B, M, H, K]`: `attention` (autograd, dropout), `forward` (output and
log-sum-exp) and `backward`. `ReferenceKernel` implements that contract with dense PyTorch math and materialised
biases, so the permutations, merges and hidden-key column run end to end on CPU in the tests. xformers is imported
lazily, inside functions, through public `xformers.ops` names only; the one xformers global a kernel call needs is
set for that call only (`fused_kernel.xformers_call`).
"""

from __future__ import annotations

import importlib.util
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from .executor_xformers_layouts import (
    LayoutGrid,
    Part,
    XformersLayout,
    _attn_bias,
    _identity_rows,
    bucket_order,
    fixed_layout,
    full_layout,
    sliding_window_layout,
    strided_layout,
)
from .executor_xformers_layouts import __all__ as _LAYOUT_NAMES
from .executor_xformers_layouts import materialize_layout as materialize_layout
from .executor_xformers_layouts import residue_classes as residue_classes
from .fused_kernel import ReferenceKernel, XformersKernel, current_kernel, use_kernel
from .numerics import HALF_HIDDEN_PENALTY, NO_KEY_LSE, compute_dtype

__all__ = [
    *_LAYOUT_NAMES,  # the layouts, built in `executor_xformers_layouts`
    "HIDDEN_PENALTY",
    "XformersKernel",
    "ReferenceKernel",
    "current_kernel",
    "use_kernel",
    "residue_view",
    "run_layout",
    "xformers_sliding_window_attention",
    "xformers_strided_attention",
    "xformers_fixed_attention",
    "xformers_full_attention",
    "bucketed_attention",
    "document_bias",
    "xformers_document_attention",
    "documents_supported",
    "unavailable_reasons",
    "request_reasons",
    "needs_tensor_bias",
    "probe_reasons",
]

HIDDEN_PENALTY = HALF_HIDDEN_PENALTY
"""Score drop of a hidden key (and the additive bias of a masked entry of a dense part bias): `numerics`'
HALF_HIDDEN_PENALTY. A row whose log-sum-exp is below -HIDDEN_PENALTY / 2 saw only hidden keys and is zeroed."""

_MAX_HEAD_DIM = 256


# ----------------------------------------------------------------------------------------------- execution
def run_layout(
    q: Tensor, k: Tensor, v: Tensor, layout: XformersLayout, *, scale: float, dropout_p: float = 0.0
) -> Tensor:
    """Compute a layout on q `[b, h, n_q, d]`, k `[b, h, n_k, d]`, v `[b, h, n_k, d_v]` -> `[b, h, n_q, d_v]`.

    Disjoint layouts run every part as one autograd kernel call (dropout allowed); the others through
    `_MergedParts` (log-sum-exp merge, hidden keys, merged backward; no dropout).

    Raises:
        ValueError: Dropout on a layout that merges parts or hides keys.
    """
    if layout.disjoint:
        out = _run_disjoint(q, k, v, layout.parts, scale=scale, dropout_p=dropout_p)
    else:
        if dropout_p > 0:
            raise ValueError("the xformers path has no attention dropout when it merges parts or hides keys")
        out = _MergedParts.apply(q, k, v, layout.parts, float(scale))
    if layout.overrides:
        if dropout_p > 0:
            raise ValueError("the xformers path has no attention dropout with global tokens")
        override = _MergedParts.apply(q, k, v, layout.overrides, float(scale))
        out = torch.where(layout.override_rows[:, None, :, None], override, out)
    return out


def _flat_table(x: Tensor) -> Tensor:
    """`[b, h, n, d]` -> `[b · n + 1, h, d]`: rows in (batch, position) order, plus one zero row."""
    b, h, n, d = x.shape
    return torch.cat([x.transpose(1, 2).reshape(b * n, h, d), x.new_zeros(1, h, d)])


def _gather(x: Tensor, table: Tensor | None, rows: Tensor | None, heads: Tensor | None) -> Tensor:
    """Kernel input `[B, M, h_p, d]` of rows (None: x itself as `[b, n, h, d]`, a view)."""
    if rows is None:
        out = x.transpose(1, 2)  # [b, n, h, d]
    else:
        out = table.index_select(0, rows.reshape(-1)).view(*rows.shape, *table.shape[1:])  # [B, M, h, d]
    return out if heads is None else out.index_select(2, heads)


def _run_disjoint(q, k, v, parts, *, scale, dropout_p):
    kernel = current_kernel()
    b, h, n_q, _ = q.shape
    d_v = v.shape[3]
    if len(parts) == 1 and parts[0].q_rows is None and parts[0].k_rows is None and parts[0].heads is None:
        part = parts[0]
        out = kernel.attention(
            _gather(q, None, None, None),
            _gather(k, None, None, None),
            _gather(v, None, None, None),
            part.bias,
            p=dropout_p,
            scale=scale,
        )
        return out.transpose(1, 2)  # [b, h, n_q, d_v]
    q_table = _flat_table(q) if any(p.q_rows is not None for p in parts) else None
    k_table = _flat_table(k) if any(p.k_rows is not None for p in parts) else None
    v_table = _flat_table(v) if k_table is not None else None
    out = q.new_zeros(b * n_q + 1, h, d_v)
    for part in parts:
        heads = part.heads if part.heads is not None else torch.arange(h, device=q.device)
        out_part = kernel.attention(
            _gather(q, q_table, part.q_rows, part.heads),
            _gather(k, k_table, part.k_rows, part.heads),
            _gather(v, v_table, part.k_rows, part.heads),
            part.bias,
            p=dropout_p,
            scale=scale,
        )  # [B, M, h_p, d_v]
        rows = part.q_rows if part.q_rows is not None else _identity_rows(b, n_q, q.device)
        out = out.index_put((rows.reshape(-1, 1), heads.view(1, -1)), out_part.reshape(-1, len(heads), d_v))
    return out[: b * n_q].view(b, n_q, h, d_v).transpose(1, 2)


@dataclass
class _PartInputs:
    q: Tensor  # [B, M, h_p, K]
    k: Tensor
    v: Tensor
    bias: Any
    q_rows: Tensor  # [B·M] flat query rows
    k_rows: Tensor  # [B·N] flat key rows
    heads: Tensor  # [h_p]
    width: int  # K: padded head dim of the call


def _part_inputs(part: Part, q: Tensor, k: Tensor, v: Tensor, tables, scale: float) -> _PartInputs:
    b, h, n_q, d = q.shape
    n_k, d_v = k.shape[2], v.shape[3]
    q_table, k_table, v_table = tables
    q_in = _gather(q, q_table, part.q_rows, part.heads)
    k_in = _gather(k, k_table, part.k_rows, part.heads)
    v_in = _gather(v, v_table, part.k_rows, part.heads)
    width = d
    if part.key_hidden is not None:
        # One more column carries the hidden flag: q gets a, a hidden key -a, so its score drops by a² · scale.
        width = -(-(max(d + 1, d_v)) // 8) * 8
        a = math.sqrt(HIDDEN_PENALTY / scale)
        flag = -a * part.key_hidden.to(k.dtype)  # [B, N]
        q_in = torch.cat([q_in, q_in.new_full((*q_in.shape[:3], 1), a)], dim=-1)
        k_in = torch.cat([k_in, flag[:, :, None, None].expand(*k_in.shape[:3], 1)], dim=-1)
        q_in, k_in = F.pad(q_in, (0, width - d - 1)), F.pad(k_in, (0, width - d - 1))
        v_in = F.pad(v_in, (0, width - d_v))
    bias = part.bias
    if part.visible is not None:
        # An additive bias; its rows are 8-aligned in memory (cutlass reads them in vectors), its batch and head
        # dims stay broadcast views.
        n = part.visible.shape[-1]
        additive = torch.zeros(*part.visible.shape[:-1], -(-n // 8) * 8, dtype=q.dtype, device=q.device)[..., :n]
        additive.masked_fill_(~part.visible, -HIDDEN_PENALTY)  # [B|1, 1, M, N]
        bias = additive.expand(q_in.shape[0], q_in.shape[2], q_in.shape[1], k_in.shape[1])
    q_rows = part.q_rows if part.q_rows is not None else _identity_rows(b, n_q, q.device)
    k_rows = part.k_rows if part.k_rows is not None else _identity_rows(b, n_k, q.device)
    heads = part.heads if part.heads is not None else torch.arange(h, device=q.device)
    return _PartInputs(
        q_in.contiguous(),
        k_in.contiguous(),
        v_in.contiguous(),
        bias,
        q_rows.reshape(-1),
        k_rows.reshape(-1),
        heads,
        width,
    )


class _MergedParts(torch.autograd.Function):
    """Parts over disjoint key sets of the same queries, merged by log-sum-exp; hand-written backward.

    Forward: every part's output O_i and log-sum-exp L_i, merged into L = log Σ exp(L_i) and
    O = Σ exp(L_i − L) O_i (running, per covered (row, head)). Backward: the softmax over the union restricted to
    part i's keys is exp(S_i − L), so each part's kernel backward, given the merged O and L and the output's
    gradient, returns exactly that part's share of dQ, dK, dV; they are scatter-added back.
    """

    @staticmethod
    def forward(ctx, q, k, v, parts, scale):
        kernel = current_kernel()
        b, h, n_q, d = q.shape
        d_v = v.shape[3]
        acc = compute_dtype(q.dtype)
        tables = _tables(q, k, v, parts)
        out = torch.zeros(b * n_q + 1, h, d_v, dtype=acc, device=q.device)
        lse = torch.full((b * n_q + 1, h), NO_KEY_LSE, dtype=acc, device=q.device)
        for part in parts:
            inputs = _part_inputs(part, q, k, v, tables, scale)
            out_part, lse_part = kernel.forward(inputs.q, inputs.k, inputs.v, inputs.bias, scale=scale)
            h_p = inputs.heads.numel()
            out_part = out_part[..., :d_v].reshape(-1, h_p, d_v).to(acc)  # [B·M, h_p, d_v]
            lse_part = lse_part.to(acc).transpose(1, 2).reshape(-1, h_p)  # [B·M, h_p]
            index = (inputs.q_rows[:, None], inputs.heads[None, :])
            old_lse = lse[index]
            new_lse = torch.logaddexp(old_lse, lse_part)
            safe = torch.where(torch.isfinite(new_lse), new_lse, 0.0)
            old_weight = torch.where(torch.isfinite(old_lse), (old_lse - safe).exp(), 0.0)
            new_weight = torch.where(torch.isfinite(lse_part), (lse_part - safe).exp(), 0.0)
            out[index] = out[index] * old_weight[..., None] + out_part * new_weight[..., None]
            lse[index] = new_lse
        has_key = lse > -HIDDEN_PENALTY / 2  # rows that saw only hidden keys (or nothing) see no key
        out = torch.where(has_key[..., None], out, 0.0)
        lse = torch.where(has_key, lse, NO_KEY_LSE)
        out_q = out[: b * n_q].view(b, n_q, h, d_v).transpose(1, 2).to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        # The kernel of the forward also runs the backward, even if `use_kernel` has been left since.
        ctx.parts, ctx.scale, ctx.kernel = parts, scale, kernel
        return out_q

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        parts, scale, kernel = ctx.parts, ctx.scale, ctx.kernel
        b, h, n_q, d = q.shape
        n_k, d_v = k.shape[2], v.shape[3]
        acc = out.dtype
        tables = _tables(q, k, v, parts)
        has_key = torch.isfinite(lse)  # [b·n_q + 1, h]
        grad = torch.cat(
            [grad_out.transpose(1, 2).reshape(b * n_q, h, d_v).to(acc), grad_out.new_zeros(1, h, d_v).to(acc)]
        )
        grad = torch.where(has_key[..., None], grad, 0.0)
        # Rows without a key get no gradient; any finite lse keeps their (zero-weighted) probabilities finite.
        lse = torch.where(has_key, lse, 0.0)
        grad_q = torch.zeros(b * n_q + 1, h, d, dtype=acc, device=q.device)
        grad_k = torch.zeros(b * n_k + 1, h, d, dtype=acc, device=q.device)
        grad_v = torch.zeros(b * n_k + 1, h, d_v, dtype=acc, device=q.device)
        for part in parts:
            inputs = _part_inputs(part, q, k, v, tables, scale)
            index = (inputs.q_rows[:, None], inputs.heads[None, :])
            shape = inputs.q.shape  # [B, M, h_p, K]
            pad = inputs.width - d_v
            grad_part = F.pad(grad[index], (0, pad)).view(*shape[:3], -1).to(q.dtype)
            out_part = F.pad(out[index], (0, pad)).view(*shape[:3], -1).to(q.dtype)
            lse_part = lse[index].view(*shape[:3]).transpose(1, 2)  # [B, h_p, M], float32 (float64 inputs: float64)
            dq, dk, dv = kernel.backward(
                grad_part, out_part, lse_part, inputs.q, inputs.k, inputs.v, inputs.bias, scale=scale
            )
            h_p = inputs.heads.numel()
            grad_q.index_put_(index, dq[..., :d].reshape(-1, h_p, d).to(acc), accumulate=True)
            k_index = (inputs.k_rows[:, None], inputs.heads[None, :])
            grad_k.index_put_(k_index, dk[..., :d].reshape(-1, h_p, d).to(acc), accumulate=True)
            grad_v.index_put_(k_index, dv[..., :d_v].reshape(-1, h_p, d_v).to(acc), accumulate=True)
        return (
            grad_q[: b * n_q].view(b, n_q, h, d).transpose(1, 2).to(q.dtype),
            grad_k[: b * n_k].view(b, n_k, h, d).transpose(1, 2).to(k.dtype),
            grad_v[: b * n_k].view(b, n_k, h, d_v).transpose(1, 2).to(v.dtype),
            None,
            None,
        )


def _tables(q, k, v, parts):
    gathers_q = any(p.q_rows is not None for p in parts)
    gathers_k = any(p.k_rows is not None for p in parts)
    return (
        _flat_table(q) if gathers_q else None,
        _flat_table(k) if gathers_k else None,
        _flat_table(v) if gathers_k else None,
    )


# ----------------------------------------------------------------------------------------------- executors
def xformers_sliding_window_attention(
    q: Tensor, k: Tensor, v: Tensor, *, scale: float, dropout_p: float = 0.0, **pattern: Any
) -> Tensor:
    """`ops.sliding_window_attention` on xformers kernels (arguments validated there): `[b, h, n_q, d_v]`.

    Args:
        q, k, v: `[b, h, n_q, d]` (the last n_q positions), `[b, h, n_k, d]`, `[b, h, n_k, d_v]`.
        scale: Multiplier of q·k.
        dropout_p: Dropout on the attention probabilities.
        **pattern: `sliding_window_layout`'s window, dilation, causal, key_padding_mask and global_mask.
    """
    dilation, causal = pattern.get("dilation", 1), pattern.get("causal", False)
    masked = pattern.get("key_padding_mask") is not None or pattern.get("global_mask") is not None
    if not masked and _residue_views_apply(q, k, dilation):
        return _dilated_band_on_views(
            q, k, v, window=pattern["window"], dilation=dilation, causal=causal, scale=scale, dropout_p=dropout_p
        )
    return run_layout(q, k, v, sliding_window_layout(LayoutGrid.of(q, k), **pattern), scale=scale, dropout_p=dropout_p)


def _residue_views_apply(q: Tensor, k: Tensor, dilation) -> bool:
    """Whether a dilated window without padding or global tokens can run on strided views of q, k, v instead of
    gathered copies."""
    n = k.shape[2]
    return isinstance(dilation, int) and dilation > 1 and n % dilation == 0 and q.shape[2] == n


def residue_view(x: Tensor, modulus: int) -> Tensor:
    """`[b, h, n, d]` -> `[b, modulus, n / modulus, h, d]`, a view: `[i, r, t]` is position `t · modulus + r`.

    Residue class r of batch row i, in position order, in xformers' `[B, M, H, K]` layout (B = the classes)
    without a copy; the kernels read it through its strides. n must be a multiple of `modulus`.
    """
    b, h, n, d = x.shape
    return x.view(b, h, n // modulus, modulus, d).permute(0, 3, 2, 1, 4)


def _dilated_band_on_views(q, k, v, *, window, dilation, causal, scale, dropout_p):
    """A dilated window (one dilation, n a multiple of it, no padding or global tokens) as one band call per
    batch row over the residue classes, read in place: inside a class the dilated window is a plain band of
    `window` class steps. Only the output is copied back to position order."""
    b, h, n, _ = q.shape
    band = _attn_bias().LocalAttentionFromBottomRightMask(
        window_left=min(window, n // dilation), window_right=0 if causal else min(window, n // dilation)
    )
    views = [residue_view(x, dilation) for x in (q, k, v)]
    kernel = current_kernel()
    outs = [kernel.attention(views[0][i], views[1][i], views[2][i], band, p=dropout_p, scale=scale) for i in range(b)]
    out = outs[0].unsqueeze(0) if b == 1 else torch.stack(outs)  # [b, dilation, n / dilation, h, d_v]
    return out.permute(0, 3, 2, 1, 4).reshape(b, h, n, v.shape[-1])


def xformers_strided_attention(q: Tensor, k: Tensor, v: Tensor, *, scale: float, **pattern: Any) -> Tensor:
    """Strided attention on xformers kernels; q, k, v `[b, h, n, d]`, `pattern`: `strided_layout`'s stride, causal
    and key_padding_mask."""
    return run_layout(q, k, v, strided_layout(LayoutGrid.of(q, k), **pattern), scale=scale)


def xformers_fixed_attention(q: Tensor, k: Tensor, v: Tensor, *, scale: float, **pattern: Any) -> Tensor:
    """Fixed attention on xformers kernels; q, k, v `[b, h, n, d]`, `pattern`: `fixed_layout`'s block_size,
    num_summary, summary_per_head, causal and key_padding_mask.

    Blocks count from position 0 in every row, padded or not. The pattern of `patterns.fixed_pattern` counts them
    from each row's first real token; `ops.fixed_attention` rolls left-padded rows before calling this, so call it
    directly only on rows whose padding is at the end.
    """
    return run_layout(q, k, v, fixed_layout(LayoutGrid.of(q, k), **pattern), scale=scale)


def xformers_full_attention(
    q: Tensor, k: Tensor, v: Tensor, *, scale: float, dropout_p: float = 0.0, **pattern: Any
) -> Tensor:
    """Dense attention on xformers kernels; q `[b, h, n_q, d]` are the last n_q positions, `pattern`:
    `full_layout`'s causal and key_padding_mask."""
    return run_layout(q, k, v, full_layout(LayoutGrid.of(q, k), **pattern), scale=scale, dropout_p=dropout_p)


def bucketed_attention(
    q: Tensor, k: Tensor, v: Tensor, *, buckets: Tensor, causal: bool = False, scale: float, dropout_p: float = 0.0
) -> Tensor:
    """Attention within buckets (LSH buckets, routing clusters, Sinkhorn blocks) as one block-diagonal call.

    The inner step the content-based kinds share: every query sees the keys of its own bucket (causal: the earlier
    ones and itself). Sorted by `bucket_order`, each (batch, head, bucket) is one block of a `BlockDiagonalMask`.

    Args:
        q: Queries `[b, h, n, d]`.
        k: Keys `[b, h, n, d]`.
        v: Values `[b, h, n, d_v]`.
        buckets: Long `[b, h, n]`, the bucket of every position (queries and keys share it).
        causal: Keys after the query (by position) are hidden.
        scale: Multiplier of q·k.
        dropout_p: Dropout on the attention probabilities.

    Returns:
        Output `[b, h, n, d_v]`.
    """
    b, h, n, d = q.shape
    order, seqlens = bucket_order(buckets)
    blocks = _attn_bias().BlockDiagonalMask.from_seqlens(seqlens, device=q.device)
    if causal:
        blocks = blocks.make_causal()

    def sort(x):
        return x.reshape(b * h * n, -1).index_select(0, order).view(1, b * h * n, 1, x.shape[-1])  # [1, b·h·n, 1, d]

    out = current_kernel().attention(sort(q), sort(k), sort(v), blocks, p=dropout_p, scale=scale)
    unsorted = torch.empty_like(out.view(b * h * n, -1)).index_copy(0, order, out.view(b * h * n, -1))
    return unsorted.view(b, h, n, v.shape[-1])


def document_bias(document_ids: Tensor, *, causal: bool, window: int | None = None) -> Any:
    """Packed documents as one xformers `BlockDiagonalMask` over the flattened batch `[1, b · n]`.

    Every (row, document) is one block; causal blocks are triangles, and a causal window of w earlier keys is
    `make_local_attention(w + 1)` (xformers counts the query itself in its window). Reads the document lengths back
    to the host once.

    Args:
        document_ids: Integer `[b, n]`, contiguous runs of one id per document.
        causal: Each block is causal.
        window: Keys before each query (causal only); None = the whole document.

    Returns:
        The bias over `[b · n, b · n]`.
    """
    b, n = document_ids.shape
    begins = torch.ones_like(document_ids, dtype=torch.bool)
    begins[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]
    starts = begins.reshape(-1).nonzero().flatten().tolist() + [b * n]
    seqlens = [end - start for start, end in zip(starts[:-1], starts[1:])]
    bias = _attn_bias().BlockDiagonalMask.from_seqlens(seqlens, device=document_ids.device)
    if window is not None:
        return bias.make_local_attention(window + 1)
    return bias.make_causal() if causal else bias


def xformers_document_attention(
    q: Tensor, k: Tensor, v: Tensor, *, document_ids: Tensor, causal: bool = False, window: int | None = None,
    scale: float, dropout_p: float = 0.0,
) -> Tensor:  # fmt: skip
    """Full or causal-window attention within packed documents, one block-diagonal kernel call (xformers' varlen).

    Args:
        q: Queries `[b, h, n, d]`.
        k: Keys `[b, h, n, d]`.
        v: Values `[b, h, n, d_v]`.
        document_ids: Integer `[b, n]`, contiguous runs of one id per document.
        causal: Keys after the query are hidden.
        window: Keys before each query (causal only); None = the whole document.
        scale: Multiplier of q·k.
        dropout_p: Dropout on the attention probabilities.

    Returns:
        Output `[b, h, n, d_v]`.
    """
    b, h, n, _ = q.shape

    def flat(x: Tensor) -> Tensor:
        return x.transpose(1, 2).reshape(1, b * n, h, x.shape[-1])  # [1, b·n, h, d]

    bias = document_bias(document_ids, causal=causal, window=window)
    out = current_kernel().attention(flat(q), flat(k), flat(v), bias, p=dropout_p, scale=scale)
    return out.view(b, n, h, v.shape[-1]).transpose(1, 2)  # [b, h, n, d_v]


def documents_supported(
    *,
    pattern: str,
    causal: bool,
    key_padding: bool,
    global_tokens: bool,
    dilation: int | Sequence[int],
    q_len: int,
    kv_len: int,
) -> bool:
    """Whether packed documents of a request map to `document_bias`: full attention, or a causal undilated window,
    with neither padding nor global tokens, as many queries as keys."""
    plain = not key_padding and not global_tokens and q_len == kv_len
    undilated = dilation == 1 or (not isinstance(dilation, int) and set(dilation) == {1})
    return plain and (pattern == "full" or (pattern == "sliding" and causal and undilated))


# ----------------------------------------------------------------------------------------------- capabilities
# Read once at import (a search, not an import): `torch.compile` then reads a constant instead of tracing a check.
_XFORMERS_FOUND = importlib.util.find_spec("xformers") is not None


def unavailable_reasons() -> list[str]:
    """Why xformers cannot be used at all in this environment (empty when its package is installed)."""
    return [] if _XFORMERS_FOUND else ["xformers is not installed (pip install xformers)"]


def needs_tensor_bias(*, pattern: str, causal: bool, global_tokens: bool) -> bool:
    """Whether the layout of a request carries a dense part mask (an additive tensor bias, served by cutlass)."""
    # Sinkhorn's blocks and LSH / routing windows hide keys (padding, causality, empty blocks) with an additive bias.
    return pattern in ("sinkhorn", "windows") or (
        causal and ((pattern == "sliding" and global_tokens) or pattern == "fixed")
    )


def request_reasons(
    *,
    pattern: str,
    dtype: torch.dtype,
    head_dim: int,
    value_head_dim: int,
    q_len: int,
    kv_len: int,
    batch: int,
    causal: bool,
    dropout: bool,
    key_padding: bool,
    global_tokens: bool,
    dilation: int | Sequence[int] = 1,
) -> list[str]:
    """Why the xformers layouts cannot serve a request, decided without touching a GPU."""
    reasons = []
    if dtype not in (torch.float16, torch.bfloat16, torch.float32):
        reasons.append(f"xformers kernels take float16, bfloat16 or float32, not {str(dtype).removeprefix('torch.')}")
    hides_keys = key_padding or global_tokens or pattern == "fixed"
    limit = _MAX_HEAD_DIM - 8 if hides_keys else _MAX_HEAD_DIM
    if head_dim % 8 or head_dim > limit:
        reasons.append(
            f"head dim {head_dim} must be a multiple of 8 and at most {limit} for xformers' flash kernels"
            + (" (one column carries the hidden-key flag)" if hides_keys else "")
        )
    if value_head_dim != head_dim:
        reasons.append(f"value head dim {value_head_dim} differs from the query/key head dim {head_dim}")
    if pattern in ("strided", "fixed") and q_len != kv_len:
        reasons.append(f"the {pattern} layout needs as many queries as keys (got {q_len} and {kv_len})")
    if pattern == "fixed" and causal and key_padding:
        reasons.append(
            "causal fixed attention with padding counts blocks from each row's first real token; the "
            "xformers layout counts them from position 0"
        )
    if pattern == "windows" and dropout:
        reasons.append(
            "the key windows of LSH and routing need the kernel's log-sum-exp, whose forward has no attention dropout"
        )
    if pattern == "blocks" and key_padding:
        reasons.append("bucketed attention takes no key padding mask (put padding in a bucket of its own)")
    merges = global_tokens or key_padding or pattern in ("strided", "fixed")
    if dropout and merges:
        reasons.append(
            "attention dropout is only available on single-call layouts (no key padding, global tokens, "
            "strided or fixed parts): the merged path runs xformers' forward/backward, which have none"
        )
    return reasons


_PROBED: dict[tuple, list[str]] = {}


def probe_reasons(dtype: torch.dtype, *, needs_tensor_bias: bool = False, device=None) -> list[str]:
    """Run a tiny forward and backward of the kernels a layout needs on the current CUDA device, once.

    xformers' compiled extension may target another torch build than the one installed; its flash and cutlass
    paths can still run on PyTorch's own kernels. This smoke test (cached per device, dtype and need) tells which.

    Returns:
        The failures, as reasons (empty when everything ran).
    """
    if not torch.cuda.is_available():
        return ["no CUDA device is available"]
    device = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
    key = (str(device), dtype, needs_tensor_bias)
    if key not in _PROBED:
        # The smoke test runs a backward whatever the caller's mode (inference included).
        with torch.inference_mode(False), torch.enable_grad():
            _PROBED[key] = _probe(device, dtype, needs_tensor_bias)
    return _PROBED[key]


def _probe(device, dtype, needs_tensor_bias) -> list[str]:
    try:
        bias = _attn_bias()
    except Exception as error:  # noqa: BLE001 - any import failure is a reason
        return [
            f"import xformers.ops failed: {type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
        ]
    kernel = XformersKernel()
    checks = {
        "local band (autograd)": lambda q, k, v: (
            kernel.attention(
                q, k, v, bias.LocalAttentionFromBottomRightMask(window_left=8, window_right=8), p=0.0, scale=0.125
            )
            .float()
            .sum()
            .backward()
        ),
        "causal triangle forward/backward with log-sum-exp": lambda q, k, v: _probe_merged(
            kernel, q, k, v, bias.LowerTriangularMask()
        ),
    }
    if needs_tensor_bias:
        checks["dense additive bias forward/backward"] = lambda q, k, v: _probe_merged(
            kernel, q, k, v, torch.zeros(1, 1, 64, 64, dtype=dtype, device=device).expand(1, 2, 64, 64)
        )
    reasons = []
    for name, check in checks.items():
        try:
            q, k, v = (torch.randn(1, 64, 2, 64, device=device, dtype=dtype, requires_grad=True) for _ in range(3))
            check(q, k, v)
            torch.cuda.synchronize(device)
        except Exception as error:  # noqa: BLE001 - a failing kernel is a reason, whatever it raises
            # xformers explains a refusal over several lines (one block per operator): keep them all, on one line.
            message = " ".join(line.strip() for line in str(error).splitlines() if line.strip())
            reasons.append(
                f"xformers {name} failed on {device} in {str(dtype).removeprefix('torch.')}: "
                f"{type(error).__name__}: {message[:600]}"
            )
    return reasons


def _probe_merged(kernel, q, k, v, attn_bias):
    with torch.no_grad():
        out, lse = kernel.forward(q, k, v, attn_bias, scale=0.125)
        kernel.backward(torch.ones_like(out), out, lse, q, k, v, attn_bias, scale=0.125)
