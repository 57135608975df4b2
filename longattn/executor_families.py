"""The executor each back end runs for each pattern family: one function per (back end, family), all of one
signature `executor(q, k, v, call) -> out`, reading one validated call (`PatternCall`).

Shape legend: b batch, h heads, n length (n_q queries, n_k keys), d head dim (d_v for values).

`backends` declares which of these each back end runs for a family, and `backends.select_executor` hands the chosen
one to the pattern functions of `ops`, which validate their arguments, build the `PatternCall` and call it: no
pattern function branches on a back end's name. The PyTorch executors (`torch_*`) and xformers' (`xformers_*`) read
the family's geometry (`PatternCall.geometry`); FlexAttention and the reference read the pattern predicate itself
(`PatternCall.mask_fn`).

The families whose kinds run steps of their own (LSH's and routing's key windows, Sinkhorn's blocks, efficient
attention) are no pattern function of `ops`: their functional module declares its executors per back end in a
`StepExecutors`, and `backends.select_step_executor` hands the chosen one back.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from .executor_blocked import banded_attention
from .executor_flex import flex_pattern_attention
from .executor_reference import reference_pattern_attention
from .executor_sparse import fixed_blocked_attention, strided_blocked_attention
from .executor_xformers import (
    xformers_document_attention,
    xformers_fixed_attention,
    xformers_full_attention,
    xformers_sliding_window_attention,
    xformers_strided_attention,
)
from .numerics import hide_exactly
from .ops_checks import check_backend_support, inert_padding
from .patterns import (
    MaskFn,
    and_masks,
    causal_mask,
    document_layout,
    first_real_token,
    key_padding_predicate,
    materialize_mask,
    same_document_mask,
)
from .relative_logits import BiasFn, materialize_bias

__all__ = ["PatternCall", "Executor", "StepExecutors", "take_positions"]


class PatternCall(NamedTuple):
    """One call of a pattern function, validated: what every executor of its family reads.

    Attributes:
        pattern: The pattern family (`backends.PATTERN_FAMILIES`).
        mask_fn: The pattern predicate, padding and documents included (None where no executor reads it).
        per_head: The predicate reads the head index (per-head dilation or summary cells).
        causal: A query sees only keys at or before its position.
        geometry: The family's own arguments (`window`, `dilation`; `stride`; `block_size`, `num_summary`,
            `summary_per_head`).
        padding: Bool `[b, n_k]`, True = real token; None = no padding.
        global_tokens: Bool `[b, n_k]`, True = global token.
        documents: Integer `[b, n_k]`, the document of each token.
        scale: Multiplier of q·k.
        dropout_p: Dropout on the attention probabilities.
        backend: The back-end name asked for (`"auto"` or a name).
        embedding: The relative-position embedding `[2M + 1, d]`.
        bias_fn: Relative-position logits of the kept pairs.
    """

    pattern: str
    mask_fn: MaskFn | None
    per_head: bool
    causal: bool
    geometry: dict[str, Any]
    padding: Tensor | None
    global_tokens: Tensor | None
    documents: Tensor | None
    scale: float
    dropout_p: float
    backend: str
    embedding: Tensor | None
    bias_fn: BiasFn | None

    def inert(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """k and v with every padded position zeroed: padding may hold anything (`ops_checks.inert_padding`)."""
        return inert_padding(self.padding, k, v)

    def executor_arguments(self, *, bias: bool) -> dict:
        """The scale and dropout of the call (`bias`: and its relative logits), as an executor's keywords."""
        return dict(scale=self.scale, dropout_p=self.dropout_p, **({"bias_fn": self.bias_fn} if bias else {}))


Executor = Callable[[Tensor, Tensor, Tensor, PatternCall], Tensor]
"""`executor(q, k, v, call) -> out [b, h, n_q, d_v]`."""


class StepExecutors(NamedTuple):
    """The executors of a family whose kind runs steps of its own, one per back end that runs it.

    Declared by the family's functional module (`ops_lsh`, `ops_routing`, `ops_sinkhorn`, `ops_linear`), which
    `backends` does not import; `backends.select_step_executor` hands back the chosen back end's executor, so that
    no functional attention branches on a back end's name. All of one family's executors take the same arguments.

    Attributes:
        attention: The attention's name in messages (`"LSH"`, `"routing"`).
        pattern: The pattern family (`backends.PATTERN_FAMILIES`) a named back end's reasons are asked for; None: the
            family is no pattern a back end serves (efficient attention), and only its table is read.
        executors: The executor of each back end that runs the family, by back-end name: `"torch"` the PyTorch
            executor, which `"auto"` runs until another back end is measured for the family; `"xformers"` the same
            steps on xformers' kernel; `"reference"` the dense form.
        refused: Why the other back ends cannot run it, by name (`check`); one without a reason gets a generic one.
        note: Added to the refusal of a back end that passes dispatch but has no executor here.
    """

    attention: str
    pattern: str | None
    executors: dict[str, Callable[..., Any]]
    refused: dict[str, str] | None = None
    note: str = ""

    def check(self, backend: str) -> str:
        """Validate `backend=` against the back ends of `executors` and `"auto"` (`ops_checks.check_backend_support`).

        Raises:
            ValueError: If `backend` is unknown or not one of them (the message says why and what is allowed).
        """
        return check_backend_support(
            backend, attention=self.attention, supported=("auto", *self.executors), unsupported=self.refused or {}
        )


def _repeated_heads(q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
    """k and v `[b, h_kv, n_k, d]` with each key/value head repeated for its group of query heads (grouped-query
    attention, for the executors that do not read groups in place)."""
    h = q.shape[1]
    if k.shape[1] == h:
        return k, v
    return tuple(t.repeat_interleave(h // t.shape[1], dim=1) for t in (k, v))


# ---------------------------------------------------------------------------------------------- every family
def reference_executor(q: Tensor, k: Tensor, v: Tensor, call: PatternCall) -> Tensor:
    """The `"reference"` back end: dense softmax under the materialised predicate."""
    k, v = _repeated_heads(q, k, v)
    return reference_pattern_attention(
        q, k, v, mask_fn=call.mask_fn, per_head=call.per_head, **call.executor_arguments(bias=True)
    )


def flex_executor(q: Tensor, k: Tensor, v: Tensor, call: PatternCall) -> Tensor:
    """The `"flex"` back end: FlexAttention with a block mask of the predicate."""
    k, v = _repeated_heads(q, k, v)
    # A predicate that reads no tensor is named after its parameters, so its block mask is cached by name.
    per_batch = call.padding is not None or call.global_tokens is not None or call.documents is not None
    return flex_pattern_attention(
        q,
        k,
        v,
        mask_fn=call.mask_fn,
        scale=call.scale,
        per_batch=per_batch,
        per_head=call.per_head,
        cache_key=None if per_batch else call.mask_fn.__name__,
        bias_fn=call.bias_fn,
    )


# ---------------------------------------------------------------------------------------------- full
def torch_full(q: Tensor, k: Tensor, v: Tensor, call: PatternCall) -> Tensor:
    """Dense attention through SDPA: directly without padding, documents or relative logits (and with queries
    aligned to the keys when causal), else under the materialised mask."""
    b, h, n_q, _ = q.shape
    n_k = k.shape[2]
    causal = call.causal
    if call.padding is None and call.documents is None and call.bias_fn is None and (not causal or n_q == n_k):
        return F.scaled_dot_product_attention(q, k, v, dropout_p=call.dropout_p, is_causal=causal, scale=call.scale)
    parts = [causal_mask()] if causal else []
    if call.padding is not None:
        parts.append(key_padding_predicate(call.padding))
    if call.documents is not None:
        parts.append(same_document_mask(call.documents))
    mask = materialize_mask(
        and_masks(*parts), batch=b, heads=1, q_len=n_q, kv_len=n_k, q_offset=max(n_k - n_q, 0), device=q.device
    )  # [b, 1, n_q, n_k]; n_q > n_k only without causality (cross-attention), where query positions do not matter
    # SDPA's softmax over a row of -inf is NaN; give such rows any key and zero their output afterwards.
    sees_a_key = mask.any(dim=-1, keepdim=True)  # [b, 1, n_q, 1]
    attn_mask = mask | ~sees_a_key
    if call.bias_fn is not None:
        # Dense attention computes every pair anyway: the relative logits enter as SDPA's additive float mask.
        bias = materialize_bias(
            call.bias_fn, batch=b, heads=h, q_len=n_q, kv_len=n_k, q_offset=max(n_k - n_q, 0), device=q.device
        )  # [b, h, n_q, n_k]
        attn_mask = hide_exactly(bias.to(q.dtype), ~attn_mask)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=call.dropout_p, scale=call.scale)
    return out.masked_fill(~sees_a_key, 0.0)


def xformers_full(q: Tensor, k: Tensor, v: Tensor, call: PatternCall) -> Tensor:
    """Dense attention on xformers: a block-diagonal bias for packed documents, else padding as a bias."""
    if call.documents is not None:
        return xformers_document_attention(
            q, k, v, document_ids=call.documents, causal=call.causal, **call.executor_arguments(bias=False)
        )
    return xformers_full_attention(
        q, k, v, causal=call.causal, key_padding_mask=call.padding, **call.executor_arguments(bias=False)
    )


# ---------------------------------------------------------------------------------------------- sliding
def torch_sliding(q: Tensor, k: Tensor, v: Tensor, call: PatternCall) -> Tensor:
    """The blocked band executor (grouped key/value heads read in place), or dense SDPA for a window that reaches
    every key."""
    window, dilation = call.geometry["window"], call.geometry["dilation"]
    if dilation == 1 and window >= k.shape[2] - 1:
        # The window reaches every key, so the pattern is exactly (causal) full attention: global tokens add no
        # key. SDPA computes it without the blocked executor's per-block overhead, which dominates short inputs.
        return torch_full(q, *_repeated_heads(q, k, v), call)
    return banded_attention(
        q,
        k,
        v,
        mask_fn=call.mask_fn,
        window_left=window,
        window_right=0 if call.causal else window,
        dilation=dilation,
        global_mask=call.global_tokens,
        exact_band=call.documents is None,  # the same-document test is not the band's geometry
        key_padding_mask=call.padding,
        **call.executor_arguments(bias=True),
    )


def xformers_sliding(q: Tensor, k: Tensor, v: Tensor, call: PatternCall) -> Tensor:
    """The window on xformers: a block-diagonal local bias for packed documents, else local biases, residue-class
    permutations for dilation and global tokens merged by log-sum-exp."""
    k, v = _repeated_heads(q, k, v)
    if call.documents is not None:
        return xformers_document_attention(
            q,
            k,
            v,
            document_ids=call.documents,
            causal=call.causal,
            window=call.geometry["window"],
            **call.executor_arguments(bias=False),
        )
    return xformers_sliding_window_attention(
        q,
        k,
        v,
        **call.geometry,
        causal=call.causal,
        global_mask=call.global_tokens,
        key_padding_mask=call.padding,
        **call.executor_arguments(bias=False),
    )


def triton_sliding(q: Tensor, k: Tensor, v: Tensor, call: PatternCall) -> Tensor:
    """longattn's Triton band kernels (grouped key/value heads read in place)."""
    from .executor_triton import triton_sliding_window_attention  # noqa: PLC0415  (triton is optional)

    return triton_sliding_window_attention(
        q,
        k,
        v,
        **call.geometry,
        causal=call.causal,
        global_mask=call.global_tokens,
        key_padding_mask=call.padding,
        scale=call.scale,
    )


# ---------------------------------------------------------------------------------------------- strided
def torch_strided(q: Tensor, k: Tensor, v: Tensor, call: PatternCall) -> Tensor:
    """The blocked strided executor."""
    return strided_blocked_attention(
        q, k, v, mask_fn=call.mask_fn, **call.geometry, causal=call.causal, **call.executor_arguments(bias=True)
    )


def xformers_strided(q: Tensor, k: Tensor, v: Tensor, call: PatternCall) -> Tensor:
    """The strided pattern on xformers' layouts (the dispatcher admits it without dropout and with n_q == n_k)."""
    return xformers_strided_attention(
        q, k, v, **call.geometry, causal=call.causal, key_padding_mask=call.padding, scale=call.scale
    )


# ---------------------------------------------------------------------------------------------- fixed
def torch_fixed(q: Tensor, k: Tensor, v: Tensor, call: PatternCall) -> Tensor:
    """The blocked fixed executor, its blocks counted from each row's first real token (rows rolled) or from each
    document's start (documents laid out)."""
    if call.documents is not None:
        return _fixed_documents(q, k, v, call)
    n_k = k.shape[2]
    first = None if call.padding is None else first_real_token(call.padding)  # [b]

    def execute(q: Tensor, k: Tensor, v: Tensor, rolled_index: Tensor | None) -> Tensor:
        # In rolled rows, the SAME predicate (and bias) evaluated on the original positions of the slots.
        rolled_mask_fn = call.mask_fn if rolled_index is None else _on_rolled_positions(call.mask_fn, first, n_k)
        arguments = call.executor_arguments(bias=True)
        if call.bias_fn is not None and rolled_index is not None:
            arguments["bias_fn"] = _on_rolled_positions(call.bias_fn, first, n_k)
        return fixed_blocked_attention(q, k, v, mask_fn=rolled_mask_fn, **_fixed_blocks(call), **arguments)

    return _run_from_first_token(execute, q, k, v, first)


def xformers_fixed(q: Tensor, k: Tensor, v: Tensor, call: PatternCall) -> Tensor:
    """The fixed pattern on xformers' block layouts, rows rolled to their first real token.

    The dispatcher admits xformers without dropout, with n_q == n_k, and without causality under padding: in rolled
    rows a wrapped padding query would see later keys. Bidirectional, every rolled slot s is tested as position s,
    real or wrapped padding, which is what the layout's blocks from 0 compute.
    """
    if call.documents is not None:
        return _fixed_documents(q, k, v, call)
    padding = call.padding
    first = None if padding is None else first_real_token(padding)  # [b]

    def execute(q: Tensor, k: Tensor, v: Tensor, rolled_index: Tensor | None) -> Tensor:
        rolled_padding = padding if rolled_index is None else padding.gather(1, rolled_index)
        return xformers_fixed_attention(
            q, k, v, **_fixed_blocks(call), key_padding_mask=rolled_padding, scale=call.scale
        )

    return _run_from_first_token(execute, q, k, v, first)


def _fixed_blocks(call: PatternCall) -> dict[str, Any]:
    return dict(**call.geometry, causal=call.causal)


def _fixed_documents(q: Tensor, k: Tensor, v: Tensor, call: PatternCall) -> Tensor:
    """The blocked fixed executor on packed rows: its blocks start at multiples of l, each document's blocks at its
    first token. The documents are laid out so that each begins at a multiple of l, the same predicate runs there,
    and the output is gathered back."""

    def execute_laid_out(q: Tensor, k: Tensor, v: Tensor, position: Tensor, real: Tensor) -> Tensor:
        arguments = call.executor_arguments(bias=True)
        if call.bias_fn is not None:  # the same relative logits, read at the original positions of the slots
            arguments["bias_fn"] = _on_slot_positions(call.bias_fn, position)
        slot_mask_fn = _on_slot_positions(call.mask_fn, position, real)
        return fixed_blocked_attention(q, k, v, mask_fn=slot_mask_fn, **_fixed_blocks(call), **arguments)

    return _run_documents_aligned(execute_laid_out, q, k, v, call.documents, call.geometry["block_size"])


def _run_from_first_token(execute, q: Tensor, k: Tensor, v: Tensor, first: Tensor | None) -> Tensor:
    """`execute(q, k, v, rolled_index)` with the blocks counted from each row's first real token `first` `[b]`."""
    # Rolling by 0 is the identity: skip it when no row is left-padded. That test reads a tensor on the host, which
    # would break a `torch.compile` graph, so compiled code always rolls.
    if first is None or (not torch.compiler.is_compiling() and not bool(first.any())):
        return execute(q, k, v, None)
    # The pattern's blocks start at each row's first real token; the executors' blocks start at 0.
    return _run_rolled(execute, q, k, v, first)


def _on_rolled_positions(mask_fn, first: Tensor, length: int):
    """`mask_fn` for rows rolled left by `first` `[b]`: slot s of row b is original position (s + first[b]) mod n."""

    def rolled_mask_fn(bi: Tensor, hi: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        row_first = first[bi]
        return mask_fn(bi, hi, (q_idx + row_first) % length, (kv_idx + row_first) % length)

    if hasattr(mask_fn, "tensors"):  # a bias function: the tensors it reads (`relative_logits.BiasFn`)
        rolled_mask_fn.tensors = mask_fn.tensors
    return rolled_mask_fn


def _run_rolled(execute, q: Tensor, k: Tensor, v: Tensor, first: Tensor) -> Tensor:
    """`execute(q, k, v, rolled_index)` on every row rolled left by its first real token, rolled back.

    Left padding wraps to the end of the row, so blocks counted from 0 in the rolled rows are blocks counted from
    the first real token in the original ones.

    Args:
        execute: Runs attention on rolled q `[b, h, n_k, d]`, k, v; `rolled_index` `[b, n_k]` is the original
            position of each rolled slot (to roll masks alike).
        q: Queries `[b, h, n_q, d]`, the last n_q positions.
        k: Keys `[b, h, n_k, d]`.
        v: Values `[b, h, n_k, d_v]`.
        first: Long `[b]`, the first real token of each row.

    Returns:
        Output `[b, h, n_q, d_v]` in the original order.
    """
    b, h, n_q, _ = q.shape
    n_k = k.shape[2]
    if n_q < n_k:  # rolled queries are no longer a suffix: run every position and keep the last n_q
        q = F.pad(q, (0, 0, n_k - n_q, 0))
    rolled_index = (torch.arange(n_k, device=q.device).view(1, n_k) + first.view(b, 1)) % n_k  # [b, n_k]

    def rolled(x: Tensor) -> Tensor:
        return x.gather(2, rolled_index.view(b, 1, n_k, 1).expand(b, h, n_k, x.shape[3]))

    out = execute(rolled(q), rolled(k), rolled(v), rolled_index)
    unrolled_index = (torch.arange(n_k, device=q.device).view(1, n_k) - first.view(b, 1)) % n_k  # [b, n_k]
    out = out.gather(2, unrolled_index.view(b, 1, n_k, 1).expand(b, h, n_k, out.shape[3]))
    return out[:, :, n_k - n_q :]


def _on_slot_positions(mask_fn, position: Tensor, real: Tensor | None = None):
    """`mask_fn` (a predicate, or a `BiasFn`) for rows laid out in slots: slot s of row b holds original position
    `position[b, s]`, and only the slots where `real[b, s]` hold a token (the others are gaps that no query sees;
    a predicate is given `real`, a bias is not: the predicate already drops the gaps)."""

    def slot_mask_fn(bi: Tensor, hi: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        at_positions = mask_fn(bi, hi, position[bi, q_idx], position[bi, kv_idx])
        return at_positions if real is None else real[bi, kv_idx] & at_positions

    if hasattr(mask_fn, "tensors"):  # a bias function: the tensors it reads (`relative_logits.BiasFn`)
        slot_mask_fn.tensors = mask_fn.tensors
    return slot_mask_fn


def _run_documents_aligned(execute, q: Tensor, k: Tensor, v: Tensor, documents: Tensor, multiple: int) -> Tensor:
    """`execute(q, k, v, position, real)` on rows laid out so that every document starts at a multiple of
    `multiple` (`patterns.document_layout`), the output gathered back.

    Args:
        execute: Runs attention on laid-out q `[b, h, s, d]`, k, v; `position` `[b, s]` is the original position of
            each slot and `real` `[b, s]` says which slots hold a token (to lay masks out alike).
        q: Queries `[b, h, n_q, d]`, the last n_q positions.
        k: Keys `[b, h, n_k, d]`.
        v: Values `[b, h, n_k, d_v]`.
        documents: Integer `[b, n_k]`, contiguous runs of one id per document.
        multiple: Slots every document start is aligned to.

    Returns:
        Output `[b, h, n_q, d_v]` in the original order.
    """
    b, h, n_q, _ = q.shape
    n_k = k.shape[2]
    if n_q < n_k:  # queries of the laid-out rows are no longer a suffix: run every position and keep the last n_q
        q = F.pad(q, (0, 0, n_k - n_q, 0))
    position, real, slot = document_layout(documents, multiple)
    out = execute(*(take_positions(x, position) for x in (q, k, v)), position, real)  # [b, h, s, d_v]
    return take_positions(out, slot)[:, :, n_k - n_q :]


def take_positions(x: Tensor, index: Tensor) -> Tensor:
    """`x [b, h, n, d]` at positions `index [b, m]` (the same for every head): `[b, h, m, d]`."""
    b, m = index.shape
    return x.gather(2, index.view(b, 1, m, 1).expand(b, x.shape[1], m, x.shape[3]))
