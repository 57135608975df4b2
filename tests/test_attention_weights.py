"""`output_attentions`: every kind returns the weights its output was computed from, after dropout (as transformers'
eager attention does), so that `weights @ v` reproduces the output in training too."""

from __future__ import annotations

import functools

import pytest
import torch
from kind_configs import kind_config

import longattn
from longattn.attention_full import CrossAttention
from longattn.attention_registry import attention_class

KINDS = longattn.available_attention_types()


_config = functools.partial(kind_config, max_position_embeddings=32, attention_probs_dropout_prob=0.5)


def _values(layer, hidden_states: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """The values `[b, h, m, d]` the layer's weights apply to (reduction attends over its reduced groups)."""
    if getattr(layer, "reduction_proj", None) is not None:
        hidden_states = layer.reduce(hidden_states, attention_mask)[0]
    return layer.split_heads(layer.v_proj(hidden_states))


@pytest.mark.parametrize("kind", KINDS)
def test_returned_weights_are_those_the_output_was_computed_from_in_training(kind):
    config = _config(kind)
    torch.manual_seed(0)
    layer = attention_class(kind)(config, layer_idx=1, is_causal=False).double().train()
    hidden_states = torch.randn(2, 19, 32, dtype=torch.float64)
    attention_mask = torch.ones(2, 19, dtype=torch.bool)
    attention_mask[1, 15:] = False
    torch.manual_seed(1)
    out, weights = layer(hidden_states, attention_mask=attention_mask, output_attentions=True)
    expected = layer.o_proj(layer.merge_heads(weights @ _values(layer, hidden_states, attention_mask)))
    real = attention_mask[:, :, None].expand_as(out)  # padded queries' outputs are not defined by every kind
    torch.testing.assert_close(out[real], expected[real])
    if kind != "efficient":  # efficient attention has no probability matrix to drop (documented)
        rows = weights.sum(-1)[attention_mask[:, None, :].expand(2, 2, 19)]
        assert not torch.allclose(rows, torch.ones_like(rows)), "dropout should have changed the weights"


def test_cross_attention_returns_the_weights_after_dropout():
    config = _config("full", is_encoder_decoder=True)
    torch.manual_seed(0)
    layer = CrossAttention(config, layer_idx=0).double().train()
    hidden_states = torch.randn(2, 5, 32, dtype=torch.float64)
    encoder_states = torch.randn(2, 9, 32, dtype=torch.float64)
    out, weights = layer(hidden_states, encoder_hidden_states=encoder_states, output_attentions=True)
    values = layer.v_proj(encoder_states).view(2, 9, 2, 16).transpose(1, 2)  # [b, h, m, d]
    expected = layer.o_proj((weights @ values).transpose(1, 2).reshape(2, 5, 32))
    torch.testing.assert_close(out, expected)
