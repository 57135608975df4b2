"""Linformer (Wang et al. 2020): identity projections give full attention, padding changes nothing, sharing modes."""

from __future__ import annotations

import functools

import pytest
import torch
from kind_configs import tiny_config

import longattn
from longattn import LongAttnConfig
from longattn.attention_base import LongAttnAttention
from longattn.attention_linformer import LinformerAttention
from longattn.ops import reference_attention

config = functools.partial(tiny_config, "linformer", max_position_embeddings=48, linformer_proj_len=8)


def layer(cfg: LongAttnConfig, layer_idx: int = 0) -> LinformerAttention:
    return LinformerAttention(cfg, layer_idx=layer_idx, is_causal=False).double().eval()


def qkv(b=2, h=2, n=48, d=16, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(b, h, n, d, generator=generator, dtype=torch.float64) for _ in range(3))


@pytest.mark.parametrize("sharing", ["none", "headwise", "key_value", "layerwise"])
def test_identity_projections_with_k_equal_n_give_full_attention(sharing):
    attention = layer(config(linformer_proj_len=48, linformer_sharing=sharing))
    with torch.no_grad():
        for table in (attention.e_proj, attention.f_proj):
            if table is not None:
                heads = table.weight.shape[1] // 48
                table.weight.copy_(torch.eye(48, dtype=torch.float64).repeat(1, heads))
    q, k, v = qkv()
    out = attention.attend(q, k, v, key_padding_mask=None, global_mask=None)
    torch.testing.assert_close(out, reference_attention(q, k, v, None))
    # The explicit weights are then the attention probabilities themselves.
    dense_out, weights = attention.attend_dense(q, k, v, key_padding_mask=None, global_mask=None)
    ref_out, ref_weights = reference_attention(q, k, v, None, return_weights=True)
    torch.testing.assert_close(dense_out, ref_out)
    torch.testing.assert_close(weights, ref_weights)


def test_the_direct_formula_with_random_projections():
    attention = layer(config(linformer_sharing="none"))
    q, k, v = qkv(n=30)
    e = attention.e_proj.weight[:30].view(30, 2, 8).permute(1, 0, 2)  # [h, n, k]
    f = attention.f_proj.weight[:30].view(30, 2, 8).permute(1, 0, 2)
    k_bar = torch.einsum("hnk,bhnd->bhkd", e, k)
    v_bar = torch.einsum("hnk,bhnd->bhkd", f, v)
    expected = torch.softmax(q @ k_bar.transpose(-1, -2) / 4.0, dim=-1) @ v_bar
    torch.testing.assert_close(attention.attend(q, k, v, key_padding_mask=None, global_mask=None), expected)


def test_padded_tokens_change_nothing():
    attention = layer(config())
    q, k, v = qkv(b=1, n=40)
    mask = torch.ones(1, 40, dtype=torch.bool)
    mask[0, :6] = False  # left padding: the real tokens must use projection rows 0, 1, ... as without padding
    mask[0, 35:] = False
    out = attention.attend(q, k, v, key_padding_mask=mask, global_mask=None)
    k2, v2 = k.clone(), v.clone()
    k2[:, :, ~mask[0]] = 50.0
    v2[:, :, ~mask[0]] = -3.0
    torch.testing.assert_close(attention.attend(q, k2, v2, key_padding_mask=mask, global_mask=None), out)
    keep = mask[0]
    alone = attention.attend(q[:, :, keep], k[:, :, keep], v[:, :, keep], key_padding_mask=None, global_mask=None)
    torch.testing.assert_close(out[:, :, keep], alone)
    _, weights = attention.attend_dense(q, k, v, key_padding_mask=mask, global_mask=None)
    assert (weights[..., ~keep] == 0).all()


def test_shorter_inputs_use_the_leading_rows():
    attention = layer(config())
    q, k, v = qkv(n=48)
    full = attention.attend(q[:, :, :20], k[:, :, :20], v[:, :, :20], key_padding_mask=None, global_mask=None)
    mask = torch.zeros(2, 48, dtype=torch.bool)
    mask[:, :20] = True
    padded = attention.attend(q, k, v, key_padding_mask=mask, global_mask=None)
    torch.testing.assert_close(padded[:, :, :20], full)
    with pytest.raises(ValueError, match="max_position_embeddings"):
        attention.attend(*qkv(n=49), key_padding_mask=None, global_mask=None)


def test_sharing_modes_own_the_right_parameters():
    def names(sharing):
        model = longattn.LongAttnModel(config(linformer_sharing=sharing))
        return sorted(n for n, _ in model.named_parameters() if "_proj." in n and ("e_proj" in n or "f_proj" in n))

    assert names("none") == [f"encoder.layers.{i}.self_attn.{p}_proj.weight" for i in (0, 1) for p in "ef"]
    assert names("headwise") == names("none")
    assert names("key_value") == [f"encoder.layers.{i}.self_attn.e_proj.weight" for i in (0, 1)]
    assert names("layerwise") == ["encoder.layers.0.self_attn.e_proj.weight"]
    assert longattn.LongAttnModel(config(linformer_sharing="none")).encoder.layers[0].self_attn.e_proj.weight.shape == (
        48,
        16,
    )


def test_layerwise_sharing_is_one_tensor_with_gradients_from_every_layer():
    cfg = config(linformer_sharing="layerwise", attention_type=["full", "linformer", "linformer"], num_hidden_layers=3)
    model = longattn.LongAttnForMaskedLM(cfg)
    layers = model.longattn.encoder.layers
    assert layers[2].self_attn.length_projections()[0] is layers[1].self_attn.e_proj.weight
    ids = torch.randint(4, 50, (2, 30))
    model(input_ids=ids, labels=ids).loss.backward()
    shared = layers[1].self_attn.e_proj.weight.grad
    # Freezing layer 2's use of E changes the gradient: both layers contribute to the one tensor.
    model.zero_grad()
    object.__setattr__(layers[2].self_attn, "_layerwise_owner", None)
    layers[2].self_attn.e_proj = torch.nn.Embedding(48, 8)
    model(input_ids=ids, labels=ids).loss.backward()
    assert not torch.allclose(layers[1].self_attn.e_proj.weight.grad, shared)
    # A second model from the same config owns its own E.
    other = longattn.LongAttnForMaskedLM(cfg)
    other_layers = other.longattn.encoder.layers
    assert other_layers[2].self_attn.length_projections()[0] is other_layers[1].self_attn.e_proj.weight
    assert other_layers[1].self_attn.e_proj.weight is not layers[1].self_attn.e_proj.weight


@pytest.mark.parametrize(
    "fields, message",
    [
        (dict(is_decoder=True), "causal"),
        (dict(linformer_proj_len=0), "linformer_proj_len"),
        (dict(linformer_sharing="everything"), "linformer_sharing"),
        (dict(linformer_sharing="layerwise", linformer_proj_len=[4, 8]), "linformer_proj_len"),
    ],
)
def test_config_errors(fields, message):
    with pytest.raises(ValueError, match=message):
        config(**fields)
    with pytest.raises(ValueError, match="causal"):
        config(attention_type="full", decoder_attention_type="linformer", is_encoder_decoder=True)


@pytest.mark.parametrize("rope", [False, True])
@pytest.mark.parametrize("sharing", ["none", "headwise", "key_value"])
def test_fused_forward_equals_projecting_per_head_keys_and_values(sharing, rope):
    # forward projects the length before the linear layers where it can ((Eᵀ X) W + (Eᵀ 1) b); the generic path
    # (project, rotate, then attend on per-head keys) must give the same outputs and weights.
    attention = layer(config(linformer_sharing=sharing))
    with torch.no_grad():
        for proj in (attention.k_proj, attention.v_proj):
            proj.bias.normal_()  # the bias term is where reordering can go wrong
    x = torch.randn(2, 40, 32, dtype=torch.float64)
    mask = torch.ones(2, 40, dtype=torch.bool)
    mask[0, :7] = False
    angles = torch.arange(40, dtype=torch.float64)[None, :, None] * torch.linspace(0.1, 1.0, 16, dtype=torch.float64)
    position = (angles.cos().expand(2, -1, -1), angles.sin().expand(2, -1, -1)) if rope else None
    for output_attentions in (False, True):
        fused = attention(x, attention_mask=mask, position_embeddings=position, output_attentions=output_attentions)
        generic = LongAttnAttention.forward(
            attention, x, attention_mask=mask, position_embeddings=position, output_attentions=output_attentions
        )
        torch.testing.assert_close(fused[0], generic[0])
        if output_attentions:
            torch.testing.assert_close(fused[1], generic[1])
