"""Reformer LSH attention (Kitaev et al. 2020, "Reformer: The Efficient Transformer"), functional level.

The `"lsh"` kind (`attention_lsh.LSHAttention`) wraps `lsh_attention`; routing and Sinkhorn attention reuse its
window kernel `attend_windows` and the row gathers.

Shape legend: b batch, h heads, n length (m keys when it differs), d head dim, r hash rounds, nb buckets,
c chunk length (`bucket_size`), nc chunks per round, w keys gathered per chunk.

Queries and keys share one projection (shared-QK). Each hash round rotates the vectors with a random matrix and
takes the bucket `argmax([xR, -xR])` (angular LSH, Andoni et al. 2015), so that vectors pointing the same way tend to
share a bucket. Tokens are sorted by (bucket, position), the sorted sequence is cut into chunks of `bucket_size`,
and every chunk attends to itself and `num_chunks_before` / `num_chunks_after` neighbouring chunks of the same
round. The rounds are combined by their log-sum-exp weights, which equals one softmax over the keys of all rounds
(a key found by two rounds counts twice, as in the paper's implementation).

The sorted rounds are laid out in one buffer with zero chunks between them, so a chunk's keys (itself and its
neighbours) are a contiguous window of rows: `attend_windows` runs the batched matmuls over `[b·h·r·nc, c, w]` on
strided views of that buffer, in cache-sized groups, with a hand-written backward. Routing and Sinkhorn attention
reuse that kernel for their clusters and blocks.

Without dropout, LSH and routing never build that buffer: `attend_gathered_windows` takes the unsorted rows and the
index of every buffer row, gathers one group of chunks at a time (in forward, and again in backward), and merges the
hash rounds (routing: the clusters) of each position by log-sum-exp inside the kernel. Backward then keeps O(n·d)
floats and integer indices, as dense attention through SDPA does, instead of r sorted copies of q, k, v and their
r·n·w probabilities.

The steps live in flat sibling modules: `ops_lsh_hashing` (rotations, buckets, the shared-QK key normalisation),
`ops_lsh_sorting` (sorting by bucket, the buffer layout, the gathers and un-sorting, the merge of the rounds),
`ops_lsh_chunks` (attention over the windows of the sorted chunks, also on the xformers kernel) and
`ops_lsh_gathered` (the same windows gathered by index). This module keeps the entry points (`lsh_attention`,
`lsh_attention_dense`), the argument checks, the executor of each back end (`LSH_STEPS`), and re-exports the steps'
public names.

Conventions shared with transformers' `ReformerModel` (`LSHSelfAttention`), so that both give the same output at
the same rotations and settings (see tests/test_lsh.py):

- keys are normalised to unit length, and scores are q·k̂ with no 1/sqrt(d) scaling;
- a query attends to itself only when no other key is visible: its own score is replaced by -1e5, so the self key
  gets a weight of exactly 0 in float32 as soon as anything else is visible;
- padding tokens go to an extra bucket after all others, and are masked as keys.

Where this implementation differs, on purpose:

- Chunk neighbours stay inside their hash round and do not wrap around (trax and transformers concatenate the rounds
  and look back circularly, so the first chunk of round 2 sees the last chunk of round 1). Without the wrap the
  output of a real token does not depend on how much padding follows it.
- **Causal LSH.** Sorting the whole sequence and then chunking leaks: where a chunk boundary falls depends on how
  many *later* tokens hashed into lower buckets. Here a causal query sees exactly the most recent
  `bucket_size · num_chunks_before` earlier keys *of its own bucket* (all of them when the bucket holds fewer). In
  the (bucket, position) order these are the nearest preceding entries of the same bucket, so a band over the
  sorted sequence computes them, and which keys they are depends only on earlier tokens.
- The number of buckets is fixed per model (`lsh_num_buckets`, by default derived from
  `max_position_embeddings`), not from the current length, so that padding and cached decoding do not change the
  hashing.

Pattern for one round, 12 tokens, chunks of 3, one chunk before (rows: queries in sorted order, ■ visible):

    ■ ■ ■ ⬚ ⬚ ⬚ ⬚ ⬚ ⬚ ⬚ ⬚ ⬚
    ■ ■ ■ ⬚ ⬚ ⬚ ⬚ ⬚ ⬚ ⬚ ⬚ ⬚      chunk 0 sees itself only (no wrap)
    ■ ■ ■ ⬚ ⬚ ⬚ ⬚ ⬚ ⬚ ⬚ ⬚ ⬚
    ■ ■ ■ ■ ■ ■ ⬚ ⬚ ⬚ ⬚ ⬚ ⬚
    ■ ■ ■ ■ ■ ■ ⬚ ⬚ ⬚ ⬚ ⬚ ⬚      chunk 1 sees chunks 0 and 1
    ...                           (the diagonal, a query's own key, only when nothing else is visible)
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from .executor_families import StepExecutors
from .numerics import compute_dtype, default_scale, hide_exactly
from .ops_checks import (
    check_attention_inputs,
    check_document_ids,
    check_positive_int,
    check_token_mask,
    empty_attention,
    inert_padding,
    is_empty,
)
from .ops_lsh_chunks import (
    SELF_SCORE,
    attend_windows,
    attend_windows_on_kernel,
    select_windows_executor,
)
from .ops_lsh_gathered import RelativeColumns, attend_gathered_windows
from .ops_lsh_hashing import (
    KEY_NORM_EPS,
    Buckets,
    default_num_buckets,
    document_buckets,
    hash_factors,
    lsh_buckets,
    lsh_rotations,
    normalize_keys,
)
from .ops_lsh_sorting import (
    _at_key_rows,
    _combine_rounds,
    _copy_inverse,
    _LshCall,
    _same_in_window,
    _scatter_index,
    _sorted_rounds,
    _SortedRounds,
    gather_rows,
    head_rows,
)
from .relative_logits import check_relative_embedding, materialize_bias, relative_bias, relative_logit_table

__all__ = [
    "RelativeColumns",
    "SELF_SCORE",
    "attend_windows",
    "attend_windows_on_kernel",
    "default_num_buckets",
    "gather_rows",
    "head_rows",
    "lsh_attention",
    "lsh_attention_dense",
    "lsh_buckets",
    "lsh_rotations",
    "normalize_keys",
    "select_windows_executor",
]

# The `backend=` values LSH attention cannot honour, and why: its chunked windows are not a mask over positions.
_UNSUPPORTED_BACKENDS = {
    "flex": "FlexAttention evaluates a predicate over positions, and LSH's keys depend on the sorted hash buckets "
    "and chunk boundaries of each round, merged over rounds by log-sum-exp, with the self key as a fallback",
}


# ---------------------------------------------------------------------------------------------- the executor
def _check_rotations(rotations: Tensor, *, heads: int, head_dim: int, num_buckets: Buckets | None) -> None:
    """Refuse rotations that are not a floating-point `[h or 1, d, r, Σ factors/2]` tensor (r >= 1).

    Raises:
        ValueError: Naming `rotations`, its shape or dtype, and the shape expected.
    """
    columns = None if num_buckets is None else sum(f // 2 for f in hash_factors(num_buckets))
    expected = f"[{heads} or 1, {head_dim}, num_hashes >= 1, {columns if columns else 'num_buckets / 2 >= 1'}]"
    if not isinstance(rotations, Tensor) or not rotations.is_floating_point():
        raise ValueError(
            f"rotations must be a floating-point tensor {expected}, got "
            f"{rotations.dtype if isinstance(rotations, Tensor) else type(rotations).__name__}"
        )
    shape = tuple(rotations.shape)
    if (
        len(shape) != 4
        or shape[0] not in (1, heads)
        or shape[1] != head_dim
        or shape[2] < 1
        or shape[3] < 1
        or (columns is not None and shape[3] != columns)
    ):
        raise ValueError(f"rotations must have shape {expected}, got {shape}")


def lsh_attention(
    qk: Tensor, v: Tensor, *, num_hashes: int, bucket_size: int, num_buckets: Buckets | None = None,
    num_chunks_before: int = 1, num_chunks_after: int = 0, causal: bool = False,
    key_padding_mask: Tensor | None = None, rotations: Tensor | None = None, seed: int | None = None,
    dropout_p: float = 0.0, backend: str = "auto", document_ids: Tensor | None = None,
    relative_embedding: Tensor | None = None,
) -> Tensor:  # fmt: skip
    """Reformer LSH attention with shared queries and keys, in O(n·log n + n·r·c·w) time.

    See the module docstring for the mechanism. Costs r·n·(1 + before + after)·c scores per head, never n².

    Args:
        qk: Shared queries/keys `[b, h, n, d]` (before normalisation).
        v: Values `[b, h, n, d_v]`.
        num_hashes: Hash rounds r (ignored when `rotations` is given: its size decides).
        bucket_size: Chunk length c of the sorted sequence.
        num_buckets: Buckets per round: an even int, or a tuple of even factors (a factorised hash). Default:
            `default_num_buckets(n, bucket_size)` without `rotations`, one hash of `2 · rotations.shape[-1]`
            buckets with them.
        num_chunks_before: Earlier chunks each chunk also attends to (causal: the band of earlier keys of the same
            bucket is `bucket_size · num_chunks_before` long).
        num_chunks_after: Later chunks each chunk also attends to (not used when causal).
        causal: A query sees only earlier keys of its own bucket (see the module docstring).
        key_padding_mask: Bool `[b, n]`, True = real token.
        document_ids: Integer `[b, n]`, the document of each token of packed rows (contiguous runs of one id): a
            bucket holds the tokens of one document only (`document_buckets`), and chunk neighbours of another
            document are hidden, so no query attends to another document's key.
        rotations: Explicit rotations `[h or 1, d, r, Σ factors/2]` (e.g. transformers'); override the seed.
        seed: Seed of the rotations (`lsh_rotations`); None = fresh random rotations.
        dropout_p: Dropout on the attention probabilities.
        backend: `"auto"` or `"torch"` (both the windowed kernel), `"xformers"` (the same windows on xformers'
            kernel, `attend_windows_on_kernel`; CUDA, no dropout; `"auto"` does not pick it until it is measured on
            a GPU), or `"reference"`: `lsh_attention_dense` at the same rotations, O(r · n²) memory, for tests (it
            equals the kernel on real tokens; padded queries and the dropout draws may differ). `"flex"` cannot
            run LSH attention. Each back end's executor: `LSH_STEPS`.
        relative_embedding: Optional r `[2M + 1, d]`: relative-position logits (`longattn.relative_logits`), scale
            1/sqrt(d) · q·r of the clipped distance between the original positions of each pair a chunk computes.

    Returns:
        Output `[b, h, n, d_v]`.

    Raises:
        ValueError: qk and v that are not floating-point tensors `[b, h, n, d]`, `[b, h, n, d_v]` of one dtype
            and device, `num_hashes` or `bucket_size` below 1, negative chunk counts, a causal call without an
            earlier chunk, invalid `num_buckets` or `rotations`, a non-bool `causal`, a mask that is not bool
            `[b, n]`, `dropout_p` outside [0, 1), or a `backend` that is unknown or cannot run LSH attention (the
            message says why).
    """
    given = _LshCall(
        rotations, num_buckets, bucket_size, num_chunks_before, num_chunks_after, causal, key_padding_mask,
        dropout_p, document_ids, relative_embedding,
    )  # fmt: skip
    call = _checked_call(qk, v, given, num_hashes=num_hashes, seed=seed, backend=backend)
    if is_empty(qk, qk):
        return empty_attention(qk, qk, v)
    # Padding may hold anything: zeroed, it hashes to a fixed bucket and its value adds nothing. A query whose
    # whole row is padding then attends to its own (zero) value only: zeros, the rule of every op.
    qk, v = inert_padding(call.key_padding_mask, qk, v)
    call = _with_rotations(call, qk, num_hashes=num_hashes, seed=seed)
    attention = select_windows_executor(
        backend, LSH_STEPS, qk, qk, v, call.key_padding_mask, call.relative_embedding, call.dropout_p, call.causal
    )
    return attention(qk, v, call)


def _checked_call(qk: Tensor, v: Tensor, given: _LshCall, *, num_hashes: int, seed: int | None, backend: str):
    """The arguments of `lsh_attention` checked, in its documented order: an `_LshCall` (rotations as given).

    Raises:
        ValueError: As `lsh_attention`.
    """
    inputs = check_attention_inputs(
        qk, qk, v, dropout_p=given.dropout_p, key_padding_mask=given.key_padding_mask,
        document_ids=given.document_ids, relative_embedding=given.relative_embedding,
        flags={"causal": given.causal}, names=("qk", "qk", "v"),
    )  # fmt: skip
    bucket_size = check_positive_int(
        "bucket_size", given.bucket_size, meaning="the chunk length of the sorted sequence"
    )
    num_chunks_before = check_positive_int("num_chunks_before", given.num_chunks_before, minimum=0)
    num_chunks_after = check_positive_int("num_chunks_after", given.num_chunks_after, minimum=0)
    causal = given.causal
    if causal and num_chunks_before < 1:
        raise ValueError("causal LSH needs num_chunks_before >= 1 (the band of earlier keys is empty otherwise).")
    if given.num_buckets is not None:
        hash_factors(given.num_buckets)
    if given.rotations is None:
        check_positive_int("num_hashes", num_hashes, meaning="the number of hash rounds")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise ValueError(f"seed must be an int or None, got {seed!r}")
    else:
        _check_rotations(given.rotations, heads=inputs.heads, head_dim=qk.shape[3], num_buckets=given.num_buckets)
    LSH_STEPS.check(backend)
    return given._replace(
        bucket_size=bucket_size, num_chunks_before=num_chunks_before, num_chunks_after=num_chunks_after,
        key_padding_mask=inputs.key_padding_mask, dropout_p=inputs.dropout_p, document_ids=inputs.document_ids,
        relative_embedding=inputs.relative_embedding,
    )  # fmt: skip


def _with_rotations(call: _LshCall, qk: Tensor, *, num_hashes: int, seed: int | None) -> _LshCall:
    """`call` with rotations: those given, else drawn (`lsh_rotations`, from `seed`) for its bucket count, by
    default `default_num_buckets` of the length."""
    if call.rotations is not None:
        return call
    _, h, n, d = qk.shape
    num_buckets = default_num_buckets(n, call.bucket_size) if call.num_buckets is None else call.num_buckets
    rotations = lsh_rotations(
        heads=h, head_dim=d, num_hashes=num_hashes, num_buckets=num_buckets, seed=seed, device=qk.device
    )
    return call._replace(rotations=rotations, num_buckets=num_buckets)


# ---------------------------------------------------------------------------------------------- LSH's executors
def _lsh_dense(qk: Tensor, v: Tensor, call: _LshCall) -> Tensor:
    """The `"reference"` back end: the dense form (`lsh_attention_dense`) at the SAME rotations and bucket count,
    so both hash every token alike."""
    out, _ = lsh_attention_dense(qk, qk, v, **call._asdict())
    return out


def _lsh_on_windows(qk: Tensor, v: Tensor, call: _LshCall) -> Tensor:
    """The PyTorch executor (`"auto"`, `"torch"`). Without dropout, neither the sorted copies nor the probabilities
    are kept: the kernel gathers the rows of each group of chunks in forward and again in backward, and merges the
    rounds of every position by log-sum-exp (`attend_gathered_windows`). With dropout, `attend_windows` on the sorted
    copies."""
    rounds = _sorted_rounds(qk, v, call)
    relative = _relative_positions(qk, call, rounds)
    if call.dropout_p == 0.0:
        return _gathered_rounds(qk, v, call, rounds, relative)
    return _copied_rounds(qk, v, call, rounds, relative, attend_windows)


def _lsh_on_kernel(qk: Tensor, v: Tensor, call: _LshCall) -> Tensor:
    """The `"xformers"` back end: the windows of the sorted copies on xformers' kernel (`attend_windows_on_kernel`)."""
    rounds = _sorted_rounds(qk, v, call)
    return _copied_rounds(qk, v, call, rounds, _relative_positions(qk, call, rounds), attend_windows_on_kernel)


LSH_STEPS = StepExecutors(
    "LSH",
    "windows",
    {"torch": _lsh_on_windows, "reference": _lsh_dense, "xformers": _lsh_on_kernel},
    refused=_UNSUPPORTED_BACKENDS,
)
"""LSH attention's executor per back end, `executor(qk, v, call) -> out`: `"auto"` is always the windowed kernel;
`"xformers"` runs its windows as one kernel call (explicit only)."""


def _relative_positions(qk: Tensor, call: _LshCall, rounds: _SortedRounds) -> dict[str, Tensor]:
    """The relative-position arguments of the window kernels (`relative_table`, `query_position`, `key_position`),
    none without an embedding: the O(n · M) table of every (batch, head, position), read per pair at the original
    positions; its rows are the output rows `(b · h + head) · n + position`, which `out_index` names."""
    if call.relative_embedding is None:
        return {}
    b, h, n, d = qk.shape
    c = rounds.c
    with torch.no_grad():
        real = torch.arange(n, device=qk.device)
        query_position = _scatter_index(rounds.n_queries * c, rounds.buffer_row[..., :n], real)
        key_position = F.pad(query_position, (rounds.before * c, rounds.after * c), value=-1)
    table = relative_logit_table(qk, call.relative_embedding, default_scale(d)).reshape(b * h * n, -1)
    return dict(relative_table=table, query_position=query_position, key_position=key_position)


def _gathered_rounds(qk: Tensor, v: Tensor, call: _LshCall, rounds: _SortedRounds, relative: dict) -> Tensor:
    """The rounds on `attend_gathered_windows`, which gathers the rows of each group of chunks itself."""
    b, h, n, _ = qk.shape
    c, before = rounds.c, rounds.before
    with torch.no_grad():
        first = last = None
        if call.causal:
            # The visible keys of a causal query are the last (at most before·c) entries of its bucket before
            # it in sorted order: window columns [column − back, column) with column = before·c + slot.
            sorted_buckets = rounds.buckets.gather(-1, rounds.order)
            bucket_start = torch.searchsorted(sorted_buckets, sorted_buckets).gather(-1, rounds.rank)
            back = (rounds.rank - bucket_start).clamp_(max=before * c)  # [b, h, r, n_pad]
            back.masked_fill_(rounds.buckets == rounds.padding_bucket, 0)  # padding sees no key
            column = before * c + rounds.buffer_row % c
            where = rounds.buffer_row[..., :n]
            first = _scatter_index(rounds.n_queries * c, where, (column - back)[..., :n]).clamp_(min=0)
            last = _scatter_index(rounds.n_queries * c, where, column[..., :n]).clamp_(min=0)
    out = attend_gathered_windows(
        rounds.qk_rows,
        rounds.qk_rows,
        rounds.v_rows,
        key_norm_eps=KEY_NORM_EPS,
        query_index=rounds.query_index,
        key_index=rounds.key_index,
        value_index=rounds.value_index,
        out_index=rounds.out_index,
        n_out=b * h * n,
        chunk=c,
        width=rounds.w,
        stride=c,
        scale=1.0,
        mask=None if call.causal else rounds.mask,
        first=first,
        last=last,
        self_column=before * c,
        **relative,
    )
    return out.view(b, h, n, v.shape[-1])


def _copied_rounds(
    qk: Tensor, v: Tensor, call: _LshCall, rounds: _SortedRounds, relative: dict, windows: Callable
) -> Tensor:
    """The rounds on `windows` (`attend_windows` or its kernel) over sorted copies of the rows, merged by
    log-sum-exp (`_combine_rounds`)."""
    b, h, n, d = qk.shape
    d_v, r = v.shape[-1], call.rotations.shape[2]
    c, w, lead, n_queries = rounds.c, rounds.w, rounds.before * rounds.c, rounds.n_queries
    mask = rounds.mask
    with torch.no_grad():
        if call.causal:
            row_bucket = _at_key_rows(rounds.buckets[..., :n], rounds.key_rows, rounds.key_index.shape[0], -1)
            # Sorted distance from query i to window key j is before·c + i − j: strictly earlier, at most
            # before·c back. Gap rows are invalid, so the band never leaves the round.
            distance = lead + torch.arange(c, device=qk.device)[:, None] - torch.arange(w, device=qk.device)
            band = (distance > 0) & (distance <= lead)  # [c, w]
            mask = mask & band & _same_in_window(row_bucket, lead, n_queries, c, w)  # [U, c, w]
        # Backward maps: copy `round` of source row p sits at key-buffer row before·c + buffer_row[.., round, p].
        key_rows = rounds.key_rows.view(b, h, r, n)
        key_inverse = _copy_inverse(rounds.qk_rows, rounds.qk_row_of, key_rows)
        value_inverse = _copy_inverse(rounds.v_rows, rounds.v_row_of, key_rows)
        unsort = rounds.buffer_row[..., :n].reshape(-1)  # [b·h·r·n], where each (b, h, r, position) was answered
        unsort_inverse = _scatter_index(n_queries * c, unsort, torch.arange(unsort.numel(), device=qk.device))
    qk_sorted = gather_rows(rounds.qk_rows, rounds.key_index, key_inverse)  # [rows, d]: zero chunks, the segments
    q_sorted = qk_sorted[lead : lead + n_queries * c].view(n_queries, c, d)
    k_sorted = normalize_keys(qk_sorted)  # zero rows stay zero
    v_sorted = gather_rows(rounds.v_rows, rounds.value_index, value_inverse)  # [rows, d_v]
    if relative:
        columns = RelativeColumns(
            relative["relative_table"], relative["query_position"], relative["key_position"], rounds.out_index, c, c, w
        )
        mask = hide_exactly(columns.bias(0, n_queries), ~mask)  # [U, c, w], differentiable
    out, lse = windows(
        q_sorted, k_sorted, v_sorted, mask, stride=c, scale=1.0, dropout_p=call.dropout_p, self_column=lead
    )  # [U, c, d_v], [U, c]
    out = gather_rows(out.view(-1, d_v), unsort, unsort_inverse.view(1, -1)).view(b, h, r, n, d_v)
    lse = lse.reshape(-1).index_select(0, unsort).view(b, h, r, n)
    return _combine_rounds(out, lse)


# ---------------------------------------------------------------------------------------------- dense form
def _dense_visibility(
    key_buckets: Tensor, valid: Tensor, n: int, same_position: Tensor, *, bucket_size: int, num_chunks_before: int,
    num_chunks_after: int, causal: bool, document_ids: Tensor | None,
) -> Tensor:  # fmt: skip
    """Bool `[b, h, r, n, m]`: the keys each of the last n queries sees in each hash round, as `lsh_attention`'s
    sorted chunks decide (see `lsh_attention_dense`); key_buckets `[b, h, r, m]`, valid `[b, m]`, same_position
    `[n, m]` (the query's own key)."""
    m = key_buckets.shape[-1]
    positions = torch.arange(m, device=key_buckets.device)
    if causal:
        query_buckets = key_buckets[..., m - n :]  # shared QK: a query hashes like its key
        same = (query_buckets[..., :, None] == key_buckets[..., None, :]) & valid[:, None, None, None, :]
        same &= positions[m - n :, None] > positions  # [b, h, r, n, m], earlier keys of the bucket
        # Places back in sorted order = same-bucket keys from this one up to the query.
        back = same.flip(-1).cumsum(-1).flip(-1)
        return same & (back <= bucket_size * num_chunks_before)
    rank = (key_buckets * m + positions).argsort(-1).argsort(-1)  # [b, h, r, m], sorted index in its round
    chunk = torch.div(rank, bucket_size, rounding_mode="floor")
    distance = chunk[..., None, :] - chunk[..., :, None]  # [b, h, r, n, m]: key chunk - query chunk
    visible = (distance >= -num_chunks_before) & (distance <= num_chunks_after) & valid[:, None, None, None, :]
    visible &= ~same_position
    if document_ids is not None:  # chunk neighbours may hold another document
        visible &= (document_ids[:, :, None] == document_ids[:, None, :])[:, None, None]
    return visible


def lsh_attention_dense(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    rotations: Tensor,
    num_buckets: Buckets | None = None,
    bucket_size: int,
    num_chunks_before: int = 1,
    num_chunks_after: int = 0,
    causal: bool = False,
    key_padding_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    document_ids: Tensor | None = None,
    relative_embedding: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """The same attention as `lsh_attention`, written as dense masked attention in O(r·n·m) (with its weights).

    Used for cached decoding (the n queries are the last n of the m key positions) and for `output_attentions`.
    Causal: a query sees the earlier keys of its bucket that are at most `bucket_size · num_chunks_before` places
    back in the (bucket, position) order. Bidirectional (n = m only): the keys whose sorted chunk is at most
    `num_chunks_before` before / `num_chunks_after` after the query's, within the round.

    Args:
        q: Queries `[b, h, n, d]` (the shared vectors of the last n positions).
        k: Keys `[b, h, m, d]` (the shared vectors, not normalised).
        v: Values `[b, h, m, d_v]`.
        rotations, num_buckets: The hashing the fast path used: its rotations `[h or 1, d, r, Σ factors/2]` and
            bucket count (None: one hash of `2 · rotations.shape[-1]` buckets).
        bucket_size, num_chunks_before, num_chunks_after, causal, key_padding_mask, dropout_p, document_ids,
            relative_embedding: As in `lsh_attention` (`document_ids` `[b, m]`).

    Returns:
        `(out [b, h, n, d_v], weights [b, h, n, m])`, weights summed over the rounds.

    Raises:
        ValueError: A bidirectional call with n != m (it needs every query's sorted position), or a mask that is not
            bool `[b, m]`.
    """
    b, h, n, _ = q.shape
    m = k.shape[2]
    if not causal and n != m:
        raise ValueError(f"bidirectional LSH needs every query (n={n}) to be a key position (m={m}).")
    key_padding_mask = check_token_mask("key_padding_mask", key_padding_mask, b, m, device=q.device)
    document_ids = check_document_ids(document_ids, b, m, device=q.device)
    dtype = compute_dtype(q.dtype)
    valid = torch.ones(b, m, dtype=torch.bool, device=q.device) if key_padding_mask is None else key_padding_mask
    q_pos = torch.arange(m - n, m, device=q.device)
    key_buckets = lsh_buckets(k, rotations, valid=valid, num_buckets=num_buckets)  # [b, h, r, m]
    if document_ids is not None:
        factors = (2 * rotations.shape[-1],) if num_buckets is None else hash_factors(num_buckets)
        key_buckets, _ = document_buckets(key_buckets, document_ids, math.prod(factors))
    same_position = q_pos[:, None] == torch.arange(m, device=q.device)  # [n, m]
    visible = _dense_visibility(
        key_buckets, valid, n, same_position, bucket_size=bucket_size, num_chunks_before=num_chunks_before,
        num_chunks_after=num_chunks_after, causal=causal, document_ids=document_ids,
    )  # fmt: skip
    scores = torch.einsum("bhnd,bhmd->bhnm", q.to(dtype), normalize_keys(k.to(dtype)))  # [b, h, n, m]
    bias_fn = relative_bias(
        q, check_relative_embedding(relative_embedding, q), scale=default_scale(q.shape[-1]), kv_len=m
    )
    if bias_fn is not None:
        scores = scores + materialize_bias(
            bias_fn, batch=b, heads=h, q_len=n, kv_len=m, q_offset=m - n, device=q.device
        )
    scores = scores[:, :, None]  # [b, h, 1, n, m]
    scores = hide_exactly(scores, ~visible)
    lonely = ~visible.any(dim=-1, keepdim=True)  # [b, h, r, n, 1]: only the query's own key is left
    scores = torch.where(lonely & same_position, torch.full_like(scores, SELF_SCORE), scores)
    lse = scores.logsumexp(dim=-1)  # [b, h, r, n]
    probs = (scores - lse.unsqueeze(-1)).exp()
    weights = (probs * torch.softmax(lse, dim=2).unsqueeze(-1)).sum(dim=2)  # [b, h, n, m]
    dropped = F.dropout(weights, p=dropout_p) if dropout_p > 0 else weights
    out = torch.matmul(dropped, v.to(dtype))
    return out.to(q.dtype), dropped.to(q.dtype)
