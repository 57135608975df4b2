"""Triton back end: one kernel family for Longformer's (dilated, per-head) sliding window with global tokens.

Shape legend: b batch, h query heads, h_kv key/value heads (h = h_kv · group), n length, d head dim (d_v for values),
g global slots (the most global tokens of a batch row), r a head's dilation.

Residue classes by strided addressing. Under dilation r, position p = c + r·s lies in class c = p mod r at step
s = p div r, and a query sees only keys of its own class, at steps s - w .. s + w (s - w .. s when causal): in
class steps the dilated window is a plain band. A program takes `BLOCK_M` consecutive steps of one class of one
head and walks the key steps of its band, loading rows r apart (a stride of r · stride_n): no permutation copy and
no work on the keys the dilation skips. Every head's dilation runs in one launch: the grid covers the head with the
most blocks (about n / BLOCK_M + r), and the spare programs of the other heads return at once. A key/value head is
read by its group of query heads in place (grouped-query attention without copies).

Window 2, dilation 2, 8 tokens: classes {0, 2, 4, 6} and {1, 3, 5, 7}, each a band of width 2 over its steps:

    ■ ⬚ ■ ⬚ ■ ⬚ ⬚ ⬚        class 0 steps   class 1 steps
    ⬚ ■ ⬚ ■ ⬚ ■ ⬚ ⬚        ■ ■ ■ ⬚         ■ ■ ■ ⬚
    ■ ⬚ ■ ⬚ ■ ⬚ ■ ⬚        ■ ■ ■ ■         ■ ■ ■ ■
    ⬚ ■ ⬚ ■ ⬚ ■ ⬚ ■        ■ ■ ■ ■         ■ ■ ■ ■
    ■ ⬚ ■ ⬚ ■ ⬚ ■ ⬚        ⬚ ■ ■ ■         ⬚ ■ ■ ■
    ⬚ ■ ⬚ ■ ⬚ ■ ⬚ ■
    ⬚ ⬚ ■ ⬚ ■ ⬚ ■ ⬚
    ⬚ ⬚ ⬚ ■ ⬚ ■ ⬚ ■

Global tokens (`patterns.global_token_mask`) split the pattern into disjoint key sets, so no pair counts twice:

- a non-global query sees its band without the global keys (the kernel hides them), plus every global key: the
  forward kernel walks the gathered global keys after its band, in the same running softmax, which is the
  log-sum-exp merge of the two parts;
- a global query sees every key: a second small pass (dense over n keys for g queries, in PyTorch) owns those rows,
  and the band kernel leaves them out.

The forward saves the merged log-sum-exp; the backward of every part (the band kernels, the global keys' and global
rows' gradients in PyTorch) computes its probabilities as exp(S - merged lse) against the merged output, which is
exactly that part's share of the gradient of the union. Padding hides keys; causality is applied to every part.

Triton is optional and imported when this module is (`longattn.ops` imports it only when the back end runs), so the
package imports without it. Its interpreter (`TRITON_INTERPRET=1`, set before triton is imported) runs the same
kernels on CPU, in float32 and float16; that is how the test suite checks them. bfloat16 needs a GPU.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from .executor_blocked import global_token_index
from .numerics import compute_dtype

try:  # inside `try`: transformers' remote-code loader does not require imports made here
    import triton
    import triton.language as tl
except ImportError:  # the back end then reports itself unavailable (`longattn.backends`)
    triton = tl = None

__all__ = ["BLOCK_M", "BLOCK_N", "triton_sliding_window_attention"]

BLOCK_M = 64
"""Query steps per program (one class of one head)."""
BLOCK_N = 64
"""Key steps per tile of the band walk."""
_LOG2E = 1.4426950408889634  # the kernels use exp2: scores are scaled by log2(e) once, the lse converted back
_LN2 = 0.6931471805599453


def _jit(fn):
    return fn if triton is None else triton.jit(fn)


# ------------------------------------------------------------------------------------------------ the kernels
@_jit
def _class_block(pid, n, r, BLOCK: tl.constexpr):
    """Program `pid`'s class c, first step and the class's number of steps (c >= r: a spare program)."""
    blocks_per_class = tl.cdiv(tl.cdiv(n, r), BLOCK)
    c = pid // blocks_per_class
    start = (pid % blocks_per_class) * BLOCK
    steps = tl.cdiv(tl.maximum(n - c, 0), r)
    return c, start, steps


@_jit
def _band_forward_kernel(
    Q, K, V, OUT, LSE, FLAGS, GLOBAL_INDEX, DILATION,
    sqb, sqh, sqn, sqd, skb, skh, skn, skd, svb, svh, svn, svd,
    n, heads, group, g, scale,
    D: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    WINDOW: tl.constexpr, WINDOW_RIGHT: tl.constexpr, CAUSAL: tl.constexpr,
    HAS_FLAGS: tl.constexpr, HAS_GLOBAL: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """Output and log-sum-exp of BLOCK_M query steps of one class: their band, then the global keys."""
    bh = tl.program_id(1)
    b = bh // heads
    h = bh % heads
    r = tl.load(DILATION + h)
    c, start_m, steps = _class_block(tl.program_id(0), n, r, BLOCK_M)
    if (c >= r) | (start_m >= steps):
        return
    kv_h = h // group
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    in_class = offs_m < steps
    pos_m = c + r * offs_m
    q = tl.load(
        Q + b * sqb + h * sqh + pos_m[:, None] * sqn + offs_d[None, :] * sqd,
        mask=in_class[:, None] & (offs_d[None, :] < D),
        other=0.0,
    )
    rows = in_class
    if HAS_FLAGS:  # global queries are the global pass's rows
        rows = rows & ((tl.load(FLAGS + b * n + pos_m, mask=in_class, other=0) & 2) == 0)
    qk_scale = scale * 1.4426950408889634
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    lo = tl.maximum(start_m - WINDOW, 0)
    hi = tl.minimum(start_m + BLOCK_M + WINDOW_RIGHT, steps)
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        pos_n = c + r * offs_n
        cols = offs_n < hi
        k = tl.load(
            K + b * skb + kv_h * skh + pos_n[:, None] * skn + offs_d[None, :] * skd,
            mask=cols[:, None] & (offs_d[None, :] < D),
            other=0.0,
        )
        v = tl.load(
            V + b * svb + kv_h * svh + pos_n[:, None] * svn + offs_dv[None, :] * svd,
            mask=cols[:, None] & (offs_dv[None, :] < DV),
            other=0.0,
        )
        if HAS_FLAGS:  # a real key that is not global (global keys come below)
            cols = cols & (tl.load(FLAGS + b * n + pos_n, mask=cols, other=0) == 1)
        step = offs_m[:, None] - offs_n[None, :]
        visible = rows[:, None] & cols[None, :] & (step <= WINDOW) & (step >= -WINDOW_RIGHT)
        acc, m_i, l_i = _softmax_step(q, k, v, visible, acc, m_i, l_i, qk_scale, PRECISION)
    if HAS_GLOBAL:
        for start_g in range(0, g, BLOCK_N):
            offs_g = start_g + tl.arange(0, BLOCK_N)
            pos_g = tl.load(GLOBAL_INDEX + b * g + offs_g, mask=offs_g < g, other=-1)
            cols = pos_g >= 0
            safe_g = tl.where(cols, pos_g, 0)
            cols = cols & ((tl.load(FLAGS + b * n + safe_g, mask=cols, other=0) & 1) == 1)
            k = tl.load(
                K + b * skb + kv_h * skh + safe_g[:, None] * skn + offs_d[None, :] * skd,
                mask=cols[:, None] & (offs_d[None, :] < D),
                other=0.0,
            )
            v = tl.load(
                V + b * svb + kv_h * svh + safe_g[:, None] * svn + offs_dv[None, :] * svd,
                mask=cols[:, None] & (offs_dv[None, :] < DV),
                other=0.0,
            )
            visible = rows[:, None] & cols[None, :]
            if CAUSAL:
                visible = visible & (safe_g[None, :] <= pos_m[:, None])
            acc, m_i, l_i = _softmax_step(q, k, v, visible, acc, m_i, l_i, qk_scale, PRECISION)
    has_key = l_i > 0  # a row without a visible key: output 0, lse -inf
    l_safe = tl.where(has_key, l_i, 1.0)
    out = acc / l_safe[:, None]
    lse = tl.where(has_key, (m_i + tl.log2(l_safe)) * 0.6931471805599453, float("-inf"))
    tl.store(
        OUT + bh * n * DV + pos_m[:, None] * DV + offs_dv[None, :],
        out.to(OUT.dtype.element_ty),
        mask=in_class[:, None] & (offs_dv[None, :] < DV),
    )
    tl.store(LSE + bh * n + pos_m, lse, mask=in_class)


@_jit
def _softmax_step(q, k, v, visible, acc, m_i, l_i, qk_scale, PRECISION: tl.constexpr):
    """One key tile of the running (base-2) softmax; hidden scores are -inf and rows with none seen stay at 0."""
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # exp2(-inf - 0) = 0, never -inf - -inf
    p = tl.exp2(s - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return acc, m_new, l_i


@_jit
def _band_probs(q, k, lse2, visible, qk_scale, PRECISION: tl.constexpr):
    """Probabilities exp(S - merged lse) of a tile (base 2), 0 where hidden."""
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
    return tl.where(visible, tl.exp2(s - lse2[:, None]), 0.0)


@_jit
def _band_backward_kv_kernel(
    Q, K, V, DO, LSE, DELTA, FLAGS, DILATION, DK, DV_OUT,
    sqb, sqh, sqn, sqd, skb, skh, skn, skd, svb, svh, svn, svd, sob, soh, son, sod,
    n, heads, group, scale,
    D: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    WINDOW: tl.constexpr, WINDOW_RIGHT: tl.constexpr,
    HAS_FLAGS: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """dK, dV of BLOCK_N key steps of one class for one query head: the band's queries that see them."""
    bh = tl.program_id(1)
    b = bh // heads
    h = bh % heads
    r = tl.load(DILATION + h)
    c, start_n, steps = _class_block(tl.program_id(0), n, r, BLOCK_N)
    if (c >= r) | (start_n >= steps):
        return
    kv_h = h // group
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    in_class = offs_n < steps
    pos_n = c + r * offs_n
    k = tl.load(
        K + b * skb + kv_h * skh + pos_n[:, None] * skn + offs_d[None, :] * skd,
        mask=in_class[:, None] & (offs_d[None, :] < D),
        other=0.0,
    )
    v = tl.load(
        V + b * svb + kv_h * svh + pos_n[:, None] * svn + offs_dv[None, :] * svd,
        mask=in_class[:, None] & (offs_dv[None, :] < DV),
        other=0.0,
    )
    cols = in_class
    if HAS_FLAGS:
        cols = cols & (tl.load(FLAGS + b * n + pos_n, mask=in_class, other=0) == 1)
    qk_scale = scale * 1.4426950408889634
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], tl.float32)
    lo = tl.maximum(start_n - WINDOW_RIGHT, 0)
    hi = tl.minimum(start_n + BLOCK_N + WINDOW, steps)
    for start_m in range(lo, hi, BLOCK_M):
        offs_m = start_m + tl.arange(0, BLOCK_M)
        pos_m = c + r * offs_m
        rows = offs_m < hi
        q = tl.load(
            Q + b * sqb + h * sqh + pos_m[:, None] * sqn + offs_d[None, :] * sqd,
            mask=rows[:, None] & (offs_d[None, :] < D),
            other=0.0,
        )
        do = tl.load(
            DO + b * sob + h * soh + pos_m[:, None] * son + offs_dv[None, :] * sod,
            mask=rows[:, None] & (offs_dv[None, :] < DV),
            other=0.0,
        )
        lse = tl.load(LSE + bh * n + pos_m, mask=rows, other=0.0)
        lse2 = tl.where(lse == float("-inf"), 0.0, lse * 1.4426950408889634)
        delta = tl.load(DELTA + bh * n + pos_m, mask=rows, other=0.0)
        if HAS_FLAGS:
            rows = rows & ((tl.load(FLAGS + b * n + pos_m, mask=rows, other=0) & 2) == 0)
        step = offs_m[:, None] - offs_n[None, :]
        visible = rows[:, None] & cols[None, :] & (step <= WINDOW) & (step >= -WINDOW_RIGHT)
        p = _band_probs(q, k, lse2, visible, qk_scale, PRECISION)  # [BLOCK_M, BLOCK_N]
        dv += tl.dot(tl.trans(p.to(do.dtype)), do, input_precision=PRECISION)
        dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
        ds = p * (dp - delta[:, None])
        dk += tl.dot(tl.trans(ds.to(q.dtype)), q, input_precision=PRECISION)
    dk = dk * scale
    tl.store(
        DK + bh * n * D + pos_n[:, None] * D + offs_d[None, :],
        dk.to(DK.dtype.element_ty),
        mask=in_class[:, None] & (offs_d[None, :] < D),
    )
    tl.store(
        DV_OUT + bh * n * DV + pos_n[:, None] * DV + offs_dv[None, :],
        dv.to(DV_OUT.dtype.element_ty),
        mask=in_class[:, None] & (offs_dv[None, :] < DV),
    )


@_jit
def _band_backward_q_kernel(
    Q, K, V, DO, LSE, DELTA, FLAGS, DILATION, DQ,
    sqb, sqh, sqn, sqd, skb, skh, skn, skd, svb, svh, svn, svd, sob, soh, son, sod,
    n, heads, group, scale,
    D: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    WINDOW: tl.constexpr, WINDOW_RIGHT: tl.constexpr,
    HAS_FLAGS: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """dQ of BLOCK_M query steps of one class: the band's keys (the global keys' share is added in PyTorch)."""
    bh = tl.program_id(1)
    b = bh // heads
    h = bh % heads
    r = tl.load(DILATION + h)
    c, start_m, steps = _class_block(tl.program_id(0), n, r, BLOCK_M)
    if (c >= r) | (start_m >= steps):
        return
    kv_h = h // group
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    in_class = offs_m < steps
    pos_m = c + r * offs_m
    q = tl.load(
        Q + b * sqb + h * sqh + pos_m[:, None] * sqn + offs_d[None, :] * sqd,
        mask=in_class[:, None] & (offs_d[None, :] < D),
        other=0.0,
    )
    do = tl.load(
        DO + b * sob + h * soh + pos_m[:, None] * son + offs_dv[None, :] * sod,
        mask=in_class[:, None] & (offs_dv[None, :] < DV),
        other=0.0,
    )
    lse = tl.load(LSE + bh * n + pos_m, mask=in_class, other=0.0)
    lse2 = tl.where(lse == float("-inf"), 0.0, lse * 1.4426950408889634)
    delta = tl.load(DELTA + bh * n + pos_m, mask=in_class, other=0.0)
    rows = in_class
    if HAS_FLAGS:
        rows = rows & ((tl.load(FLAGS + b * n + pos_m, mask=in_class, other=0) & 2) == 0)
    qk_scale = scale * 1.4426950408889634
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    lo = tl.maximum(start_m - WINDOW, 0)
    hi = tl.minimum(start_m + BLOCK_M + WINDOW_RIGHT, steps)
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        pos_n = c + r * offs_n
        cols = offs_n < hi
        k = tl.load(
            K + b * skb + kv_h * skh + pos_n[:, None] * skn + offs_d[None, :] * skd,
            mask=cols[:, None] & (offs_d[None, :] < D),
            other=0.0,
        )
        v = tl.load(
            V + b * svb + kv_h * svh + pos_n[:, None] * svn + offs_dv[None, :] * svd,
            mask=cols[:, None] & (offs_dv[None, :] < DV),
            other=0.0,
        )
        if HAS_FLAGS:
            cols = cols & (tl.load(FLAGS + b * n + pos_n, mask=cols, other=0) == 1)
        step = offs_m[:, None] - offs_n[None, :]
        visible = rows[:, None] & cols[None, :] & (step <= WINDOW) & (step >= -WINDOW_RIGHT)
        p = _band_probs(q, k, lse2, visible, qk_scale, PRECISION)
        dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
        ds = p * (dp - delta[:, None])
        dq += tl.dot(ds.to(k.dtype), k, input_precision=PRECISION)
    dq = dq * scale
    tl.store(
        DQ + bh * n * D + pos_m[:, None] * D + offs_d[None, :],
        dq.to(DQ.dtype.element_ty),
        mask=in_class[:, None] & (offs_d[None, :] < D),
    )


# ------------------------------------------------------------------------------------------------ host side
class _Globals:
    """The global tokens of a call, gathered once.

    Attributes:
        index: Long `[b, g]`, positions of each row's global tokens (invalid slots hold 0).
        valid: Bool `[b, g]`.
        kernel_index: Int32 `[b, g]`, the positions with -1 in invalid slots (what the forward kernel reads).
        row_batch, row_slot, row_pos: Long `[m]`, the m valid (batch row, slot, position) triples: the global rows.
    """

    def __init__(self, global_mask: Tensor):
        self.index, self.valid = global_token_index(global_mask)
        self.kernel_index = torch.where(self.valid, self.index, -1).to(torch.int32).contiguous()
        self.row_batch, self.row_slot = self.valid.nonzero(as_tuple=True)
        self.row_pos = self.index[self.row_batch, self.row_slot]


class _Band:
    """The static facts of a call: window, causality, scale, one dilation per query head, tile sizes."""

    def __init__(self, *, window: int, causal: bool, scale: float, dilations: tuple[int, ...], block_m, block_n):
        self.window, self.causal, self.scale, self.dilations = window, causal, scale, dilations
        self.block_m, self.block_n = block_m, block_n

    def programs(self, n: int, block: int) -> int:
        """Programs per (batch, head) on the grid's first axis: every class block of the most divided head."""
        return max(r * triton.cdiv(triton.cdiv(n, r), block) for r in set(self.dilations))

    def constants(self, d: int, d_v: int, dtype: torch.dtype) -> dict:
        return dict(
            D=d,
            DV=d_v,
            BLOCK_D=max(16, triton.next_power_of_2(d)),
            BLOCK_DV=max(16, triton.next_power_of_2(d_v)),
            WINDOW=self.window,
            WINDOW_RIGHT=0 if self.causal else self.window,
            # float32 inputs multiply in float32 (the GPU's default would round them to tf32).
            PRECISION="ieee" if dtype == torch.float32 else "tf32",
            BLOCK_M=self.block_m,
            BLOCK_N=self.block_n,
        )


def _global_row_scores(q: Tensor, k: Tensor, real: Tensor, glob: _Globals, band: _Band) -> tuple[Tensor, Tensor]:
    """The global queries over every key: q gathered `[b, h_kv, group·g, d]` and masked scores `[b, h_kv, group·g, n]`
    (float32; hidden = -inf). Rows are (head in group, slot); a key/value head serves its group without copies."""
    b, h, n, d = q.shape
    h_kv = k.shape[1]
    g = glob.index.shape[1]
    dtype = compute_dtype(q.dtype)
    q_g = q.gather(2, glob.index[:, None, :, None].expand(b, h, g, d)).to(dtype).reshape(b, h_kv, -1, d)
    scores = torch.matmul(q_g, k.to(dtype).transpose(-1, -2)) * band.scale  # [b, h_kv, group·g, n]
    group = h // h_kv
    visible = real[:, None, None, :] & glob.valid.repeat(1, group)[:, None, :, None]  # [b, 1, group·g, n]
    if band.causal:
        positions = glob.index.repeat(1, group)[:, None, :, None]
        visible = visible & (torch.arange(n, device=q.device) <= positions)
    return q_g, scores.masked_fill(~visible, -math.inf)


def _global_key_scores(q: Tensor, k: Tensor, flags: Tensor, glob: _Globals, band: _Band) -> tuple[Tensor, Tensor]:
    """The non-global queries over the global keys: k gathered `[b, h_kv, g, d]` and masked scores
    `[b, h_kv, group·n, g]` (float32; hidden = -inf). Rows are (head in group, position)."""
    b, h, n, d = q.shape
    h_kv = k.shape[1]
    g = glob.index.shape[1]
    dtype = compute_dtype(q.dtype)
    k_g = k.gather(2, glob.index[:, None, :, None].expand(b, h_kv, g, d)).to(dtype)
    scores = torch.matmul(q.to(dtype).reshape(b, h_kv, -1, d), k_g.transpose(-1, -2)) * band.scale
    real_global = glob.valid & (flags.gather(1, glob.index) & 1).bool()  # [b, g]
    visible = real_global[:, None, None, None, :] & ~(flags & 2).bool()[:, None, None, :, None]  # [b, 1, 1, n, g]
    if band.causal:
        visible = visible & (glob.index[:, None, None, None, :] <= torch.arange(n, device=q.device)[:, None])
    return k_g, scores.view(b, h_kv, h // h_kv, n, g).masked_fill(~visible, -math.inf).view(b, h_kv, -1, g)


def _probs(scores: Tensor, lse: Tensor) -> Tensor:
    """exp(scores - lse) with hidden (-inf) scores and rows without a key (lse = -inf) at exactly 0."""
    return (scores - torch.where(torch.isfinite(lse), lse, 0.0)[..., None]).exp()


def _strides(*tensors: Tensor) -> list[int]:
    return [stride for t in tensors for stride in t.stride()]


def _forward(q, k, v, flags, dilation, glob, band) -> tuple[Tensor, Tensor]:
    """Output `[b, h, n, d_v]` (q's dtype) and the merged log-sum-exp `[b, h, n]` (float32)."""
    b, h, n, d = q.shape
    h_kv, d_v = k.shape[1], v.shape[3]
    out = torch.empty(b, h, n, d_v, dtype=q.dtype, device=q.device)
    lse = torch.empty(b, h, n, dtype=torch.float32, device=q.device)
    g = 0 if glob is None else glob.index.shape[1]
    grid = (band.programs(n, band.block_m), b * h)
    _band_forward_kernel[grid](
        q, k, v, out, lse,
        dilation if flags is None else flags,
        dilation if glob is None else glob.kernel_index,
        dilation,
        *_strides(q, k, v),
        n, h, h // h_kv, g, band.scale,
        CAUSAL=band.causal, HAS_FLAGS=flags is not None, HAS_GLOBAL=glob is not None,
        **band.constants(d, d_v, q.dtype),
    )  # fmt: skip
    if glob is not None:
        q_g, scores = _global_row_scores(q, k, (flags & 1).bool(), glob, band)
        row_lse = scores.logsumexp(dim=-1)  # [b, h_kv, group·g]
        row_out = torch.matmul(_probs(scores, row_lse), v.to(scores.dtype))  # [b, h_kv, group·g, d_v]
        rows, slots, positions = glob.row_batch, glob.row_slot, glob.row_pos
        out[rows, :, positions] = row_out.reshape(b, h, g, d_v)[rows, :, slots].to(out.dtype)
        lse[rows, :, positions] = row_lse.reshape(b, h, g)[rows, :, slots].float()
    return out, lse


def _backward(grad_out, q, k, v, out, lse, flags, dilation, glob, band) -> tuple[Tensor, Tensor, Tensor]:
    """dQ, dK, dV from the merged output and log-sum-exp: the band kernels, then the global parts in PyTorch."""
    b, h, n, d = q.shape
    h_kv, d_v = k.shape[1], v.shape[3]
    group = h // h_kv
    delta = (grad_out.float() * out.float()).sum(dim=-1)  # [b, h, n]: rowsum(dO ∘ O), the softmax's correction
    # Per query head, in float32 when a group's heads or the global parts are summed into them afterwards.
    acc = compute_dtype(q.dtype) if group > 1 or glob is not None else None
    grad_q = torch.empty(b, h, n, d, dtype=acc or q.dtype, device=q.device)
    grad_k = torch.empty(b, h, n, d, dtype=acc or k.dtype, device=q.device)
    grad_v = torch.empty(b, h, n, d_v, dtype=acc or v.dtype, device=q.device)
    shared = (
        *_strides(q, k, v, grad_out),
        n, h, group, band.scale,
    )  # fmt: skip
    constants = dict(HAS_FLAGS=flags is not None, **band.constants(d, d_v, q.dtype))
    band_flags = dilation if flags is None else flags
    _band_backward_kv_kernel[(band.programs(n, band.block_n), b * h)](
        q, k, v, grad_out, lse, delta, band_flags, dilation, grad_k, grad_v, *shared, **constants
    )
    _band_backward_q_kernel[(band.programs(n, band.block_m), b * h)](
        q, k, v, grad_out, lse, delta, band_flags, dilation, grad_q, *shared, **constants
    )
    if group > 1:  # [b, h_kv, group, n, ·] summed over each key/value head's group
        grad_k = grad_k.view(b, h_kv, group, n, d).sum(dim=2)
        grad_v = grad_v.view(b, h_kv, group, n, d_v).sum(dim=2)
    if glob is not None:
        _global_backward(grad_out, q, k, v, lse, delta, flags, glob, band, grad_q, grad_k, grad_v)
    return grad_q.to(q.dtype), grad_k.to(k.dtype), grad_v.to(v.dtype)


def _global_backward(grad_out, q, k, v, lse, delta, flags, glob, band, grad_q, grad_k, grad_v) -> None:
    """Add the global parts' gradients (probabilities from the merged lse) into float32 grad_q, grad_k, grad_v."""
    b, h, n, d = q.shape
    h_kv, d_v = k.shape[1], v.shape[3]
    g = glob.index.shape[1]
    dtype = grad_q.dtype
    grad = grad_out.to(dtype)

    # Global keys, seen by every non-global query: rows (head in group, position) of each key/value head.
    k_g, scores = _global_key_scores(q, k, flags, glob, band)  # [b, h_kv, g, d], [b, h_kv, group·n, g]
    probs = _probs(scores, lse.reshape(b, h_kv, -1))
    grad_rows = grad.reshape(b, h_kv, -1, d_v)
    v_g = v.gather(2, glob.index[:, None, :, None].expand(b, h_kv, g, d_v)).to(dtype)
    grad_scores = probs * (torch.matmul(grad_rows, v_g.transpose(-1, -2)) - delta.reshape(b, h_kv, -1, 1))
    grad_scores = grad_scores * band.scale
    grad_q += torch.matmul(grad_scores, k_g).view(b, h, n, d)
    key_index = glob.index[:, None, :, None]  # invalid slots point at 0 and add 0: their probabilities are 0
    grad_k.scatter_add_(
        2,
        key_index.expand(b, h_kv, g, d),
        torch.matmul(grad_scores.transpose(-1, -2), q.to(dtype).reshape(b, h_kv, -1, d)),
    )
    grad_v.scatter_add_(2, key_index.expand(b, h_kv, g, d_v), torch.matmul(probs.transpose(-1, -2), grad_rows))

    # Global queries, seeing every key: rows (head in group, slot).
    q_g, scores = _global_row_scores(q, k, (flags & 1).bool(), glob, band)  # [b, h_kv, group·g, ·]
    gather_rows = glob.index[:, None, :, None]
    row_lse = lse.gather(2, glob.index[:, None, :].expand(b, h, g)).reshape(b, h_kv, -1)
    row_delta = delta.gather(2, glob.index[:, None, :].expand(b, h, g)).reshape(b, h_kv, -1, 1)
    row_grad = grad.gather(2, gather_rows.expand(b, h, g, d_v)).reshape(b, h_kv, -1, d_v)
    probs = _probs(scores, row_lse)  # [b, h_kv, group·g, n]; invalid slots are hidden rows: 0
    grad_scores = probs * (torch.matmul(row_grad, v.to(dtype).transpose(-1, -2)) - row_delta) * band.scale
    grad_v += torch.matmul(probs.transpose(-1, -2), row_grad)
    grad_k += torch.matmul(grad_scores.transpose(-1, -2), q_g)
    row_grad_q = torch.matmul(grad_scores, k.to(dtype)).reshape(b, h, g, d)
    rows, slots, positions = glob.row_batch, glob.row_slot, glob.row_pos
    # Through a [b, n, h, d] view: index_put_ takes index tensors only; it writes into grad_q.
    grad_q.transpose(1, 2).index_put_((rows, positions), row_grad_q.transpose(1, 2)[rows, slots], accumulate=True)


class _TritonBandAttention(torch.autograd.Function):
    """The band kernels and the global parts, forward and backward, around one saved (output, merged lse)."""

    @staticmethod
    def forward(ctx, q, k, v, flags, dilation, glob, band):
        out, lse = _forward(q, k, v, flags, dilation, glob, band)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.flags, ctx.dilation, ctx.glob, ctx.band = flags, dilation, glob, band
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        grads = _backward(grad_out, q, k, v, out, lse, ctx.flags, ctx.dilation, ctx.glob, ctx.band)
        return (*grads, None, None, None, None)


def triton_sliding_window_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    window: int,
    dilation: int | Sequence[int] = 1,
    causal: bool = False,
    global_mask: Tensor | None = None,
    key_padding_mask: Tensor | None = None,
    scale: float,
    block_m: int = BLOCK_M,
    block_n: int = BLOCK_N,
) -> Tensor:
    """`patterns.sliding_window_pattern` on the Triton kernels, with autograd.

    The arguments are checked by `longattn.ops.sliding_window_attention`, and the dispatcher
    (`backends.TritonBackend`) admits only what this runs: n_q = n_k, float16 / bfloat16 / float32, no dropout.

    Args:
        q: Queries `[b, h, n, d]`.
        k: Keys `[b, h_kv, n, d]`, h_kv dividing h (read in place by each group of h / h_kv query heads).
        v: Values `[b, h_kv, n, d_v]`.
        window: Keys on each side of a query (causal: before it).
        dilation: Gap between attended keys, or one per query head.
        causal: Keys after the query are hidden (global tokens included).
        global_mask: Bool `[b, n]`, True = global token; None = none.
        key_padding_mask: Bool `[b, n]`, True = real token; None = no padding.
        scale: Multiplier of q·k.
        block_m: Query steps per program (a power of two >= 16).
        block_n: Key steps per tile (a power of two >= 16).

    Returns:
        Output `[b, h, n, d_v]`; a query that sees no key gets zeros.
    """
    if triton is None:
        raise ImportError("the triton back end needs triton: pip install 'longattn[triton]'")
    b, h, n, _ = q.shape
    dilations = (dilation,) * h if isinstance(dilation, int) else tuple(dilation)
    band = _Band(window=window, causal=causal, scale=scale, dilations=dilations, block_m=block_m, block_n=block_n)
    glob = None
    if global_mask is not None and bool(global_mask.any()):
        glob = _Globals(global_mask)
    flags = None  # int8 [b, n]: bit 0 = real token, bit 1 = global token
    if key_padding_mask is not None or glob is not None:
        real = torch.ones(b, n, dtype=torch.bool, device=q.device) if key_padding_mask is None else key_padding_mask
        is_global = global_mask if glob is not None else torch.zeros_like(real)
        flags = (real.to(torch.int8) | (is_global.to(torch.int8) << 1)).contiguous()
    dilation_t = torch.tensor(dilations, dtype=torch.int32, device=q.device)
    return _TritonBandAttention.apply(q, k, v, flags, dilation_t, glob, band)
