"""Input checks shared by the functional attentions (`ops`, `ops_linear`, `ops_<family>`): one wording for every
error.

Shape legend: b batch, h heads, n_q queries, n_k keys, d head dim (d_v for values). This module depends on torch, the
back-end names (`longattn.attention_fields`) and the relative-embedding check (`longattn.relative_logits`) only.
"""

from __future__ import annotations

import math
import numbers
from typing import NamedTuple

import torch
from torch import Tensor

from .attention_fields import check_backend_name
from .numerics import default_scale
from .relative_logits import check_relative_embedding

__all__ = [
    "AttentionInputs",
    "check_attention_inputs",
    "check_backend_support",
    "check_bool_mask",
    "check_dropout",
    "check_flag",
    "check_input_mask",
    "check_positive_int",
    "check_qkv",
    "check_scale",
    "check_tensor_on",
    "check_token_mask",
    "empty_attention",
    "inert_padding",
    "is_empty",
]


def check_backend_support(
    backend: str, *, attention: str, supported: tuple[str, ...], unsupported: dict[str, str]
) -> str:
    """Validate `backend=` for a functional attention that runs on some back ends only.

    Args:
        backend: The requested back end.
        attention: The attention's name in messages (e.g. "LSH").
        supported: The back ends it runs on.
        unsupported: Why it cannot run on the others, per back-end name.

    Returns:
        `backend`.

    Raises:
        ValueError: If `backend` is unknown, or not one of `supported` (the message says why and what is allowed).
    """
    check_backend_name(backend)
    if backend not in supported:
        why = unsupported.get(backend, f"it has no implementation of {attention} attention")
        raise ValueError(
            f"`backend`={backend!r} cannot run {attention} attention: {why}; use one of {list(supported)}."
        )
    return backend


def check_qkv(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    names: tuple[str, str, str] = ("q", "k", "v"),
    queries_last: bool = True,
    grouped: bool = False,
) -> tuple[int, int, int, int]:
    """Check q `[b, h, n_q, d]`, k `[b, h, n_k, d]`, v `[b, h, n_k, d_v]`; return (b, h, n_q, n_k).

    Args:
        q: Queries.
        k: Keys.
        v: Values.
        names: The arguments' names in messages (e.g. `("qk", "qk", "v")` for shared-QK attention).
        queries_last: The queries are the last n_q key positions (cached decoding), so n_q <= n_k is required.
        grouped: k and v may have fewer heads h_kv than q, h_kv dividing h (grouped-query attention).

    Raises:
        ValueError: A tensor is not a 4-d floating-point tensor, the three differ in dtype or device, the shapes
            disagree, a head dim is 0, or (with `queries_last`) q has more positions than k.
    """
    for name, tensor in zip(names, (q, k, v)):
        if not isinstance(tensor, Tensor):
            raise ValueError(
                f"{name} must be a torch.Tensor [batch, heads, length, head_dim], got {type(tensor).__name__}"
            )
        if tensor.dim() != 4:
            raise ValueError(f"{name} must have shape [batch, heads, length, head_dim], got {tuple(tensor.shape)}")
        if not tensor.is_floating_point():
            raise ValueError(
                f"{name} must have a floating-point dtype (float16, bfloat16, float32, float64), got {tensor.dtype}"
            )
        if tensor.shape[3] == 0:
            raise ValueError(f"{name} has head_dim 0 (shape {tuple(tensor.shape)}): head_dim must be >= 1")
    q_name, k_name, v_name = names
    for name, tensor in ((k_name, k), (v_name, v)):
        if tensor.dtype != q.dtype:
            raise ValueError(
                f"{name} has dtype {tensor.dtype} but {q_name} has {q.dtype}: {q_name}, {k_name}, "
                f"{v_name} must share one dtype"
            )
        if tensor.device != q.device:
            raise ValueError(
                f"{name} is on {tensor.device} but {q_name} is on {q.device}: {q_name}, {k_name}, "
                f"{v_name} must be on one device"
            )
    b, h, n_q, d = q.shape
    n_k = k.shape[2]
    heads_ok = k.shape[1] == h or (grouped and k.shape[1] > 0 and h % k.shape[1] == 0)
    if k.shape[0] != b or not heads_ok or k.shape[3] != d:
        heads = f"h_kv dividing {h}" if grouped else str(h)
        raise ValueError(
            f"{k_name} must have shape [{b}, {heads}, n_k, {d}] to match {q_name} {tuple(q.shape)}, "
            f"got {tuple(k.shape)}"
        )
    if v.shape[:3] != k.shape[:3]:
        raise ValueError(
            f"{v_name} must have shape [{b}, {h}, {n_k}, d_v] to match {k_name} {tuple(k.shape)}, got {tuple(v.shape)}"
        )
    if queries_last and n_q > n_k:
        raise ValueError(
            f"{q_name} has more positions ({n_q}) than {k_name} ({n_k}); queries are the last n_q key positions, "
            "so n_q <= n_k"
        )
    return b, h, n_q, n_k


def check_bool_mask(name: str, mask: Tensor | None, *, device: torch.device | None = None) -> Tensor | None:
    """A bool mask, unchanged (None stays None): True = takes part (is attended / is a real or global token).

    Float masks are refused rather than converted: `scaled_dot_product_attention` reads a float mask as an additive
    bias (0 = keep, -inf = drop), which `.bool()` would invert, and a 1/0 mask would be read the other way round.

    Raises:
        ValueError: The mask is not a bool tensor, or is not on `device` (the message names it by `name` and says
            how to convert).
    """
    if mask is None:
        return None
    if not isinstance(mask, Tensor):
        raise ValueError(f"{name} must be a bool torch.Tensor (True = attend), got {type(mask).__name__}")
    if mask.dtype != torch.bool:
        raise ValueError(
            f"{name} must be a bool tensor (True = attend / take part, as scaled_dot_product_attention's bool "
            f"masks), got dtype {mask.dtype}: convert an additive float mask (0 = keep, -inf = drop) with "
            f"`{name} == 0`, and a 1/0 mask (1 = keep) with `{name}.bool()`"
        )
    if device is not None and mask.device != device:
        raise ValueError(
            f"{name} is on {mask.device} but the queries are on {device}: move it with `.to({device.type!r})`"
        )
    return mask


def check_token_mask(
    name: str, mask: Tensor | None, batch: int, length: int, *, device: torch.device | None = None
) -> Tensor | None:
    """A per-token bool mask `[batch, length]`, unchanged (None stays None).

    Raises:
        ValueError: The mask is not bool (see `check_bool_mask`), is not on `device`, or has another shape (the
            message names it by `name`).
    """
    mask = check_bool_mask(name, mask, device=device)
    if mask is None:
        return None
    if mask.dim() != 2 or tuple(mask.shape) != (batch, length):
        raise ValueError(f"{name} must have shape [batch, length] = [{batch}, {length}], got {tuple(mask.shape)}")
    return mask


def check_tensor_on(name: str, value, device: torch.device) -> None:
    """Raise `ValueError` unless `value` is a tensor on `device` (the device of a model's token inputs)."""
    if not isinstance(value, Tensor):
        raise ValueError(f"`{name}` must be a torch.Tensor, got {type(value).__name__}.")
    if value.device != device:
        raise ValueError(f"`{name}` is on {value.device} but the token inputs are on {device}: move it there.")


def check_input_mask(mask: Tensor | None, *, name: str, batch: int, length: int, device: torch.device) -> Tensor | None:
    """A model input mask `[b, length]` of 1 (keep / global) and 0, bool, integer or float as in transformers, as
    bool (None stays None): the one check of `attention_mask`, `global_attention_mask`, ... that longattn's models
    and the stock-model integration share.

    Args:
        mask: The mask as given.
        name: The argument's name, for the messages.
        batch, length: The expected shape `[batch, length]`.
        device: The token inputs' device.

    Raises:
        ValueError: not a tensor on `device`, another shape (a 4-D `[b, 1, n, m]` mask included: which keys a query
            sees is the attention kind's pattern, which such a mask cannot express), or a float mask with values
            other than 0 and 1 (NaN included: an additive mask, 0 keep / -inf drop, would be read the other way
            round).
    """
    if mask is None:
        return None
    check_tensor_on(name, mask, device)
    expected = f"[batch, length] = [{batch}, {length}]"
    if mask.dim() == 4:
        raise ValueError(
            f"`{name}` has shape {list(mask.shape)}: a 4-D mask is not supported, because which keys a query sees is "
            "set by each layer's `attention_type` (a sparse pattern such a mask cannot express, causality included). "
            f"Pass the {expected} mask: 1 = token, 0 = padding."
        )
    if mask.dim() != 2 or mask.shape[0] != batch or mask.shape[1] != length:
        raise ValueError(f"`{name}` has shape {list(mask.shape)}: expected {expected}.")
    if mask.is_complex() or (mask.is_floating_point() and not ((mask == 0) | (mask == 1)).all()):
        raise ValueError(
            f"`{name}` is a float mask with values other than 0 and 1: expected 1 = token, 0 = padding (as "
            "transformers' attention masks), bool or integer; an additive mask (0 keep, -inf drop) is not accepted."
        )
    return mask.bool()


def check_document_ids(document_ids: Tensor | None, batch: int, length: int, *, device=None) -> Tensor | None:
    """The document of each key in packed rows, integer `[batch, length]`, unchanged (None stays None).

    Raises:
        ValueError: It is not an integer tensor of that shape on `device`.
    """
    if document_ids is None:
        return None
    if not isinstance(document_ids, Tensor) or document_ids.dtype.is_floating_point or document_ids.dtype == torch.bool:
        raise ValueError(
            f"document_ids must be an integer tensor [batch, length] (the document of each token), got "
            f"{getattr(document_ids, 'dtype', type(document_ids).__name__)}"
        )
    if tuple(document_ids.shape) != (batch, length):
        raise ValueError(
            f"document_ids must have shape [batch, length] = [{batch}, {length}], got {tuple(document_ids.shape)}"
        )
    if device is not None and document_ids.device != device:
        raise ValueError(f"document_ids is on {document_ids.device}, the queries on {device}: put them on one device")
    return document_ids


def check_dropout(dropout_p: float) -> float:
    """The dropout probability as a float.

    Raises:
        ValueError: It is not a real number in [0, 1).
    """
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, numbers.Real) or not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be a float in [0, 1), got {dropout_p!r}")
    return float(dropout_p)


def check_scale(scale: float | None, head_dim: int) -> float:
    """The multiplier of q·k: `scale`, or 1/sqrt(head_dim) when None.

    Raises:
        ValueError: `scale` is not a finite real number.
    """
    if scale is None:
        return default_scale(head_dim)
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real) or not math.isfinite(scale):
        raise ValueError(f"scale must be a finite float (or None for 1/sqrt(head_dim)), got {scale!r}")
    return float(scale)


def check_positive_int(name: str, value: int, *, minimum: int = 1, meaning: str = "") -> int:
    """An int option >= `minimum`, unchanged.

    Raises:
        ValueError: It is not an int (bools are refused) or is below `minimum`.
    """
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        what = f" ({meaning})" if meaning else ""
        raise ValueError(f"{name} must be an int >= {minimum}{what}, got {value!r}")
    return value


def is_empty(q: Tensor, k: Tensor) -> bool:
    """Whether a checked call has no output row (batch, heads or queries 0) or no key to attend to."""
    return q.numel() == 0 or k.numel() == 0


def empty_attention(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """The output `[b, h, n_q, d_v]` of a call without queries or keys: empty, or zeros (no visible key), as SDPA.

    Computed from q, k and v (all three have no element, or q·kᵀ has none), so it stays in the autograd graph
    and the backward gives zero gradients of the inputs' shapes.
    """
    return torch.matmul(torch.matmul(q, k.transpose(-1, -2)), v)  # [b, h, n_q, n_k] @ [b, h, n_k, d_v]


def check_flag(name: str, value: bool) -> bool:
    """A bool option, unchanged.

    Raises:
        ValueError: It is not a bool (the message names it by `name`).
    """
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be a bool (True or False), got {value!r}")
    return value


def inert_padding(padding: Tensor | None, *tensors: Tensor) -> tuple[Tensor, ...]:
    """`tensors` (keys `[b, h, n_k, d]`, values `[b, h, n_k, d_v]`, ...) with every padded position zeroed.

    Padding may hold anything, NaN and inf included. Masking the logits keeps a padded key's weight at 0, but
    0 · inf is NaN, and a NaN key makes a whole q·kᵀ block NaN before any mask applies: zeroing the keys and values
    themselves is what keeps padding from reaching a real output or its gradient. `padding`: bool `[b, n_k]`, True =
    real token; None = no padding (the tensors come back unchanged).
    """
    if padding is None:
        return tensors
    padded = ~padding[:, None, :, None]  # [b, 1, n_k, 1]
    return tuple(t.masked_fill(padded, 0.0) for t in tensors)


class AttentionInputs(NamedTuple):
    """The arguments that every functional attention takes and checks alike, checked (`check_attention_inputs`)."""

    batch: int
    heads: int
    queries: int
    keys: int
    scale: float
    dropout_p: float
    key_padding_mask: Tensor | None
    document_ids: Tensor | None
    relative_embedding: Tensor | None


def check_attention_inputs(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    scale: float | None = None,
    dropout_p: float = 0.0,
    key_padding_mask: Tensor | None = None,
    document_ids: Tensor | None = None,
    relative_embedding: Tensor | None = None,
    flags: dict[str, bool] | None = None,
    names: tuple[str, str, str] = ("q", "k", "v"),
) -> AttentionInputs:
    """Check the arguments a functional attention shares with the others, in one order and one wording.

    Args:
        q: Queries `[b, h, n_q, d]`, the last n_q of the n_k key positions.
        k: Keys `[b, h, n_k, d]`.
        v: Values `[b, h, n_k, d_v]`.
        scale: The multiplier of q·k, None for 1/sqrt(d).
        dropout_p: Dropout on the attention probabilities.
        key_padding_mask: Bool `[b, n_k]`, True = real key.
        document_ids: Integer `[b, n_k]`: the document of each key of packed rows.
        relative_embedding: Relative-position logits r `[2M + 1, d]` (`longattn.relative_logits`).
        flags: The call's bool options by name (e.g. `{"causal": causal}`), checked to be bools.
        names: q, k and v's names in messages (`("qk", "qk", "v")` for shared-QK attention).

    Returns:
        An `AttentionInputs`: the sizes, and scale, dropout and the masks as the call runs with them.

    Raises:
        ValueError: Naming the argument, as `check_qkv`, `check_flag`, `check_scale`, `check_dropout`,
            `check_token_mask`, `check_document_ids` and `relative_logits.check_relative_embedding` word it.
    """
    b, h, n_q, n_k = check_qkv(q, k, v, names=names)
    for name, value in (flags or {}).items():
        check_flag(name, value)
    return AttentionInputs(
        batch=b,
        heads=h,
        queries=n_q,
        keys=n_k,
        scale=check_scale(scale, q.shape[-1]),
        dropout_p=check_dropout(dropout_p),
        key_padding_mask=check_token_mask("key_padding_mask", key_padding_mask, b, n_k, device=q.device),
        document_ids=check_document_ids(document_ids, b, n_k, device=q.device),
        relative_embedding=check_relative_embedding(relative_embedding, q),
    )
