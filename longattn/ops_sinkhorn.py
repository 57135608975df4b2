"""Sparse Sinkhorn attention and SortCut (Tay et al. 2020, "Sparse Sinkhorn Attention"), functional level.

The `"sinkhorn"` kind (`attention_sinkhorn.SinkhornAttention`) wraps `sinkhorn_attention` and its dense form.

Shape legend: b batch, h heads, n length, d head dim, B blocks (N_B in the paper), s block size, p SortCut budget.

The sequence is cut into blocks of `block_size`. A sorting network scores every (target block i, source block j)
pair from block summaries, and `iterations` rounds of Sinkhorn balancing in log space (Gumbel noise and
`temperature` in training, as in the paper) turn the scores into a doubly stochastic matrix S, a relaxed permutation
of the blocks.

- **Sorting network.** Block summaries are the mean keys of a block's real tokens. The score of (i, j) is
  `(u_i W) · u_j / sqrt(d)` with a learned `W` (`sort_weight`, d x d, shared by the heads), u_i the summary of block
  i. The paper's SortNet maps one summary to N_B scores with a dense layer, which fixes the number of blocks and so
  the sequence length; this bilinear form scores any number of blocks, and uses keys so that cached decoding can
  recompute it.
- **Sinkhorn attention.** Query block i attends to its own block and to its sorted block. The sorted block is the
  soft permutation truncated to its largest entry: the keys and values of block j* = argmax_j S_ij, scaled by
  S_ij* (what `S · K` gives when row i is one-hot, and the path by which the sorting network learns). Computing
  the full `S · K` would cost O(n · N_B · d), quadratic in n; this keeps the kind linear.
- **SortCut** (`sortcut` = p). After sorting, only the first p sorted blocks are kept, the exact soft mixtures
  `Σ_j S_qj K_j` for q < p, and every query attends to those p·s keys (and no local block, as in the paper's
  `Softmax(Q ψ_S(K)[:n]ᵀ) ψ_S(V)[:n]`). O(n · p · s).
- **Causal.** Block i must not see anything after its own tokens: its sorting row uses the summary of block i - 1
  (entirely in the past) and may pick only blocks j < i, its own block is masked causally, and the column
  normalisation of Sinkhorn runs cumulatively over the rows up to i, so that row i of S depends only on blocks
  up to i - 1 (plain Sinkhorn would let every later block reshape row i). Block 0 has no sorted block. SortCut has
  no causal form (every query would see the same sorted mixtures, built from the whole sequence): a `ValueError`.

Blocks start at each row's first real token (left padding is rotated to the end), so block boundaries, and thus
the output of real tokens, do not depend on padding.

Relative-position logits (`relative_embedding`): the pair of query i and key j, own or sorted block, gains
scale · q_i · r_{clip(j − i)} on the original positions, added to the logit as it is (not multiplied by S_ij*,
which scales the sorted key vector). SortCut's keys are mixtures of blocks, with no position: it refuses them.

Block pattern, 4 blocks, bidirectional (■ own block, ▣ sorted block; here S sorts 0→2, 1→0, 2→3, 3→1):

    ■ ⬚ ▣ ⬚
    ▣ ■ ⬚ ⬚
    ⬚ ⬚ ■ ▣
    ⬚ ▣ ⬚ ■

Each back end's executor is declared once, in `SINKHORN_STEPS`: the PyTorch blocked executor (`"auto"`, `"torch"`),
the attention step as one call of xformers' kernel (`"xformers"`), and the dense form over every key position
(`"reference"`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from .backends import runs_dense_form, select_step_executor
from .executor_families import StepExecutors
from .executor_gathered import attend_blocks
from .fused_kernel import current_kernel
from .numerics import HALF_HIDDEN_PENALTY, LOG_SPACE_HIDDEN, compute_dtype, default_scale, hide_exactly
from .ops_checks import check_attention_inputs, check_positive_int, empty_attention, is_empty
from .patterns import document_layout
from .relative_logits import block_bias, relative_bias

__all__ = [
    "SINKHORN_STEPS",
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
    return _take(out, _inverse(rotation))


def _inverse(rotation: Tensor) -> Tensor:
    """The inverse permutation `[b, n]` of each row of `rotation [b, n]`: where each original position went."""
    positions = torch.arange(rotation.shape[1], device=rotation.device).expand_as(rotation)
    return torch.empty_like(rotation).scatter_(1, rotation, positions)


# ---------------------------------------------------------------------------------------------- attention
class _SinkhornCall(NamedTuple):
    """One call of `sinkhorn_attention`, checked (`_checked_call`): the settings its executors read."""

    block_size: int  # s, clamped to the keys
    iterations: int
    temperature: float
    causal: bool
    sortcut: int | None
    key_padding_mask: Tensor | None  # bool [b, n], True = real token
    scale: float | None  # None: 1/sqrt(d)
    noise: bool
    dropout_p: float
    relative_embedding: Tensor | None  # [2M + 1, d]
    block_documents: Tensor | None  # the document of each block of rows laid out per document

    def sorting(self) -> dict[str, Any]:
        """The Sinkhorn balancing settings (`sinkhorn_sort_matrix`'s keywords)."""
        return dict(iterations=self.iterations, temperature=self.temperature, causal=self.causal, noise=self.noise)

    def resolved_scale(self, d: int) -> float:
        return default_scale(d) if self.scale is None else self.scale


def sinkhorn_attention(
    q: Tensor, k: Tensor, v: Tensor, sort_weight: Tensor, *, block_size: int, iterations: int, temperature: float,
    causal: bool = False, sortcut: int | None = None, key_padding_mask: Tensor | None = None,
    scale: float | None = None, noise: bool = False, dropout_p: float = 0.0, backend: str = "auto",
    return_weights: bool = False, document_ids: Tensor | None = None, relative_embedding: Tensor | None = None,
    _block_documents: Tensor | None = None,
) -> Tensor | tuple[Tensor, Tensor]:  # fmt: skip
    """Sparse Sinkhorn attention (or SortCut), O(n · s) (SortCut: O(n · p · s)); never an n x n score.

    The attention step runs through `executor_gathered.attend_blocks`: query block i reads its own block in place
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
            on a GPU); `"reference"`: the dense form, written over all key positions (`_dense_attention`). Each back
            end's executor: `SINKHORN_STEPS`.
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
        ValueError: Naming the argument: q, k, v that are not 4-d floating tensors of matching shapes, a
            `block_size` below 1, `iterations` below 0, a `temperature` that is not a finite float > 0, a `sortcut`
            below 1, a non-bool `causal`, `noise` or `return_weights`, a non-finite `scale`, `dropout_p` outside
            [0, 1); causal SortCut, SortCut with `document_ids`, a `key_padding_mask` that is not a bool `[b, n]`
            tensor on q's device,
            `return_weights` with another back end than `"reference"`, or a back end that cannot run this call (the
            message says why).
    """
    given = _SinkhornCall(
        block_size, iterations, temperature, causal, sortcut, key_padding_mask, scale, noise, dropout_p,
        relative_embedding, _block_documents,
    )  # fmt: skip
    call, document_ids = _checked_call(
        q, k, v, given, backend=backend, return_weights=return_weights, documents=document_ids
    )
    if document_ids is not None:
        return _per_document(q, k, v, sort_weight, document_ids, call, backend=backend, return_weights=return_weights)
    # The dense form also serves decoding (fewer queries than keys) and an empty call, with its weights.
    if not return_weights and is_empty(q, k):
        return empty_attention(q, k, v)
    # "auto" is the PyTorch executor (the xformers path is explicit until measured): no dispatch on the hot path.
    attention = select_step_executor(
        backend,
        SINKHORN_STEPS,
        q,
        k,
        v,
        dropout_p=dropout_p,
        causal=causal,
        key_padding=call.key_padding_mask is not None,
        relative_logits=call.relative_embedding is not None,
    )
    out, weights = attention(q, k, v, sort_weight, call)
    return (out, weights) if return_weights else out


def _checked_call(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    given: _SinkhornCall,
    *,
    backend: str,
    return_weights: bool,
    documents: Tensor | None,
) -> tuple[_SinkhornCall, Tensor | None]:
    """The arguments of `sinkhorn_attention` checked, in its documented order (the block size clamped to the keys),
    and its document ids.

    Raises:
        ValueError: As `sinkhorn_attention`.
    """
    inputs = check_attention_inputs(
        q, k, v, scale=given.scale, dropout_p=given.dropout_p, key_padding_mask=given.key_padding_mask,
        document_ids=documents, relative_embedding=given.relative_embedding,
        flags={"causal": given.causal, "noise": given.noise, "return_weights": return_weights},
    )  # fmt: skip
    check_positive_int("block_size", given.block_size, meaning="tokens per block")
    check_positive_int("iterations", given.iterations, minimum=0, meaning="Sinkhorn rounds")
    if (
        isinstance(given.temperature, bool)
        or not isinstance(given.temperature, (int, float))
        or not (math.isfinite(given.temperature) and given.temperature > 0)
    ):
        raise ValueError(f"temperature must be a finite float > 0 (Sinkhorn temperature), got {given.temperature!r}")
    if given.sortcut is not None:
        check_positive_int("sortcut", given.sortcut, meaning="SortCut's budget of mixed blocks, or None")
    sortcut = given.sortcut
    if given.causal and sortcut:
        raise ValueError("SortCut has no causal form: every query attends to sorted mixtures of the whole sequence.")
    if return_weights and not runs_dense_form(backend):
        raise ValueError(f"`return_weights`=True needs backend='reference' (the dense form), got backend={backend!r}.")
    documents, relative_embedding = inputs.document_ids, inputs.relative_embedding
    if relative_embedding is not None and sortcut:
        raise ValueError(
            f"relative_embedding cannot be used with SortCut (sortcut={sortcut}): its keys are mixtures of blocks, "
            "with no position to measure a distance to."
        )
    if documents is not None and sortcut:
        raise ValueError(
            f"SortCut (`sinkhorn_sortcut`={sortcut}) cannot run packed documents (`document_ids`): its keys are "
            "mixtures of every block of the row. Pad each document to its own row, or use Sinkhorn attention."
        )
    # A block longer than the keys is one block of them all: clamped to the keys, never allocated by its size.
    block_size = min(given.block_size, max(inputs.keys, 1))
    call = given._replace(
        block_size=block_size, scale=inputs.scale, dropout_p=inputs.dropout_p,
        key_padding_mask=inputs.key_padding_mask, relative_embedding=relative_embedding,
    )  # fmt: skip
    return call, documents


def _per_document(
    q, k, v, sort_weight, document_ids, call: _SinkhornCall, *, backend: str, return_weights: bool
) -> Tensor | tuple[Tensor, Tensor]:
    """`sinkhorn_attention` of packed rows: on rows laid out so that each document starts on a block boundary, with
    blocks sorted within their document, gathered back (weights too)."""
    b, h, n, _ = q.shape
    s = call.block_size
    position, real, slot = document_layout(document_ids, s)  # [b, S], [b, S], [b, n]
    padding = call.key_padding_mask
    valid = real if padding is None else real & padding.gather(1, position)
    settings = call._replace(key_padding_mask=valid)._asdict()
    settings["_block_documents"] = document_ids.gather(1, position[:, ::s])  # [b, B]: a block's first slot is real
    del settings["block_documents"]
    result = sinkhorn_attention(
        *(_take(x, position) for x in (q, k, v)),
        sort_weight,
        backend=backend,
        return_weights=return_weights,
        **settings,
    )
    if not return_weights:
        return _take(result, slot)
    out, weights = result  # [b, h, S, d_v], [b, h, S, S]
    weights = weights.gather(2, slot[:, None, :, None].expand(b, h, n, weights.shape[3]))
    return _take(out, slot), weights.gather(3, slot[:, None, None, :].expand(b, h, n, n))


# ---------------------------------------------------------------------------------------------- the executors
class _SortedBlocks(NamedTuple):
    """The blocks of one call and their sorting matrix (`_sorted_blocks`), what the blocked executors read."""

    q: Tensor  # [b, h, B·s, d]: rotated (left padding to the end), padded to whole blocks
    k: Tensor  # [b, h, B·s, d], padding zeroed
    v: Tensor  # [b, h, B·s, d_v], padding zeroed
    valid: Tensor  # bool [b, B·s], True = real token
    rotation: Tensor | None  # [b, n]: the original position of each layout slot; None: not rotated
    sort: Tensor  # S [b, h, B, B]
    padded: bool  # anything can be hidden (padding or a partial last block)
    scale: float


def _sorted_blocks(q: Tensor, k: Tensor, v: Tensor, sort_weight: Tensor, call: _SinkhornCall) -> _SortedBlocks:
    """The call's inputs in whole blocks starting at each row's first real token, and S (`sinkhorn_sort_matrix`)."""
    s = call.block_size
    padded = call.key_padding_mask is not None or q.shape[2] % s != 0
    scale = call.resolved_scale(q.shape[-1])
    q, k, v, valid, rotation = _prepare(q, k, v, call.key_padding_mask, s)
    sort = sinkhorn_sort_matrix(
        k, valid, sort_weight, block_size=s, padded=padded, block_documents=call.block_documents, **call.sorting()
    )  # [b, h, B, B]
    return _SortedBlocks(q, k, v, valid, rotation, sort, padded, scale)


def _sorted_keys(blocks: _SortedBlocks, call: _SinkhornCall):
    """`_own_and_sorted_keys` of the blocks, its weight in the keys' dtype."""
    kv_index, kv_weight, mask = _own_and_sorted_keys(
        blocks.sort, blocks.valid, call.block_size, causal=call.causal, padded=blocks.padded
    )
    return kv_index, kv_weight.to(blocks.k.dtype), mask


def _mixed_keys(blocks: _SortedBlocks, call: _SinkhornCall) -> tuple[Tensor, Tensor, Tensor | None]:
    """SortCut's keys, values and visible keys (`_sortcut_keys`); None: every mixed block exists."""
    kept = min(call.sortcut, blocks.q.shape[2] // call.block_size)
    keys, values, visible = _sortcut_keys(blocks.k, blocks.v, blocks.sort, kept, call.block_size)
    if not (blocks.padded or call.causal):  # every row of S sums to 1: every mixed block exists, no mask to apply
        visible = None
    return keys, values, visible


def _sinkhorn_on_blocks(q: Tensor, k: Tensor, v: Tensor, sort_weight: Tensor, call: _SinkhornCall):
    """The PyTorch executor (`"auto"`, `"torch"`): the attention step on `attend_blocks`. Returns `(out, None)`."""
    b, h, n, d = q.shape
    s = call.block_size
    bias_fn = relative_bias(q, call.relative_embedding, scale=call.resolved_scale(d), kv_len=n)  # original positions
    blocks = _sorted_blocks(q, k, v, sort_weight, call)
    n_blocks = blocks.q.shape[2] // s
    if call.sortcut:
        keys, values, visible = _mixed_keys(blocks, call)
        kv_index = kv_weight = None
        # [b, h, 1, 1, p·s] broadcast (its storage is p·s per head); None: every key visible.
        mask = None if visible is None else visible.expand(b, h, n_blocks, s, keys.shape[2])
        own_keys = 0
    else:
        # Each block's own keys read in place (`own_keys`), then its sorted block gathered and weighted by S_ij*;
        # the mask is a function of the chunk (evaluated again in backward, never kept).
        kv_index, kv_weight, mask = _sorted_keys(blocks, call)
        keys, values, own_keys = blocks.k, blocks.v, s
    bias = None if bias_fn is None else _relative_block_bias(bias_fn, blocks.rotation, kv_index, n, s)
    out, _ = attend_blocks(
        blocks.q.view(b, h, n_blocks, s, d), keys, values, kv_index=kv_index, mask=mask, scale=blocks.scale,
        dropout_p=call.dropout_p, kv_weight=kv_weight, bias=bias, own_keys=own_keys,
    )  # fmt: skip
    # out: [b, h, B, s, d_v]
    return _restore(out.flatten(2, 3), n, blocks.rotation), None


def _sinkhorn_on_kernel(q: Tensor, k: Tensor, v: Tensor, sort_weight: Tensor, call: _SinkhornCall):
    """The `"xformers"` back end: the attention step as one call of the fused kernel (`_attend_on_kernel`).
    Returns `(out, None)`."""
    n = q.shape[2]
    s = call.block_size
    blocks = _sorted_blocks(q, k, v, sort_weight, call)
    if call.sortcut:  # one key block that all queries share
        keys, values, visible = _mixed_keys(blocks, call)
        queries_per_key_block = blocks.q.shape[2]
    else:  # the keys materialised per block: [b, h, B·2s, d]
        kv_index, kv_weight, mask = _sorted_keys(blocks, call)
        keys, values = (_own_and_sorted_rows(x, kv_index, kv_weight).flatten(2, 3) for x in (blocks.k, blocks.v))
        visible = None if mask is None else mask(0, blocks.q.shape[2] // s)
        queries_per_key_block = s
    out = _attend_on_kernel(
        blocks.q, keys, values, visible=visible, queries_per_key_block=queries_per_key_block, scale=blocks.scale,
        dropout_p=call.dropout_p,
    )  # fmt: skip
    return _restore(out, n, blocks.rotation), None


def _relative_block_bias(bias_fn, rotation: Tensor | None, kv_index: Tensor, n: int, s: int) -> Tensor:
    """The relative logits `[b, h, B, s, 2s]` of each query block over its own, then its sorted keys, read on the
    original positions of the layout slots (padding slots: any position, they are hidden)."""
    b, h, blocks, _ = kv_index.shape
    device = kv_index.device
    position = torch.arange(n, device=device).expand(b, n) if rotation is None else rotation
    position = F.pad(position, (0, blocks * s - n))  # [b, B·s]
    kv_pos = _own_and_sorted_rows(position.view(b, 1, -1, 1), kv_index, None)[..., 0]  # [b, h, B, 2s]
    return block_bias(
        bias_fn, batch=b, heads=torch.arange(h, device=device), q_pos=position.view(b, blocks, s), kv_pos=kv_pos
    )


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


class _DenseLayout(NamedTuple):
    """The keys of the dense form in the blocked layout (rotated, padded to whole blocks), in the compute dtype."""

    keys: Tensor  # [b, h, m_pad, d], padding zeroed
    values: Tensor  # [b, h, m_pad, d_v], padding zeroed
    valid: Tensor  # bool [b, m_pad]
    rotation: Tensor  # [b, m]: the original position of each layout slot
    layout: Tensor  # [b, m]: the layout slot of each original position


def _dense_layout(k: Tensor, v: Tensor, valid: Tensor, s: int, dtype: torch.dtype) -> _DenseLayout:
    """Keys and values in the blocked layout, and the layout slot of every original key position."""
    m = k.shape[2]
    rotation = _left_aligned(valid)
    k_l, v_l = _take(k.to(dtype), rotation), _take(v.to(dtype), rotation)
    valid_l = valid.gather(1, rotation)
    m_pad = -(-m // s) * s
    k_l, v_l = F.pad(k_l, (0, 0, 0, m_pad - m)), F.pad(v_l, (0, 0, 0, m_pad - m))
    valid_l = F.pad(valid_l, (0, m_pad - m), value=False)
    keep = valid_l[:, None, :, None].to(dtype)
    return _DenseLayout(k_l * keep, v_l * keep, valid_l, rotation, _inverse(rotation))


def _sinkhorn_dense(q: Tensor, k: Tensor, v: Tensor, sort_weight: Tensor, call: _SinkhornCall):
    """The `"reference"` back end: the dense form (`sinkhorn_attention_dense`, its key padding mask checked), over
    all key positions. Returns `(out [b, h, n, d_v], weights [b, h, n, m])`."""
    s = call.block_size
    b, h, n, d = q.shape
    m = k.shape[2]
    scale = call.resolved_scale(d)
    dtype = compute_dtype(q.dtype)
    if is_empty(q, k):
        return empty_attention(q, k, v), q.new_zeros(b, h, n, m)
    padding = call.key_padding_mask
    valid = torch.ones(b, m, dtype=torch.bool, device=q.device) if padding is None else padding
    keys = _dense_layout(k, v, valid, s, dtype)
    sort = sinkhorn_sort_matrix(
        keys.keys, keys.valid, sort_weight, block_size=s, block_documents=call.block_documents, **call.sorting()
    ).to(dtype)  # [b, h, B, B]
    scores = torch.einsum("bhnd,bhmd->bhnm", q.to(dtype), keys.keys) * scale  # [b, h, n, m_pad]
    if call.sortcut:
        weights_layout = _dense_sortcut_weights(scores, sort[:, :, : min(call.sortcut, sort.shape[2])], s)
    else:
        bias = _dense_relative_bias(q, call.relative_embedding, scale, keys.rotation, scores.shape[-1], dtype)
        q_layout = keys.layout[:, m - n :]  # [b, n], layout position of each query
        weights_layout = _dense_sorted_weights(scores, bias, sort, q_layout, keys.valid, s, causal=call.causal)
    weights_layout = weights_layout * valid[:, None, m - n :, None]  # padding queries: zero (as the fast path's
    # rotated-away padding would give garbage, not a defined output)
    dropped = F.dropout(weights_layout, p=call.dropout_p) if call.dropout_p > 0 else weights_layout
    out = torch.matmul(dropped, keys.values)  # [b, h, n, d_v]
    weights = dropped[..., :m].gather(-1, keys.layout[:, None, None, :].expand(b, h, n, m))  # back to positions
    return out.to(q.dtype), weights.to(q.dtype)


def _dense_relative_bias(
    q: Tensor, embedding: Tensor | None, scale: float, rotation: Tensor, m_pad: int, dtype: torch.dtype
) -> Tensor | float:
    """The relative logits `[b, h, n, m_pad]` of the queries (the last n of m positions) for every layout key slot,
    on original positions (padding slots: position 0, hidden); 0 without an embedding."""
    if embedding is None:
        return 0.0
    b, h, n, _ = q.shape
    m = rotation.shape[1]
    bias_fn = relative_bias(q, embedding, scale=scale, kv_len=m)
    key_position = F.pad(rotation, (0, m_pad - m))[:, None, None, :]  # [b, 1, 1, m_pad]
    query_position = (m - n + torch.arange(n, device=q.device)).view(1, 1, n, 1)
    return bias_fn(
        torch.arange(b, device=q.device).view(b, 1, 1, 1),
        torch.arange(h, device=q.device).view(1, h, 1, 1),
        query_position,
        key_position,
    ).to(dtype)  # [b, h, n, m_pad]


def _dense_sortcut_weights(scores: Tensor, mix: Tensor, s: int) -> Tensor:
    """SortCut's weights `[b, h, n, m_pad]` over the layout keys from the scores `[b, h, n, m_pad]` and the kept rows
    of S `mix [b, h, p, B]`."""
    b, h, n, m_pad = scores.shape
    kept, blocks = mix.shape[2], mix.shape[3]
    # Mixed key (p, t) = Σ_j S_pj K[j·s + t]; its score is Σ_j S_pj (q · K[j·s + t]).
    per_block = scores.view(b, h, n, blocks, s)
    mixed = torch.einsum("bhpj,bhnjt->bhnpt", mix, per_block).reshape(b, h, n, kept * s)
    present = (mix.sum(-1) > 0)[:, :, None, :, None].expand(b, h, n, kept, s).reshape(b, h, n, kept * s)
    probs = _softmax_or_zero(hide_exactly(mixed, ~present))  # [b, h, n, p·s]
    # Spread back: weight of layout key j·s + t = Σ_p probs[p, t] · S_pj.
    return torch.einsum("bhnpt,bhpj->bhnjt", probs.view(b, h, n, kept, s), mix).reshape(b, h, n, m_pad)


def _dense_sorted_weights(
    scores: Tensor, bias: Tensor | float, sort: Tensor, q_layout: Tensor, valid: Tensor, s: int, *, causal: bool
) -> Tensor:
    """Sinkhorn attention's weights `[b, h, n, m_pad]` over the layout keys: each query's own block and its sorted
    block, whose keys are scaled by S_ij* (score w·(q·k), value w·v; the same key may appear twice)."""
    b, h, n, m_pad = scores.shape
    device = scores.device
    q_block = torch.div(q_layout, s, rounding_mode="floor")[:, None, :].expand(b, h, n)  # [b, h, n]
    key_block = torch.arange(m_pad, device=device) // s  # [m_pad]
    source = sort.argmax(dim=-1)  # [b, h, B]
    q_source = source.gather(-1, q_block)  # [b, h, n]
    q_weight = sort.gather(-1, source.unsqueeze(-1)).squeeze(-1).gather(-1, q_block)
    q_has = (sort.amax(dim=-1) > 0).gather(-1, q_block)
    own = (key_block == q_block[:, :1, :, None]) & valid[:, None, None, :]  # [b, 1, n, m_pad]
    if causal:
        own = own & (torch.arange(m_pad, device=device) <= q_layout[..., None])[:, None]
    other = (key_block == q_source[..., None]) & valid[:, None, None, :] & q_has[..., None]  # [b, h, n, m_pad]
    both = torch.cat(
        [
            hide_exactly(scores + bias, ~own),
            hide_exactly(scores * q_weight[..., None] + bias, ~other),
        ],
        dim=-1,
    )
    probs = _softmax_or_zero(both)  # [b, h, n, 2·m_pad]
    return probs[..., :m_pad] + probs[..., m_pad:] * q_weight[..., None]


def _softmax_or_zero(scores: Tensor) -> Tensor:
    """Softmax over the last dim; rows without any finite score give zeros (not NaN)."""
    sees = ~torch.isneginf(scores).all(dim=-1, keepdim=True)
    return torch.softmax(scores.masked_fill(~sees, 0.0), dim=-1) * sees


SINKHORN_STEPS = StepExecutors(
    "Sinkhorn",
    "sinkhorn",
    {"torch": _sinkhorn_on_blocks, "xformers": _sinkhorn_on_kernel, "reference": _sinkhorn_dense},
)
"""Sinkhorn attention's executor per back end, `executor(q, k, v, sort_weight, call) -> (out, weights or None)`."""
