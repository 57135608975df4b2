"""Functional attention: `(q, k, v) -> out`, one function per pattern family, each dispatched to a back end.

Shape legend: b batch, h heads, n length (n_q queries, n_k keys), d head dim (d_v for values).

q, k, v are `[b, h, n, d]` like `torch.nn.functional.scaled_dot_product_attention`. When n_q < n_k the queries are
the LAST n_q positions (cached decoding). Masks are bool `[b, n_k]`: `key_padding_mask` True = real token,
`global_mask` True = global token; a float or int mask is refused with a `ValueError` (SDPA reads a float mask as
an additive bias, 0 = keep, so converting it with `.bool()` would invert it: pass `mask == 0` for such a mask,
`mask.bool()` for a 1/0 one). Every function returns zeros, never NaN, for a query that sees no key (e.g. a
fully padded row), in every dtype and in the gradients. Lengths need not be multiples of anything. An empty
batch or sequence gives an empty output of the right shape, as SDPA does; bad input raises `ValueError` naming the
argument (the checks are in `longattn.ops_checks`). `reference_attention`, the dense ground truth, lives in
`longattn.executor_reference` (the `"reference"` back end) and is re-exported here.

Arguments every pattern function takes, besides its pattern's own:

- `q` `[b, h, n_q, d]`, `k` `[b, h, n_k, d]`, `v` `[b, h, n_k, d_v]`.
- `key_padding_mask`: bool `[b, n_k]`, True = real token; None = no padding.
- `document_ids`: integer `[b, n_k]`, the document of each token of packed rows (contiguous runs of one id); a
  query never sees a key of another document, and position-anchored patterns count from each document's start.
  None = one document per row.
- `scale`: multiplier of q·k; default 1/sqrt(d).
- `dropout_p`: dropout on the attention probabilities.
- `backend`: `"auto"` (default: xformers, then FlexAttention on CUDA, else the PyTorch executor), `"torch"` (the
  blocked executor; SDPA for dense attention), `"flex"`, `"xformers"`, `"reference"`, or `"triton"` (sliding
  windows only; never chosen by `"auto"`); see `longattn.backends`.
- `relative_embedding`: optional r `[2M + 1, d]`, relative-position logits (Shaw et al. 2018): the logit of query i
  for key j gains scale · q_i · r[clip(j − i, −M, M) + M], on the pairs the pattern keeps only (see
  `longattn.relative_logits`). Every back end but xformers (which takes only a dense bias) computes it.

Each returns the output `[b, h, n_q, d_v]` and raises `ValueError` for q, k, v that are not floating-point tensors
of matching shapes, dtype and device, a mask that is not bool `[b, n_k]`, a non-finite `scale`, `dropout_p` outside
[0, 1), or a `backend` that is unknown or cannot run the call (the message says why).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Sequence
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from .backends import AttentionRequest, check_backend_name, select_backend
from .executor_blocked import banded_attention
from .executor_flex import flex_pattern_attention
from .executor_reference import reference_attention, reference_pattern_attention
from .executor_sparse import fixed_blocked_attention, strided_blocked_attention
from .executor_xformers import (
    xformers_document_attention,
    xformers_fixed_attention,
    xformers_full_attention,
    xformers_sliding_window_attention,
    xformers_strided_attention,
)
from .ops_checks import (
    check_document_ids,
    check_dropout,
    check_flag,
    check_qkv,
    check_scale,
    check_token_mask,
    empty_attention,
    inert_padding,
    is_empty,
)
from .ops_linear import efficient_attention
from .ops_lsh import lsh_attention
from .patterns import (
    MaskFn,
    and_masks,
    causal_mask,
    check_dilation,
    check_fixed_sizes,
    check_stride,
    check_window,
    document_layout,
    first_real_token,
    fixed_pattern,
    key_padding_predicate,
    materialize_mask,
    same_document_mask,
    sliding_window_pattern,
    strided_pattern,
)
from .relative_logits import BiasFn, check_relative_embedding, materialize_bias, relative_bias

__all__ = [
    "reference_attention",
    "full_attention",
    "sliding_window_attention",
    "strided_attention",
    "fixed_attention",
    "efficient_attention",
    "lsh_attention",
]


class _Call(NamedTuple):
    """The arguments every pattern function shares, validated once and passed down to the back ends."""

    padding: Tensor | None  # bool [b, n_k], True = real token
    global_tokens: Tensor | None  # bool [b, n_k], True = global token
    documents: Tensor | None  # integer [b, n_k], the document of each token
    scale: float
    dropout_p: float
    backend: str
    embedding: Tensor | None  # the relative-position embedding `[2M + 1, d]`
    bias_fn: BiasFn | None  # relative-position logits of the kept pairs

    def shared(self, **changes) -> dict:
        """These arguments as a pattern function's shared keywords, `changes` applied (one pattern function
        handing its call to another)."""
        given = _SharedArguments(self.padding, self.documents, self.scale, self.dropout_p, self.backend, self.embedding)
        return given._replace(**changes)._asdict()

    def select(self, q: Tensor, k: Tensor, v: Tensor, *, pattern: str, causal: bool, **fields) -> str:
        """The back end that runs this call (`backends.select_backend` on its request)."""
        request = AttentionRequest.for_inputs(
            q,
            k,
            v,
            pattern=pattern,
            dropout_p=self.dropout_p,
            causal=causal,
            key_padding=self.padding is not None,
            global_tokens=self.global_tokens is not None,
            documents=self.documents is not None,
            relative_logits=self.bias_fn is not None,
            **fields,
        )
        return select_backend(self.backend, request)

    def run_pattern(self, backend: str, q: Tensor, k: Tensor, v: Tensor, *, mask_fn: MaskFn, per_head: bool) -> Tensor:
        """The back ends that evaluate the pattern predicate itself: `"flex"` (a block mask) and `"reference"`."""
        if backend == "reference":
            return reference_pattern_attention(
                q, k, v, mask_fn=mask_fn, per_head=per_head, **self.executor_arguments(bias=True)
            )
        # A predicate that reads no tensor is named after its parameters, so its block mask is cached by name.
        per_batch = self.padding is not None or self.global_tokens is not None or self.documents is not None
        return flex_pattern_attention(
            q,
            k,
            v,
            mask_fn=mask_fn,
            scale=self.scale,
            per_batch=per_batch,
            per_head=per_head,
            cache_key=None if per_batch else mask_fn.__name__,
            bias_fn=self.bias_fn,
        )

    def inert(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """k and v with every padded position zeroed: padding may hold anything (`ops_checks.inert_padding`)."""
        return inert_padding(self.padding, k, v)

    def executor_arguments(self, *, bias: bool) -> dict:
        """The scale and dropout of the call (`bias`: and its relative logits), as an executor's keywords."""
        return dict(scale=self.scale, dropout_p=self.dropout_p, **({"bias_fn": self.bias_fn} if bias else {}))


class _SharedArguments(NamedTuple):
    """The keyword arguments every pattern function takes besides its pattern's own (module docstring), as given.

    Declared here once: `_pattern_function` adds them to each function's signature and hands them over unchecked,
    so that each function checks its own arguments first, then these (`check`), in its documented order.
    """

    key_padding_mask: Tensor | None = None
    document_ids: Tensor | None = None
    scale: float | None = None
    dropout_p: float = 0.0
    backend: str = "auto"
    relative_embedding: Tensor | None = None

    def check(self, q: Tensor, k: Tensor, *, global_mask: Tensor | None = None) -> _Call:
        """Validate the masks, documents, scale, dropout, back-end name and relative embedding of a call on q
        `[b, h, n_q, d]`, k `[b, h_kv, n_k, d]`."""
        b, n_k = q.shape[0], k.shape[2]
        padding = check_token_mask("key_padding_mask", self.key_padding_mask, b, n_k, device=q.device)
        global_tokens = check_token_mask("global_mask", global_mask, b, n_k, device=q.device)
        documents = check_document_ids(self.document_ids, b, n_k, device=q.device)
        dropout_p = check_dropout(self.dropout_p)
        scale = check_scale(self.scale, q.shape[-1])
        backend = check_backend_name(self.backend)
        embedding = check_relative_embedding(self.relative_embedding, q)
        bias_fn = relative_bias(q, embedding, scale=scale, kv_len=n_k)  # the O(n · M) table, read per kept pair
        return _Call(padding, global_tokens, documents, scale, dropout_p, backend, embedding, bias_fn)


def _pattern_function(fn):
    """The public pattern function of `fn(q, k, v, *, <its pattern's own arguments>, shared)`.

    It takes q, k, v (tensors) and, besides `fn`'s own keywords, those of `_SharedArguments` with their defaults
    (its signature shows them all), and hands these to `fn` unchecked as `shared`.
    """
    tensors = [inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation="Tensor") for name in "qkv"]
    own = [p for name, p in inspect.signature(fn).parameters.items() if name not in ("q", "k", "v", "shared")]
    tail = [
        # NamedTuple keeps this module's postponed (string) annotations as forward references: shown as strings
        inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=annotation.__forward_arg__)
        for (name, default), annotation in zip(
            _SharedArguments._field_defaults.items(), _SharedArguments.__annotations__.values()
        )
    ]

    @functools.wraps(fn)
    def pattern_function(q, k, v, **arguments):
        given = {name: arguments.pop(name) for name in _SharedArguments._fields if name in arguments}
        return fn(q, k, v, shared=_SharedArguments(**given), **arguments)

    parameters = [*tensors, *own, *tail]
    pattern_function.__signature__ = inspect.Signature(parameters, return_annotation="Tensor")
    pattern_function.__annotations__ = {p.name: p.annotation for p in parameters} | {"return": "Tensor"}
    return pattern_function


@_pattern_function
def full_attention(q, k, v, *, causal: bool = False, global_mask: Tensor | None = None, shared: _SharedArguments):
    """Dense attention over every (visible) key through torch's `scaled_dot_product_attention`: the baseline.

    Args:
        q: Queries `[b, h, n_q, d]` (causal: n_q <= n_k, the last n_q positions; else any n_q, as in
            cross-attention).
        causal: A query sees only keys at or before its position (bottom-right aligned when n_q < n_k).
        global_mask: Bool `[b, n_k]`; accepted so every attention kind takes the same arguments, but every token
            already sees every key, so it changes nothing (its shape is still checked).
        k, v, key_padding_mask, document_ids, scale, dropout_p, backend, relative_embedding: As in every pattern
            function (module docstring); the relative logits enter SDPA as a dense additive mask (every pair is
            computed anyway); `"auto"` picks SDPA unless padding makes FlexAttention or xformers worth it on CUDA.
            With `document_ids`, the queries are the last n_q of the n_k positions.

    Raises:
        ValueError: For a non-bool `causal`, or a shared argument that is invalid (module docstring).
    """
    causal = check_flag("causal", causal)
    # Only causal attention (and packed documents) align the queries with the last keys; cross-attention has any
    # number of queries.
    b, h, n_q, n_k = check_qkv(q, k, v, queries_last=causal or shared.document_ids is not None)
    check_token_mask("global_mask", global_mask, b, n_k, device=q.device)  # checked only: it adds no key
    call = shared.check(q, k)
    if is_empty(q, k):
        return empty_attention(q, k, v)
    k, v = call.inert(k, v)
    choice = call.select(q, k, v, pattern="full", causal=causal)
    if choice == "xformers" and call.documents is not None:
        return xformers_document_attention(
            q, k, v, document_ids=call.documents, causal=causal, **call.executor_arguments(bias=False)
        )
    if choice == "xformers":
        return xformers_full_attention(
            q, k, v, causal=causal, key_padding_mask=call.padding, **call.executor_arguments(bias=False)
        )
    if (
        choice == "torch"
        and call.padding is None
        and call.documents is None
        and call.bias_fn is None
        and (not causal or n_q == n_k)
    ):
        return F.scaled_dot_product_attention(q, k, v, dropout_p=call.dropout_p, is_causal=causal, scale=call.scale)
    parts = [causal_mask()] if causal else []
    if call.padding is not None:
        parts.append(key_padding_predicate(call.padding))
    if call.documents is not None:
        parts.append(same_document_mask(call.documents))
    if choice != "torch":
        return call.run_pattern(choice, q, k, v, mask_fn=and_masks(*parts), per_head=False)
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
        attn_mask = bias.to(q.dtype).masked_fill(~attn_mask, float("-inf"))
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=call.dropout_p, scale=call.scale)
    return out.masked_fill(~sees_a_key, 0.0)


@_pattern_function
def sliding_window_attention(
    q, k, v, *, window: int, dilation: int | Sequence[int] = 1, causal: bool = False,
    global_mask: Tensor | None = None, shared: _SharedArguments,
):  # fmt: skip
    """Longformer attention: (dilated) sliding window plus symmetric global tokens, in O(n · window).

    The pattern is `patterns.sliding_window_pattern(...)`; it is computed by the blocked executor
    (`executor_blocked.banded_attention`), which equals `reference_attention` under the materialised pattern.
    A window at least as long as the sequence is exactly full attention.

    Args:
        q: Queries `[b, h, n_q, d]`.
        k: Keys `[b, h_kv, n_k, d]`, h_kv dividing h: grouped-query attention, each key/value head read by its
            group of h / h_kv query heads (the blocked executor and the Triton kernels read it in place; other back
            ends repeat it).
        v: Values `[b, h_kv, n_k, d_v]`.
        window: Keys on each side of a query (>= 1); a causal query sees `window` earlier keys and itself.
        dilation: Gap between attended keys (>= 1), or one per head (a sequence of length h).
        causal: Restrict every query, global ones included, to keys at or before its position.
        global_mask: Bool `[b, n_k]`, True = global token: it sees every key and every query sees it (of its own
            document, in packed rows).
        key_padding_mask, document_ids, scale, dropout_p, backend, relative_embedding: As in every pattern function
            (module docstring).

    Raises:
        ValueError: For a window or dilation below 1, a per-head dilation whose length is not h, a non-bool
            `causal`, or a shared argument that is invalid (module docstring).
    """
    b, h, n_q, n_k = check_qkv(q, k, v, grouped=True)
    window = check_window(window)
    dilation = check_dilation(dilation, heads=h)
    if not isinstance(dilation, int) and len(set(dilation)) == 1:
        dilation = dilation[0]  # one group of heads, and a mask without a head dimension
    causal = check_flag("causal", causal)
    call = shared.check(q, k, global_mask=global_mask)
    if is_empty(q, k):
        return empty_attention(q, k, v)
    k, v = call.inert(k, v)
    # A gap or reach past the keys changes nothing: key i ± j·dilation exists for |j| <= window only while it lies in
    # [0, n_k). Both are clamped to what the keys need, never allocated or looped over by their size.
    if isinstance(dilation, int):
        dilation = min(dilation, n_k)
        window = min(window, max(1, -(-(n_k - 1) // dilation)))
    else:
        dilation = tuple(min(gap, n_k) for gap in dilation)
        window = min(window, max(1, -(-(n_k - 1) // min(dilation))))
    band = dict(window=window, dilation=dilation, causal=causal)
    masks = dict(global_mask=call.global_tokens, key_padding_mask=call.padding)
    choice = call.select(q, k, v, pattern="sliding", causal=causal, dilation=dilation)
    if choice == "triton":
        from .executor_triton import triton_sliding_window_attention  # noqa: PLC0415  (triton is optional)

        return triton_sliding_window_attention(q, k, v, **band, **masks, scale=call.scale)
    if k.shape[1] != h and (choice != "torch" or (dilation == 1 and window >= n_k - 1)):
        k, v = (t.repeat_interleave(h // t.shape[1], dim=1) for t in (k, v))  # the blocked executor reads groups
    if choice == "xformers" and call.documents is not None:
        return xformers_document_attention(
            q, k, v, document_ids=call.documents, causal=causal, window=window, **call.executor_arguments(bias=False)
        )
    if choice == "xformers":
        return xformers_sliding_window_attention(q, k, v, **band, **masks, **call.executor_arguments(bias=False))
    mask_fn = sliding_window_pattern(**band, **masks, document_ids=call.documents)
    if choice != "torch":
        return call.run_pattern(choice, q, k, v, mask_fn=mask_fn, per_head=not isinstance(dilation, int))
    if dilation == 1 and window >= n_k - 1:
        # The window reaches every key, so the pattern is exactly (causal) full attention: global tokens add no
        # key. SDPA computes it without the blocked executor's per-block overhead, which dominates short inputs.
        return full_attention(q, k, v, causal=causal, **call.shared(backend="torch"))
    return banded_attention(
        q,
        k,
        v,
        mask_fn=mask_fn,
        window_left=window,
        window_right=0 if causal else window,
        dilation=dilation,
        global_mask=call.global_tokens,
        exact_band=call.documents is None,  # the same-document test is not the band's geometry
        key_padding_mask=call.padding,
        **call.executor_arguments(bias=True),
    )


@_pattern_function
def strided_attention(q, k, v, *, stride: int, causal: bool = True, shared: _SharedArguments):
    """Sparse Transformer strided attention (Child et al. 2019): the previous l keys and every l-th key.

    Query i sees A1 = {max(0, i − l) … i} and A2 = {j <= i : (i − j) mod l = 0}; the bidirectional form
    (`causal=False`, for encoders) mirrors A1 (|i − j| <= l) and keeps A2 on both sides. The pattern is
    `patterns.strided_pattern(...)`; the executor (`executor_sparse.strided_blocked_attention`) costs
    O(n · (l + n / l)), O(n · sqrt(n)) with the paper's choice l ~ sqrt(n), and equals `reference_attention` under
    the materialised pattern.

    Args:
        stride: The stride l (>= 1).
        causal: Restrict every query to keys at or before its position (the paper's decoder form).
        q, k, v, key_padding_mask, document_ids, scale, dropout_p, backend, relative_embedding: As in every pattern
            function (module docstring). The sets depend on i − j only, so packed documents need only the
            same-document test.

    Raises:
        ValueError: For a stride below 1, a non-bool `causal`, or a shared argument that is invalid (module
            docstring).
    """
    check_qkv(q, k, v)
    stride = check_stride(stride)
    causal = check_flag("causal", causal)
    call = shared.check(q, k)
    if is_empty(q, k):
        return empty_attention(q, k, v)
    k, v = call.inert(k, v)
    mask_fn = strided_pattern(stride=stride, causal=causal, key_padding_mask=call.padding, document_ids=call.documents)
    choice = call.select(q, k, v, pattern="strided", causal=causal)
    if choice == "xformers":
        # The dispatcher admits xformers without dropout and with n_q == n_k only (its layout's requirements).
        return xformers_strided_attention(
            q, k, v, stride=stride, causal=causal, key_padding_mask=call.padding, scale=call.scale
        )
    if choice != "torch":
        return call.run_pattern(choice, q, k, v, mask_fn=mask_fn, per_head=False)
    return strided_blocked_attention(
        q, k, v, mask_fn=mask_fn, stride=stride, causal=causal, **call.executor_arguments(bias=True)
    )


@_pattern_function
def fixed_attention(
    q, k, v, *, block_size: int, num_summary: int, causal: bool = True, summary_per_head: bool = False,
    shared: _SharedArguments,
):  # fmt: skip
    """Sparse Transformer fixed attention (Child et al. 2019): the query's own block and every block's summary cells.

    Query i sees A1 = {j : floor(j / l) = floor(i / l)} and A2 = {j : j mod l in [l − c, l − 1]} (the last c
    cells of each block); causal: j <= i as well. With `summary_per_head`, head h uses its own sub-block of c
    cells instead (the paper's preferred multi-head variant, see `patterns.fixed_mask`). With padding, blocks are
    counted from each row's first real token, so left padding does not move them. The pattern is
    `patterns.fixed_pattern(...)`; the executor (`executor_sparse.fixed_blocked_attention`) costs
    O(n · (l + c · n / l)) and equals `reference_attention` under the materialised pattern.

    Args:
        block_size: Block length l (>= 1).
        num_summary: Summary cells per block c, in [1, block_size].
        causal: Restrict every query to keys at or before its position.
        summary_per_head: Distinct summary sub-blocks per head (head h: sub-block h mod floor(l / c) from the
            block end); False: every head uses the last c cells.
        q, k, v, key_padding_mask, document_ids, scale, dropout_p, backend, relative_embedding: As in every pattern
            function (module docstring). In packed rows blocks are counted from each document's start.

    Raises:
        ValueError: For a block size below 1, `num_summary` outside [1, block_size], a non-bool flag, or a shared
            argument that is invalid (module docstring).
    """
    n_k = check_qkv(q, k, v)[3]
    block_size, num_summary = check_fixed_sizes(block_size, num_summary)
    causal = check_flag("causal", causal)
    summary_per_head = check_flag("summary_per_head", summary_per_head)
    call = shared.check(q, k)
    if is_empty(q, k):
        return empty_attention(q, k, v)
    k, v = call.inert(k, v)
    padding = call.padding
    blocks = dict(block_size=block_size, num_summary=num_summary, summary_per_head=summary_per_head, causal=causal)
    mask_fn = fixed_pattern(**blocks, key_padding_mask=padding, document_ids=call.documents)
    choice = call.select(q, k, v, pattern="fixed", causal=causal)
    if choice in ("flex", "reference"):
        return call.run_pattern(choice, q, k, v, mask_fn=mask_fn, per_head=summary_per_head)
    if call.documents is not None:
        # The executor's blocks start at multiples of l; each document's blocks start at its first token. Lay the
        # documents out so that each begins at a multiple of l, run the same predicate there, and gather back.
        def execute_laid_out(q: Tensor, k: Tensor, v: Tensor, position: Tensor, real: Tensor) -> Tensor:
            arguments = call.executor_arguments(bias=True)
            if call.bias_fn is not None:  # the same relative logits, read at the original positions of the slots
                arguments["bias_fn"] = _on_slot_positions(call.bias_fn, position)
            slot_mask_fn = _on_slot_positions(mask_fn, position, real)
            return fixed_blocked_attention(q, k, v, mask_fn=slot_mask_fn, **blocks, **arguments)

        return _run_documents_aligned(execute_laid_out, q, k, v, call.documents, block_size)
    first = None if padding is None else first_real_token(padding)  # [b]
    if choice == "xformers":
        # The dispatcher admits xformers without dropout, with n_q == n_k, and without causality under padding: in
        # rolled rows (below) a wrapped padding query would see later keys. Bidirectional, every rolled slot s is
        # tested as position s, real or wrapped padding, which is what the layout's blocks from 0 compute.
        def execute(q: Tensor, k: Tensor, v: Tensor, rolled_index: Tensor | None) -> Tensor:
            rolled_padding = padding if rolled_index is None else padding.gather(1, rolled_index)
            return xformers_fixed_attention(q, k, v, **blocks, key_padding_mask=rolled_padding, scale=call.scale)
    else:

        def execute(q: Tensor, k: Tensor, v: Tensor, rolled_index: Tensor | None) -> Tensor:
            # In rolled rows, the SAME predicate (and bias) evaluated on the original positions of the slots.
            rolled_mask_fn = mask_fn if rolled_index is None else _on_rolled_positions(mask_fn, first, n_k)
            arguments = call.executor_arguments(bias=True)
            if call.bias_fn is not None and rolled_index is not None:
                arguments["bias_fn"] = _on_rolled_positions(call.bias_fn, first, n_k)
            return fixed_blocked_attention(q, k, v, mask_fn=rolled_mask_fn, **blocks, **arguments)

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
