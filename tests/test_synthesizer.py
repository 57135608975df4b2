"""Synthesizer (Tay et al. 2021): every mode equals its formula, causal masking leaks nothing, shorter inputs work."""

from __future__ import annotations

import functools

import pytest
import torch
from kind_configs import tiny_config
from transformers.cache_utils import DynamicCache

import longattn
from longattn.attention_synthesizer import SynthesizerAttention

MODES = ["dense", "random", "factorized_dense", "factorized_random"]
L, D, H = 24, 16, 2


config = functools.partial(
    tiny_config, "synthesizer", hidden_size=D, intermediate_size=32, max_position_embeddings=L, synthesizer_factor_k=5
)


def module(mode: str, *, mix: bool = False, causal: bool = False, **fields) -> SynthesizerAttention:
    torch.manual_seed(0)
    attention = SynthesizerAttention(
        config(synthesizer_mode=mode, synthesizer_mix=mix, **fields), layer_idx=0, is_causal=causal
    )
    attention = attention.double().eval()
    with torch.no_grad():  # larger logits than the initialisation, so that the softmax is far from uniform
        for name, param in attention.named_parameters():
            if name.startswith("synth_"):
                param.normal_(0.0, 0.7)
    return attention


def linear(layer, x):
    return x @ layer.weight.T + layer.bias


def direct_logits(attention: SynthesizerAttention, x: torch.Tensor) -> torch.Tensor:
    """The paper's formulas, per head, on positions 0..n-1: `[b, h, n, n]`."""
    b, n, _ = x.shape
    mode, k = attention.mode, attention.factor_k
    if mode in ("dense", "factorized_dense"):
        hidden = torch.relu(linear(attention.synth_hidden, x))
    if mode == "dense":  # B = W_2 relu(W_1 X + b_1) + b_2, one logit per key position
        return linear(attention.synth_logits, hidden).view(b, n, H, L).permute(0, 2, 1, 3)[..., :n]
    if mode == "factorized_dense":  # C = H_A(A) * H_B(B): A tiled, B repeated
        a = linear(attention.synth_logits_a, hidden).view(b, n, H, k).permute(0, 2, 1, 3)
        c = linear(attention.synth_logits_b, hidden).view(b, n, H, -1).permute(0, 2, 1, 3)
        tiled = a.repeat(1, 1, 1, -(-L // k))  # [.., a·c]: A[0..a-1], A[0..a-1], ...
        repeated = c.repeat_interleave(k, dim=-1)  # B[0] a times, B[1] a times, ...
        return (tiled * repeated)[..., :n]
    if mode == "random":  # R, input independent
        r = attention.synth_random.weight.view(L, H, L).permute(1, 0, 2)  # [h, L, L]
        return r[None, :, :n, :n].expand(b, -1, -1, -1)
    r1 = attention.synth_random_a.weight.view(L, H, k).permute(1, 0, 2)[:, :n]  # [h, n, k]
    r2 = attention.synth_random_b.weight.view(L, H, k).permute(1, 0, 2)[:, :n]
    return (r1 @ r2.transpose(-1, -2))[None].expand(b, -1, -1, -1)  # R_1 R_2ᵀ


def direct_output(attention: SynthesizerAttention, x: torch.Tensor, causal: bool = False) -> torch.Tensor:
    b, n, _ = x.shape
    logits = direct_logits(attention, x)
    v = linear(attention.v_proj, x).view(b, n, H, D // H).transpose(1, 2)
    if attention.mix:  # softmax(α_1 S + α_2 Q Kᵀ / sqrt(d))
        q = linear(attention.q_proj, x).view(b, n, H, D // H).transpose(1, 2)
        k = linear(attention.k_proj, x).view(b, n, H, D // H).transpose(1, 2)
        alpha = torch.softmax(attention.synth_mix, dim=-1)
        logits = (
            alpha[:, 0, None, None] * logits + alpha[:, 1, None, None] * (q @ k.transpose(-1, -2)) / (D // H) ** 0.5
        )
    if causal:
        logits = logits.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
    out = torch.softmax(logits, dim=-1) @ v
    return linear(attention.o_proj, out.transpose(1, 2).reshape(b, n, D))


@pytest.mark.parametrize("mix", [False, True])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("n", [L, 13])  # the full length, and a shorter input (leading rows and columns)
def test_each_mode_equals_its_formula(mode, mix, n):
    attention = module(mode, mix=mix)
    x = torch.randn(2, n, D, dtype=torch.float64)
    out, weights = attention(x, output_attentions=True)
    torch.testing.assert_close(out, direct_output(attention, x))
    assert weights.shape == (2, H, n, n)
    torch.testing.assert_close(weights.sum(-1), torch.ones(2, H, n, dtype=torch.float64))
    attention.is_causal = True  # decoders mask the upper triangle
    torch.testing.assert_close(attention(x)[0], direct_output(attention, x, causal=True))


@pytest.mark.parametrize("mode", MODES)
def test_causal_masking_leaks_nothing_and_the_cache_agrees(mode):
    attention = module(mode, mix=mode == "random", causal=True)
    x = torch.randn(1, 20, D, dtype=torch.float64)
    changed = x.clone()
    changed[:, 12:] = torch.randn(1, 8, D, dtype=torch.float64)
    before, after = attention(x)[0], attention(changed)[0]
    torch.testing.assert_close(after[:, :12], before[:, :12])
    assert not torch.allclose(after[:, 12:], before[:, 12:])
    # Decoding token by token with a cache gives the same outputs as the whole sequence at once.
    cache = DynamicCache()
    steps = [attention(x[:, :7], past_key_values=cache)[0]]
    steps += [attention(x[:, t : t + 1], past_key_values=cache)[0] for t in range(7, 20)]
    torch.testing.assert_close(torch.cat(steps, dim=1), before)


@pytest.mark.parametrize("mode", MODES)
def test_padding_is_masked_and_does_not_shift_positions(mode):
    attention = module(mode, mix=True)
    real = torch.randn(1, 15, D, dtype=torch.float64)
    x = torch.cat([torch.randn(1, 4, D, dtype=torch.float64), real, torch.randn(1, 3, D, dtype=torch.float64)], 1)
    mask = torch.zeros(1, 22, dtype=torch.bool)
    mask[0, 4:19] = True
    out, weights = attention(x, attention_mask=mask, output_attentions=True)
    torch.testing.assert_close(out[:, mask[0]], attention(real)[0])
    assert (weights[..., ~mask[0]] == 0).all()
    # A fully padded row in bfloat16 stays finite.
    attention = attention.to(torch.bfloat16).train()
    out, _ = attention(x.to(torch.bfloat16), attention_mask=torch.zeros(1, 22, dtype=torch.bool))
    assert torch.isfinite(out.float()).all()


def test_parameters_are_only_the_used_ones_and_fixed_random_stays_fixed():
    names = {mode: {n.split(".")[0] for n, _ in module(mode).named_parameters()} for mode in MODES}
    assert names["dense"] == {"v_proj", "o_proj", "synth_hidden", "synth_logits"}
    assert names["random"] == {"v_proj", "o_proj", "synth_random"}
    assert names["factorized_dense"] == {"v_proj", "o_proj", "synth_hidden", "synth_logits_a", "synth_logits_b"}
    assert names["factorized_random"] == {"v_proj", "o_proj", "synth_random_a", "synth_random_b"}
    assert {n.split(".")[0] for n, _ in module("random", mix=True).named_parameters()} >= {
        "q_proj",
        "k_proj",
        "synth_mix",
    }

    model = longattn.LongAttnForMaskedLM(
        config(synthesizer_mode="factorized_random", synthesizer_random_trainable=False)
    )
    table = model.longattn.encoder.layers[0].self_attn.synth_random_a.weight
    assert not table.requires_grad
    before = table.clone()
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    ids = torch.randint(4, 50, (2, 20))
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    torch.testing.assert_close(table, before, rtol=0, atol=0)
    assert "longattn.encoder.layers.0.self_attn.synth_random_a.weight" in model.state_dict()


@pytest.mark.parametrize(
    "fields, message",
    [
        (dict(synthesizer_mode="sparse"), "synthesizer_mode"),
        (dict(synthesizer_factor_k=0), "synthesizer_factor_k"),
        (dict(synthesizer_mix="yes"), "synthesizer_mix"),
        (dict(synthesizer_random_trainable=1), "synthesizer_random_trainable"),
    ],
)
def test_config_errors(fields, message):
    with pytest.raises(ValueError, match=message):
        config(**fields)


def test_longer_inputs_than_the_synthesised_length_raise():
    attention = module("dense")
    with pytest.raises(ValueError, match="max_position_embeddings"):
        attention(torch.randn(1, L + 1, D, dtype=torch.float64))


@pytest.mark.parametrize("mode", MODES)
def test_output_attentions_are_the_dropped_weights_each_sequence_its_own(mode):
    """The returned weights are the tensor the output was computed from (after dropout, in training); the
    input-independent modes share one matrix across the batch, yet each sequence draws its own dropout mask."""
    attention = module(mode, attention_probs_dropout_prob=0.5).train()
    x = torch.randn(1, 10, D, dtype=torch.float64).expand(2, -1, -1)  # two identical sequences
    torch.manual_seed(3)
    out, weights = attention(x, output_attentions=True)
    values = linear(attention.v_proj, x).view(2, 10, H, D // H).transpose(1, 2)
    expected = linear(attention.o_proj, (weights @ values).transpose(1, 2).reshape(2, 10, D))
    torch.testing.assert_close(out, expected)
    assert not torch.equal(weights[0], weights[1]), "both sequences were dropped with the same mask"
