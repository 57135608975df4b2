"""Sequence-reduction attention (PVT's spatial reduction on sequences): the formula, odd lengths, padding, errors."""

from __future__ import annotations

import functools

import pytest
import torch
from kind_configs import tiny_config

import longattn
from longattn.attention_reduction import ReductionAttention, pack_groups

config = functools.partial(tiny_config, "reduction", num_attention_heads=4, reduction_ratio=4)


def attention(ratio: int = 4) -> ReductionAttention:
    torch.manual_seed(0)
    return ReductionAttention(config(reduction_ratio=ratio), layer_idx=0, is_causal=False).double().eval()


def direct(module: ReductionAttention, x: torch.Tensor, ratio: int, rope=None) -> torch.Tensor:
    """SRA written out: Reshape(x, R) W_S -> LayerNorm -> K, V; softmax(Q Kᵀ / sqrt(d)) V; W_O."""
    b, n, width = x.shape
    g = -(-n // ratio)
    padded = torch.cat([x, x.new_zeros(b, g * ratio - n, width)], dim=1)
    reduced = torch.nn.functional.layer_norm(
        padded.reshape(b, g, ratio * width) @ module.reduction_proj.weight.T + module.reduction_proj.bias,
        (width,),
        module.reduction_norm.weight,
        module.reduction_norm.bias,
        eps=module.reduction_norm.eps,
    )
    heads, d = module.num_heads, width // module.num_heads
    q = (x @ module.q_proj.weight.T + module.q_proj.bias).view(b, n, heads, d).transpose(1, 2)
    k = (reduced @ module.k_proj.weight.T + module.k_proj.bias).view(b, g, heads, d).transpose(1, 2)
    v = (reduced @ module.v_proj.weight.T + module.v_proj.bias).view(b, g, heads, d).transpose(1, 2)
    if rope is not None:
        cos, sin = rope
        half = d // 2

        def rotate(t, c, s):
            rotated = torch.cat([-t[..., half:], t[..., :half]], dim=-1)
            return t * c[:, None] + rotated * s[:, None]

        q = rotate(q, cos, sin)
        k = rotate(k, cos[:, ::ratio], sin[:, ::ratio])  # the position of each group's first token
    weights = torch.softmax(q @ k.transpose(-1, -2) / d**0.5, dim=-1)  # [b, h, n, g]
    out = (weights @ v).transpose(1, 2).reshape(b, n, width)
    return out @ module.o_proj.weight.T + module.o_proj.bias


@pytest.mark.parametrize("n", [32, 29, 3])  # divisible by R, not divisible, shorter than one group
def test_equals_the_direct_formula(n):
    module = attention(4)
    x = torch.randn(2, n, 32, dtype=torch.float64)
    out, weights = module(x)
    torch.testing.assert_close(out, direct(module, x, 4))
    assert weights is None
    out_explicit, weights = module(x, output_attentions=True)
    torch.testing.assert_close(out_explicit, out)
    assert weights.shape == (2, 4, n, -(-n // 4))


def test_rotary_keys_take_their_group_start_position():
    module = attention(3)
    x = torch.randn(1, 31, 32, dtype=torch.float64)
    angles = torch.arange(31, dtype=torch.float64)[:, None] * torch.linspace(0.1, 1.0, 4, dtype=torch.float64)
    angles = torch.cat([angles, angles], dim=-1)[None]  # [1, n, d]
    rope = (angles.cos(), angles.sin())
    out, _ = module(x, position_embeddings=rope)
    torch.testing.assert_close(out, direct(module, x, 3, rope))


@pytest.mark.parametrize("side", ["left", "right", "both"])
def test_padding_is_handled_inside_the_groups(side):
    module = attention(4)
    real = torch.randn(1, 22, 32, dtype=torch.float64)  # 22 is not a multiple of 4
    left = {"left": 5, "right": 0, "both": 3}[side]
    right = {"left": 0, "right": 7, "both": 2}[side]
    x = torch.cat(
        [torch.randn(1, left, 32, dtype=torch.float64), real, torch.randn(1, right, 32, dtype=torch.float64)], 1
    )
    mask = torch.zeros(1, x.shape[1], dtype=torch.bool)
    mask[0, left : left + 22] = True
    out, _ = module(x, attention_mask=mask)
    alone, _ = module(real)
    torch.testing.assert_close(out[:, mask[0]], alone)


def test_pack_groups_marks_empty_groups_and_fully_padded_rows_stay_finite():
    x = torch.arange(2 * 7, dtype=torch.float32).view(2, 7, 1)
    mask = torch.tensor([[0, 1, 1, 0, 1, 0, 0], [0] * 7], dtype=torch.bool)
    groups, valid = pack_groups(x, mask, 2)
    assert groups.shape == (2, 4, 2, 1)
    assert groups[0, :, :, 0].tolist() == [[1, 2], [4, 0], [0, 0], [0, 0]]
    assert valid.tolist() == [[True, True, False, False], [False] * 4]
    module = attention(2).to(torch.bfloat16)
    out, _ = module(torch.randn(2, 7, 32, dtype=torch.bfloat16), attention_mask=mask)
    assert torch.isfinite(out.float()).all()


def test_ratio_one_is_full_attention():
    module = ReductionAttention(config(reduction_ratio=1), layer_idx=0, is_causal=False).double().eval()
    assert module.reduction_proj is None
    x = torch.randn(2, 9, 32, dtype=torch.float64)
    q, k, v = module.project(x)
    expected = torch.softmax(q @ k.transpose(-1, -2) / 8**0.5, dim=-1) @ v
    torch.testing.assert_close(module(x)[0], module.o_proj(module.merge_heads(expected)))


def test_per_layer_ratios_and_mixing_with_other_kinds():
    model = longattn.LongAttnModel(config(attention_type=["reduction", "full"], reduction_ratio=[5, 2]))
    assert model.encoder.layers[0].self_attn.ratio == 5
    assert model.encoder.layers[0].self_attn.reduction_proj.in_features == 5 * 32
    out = model(input_ids=torch.randint(4, 50, (2, 23))).last_hidden_state
    assert out.shape == (2, 23, 32)


@pytest.mark.parametrize(
    "fields, message",
    [
        (dict(is_decoder=True), "causal"),
        (dict(reduction_ratio=0), "reduction_ratio"),
        (dict(reduction_ratio=[2, 2, 2]), "reduction_ratio"),
    ],
)
def test_config_errors(fields, message):
    with pytest.raises(ValueError, match=message):
        config(**fields)
