"""The numerical rules every attention kind and executor shares; nothing else in the package defines them.

- `default_scale(d)`: the multiplier of q·k when none is given, 1/sqrt(d) (Vaswani et al. 2017).
- `compute_dtype(dtype)`: the dtype scores, softmax and log-sum-exp are computed in. Half-precision inputs (float16,
  bfloat16) are promoted to float32: their exp() and sums lose too much; float32 and float64 stay as they are, so the
  float64 reference tests compare in float64.
- Masked-logit constants, one per context, and the rule that picks each:

  - `HIDDEN_LOGIT` = -1e30: added to (or filled into) logits computed in float32 / float64. Finite, so a row whose
    keys are all hidden stays finite through softmax (it is zeroed afterwards), where -inf gives NaN; it dwarfs any
    real score, yet s - 1e30 cannot overflow float32.
  - `HALF_HIDDEN_PENALTY` = 1e4: the additive bias of a fused kernel that may run in float16 (xformers).
    Representable in float16 (max 65504), and exp(-1e4) is exactly 0 in float32; a row whose log-sum-exp is below
    -1e4 / 2 saw only hidden keys.
  - `LOG_SPACE_HIDDEN` = -1e9: log-space iterations (Sinkhorn normalisation). Large enough to vanish after exp(),
    small enough that repeated row / column log-sum-exp subtractions stay far from float32 overflow.
  - `hidden_logit(dtype)` = `finfo(dtype).min`: `masked_fill` of logits whose dtype is only known at run time; the
    most negative finite value of that dtype, never -inf.

  `hide_logits` is THE rule that picks the value a hidden logit takes, called wherever logits of hidden keys are
  hidden before a softmax over keys:

  - A hidden key must weigh exactly 0 beside any visible key, whatever the real logits hold (logits of -3e32 in
    float32, or 1e300 in float64, are real logits too). Adding the finite `HIDDEN_LOGIT` only does that while every
    real logit lies within `SAFE_LOGIT_BOUND` (1e29) of 0, so it is used only where the caller has proved that
    bound (`logit_bound`, Cauchy-Schwarz on q and k: cheap, O(n · d)); it is the fast path of the blocked
    executor's hot loop (an addition of the mask's bytes, several times faster than `masked_fill`).
  - Otherwise hidden keys get -inf (an exact 0 weight), and a row whose keys are ALL hidden gets the finite
    `hidden_logit(dtype)` in every entry instead, so that its softmax stays finite (no NaN in forward or backward).
  - Whether a row saw a key is never read off the values (a log-sum-exp below some threshold): it is decided from
    the mask (`sees_a_key`), and such a row's output is zero, its log-sum-exp -inf.

  The fused kernels' additive float biases (`HALF_HIDDEN_PENALTY`, the blocked band's `HIDDEN_LOGIT` bias) follow
  the same rule: they run only where the logits are bounded, and their rows without a key come from the mask.
- -inf, only through these names (a test scans the package for any other -inf; Triton kernels are its allow-list):

  - `EXACTLY_HIDDEN` and `hide_exactly(x, hidden)`: a log-space entry (logit, additive bias, log-weight, a score
    before a maximum or top-k) that must weigh exactly 0 and never be picked, in code that guards its rows without
    a visible entry itself: it shifts by the row maximum with `zero_empty_shift` and zeroes the rows whose sum is
    0, or tells them from the mask and zeroes them around `softmax` / `logsumexp`.
  - `zero_empty_shift(shift)`: the row maximum of such a row is -inf; shifted by 0 instead, exp(-inf - 0) = 0,
    where -inf - (-inf) is NaN.
  - `NO_KEY_LSE`: the log-sum-exp (log 0) and the running maximum of a row that sees no key, told apart by
    comparing with it; `merge_attention` drops such parts.
- `merge_attention`: exact log-sum-exp merge of partial attentions over disjoint key sets.
- `head_groups`: query heads grouped by their dilation, so each group runs as one batched call.
- `rotate_half`, `rotate`, `apply_rotary`, `rotary_inverse_frequencies`: rotary position embedding (Su et al. 2021,
  RoFormer), one implementation for the model and every executor.

This module imports only torch: configuration, executors and kinds all stand on it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = [
    "EXACTLY_HIDDEN",
    "HALF_HIDDEN_PENALTY",
    "HIDDEN_LOGIT",
    "LOG_SPACE_HIDDEN",
    "NO_KEY_LSE",
    "apply_rotary",
    "compute_dtype",
    "default_scale",
    "head_groups",
    "SAFE_LOGIT_BOUND",
    "hidden_logit",
    "hide_exactly",
    "hide_logits",
    "logit_bound",
    "sees_a_key",
    "merge_attention",
    "rotary_inverse_frequencies",
    "rotate",
    "rotate_half",
    "zero_empty_shift",
]

HIDDEN_LOGIT = -1e30
"""Added to (or filled into) the logits of hidden keys when logits are float32 / float64 (see the module table)."""

HALF_HIDDEN_PENALTY = 1e4
"""Score drop of a hidden key in a fused kernel's additive bias that may be float16 (see the module table)."""

LOG_SPACE_HIDDEN = -1e9
"""Log-space value of a forbidden entry during Sinkhorn's iterative normalisation (see the module table)."""

EXACTLY_HIDDEN = -math.inf
"""The value of a log-space entry that must weigh exactly 0 (exp() of it is 0) and never win a maximum or a top-k
over a real entry: -inf, safe only where the code guards the rows left without a finite entry (`hide_exactly`)."""

NO_KEY_LSE = -math.inf
"""The log-sum-exp (log of an empty sum) and the row maximum of a row that sees no key: -inf, the start of running
maxima and log-sum-exp merges. Safe because it is never shifted by itself: readers compare with it, shift by
`zero_empty_shift`, or zero such rows from the mask (`merge_attention` drops such parts)."""

_HALF_DTYPES = (torch.float16, torch.bfloat16)


def default_scale(head_dim: int) -> float:
    """1/sqrt(head_dim): the softmax temperature of scaled dot-product attention (Vaswani et al. 2017)."""
    return 1.0 / math.sqrt(head_dim)


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype in which scores, softmax and log-sum-exp are computed for inputs of `dtype` (halves -> float32)."""
    return torch.float32 if dtype in _HALF_DTYPES else dtype


def hidden_logit(dtype: torch.dtype) -> float:
    """The most negative finite value of `dtype`: a `masked_fill` value that never becomes -inf or NaN."""
    return torch.finfo(dtype).min


SAFE_LOGIT_BOUND = 1e29
"""Real logits no larger than this in magnitude let `hide_logits` add `HIDDEN_LOGIT` and stay exact: a hidden key
then sits at least 8e29 below every visible key, and exp() of that is exactly 0 in float32 and float64."""


def logit_bound(q: Tensor, k: Tensor, scale: float, bias: Tensor | None = None) -> float:
    """An upper bound of |scale · q·k + bias| over every pair: scale · max‖q_i‖ · max‖k_j‖ (Cauchy-Schwarz) plus
    max |bias|, in float64 so that the bound itself cannot overflow. inf (or NaN) when an input holds inf or NaN.

    O(n · d), read back to the host once per call: `hide_logits` takes the fast additive path only under
    `SAFE_LOGIT_BOUND`. The row norms are read in place (`_max_row_norm`), without a float64 copy of q and k.
    """
    if q.numel() == 0 or k.numel() == 0:
        return 0.0
    norms = [_max_row_norm(t.detach()) for t in (q, k)]
    bound = abs(scale) * norms[0] * norms[1]
    if bias is not None and bias.numel():
        bound += float(bias.detach().to(torch.float64).abs().amax())
    return bound


# Relative margin over a float32 norm: its sum of d squares is within d · 2**-24 of the exact one (sqrt halves that),
# so 2**-10 covers rows of up to ~16K elements with room to spare.
_FLOAT32_NORM_MARGIN = 1.0 + 2.0**-10


def _max_row_norm(t: Tensor) -> float:
    """max over rows of ‖t_i‖ (the last dim), never below the exact value (inf or NaN as the input holds them).

    float32 inputs are reduced in float32 where they lie (a float64 copy of q and k cost more than the norms: ~60 ms
    of a 16K-token strided step), then widened by `_FLOAT32_NORM_MARGIN`. When that norm is not finite (squares past
    float32's range) or tiny (squares near its underflow), the float64 reduction decides instead, as for every other
    dtype."""
    if t.dtype == torch.float32:
        norm = float(torch.linalg.vector_norm(t, dim=-1).amax())
        if 1e-15 <= norm < 1e15:
            return norm * _FLOAT32_NORM_MARGIN
    return float(torch.linalg.vector_norm(t.to(torch.float64), dim=-1).amax())


def sees_a_key(hidden: Tensor, dim: int = -1) -> Tensor:
    """Bool, True for the rows (along `dim`, kept as a size-1 dim) with at least one visible key: decided from the
    mask `hidden` (True = hidden), never from logit values."""
    return ~hidden.all(dim=dim, keepdim=True)


def hide_logits(
    scores: Tensor, hidden: Tensor, *, bound: float | None = None, dim: int = -1, inplace: bool = False
) -> Tensor:
    """Hide the logits of hidden keys before a softmax along `dim`: the one rule of the module table.

    Args:
        scores: Float logits `[..., m]` (any layout; the softmax runs along `dim`).
        hidden: Bool, broadcastable to scores, True where the key is hidden.
        bound: An upper bound of every real |logit| (`logit_bound`), or None when unknown. At most
            `SAFE_LOGIT_BOUND` (and float32 / float64 scores, where `HIDDEN_LOGIT` is finite): `HIDDEN_LOGIT` is
            added to the hidden entries (fast, and exact under that bound); rows without a visible key stay finite
            (about `HIDDEN_LOGIT`). Otherwise hidden entries become -inf and
            rows without a visible key `hidden_logit(dtype)` throughout (finite).
        dim: The softmax dim (the keys).
        inplace: Write into scores (a workspace) instead of a new tensor.

    Returns:
        The hidden logits: every hidden key weighs exactly 0 after a softmax beside any visible key, and every row
        stays finite. Rows without a visible key are the caller's to zero, found with `sees_a_key(hidden)`.
    """
    if bound is not None and bound <= SAFE_LOGIT_BOUND and scores.dtype in (torch.float32, torch.float64):
        # Bool bytes as uint8 (the same 0 / 1): ~3x faster than adding the bool tensor, ~10x than masked_fill_.
        flags = hidden.view(torch.uint8) if hidden.dtype == torch.bool else hidden
        return scores.add_(flags, alpha=HIDDEN_LOGIT) if inplace else scores.add(flags, alpha=HIDDEN_LOGIT)
    scores = hide_exactly(scores, hidden, inplace=inplace)
    return scores.masked_fill_(~sees_a_key(hidden, dim), hidden_logit(scores.dtype))


def hide_exactly(x: Tensor, hidden: Tensor, *, inplace: bool = False) -> Tensor:
    """`x` with `EXACTLY_HIDDEN` (-inf) where `hidden` (bool, broadcastable, True = hidden): `masked_fill`, or
    `masked_fill_` into x when `inplace`.

    For log-space entries (logits, a 0 / -inf additive bias, log-weights, scores before a maximum or top-k) that
    must weigh exactly 0 whatever the real values hold. -inf is safe here, unlike in `hide_logits`, only because the
    caller guards the rows whose entries are all hidden: it shifts exp() by the row maximum made finite with
    `zero_empty_shift` and zeroes rows whose sum is 0, or tells those rows from the mask and keeps them out of
    `softmax` / `logsumexp` (their log-sum-exp is `NO_KEY_LSE`). An unguarded softmax of such a row is NaN: use
    `hide_logits` there.
    """
    return x.masked_fill_(hidden, EXACTLY_HIDDEN) if inplace else x.masked_fill(hidden, EXACTLY_HIDDEN)


def zero_empty_shift(shift: Tensor, *, inplace: bool = False) -> Tensor:
    """The row maxima `shift` with -inf (a row without a finite entry, see `hide_exactly`) replaced by 0:
    `masked_fill`, or `masked_fill_` into shift when `inplace`.

    exp(x - shift) then stays exactly 0 on such a row (exp(-inf - 0) = 0) where -inf - (-inf) would be NaN, and the
    row's sum of 0 tells the caller it saw no entry. Finite maxima are kept, so the shift still guards exp() against
    overflow.
    """
    empty = shift == NO_KEY_LSE
    return shift.masked_fill_(empty, 0.0) if inplace else shift.masked_fill(empty, 0.0)


def merge_attention(partials: Sequence[tuple[Tensor, Tensor]]) -> tuple[Tensor, Tensor]:
    """Merge attentions of the same queries over disjoint key sets into the attention over their union.

    With partial outputs O_i and log-normalisers L_i, the union has L = log Σ exp(L_i) and O = Σ exp(L_i − L) O_i.
    Rows that see no key in any part stay zero with lse = -inf, and their gradients stay finite.

    Args:
        partials: `(out, lse)` pairs, out `[..., d_v]`, lse `[...]` (as returned by `attend_blocks`).

    Returns:
        `(out, lse)` of the union, out in the dtype of the first partial output.
    """
    if len(partials) == 1:
        return partials[0]
    lses = torch.stack([lse for _, lse in partials])  # [parts, ...]
    # The shift only guards exp() against overflow and cancels exactly, so it carries no gradient.
    shift = lses.detach().amax(dim=0)
    shift = zero_empty_shift(shift)
    weights = (lses - shift).exp()  # [parts, ...]
    total = weights.sum(dim=0)
    visible = total > 0
    safe_total = torch.where(visible, total, torch.ones_like(total))
    lse = torch.where(visible, shift + safe_total.log(), torch.full_like(total, NO_KEY_LSE))
    # Summed in the lse dtype (float32 for half inputs) so that merging adds no rounding of its own.
    out = sum(
        (weight / safe_total).unsqueeze(-1) * part.to(weight.dtype)
        for weight, (part, _) in zip(weights, partials, strict=True)
    )
    return out.to(partials[0][0].dtype), lse


def head_groups(dilation: int | Sequence[int], heads: int) -> list[tuple[int, list[int]]]:
    """Group the query heads by dilation: `[(dilation, [head, ...]), ...]` in order of first appearance.

    `dilation` is one value for every head or one per head (Longformer's per-head dilation).
    """
    if isinstance(dilation, int):
        return [(dilation, list(range(heads)))]
    groups: dict[int, list[int]] = {}
    for head, value in enumerate(dilation):
        groups.setdefault(value, []).append(head)
    return list(groups.items())


def rotary_inverse_frequencies(head_dim: int, theta: float) -> Tensor:
    """Rotary frequencies theta^(-2i/d) for i < d/2, float32 `[d/2]` (Su et al. 2021, eq. 15)."""
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))


def rotate_half(x: Tensor) -> Tensor:
    """`[x1, x2] -> [-x2, x1]` on the last dim: the rotation by 90 degrees of each (x1_i, x2_i) pair."""
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


def rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotary position embedding (Su et al. 2021) of one tensor `x` `[..., d]`: `x·cos + rotate_half(x)·sin`.

    `cos` and `sin` are already laid out to broadcast against `x` (any layout: heads first or tokens first) and in
    its dtype; `apply_rotary` does that for q and k `[b, h, n, d]`.
    """
    return x * cos + rotate_half(x) * sin


def apply_rotary(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    """Rotary position embedding (Su et al. 2021) of q `[b, h, n, d]` and k `[b, h, n, d]`; cos, sin `[b, n, d]`."""
    cos, sin = cos.unsqueeze(1).to(q.dtype), sin.unsqueeze(1).to(q.dtype)  # [b, 1, n, d]
    return rotate(q, cos, sin), rotate(k, cos, sin)
