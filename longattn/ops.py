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

from torch import Tensor

from .backends import AttentionRequest, check_backend_name, select_executor
from .executor_families import PatternCall
from .executor_reference import reference_attention
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
    fixed_pattern,
    key_padding_predicate,
    same_document_mask,
    sliding_window_pattern,
    strided_pattern,
)
from .relative_logits import BiasFn, check_relative_embedding, relative_bias

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

    def run(
        self, q: Tensor, k: Tensor, v: Tensor, *, pattern: str, causal: bool, mask_fn: MaskFn,
        per_head: bool = False, geometry: dict | None = None, **fields,
    ) -> Tensor:  # fmt: skip
        """Run the call on the executor of the back end that serves it (`backends.select_executor` on its request).

        Args:
            pattern: The pattern family.
            causal: A query sees only keys at or before its position.
            mask_fn: The pattern predicate (padding and documents included).
            per_head: The predicate reads the head index.
            geometry: The family's own arguments, as its executors take them.
            **fields: Other `AttentionRequest` fields (`dilation`).
        """
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
        executor = select_executor(self.backend, request)
        call = PatternCall(pattern, mask_fn, per_head, causal, geometry or {}, *self)
        return executor(q, k, v, call)

    def inert(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """k and v with every padded position zeroed: padding may hold anything (`ops_checks.inert_padding`)."""
        return inert_padding(self.padding, k, v)


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
    parts = [causal_mask()] if causal else []
    if call.padding is not None:
        parts.append(key_padding_predicate(call.padding))
    if call.documents is not None:
        parts.append(same_document_mask(call.documents))
    return call.run(q, k, v, pattern="full", causal=causal, mask_fn=and_masks(*parts))


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
    mask_fn = sliding_window_pattern(
        window=window,
        dilation=dilation,
        causal=causal,
        global_mask=call.global_tokens,
        key_padding_mask=call.padding,
        document_ids=call.documents,
    )
    return call.run(
        q,
        k,
        v,
        pattern="sliding",
        causal=causal,
        mask_fn=mask_fn,
        per_head=not isinstance(dilation, int),
        geometry=dict(window=window, dilation=dilation),
        dilation=dilation,
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
    return call.run(q, k, v, pattern="strided", causal=causal, mask_fn=mask_fn, geometry=dict(stride=stride))


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
    check_qkv(q, k, v)
    block_size, num_summary = check_fixed_sizes(block_size, num_summary)
    causal = check_flag("causal", causal)
    summary_per_head = check_flag("summary_per_head", summary_per_head)
    call = shared.check(q, k)
    if is_empty(q, k):
        return empty_attention(q, k, v)
    k, v = call.inert(k, v)
    geometry = dict(block_size=block_size, num_summary=num_summary, summary_per_head=summary_per_head)
    mask_fn = fixed_pattern(**geometry, causal=causal, key_padding_mask=call.padding, document_ids=call.documents)
    return call.run(
        q, k, v, pattern="fixed", causal=causal, mask_fn=mask_fn, per_head=summary_per_head, geometry=geometry
    )
