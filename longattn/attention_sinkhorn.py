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

Relative-position logits (`relative_position_logits`): the pair of query i and key j, own or sorted block, gains
scale · q_i · r_{clip(j − i)} on the original positions, added to the logit as it is (not multiplied by S_ij*,
which scales the sorted key vector). SortCut's keys are mixtures of blocks, with no position: it refuses them.

Block pattern, 4 blocks, bidirectional (■ own block, ▣ sorted block; here S sorts 0→2, 1→0, 2→3, 3→1):

    ■ ⬚ ▣ ⬚
    ▣ ■ ⬚ ⬚
    ⬚ ⬚ ■ ▣
    ⬚ ▣ ⬚ ■
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .attention_base import LongAttnAttention
from .backends import select_named_backend
from .executor_blocked import attend_blocks
from .fused_kernel import current_kernel
from .numerics import HALF_HIDDEN_PENALTY, LOG_SPACE_HIDDEN, compute_dtype, default_scale
from .ops_checks import check_document_ids, check_token_mask, empty_attention, is_empty
from .patterns import document_layout
from .relative_logits import block_bias, check_relative_embedding, relative_bias

__all__ = [
    "SinkhornAttention",
    "log_sinkhorn",
    "sinkhorn_attention",
    "sinkhorn_attention_dense",
    "sinkhorn_sort_matrix",
]


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
    dtype = compute_dtype(logits.dtype)
    blocked = None if allowed is None else ~allowed
    x = logits.to(dtype) if blocked is None else logits.to(dtype).masked_fill(blocked, LOG_SPACE_HIDDEN)
    for _ in range(iterations):
        # x - logsumexp(x) is log_softmax(x): one fused pass (and one in backward) instead of six.
        x = x - torch.logcumsumexp(x, dim=-2) if causal else torch.log_softmax(x, dim=-2)
        if blocked is not None:  # re-mask: a row or column with nothing allowed normalised to finite junk
            x = x.masked_fill(blocked, LOG_SPACE_HIDDEN)
        x = torch.log_softmax(x, dim=-1)
        if blocked is not None:
            x = x.masked_fill(blocked, LOG_SPACE_HIDDEN)
    return x.exp() if blocked is None else x.exp() * allowed


def _block_summaries(k: Tensor, valid: Tensor, block: int, *, padded: bool = True) -> tuple[Tensor, Tensor]:
    """Mean key of each block's real tokens `[b, h, B, d]`, and whether a block has any `[b, B]`.

    Keys split from a `[b, n, h·d]` projection are summed in that memory (`[b, B, s, h·d]`), without a copy.
    Without padding (`padded=False`) a plain sum, whose backward is a broadcast (nothing sequence-sized).
    """
    b, h, n, d = k.shape
    blocks = n // block
    weights = valid.to(k.dtype).view(b, blocks, 1, block)  # [b, B, 1, s]
    counts = weights.sum(dim=-1)  # [b, B, 1]
    if k.transpose(1, 2).is_contiguous():
        rows = k.transpose(1, 2).reshape(b, blocks, block, h * d)  # a view
        # Padded: a [1, s] x [s, h·d] matmul per block, cheaper than multiplying and summing the keys.
        sums = torch.matmul(weights, rows).squeeze(2) if padded else rows.sum(dim=2)  # [b, B, h·d]
        sums = sums.view(b, blocks, h, d).transpose(1, 2)
    else:
        rows = k.reshape(b, h, blocks, block, d)
        sums = torch.matmul(weights.unsqueeze(1), rows).squeeze(-2) if padded else rows.sum(dim=3)  # [b, h, B, d]
    return sums / counts.view(b, 1, blocks, 1).clamp(min=1), counts.view(b, blocks) > 0


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
    block_documents: Tensor | None = None,
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
        block_documents: Optional integer `[b, B]`, the document of every block of packed rows (laid out so that no
            block holds two): a block sorts among its own document's blocks only. S is then block-diagonal, and
            Sinkhorn's row and column normalisations run within each document, as for the document alone.

    Returns:
        S `[b, h, B, B]`, float32 (float64 for float64 keys); rows sum to 1 where anything is allowed.
    """
    summaries, has_tokens = _block_summaries(k, valid, block_size, padded=padded)  # [b, h, B, d], [b, B]
    blocks = summaries.shape[2]
    rows, row_ok = summaries, has_tokens
    if causal:
        rows = F.pad(summaries[:, :, :-1], (0, 0, 1, 0))  # row i looks from block i - 1
        row_ok = has_tokens & F.pad(has_tokens[:, :-1], (1, 0), value=False)
    scores = torch.einsum("bhid,de,bhje->bhij", rows, sort_weight.to(rows.dtype), summaries)
    scores = scores * default_scale(k.shape[-1])
    if noise:
        uniform = torch.rand_like(scores, dtype=torch.float32).clamp_(1e-6, 1 - 1e-6)
        scores = scores - torch.log(-torch.log(uniform)).to(scores.dtype)  # + Gumbel(0, 1)
    allowed = None
    if padded or causal:
        allowed = row_ok[:, None, :, None] & has_tokens[:, None, None, :]  # [b, 1, B, B]
    if causal:
        allowed = allowed & torch.ones(blocks, blocks, dtype=torch.bool, device=k.device).tril(-1)
    if block_documents is not None:
        same = (block_documents[:, :, None] == block_documents[:, None, :])[:, None]  # [b, 1, B, B]
        allowed = same if allowed is None else allowed & same
    return log_sinkhorn(scores / temperature, allowed, iterations=iterations, causal=causal)


# ---------------------------------------------------------------------------------------------- layout helpers
def _sorting(settings: dict[str, Any]) -> dict[str, Any]:
    """The Sinkhorn balancing settings (`sinkhorn_sort_matrix`'s keywords) out of a call's settings."""
    return {name: settings[name] for name in ("iterations", "temperature", "causal", "noise")}


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
    valid = torch.ones(b, n, dtype=torch.bool, device=q.device) if key_padding_mask is None else key_padding_mask
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


# ---------------------------------------------------------------------------------------------- attention
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
    backend: str = "auto",
    return_weights: bool = False,
    document_ids: Tensor | None = None,
    relative_embedding: Tensor | None = None,
    _block_documents: Tensor | None = None,
) -> Tensor | tuple[Tensor, Tensor]:
    """Sparse Sinkhorn attention (or SortCut), O(n · s) (SortCut: O(n · p · s)); never an n x n score.

    The attention step runs through `executor_blocked.attend_blocks`: query block i reads its own block in place
    (`own_keys`) and gathers its sorted block (`kv_index`, one key set per head), weighted by S_ij* (`kv_weight`,
    one per block, differentiable, so the sorting network learns through it); a padded or causal mask is a function
    of the chunk, evaluated again in backward. SortCut's p mixed blocks are keys every query block sees.

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
        backend: `"auto"` (default) or `"torch"`: the PyTorch blocked executor; `"xformers"`: the attention step as
            one call of the fused kernel (CUDA; `_attend_on_kernel`), which `"auto"` does not pick yet (not measured
            on a GPU); `"reference"`: the dense form, written over all key positions (`_dense_attention`).
        return_weights: Also return the effective attention weights (`sinkhorn_attention_dense`); needs
            `backend="reference"`.
        document_ids: Integer `[b, n]`, the document of each token of packed rows. The documents are laid out so
            that each starts on a block boundary (`patterns.document_layout`) and a block sorts among its own
            document's blocks only, so every document gets the output it would get alone. SortCut cannot pack.
        relative_embedding: Optional r `[2M + 1, d]`: relative-position logits on the pairs each query block
            computes (`longattn.relative_logits`); not with SortCut. With `document_ids` they are read on the
            laid-out positions, where the distance within a document is unchanged.
        _block_documents: Internal: the document of each block of rows already laid out that way.

    Returns:
        `[b, h, n, d_v]`; with `return_weights`, `(out, weights [b, h, n, n])`.

    Raises:
        ValueError: Causal SortCut, SortCut with `document_ids`, a `key_padding_mask` that is not a bool `[b, n]`
            tensor on q's device,
            `return_weights` with another back end than `"reference"`, or a back end that cannot run this call (the
            message says why).
    """
    if causal and sortcut:
        raise ValueError("SortCut has no causal form: every query attends to sorted mixtures of the whole sequence.")
    if return_weights and backend != "reference":
        raise ValueError(f"`return_weights`=True needs backend='reference' (the dense form), got backend={backend!r}.")
    key_padding_mask = check_token_mask("key_padding_mask", key_padding_mask, k.shape[0], k.shape[2], device=q.device)
    document_ids = check_document_ids(document_ids, k.shape[0], k.shape[2], device=q.device)
    relative_embedding = check_relative_embedding(relative_embedding, q)
    if relative_embedding is not None and sortcut:
        raise ValueError(
            f"relative_embedding cannot be used with SortCut (sortcut={sortcut}): its keys are mixtures of blocks, "
            "with no position to measure a distance to."
        )
    # A block longer than the keys is one block of them all: clamped to the keys, never allocated by its size.
    block_size = min(block_size, max(k.shape[2], 1))
    settings = dict(
        block_size=block_size,
        iterations=iterations,
        temperature=temperature,
        causal=causal,
        scale=scale,
        noise=noise,
        dropout_p=dropout_p,
        relative_embedding=relative_embedding,
    )
    if document_ids is not None:
        if sortcut:
            raise ValueError(
                f"SortCut (`sinkhorn_sortcut`={sortcut}) cannot run packed documents (`document_ids`): its keys are "
                "mixtures of every block of the row. Pad each document to its own row, or use Sinkhorn attention."
            )
        settings.update(backend=backend, return_weights=return_weights)
        return _per_document(q, k, v, sort_weight, document_ids, key_padding_mask, settings)
    if return_weights:  # the dense form also serves decoding (fewer queries than keys), which dispatch does not take
        choice = "reference"
    elif is_empty(q, k):
        return empty_attention(q, k, v)
    else:
        # "auto" is the PyTorch executor (the xformers path is explicit until measured): no dispatch on the hot path.
        choice = select_named_backend(
            backend,
            q,
            k,
            v,
            pattern="sinkhorn",
            dropout_p=dropout_p,
            causal=causal,
            key_padding=key_padding_mask is not None,
            relative_logits=relative_embedding is not None,
        )
    if choice == "reference":
        out, weights = _dense_attention(
            q, k, v, sort_weight, key_padding_mask, sortcut=sortcut, block_documents=_block_documents, **settings
        )
        return (out, weights) if return_weights else out
    b, h, n, d = q.shape
    s = block_size
    scale = default_scale(d) if scale is None else scale
    padded = key_padding_mask is not None or n % s != 0
    bias_fn = relative_bias(q, relative_embedding, scale=scale, kv_len=n)  # read on original positions
    q, k, v, valid, rotation = _prepare(q, k, v, key_padding_mask, s)
    blocks = q.shape[2] // s
    sort = sinkhorn_sort_matrix(
        k, valid, sort_weight, block_size=s, padded=padded, block_documents=_block_documents, **_sorting(settings)
    )  # [b, h, B, B]
    own_keys = 0
    if sortcut:
        keys, values, visible = _sortcut_keys(k, v, sort, min(sortcut, blocks), s)
        if not (padded or causal):  # every row of S sums to 1: every mixed block exists, no mask to apply
            visible = None
        if choice == "xformers":  # one key block that all queries share
            out = _attend_on_kernel(
                q, keys, values, visible=visible, queries_per_key_block=q.shape[2], scale=scale, dropout_p=dropout_p
            )
            return _restore(out, n, rotation)
        kv_index = kv_weight = None
        # [b, h, 1, 1, p·s] broadcast (its storage is p·s per head); None: every key visible.
        mask = None if visible is None else visible.expand(b, h, blocks, s, keys.shape[2])
    else:
        # Each block's own keys read in place (`own_keys`), then its sorted block gathered and weighted by S_ij*;
        # the mask is a function of the chunk (evaluated again in backward, never kept).
        kv_index, kv_weight, mask = _own_and_sorted_keys(sort, valid, s, causal=causal, padded=padded)
        kv_weight = kv_weight.to(k.dtype)
        if choice == "xformers":  # the keys materialised per block: [b, h, B·2s, d]
            keys, values = (_own_and_sorted_rows(x, kv_index, kv_weight).flatten(2, 3) for x in (k, v))
            visible = None if mask is None else mask(0, blocks)
            out = _attend_on_kernel(
                q, keys, values, visible=visible, queries_per_key_block=s, scale=scale, dropout_p=dropout_p
            )
            return _restore(out, n, rotation)
        keys, values, own_keys = k, v, s
    bias = None
    if bias_fn is not None:
        # The original position of every layout slot (padding slots: any position, they are hidden).
        position = torch.arange(n, device=q.device).expand(b, n) if rotation is None else rotation
        position = F.pad(position, (0, blocks * s - n))  # [b, B·s]
        kv_pos = _own_and_sorted_rows(position.view(b, 1, -1, 1), kv_index, None)[..., 0]  # [b, h, B, 2s]
        bias = block_bias(
            bias_fn, batch=b, heads=torch.arange(h, device=q.device), q_pos=position.view(b, blocks, s), kv_pos=kv_pos
        )  # [b, h, B, s, 2s]
    out, _ = attend_blocks(
        q.view(b, h, blocks, s, d),
        keys,
        values,
        kv_index=kv_index,
        mask=mask,
        scale=scale,
        dropout_p=dropout_p,
        kv_weight=kv_weight,
        bias=bias,
        own_keys=own_keys,
    )  # [b, h, B, s, d_v]
    return _restore(out.flatten(2, 3), n, rotation)


def _own_and_sorted_keys(
    sort: Tensor, valid: Tensor, s: int, *, causal: bool, padded: bool
) -> tuple[Tensor, Tensor, Callable[[int, int], Tensor] | None]:
    """What each query block attends to besides its own block (`attend_blocks`' `own_keys`): its sorted block
    j* = argmax_j S_ij, weighted by S_ij*, and which of the 2s keys each query sees.

    The sorted block is the soft permutation truncated to its largest entry (module docstring): `w · K_j*` and
    `w · V_j*` with w = S_ij*, through which the sorting network gets its gradient.

    Args:
        sort: S `[b, h, B, B]`.
        valid: Bool `[b, B·s]`, True = real token.
        s: Block size.
        causal: Own blocks are masked causally (sorted blocks lie entirely in the past).
        padded: Whether anything can be hidden (padding, an empty row of S); False with `causal` False: None mask.

    Returns:
        `(kv_index, kv_weight, visible)`: long `[b, h, B, s]` positions of the sorted block's keys, `[b, h, B, 1]`
        its weight S_ij* (differentiable), and None (every key visible) or a function of (start, stop) giving bool
        `[b, h, stop − start, s, 2s]` (own block, then sorted block) from `valid`, the index and the empty rows of S
        alone, O(n) tensors, so that the executor can evaluate it per chunk in forward and again in backward.
    """
    b, h, blocks, _ = sort.shape
    with torch.no_grad():
        source = sort.argmax(dim=-1, keepdim=True)  # [b, h, B, 1], the block sorted into place i
        kv_index = source * s + torch.arange(s, device=sort.device)  # [b, h, B, s]
    weight = sort.gather(-1, source)  # [b, h, B, 1]: S_ij*, carries the gradient
    if not (padded or causal):  # every key is visible and every row of S has a block (rows sum to 1)
        return kv_index, weight, None
    has_source = (weight > 0).detach()  # [b, h, B, 1]; False: an empty row of S (no real or no earlier block)
    own_valid = valid.reshape(b, 1, blocks, 1, s)
    earlier = torch.ones(s, s, dtype=torch.bool, device=sort.device).tril() if causal else None

    def visible(start: int, stop: int) -> Tensor:
        n_blk = stop - start
        own = own_valid[:, :, start:stop]
        own = own.expand(b, h, n_blk, s, s) if earlier is None else own & earlier  # [b, 1|h, n_blk, s, s]
        other = valid.gather(1, kv_index[:, :, start:stop].flatten(1)).view(b, h, n_blk, 1, s)
        other = other & has_source[:, :, start:stop, :, None]
        return torch.cat([own.expand(b, h, n_blk, s, s), other.expand(b, h, n_blk, s, s)], dim=-1)

    return kv_index, weight, visible


def _sortcut_keys(k: Tensor, v: Tensor, sort: Tensor, kept: int, s: int) -> tuple[Tensor, Tensor, Tensor]:
    """SortCut's keys: the first p sorted blocks as exact soft mixtures `Σ_j S_pj K_j` (values alike).

    Returns:
        `(keys [b, h, p·s, d], values [b, h, p·s, d_v], visible [b, h, 1, 1, p·s])`: a mixed block exists where
        its row of S is not empty (a real target block).
    """
    b, h, n, d = k.shape
    blocks = n // s
    mix = sort[:, :, :kept].to(k.dtype)  # [b, h, p, B]
    keys = torch.einsum("bhpj,bhjsd->bhpsd", mix, k.view(b, h, blocks, s, d)).reshape(b, h, kept * s, d)
    values = torch.einsum("bhpj,bhjsd->bhpsd", mix, v.view(b, h, blocks, s, -1)).reshape(b, h, kept * s, -1)
    present = (sort[:, :, :kept].sum(-1) > 0)[..., None].expand(b, h, kept, s)
    return keys, values, present.reshape(b, h, 1, 1, kept * s)


def _own_and_sorted_rows(x: Tensor, kv_index: Tensor, kv_weight: Tensor | None) -> Tensor:
    """Each block's own rows of `x [b, h|1, B·s, c]`, then its sorted rows `kv_index [b, h, B, s]` times `kv_weight`
    `[b, h, B, 1]` (None: unweighted): `[b, h, B, 2s, c]`, what `attend_blocks` reads with `own_keys=s`."""
    b, h, blocks, s = kv_index.shape
    x = x.expand(b, h, -1, -1)
    rows = x.gather(2, kv_index.reshape(b, h, blocks * s, 1).expand(b, h, blocks * s, x.shape[-1]))
    rows = rows.view(b, h, blocks, s, -1)
    if kv_weight is not None:
        rows = rows * kv_weight[..., None]
    return torch.cat([x.unflatten(2, (blocks, s)), rows], dim=3)


def _attend_on_kernel(
    q: Tensor,
    keys: Tensor,
    values: Tensor,
    *,
    visible: Tensor | None,
    queries_per_key_block: int,
    scale: float,
    dropout_p: float,
) -> Tensor:
    """Query blocks over their own key blocks as one call of the xformers kernel (`executor_xformers`' contract).

    Query block i (`queries_per_key_block` = m queries) attends to key block i (w keys): q `[b, h, B·m, d]`,
    keys `[b, h, B·w, d]`, values `[b, h, B·w, d_v]`, the blocks riding in the kernel's batch dim. Hidden keys get
    an additive bias of -`HALF_HIDDEN_PENALTY` (its rows 8-aligned in memory, as the kernels read them), and rows
    with no visible key are zeroed, as the PyTorch executor returns them.

    Args:
        visible: Bool `[b, h, B, 1 or m, w]`, True = visible; None = every key.

    Returns:
        `[b, h, B·m, d_v]`.
    """
    b, h, n_q, d = q.shape
    m = queries_per_key_block
    blocks = n_q // m
    w = keys.shape[2] // blocks

    def kernel_layout(x: Tensor, rows: int) -> Tensor:  # [b, h, B·rows, c] -> [b·B, rows, h, c]
        return x.reshape(b, h, blocks, rows, x.shape[-1]).permute(0, 2, 3, 1, 4).reshape(b * blocks, rows, h, -1)

    attn_bias = has_key = None
    if visible is not None:
        has_key = visible.any(dim=-1, keepdim=True)  # [b, h, B, 1 or m, 1]
        aligned = -(-w // 8) * 8
        attn_bias = torch.zeros(b, blocks, h, visible.shape[3], aligned, dtype=q.dtype, device=q.device)[..., :w]
        attn_bias.masked_fill_(~visible.permute(0, 2, 1, 3, 4), -HALF_HIDDEN_PENALTY)
        attn_bias = attn_bias.reshape(b * blocks, h, visible.shape[3], w).expand(b * blocks, h, m, w)
    out = current_kernel().attention(
        kernel_layout(q, m), kernel_layout(keys, w), kernel_layout(values, w), attn_bias, p=dropout_p, scale=scale
    )  # [b·B, m, h, d_v]
    out = out.view(b, blocks, m, h, -1).permute(0, 3, 1, 2, 4)  # [b, h, B, m, d_v]
    if has_key is not None:
        out = out * has_key
    return out.reshape(b, h, n_q, -1)


# ---------------------------------------------------------------------------------------------- dense form
def sinkhorn_attention_dense(
    q: Tensor, k: Tensor, v: Tensor, sort_weight: Tensor, **settings: Any
) -> tuple[Tensor, Tensor]:
    """The same attention as `sinkhorn_attention`, written over all m key positions (with its weights).

    `sinkhorn_attention(q, k, v, sort_weight, backend="reference", return_weights=True, **settings)`: the same
    keyword arguments (`block_size`, `iterations`, `temperature`, `causal`, `sortcut`, `key_padding_mask` `[b, m]`,
    `scale`, `noise`, `dropout_p`), but `backend`. Queries are the last n of the m key positions (cached decoding;
    n = m for `output_attentions`). The returned weights are the effective mixing weights over the original
    positions (`out = weights @ v`): for a sorted block, probability times S_ij*; for SortCut, the probabilities of
    the mixed keys spread over their source blocks by S.

    Returns:
        `(out [b, h, n, d_v], weights [b, h, n, m])`.

    Raises:
        ValueError: As `sinkhorn_attention`.
    """
    return sinkhorn_attention(q, k, v, sort_weight, backend="reference", return_weights=True, **settings)


def _dense_attention(q, k, v, sort_weight, key_padding_mask, *, block_size, sortcut, block_documents, **settings):
    """`sinkhorn_attention_dense` (the arguments of `sinkhorn_attention`, the key padding mask checked)."""
    s = block_size
    causal, scale, dropout_p = settings["causal"], settings["scale"], settings["dropout_p"]
    relative_embedding = settings["relative_embedding"]
    b, h, n, d = q.shape
    m = k.shape[2]
    scale = default_scale(d) if scale is None else scale
    dtype = compute_dtype(q.dtype)
    if is_empty(q, k):
        return empty_attention(q, k, v), q.new_zeros(b, h, n, m)
    valid = torch.ones(b, m, dtype=torch.bool, device=q.device) if key_padding_mask is None else key_padding_mask
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
    sort = sinkhorn_sort_matrix(
        k_l, valid_l, sort_weight, block_size=s, block_documents=block_documents, **_sorting(settings)
    ).to(dtype)  # [b, h, B, B]
    layout = torch.empty_like(rotation).scatter_(1, rotation, torch.arange(m, device=q.device).expand_as(rotation))
    q_layout = layout[:, m - n :]  # [b, n], layout position of each query
    q_block = torch.div(q_layout, s, rounding_mode="floor")
    key_block = torch.arange(m_pad, device=q.device) // s  # [m_pad]
    scores = torch.einsum("bhnd,bhmd->bhnm", q.to(dtype), k_l) * scale  # [b, h, n, m_pad]
    bias = 0.0
    if relative_embedding is not None:
        # On original positions: query m - n + i, layout key slot p holds position rotation[p] (padding slots: 0,
        # hidden).
        bias_fn = relative_bias(q, relative_embedding, scale=scale, kv_len=m)
        key_position = F.pad(rotation, (0, m_pad - m))[:, None, None, :]  # [b, 1, 1, m_pad]
        query_position = (m - n + torch.arange(n, device=q.device)).view(1, 1, n, 1)
        bias = bias_fn(
            torch.arange(b, device=q.device).view(b, 1, 1, 1),
            torch.arange(h, device=q.device).view(1, h, 1, 1),
            query_position,
            key_position,
        ).to(dtype)  # [b, h, n, m_pad]

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
        both = torch.cat(
            [
                (scores + bias).masked_fill(~own, -math.inf),
                (scores * q_weight[..., None] + bias).masked_fill(~other, -math.inf),
            ],
            dim=-1,
        )
        probs = _softmax_or_zero(both)  # [b, h, n, 2·m_pad]
        weights_layout = probs[..., :m_pad] + probs[..., m_pad:] * q_weight[..., None]
    weights_layout = weights_layout * valid[:, None, m - n :, None]  # padding queries: zero (as the fast path's
    # rotated-away padding would give garbage, not a defined output)
    dropped = F.dropout(weights_layout, p=dropout_p) if dropout_p > 0 else weights_layout
    out = torch.matmul(dropped, v_l)  # [b, h, n, d_v]
    weights = dropped[..., :m].gather(-1, layout[:, None, None, :].expand(b, h, n, m))  # back to positions
    return out.to(q.dtype), weights.to(q.dtype)


def _per_document(q, k, v, sort_weight, document_ids, key_padding_mask, settings) -> Tensor | tuple[Tensor, Tensor]:
    """`sinkhorn_attention` of packed rows: on rows laid out so that each document starts on a block boundary, with
    blocks sorted within their document (`settings`: its other arguments), gathered back (weights too)."""
    b, h, n, _ = q.shape
    s = settings["block_size"]
    position, real, slot = document_layout(document_ids, s)  # [b, S], [b, S], [b, n]
    valid = real if key_padding_mask is None else real & key_padding_mask.gather(1, position)
    block_documents = document_ids.gather(1, position[:, ::s])  # [b, B]: a block's first slot holds a token
    result = sinkhorn_attention(
        *(_take(x, position) for x in (q, k, v)),
        sort_weight,
        key_padding_mask=valid,
        _block_documents=block_documents,
        **settings,
    )
    if not settings["return_weights"]:
        return _take(result, slot)
    out, weights = result  # [b, h, S, d_v], [b, h, S, S]
    weights = weights.gather(2, slot[:, None, :, None].expand(b, h, n, weights.shape[3]))
    return _take(out, slot), weights.gather(3, slot[:, None, None, :].expand(b, h, n, n))


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
    supports_packing = True
    settings = ("block_size", "iterations", "temperature", "sortcut")

    def __init__(self, config: Any, *, layer_idx: int, is_causal: bool):
        super().__init__(config, layer_idx=layer_idx, is_causal=is_causal)
        self.sort_proj = nn.Linear(self.head_dim, self.head_dim, bias=False)

    @classmethod
    def length_multiple(cls, config, *, layer_idx):
        # The sequence is padded to whole blocks inside (`_prepare`): a batch padded there costs no extra work.
        return config.per_layer("sinkhorn_block_size", layer_idx)

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
            relative_embedding=self.relative_weight,
        )

    def attend(self, q, k, v, *, key_padding_mask, global_mask, document_ids=None):
        return sinkhorn_attention(
            q,
            k,
            v,
            key_padding_mask=key_padding_mask,
            backend=self.backend,
            document_ids=document_ids,
            **self._kwargs(),
        )

    def attend_dense(self, q, k, v, *, key_padding_mask, global_mask, document_ids=None):
        return sinkhorn_attention_dense(
            q, k, v, key_padding_mask=key_padding_mask, document_ids=document_ids, **self._kwargs()
        )
