"""Input checks shared by the functional attentions (`ops`, `ops_linear`): one wording for every error.

Shape legend: b batch, h heads, n_q queries, n_k keys, d head dim (d_v for values). This module depends on torch and
the back-end names (`longattn.backends`) only.
"""

from __future__ import annotations

from torch import Tensor

from .backends import check_backend_name

__all__ = ["check_backend_support", "check_dropout", "check_flag", "check_qkv", "check_token_mask"]


def check_backend_support(backend: str, *, attention: str, supported: tuple[str, ...],
                          unsupported: dict[str, str]) -> str:
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


def check_qkv(q: Tensor, k: Tensor, v: Tensor) -> tuple[int, int, int, int]:
    """Check q `[b, h, n_q, d]`, k `[b, h, n_k, d]`, v `[b, h, n_k, d_v]` with n_q <= n_k; return (b, h, n_q, n_k).

    Raises:
        ValueError: A tensor is not 4-d, the shapes disagree, or q has more positions than k (queries are the
            last n_q key positions).
    """
    for name, tensor in (("q", q), ("k", k), ("v", v)):
        if tensor.dim() != 4:
            raise ValueError(f"{name} must have shape [batch, heads, length, head_dim], got {tuple(tensor.shape)}")
    b, h, n_q, d = q.shape
    n_k = k.shape[2]
    if k.shape[:2] != (b, h) or k.shape[3] != d:
        raise ValueError(f"k must have shape [{b}, {h}, n_k, {d}] to match q {tuple(q.shape)}, got {tuple(k.shape)}")
    if v.shape[:3] != k.shape[:3]:
        raise ValueError(f"v must have shape [{b}, {h}, {n_k}, d_v] to match k {tuple(k.shape)}, got {tuple(v.shape)}")
    if n_q > n_k:
        raise ValueError(
            f"q has more positions ({n_q}) than k ({n_k}); queries are the last n_q key positions, so n_q <= n_k"
        )
    return b, h, n_q, n_k


def check_token_mask(name: str, mask: Tensor | None, batch: int, length: int) -> Tensor | None:
    """A per-token mask `[batch, length]` as bool (None stays None).

    Raises:
        ValueError: The mask has another shape (the message names it by `name`).
    """
    if mask is None:
        return None
    if mask.dim() != 2 or tuple(mask.shape) != (batch, length):
        raise ValueError(f"{name} must have shape [batch, length] = [{batch}, {length}], got {tuple(mask.shape)}")
    return mask.bool()


def check_dropout(dropout_p: float) -> float:
    """The dropout probability as a float.

    Raises:
        ValueError: It is not in [0, 1).
    """
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p!r}")
    return float(dropout_p)


def check_flag(name: str, value: bool) -> bool:
    """A bool option, unchanged.

    Raises:
        ValueError: It is not a bool (the message names it by `name`).
    """
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be a bool (True or False), got {value!r}")
    return value
