"""Adaptive attention span (Sukhbaatar et al. 2019): the soft mask, the penalty in the loss, banded == dense."""

from __future__ import annotations

import functools

import pytest
import torch
from kind_configs import tiny_config

import longattn
from longattn.attention_adaptive_span import (
    AdaptiveSpanAttention,
    adaptive_span_attention,
    adaptive_span_reference,
    soft_span_mask,
)

config = functools.partial(
    tiny_config, "adaptive_span", num_attention_heads=4, adaptive_span_max=[12, 20], adaptive_span_ramp=4
)


def test_soft_mask_matches_the_formula():
    ramp, z = 4, 2.5
    distance = torch.arange(10, dtype=torch.float64)
    expected = [min(max((ramp + z - x) / ramp, 0.0), 1.0) for x in range(10)]  # m_z(x) = min(max((R+z-x)/R, 0), 1)
    torch.testing.assert_close(
        soft_span_mask(distance, torch.tensor(z, dtype=torch.float64), ramp),
        torch.tensor(expected, dtype=torch.float64),
    )
    assert expected[:3] == [1.0, 1.0, 1.0] and expected[5] == 0.375 and expected[7:] == [0.0] * 3


def test_weights_are_the_masked_softmax_of_the_paper():
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 9, 4, generator=generator, dtype=torch.float64) for _ in range(3))
    span = torch.tensor([1.5, 6.0], dtype=torch.float64)
    _, weights = adaptive_span_reference(q, k, v, span=span, max_span=6, ramp=2, causal=True, scale=0.5)
    t = 8  # a_tr = m_z(t - r) exp(s_tr) / Σ_q m_z(t - q) exp(s_tq), over r = t - S .. t
    for head in range(2):
        scores = (q[0, head, t] @ k[0, head].T) * 0.5
        mask = torch.tensor(
            [
                soft_span_mask(torch.tensor(float(t - r)), span[head], 2).item() if 0 <= t - r <= 6 else 0.0
                for r in range(9)
            ],
            dtype=torch.float64,
        )
        expected = mask * scores.exp() / (mask * scores.exp()).sum()
        torch.testing.assert_close(weights[0, head, t], expected)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("n_q", [37, 5])
@pytest.mark.parametrize("dropout_p", [0.0, 1e-12])  # the hand-written backward, and the autograd path dropout uses
def test_banded_executor_equals_the_dense_reference(causal, n_q, dropout_p):
    generator = torch.Generator().manual_seed(1)
    b, h, n_k, d = 2, 4, 37, 8
    q = torch.randn(b, h, n_q, d, generator=generator, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(b, h, n_k, d, generator=generator, dtype=torch.float64, requires_grad=True) for _ in range(2))
    span = torch.tensor([0.0, 3.3, 7.5, 10.0], dtype=torch.float64, requires_grad=True)  # 0 and S included
    mask = torch.ones(b, n_k, dtype=torch.bool)
    mask[1, :4] = False
    mask[1, 30:] = False
    kwargs = dict(span=span, max_span=10, ramp=3, causal=causal, key_padding_mask=mask)
    # 37 is not a multiple of the block. A dropout probability of 1e-12 drops nothing here but takes the other path.
    out = adaptive_span_attention(q, k, v, block_size=8, dropout_p=dropout_p, **kwargs)
    expected, _ = adaptive_span_reference(q, k, v, **kwargs)
    torch.testing.assert_close(out, expected)
    grad_out = torch.randn(out.shape, generator=generator, dtype=torch.float64)
    grads = torch.autograd.grad(out, (q, k, v, span), grad_out)
    grads_ref = torch.autograd.grad(expected, (q, k, v, span), grad_out)
    for got, want in zip(grads, grads_ref):
        torch.testing.assert_close(got, want)
    assert grads[3].abs().sum() > 0  # the spans learn through the ramp


@pytest.mark.parametrize("causal", [True, False])
def test_heads_whose_span_hides_every_key_give_zeros_not_nan(causal):
    """A span at most -R gives m = 0 even at distance 0: that head's rows see no key (zeros, as the dense form),
    while the other head still learns its span through the hand-written backward."""
    generator = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 2, 23, 4, generator=generator, dtype=torch.float64, requires_grad=True) for _ in range(3))
    span = torch.tensor([-5.0, 2.5], dtype=torch.float64, requires_grad=True)
    kwargs = dict(span=span, max_span=6, ramp=3, causal=causal)
    out = adaptive_span_attention(q, k, v, block_size=4, **kwargs)
    expected, _ = adaptive_span_reference(q, k, v, **kwargs)
    torch.testing.assert_close(out, expected)
    assert (out[:, 0] == 0).all() and not out.isnan().any()
    grad_out = torch.randn(out.shape, generator=generator, dtype=torch.float64)
    grads = torch.autograd.grad(out, (q, k, v, span), grad_out)
    for got, want in zip(grads, torch.autograd.grad(expected, (q, k, v, span), grad_out)):
        torch.testing.assert_close(got, want)
    assert grads[3][0] == 0 and grads[3][1] != 0


def test_keys_beyond_the_largest_span_are_never_read():
    generator = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, 2, 200, 4, generator=generator) for _ in range(3))
    span = torch.tensor([3.0, 5.0])
    out = adaptive_span_attention(q, k, v, span=span, max_span=100, ramp=2, causal=False)
    # Blocks of 64 queries gather the keys within reach 5 + 2 of them, so queries 0..127 read keys 0..134 only. A
    # masked dense product would multiply NaN values by zero weights and spread NaN everywhere; the band does not.
    k[:, :, 135:], v[:, :, 135:] = float("nan"), float("nan")
    poisoned = adaptive_span_attention(q, k, v, span=span, max_span=100, ramp=2, causal=False, block_size=64)
    torch.testing.assert_close(poisoned[:, :, :128], out[:, :, :128])
    assert torch.isnan(poisoned[:, :, 128:]).any()


def test_span_penalty_is_in_the_loss_and_its_gradient_reaches_z():
    torch.manual_seed(0)
    coef = 0.01
    model = longattn.LongAttnForCausalLM(config(adaptive_span_loss_coef=coef, is_decoder=True))
    with torch.no_grad():
        for layer in model.longattn.encoder.layers:
            layer.self_attn.span_fraction.copy_(torch.tensor([0.0, 0.25, 0.5, 1.0]))
    ids = torch.randint(4, 50, (2, 30))
    out = model(input_ids=ids, labels=ids)
    # (λ / M) Σ_i z_i per layer, z = S · fraction: mean fraction 0.4375, S = 12 and 20.
    penalty = coef * 0.4375 * (12 + 20)
    free = longattn.LongAttnForCausalLM(config(adaptive_span_loss_coef=0.0, is_decoder=True))
    free.load_state_dict(model.state_dict())
    out_free = free(input_ids=ids, labels=ids)
    torch.testing.assert_close(out.loss - out_free.loss, torch.tensor(penalty), rtol=1e-5, atol=1e-6)
    out.loss.backward()
    out_free.loss.backward()
    for layer, layer_free, s in zip(model.longattn.encoder.layers, free.longattn.encoder.layers, (12, 20)):
        difference = layer.self_attn.span_fraction.grad - layer_free.self_attn.span_fraction.grad
        torch.testing.assert_close(difference, torch.full((4,), coef * s / 4))  # d/dz of the penalty
        assert layer_free.self_attn.span_fraction.grad.abs().sum() > 0  # the task gradient reaches z too


def test_spans_are_clamped_with_a_straight_through_gradient():
    attention = AdaptiveSpanAttention(config(), layer_idx=0, is_causal=True)
    with torch.no_grad():
        attention.span_fraction.copy_(torch.tensor([-0.5, 0.5, 1.5, 0.0]))
    spans = attention.spans()
    torch.testing.assert_close(spans, torch.tensor([0.0, 6.0, 12.0, 0.0]))
    spans.sum().backward()
    torch.testing.assert_close(attention.span_fraction.grad, torch.full((4,), 12.0))
    # The penalty does not push a span below zero.
    attention.span_fraction.grad = None
    attention.auxiliary_loss().backward()
    assert attention.span_fraction.grad[0] == 0 and attention.span_fraction.grad[2] > 0


def test_encoder_and_decoder_paths_agree_with_the_explicit_weights():
    torch.manual_seed(0)
    for is_decoder in (False, True):
        model = longattn.LongAttnModel(config(is_decoder=is_decoder)).eval()
        with torch.no_grad():
            for layer in model.encoder.layers:
                layer.self_attn.span_fraction.uniform_(0, 1)
        ids = torch.randint(4, 50, (2, 41))
        mask = torch.ones(2, 41, dtype=torch.long)
        mask[1, 33:] = 0
        with torch.no_grad():
            fast = model(input_ids=ids, attention_mask=mask, use_cache=False).last_hidden_state
            explicit = model(input_ids=ids, attention_mask=mask, output_attentions=True, use_cache=False)
        torch.testing.assert_close(explicit.last_hidden_state, fast, rtol=1e-5, atol=1e-5)
        attentions = explicit.attentions[0]  # layer 0: S = 12, so nothing farther than 12 is seen
        far = (torch.arange(41)[:, None] - torch.arange(41)[None]).abs() > 12
        assert (attentions[..., far] == 0).all()


@pytest.mark.parametrize(
    "fields, message",
    [
        (dict(adaptive_span_max=0), "adaptive_span_max"),
        (dict(adaptive_span_max=[4, 4, 4]), "adaptive_span_max"),
        (dict(adaptive_span_ramp=0), "adaptive_span_ramp"),
        (dict(adaptive_span_loss_coef=-1.0), "adaptive_span_loss_coef"),
    ],
)
def test_config_errors(fields, message):
    with pytest.raises(ValueError, match=message):
        config(**fields)


def test_forward_and_backward_keep_rows_not_band_tensors_and_small_workspaces():
    """Saved for backward: q, the padded k and v, the output and two numbers per query (O(n·d)); the soft mask is
    one [h, c, w] table. Forward + backward add O(n·d) tensors and chunk workspaces of about 1 MB each: at this
    size, less than two [n, w] band tensors in all."""
    from attention_checks import peak_tensor_bytes, saved_tensor_bytes

    b, h, n, d, max_span = 1, 2, 1024, 16, 256
    q, k, v = (torch.randn(b, h, n, d, requires_grad=True) for _ in range(3))
    span = torch.full((h,), float(max_span), requires_grad=True)

    def step():
        out = adaptive_span_attention(q, k, v, span=span, max_span=max_span, ramp=32, causal=False)
        out.backward(torch.ones_like(out))

    floating, _ = saved_tensor_bytes(step)
    rows = b * h * (n + 2 * max_span) * d * 4  # one float32 [b, h, n + 2S, d] tensor
    table = h * 64 * (64 + 2 * max_span) * 4  # one float32 [h, c, w] table (the soft mask and its autograd inputs)
    assert floating <= 5 * rows + 3 * table, floating
    band = b * h * n * (64 + 2 * max_span) * 4  # one float32 [n, w] band tensor: 4.5 MB here
    peak = peak_tensor_bytes(step)
    assert peak <= 2 * band, (peak, band)  # about 1.6 band tensors; 4 MB chunk workspaces made it 4.5
