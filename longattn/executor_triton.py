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

from collections.abc import Sequence

import torch
from torch import Tensor

from .executor_band import global_token_index
from .numerics import compute_dtype, hide_exactly

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
# Tensors reach the kernels with their four strides as one tuple (`[b, h, n, width]`), read by `_rows_of`.
@_jit
def _program(DILATION, n, heads, group, BLOCK: tl.constexpr):
    """This program's (batch, head) index bh, batch row b, query head h, key/value head, class c, dilation r, first
    step and the class's number of steps (c >= r or a first step past them: a spare program)."""
    bh = tl.program_id(1)
    h = bh % heads
    r = tl.load(DILATION + h)
    blocks_per_class = tl.cdiv(tl.cdiv(n, r), BLOCK)
    c = tl.program_id(0) // blocks_per_class
    start = (tl.program_id(0) % blocks_per_class) * BLOCK
    steps = tl.cdiv(tl.maximum(n - c, 0), r)
    return bh, bh // heads, h, h // group, c, r, start, steps


@_jit
def _class_tile(c, r, start, limit, BLOCK: tl.constexpr):
    """Steps start .. start + BLOCK - 1 of class c under dilation r: the steps, which lie before `limit`, and their
    positions c + r · step."""
    offs = start + tl.arange(0, BLOCK)
    return offs, offs < limit, c + r * offs


@_jit
def _rows_of(PTR, strides, b, head, pos, valid, WIDTH: tl.constexpr, BLOCK_W: tl.constexpr):
    """Rows `pos` of head `head` of batch row b of a `[b, h, n, WIDTH]` tensor: `[len(pos), BLOCK_W]`, 0 in the rows
    that are not `valid` and in the columns past WIDTH."""
    offs = tl.arange(0, BLOCK_W)
    return tl.load(
        PTR + b * strides[0] + head * strides[1] + pos[:, None] * strides[2] + offs[None, :] * strides[3],
        mask=valid[:, None] & (offs[None, :] < WIDTH),
        other=0.0,
    )


@_jit
def _store_rows(PTR, bh, n, pos, valid, value, WIDTH: tl.constexpr, BLOCK_W: tl.constexpr):
    """Write `value` `[len(pos), BLOCK_W]` to rows `pos` of (batch, head) bh of a contiguous `[b·h, n, WIDTH]`
    output, in its dtype: the `valid` rows, the columns before WIDTH."""
    offs = tl.arange(0, BLOCK_W)
    tl.store(
        PTR + bh * n * WIDTH + pos[:, None] * WIDTH + offs[None, :],
        value.to(PTR.dtype.element_ty),
        mask=valid[:, None] & (offs[None, :] < WIDTH),
    )


@_jit
def _band_queries(FLAGS, b, n, pos, rows, HAS_FLAGS: tl.constexpr):
    """`rows` without the global queries (the global pass owns them)."""
    if HAS_FLAGS:
        rows = rows & ((tl.load(FLAGS + b * n + pos, mask=rows, other=0) & 2) == 0)
    return rows


@_jit
def _band_key_flags(FLAGS, b, n, pos, cols, HAS_FLAGS: tl.constexpr):
    """`cols` without the padding keys and the global keys (those the global part walks)."""
    if HAS_FLAGS:
        cols = cols & (tl.load(FLAGS + b * n + pos, mask=cols, other=0) == 1)
    return cols


@_jit
def _in_band(offs_m, offs_n, rows, cols, WINDOW: tl.constexpr, WINDOW_RIGHT: tl.constexpr):
    """Which (query step, key step) pairs of the tile the band shows: `[len(offs_m), len(offs_n)]`."""
    step = offs_m[:, None] - offs_n[None, :]
    return rows[:, None] & cols[None, :] & (step <= WINDOW) & (step >= -WINDOW_RIGHT)


@_jit
def _band_keys(
    K, V, FLAGS, k_strides, v_strides, b, kv_h, n, c, r, start_n, hi, offs_m, rows,
    D: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    WINDOW: tl.constexpr, WINDOW_RIGHT: tl.constexpr, HAS_FLAGS: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """The key tile at class step start_n (steps before hi) of the band of query steps `offs_m`: k, v and which
    (query, key) pairs are visible."""
    offs_n, cols, pos_n = _class_tile(c, r, start_n, hi, BLOCK_N)
    k = _rows_of(K, k_strides, b, kv_h, pos_n, cols, D, BLOCK_D)
    v = _rows_of(V, v_strides, b, kv_h, pos_n, cols, DV, BLOCK_DV)
    cols = _band_key_flags(FLAGS, b, n, pos_n, cols, HAS_FLAGS)
    return k, v, _in_band(offs_m, offs_n, rows, cols, WINDOW, WINDOW_RIGHT)


@_jit
def _query_rows(
    Q, DO, LSE, DELTA, FLAGS, q_strides, o_strides, b, h, bh, n, pos, valid,
    D: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, HAS_FLAGS: tl.constexpr,
):  # fmt: skip
    """What the backward reads of query rows `pos`: q, dO, the merged lse in base 2 (0 for a row without a key),
    delta, and which rows are the band's."""
    q = _rows_of(Q, q_strides, b, h, pos, valid, D, BLOCK_D)
    do = _rows_of(DO, o_strides, b, h, pos, valid, DV, BLOCK_DV)
    lse = tl.load(LSE + bh * n + pos, mask=valid, other=0.0)
    lse2 = tl.where(lse == float("-inf"), 0.0, lse * 1.4426950408889634)
    delta = tl.load(DELTA + bh * n + pos, mask=valid, other=0.0)
    return q, do, lse2, delta, _band_queries(FLAGS, b, n, pos, valid, HAS_FLAGS)


@_jit
def _band_forward_kernel(
    Q, K, V, OUT, LSE, FLAGS, GLOBAL_INDEX, DILATION, q_strides, k_strides, v_strides, n, heads, group, g, scale,
    D: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    WINDOW: tl.constexpr, WINDOW_RIGHT: tl.constexpr, CAUSAL: tl.constexpr,
    HAS_FLAGS: tl.constexpr, HAS_GLOBAL: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """Output and log-sum-exp of BLOCK_M query steps of one class: their band, then the global keys."""
    bh, b, h, kv_h, c, r, start_m, steps = _program(DILATION, n, heads, group, BLOCK_M)
    if (c >= r) | (start_m >= steps):
        return
    offs_m, in_class, pos_m = _class_tile(c, r, start_m, steps, BLOCK_M)
    q = _rows_of(Q, q_strides, b, h, pos_m, in_class, D, BLOCK_D)
    rows = _band_queries(FLAGS, b, n, pos_m, in_class, HAS_FLAGS)
    qk_scale = scale * 1.4426950408889634
    lo, hi = _band_span(start_m, steps, WINDOW, BLOCK_M + WINDOW_RIGHT)
    m_i, l_i, acc = _softmax_start(BLOCK_M, BLOCK_DV)
    for start_n in range(lo, hi, BLOCK_N):
        k, v, visible = _band_keys(
            K, V, FLAGS, k_strides, v_strides, b, kv_h, n, c, r, start_n, hi, offs_m, rows,
            D, DV, BLOCK_D, BLOCK_DV, WINDOW, WINDOW_RIGHT, HAS_FLAGS, BLOCK_N,
        )  # fmt: skip
        acc, m_i, l_i = _softmax_step(q, k, v, visible, acc, m_i, l_i, qk_scale, PRECISION)
    if HAS_GLOBAL:
        for start_g in range(0, g, BLOCK_N):
            offs_g = start_g + tl.arange(0, BLOCK_N)
            pos_g = tl.load(GLOBAL_INDEX + b * g + offs_g, mask=offs_g < g, other=-1)
            cols = pos_g >= 0
            safe_g = tl.where(cols, pos_g, 0)
            cols = cols & ((tl.load(FLAGS + b * n + safe_g, mask=cols, other=0) & 1) == 1)
            k = _rows_of(K, k_strides, b, kv_h, safe_g, cols, D, BLOCK_D)
            v = _rows_of(V, v_strides, b, kv_h, safe_g, cols, DV, BLOCK_DV)
            visible = rows[:, None] & cols[None, :]
            if CAUSAL:
                visible = visible & (safe_g[None, :] <= pos_m[:, None])
            acc, m_i, l_i = _softmax_step(q, k, v, visible, acc, m_i, l_i, qk_scale, PRECISION)
    has_key = l_i > 0  # a row without a visible key: output 0, lse -inf
    l_safe = tl.where(has_key, l_i, 1.0)
    lse = tl.where(has_key, (m_i + tl.log2(l_safe)) * 0.6931471805599453, float("-inf"))
    _store_rows(OUT, bh, n, pos_m, in_class, acc / l_safe[:, None], DV, BLOCK_DV)
    tl.store(LSE + bh * n + pos_m, lse, mask=in_class)


@_jit
def _band_span(start, steps, BEFORE: tl.constexpr, AFTER: tl.constexpr):
    """The other side's steps [lo, hi) that a block starting at step `start` meets in the band: from BEFORE steps
    before it to AFTER steps past its start (the block's length included), within the class's `steps`."""
    return tl.maximum(start - BEFORE, 0), tl.minimum(start + AFTER, steps)


@_jit
def _softmax_start(BLOCK_M: tl.constexpr, BLOCK_DV: tl.constexpr):
    """The empty running softmax of BLOCK_M rows: maximum -inf, sum 0, accumulator `[BLOCK_M, BLOCK_DV]` 0."""
    return (
        tl.full([BLOCK_M], float("-inf"), tl.float32),
        tl.zeros([BLOCK_M], tl.float32),
        tl.zeros([BLOCK_M, BLOCK_DV], tl.float32),
    )


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
def _score_grads(q, k, v, do, lse2, delta, visible, qk_scale, PRECISION: tl.constexpr):
    """Of a tile: the probabilities P = exp(S - merged lse) (base 2, 0 where hidden) and the score gradients
    dS = P ∘ (dO · Vᵀ - delta)."""
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
    p = tl.where(visible, tl.exp2(s - lse2[:, None]), 0.0)
    dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
    return p, p * (dp - delta[:, None])


@_jit
def _band_backward_kernel(
    Q, K, V, DO, LSE, DELTA, FLAGS, DILATION, GRAD_A, GRAD_B, q_strides, k_strides, v_strides, o_strides,
    n, heads, group, scale,
    D: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    WINDOW: tl.constexpr, WINDOW_RIGHT: tl.constexpr,
    HAS_FLAGS: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, KEYS: tl.constexpr,
):  # fmt: skip
    """KEYS: dK (into GRAD_A) and dV (GRAD_B) of BLOCK_N key steps of one class for one query head, from the band's
    queries that see them. Otherwise dQ (GRAD_A) of BLOCK_M query steps of one class, from the band's keys (the
    global keys' share is added in PyTorch)."""
    BLOCK: tl.constexpr = BLOCK_N if KEYS else BLOCK_M
    bh, b, h, kv_h, c, r, start, steps = _program(DILATION, n, heads, group, BLOCK)
    if (c >= r) | (start >= steps):
        return
    offs, in_class, pos = _class_tile(c, r, start, steps, BLOCK)
    qk_scale = scale * 1.4426950408889634
    if KEYS:  # walk the query tiles whose band reaches these keys
        k = _rows_of(K, k_strides, b, kv_h, pos, in_class, D, BLOCK_D)
        v = _rows_of(V, v_strides, b, kv_h, pos, in_class, DV, BLOCK_DV)
        cols = _band_key_flags(FLAGS, b, n, pos, in_class, HAS_FLAGS)
        dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
        dv = tl.zeros([BLOCK_N, BLOCK_DV], tl.float32)
        lo, hi = _band_span(start, steps, WINDOW_RIGHT, BLOCK_N + WINDOW)
        for start_m in range(lo, hi, BLOCK_M):
            offs_m, valid, pos_m = _class_tile(c, r, start_m, hi, BLOCK_M)
            q, do, lse2, delta, rows = _query_rows(
                Q, DO, LSE, DELTA, FLAGS, q_strides, o_strides, b, h, bh, n, pos_m, valid,
                D, DV, BLOCK_D, BLOCK_DV, HAS_FLAGS,
            )  # fmt: skip
            visible = _in_band(offs_m, offs, rows, cols, WINDOW, WINDOW_RIGHT)
            p, ds = _score_grads(q, k, v, do, lse2, delta, visible, qk_scale, PRECISION)  # [BLOCK_M, BLOCK_N]
            dv += tl.dot(tl.trans(p.to(do.dtype)), do, input_precision=PRECISION)
            dk += tl.dot(tl.trans(ds.to(q.dtype)), q, input_precision=PRECISION)
        _store_rows(GRAD_A, bh, n, pos, in_class, dk * scale, D, BLOCK_D)
        _store_rows(GRAD_B, bh, n, pos, in_class, dv, DV, BLOCK_DV)
    else:  # walk the key tiles of these queries' band
        q, do, lse2, delta, rows = _query_rows(
            Q, DO, LSE, DELTA, FLAGS, q_strides, o_strides, b, h, bh, n, pos, in_class,
            D, DV, BLOCK_D, BLOCK_DV, HAS_FLAGS,
        )  # fmt: skip
        dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        lo, hi = _band_span(start, steps, WINDOW, BLOCK_M + WINDOW_RIGHT)
        for start_n in range(lo, hi, BLOCK_N):
            k, v, visible = _band_keys(
                K, V, FLAGS, k_strides, v_strides, b, kv_h, n, c, r, start_n, hi, offs, rows,
                D, DV, BLOCK_D, BLOCK_DV, WINDOW, WINDOW_RIGHT, HAS_FLAGS, BLOCK_N,
            )  # fmt: skip
            p, ds = _score_grads(q, k, v, do, lse2, delta, visible, qk_scale, PRECISION)
            dq += tl.dot(ds.to(k.dtype), k, input_precision=PRECISION)
        _store_rows(GRAD_A, bh, n, pos, in_class, dq * scale, D, BLOCK_D)


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
    return q_g, hide_exactly(scores, ~visible)


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
    return k_g, hide_exactly(scores.view(b, h_kv, h // h_kv, n, g), ~visible).view(b, h_kv, -1, g)


def _probs(scores: Tensor, lse: Tensor) -> Tensor:
    """exp(scores - lse) with hidden (-inf) scores and rows without a key (lse = -inf) at exactly 0."""
    return (scores - torch.where(torch.isfinite(lse), lse, 0.0)[..., None]).exp()


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
        q.stride(), k.stride(), v.stride(),
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
    inputs = (q, k, v, grad_out, lse, delta, dilation if flags is None else flags, dilation)
    shared = (q.stride(), k.stride(), v.stride(), grad_out.stride(), n, h, group, band.scale)
    constants = dict(HAS_FLAGS=flags is not None, **band.constants(d, d_v, q.dtype))
    _band_backward_kernel[(band.programs(n, band.block_n), b * h)](
        *inputs, grad_k, grad_v, *shared, KEYS=True, **constants
    )
    _band_backward_kernel[(band.programs(n, band.block_m), b * h)](
        *inputs, grad_q, grad_q, *shared, KEYS=False, **constants
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
    q: Tensor, k: Tensor, v: Tensor, *, window: int, dilation: int | Sequence[int] = 1, causal: bool = False,
    global_mask: Tensor | None = None, key_padding_mask: Tensor | None = None, scale: float,
    block_m: int = BLOCK_M, block_n: int = BLOCK_N,
) -> Tensor:  # fmt: skip
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
        raise ImportError("the triton back end needs triton: pip install triton")
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
