"""`longattn.ops_checks` directly: each check raises the documented ValueError naming the argument and the value
(and what is allowed), and returns valid input unchanged."""

from __future__ import annotations

import math
import re

import pytest
import torch

from longattn import ops_checks


def _t(*shape, dtype=torch.float32):
    return torch.zeros(*shape, dtype=dtype)


Q, K, V = _t(2, 3, 5, 4), _t(2, 3, 7, 4), _t(2, 3, 7, 6)


# ---------------------------------------------------------------------------------------------- check_qkv
def test_check_qkv_returns_the_sizes():
    assert ops_checks.check_qkv(Q, K, V) == (2, 3, 5, 7)
    # Grouped-query attention: 1 or 3 key/value heads for 3 query heads.
    assert ops_checks.check_qkv(Q, _t(2, 1, 7, 4), _t(2, 1, 7, 6), grouped=True) == (2, 3, 5, 7)
    # More queries than keys is fine when the queries are not the last key positions.
    assert ops_checks.check_qkv(_t(2, 3, 9, 4), K, V, queries_last=False) == (2, 3, 9, 7)


@pytest.mark.parametrize(
    ("q", "k", "v", "message"),
    [
        ([[1.0]], K, V, "q must be a torch.Tensor [batch, heads, length, head_dim], got list"),
        (Q, _t(2, 7, 4), V, "k must have shape [batch, heads, length, head_dim], got (2, 7, 4)"),
        (
            Q,
            K,
            torch.zeros(2, 3, 7, 6, dtype=torch.long),
            "v must have a floating-point dtype (float16, bfloat16, float32, float64), got torch.int64",
        ),
        (_t(2, 3, 5, 0), _t(2, 3, 7, 0), V, "q has head_dim 0 (shape (2, 3, 5, 0)): head_dim must be >= 1"),
        (
            Q,
            _t(2, 3, 7, 4, dtype=torch.float64),
            V,
            "k has dtype torch.float64 but q has torch.float32: q, k, v must share one dtype",
        ),
        (Q, K, V.to(device="meta"), "v is on meta but q is on cpu: q, k, v must be on one device"),
        (Q, _t(1, 3, 7, 4), V, "k must have shape [2, 3, n_k, 4] to match q (2, 3, 5, 4), got (1, 3, 7, 4)"),
        (Q, _t(2, 2, 7, 4), V, "k must have shape [2, 3, n_k, 4] to match q (2, 3, 5, 4), got (2, 2, 7, 4)"),
        (Q, _t(2, 3, 7, 8), V, "k must have shape [2, 3, n_k, 4] to match q (2, 3, 5, 4), got (2, 3, 7, 8)"),
        (Q, K, _t(2, 3, 6, 6), "v must have shape [2, 3, 7, d_v] to match k (2, 3, 7, 4), got (2, 3, 6, 6)"),
        (
            _t(2, 3, 9, 4),
            K,
            V,
            "q has more positions (9) than k (7); queries are the last n_q key positions, so n_q <= n_k",
        ),
    ],
)
def test_check_qkv_names_the_tensor_and_its_fault(q, k, v, message):
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        ops_checks.check_qkv(q, k, v)


def test_check_qkv_uses_the_given_names_and_the_grouped_rule():
    with pytest.raises(ValueError, match=re.escape("v must have shape [2, 3, 7, d_v] to match qk (2, 3, 7, 4)")):
        ops_checks.check_qkv(K, K, _t(2, 3, 5, 6), names=("qk", "qk", "v"))
    with pytest.raises(ValueError, match=re.escape("k must have shape [2, h_kv dividing 3, n_k, 4]")):
        ops_checks.check_qkv(Q, _t(2, 2, 7, 4), _t(2, 2, 7, 6), grouped=True)


# ---------------------------------------------------------------------------------------------- masks
def test_bool_masks_pass_unchanged_and_none_stays_none():
    mask = torch.ones(2, 7, dtype=torch.bool)
    assert ops_checks.check_bool_mask("attn_mask", mask) is mask
    assert ops_checks.check_bool_mask("attn_mask", None) is None
    assert ops_checks.check_token_mask("key_padding_mask", mask, 2, 7) is mask
    assert ops_checks.check_token_mask("key_padding_mask", None, 2, 7) is None


@pytest.mark.parametrize(
    ("mask", "message"),
    [
        ([[True]], "global_mask must be a bool torch.Tensor (True = attend), got list"),
        (
            torch.ones(2, 7),
            "global_mask must be a bool tensor (True = attend / take part, as "
            "scaled_dot_product_attention's bool masks), got dtype torch.float32: convert an additive float mask "
            "(0 = keep, -inf = drop) with `global_mask == 0`, "
            "and a 1/0 mask (1 = keep) with `global_mask.bool()`",
        ),
        (
            torch.ones(2, 7, dtype=torch.bool, device="meta"),
            "global_mask is on meta but the queries are on cpu: move it with `.to('cpu')`",
        ),
        (torch.ones(2, 6, dtype=torch.bool), "global_mask must have shape [batch, length] = [2, 7], got (2, 6)"),
        (torch.ones(14, dtype=torch.bool), "global_mask must have shape [batch, length] = [2, 7], got (14,)"),
    ],
)
def test_token_mask_names_the_mask_and_its_fault(mask, message):
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        ops_checks.check_token_mask("global_mask", mask, 2, 7, device=torch.device("cpu"))


# ---------------------------------------------------------------------------------------------- options
@pytest.mark.parametrize("value", [0, 0.0, 0.5, 0.999])
def test_dropout_in_range_is_a_float(value):
    assert ops_checks.check_dropout(value) == value and isinstance(ops_checks.check_dropout(value), float)


@pytest.mark.parametrize("value", [1.0, -0.1, True, "0.1", None, math.nan])
def test_dropout_out_of_range(value):
    with pytest.raises(ValueError, match=f"^dropout_p must be a float in \\[0, 1\\), got {re.escape(repr(value))}$"):
        ops_checks.check_dropout(value)


def test_scale_defaults_to_one_over_sqrt_head_dim():
    assert ops_checks.check_scale(None, 16) == 0.25
    assert ops_checks.check_scale(2, 16) == 2.0 and isinstance(ops_checks.check_scale(2, 16), float)
    assert ops_checks.check_scale(-0.5, 16) == -0.5


@pytest.mark.parametrize("value", [math.inf, math.nan, True, "0.5", torch.tensor([0.5, 0.5])])
def test_scale_must_be_finite(value):
    with pytest.raises(ValueError, match=f"^scale must be a finite float .*got {re.escape(repr(value))}$"):
        ops_checks.check_scale(value, 16)


def test_positive_int():
    assert ops_checks.check_positive_int("num_hashes", 3) == 3
    assert ops_checks.check_positive_int("num_chunks_before", 0, minimum=0) == 0
    for value in (0, -2, 2.0, True, "2"):
        message = f"num_hashes must be an int >= 1 (rounds), got {value!r}"
        with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
            ops_checks.check_positive_int("num_hashes", value, meaning="rounds")
    with pytest.raises(ValueError, match=r"^num_chunks_before must be an int >= 0, got -1$"):
        ops_checks.check_positive_int("num_chunks_before", -1, minimum=0)


def test_flag():
    assert ops_checks.check_flag("causal", True) is True and ops_checks.check_flag("causal", False) is False
    for value in (1, 0, "True", None):
        message = f"causal must be a bool (True or False), got {value!r}"
        with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
            ops_checks.check_flag("causal", value)


# ---------------------------------------------------------------------------------------------- back ends
def test_backend_support():
    kwargs = dict(attention="LSH", supported=("auto", "torch"), unsupported={"flex": "its buckets change per call"})
    assert ops_checks.check_backend_support("torch", **kwargs) == "torch"
    with pytest.raises(
        ValueError,
        match=re.escape(
            "`backend`='flex' cannot run LSH attention: its buckets change per call; use one of ['auto', 'torch']."
        ),
    ):
        ops_checks.check_backend_support("flex", **kwargs)
    with pytest.raises(
        ValueError,
        match=re.escape(
            "`backend`='reference' cannot run LSH attention: it has no implementation of LSH attention; use one of"
        ),
    ):
        ops_checks.check_backend_support("reference", **kwargs)
    with pytest.raises(ValueError, match=r"`backend`='cuda' is unknown"):
        ops_checks.check_backend_support("cuda", **kwargs)


# ---------------------------------------------------------------------------------------------- empty calls
@pytest.mark.parametrize(
    ("q_shape", "k_shape", "empty"),
    [
        ((2, 3, 5, 4), (2, 3, 7, 4), False),
        ((0, 3, 5, 4), (0, 3, 7, 4), True),
        ((2, 3, 0, 4), (2, 3, 7, 4), True),
        ((2, 3, 5, 4), (2, 3, 0, 4), True),
    ],
)
def test_empty_attention_is_zeros_of_the_output_shape_with_gradients(q_shape, k_shape, empty):
    q = torch.randn(q_shape, requires_grad=True)
    k = torch.randn(k_shape, requires_grad=True)
    v = torch.randn(*k_shape[:3], 6, requires_grad=True)
    assert ops_checks.is_empty(q, k) is empty
    if not empty:
        return
    out = ops_checks.empty_attention(q, k, v)
    assert out.shape == (*q_shape[:3], 6) and not out.any()
    grads = torch.autograd.grad(out.sum(), (q, k, v), allow_unused=False)
    assert [g.shape for g in grads] == [q.shape, k.shape, v.shape] and not any(g.any() for g in grads)
