"""Sparse Sinkhorn attention and SortCut (Tay et al. 2020, "Sparse Sinkhorn Attention"): the `"sinkhorn"` kind.

Shape legend: b batch, h heads, n length, d head dim, B blocks (N_B in the paper), s block size, p SortCut budget.

The sequence is cut into blocks of `sinkhorn_block_size`. A sorting network scores every (target block i, source
block j) pair from block summaries, and `sinkhorn_iterations` rounds of Sinkhorn balancing in log space (Gumbel noise
and temperature `sinkhorn_temperature` in training, as in the paper) turn the scores into a doubly stochastic
matrix S, a relaxed permutation of the blocks.

- **Sorting network.** Block summaries are the mean keys of a block's real tokens. The score of (i, j) is
  `(u_i W) · u_j / sqrt(d)` with a learned `W` (`sort_proj`, d x d, shared by the heads), u_i the summary of block i.
  The paper's SortNet maps one summary to N_B scores with a dense layer, which fixes the number of blocks and so
  the sequence length; this bilinear form scores any number of blocks, and uses keys so that cached decoding can
  recompute it.
- **Sinkhorn attention.** Query block i attends to its own block and to its sorted block. The sorted block is the
  soft permutation truncated to its largest entry: the keys and values of block j* = argmax_j S_ij, scaled by
  S_ij* (what `S · K` gives when row i is one-hot, and the path by which the sorting network learns). Computing
  the full `S · K` would cost O(n · N_B · d), quadratic in n; this keeps the kind linear.
- **SortCut** (`sinkhorn_sortcut` = p). After sorting, only the first p sorted blocks are kept, the exact soft
  mixtures `Σ_j S_qj K_j` for q < p, and every query attends to those p·s keys (and no local block, as in the
  paper's `Softmax(Q ψ_S(K)[:n]ᵀ) ψ_S(V)[:n]`). O(n · p · s).
- **Causal.** Block i must not see anything after its own tokens: its sorting row uses the summary of block i - 1
  (entirely in the past) and may pick only blocks j < i, its own block is masked causally, and the column
  normalisation of Sinkhorn runs cumulatively over the rows up to i, so that row i of S depends only on blocks
  up to i - 1 (plain Sinkhorn would let every later block reshape row i). Block 0 has no sorted block. SortCut has
  no causal form (every query would see the same sorted mixtures, built from the whole sequence): a `ValueError`.

Blocks start at each row's first real token (left padding is rotated to the end), so block boundaries, and thus
the output of real tokens, do not depend on padding.

Block pattern, 4 blocks, bidirectional (■ own block, ▣ sorted block; here S sorts 0→2, 1→0, 2→3, 3→1):

    ■ ⬚ ▣ ⬚
    ▣ ■ ⬚ ⬚
    ⬚ ⬚ ■ ▣
    ⬚ ▣ ⬚ ■
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .attention_base import LongAttnAttention, check_int_field
from .ops_lsh import attend_windows

__all__ = [
    "SinkhornAttention",
    "log_sinkhorn",
    "sinkhorn_attention",
    "sinkhorn_attention_dense",
    "sinkhorn_sort_matrix",
]

# Masked entries of the log-space Sinkhorn matrix: finite, so that a row or column with nothing allowed normalises
# to finite values (then masked again) instead of NaN, and exp() of it is exactly 0 in float32.
_MASKED = -1e9


# ---------------------------------------------------------------------------------------------- Sinkhorn
def log_sinkhorn(logits: Tensor, allowed: Tensor | None, *, iterations: int, causal: bool) -> Tensor:
    """Sinkhorn balancing in log space: alternately normalise columns and rows; returns S = exp(result).

    Args:
        logits: `[..., B, B]` scores (rows: target blocks, columns: source blocks), already divided by the
            temperature.
        allowed: Bool broadcastable to logits, S is 0 elsewhere; None = everything allowed (no masking work).
        iterations: Rounds of (column, row) normalisation; rows sum to 1 at the end (rows with nothing allowed: 0).
        causal: Normalise each column over the rows up to the current one (a cumulative log-sum-exp), so that row i
            depends only on rows <= i.

    Returns:
        S `[..., B, B]` in float32 (float64 for float64 input).
    """
    dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
    blocked = None if allowed is None else ~allowed
    x = logits.to(dtype) if blocked is None else logits.to(dtype).masked_fill(blocked, _MASKED)
    for _ in range(iterations):
        column = torch.logcumsumexp(x, dim=-2) if causal else x.logsumexp(dim=-2, keepdim=True)
        x = x - column
        if blocked is not None:  # re-mask: a row or column with nothing allowed normalised to finite junk
            x = x.masked_fill(blocked, _MASKED)
        x = x - x.logsumexp(dim=-1, keepdim=True)
        if blocked is not None:
            x = x.masked_fill(blocked, _MASKED)
    return x.exp() if blocked is None else x.exp() * allowed


def _block_summaries(k: Tensor, valid: Tensor, block: int) -> tuple[Tensor, Tensor]:
    """Mean key of each block's real tokens `[b, h, B, d]`, and whether a block has any `[b, B]`."""
    b, h, n, d = k.shape
    weights = valid.to(k.dtype).view(b, 1, n // block, 1, block)  # [b, 1, B, 1, s]
    counts = weights.sum(dim=-1)  # [b, 1, B, 1]
    # A [1, s] x [s, d] matmul per block: cheaper than multiplying and summing the [B, s, d] keys.
    sums = torch.matmul(weights, k.view(b, h, n // block, block, d)).squeeze(-2)  # [b, h, B, d]
    return sums / counts.clamp(min=1), counts[:, 0, :, 0] > 0


def sinkhorn_sort_matrix(
    k: Tensor,
    valid: Tensor,
    sort_weight: Tensor,
    *,
    block_size: int,
    iterations: int,
    temperature: float,
    causal: bool,
    noise: bool = False,
    padded: bool = True,
) -> Tensor:
    """The block sorting matrix S `[b, h, B, B]` (rows: target blocks, columns: source blocks).

    Args:
        k: Keys `[b, h, n, d]`, n a multiple of `block_size`, real tokens first in every row.
        valid: Bool `[b, n]`, True = real token.
        sort_weight: `W` `[d, d]` of the bilinear sorting network.
        block_size: s.
        iterations: Sinkhorn rounds.
        temperature: Divides the scores (after the noise).
        causal: Row i uses the summary of block i - 1 and may pick only blocks j < i; cumulative columns.
        noise: Add Gumbel noise to the scores (training).
        padded: Whether `valid` may be False anywhere; False skips the masking work (bidirectional only).

    Returns:
        S `[b, h, B, B]`, float32 (float64 for float64 keys); rows sum to 1 where anything is allowed.
    """
    summaries, has_tokens = _block_summaries(k, valid, block_size)  # [b, h, B, d], [b, B]
    blocks = summaries.shape[2]
    rows, row_ok = summaries, has_tokens
    if causal:
        rows = F.pad(summaries[:, :, :-1], (0, 0, 1, 0))  # row i looks from block i - 1
        row_ok = has_tokens & F.pad(has_tokens[:, :-1], (1, 0), value=False)
    scores = torch.einsum("bhid,de,bhje->bhij", rows, sort_weight.to(rows.dtype), summaries)
    scores = scores / math.sqrt(k.shape[-1])
    if noise:
        uniform = torch.rand_like(scores, dtype=torch.float32).clamp_(1e-6, 1 - 1e-6)
        scores = scores - torch.log(-torch.log(uniform)).to(scores.dtype)  # + Gumbel(0, 1)
    allowed = None
    if padded or causal:
        allowed = row_ok[:, None, :, None] & has_tokens[:, None, None, :]  # [b, 1, B, B]
    if causal:
        allowed = allowed & torch.ones(blocks, blocks, dtype=torch.bool, device=k.device).tril(-1)
    return log_sinkhorn(scores / temperature, allowed, iterations=iterations, causal=causal)


# ---------------------------------------------------------------------------------------------- layout helpers
def _left_aligned(valid: Tensor) -> Tensor:
    """Per row, the rotation `[b, n]` that moves the first real token to position 0 (left padding to the end)."""
    b, n = valid.shape
    first = torch.where(valid.any(-1), valid.long().argmax(-1), 0)  # [b]
    return (torch.arange(n, device=valid.device) + first[:, None]) % n


def _take(x: Tensor, index: Tensor) -> Tensor:
    """`x [b, h, n, d]` with positions `index [b, n]` (the same for every head)."""
    return x.gather(2, index[:, None, :, None].expand(-1, x.shape[1], -1, x.shape[3]))


def _prepare(q, k, v, key_padding_mask, block):
    """Rotate left padding away, pad to whole blocks, zero padded keys and values (they enter block means)."""
    b, h, n, _ = q.shape
    valid = torch.ones(b, n, dtype=torch.bool, device=q.device) if key_padding_mask is None else key_padding_mask.bool()
    rotation = None
    if key_padding_mask is not None:
        rotation = _left_aligned(valid)
        q, k, v, valid = _take(q, rotation), _take(k, rotation), _take(v, rotation), valid.gather(1, rotation)
        keep = valid[:, None, :, None].to(k.dtype)
        k, v = k * keep, v * keep
    n_pad = -(-n // block) * block
    if n_pad > n:  # the alignment padding is zeros already
        q, k, v = (F.pad(x, (0, 0, 0, n_pad - n)) for x in (q, k, v))
        valid = F.pad(valid, (0, n_pad - n), value=False)
    return q, k, v, valid, rotation


def _restore(out: Tensor, n: int, rotation: Tensor | None) -> Tensor:
    out = out[:, :, :n]
    if rotation is None:
        return out
    inverse = torch.empty_like(rotation).scatter_(1, rotation, torch.arange(n, device=out.device).expand_as(rotation))
    return _take(out, inverse)


# ---------------------------------------------------------------------------------------------- executor
class _OwnAndSorted(torch.autograd.Function):
    """Blocks `[B, s, d]` -> `[B, 2s, d]`: block i, then w_i · block source_i (its sorted block).

    Written out for memory: backward needs the blocks, and finds them in the first half of its own output, which
    the attention kernel keeps anyway; autograd would also have kept the gathered and the scaled copies.
    """

    @staticmethod
    def forward(ctx, blocks, source, weight):
        size = blocks.shape[1]
        out = blocks.new_empty(blocks.shape[0], 2 * size, blocks.shape[2])
        out[:, :size] = blocks
        torch.mul(blocks.index_select(0, source), weight.view(-1, 1, 1), out=out[:, size:])
        ctx.save_for_backward(out, source, weight)
        return out

    @staticmethod
    def backward(ctx, grad):
        out, source, weight = ctx.saved_tensors
        size = out.shape[1] // 2
        n_blocks = out.shape[0]
        grad_own, grad_sorted = grad[:, :size], grad[:, size:]
        # One block-sized temporary at a time (this backward runs at the peak of the layer's memory).
        gathered = out[:, :size].index_select(0, source)
        grad_weight = torch.bmm(grad_sorted.reshape(n_blocks, 1, -1), gathered.view(n_blocks, -1, 1)).view(-1)
        del gathered
        grad_blocks = grad_own.contiguous()
        grad_blocks.index_add_(0, source, grad_sorted * weight.view(-1, 1, 1))
        return grad_blocks, None, grad_weight


def sinkhorn_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    sort_weight: Tensor,
    *,
    block_size: int,
    iterations: int,
    temperature: float,
    causal: bool = False,
    sortcut: int | None = None,
    key_padding_mask: Tensor | None = None,
    scale: float | None = None,
    noise: bool = False,
    dropout_p: float = 0.0,
) -> Tensor:
    """Sparse Sinkhorn attention (or SortCut), O(n · s) (SortCut: O(n · p · s)); never an n x n score.

    Args:
        q, k, v: `[b, h, n, d]` (v: d_v).
        sort_weight: `W` `[d, d]` of the sorting network.
        block_size: s.
        iterations: Sinkhorn rounds.
        temperature: Sinkhorn temperature.
        causal: The causal variant (module docstring).
        sortcut: Budget p of SortCut; None = Sinkhorn attention.
        key_padding_mask: Bool `[b, n]`, True = real token.
        scale: Multiplier of q·k; default 1/sqrt(d).
        noise: Gumbel noise on the sorting scores (training).
        dropout_p: Dropout on the attention probabilities.

    Returns:
        `[b, h, n, d_v]`.

    Raises:
        ValueError: Causal SortCut.
    """
    if causal and sortcut:
        raise ValueError("SortCut has no causal form: every query attends to sorted mixtures of the whole sequence.")
    b, h, n, d = q.shape
    d_v = v.shape[-1]
    s = block_size
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    padded = key_padding_mask is not None or n % s != 0
    q, k, v, valid, rotation = _prepare(q, k, v, key_padding_mask, s)
    blocks = q.shape[2] // s
    sort = sinkhorn_sort_matrix(k, valid, sort_weight, block_size=s, iterations=iterations,
                                temperature=temperature, causal=causal, noise=noise, padded=padded)  # [b, h, B, B]
    k_blocks, v_blocks = k.view(b, h, blocks, s, d), v.view(b, h, blocks, s, d_v)
    bias_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32

    if sortcut:
        kept = min(sortcut, blocks)
        mix = sort[:, :, :kept].to(k.dtype)  # [b, h, p, B]
        keys = torch.einsum("bhpj,bhjsd->bhpsd", mix, k_blocks)  # the first p sorted blocks, exact soft mixtures
        values = torch.einsum("bhpj,bhjsd->bhpsd", mix, v_blocks)
        # A sorted block exists where its row of S is not empty (a real target block).
        present = (sort[:, :, :kept].sum(-1) > 0)[..., None].expand(b, h, kept, s).reshape(b * h, 1, kept * s)
        bias = torch.zeros(present.shape, dtype=bias_dtype, device=q.device).masked_fill_(~present, -math.inf)
        out, _ = attend_windows(q.reshape(b * h, -1, d), keys.reshape(-1, d), values.reshape(-1, d_v), bias,
                                stride=kept * s, scale=scale, dropout_p=dropout_p)
        return _restore(out.view(b, h, -1, d_v), n, rotation)

    with torch.no_grad():
        source = sort.argmax(dim=-1)  # [b, h, B], the block sorted into place i
        has_source = sort.amax(dim=-1) > 0
    weight = sort.gather(-1, source.unsqueeze(-1)).squeeze(-1).to(k.dtype)  # [b, h, B]: S_ij*, carries the gradient
    flat = ((torch.arange(b * h, device=q.device).view(b, h, 1) * blocks) + source).reshape(-1)
    keys = _OwnAndSorted.apply(k_blocks.reshape(b * h * blocks, s, d), flat, weight.reshape(-1))  # [.., 2s, d]
    values = _OwnAndSorted.apply(v_blocks.reshape(b * h * blocks, s, d_v), flat, weight.reshape(-1))
    with torch.no_grad():
        own = valid.view(b, 1, blocks, 1, s).expand(b, h, blocks, 1, s)
        other = valid.view(b, 1, blocks, s).expand(b, h, blocks, s).gather(
            2, source.unsqueeze(-1).expand(b, h, blocks, s)) & has_source.unsqueeze(-1)
        visible = torch.cat([own, other.unsqueeze(3)], dim=-1)  # [b, h, B, 1, 2s]
        if causal:
            earlier = torch.ones(s, s, dtype=torch.bool, device=q.device).tril()
            visible = visible & torch.cat([earlier, torch.ones_like(earlier)], dim=-1)  # [b, h, B, s, 2s]
        bias = torch.zeros(visible.shape, dtype=bias_dtype, device=q.device).masked_fill_(~visible, -math.inf)
    # Probabilities are recomputed in backward: this kind's memory is otherwise the tightest against its peers.
    out, _ = attend_windows(q.reshape(-1, s, d), keys.view(-1, d), values.view(-1, d_v),
                            bias.view(b * h * blocks, -1, 2 * s), stride=2 * s, scale=scale, dropout_p=dropout_p,
                            keep_probs=False)
    return _restore(out.view(b, h, -1, d_v), n, rotation)


# ---------------------------------------------------------------------------------------------- dense form
def sinkhorn_attention_dense(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    sort_weight: Tensor,
    *,
    block_size: int,
    iterations: int,
    temperature: float,
    causal: bool = False,
    sortcut: int | None = None,
    key_padding_mask: Tensor | None = None,
    scale: float | None = None,
    noise: bool = False,
    dropout_p: float = 0.0,
) -> tuple[Tensor, Tensor]:
    """The same attention as `sinkhorn_attention`, written over all m key positions (with its weights).

    Queries are the last n of the m key positions (cached decoding; n = m for `output_attentions`). The returned
    weights are the effective mixing weights over the original positions (`out = weights @ v`): for a sorted block,
    probability times S_ij*; for SortCut, the probabilities of the mixed keys spread over their source blocks by S.

    Returns:
        `(out [b, h, n, d_v], weights [b, h, n, m])`.
    """
    b, h, n, d = q.shape
    m = k.shape[2]
    s = block_size
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    dtype = torch.float32 if q.dtype in (torch.float16, torch.bfloat16) else q.dtype
    valid = torch.ones(b, m, dtype=torch.bool, device=q.device) if key_padding_mask is None else key_padding_mask.bool()
    rotation = _left_aligned(valid)
    # Keys in the blocked layout (rotated, padded) and the layout position of every original key position.
    k_l, v_l = _take(k.to(dtype), rotation), _take(v.to(dtype), rotation)
    valid_l = valid.gather(1, rotation)
    m_pad = -(-m // s) * s
    k_l, v_l = F.pad(k_l, (0, 0, 0, m_pad - m)), F.pad(v_l, (0, 0, 0, m_pad - m))
    valid_l = F.pad(valid_l, (0, m_pad - m), value=False)
    keep = valid_l[:, None, :, None].to(dtype)
    k_l, v_l = k_l * keep, v_l * keep
    blocks = m_pad // s
    sort = sinkhorn_sort_matrix(k_l, valid_l, sort_weight, block_size=s, iterations=iterations,
                                temperature=temperature, causal=causal, noise=noise).to(dtype)  # [b, h, B, B]
    layout = torch.empty_like(rotation).scatter_(1, rotation, torch.arange(m, device=q.device).expand_as(rotation))
    q_layout = layout[:, m - n:]  # [b, n], layout position of each query
    q_block = torch.div(q_layout, s, rounding_mode="floor")
    key_block = torch.arange(m_pad, device=q.device) // s  # [m_pad]
    scores = torch.einsum("bhnd,bhmd->bhnm", q.to(dtype), k_l) * scale  # [b, h, n, m_pad]

    if sortcut:
        kept = min(sortcut, blocks)
        mix = sort[:, :, :kept]  # [b, h, p, B]
        # Mixed key (p, t) = Σ_j S_pj K[j·s + t]; its score is Σ_j S_pj (q · K[j·s + t]).
        per_block = scores.view(b, h, n, blocks, s)
        mixed = torch.einsum("bhpj,bhnjt->bhnpt", mix, per_block).reshape(b, h, n, kept * s)
        present = (mix.sum(-1) > 0)[:, :, None, :, None].expand(b, h, n, kept, s).reshape(b, h, n, kept * s)
        probs = _softmax_or_zero(mixed.masked_fill(~present, -math.inf))  # [b, h, n, p·s]
        # Spread back: weight of layout key j·s + t = Σ_p probs[p, t] · S_pj.
        weights_layout = torch.einsum("bhnpt,bhpj->bhnjt", probs.view(b, h, n, kept, s), mix).reshape(b, h, n, m_pad)
    else:
        source = sort.argmax(dim=-1)  # [b, h, B]
        has_source = sort.amax(dim=-1) > 0
        weight = sort.gather(-1, source.unsqueeze(-1)).squeeze(-1)  # [b, h, B]
        q_source = source.gather(-1, q_block[:, None, :].expand(b, h, n))  # [b, h, n]
        q_weight = weight.gather(-1, q_block[:, None, :].expand(b, h, n))
        q_has = has_source.gather(-1, q_block[:, None, :].expand(b, h, n))
        own = (key_block == q_block[..., None])[:, None] & valid_l[:, None, None, :]  # [b, 1, n, m_pad]
        if causal:
            own = own & (torch.arange(m_pad, device=q.device) <= q_layout[..., None])[:, None]
        other = (key_block == q_source[..., None]) & valid_l[:, None, None, :] & q_has[..., None]  # [b, h, n, m_pad]
        # Sorted keys are scaled by S_ij*: score w·(q·k), value w·v; the same key may appear twice (own = sorted).
        both = torch.cat([scores.masked_fill(~own, -math.inf),
                          (scores * q_weight[..., None]).masked_fill(~other, -math.inf)], dim=-1)
        probs = _softmax_or_zero(both)  # [b, h, n, 2·m_pad]
        weights_layout = probs[..., :m_pad] + probs[..., m_pad:] * q_weight[..., None]
    weights_layout = weights_layout * valid[:, None, m - n:, None]  # padding queries: zero (as the fast path's
    # rotated-away padding would give garbage, not a defined output)
    dropped = F.dropout(weights_layout, p=dropout_p) if dropout_p > 0 else weights_layout
    out = torch.matmul(dropped, v_l)  # [b, h, n, d_v]
    weights = weights_layout[..., :m].gather(-1, layout[:, None, None, :].expand(b, h, n, m))  # back to positions
    return out.to(q.dtype), weights.to(q.dtype)


def _softmax_or_zero(scores: Tensor) -> Tensor:
    """Softmax over the last dim; rows without any finite score give zeros (not NaN)."""
    sees = ~torch.isneginf(scores).all(dim=-1, keepdim=True)
    return torch.softmax(scores.masked_fill(~sees, 0.0), dim=-1) * sees


# ---------------------------------------------------------------------------------------------- the module
class SinkhornAttention(LongAttnAttention):
    """The `"sinkhorn"` kind: Sparse Sinkhorn attention, or SortCut with `sinkhorn_sortcut`.

    Config fields (ints may be one value or one per layer):
        sinkhorn_block_size (64): tokens per block s.
        sinkhorn_iterations (5): Sinkhorn balancing rounds.
        sinkhorn_temperature (0.75): divides the sorting scores (the paper's τ).
        sinkhorn_sortcut (None): SortCut budget p (blocks kept after sorting); None = Sinkhorn attention. Encoders
            only: a causal layer with SortCut is refused at config time.

    Parameters: `sort_proj` (the sorting network's W, d x d, shared by the heads) besides q/k/v/o.
    """

    attention_type = "sinkhorn"
    config_fields = {
        "sinkhorn_block_size": 64,
        "sinkhorn_iterations": 5,
        "sinkhorn_temperature": 0.75,
        "sinkhorn_sortcut": None,
    }

    def __init__(self, config: Any, *, layer_idx: int, is_causal: bool):
        super().__init__(config, layer_idx=layer_idx, is_causal=is_causal)
        self.block_size = config.per_layer("sinkhorn_block_size", layer_idx)
        self.iterations = config.per_layer("sinkhorn_iterations", layer_idx)
        self.temperature = config.sinkhorn_temperature
        self.sortcut = config.per_layer("sinkhorn_sortcut", layer_idx)
        self.sort_proj = nn.Linear(self.head_dim, self.head_dim, bias=False)

    @classmethod
    def validate_config(cls, config, *, layer_idx, is_causal):
        check_int_field(config, "sinkhorn_block_size", layer_idx, minimum=1)
        check_int_field(config, "sinkhorn_iterations", layer_idx, minimum=1)
        temperature = config.sinkhorn_temperature
        if not isinstance(temperature, (int, float)) or isinstance(temperature, bool) or not temperature > 0:
            raise ValueError(f"`sinkhorn_temperature`={temperature!r} is invalid: expected a number > 0.")
        sortcut = config.sinkhorn_sortcut
        if sortcut is None:
            return
        values = list(sortcut) if isinstance(sortcut, (list, tuple)) else [sortcut]
        if isinstance(sortcut, (list, tuple)) and len(values) != config.num_hidden_layers:
            raise ValueError(f"`sinkhorn_sortcut`={sortcut!r} has {len(values)} entries: expected None, one integer "
                             f"or one per layer ({config.num_hidden_layers}).")
        for value in values:
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ValueError(f"`sinkhorn_sortcut`={sortcut!r} is invalid: expected None or integers >= 1.")
        this_layer = values[layer_idx] if len(values) > 1 else values[0]
        if is_causal and this_layer is not None:
            raise ValueError(
                f"`sinkhorn_sortcut`={sortcut!r} has no causal form (decoder layers): every query would attend to "
                "sorted mixtures of the whole sequence, later tokens included. Use it in encoders only."
            )

    def _kwargs(self) -> dict:
        return dict(
            sort_weight=self.sort_proj.weight.T,
            block_size=self.block_size,
            iterations=self.iterations,
            temperature=self.temperature,
            causal=self.is_causal,
            sortcut=self.sortcut,
            scale=self.scale,
            noise=self.training,
            dropout_p=self.dropout_p if self.training else 0.0,
        )

    def attend(self, q, k, v, *, key_padding_mask, global_mask):
        return sinkhorn_attention(q, k, v, key_padding_mask=key_padding_mask, **self._kwargs())

    def attend_dense(self, q, k, v, *, key_padding_mask, global_mask):
        return sinkhorn_attention_dense(q, k, v, key_padding_mask=key_padding_mask, **self._kwargs())
