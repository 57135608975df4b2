"""Efficient attention (Shen et al. 2021, "Efficient Attention: Attention with Linear Complexities"): `Q (Kᵀ V)`.

Shape legend: b batch, h heads, n_q queries, n_k keys, d head dim (d_v for values), T key chunks, c keys per chunk.

Dot-product attention computes `ρ(Q Kᵀ) V`: an `[n_q, n_k]` matrix. Efficient attention normalises queries and keys
separately and multiplies the other way round, `ρ_q(Q) (ρ_k(K)ᵀ V)`, so the largest intermediate is the `[d, d_v]`
"global context" and time and memory are linear in length. Two normalisations (the paper's Eq. 4):

- `"softmax"`: ρ_q = softmax over the features of each query, ρ_k = softmax over the positions of each key feature.
  Every row of `ρ_q(Q) ρ_k(K)ᵀ` still sums to 1; it approximates (does not equal) softmax dot-product attention.
- `"scaling"`: ρ_q(Q) = Q / sqrt(n), ρ_k(K) = K / sqrt(n). Then `ρ_q(Q) ρ_k(K)ᵀ V = (Q Kᵀ / n) V`: exactly
  dot-product attention with scaling normalisation (the paper's Section 3.3), n being the number of visible keys.

The causal form gives query i the same mechanism over keys 0..i only: softmax over the positions j <= i, or n = the
number of visible keys up to i. It is computed chunk by chunk with a running state (prefix sums), still linear;
the softmax form takes every exponent relative to the query's running maximum (as online softmax does), so large
logits give exact, finite rows.

This module depends on torch, the shared input checks and the dispatcher, which hands back the executor of the
back end asked for (`EFFICIENT_STEPS`).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .attention_fields import EFFICIENT_NORMALIZATIONS
from .backends import select_step_executor
from .executor_families import StepExecutors
from .numerics import NO_KEY_LSE, compute_dtype, hide_exactly, hide_logits, zero_empty_shift
from .ops_checks import (
    check_flag,
    check_qkv,
    check_token_mask,
    empty_attention,
    inert_padding,
    is_empty,
)

__all__ = ["efficient_attention", "efficient_attention_weights", "EFFICIENT_NORMALIZATIONS"]


# The `backend=` values efficient attention cannot honour, and why: the shared back ends compute softmax(Q Kᵀ / s) V
# under a mask, and efficient attention never forms a score matrix to mask or take a softmax over.
_UNSUPPORTED_BACKENDS = {
    "flex": "FlexAttention computes softmax(Q Kᵀ) V under a block mask, and efficient attention has no score "
    "matrix (it multiplies ρ_q(Q) by the [d, d_v] context ρ_k(K)ᵀ V)",
    "xformers": "xformers' kernels compute softmax(Q Kᵀ) V, and efficient attention has no softmax over keys to "
    "hand to a kernel (it normalises queries and keys separately)",
}

# Keys per chunk of the causal form. Memory per (b, h) is about n·c (intra-chunk scores) + (n / c)·d·d_v (one state
# per chunk), smallest near c = sqrt(d·d_v); 64 also keeps the per-chunk Python step count low (n / 64).
_CAUSAL_CHUNK = 64
# The softmax form also holds one [c, c, d] block of weights per chunk (per-query stabilisers, see `_causal`), so
# its memory per (b, h) is about n·c·d + (n / c)·d·d_v: a smaller chunk keeps that near the scaling form's.
_CAUSAL_SOFTMAX_CHUNK = 16


def _check(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    normalization: str,
    causal: bool,
    key_padding_mask: Tensor | None,
    names: tuple[str, str, str] = ("q", "k", "v"),
) -> Tensor | None:
    """The shared checks of both entry points; returns the padding mask (bool `[b, n_k]` or None)."""
    b, _, _, n_k = check_qkv(q, k, v, names=names)
    if normalization not in EFFICIENT_NORMALIZATIONS:
        raise ValueError(
            f"normalization={normalization!r} is unknown: expected one of {list(EFFICIENT_NORMALIZATIONS)}"
        )
    check_flag("causal", causal)
    return check_token_mask("key_padding_mask", key_padding_mask, b, n_k, device=q.device)


def efficient_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    normalization: str = "softmax",
    causal: bool = False,
    key_padding_mask: Tensor | None = None,
    backend: str = "auto",
) -> Tensor:
    """Efficient attention `ρ_q(Q) (ρ_k(K)ᵀ V)` in O(n · d · d_v) time and O(n · (d + d_v)) memory.

    The causal softmax form adds O(n · c · d) time and memory for its per-query stabilisers (c = 16 keys per chunk).
    An empty batch or sequence gives an empty output.

    Padded keys take no part in any normalisation (they are not counted in n and get no softmax mass). A query
    that sees no key (a fully padded row, or a causal query before the first real key) returns zeros.

    Args:
        q: Queries `[b, h, n_q, d]`; the last n_q positions when n_q < n_k (cached decoding).
        k: Keys `[b, h, n_k, d]`.
        v: Values `[b, h, n_k, d_v]`.
        normalization: `"softmax"` (features of each query, positions of each key feature) or `"scaling"`
            (divide by the number of visible keys: exactly dot-product attention with scaling normalisation).
        causal: Query i sees keys 0..i only, normalised over them (computed with prefix sums over key chunks).
        key_padding_mask: Bool `[b, n_k]`, True = real token.
        backend: `"auto"` or `"torch"` (both this module's linear-time computation), or `"reference"`: the dense
            form `efficient_attention_weights(...) @ v`, O(n_q · n_k) memory, for tests. `"flex"` and `"xformers"`
            compute softmax attention and cannot run it.

    Returns:
        Output `[b, h, n_q, d_v]` in the dtype of q (accumulated in float32 for half inputs).

    Raises:
        ValueError: q, k, v that are not floating-point tensors of matching shapes, dtype and device, n_q > n_k,
            an unknown normalisation, a non-bool `causal`, a mask that is not bool `[b, n_k]`, or a `backend`
            that is unknown or cannot run efficient attention (the message says why).
    """
    padding = _check(q, k, v, normalization, causal, key_padding_mask)
    backend = EFFICIENT_STEPS.check(backend)
    if is_empty(q, k):
        return empty_attention(q, k, v)
    k, v = inert_padding(padding, k, v)
    attention = select_step_executor(backend, EFFICIENT_STEPS, q, k, v)
    return attention(q, k, v, normalization, causal, padding)


def _linear_form(q: Tensor, k: Tensor, v: Tensor, normalization: str, causal: bool, padding: Tensor | None) -> Tensor:
    """The PyTorch executor (`"auto"`, `"torch"`): `ρ_q(Q) (ρ_k(K)ᵀ V)` in linear time, in the compute dtype."""
    dtype = compute_dtype(q.dtype)
    qc, kc, vc = q.to(dtype), k.to(dtype), v.to(dtype)
    if causal:
        out = _causal(qc, kc, vc, normalization, padding)
    elif normalization == "softmax":
        out = _softmax_global(qc, kc, vc, padding)
    else:
        out = _scaling_global(qc, kc, vc, padding)
    return out.to(q.dtype)


def _dense_form(q: Tensor, k: Tensor, v: Tensor, normalization: str, causal: bool, padding: Tensor | None) -> Tensor:
    """The `"reference"` back end: `efficient_attention_weights(...) @ v`, O(n_q · n_k) memory."""
    weights = efficient_attention_weights(
        q, k, normalization=normalization, causal=causal, key_padding_mask=padding
    )  # [b, h, n_q, n_k] in the compute dtype
    return (weights @ v.to(weights.dtype)).to(q.dtype)


EFFICIENT_STEPS = StepExecutors(
    "efficient (linear)", None, {"torch": _linear_form, "reference": _dense_form}, refused=_UNSUPPORTED_BACKENDS
)
"""Efficient attention's executors per back end (`"auto"` is always this module's linear-time computation)."""


def _softmax_over_positions(k: Tensor, padding: Tensor | None) -> Tensor:
    """Softmax of each key feature over the (real) positions: `[b, h, n, d]`, columns sum to 1 (or are all 0)."""
    if padding is None:
        return torch.softmax(k, dim=2)
    keep = padding[:, None, :, None]
    # `hide_logits` along the positions: padding weighs exactly 0; a feature of a row without any real token gets
    # a finite softmax over its padding, which the product zeroes, instead of NaN.
    return torch.softmax(hide_logits(k, ~keep, dim=2), dim=2) * keep


def _softmax_global(q: Tensor, k: Tensor, v: Tensor, padding: Tensor | None) -> Tensor:
    context = _softmax_over_positions(k, padding).transpose(-1, -2) @ v  # [b, h, d, d_v]
    return torch.softmax(q, dim=-1) @ context  # [b, h, n_q, d_v]


def _scaling_global(q: Tensor, k: Tensor, v: Tensor, padding: Tensor | None) -> Tensor:
    n_k = k.shape[2]
    if padding is None:
        count = torch.full((1, 1, 1, 1), float(n_k), dtype=q.dtype, device=q.device)
    else:
        k = k * padding[:, None, :, None]
        count = padding.sum(dim=1).to(q.dtype).view(-1, 1, 1, 1)
    context = k.transpose(-1, -2) @ v  # [b, h, d, d_v]
    # (Q / sqrt(n)) (K / sqrt(n))ᵀ V, with both 1/sqrt(n) folded into one division; a row without keys stays 0.
    return (q @ context) / count.clamp(min=1)


def _causal(q: Tensor, k: Tensor, v: Tensor, normalization: str, padding: Tensor | None) -> Tensor:
    """Causal efficient attention by key chunks of c: within a chunk a masked [c, c] product, across chunks a state.

    Softmax form: query i needs, per key feature f, Σ_{j<=i} exp(k_jf) v_j / Σ_{j<=i} exp(k_jf). Every exponent is
    taken relative to the prefix maximum M_if = max_{j<=i} k_jf (a running max, as in online softmax), so every
    exp() is <= 1 and the key reaching the maximum contributes exactly 1 to the denominator: large logits neither
    overflow nor underflow a whole row to zero. Inside a chunk the weights exp(k_jf - M_if) depend on both i and j
    (a [c, c, d] product per chunk); the state carried across chunks is kept relative to the maximum at the end of
    the previous chunk, R_{t-1} <= M_i, and rescaled by exp(R_{t-1} - M_if) <= 1 for each query.
    """
    b, h, n_q, d = q.shape
    n_k, d_v = k.shape[2], v.shape[3]
    c = min(_CAUSAL_CHUNK if normalization == "scaling" else _CAUSAL_SOFTMAX_CHUNK, n_k)
    n_chunks = -(-n_k // c)
    pad = n_chunks * c - n_k
    valid = torch.ones(b, n_k, dtype=torch.bool, device=q.device) if padding is None else padding
    # Queries are the last n_q positions: give the earlier positions zero queries and cut their rows at the end.
    q_full = torch.nn.functional.pad(q, (0, 0, n_k - n_q, pad))  # [b, h, T·c, d]
    k_full = torch.nn.functional.pad(k, (0, 0, 0, pad))
    v_full = torch.nn.functional.pad(v, (0, 0, 0, pad))
    valid = torch.nn.functional.pad(valid, (0, pad), value=False)  # [b, T·c]
    q_t = q_full.view(b, h, n_chunks, c, d)
    k_t = k_full.view(b, h, n_chunks, c, d)
    v_t = v_full.view(b, h, n_chunks, c, d_v)
    valid_t = valid.view(b, 1, n_chunks, c, 1)
    tril = torch.ones(c, c, dtype=torch.bool, device=q.device).tril()  # key j <= query i inside a chunk

    if normalization == "scaling":
        weights = k_t * valid_t  # [b, h, T, c, d]
        chunk_context = weights.transpose(-1, -2) @ v_t  # [b, h, T, d, d_v]
        # No stabiliser is needed for sums of products, so the carried states are plain exclusive prefix sums.
        context_in = chunk_context.cumsum(dim=2) - chunk_context
        count = valid.to(q.dtype).cumsum(dim=1).view(b, 1, n_chunks, c, 1)  # visible keys up to each query
        coefficient = q_t / count.clamp(min=1)  # [b, h, T, c, d]
        inter = coefficient @ context_in  # [b, h, T, c, d_v]: keys of earlier chunks
        scores = (coefficient @ weights.transpose(-1, -2)).masked_fill(~tril, 0.0)  # [b, h, T, c, c]
        out = inter + scores @ v_t  # [b, h, T, c, d_v]
        return out.reshape(b, h, n_chunks * c, d_v)[:, :, n_k - n_q : n_k]

    k_masked = hide_exactly(k_t, ~valid_t)
    # Stabilisers carry no gradient: the result does not depend on them. -inf = no real key up to there.
    prefix = torch.cummax(k_masked.detach().reshape(b, h, n_chunks * c, d), dim=2).values
    prefix = prefix.view(b, h, n_chunks, c, d)  # M_i
    seen = prefix > NO_KEY_LSE
    shift = torch.where(seen, prefix, torch.zeros_like(prefix))
    end, end_seen = shift[:, :, :, -1], seen[:, :, :, -1]  # R_t, [b, h, T, d]
    prev_end = torch.nn.functional.pad(end, (0, 0, 1, 0))[:, :, :-1]  # R_{t-1}
    prev_seen = torch.nn.functional.pad(end_seen, (0, 0, 1, 0), value=False)[:, :, :-1]
    # exp(R_{t-1} - x) <= 1; 0 where no real key came before the chunk (its state is 0 then anyway).
    carried = torch.exp(hide_exactly(prev_end.unsqueeze(3) - shift, ~prev_seen.unsqueeze(3)))  # [b, h, T, c, d]
    decay = torch.exp(hide_exactly(prev_end - end, ~prev_seen))  # [b, h, T, d]: R_{t-1} -> R_t

    weights = torch.exp(k_masked - end.unsqueeze(3))  # [b, h, T, c, d]: exp(k_j - R_t), 0 on padding
    chunk_context = weights.transpose(-1, -2) @ v_t  # [b, h, T, d, d_v]
    context_in, mass_in = _carry(chunk_context, weights.sum(dim=3), decay)  # states entering chunk t, rel. R_{t-1}
    # exp(k_jf - M_if) for keys j <= i of the chunk; masked before exp() so that no inf reaches the backward.
    within = hide_exactly(k_masked.unsqueeze(3) - shift.unsqueeze(4), ~tril[:, :, None])
    within = torch.exp(within)  # [b, h, T, c_i, c_j, d]
    mass = carried * mass_in.unsqueeze(3) + within.sum(dim=4)  # [b, h, T, c, d]: >= 1 once a real key is seen
    features = torch.softmax(q_t, dim=-1)
    coefficient = torch.where(mass > 0, features / torch.where(mass > 0, mass, torch.ones_like(mass)), 0.0)
    inter = (coefficient * carried) @ context_in  # [b, h, T, c, d_v]: keys of earlier chunks
    scores = torch.einsum("bhtif,bhtijf->bhtij", coefficient, within)  # [b, h, T, c, c]
    out = inter + scores @ v_t  # [b, h, T, c, d_v]
    return out.reshape(b, h, n_chunks * c, d_v)[:, :, n_k - n_q : n_k]


def _carry(chunk_context: Tensor, chunk_mass: Tensor, decay: Tensor) -> tuple[Tensor, Tensor]:
    """States entering each chunk: G_0 = 0, G_{t+1} = decay_t · G_t + U_t, the same for the mass.

    U_t is chunk t's sum relative to R_t (the prefix max at its end) and decay_t = exp(R_{t-1} - R_t) <= 1, so G_t
    is relative to R_{t-1}. A sequential scan over the T chunks (each step touches only [b, h, d, d_v]): the decays
    make a cumulative sum impossible without over- or underflow, and T = n / c steps keep it linear.
    """
    # unbind (not indexing in the loop): the backward of T index ops would write T full-size zero gradients.
    context_steps, mass_steps, factors = chunk_context.unbind(2), chunk_mass.unbind(2), decay.unbind(2)
    contexts = [torch.zeros_like(context_steps[0])]
    masses = [torch.zeros_like(mass_steps[0])]
    for t in range(len(context_steps) - 1):  # factor [b, h, d]
        contexts.append(contexts[-1] * factors[t].unsqueeze(-1) + context_steps[t])
        masses.append(masses[-1] * factors[t] + mass_steps[t])
    return torch.stack(contexts, dim=2), torch.stack(masses, dim=2)


def efficient_attention_weights(
    q: Tensor,
    k: Tensor,
    *,
    normalization: str = "softmax",
    causal: bool = False,
    key_padding_mask: Tensor | None = None,
) -> Tensor:
    """The `[b, h, n_q, n_k]` matrix `ρ_q(Q) ρ_k(K)ᵀ` that efficient attention applies to V, made explicit.

    Costs O(n_q · n_k · d) time, and memory O(n_q · n_k) (O(n_q · n_k · d) for the causal form, which normalises
    the keys per query): for tests, `output_attentions` and cached decoding of a few new tokens, never for whole
    long sequences.

    Args:
        q: Queries `[b, h, n_q, d]`, the last n_q positions.
        k: Keys `[b, h, n_k, d]`.
        normalization: `"softmax"` or `"scaling"`.
        causal: Query i sees keys up to its own position only.
        key_padding_mask: Bool `[b, n_k]`, True = real token.

    Returns:
        Weights `[b, h, n_q, n_k]` in the compute dtype (float32 for half inputs); `weights @ v` is the output.
    """
    padding = _check(q, k, k, normalization, causal, key_padding_mask, names=("q", "k", "k"))
    dtype = compute_dtype(q.dtype)
    q, k = q.to(dtype), k.to(dtype)
    if is_empty(q, k):
        return q @ k.transpose(-1, -2)  # [b, h, n_q, n_k], no element
    b, h, n_q, d = q.shape
    n_k = k.shape[2]
    visible = torch.ones(b, 1, n_q, n_k, dtype=torch.bool, device=q.device)
    if causal:
        visible = visible & torch.ones(n_q, n_k, dtype=torch.bool, device=q.device).tril(n_k - n_q)
    if padding is not None:
        visible = visible & padding[:, None, None, :]
    if normalization == "scaling":
        count = visible.sum(dim=-1, keepdim=True).clamp(min=1).to(dtype)  # [b, 1, n_q, 1]
        return (q @ k.transpose(-1, -2)) * visible / count
    if not causal:
        # Every query sees the same keys: one key normalisation for all of them, [b, h, n_q, n_k] only.
        return torch.softmax(q, dim=-1) @ _softmax_over_positions(k, padding).transpose(-1, -2)
    # Per query i and feature f: exp(k_jf) / Σ_{j' visible} exp(k_j'f): a [n_q, n_k, d] tensor.
    logits = hide_exactly(k.unsqueeze(2), ~visible.unsqueeze(-1))  # [b, h, n_q, n_k, d]
    shift = logits.amax(dim=3, keepdim=True).detach()
    shift = zero_empty_shift(shift)
    key_weights = torch.exp(logits - shift)
    total = key_weights.sum(dim=3, keepdim=True)
    key_weights = key_weights / torch.where(total > 0, total, torch.ones_like(total))
    return torch.einsum("bhqd,bhqkd->bhqk", torch.softmax(q, dim=-1), key_weights)
