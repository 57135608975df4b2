"""Efficient attention (Shen et al. 2021): the paper's equivalence, the causal form, padding, and the kind."""

from __future__ import annotations

import pytest
import torch
from kind_configs import tiny_config

import longattn
from longattn.ops_linear import efficient_attention, efficient_attention_weights


def qkv(b=2, h=3, n=150, d=8, dtype=torch.float64, seed=0, grad=False):
    generator = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(b, h, n, d, generator=generator, dtype=dtype).requires_grad_(grad) for _ in range(3))


def padding_mask(b, n):
    mask = torch.ones(b, n, dtype=torch.bool)
    mask[1, :17] = False  # left padding
    mask[1, n - 23 :] = False  # and right padding, in one row
    return mask


def dot_product_scaling(q, k, v, visible):
    """Dot-product attention with scaling normalisation: (Q Kᵀ / n) V over the visible keys (the paper's Eq. 2)."""
    count = visible.sum(-1, keepdim=True).clamp(min=1)
    return ((q @ k.transpose(-1, -2)) * visible / count) @ v


def test_scaling_normalisation_equals_dot_product_attention():
    q, k, v = qkv()
    n = q.shape[2]
    visible = torch.ones(n, n, dtype=torch.bool)
    torch.testing.assert_close(
        efficient_attention(q, k, v, normalization="scaling"), dot_product_scaling(q, k, v, visible)
    )
    causal = visible.tril()
    torch.testing.assert_close(
        efficient_attention(q, k, v, normalization="scaling", causal=True), dot_product_scaling(q, k, v, causal)
    )
    mask = padding_mask(2, n)
    torch.testing.assert_close(
        efficient_attention(q, k, v, normalization="scaling", causal=True, key_padding_mask=mask),
        dot_product_scaling(q, k, v, causal & mask[:, None, None, :]),
    )


def softmax_dense(q, k, v, visible):
    """Direct formula: per query i, softmax of q_i over features, softmax of each key feature over visible j."""
    logits = k.unsqueeze(2).masked_fill(~visible.unsqueeze(-1), float("-inf"))  # [b, h, n_q, n_k, d]
    key_weights = torch.softmax(logits, dim=3).nan_to_num(0.0)
    weights = torch.einsum("bhqf,bhqkf->bhqk", torch.softmax(q, dim=-1), key_weights)
    return weights @ v


@pytest.mark.parametrize("n_q", [150, 7])
def test_causal_form_equals_its_dense_causal_reference(n_q):
    q, k, v = qkv(grad=True)
    n = k.shape[2]
    mask = padding_mask(2, n)
    visible = torch.ones(n_q, n, dtype=torch.bool).tril(n - n_q) & mask[:, None, None, :]
    out = efficient_attention(q[:, :, n - n_q :], k, v, causal=True, key_padding_mask=mask)
    expected = softmax_dense(q[:, :, n - n_q :], k, v, visible)
    torch.testing.assert_close(out, expected)
    # Gradients too: the chunked prefix sums and the dense reference are the same function.
    grads = torch.autograd.grad(out.square().sum(), (q, k, v))
    grads_ref = torch.autograd.grad(expected.square().sum(), (q, k, v))
    for got, want in zip(grads, grads_ref):
        torch.testing.assert_close(got, want)


def test_global_softmax_form_is_the_papers_formula():
    q, k, v = qkv(n=40)
    expected = torch.softmax(q, dim=-1) @ (torch.softmax(k, dim=2).transpose(-1, -2) @ v)
    torch.testing.assert_close(efficient_attention(q, k, v), expected)
    weights = efficient_attention_weights(q, k)
    torch.testing.assert_close(weights.sum(-1), torch.ones_like(weights.sum(-1)))  # rows are distributions


@pytest.mark.parametrize("normalization", ["softmax", "scaling"])
@pytest.mark.parametrize("causal", [False, True])
def test_padding_contributes_nothing(normalization, causal):
    q, k, v = qkv(b=1, n=97)
    mask = torch.ones(1, 97, dtype=torch.bool)
    mask[0, 40:55] = False
    out = efficient_attention(q, k, v, normalization=normalization, causal=causal, key_padding_mask=mask)
    # Anything in the padded positions' keys and values is ignored...
    k2, v2 = k.clone(), v.clone()
    k2[:, :, 40:55] = 1e3
    v2[:, :, 40:55] = -7.0
    out2 = efficient_attention(q, k2, v2, normalization=normalization, causal=causal, key_padding_mask=mask)
    torch.testing.assert_close(out2, out)
    # ...and is the same as deleting them.
    keep = mask[0]
    alone = efficient_attention(q[:, :, keep], k[:, :, keep], v[:, :, keep], normalization=normalization, causal=causal)
    torch.testing.assert_close(out[:, :, keep], alone)


@pytest.mark.parametrize("causal", [False, True])
def test_fully_padded_row_is_zero_and_finite_in_bf16(causal):
    q, k, v = qkv(dtype=torch.bfloat16, grad=True)
    mask = torch.zeros(2, q.shape[2], dtype=torch.bool)
    mask[0] = True
    for normalization in ("softmax", "scaling"):
        out = efficient_attention(q, k, v, normalization=normalization, causal=causal, key_padding_mask=mask)
        assert torch.isfinite(out.float()).all() and (out[1] == 0).all()
        grads = torch.autograd.grad(out.float().sum(), (q, k, v))
        assert all(torch.isfinite(g.float()).all() for g in grads)


def test_causal_state_is_exact_across_many_chunks_with_large_logits():
    # Keys grow along the sequence, so the running stabiliser changes in every chunk (the state is rescaled).
    q, k, v = qkv(b=1, h=1, n=300, d=4)
    k = k + torch.linspace(0, 40, 300, dtype=torch.float64).view(1, 1, -1, 1)
    visible = torch.ones(300, 300, dtype=torch.bool).tril()
    torch.testing.assert_close(efficient_attention(q, k, v, causal=True), softmax_dense(q, k, v, visible))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_causal_form_is_exact_at_large_logits(dtype):
    # q and k scaled by 30: inside a chunk, later keys exceed earlier ones by more than float32's exponent range, so
    # a stabiliser shared by the chunk (its maximum) underflowed whole rows to zero (or NaN). Each query's own
    # prefix maximum keeps every row exact.
    q, k, v = qkv(n=150, grad=False)
    q, k = q * 30, k * 30
    mask = padding_mask(2, 150)
    visible = torch.ones(150, 150, dtype=torch.bool).tril() & mask[:, None, None, :]
    expected = softmax_dense(q, k, v, visible)  # float64
    inputs = [t.to(dtype).requires_grad_() for t in (q, k, v)]
    out = efficient_attention(*inputs, causal=True, key_padding_mask=mask)
    tolerance = {} if dtype == torch.float64 else dict(rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(out.double(), expected, **tolerance)
    assert (out[0].abs().sum(-1) > 0).all()  # no row without padding is zero
    grads = torch.autograd.grad(out.sum(), inputs)
    assert all(torch.isfinite(g).all() for g in grads)
    if dtype == torch.float64:
        reference = [t.detach().requires_grad_() for t in (q, k, v)]
        expected_grads = torch.autograd.grad(
            efficient_attention(*reference, causal=True, key_padding_mask=mask, backend="reference").sum(), reference
        )
        for grad, expected_grad in zip(grads, expected_grads):
            torch.testing.assert_close(grad, expected_grad)


def test_bad_arguments_raise():
    q, k, v = qkv(n=10)
    with pytest.raises(ValueError, match="normalization"):
        efficient_attention(q, k, v, normalization="relu")
    with pytest.raises(ValueError, match="key_padding_mask"):
        efficient_attention(q, k, v, key_padding_mask=torch.ones(2, 9, dtype=torch.bool))
    with pytest.raises(ValueError, match="efficient_normalization"):
        longattn.LongAttnConfig(attention_type="efficient", efficient_normalization="relu")


@pytest.mark.parametrize("normalization", ["softmax", "scaling"])
def test_kind_uses_the_kernel_and_explicit_weights_agree(normalization):
    config = tiny_config("efficient", num_hidden_layers=1, efficient_normalization=normalization)
    model = longattn.LongAttnModel(config).eval()
    ids = torch.randint(4, 50, (2, 45), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(2, 45, dtype=torch.long)
    mask[0, 30:] = 0
    with torch.no_grad():
        fast = model(input_ids=ids, attention_mask=mask).last_hidden_state
        explicit = model(input_ids=ids, attention_mask=mask, output_attentions=True)
    torch.testing.assert_close(explicit.last_hidden_state, fast, rtol=1e-5, atol=1e-5)
    assert explicit.attentions[0].shape == (2, 2, 45, 45)
    assert (explicit.attentions[0][0, :, :, 30:] == 0).all()  # padded keys get no weight
