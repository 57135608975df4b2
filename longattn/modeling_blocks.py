"""longattn's building blocks: rotary and learned positions, token embeddings, the MLP, one pre-LN transformer
layer and the stack of them (the same class is the encoder and the decoder).

Shape legend: b batch, n length (new tokens), m length of all keys (cached ones included), D hidden size.

Nothing here knows which attention a layer holds: each layer asks the registry for the class named by its
attention type and calls it through the `LongAttnAttention` interface. Layers are pre-LayerNorm (Xiong et al.
2020), which trains from scratch without warm-up tricks.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.activations import ACT2FN
from transformers.cache_utils import Cache, EncoderDecoderCache
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import BaseModelOutputWithPastAndCrossAttentions, CausalLMOutputWithPast
from transformers.utils import logging

from .attention_full import CrossAttention
from .attention_registry import attention_class
from .configuration_longattn import LongAttnConfig
from .numerics import rotary_inverse_frequencies

logger = logging.get_logger(__name__)

# transformers 5.x renamed the KV cache argument and output field `past_key_values` to `cache` (generate passes
# `cache=` since): the models take both names and fill the output field under the installed release's name.
_CACHE_FIELD = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"


def _cache_argument(cache: Cache | None, past_key_values: Cache | None) -> Cache | None:
    """The KV cache given as `cache` or, by its older name, as `past_key_values`."""
    if cache is not None and past_key_values is not None and cache is not past_key_values:
        raise ValueError("Pass the KV cache as `cache` or as `past_key_values` (its older name), not both.")
    return cache if cache is not None else past_key_values


# ---------------------------------------------------------------------------------------------- building blocks
class LongAttnRotaryEmbedding(nn.Module):
    """Rotary position embedding (Su et al. 2021): relative, so it works at any length."""

    def __init__(self, config: LongAttnConfig):
        super().__init__()
        self.head_dim = config.hidden_size // config.num_attention_heads
        self.theta = config.rope_theta
        # Derived from the config: not saved, so checkpoints hold only learned weights (and recomputed in
        # `_init_weights`, because `from_pretrained` builds modules on the meta device).
        self.register_buffer("inv_freq", self.compute_inv_freq(), persistent=False)

    def compute_inv_freq(self) -> torch.Tensor:
        return rotary_inverse_frequencies(self.head_dim, self.theta)

    @torch.no_grad()
    def forward(self, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """position_ids `[b, n]` -> (cos, sin) `[b, n, d]` in float32."""
        angles = position_ids[..., None].float() * self.inv_freq  # [b, n, d/2]
        angles = torch.cat((angles, angles), dim=-1)  # [b, n, d]
        return angles.cos(), angles.sin()


class LongAttnEmbeddings(nn.Module):
    """Token embeddings, plus learned absolute positions when `position_embedding_type="learned"`."""

    def __init__(self, config: LongAttnConfig):
        super().__init__()
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size, padding_idx=config.pad_token_id)
        self.position_embeddings = (
            nn.Embedding(config.max_position_embeddings, config.hidden_size)
            if config.position_embedding_type == "learned"
            else None
        )
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def forward(self, inputs_embeds: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        if self.position_embeddings is not None:
            inputs_embeds = inputs_embeds + self.position_embeddings(position_ids)
        return self.dropout(inputs_embeds)


class LongAttnMLP(nn.Module):
    def __init__(self, config: LongAttnConfig):
        super().__init__()
        self.fc_in = nn.Linear(config.hidden_size, config.intermediate_size)
        self.act = ACT2FN[config.hidden_act]
        self.fc_out = nn.Linear(config.intermediate_size, config.hidden_size)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.fc_out(self.act(self.fc_in(hidden_states))))


class LongAttnLayer(GradientCheckpointingLayer):
    """One pre-LN transformer layer: self-attention (any registered kind), optional cross-attention, MLP.

    Args:
        config: The model config.
        layer_idx: Position in the stack.
        attention_type: Registered name of the self-attention kind.
        is_causal: Causal self-attention.
        has_cross_attention: Add decoder-to-encoder attention (seq2seq decoders).
    """

    def __init__(
        self, config: LongAttnConfig, *, layer_idx: int, attention_type: str, is_causal: bool, has_cross_attention: bool
    ):
        super().__init__()
        self.self_attn_layer_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.self_attn = attention_class(attention_type)(config, layer_idx=layer_idx, is_causal=is_causal)
        if has_cross_attention:
            self.cross_attn_layer_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
            self.cross_attn = CrossAttention(config, layer_idx=layer_idx)
        else:
            self.cross_attn = None
        self.final_layer_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.mlp = LongAttnMLP(config)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        global_attention_mask: torch.Tensor | None = None,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        encoder_hidden_states: torch.Tensor | None = None,
        encoder_attention_mask: torch.Tensor | None = None,
        past_key_values: Cache | None = None,
        output_attentions: bool = False,
        document_ids: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """hidden_states `[b, n, D]` -> (`[b, n, D]`, self-attention weights, cross-attention weights);
        `document_ids` `[b, n]`: the documents of packed rows (None: one per row)."""
        self_cache = getattr(past_key_values, "self_attention_cache", past_key_values)
        attn_out, self_weights = self.self_attn(
            self.self_attn_layer_norm(hidden_states),
            attention_mask=attention_mask,
            global_attention_mask=global_attention_mask,
            position_embeddings=position_embeddings,
            past_key_values=self_cache,
            output_attentions=output_attentions,
            document_ids=document_ids,
        )
        hidden_states = hidden_states + self.dropout(attn_out)
        cross_weights = None
        if self.cross_attn is not None:
            cross_out, cross_weights = self.cross_attn(
                self.cross_attn_layer_norm(hidden_states),
                encoder_hidden_states=encoder_hidden_states,
                encoder_attention_mask=encoder_attention_mask,
                past_key_values=past_key_values if isinstance(past_key_values, EncoderDecoderCache) else None,
                output_attentions=output_attentions,
            )
            hidden_states = hidden_states + self.dropout(cross_out)
        hidden_states = hidden_states + self.mlp(self.final_layer_norm(hidden_states))
        return hidden_states, self_weights, cross_weights


class LongAttnStack(nn.Module):
    """A stack of `LongAttnLayer`s with a final LayerNorm; the same class is the encoder and the decoder."""

    def __init__(
        self, config: LongAttnConfig, *, attention_types: list[str], is_causal: bool, has_cross_attention: bool
    ):
        super().__init__()
        self.layers = nn.ModuleList(
            LongAttnLayer(
                config,
                layer_idx=layer_idx,
                attention_type=attention_type,
                is_causal=is_causal,
                has_cross_attention=has_cross_attention,
            )
            for layer_idx, attention_type in enumerate(attention_types)
        )
        self.final_layer_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(
        self,
        hidden_states: torch.Tensor,
        *,
        attention_mask: torch.Tensor | None,
        global_attention_mask: torch.Tensor | None,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None,
        encoder_hidden_states: torch.Tensor | None = None,
        encoder_attention_mask: torch.Tensor | None = None,
        past_key_values: Cache | None = None,
        output_hidden_states: bool = False,
        output_attentions: bool = False,
        document_ids: torch.Tensor | None = None,
    ) -> BaseModelOutputWithPastAndCrossAttentions:
        if (
            past_key_values is not None
            and self.training
            and torch.is_grad_enabled()
            and any(layer.gradient_checkpointing for layer in self.layers)
        ):
            # The backward pass runs each checkpointed layer again, which would write its keys into the cache twice.
            logger.warning_once("Gradient checkpointing in training: the KV cache is not used (`use_cache=False`).")
            past_key_values = None
        all_hidden_states = () if output_hidden_states else None
        all_attentions = () if output_attentions else None
        all_cross_attentions = () if output_attentions and encoder_hidden_states is not None else None
        for layer in self.layers:
            if output_hidden_states:
                all_hidden_states += (hidden_states,)
            # Tensors go in by position: reentrant gradient checkpointing passes gradients only to positional
            # arguments, and the decoder's cross-attention must reach the encoder through `encoder_hidden_states`.
            hidden_states, self_weights, cross_weights = layer(
                hidden_states,
                attention_mask,
                global_attention_mask,
                position_embeddings,
                encoder_hidden_states,
                encoder_attention_mask,
                past_key_values=past_key_values,
                output_attentions=output_attentions,
                document_ids=document_ids,
            )
            if output_attentions:
                all_attentions += (self_weights,)
                if all_cross_attentions is not None:
                    all_cross_attentions += (cross_weights,)
        hidden_states = self.final_layer_norm(hidden_states)
        if output_hidden_states:
            all_hidden_states += (hidden_states,)
        return BaseModelOutputWithPastAndCrossAttentions(
            last_hidden_state=hidden_states,
            **{_CACHE_FIELD: past_key_values},
            hidden_states=all_hidden_states,
            attentions=all_attentions,
            cross_attentions=all_cross_attentions,
        )

    def auxiliary_loss(self) -> torch.Tensor | None:
        """Sum of the attention kinds' auxiliary losses (e.g. adaptive span's penalty), None when none has one."""
        losses = [layer.self_attn.auxiliary_loss() for layer in self.layers]  # no walrus: torch.compile breaks on it
        losses = [loss for loss in losses if loss is not None]
        return torch.stack(losses).sum() if losses else None
