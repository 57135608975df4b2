"""longattn models: embeddings, one transformer layer, the encoder / decoder stacks and the task heads.

Shape legend: b batch, n length (new tokens), m length of all keys (cached ones included), D hidden size, V vocab.

Nothing here knows which attention a layer holds: each layer asks the registry for the class named by
`config.attention_type` (one name or one per layer) and calls it through the `LongAttnAttention` interface.
Layers are pre-LayerNorm (Xiong et al. 2020), which trains from scratch without warm-up tricks.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers import initialization as init
from transformers.activations import ACT2FN
from transformers.cache_utils import Cache, DynamicCache, EncoderDecoderCache
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.utils import ModelOutput
from transformers.modeling_outputs import (
    BaseModelOutput,
    BaseModelOutputWithPastAndCrossAttentions,
    CausalLMOutputWithPast,
    MaskedLMOutput,
    QuestionAnsweringModelOutput,
    Seq2SeqLMOutput,
    SequenceClassifierOutput,
    TokenClassifierOutput,
)

from .attention_base import LongAttnAttention
from .attention_full import CrossAttention
from .attention_registry import attention_class
from .configuration_longattn import LongAttnConfig


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
        return 1.0 / (self.theta ** (torch.arange(0, self.head_dim, 2, dtype=torch.float32) / self.head_dim))

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
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """hidden_states `[b, n, D]` -> (`[b, n, D]`, self-attention weights, cross-attention weights)."""
        self_cache = getattr(past_key_values, "self_attention_cache", past_key_values)
        attn_out, self_weights = self.self_attn(
            self.self_attn_layer_norm(hidden_states),
            attention_mask=attention_mask,
            global_attention_mask=global_attention_mask,
            position_embeddings=position_embeddings,
            past_key_values=self_cache,
            output_attentions=output_attentions,
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
    ) -> BaseModelOutputWithPastAndCrossAttentions:
        all_hidden_states = () if output_hidden_states else None
        all_attentions = () if output_attentions else None
        all_cross_attentions = () if output_attentions and encoder_hidden_states is not None else None
        for layer in self.layers:
            if output_hidden_states:
                all_hidden_states += (hidden_states,)
            hidden_states, self_weights, cross_weights = layer(
                hidden_states,
                attention_mask=attention_mask,
                global_attention_mask=global_attention_mask,
                position_embeddings=position_embeddings,
                encoder_hidden_states=encoder_hidden_states,
                encoder_attention_mask=encoder_attention_mask,
                past_key_values=past_key_values,
                output_attentions=output_attentions,
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
            past_key_values=past_key_values,
            hidden_states=all_hidden_states,
            attentions=all_attentions,
            cross_attentions=all_cross_attentions,
        )

    def auxiliary_loss(self) -> torch.Tensor | None:
        """Sum of the attention kinds' auxiliary losses (e.g. adaptive span's penalty), None when none has one."""
        losses = [layer.self_attn.auxiliary_loss() for layer in self.layers]  # no walrus: torch.compile breaks on it
        losses = [loss for loss in losses if loss is not None]
        return torch.stack(losses).sum() if losses else None


def _as_bool_mask(mask: torch.Tensor | None, *, name: str, batch: int, length: int) -> torch.Tensor | None:
    """Check a `[b, length]` 0/1 mask and return it as bool (None stays None)."""
    if mask is None:
        return None
    if mask.dim() != 2 or mask.shape[0] != batch or mask.shape[1] != length:
        raise ValueError(f"`{name}` has shape {list(mask.shape)}: expected [batch, length] = [{batch}, {length}].")
    return mask.bool()


def _position_ids(attention_mask: torch.Tensor | None, *, batch: int, past: int, length: int, device) -> torch.Tensor:
    """Positions of the new tokens `[b, n]`: counted over real tokens, so that left padding does not shift them."""
    if attention_mask is None:
        return torch.arange(past, past + length, device=device).expand(batch, length)
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)[:, -length:]


# ---------------------------------------------------------------------------------------------- pretrained base
class LongAttnPreTrainedModel(PreTrainedModel):
    config_class = LongAttnConfig
    config: LongAttnConfig
    base_model_prefix = "longattn"
    supports_gradient_checkpointing = True
    _no_split_modules = ["LongAttnLayer"]
    _skip_keys_device_placement = ["past_key_values"]

    def _initialize_weights(self, module: nn.Module, is_custom_code: bool = False) -> None:
        # transformers skips, for custom code, modules without direct parameters of their own: that would skip the
        # attention modules whose kind-specific tables live in children. Every initialisation here goes through
        # `transformers.initialization`, which leaves loaded tensors alone, so the shortcut is not needed.
        super()._initialize_weights(module, is_custom_code=False)

    def _init_weights(self, module: nn.Module) -> None:
        super()._init_weights(module)
        if isinstance(module, LongAttnRotaryEmbedding):
            init.copy_(module.inv_freq, module.compute_inv_freq())
        if isinstance(module, LongAttnAttention):
            # Kind-specific parameters (Linformer's E/F, adaptive span's z, ...) have their own initial values;
            # kinds set them through `transformers.initialization`, so weights loaded from a checkpoint stay.
            module.reset_kind_parameters()

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        # transformers would build the generation cache from the config, and reads our `sliding_window` field as
        # "keep only the last w keys". That is wrong for dilated windows and global tokens, so the model builds a
        # plain `DynamicCache` (all keys) itself on the first forward pass.
        return False


def _run_backbone(
    embeddings: LongAttnEmbeddings,
    rotary: LongAttnRotaryEmbedding | None,
    stack: LongAttnStack,
    config: LongAttnConfig,
    *,
    input_ids: torch.Tensor | None,
    inputs_embeds: torch.Tensor | None,
    attention_mask: torch.Tensor | None,
    global_attention_mask: torch.Tensor | None,
    position_ids: torch.Tensor | None,
    past_key_values: Cache | None,
    encoder_hidden_states: torch.Tensor | None = None,
    encoder_attention_mask: torch.Tensor | None = None,
    output_hidden_states: bool,
    output_attentions: bool,
) -> BaseModelOutputWithPastAndCrossAttentions:
    """Validate inputs, embed, add positions, and run `stack`: the shared body of every model."""
    if (input_ids is None) == (inputs_embeds is None):
        raise ValueError("Pass exactly one of `input_ids` and `inputs_embeds`.")
    if inputs_embeds is None:
        if input_ids.dim() != 2:
            raise ValueError(f"`input_ids` has shape {list(input_ids.shape)}: expected [batch, length].")
        inputs_embeds = embeddings.word_embeddings(input_ids)
    batch, length = inputs_embeds.shape[:2]
    past = past_key_values.get_seq_length() if past_key_values is not None else 0
    if past + length > config.max_position_embeddings:
        raise ValueError(
            f"sequence length {past + length} exceeds `max_position_embeddings`={config.max_position_embeddings}: "
            f"pass at most {config.max_position_embeddings} tokens or build the model with a larger limit."
        )
    attention_mask = _as_bool_mask(attention_mask, name="attention_mask", batch=batch, length=past + length)
    global_attention_mask = _as_bool_mask(
        global_attention_mask, name="global_attention_mask", batch=batch, length=past + length
    )
    if encoder_hidden_states is not None:
        encoder_attention_mask = _as_bool_mask(
            encoder_attention_mask, name="encoder_attention_mask", batch=batch, length=encoder_hidden_states.shape[1]
        )
    if position_ids is None:
        position_ids = _position_ids(attention_mask, batch=batch, past=past, length=length,
                                     device=inputs_embeds.device)
    hidden_states = embeddings(inputs_embeds, position_ids)
    position_embeddings = rotary(position_ids) if rotary is not None else None
    return stack(
        hidden_states,
        attention_mask=attention_mask,
        global_attention_mask=global_attention_mask,
        position_embeddings=position_embeddings,
        encoder_hidden_states=encoder_hidden_states,
        encoder_attention_mask=encoder_attention_mask,
        past_key_values=past_key_values,
        output_hidden_states=output_hidden_states,
        output_attentions=output_attentions,
    )


# ---------------------------------------------------------------------------------------------- the base model
class LongAttnModel(LongAttnPreTrainedModel):
    """The bare stack: a bidirectional encoder, or a causal decoder when `config.is_decoder` (without seq2seq).

    Forward args:
        input_ids: `[b, n]` token ids (or `inputs_embeds` `[b, n, D]`).
        attention_mask: `[b, m]`, 1 = real token, 0 = padding.
        global_attention_mask: `[b, m]`, 1 = global token (Longformer semantics; kinds without global tokens ignore it).
        position_ids: `[b, n]`; by default counted over real tokens.
        past_key_values / use_cache: the KV cache of a causal decoder.

    Returns:
        `BaseModelOutputWithPastAndCrossAttentions` with `last_hidden_state` `[b, n, D]`.
    """

    def __init__(self, config: LongAttnConfig):
        super().__init__(config)
        self.is_causal = bool(config.is_decoder) and not config.is_encoder_decoder
        self.embeddings = LongAttnEmbeddings(config)
        self.rotary = LongAttnRotaryEmbedding(config) if config.position_embedding_type == "rope" else None
        self.encoder = LongAttnStack(config, attention_types=config.layer_attention_types, is_causal=self.is_causal,
                                     has_cross_attention=False)
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.embeddings.word_embeddings

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.embeddings.word_embeddings = value

    def auxiliary_loss(self) -> torch.Tensor | None:
        return self.encoder.auxiliary_loss()

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        global_attention_mask: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        past_key_values: Cache | None = None,
        use_cache: bool | None = None,
        output_hidden_states: bool | None = None,
        output_attentions: bool | None = None,
        return_dict: bool | None = None,
        **kwargs: Any,
    ) -> BaseModelOutputWithPastAndCrossAttentions | tuple:
        use_cache = self.is_causal and (use_cache if use_cache is not None else self.config.use_cache)
        if use_cache and past_key_values is None:
            past_key_values = DynamicCache()  # no config: see `_supports_default_dynamic_cache`
        if not use_cache:
            past_key_values = None
        outputs = _run_backbone(
            self.embeddings, self.rotary, self.encoder, self.config,
            input_ids=input_ids,
            inputs_embeds=inputs_embeds,
            attention_mask=attention_mask,
            global_attention_mask=global_attention_mask,
            position_ids=position_ids,
            past_key_values=past_key_values,
            output_hidden_states=bool(output_hidden_states if output_hidden_states is not None
                                      else self.config.output_hidden_states),
            output_attentions=bool(output_attentions if output_attentions is not None
                                   else self.config.output_attentions),
        )
        return_dict = return_dict if return_dict is not None else self.config.return_dict
        return outputs if return_dict else outputs.to_tuple()


def _with_auxiliary_loss(loss: torch.Tensor | None, model: LongAttnModel | Any) -> torch.Tensor | None:
    """Add the attention kinds' auxiliary losses to a task loss (only when there is a task loss)."""
    extra = model.auxiliary_loss()
    if loss is None or extra is None:
        return loss
    return loss + extra.to(loss.dtype)


# ---------------------------------------------------------------------------------------------- encoder heads
class LongAttnLMHead(nn.Module):
    """dense -> activation -> LayerNorm -> vocabulary projection (tied to the token embeddings)."""

    def __init__(self, config: LongAttnConfig):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.act = ACT2FN[config.hidden_act]
        self.layer_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.decoder = nn.Linear(config.hidden_size, config.vocab_size)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.decoder(self.layer_norm(self.act(self.dense(hidden_states))))


class LongAttnForMaskedLM(LongAttnPreTrainedModel):
    """Masked-LM head on the bidirectional encoder; `labels` `[b, n]` with -100 on unmasked positions."""

    _tied_weights_keys = {"lm_head.decoder.weight": "longattn.embeddings.word_embeddings.weight"}

    def __init__(self, config: LongAttnConfig):
        super().__init__(config)
        self.longattn = LongAttnModel(config)
        self.lm_head = LongAttnLMHead(config)
        self.post_init()

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head.decoder

    def set_output_embeddings(self, value: nn.Linear) -> None:
        self.lm_head.decoder = value

    def forward(self, input_ids=None, attention_mask=None, global_attention_mask=None, inputs_embeds=None,
                position_ids=None, labels=None, output_hidden_states=None, output_attentions=None, return_dict=None,
                **kwargs) -> MaskedLMOutput | tuple:
        outputs = self.longattn(input_ids, attention_mask=attention_mask, global_attention_mask=global_attention_mask,
                                inputs_embeds=inputs_embeds, position_ids=position_ids,
                                output_hidden_states=output_hidden_states, output_attentions=output_attentions,
                                return_dict=True)
        logits = self.lm_head(outputs.last_hidden_state)  # [b, n, V]
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits.view(-1, logits.shape[-1]).float(), labels.view(-1).to(logits.device))
        loss = _with_auxiliary_loss(loss, self.longattn)
        output = MaskedLMOutput(loss=loss, logits=logits, hidden_states=outputs.hidden_states,
                                attentions=outputs.attentions)
        return output if _return_dict(self, return_dict) else output.to_tuple()


def _return_dict(model: PreTrainedModel, return_dict: bool | None) -> bool:
    return return_dict if return_dict is not None else model.config.return_dict


def _classifier_dropout(config: LongAttnConfig) -> float:
    return config.classifier_dropout if config.classifier_dropout is not None else config.hidden_dropout_prob


class LongAttnForSequenceClassification(LongAttnPreTrainedModel):
    """Classification from the first token's state. The first token is global unless `global_attention_mask` is given
    (Longformer's recipe: the classification token then sees the whole document)."""

    def __init__(self, config: LongAttnConfig):
        super().__init__(config)
        self.num_labels = config.num_labels
        self.longattn = LongAttnModel(config)
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.dropout = nn.Dropout(_classifier_dropout(config))
        self.out_proj = nn.Linear(config.hidden_size, config.num_labels)
        self.post_init()

    def forward(self, input_ids=None, attention_mask=None, global_attention_mask=None, inputs_embeds=None,
                position_ids=None, labels=None, output_hidden_states=None, output_attentions=None, return_dict=None,
                **kwargs) -> SequenceClassifierOutput | tuple:
        if global_attention_mask is None:
            reference = input_ids if input_ids is not None else inputs_embeds[..., 0]
            global_attention_mask = torch.zeros(reference.shape[:2], dtype=torch.bool, device=reference.device)
            global_attention_mask[:, 0] = True
        outputs = self.longattn(input_ids, attention_mask=attention_mask, global_attention_mask=global_attention_mask,
                                inputs_embeds=inputs_embeds, position_ids=position_ids,
                                output_hidden_states=output_hidden_states, output_attentions=output_attentions,
                                return_dict=True)
        pooled = outputs.last_hidden_state[:, 0]  # [b, D]
        logits = self.out_proj(self.dropout(torch.tanh(self.dense(self.dropout(pooled)))))  # [b, num_labels]
        loss = _with_auxiliary_loss(_classification_loss(self.config, logits, labels), self.longattn)
        output = SequenceClassifierOutput(loss=loss, logits=logits, hidden_states=outputs.hidden_states,
                                          attentions=outputs.attentions)
        return output if _return_dict(self, return_dict) else output.to_tuple()


def _classification_loss(config: LongAttnConfig, logits: torch.Tensor, labels: torch.Tensor | None):
    """transformers' problem types: regression (1 label), single-label (int labels), multi-label (float labels)."""
    if labels is None:
        return None
    labels = labels.to(logits.device)
    if config.problem_type is None:
        if config.num_labels == 1:
            config.problem_type = "regression"
        elif labels.dtype in (torch.long, torch.int):
            config.problem_type = "single_label_classification"
        else:
            config.problem_type = "multi_label_classification"
    if config.problem_type == "regression":
        return F.mse_loss(logits.squeeze(-1).float(), labels.float().view(-1))
    if config.problem_type == "single_label_classification":
        return F.cross_entropy(logits.view(-1, config.num_labels).float(), labels.view(-1))
    return F.binary_cross_entropy_with_logits(logits.float(), labels.float())


class LongAttnForTokenClassification(LongAttnPreTrainedModel):
    """Per-token classification; `labels` `[b, n]` with -100 on ignored positions."""

    def __init__(self, config: LongAttnConfig):
        super().__init__(config)
        self.num_labels = config.num_labels
        self.longattn = LongAttnModel(config)
        self.dropout = nn.Dropout(_classifier_dropout(config))
        self.classifier = nn.Linear(config.hidden_size, config.num_labels)
        self.post_init()

    def forward(self, input_ids=None, attention_mask=None, global_attention_mask=None, inputs_embeds=None,
                position_ids=None, labels=None, output_hidden_states=None, output_attentions=None, return_dict=None,
                **kwargs) -> TokenClassifierOutput | tuple:
        outputs = self.longattn(input_ids, attention_mask=attention_mask, global_attention_mask=global_attention_mask,
                                inputs_embeds=inputs_embeds, position_ids=position_ids,
                                output_hidden_states=output_hidden_states, output_attentions=output_attentions,
                                return_dict=True)
        logits = self.classifier(self.dropout(outputs.last_hidden_state))  # [b, n, num_labels]
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits.view(-1, self.num_labels).float(), labels.view(-1).to(logits.device))
        loss = _with_auxiliary_loss(loss, self.longattn)
        output = TokenClassifierOutput(loss=loss, logits=logits, hidden_states=outputs.hidden_states,
                                       attentions=outputs.attentions)
        return output if _return_dict(self, return_dict) else output.to_tuple()


class LongAttnForQuestionAnswering(LongAttnPreTrainedModel):
    """Extractive QA: start/end logits per token. Put global attention on the question tokens
    (`global_attention_mask`), as Longformer does; none is added by default."""

    def __init__(self, config: LongAttnConfig):
        super().__init__(config)
        self.longattn = LongAttnModel(config)
        self.qa_outputs = nn.Linear(config.hidden_size, 2)
        self.post_init()

    def forward(self, input_ids=None, attention_mask=None, global_attention_mask=None, inputs_embeds=None,
                position_ids=None, start_positions=None, end_positions=None, output_hidden_states=None,
                output_attentions=None, return_dict=None, **kwargs) -> QuestionAnsweringModelOutput | tuple:
        outputs = self.longattn(input_ids, attention_mask=attention_mask, global_attention_mask=global_attention_mask,
                                inputs_embeds=inputs_embeds, position_ids=position_ids,
                                output_hidden_states=output_hidden_states, output_attentions=output_attentions,
                                return_dict=True)
        start_logits, end_logits = self.qa_outputs(outputs.last_hidden_state).float().unbind(-1)  # [b, n] each
        loss = None
        if start_positions is not None and end_positions is not None:
            length = start_logits.shape[1]
            # Positions outside the sequence are ignored, as in transformers' QA heads.
            start = start_positions.view(-1).clamp(0, length).to(start_logits.device)
            end = end_positions.view(-1).clamp(0, length).to(end_logits.device)
            loss = (F.cross_entropy(start_logits, start, ignore_index=length)
                    + F.cross_entropy(end_logits, end, ignore_index=length)) / 2
        loss = _with_auxiliary_loss(loss, self.longattn)
        output = QuestionAnsweringModelOutput(loss=loss, start_logits=start_logits, end_logits=end_logits,
                                              hidden_states=outputs.hidden_states, attentions=outputs.attentions)
        return output if _return_dict(self, return_dict) else output.to_tuple()


# ---------------------------------------------------------------------------------------------- decoder heads
class LongAttnForCausalLM(LongAttnPreTrainedModel, GenerationMixin):
    """Causal LM: the stack with causal attention (`config.is_decoder` is set), and a tied vocabulary projection.
    `labels` `[b, n]` are the inputs themselves (shifted inside), -100 ignored."""

    _tied_weights_keys = {"lm_head.weight": "longattn.embeddings.word_embeddings.weight"}

    def __init__(self, config: LongAttnConfig):
        if not config.is_decoder or config.is_encoder_decoder:
            config.is_decoder, config.is_encoder_decoder = True, False
            config.validate_longattn()  # kinds that cannot be causal refuse here
        super().__init__(config)
        self.longattn = LongAttnModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head

    def set_output_embeddings(self, value: nn.Linear) -> None:
        self.lm_head = value

    def forward(self, input_ids=None, attention_mask=None, global_attention_mask=None, inputs_embeds=None,
                position_ids=None, past_key_values=None, use_cache=None, labels=None, output_hidden_states=None,
                output_attentions=None, return_dict=None, logits_to_keep: int = 0,
                **kwargs) -> CausalLMOutputWithPast | tuple:
        outputs = self.longattn(input_ids, attention_mask=attention_mask, global_attention_mask=global_attention_mask,
                                inputs_embeds=inputs_embeds, position_ids=position_ids,
                                past_key_values=past_key_values, use_cache=use_cache,
                                output_hidden_states=output_hidden_states, output_attentions=output_attentions,
                                return_dict=True)
        hidden_states = outputs.last_hidden_state
        if logits_to_keep:
            hidden_states = hidden_states[:, -logits_to_keep:]
        logits = self.lm_head(hidden_states)  # [b, n, V]
        loss = None
        if labels is not None:
            shifted = labels[:, 1:].to(logits.device)
            loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(), shifted.reshape(-1))
        loss = _with_auxiliary_loss(loss, self.longattn)
        output = CausalLMOutputWithPast(loss=loss, logits=logits, past_key_values=outputs.past_key_values,
                                        hidden_states=outputs.hidden_states, attentions=outputs.attentions)
        return output if _return_dict(self, return_dict) else output.to_tuple()


class LongAttnDecoder(nn.Module):
    """The seq2seq decoder: causal self-attention (`config.decoder_attention_type`) + cross-attention."""

    def __init__(self, config: LongAttnConfig, word_embeddings: nn.Embedding):
        super().__init__()
        self.config = config
        self.embeddings = LongAttnEmbeddings(config)
        self.embeddings.word_embeddings = word_embeddings  # shared with the encoder
        self.rotary = LongAttnRotaryEmbedding(config) if config.position_embedding_type == "rope" else None
        self.stack = LongAttnStack(config, attention_types=config.decoder_layer_attention_types, is_causal=True,
                                   has_cross_attention=True)

    def forward(self, input_ids=None, inputs_embeds=None, attention_mask=None, encoder_hidden_states=None,
                encoder_attention_mask=None, past_key_values=None, output_hidden_states=False,
                output_attentions=False) -> BaseModelOutputWithPastAndCrossAttentions:
        return _run_backbone(
            self.embeddings, self.rotary, self.stack, self.config,
            input_ids=input_ids, inputs_embeds=inputs_embeds, attention_mask=attention_mask,
            global_attention_mask=None, position_ids=None, past_key_values=past_key_values,
            encoder_hidden_states=encoder_hidden_states, encoder_attention_mask=encoder_attention_mask,
            output_hidden_states=output_hidden_states, output_attentions=output_attentions,
        )


def shift_tokens_right(labels: torch.Tensor, pad_token_id: int, decoder_start_token_id: int) -> torch.Tensor:
    """Decoder inputs from labels `[b, n]`: start token, then labels[:-1], with -100 replaced by padding."""
    shifted = labels.new_full(labels.shape, pad_token_id)
    shifted[:, 1:] = labels[:, :-1]
    shifted[:, 0] = decoder_start_token_id
    return shifted.masked_fill(shifted == -100, pad_token_id)


class LongAttnForSeq2SeqLM(LongAttnPreTrainedModel, GenerationMixin):
    """Encoder-decoder like LED: a long encoder with the configured attention (`attention_type`), a decoder with causal
    self-attention (`decoder_attention_type`, "full" by default) and dense cross-attention, shared embeddings."""

    _tied_weights_keys = {
        "lm_head.weight": "encoder.embeddings.word_embeddings.weight",
        "decoder.embeddings.word_embeddings.weight": "encoder.embeddings.word_embeddings.weight",
    }

    def __init__(self, config: LongAttnConfig):
        if not config.is_encoder_decoder or config.is_decoder:
            config.is_encoder_decoder, config.is_decoder = True, False
            config.validate_longattn()
        super().__init__(config)
        self.encoder = LongAttnModel(config)
        self.decoder = LongAttnDecoder(config, self.encoder.embeddings.word_embeddings)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_encoder(self) -> LongAttnModel:
        return self.encoder

    def get_decoder(self) -> LongAttnDecoder:
        return self.decoder

    def get_input_embeddings(self) -> nn.Embedding:
        return self.encoder.embeddings.word_embeddings

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.encoder.embeddings.word_embeddings = value
        self.decoder.embeddings.word_embeddings = value

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head

    def set_output_embeddings(self, value: nn.Linear) -> None:
        self.lm_head = value

    def prepare_decoder_input_ids_from_labels(self, labels: torch.Tensor) -> torch.Tensor:
        return shift_tokens_right(labels, self.config.pad_token_id, self.config.decoder_start_token_id)

    def forward(self, input_ids=None, attention_mask=None, global_attention_mask=None, inputs_embeds=None,
                decoder_input_ids=None, decoder_attention_mask=None, decoder_inputs_embeds=None,
                encoder_outputs=None, past_key_values=None, use_cache=None, labels=None,
                output_hidden_states=None, output_attentions=None, return_dict=None,
                **kwargs) -> Seq2SeqLMOutput | tuple:
        output_hidden_states = bool(output_hidden_states if output_hidden_states is not None
                                    else self.config.output_hidden_states)
        output_attentions = bool(output_attentions if output_attentions is not None
                                 else self.config.output_attentions)
        if encoder_outputs is None:
            encoder_outputs = self.encoder(input_ids, attention_mask=attention_mask,
                                           global_attention_mask=global_attention_mask, inputs_embeds=inputs_embeds,
                                           output_hidden_states=output_hidden_states,
                                           output_attentions=output_attentions, return_dict=True)
        elif not isinstance(encoder_outputs, ModelOutput):
            encoder_outputs = BaseModelOutput(*encoder_outputs)  # a tuple from `return_dict=False`
        if labels is not None:
            use_cache = False
            if decoder_input_ids is None and decoder_inputs_embeds is None:
                decoder_input_ids = self.prepare_decoder_input_ids_from_labels(labels)
        use_cache = use_cache if use_cache is not None else self.config.use_cache
        if use_cache and past_key_values is None:
            past_key_values = EncoderDecoderCache(DynamicCache(), DynamicCache())
        if not use_cache:
            past_key_values = None
        decoder_outputs = self.decoder(
            input_ids=decoder_input_ids, inputs_embeds=decoder_inputs_embeds, attention_mask=decoder_attention_mask,
            encoder_hidden_states=encoder_outputs.last_hidden_state, encoder_attention_mask=attention_mask,
            past_key_values=past_key_values, output_hidden_states=output_hidden_states,
            output_attentions=output_attentions,
        )
        logits = self.lm_head(decoder_outputs.last_hidden_state)  # [b, n, V]
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1).to(logits.device))
        loss = _with_auxiliary_loss(loss, self)
        output = Seq2SeqLMOutput(
            loss=loss, logits=logits, past_key_values=decoder_outputs.past_key_values,
            decoder_hidden_states=decoder_outputs.hidden_states, decoder_attentions=decoder_outputs.attentions,
            cross_attentions=decoder_outputs.cross_attentions,
            encoder_last_hidden_state=encoder_outputs.last_hidden_state,
            encoder_hidden_states=encoder_outputs.hidden_states, encoder_attentions=encoder_outputs.attentions,
        )
        return output if _return_dict(self, return_dict) else output.to_tuple()

    def auxiliary_loss(self) -> torch.Tensor | None:
        losses = [loss for loss in (self.encoder.auxiliary_loss(), self.decoder.stack.auxiliary_loss())
                  if loss is not None]
        return torch.stack(losses).sum() if losses else None


__all__ = [
    "LongAttnPreTrainedModel",
    "LongAttnModel",
    "LongAttnForMaskedLM",
    "LongAttnForSequenceClassification",
    "LongAttnForTokenClassification",
    "LongAttnForQuestionAnswering",
    "LongAttnForCausalLM",
    "LongAttnForSeq2SeqLM",
]
