"""Adaptive attention span (Sukhbaatar et al. 2019, "Adaptive Attention Span in Transformers"): `"adaptive_span"`.

Shape legend: b batch, h heads, n query length, m key length, d head dim, nb query blocks, c queries per block,
w keys gathered per block (c + reach on each allowed side), S `adaptive_span_max`, R `adaptive_span_ramp`.

Each head learns how far it looks. Its span z ∈ [0, S] enters through the soft mask over the distance x between
query and key,

    m_z(x) = clamp((R + z - x) / R, 0, 1),      a_ij = m_z(x_ij) exp(s_ij) / Σ_j' m_z(x_ij') exp(s_ij'),

with s the scaled dot products, keys at distance x <= S only, and the L1 penalty (λ / M) Σ_i z_i over the M heads of
a layer added to the model's loss (λ = `adaptive_span_loss_coef`). In a decoder x = i - j over earlier keys (the
paper's setting); in an encoder x = |i - j| on both sides.

A key at distance x >= R + z has weight 0, so only keys within the current largest span, reach = min(S, max_i z_i + R),
are computed: a banded executor (`adaptive_span_attention`) gathers, for each block of c queries, the c + reach
(causal) or c + 2·reach keys around it, costing O(n · (c + reach)) instead of O(n²). The reach is read back to the
host once per call (one device sync), as the paper's implementation trims its memory: it is a shape. Under
`torch.compile` or `torch.export` the band is S wide instead (a value read back would break the graph).

z is stored as the fraction `span_fraction` = z / S (initialised at 0 as in the paper's code, so spans grow from R):
a step of the optimiser then moves z by a fraction of S whatever S is. The paper clamps the parameter into [0, 1]
after each optimiser step; here the forward pass clamps it with a straight-through gradient instead, so a fraction
pushed outside [0, 1] still gets the task's gradient and can come back, and the penalty acts on max(fraction, 0).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor, nn
from transformers import initialization as init

from .attention_base import LongAttnAttention
from .numerics import NO_KEY_LSE, compute_dtype, default_scale, hide_exactly, zero_empty_shift
from .ops_checks import (
    check_dropout,
    check_flag,
    check_positive_int,
    check_scale,
    check_token_mask,
    empty_attention,
    is_empty,
)

# Queries per block of the banded executor: a block gathers c + reach (causal) or c + 2·reach keys, so larger blocks
# waste fewer gathered keys per query but compute more masked-out scores at the band's edges; 64 balances both for
# spans of a few hundred tokens.
_BLOCK_SIZE = 64


def soft_span_mask(distance: Tensor, span: Tensor, ramp: int) -> Tensor:
    """The paper's soft mask m_z(x) = clamp((R + z - x) / R, 0, 1).

    Args:
        distance: Distances x (any shape, broadcastable against `span`), >= 0.
        span: Spans z in tokens, e.g. `[h, 1, 1]` for one per head.
        ramp: Softness R of the ramp (>= 1).

    Returns:
        The mask values in [0, 1], broadcast shape of `distance` and `span`.
    """
    return ((ramp + span - distance) / ramp).clamp(0.0, 1.0)


def _support_and_softmax(scores: Tensor, soft: Tensor, visible: Tensor) -> Tensor:
    """Weights m · exp(s) / Σ m · exp(s) over the last dim, zero where not visible or m = 0; rows without any such
    key are all zeros (never NaN).

    The exponent is shifted by the row maximum over keys that can carry weight (m > 0): a larger score on a key the
    mask removes could otherwise make every kept key underflow.
    """
    support = visible & (soft > 0)
    masked = hide_exactly(scores, ~support)
    shift = masked.detach().amax(dim=-1, keepdim=True)
    shift = zero_empty_shift(shift)
    weighted = torch.exp(masked - shift) * soft  # 0 off the support
    total = weighted.sum(dim=-1, keepdim=True)
    return weighted / torch.where(total > 0, total, torch.ones_like(total))


def adaptive_span_attention(
    q: Tensor, k: Tensor, v: Tensor, *, span: Tensor, max_span: int, ramp: int, causal: bool,
    key_padding_mask: Tensor | None = None, scale: float | None = None, dropout_p: float = 0.0,
    block_size: int = _BLOCK_SIZE, dense: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:  # fmt: skip
    """Soft-masked attention over the keys within each head's span, banded: O(n · (c + reach)) time and memory.

    Blocks of c consecutive queries attend to their band of keys, a slice of the keys (clipped at the sequence's
    ends); the distance of query slot i to window key j is the same in every block (i + reach - j), so the soft mask
    is one `[h, c, w]` table, added to the scores as log m. A hand-written backward (`_SoftBandAttention`)
    recomputes the weights block by block, so no `[n, w]` tensor is kept; gradients reach q, k, v and the spans.
    With attention dropout the plain autograd path (over gathered copies of the windows) runs instead.

    Args:
        q: Queries `[b, h, n, d]`, the last n of the m key positions (n < m in cached decoding).
        k: Keys `[b, h, m, d]`.
        v: Values `[b, h, m, d_v]`.
        span: Spans z in tokens `[h]` (in [0, max_span]).
        max_span: S: keys farther than S are never seen.
        ramp: R, the length of the soft ramp.
        causal: Only earlier keys (and the query itself); else both sides.
        key_padding_mask: Bool `[b, m]`, True = real token.
        scale: Multiplier of q·k; default 1/sqrt(d).
        dropout_p: Dropout on the attention weights.
        block_size: Queries per block c.
        dense: Compute over all m keys with an explicit `[b, h, n, m]` soft mask instead, O(n · m), and return the
            weights too (`adaptive_span_reference`).

    Returns:
        `[b, h, n, d_v]`; a query that sees no key (a fully padded row) gets zeros; empty for batch or length 0.
        With `dense`: `(out, weights [b, h, n, m])`.

    Raises:
        ValueError: Naming the argument: a `key_padding_mask` that is not a bool `[b, m]` tensor on q's device, a
            `span` that is not a floating `[h]` tensor on q's device or holds NaN / inf, `max_span` below 0, `ramp`
            or `block_size` below 1, a non-bool `causal` or `dense`, `dropout_p` outside [0, 1), a non-finite
            `scale`.
    """
    b, h, n_q, d = q.shape
    n_k = k.shape[2]
    _check_span_arguments(span, h, q.device, max_span=max_span, ramp=ramp, block_size=block_size)
    causal, dense = check_flag("causal", causal), check_flag("dense", dense)
    dropout_p = check_dropout(dropout_p)
    scale = check_scale(scale, d)
    key_padding_mask = check_token_mask("key_padding_mask", key_padding_mask, b, n_k, device=q.device)
    if is_empty(q, k):
        return (empty_attention(q, k, v), q.new_zeros(b, h, n_q, n_k)) if dense else empty_attention(q, k, v)
    scale = default_scale(d) if scale is None else scale
    dtype = compute_dtype(q.dtype)
    if dense:
        return _dense_span_attention(
            q, k, v, span.to(dtype), max_span, ramp, causal, key_padding_mask, scale, dropout_p
        )
    q_offset = n_k - n_q
    reach, may_be_empty = _span_reach(span, max_span, ramp, n_k, padded=key_padding_mask is not None)
    left, right = reach, 0 if causal else reach
    c = max(1, min(block_size, n_q))
    w = c + left + right

    # Query slot i of a block and key slot j of its window are i + left - j apart in every block, so the soft mask
    # is one [h, c, w] table (blocks at the sequence's ends use a slice of it).
    relative = torch.arange(c, device=q.device)[:, None] + left - torch.arange(w, device=q.device)[None, :]  # i - j
    in_band = (relative <= left) & (relative >= (0 if causal else -right))  # [c, w]
    soft = soft_span_mask(relative.abs().to(dtype), span.to(dtype).view(h, 1, 1), ramp) * in_band  # [h, c, w]
    if dropout_p > 0:
        return _dropout_band_attention(
            q, k, v, soft, in_band, key_padding_mask, q_offset, left, right, scale, dropout_p, dtype
        )
    hidden = None if key_padding_mask is None else ~key_padding_mask
    out = _SoftBandAttention.apply(
        q.to(dtype), k.to(dtype), v.to(dtype), soft, hidden, q_offset, left, scale, may_be_empty
    )  # [b, h, n, d_v]
    return out.to(q.dtype)


def _span_reach(span: Tensor, max_span: int, ramp: int, n_k: int, *, padded: bool) -> tuple[int, bool]:
    """The band's reach on each side (the farthest distance with a nonzero mask, x < R + z, within the `n_k` keys),
    and whether a query may see no key (`padded`: keys are padded).

    One host sync: the band width is a shape. A compiled graph cannot read a value back (it would break there), so
    it takes the largest span S: the same output, S's cost."""
    if torch.compiler.is_compiling():
        largest, may_be_empty = max_span, True
    else:
        low, high = torch.stack([span.detach().min(), span.detach().max()]).tolist()
        largest = int(math.floor(high)) + ramp
        # A query always sees its own key (distance 0, m = 1) unless a span is at most -R or keys are padded.
        may_be_empty = padded or low <= -ramp
    return max(0, min(max_span, largest, n_k - 1)), may_be_empty


def _dropout_band_attention(q, k, v, soft, in_band, key_padding_mask, q_offset, left, right, scale, dropout_p, dtype):
    """The band with attention dropout: plain autograd over gathered key windows (weights and windows kept)."""
    b, h, n_q, d = q.shape
    n_k, d_v = k.shape[2], v.shape[3]
    c, w = in_band.shape
    nb = -(-n_q // c)
    # Keys padded so that block t's window starts at index q_offset + t·c (key position q_offset + t·c - left).
    extra = q_offset + nb * c + right - n_k
    k_padded = nn.functional.pad(k.to(dtype), (0, 0, left, extra))[:, :, q_offset:]  # [b, h, nb·c + left + right, d]
    v_padded = nn.functional.pad(v.to(dtype), (0, 0, left, extra))[:, :, q_offset:]
    q_padded = q if nb * c == n_q else nn.functional.pad(q, (0, 0, 0, nb * c - n_q))  # [b, h, nb·c, d]
    key_real = torch.ones(b, n_k, dtype=torch.bool, device=q.device) if key_padding_mask is None else key_padding_mask
    key_real = nn.functional.pad(key_real, (left, extra), value=False)[:, q_offset:].unfold(1, w, c)  # [b, nb, w]
    key_real = key_real.transpose(0, 1)  # [nb, b, w]
    q_blocks = (q_padded.to(dtype) * scale).view(b, h, nb, c, d).permute(2, 0, 1, 3, 4)  # [nb, b, h, c, d]
    k_windows = _windows(k_padded, nb, c, w)  # [nb, b, h, w, d]
    scores = q_blocks @ k_windows.transpose(-1, -2)  # [nb, b, h, c, w]
    visible = key_real[:, :, None, None, :] & in_band  # [nb, b, 1, c, w]
    weights = _support_and_softmax(scores, soft, visible)
    out = nn.functional.dropout(weights, p=dropout_p) @ _windows(v_padded, nb, c, w)  # [nb, b, h, c, d_v]
    return out.permute(1, 2, 0, 3, 4).reshape(b, h, nb * c, d_v)[:, :, :n_q].to(q.dtype)


def _windows(padded: Tensor, blocks: int, c: int, w: int) -> Tensor:
    """Key windows of blocks 0..blocks-1 (w rows from row t·c each) of `padded` `[b, h, rows, d]`.

    Returns a contiguous copy `[blocks, b, h, w, d]`: a batched matmul over the overlapping strided views would fall
    back to a slow loop.
    """
    rows = padded[:, :, : (blocks - 1) * c + w]
    return rows.unfold(2, w, c).permute(2, 0, 1, 4, 3).contiguous()


def _band_blocks(n_q: int, n_k: int, c: int, w: int, q_offset: int, left: int):
    """`(r0, r1, lo, hi, j0)` per block of c queries: its query rows r0..r1, its window's keys lo..hi (the band of
    w keys from key q_offset + r0 - left, clipped to the sequence) and the table column j0 of key lo."""
    for r0 in range(0, n_q, c):
        first = q_offset + r0 - left  # the key at table column 0
        lo, hi = max(0, first), min(n_k, first + w)
        yield r0, min(n_q, r0 + c), lo, hi, lo - first


class _SoftBandAttention(torch.autograd.Function):
    """Soft-masked banded attention with a hand-written backward that recomputes the weights block by block.

    The soft mask enters as the additive table log m (-inf where m = 0 or outside the band): softmax(s + log m) =
    m ∘ exp(s) / Σ m ∘ exp(s), the paper's weights. Per batch row and block of c queries (all heads at once), the
    keys of its window are a slice of the rows (no gathered copy: the band is clipped at the sequence's ends, so
    nothing is padded), P = softmax(scale · Q Kᵀ + log m) and O = P V, written in place into the output. q, k, v
    are read in whatever strides they come in (the heads of a projection, `[b, n, h, d]` in memory, need no copy);
    the output is laid out `[b, n, h, d_v]` in memory, so merging its heads is a view, and the gradients take their
    inputs' layouts. Saved: q, k, v, the output and the table: nothing of size n · w.
    Backward, with G = dO Vᵀ - rowsum(dO ∘ O): dV = Pᵀ dO, dS = P ∘ G, dQ = scale · dS K, dK = scale · dSᵀ Q (window
    gradients added onto their overlapping key rows), and for the mask dm = (P / m) ∘ G = dS / m, summed over batch
    rows and blocks into the `[h, c, w]` table (its gradient reaches z).

    Shapes: q `[b, h, n, d]`, k `[b, h, m, d]`, v `[b, h, m, d_v]`, soft `[h, c, w]`, hidden (padded keys) bool
    `[b, m]` or None; out `[b, h, n, d_v]`.
    """

    @staticmethod
    def forward(ctx, q, k, v, soft, hidden, q_offset, left, scale, may_be_empty):
        b, h, n_q, _ = q.shape
        bias = soft.log()  # [h, c, w]: -inf off the support
        out = v.new_empty(b, n_q, h, v.shape[3]).transpose(1, 2)
        for row in range(b):
            for r0, r1, lo, hi, j0 in _band_blocks(n_q, k.shape[2], *soft.shape[1:], q_offset, left):
                probs = _block_probs(q, k, bias, hidden, row, scale, may_be_empty, r0, r1, lo, hi, j0)
                out[row, :, r0:r1] = torch.bmm(probs, v[row, :, lo:hi])  # (dynamo refuses strided `out=`)
        ctx.save_for_backward(q, k, v, soft, hidden, out)
        ctx.settings = q_offset, left, scale, may_be_empty
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, soft, hidden, out = ctx.saved_tensors
        q_offset, left, scale, may_be_empty = ctx.settings
        b, _, n_q, _ = q.shape
        bias = soft.log()
        grad_q = torch.empty_like(q)
        grad_k, grad_v = torch.zeros_like(k), torch.zeros_like(v)
        dsum = torch.zeros_like(soft) if ctx.needs_input_grad[3] else None  # Σ dS per table entry
        for row in range(b):
            for r0, r1, lo, hi, j0 in _band_blocks(n_q, k.shape[2], *soft.shape[1:], q_offset, left):
                probs = _block_probs(q, k, bias, hidden, row, scale, may_be_empty, r0, r1, lo, hi, j0)
                grad_out_c = grad_out[row, :, r0:r1]  # [h, c, d_v]
                grad_v[row, :, lo:hi].baddbmm_(probs.transpose(1, 2), grad_out_c)
                minus_delta = (grad_out_c * out[row, :, r0:r1]).sum(dim=-1, keepdim=True).neg_()  # -rowsum(dO ∘ O)
                grad_scores = torch.baddbmm(minus_delta, grad_out_c, v[row, :, lo:hi].transpose(1, 2)).mul_(probs)
                if dsum is not None:
                    dsum[:, : r1 - r0, j0 : j0 + hi - lo] += grad_scores
                grad_q[row, :, r0:r1] = torch.bmm(grad_scores, k[row, :, lo:hi])
                grad_k[row, :, lo:hi].baddbmm_(grad_scores.transpose(1, 2), q[row, :, r0:r1], alpha=scale)
        grad_soft = None
        if dsum is not None:  # dm = dS / m where m > 0; 0 off the support, as the weights do not depend on m there
            grad_soft = torch.where(soft > 0, dsum / soft, torch.zeros_like(soft))
        return grad_q.mul_(scale), grad_k, grad_v, grad_soft, *([None] * 5)


def _block_probs(q, k, bias, hidden, row, scale, may_be_empty, r0, r1, lo, hi, j0) -> Tensor:
    """The weights `[h, r1 - r0, hi - lo]` of batch row `row`'s queries r0..r1 over its keys lo..hi (table columns
    from j0)."""
    scores = torch.baddbmm(
        bias[:, : r1 - r0, j0 : j0 + hi - lo], q[row, :, r0:r1], k[row, :, lo:hi].transpose(1, 2), alpha=scale
    )
    if hidden is not None:
        hide_exactly(scores, hidden[row, lo:hi], inplace=True)
    probs = torch.softmax(scores, dim=-1)
    if may_be_empty:  # a row without any key: weights 0 (softmax of all -inf is NaN)
        probs.masked_fill_(scores.amax(dim=-1, keepdim=True) == NO_KEY_LSE, 0.0)
    return probs


def _check_span_arguments(span, heads: int, device: torch.device, *, max_span, ramp, block_size) -> None:
    """The span settings of `adaptive_span_attention`: ValueError naming the argument."""
    check_positive_int("max_span", max_span, minimum=0, meaning="keys farther than it are never seen")
    check_positive_int("ramp", ramp, meaning="the length of the soft ramp")
    check_positive_int("block_size", block_size, meaning="queries per block")
    if not isinstance(span, Tensor) or not span.is_floating_point() or tuple(span.shape) != (heads,):
        got = f"{span.dtype} {list(span.shape)}" if isinstance(span, Tensor) else repr(span)
        raise ValueError(f"span must be a floating tensor [h] = [{heads}] (one span per head, in tokens), got {got}")
    if span.device != device:
        raise ValueError(f"span must be on q's device ({device}), got {span.device}")
    if not torch.compiler.is_compiling() and not bool(torch.isfinite(span.detach()).all()):
        raise ValueError(f"span must be finite (NaN or inf found): {span.detach().tolist()}")


def adaptive_span_reference(q: Tensor, k: Tensor, v: Tensor, **settings: Any) -> tuple[Tensor, Tensor]:
    """The same attention over all m keys with an explicit `[b, h, n, m]` soft mask: O(n · m).

    For cached decoding (a few new queries), `output_attentions`, and as the reference of the banded executor.
    Takes the keyword arguments of `adaptive_span_attention` (`dense=True` there).

    Returns:
        `(out [b, h, n, d_v], weights [b, h, n, m])`.

    Raises:
        ValueError: A `key_padding_mask` that is not a bool `[b, m]` tensor on q's device.
    """
    return adaptive_span_attention(q, k, v, dense=True, **settings)


def _dense_span_attention(q, k, v, span, max_span, ramp, causal, key_padding_mask, scale, dropout_p):
    """`adaptive_span_reference` after the checks: the soft mask over all `[n, m]` pairs; span in compute dtype."""
    h, n_q, n_k = q.shape[1], q.shape[2], k.shape[2]
    dtype = span.dtype
    scores = (q.to(dtype) @ k.to(dtype).transpose(-1, -2)) * scale  # [b, h, n, m]
    relative = (n_k - n_q + torch.arange(n_q, device=q.device))[:, None] - torch.arange(n_k, device=q.device)[None]
    allowed = relative.abs() <= max_span
    if causal:
        allowed = allowed & (relative >= 0)
    soft = soft_span_mask(relative.abs().to(dtype), span.view(h, 1, 1), ramp) * allowed  # [h, n, m]
    visible = allowed[None, None] if key_padding_mask is None else allowed & key_padding_mask[:, None, None, :]
    weights = _support_and_softmax(scores, soft[None], visible)
    dropped = nn.functional.dropout(weights, p=dropout_p) if dropout_p > 0 else weights
    return (dropped @ v.to(dtype)).to(q.dtype), dropped.to(q.dtype)


class AdaptiveSpanAttention(LongAttnAttention):
    """The `"adaptive_span"` kind: each head learns its span z through a soft mask; an L1 penalty keeps spans short.

    Config fields:
        adaptive_span_max: S, the largest span (int, or one per layer), default 1024.
        adaptive_span_ramp: R, the length of the soft ramp (int), default 32.
        adaptive_span_loss_coef: λ of the penalty (λ / M) Σ_i z_i added to the model's loss, default 2e-6
            (the paper's value); 0 turns the penalty off.

    Parameter besides q/k/v/o_proj: `span_fraction` `[h]`, z / S per head.
    """

    attention_type = "adaptive_span"
    settings = (("max_span", "adaptive_span_max"), "ramp", "loss_coef")

    def __init__(self, config: Any, *, layer_idx: int, is_causal: bool):
        super().__init__(config, layer_idx=layer_idx, is_causal=is_causal)
        self.span_fraction = nn.Parameter(torch.zeros(self.num_heads))
        self.reset_kind_parameters()

    @torch.no_grad()
    def reset_kind_parameters(self) -> None:
        """Spans start at 0 (only the ramp's R keys are seen) and grow where the task needs them (the paper's code)."""
        init.zeros_(self.span_fraction)

    def spans(self) -> Tensor:
        """z per head in tokens `[h]`: S · clamp(fraction, 0, 1), with a straight-through gradient at the bounds."""
        fraction = self.span_fraction
        clamped = fraction + (fraction.clamp(0.0, 1.0) - fraction).detach()
        return clamped * self.max_span

    def auxiliary_loss(self) -> Tensor | None:
        """(λ / M) Σ_i z_i over this layer's M heads (z from max(fraction, 0), so it never pushes a span below 0)."""
        if self.loss_coef == 0:
            return None
        return self.loss_coef * self.max_span * self.span_fraction.clamp(min=0.0).mean()

    def _pattern(self) -> dict[str, Any]:
        """The settings the banded executor and the dense form share."""
        shared = self.layer_arguments("causal", "scale", "dropout_p")
        return dict(span=self.spans(), max_span=self.max_span, ramp=self.ramp, **shared)

    def attend(self, q, k, v, *, key_padding_mask, global_mask):
        return adaptive_span_attention(q, k, v, key_padding_mask=key_padding_mask, **self._pattern())

    def attend_dense(self, q, k, v, *, key_padding_mask, global_mask):
        """All m keys with the explicit soft mask (cached decoding, `output_attentions`): weights `[b, h, n, m]`."""
        return adaptive_span_reference(q, k, v, key_padding_mask=key_padding_mask, **self._pattern())
