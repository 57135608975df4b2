"""longattn models: the pretrained base, the bare model (encoder, causal decoder or encoder-decoder) and the task
heads, with the Auto classes a saved folder answers to.

Shape legend: b batch, n length (new tokens), m length of all keys (cached ones included), D hidden size, V vocab.

The layers are in sibling modules, importable from here as well: the embeddings, one layer and the stacks in
`modeling_blocks`, the input checks and the shared body of every model in `modeling_inputs`, the heads' own layers
and losses in `modeling_heads`. Nothing here knows which attention a layer holds (see `modeling_blocks`).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers import initialization as init
from transformers.cache_utils import Cache, DynamicCache, EncoderDecoderCache
from transformers.conversion_mapping import register_checkpoint_conversion_mapping
from transformers.core_model_loading import WeightRenaming
from transformers.generation.utils import ALL_CACHE_NAMES
from transformers.loss.loss_utils import ForCausalLMLoss, fixed_cross_entropy
from transformers.modeling_outputs import (
    BaseModelOutput,
    BaseModelOutputWithPastAndCrossAttentions,
    CausalLMOutputWithPast,
    MaskedLMOutput,
    QuestionAnsweringModelOutput,
    Seq2SeqLMOutput,
    Seq2SeqModelOutput,
    SequenceClassifierOutput,
    TokenClassifierOutput,
)
from transformers.utils import ModelOutput

from .attention_base import LongAttnAttention
from .configuration_longattn import LongAttnConfig
from .modeling_blocks import (
    _CACHE_FIELD,
    LongAttnEmbeddings,
    LongAttnRotaryEmbedding,
    LongAttnStack,
    _cache_argument,
)
from .modeling_blocks import LongAttnLayer as LongAttnLayer
from .modeling_blocks import LongAttnMLP as LongAttnMLP
from .modeling_heads import (
    LongAttnClassificationHead,
    LongAttnLMHead,
    _classification_loss,
    _classifier_dropout,
    _masked_lm_loss,
    _mean_over_tokens,
    _with_auxiliary_loss,
)
from .modeling_inputs import IGNORE_INDEX as IGNORE_INDEX
from .modeling_inputs import VARLEN_KWARGS as VARLEN_KWARGS
from .modeling_inputs import (
    _check_labels,
    _check_token_inputs,
    _is_packed,
    _return_dict,
    _run_backbone,
    _varlen_kwargs,
)


# ---------------------------------------------------------------------------------------------- pretrained base
class LongAttnPreTrainedModel(PreTrainedModel):
    config_class = LongAttnConfig
    config: LongAttnConfig
    base_model_prefix = "longattn"
    supports_gradient_checkpointing = True
    _no_split_modules = ["LongAttnLayer"]
    _skip_keys_device_placement = ["cache", "past_key_values"]

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

    def save_pretrained(self, save_directory, *args, **kwargs):
        """transformers' `save_pretrained`, with every head's Auto class in `auto_map` (see `AUTO_MAP`).

        Each class is registered for its Auto class (`register_for_auto_class`), so every save (Trainer's, a merged
        PEFT model's, `push_to_hub`) writes `auto_map` and copies this module with every sibling it imports; the
        library writes the saving head's own entry, and this adds the others."""
        self.config.auto_map = {**AUTO_MAP, **(getattr(self.config, "auto_map", None) or {})}
        return super().save_pretrained(save_directory, *args, **kwargs)

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        # transformers would build the generation cache from the config, and reads our `sliding_window` field as
        # "keep only the last w keys". That is wrong for dilated windows, global tokens and the strided, fixed and
        # content-based kinds, so `_prepare_cache_for_generation` builds one that keeps every key.
        return False

    def _prepare_cache_for_generation(self, generation_config, model_kwargs: dict, *args, **kwargs) -> None:
        """Give `generate` a KV cache of full layers (every key kept), for every decoding mode.

        Assisted and prompt-lookup decoding need it before the first forward pass (they `crop` the keys of rejected
        draft tokens), beam search reorders it (`reorder_cache`). A cache the caller passes is used as it is.

        Raises:
            ValueError: a `cache_implementation` other than "dynamic" (static and sliding caches are laid out from
                the config, which cannot describe the kinds' patterns).
        """
        given = any(model_kwargs.get(name) is not None for name in ALL_CACHE_NAMES)
        builds = generation_config.use_cache is not False and not given
        if builds and generation_config.cache_implementation not in (None, "dynamic"):
            raise ValueError(
                f"`cache_implementation`={generation_config.cache_implementation!r} is not supported by longattn "
                "models: use None or 'dynamic' (a cache that keeps every key, which every attention kind can use)."
            )
        super()._prepare_cache_for_generation(generation_config, model_kwargs, *args, **kwargs)  # checks a given one
        if not builds:
            return
        cache = DynamicCache()  # no config: full layers, whatever `sliding_window` says
        if self.config.is_encoder_decoder:
            cache = EncoderDecoderCache(cache, DynamicCache())
        if getattr(generation_config, "is_assistant", False) and hasattr(cache, "activate_past_recording"):
            cache.activate_past_recording()  # transformers does this for the caches it builds for a draft model
        model_kwargs[ALL_CACHE_NAMES[0]] = cache


class _RenameOnLoad(WeightRenaming):
    """A key renaming for checkpoints of an earlier layout, applied when loading only.

    transformers saves a loaded model under the reverse of the renamings it loaded with ("original format"), and a
    new model under the reverse of every registered one. Reversed, `encoder.encoder.` <- `encoder.` would write the
    current base model's `encoder.*` keys in the old seq2seq layout; the reverse here keeps the current names.
    """

    __slots__ = ()

    def reverse_transform(self) -> WeightRenaming:
        literal = [pattern.replace(".", r"\.") for pattern in self._original_target_patterns]
        return WeightRenaming(source_patterns=literal, target_patterns=list(self._original_target_patterns))


# Until the seq2seq model took BART's layout, `LongAttnForSeq2SeqLM` kept its encoder as a whole `LongAttnModel` under
# `encoder.` (keys `encoder.embeddings.*`, `encoder.encoder.*`) next to `decoder.*`. Renamed here to the base model's
# names; transformers then adds the `longattn.` prefix where the class has it (`decoder.*` needs nothing else). Keys of
# every other layout never start with `encoder.encoder.` or `encoder.embeddings.`.
SEQ2SEQ_V0_RENAMINGS = [
    _RenameOnLoad(source_patterns=r"^encoder\.encoder\.", target_patterns="encoder."),
    _RenameOnLoad(source_patterns=r"^encoder\.embeddings\.", target_patterns="embeddings."),
]
# Until the sentence head became the `classifier` submodule (as in transformers' encoders, so that tools that look for
# the head by that name find it: PEFT's sequence-classification task trains and saves `classifier` with the adapter),
# `LongAttnForSequenceClassification` kept `dense.*` and `out_proj.*` at the top. No other class has top-level keys
# of those names.
CLASSIFIER_V0_RENAMINGS = [
    _RenameOnLoad(source_patterns=r"^dense\.", target_patterns="classifier.dense."),
    _RenameOnLoad(source_patterns=r"^out_proj\.", target_patterns="classifier.out_proj."),
]
# Registered for the model type (custom code gets only registered mappings); again by the copy a Hub folder carries.
register_checkpoint_conversion_mapping(
    LongAttnConfig.model_type, SEQ2SEQ_V0_RENAMINGS + CLASSIFIER_V0_RENAMINGS, overwrite=True
)


# ---------------------------------------------------------------------------------------------- the base model
ENCODER_WORD_EMBEDDINGS = "embeddings.word_embeddings.weight"
DECODER_WORD_EMBEDDINGS = "decoder.embeddings.word_embeddings.weight"


class LongAttnModel(LongAttnPreTrainedModel):
    """The bare model: a bidirectional encoder, a causal decoder when `config.is_decoder`, or an encoder-decoder
    when `config.is_encoder_decoder` (then it also holds the seq2seq decoder and returns `Seq2SeqModelOutput`).

    Laid out as BART's `BartModel`: every head keeps this class under `longattn` (the `base_model_prefix`), and the
    encoder's weights have the same names in every model (`embeddings.*`, `encoder.*`; the decoder adds `decoder.*`
    and shares `embeddings.word_embeddings`). So `AutoModel` on a seq2seq folder loads the whole trained model, a
    seq2seq head loads the encoder of a masked-LM checkpoint, and an encoder head loads the encoder of a seq2seq one.

    Args:
        config: The model config.
        add_decoder: Build the seq2seq decoder (default: `config.is_encoder_decoder`); the encoder heads pass False,
            so that they are the encoder alone whatever checkpoint they load.

    Forward args:
        input_ids: `[b, n]` token ids (or `inputs_embeds` `[b, n, D]`).
        attention_mask: `[b, m]`, 1 = real token, 0 = padding.
        global_attention_mask: `[b, m]`, 1 = global token (Longformer semantics; kinds without global tokens ignore it).
        position_ids: `[b, n]`; by default counted over real tokens. Positions that restart at 0 mark packed
            documents (`DataCollatorWithFlattening`): attention never crosses from one to another.
        cu_seq_lens_q / cu_seq_lens_k (with max_length_q / max_length_k): transformers' varlen keywords, another way
            to mark packed documents over the flattened batch.
        cache (or `past_key_values`, its older name) / use_cache: the KV cache of a causal decoder (an
        `EncoderDecoderCache` in seq2seq).
        decoder_input_ids / decoder_inputs_embeds / decoder_attention_mask: the decoder's inputs `[b, t]` (seq2seq;
            without them the decoder reads `input_ids` shifted right, as in BART's `BartModel`).
        encoder_outputs: the encoder's output, computed once by `generate()` (seq2seq).

    Returns:
        `BaseModelOutputWithPastAndCrossAttentions` with `last_hidden_state` `[b, n, D]`; in seq2seq
        `Seq2SeqModelOutput` with the decoder's `last_hidden_state` `[b, t, D]` and `encoder_last_hidden_state`.
    """

    def __init__(self, config: LongAttnConfig, *, add_decoder: bool | None = None):
        super().__init__(config)
        add_decoder = bool(config.is_encoder_decoder) if add_decoder is None else add_decoder
        self.is_causal = bool(config.is_decoder) and not config.is_encoder_decoder
        self.embeddings = LongAttnEmbeddings(config)
        self.rotary = LongAttnRotaryEmbedding(config) if config.position_embedding_type == "rope" else None
        self.encoder = LongAttnStack(
            config, attention_types=config.layer_attention_types, is_causal=self.is_causal, has_cross_attention=False
        )
        self.decoder = LongAttnDecoder(config) if add_decoder else None
        if add_decoder:
            # Instance attribute: an encoder alone has no decoder weight to tie.
            self._tied_weights_keys = {DECODER_WORD_EMBEDDINGS: ENCODER_WORD_EMBEDDINGS}
        self.post_init()

    def get_expanded_tied_weights_keys(self, all_submodels: bool = False) -> dict[str, str]:
        tied = super().get_expanded_tied_weights_keys(all_submodels=all_submodels)
        if self.decoder is not None and not all_submodels:
            # One token table for encoder and decoder (as BART's `shared`), whatever `tie_word_embeddings` says: only
            # the LM head follows that field. Tied as parameters, not by sharing the module, so that transformers
            # can tell a missing table from a loaded one.
            tied[DECODER_WORD_EMBEDDINGS] = ENCODER_WORD_EMBEDDINGS
        return tied

    def get_input_embeddings(self) -> nn.Embedding:
        return self.embeddings.word_embeddings

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.embeddings.word_embeddings = value
        if self.decoder is not None:
            self.decoder.embeddings.word_embeddings = value  # `tie_weights` ties them again when it runs

    def get_encoder(self) -> nn.Module:
        return LongAttnEncoder(self) if self.decoder is not None else self

    def get_decoder(self) -> LongAttnDecoder | None:
        return self.decoder

    def auxiliary_loss(self) -> torch.Tensor | None:
        losses = [
            loss
            for loss in (
                self.encoder.auxiliary_loss(),
                self.decoder.stack.auxiliary_loss() if self.decoder is not None else None,
            )
            if loss is not None
        ]
        return torch.stack(losses).sum() if losses else None

    def encode(
        self, *, return_dict: bool | None = None, **inputs: Any
    ) -> BaseModelOutputWithPastAndCrossAttentions | tuple:
        """The encoder stack alone: `last_hidden_state` `[b, n, D]`; `inputs` are `_run_backbone`'s keywords (the
        other `ENCODER_INPUTS`, `past_key_values`, `cu_seq_lens_q` / `cu_seq_lens_k`). Bidirectional without a
        cache, except in a causal decoder-only model, whose stack this is (`past_key_values`: its KV cache).
        `cu_seq_lens_q` / `cu_seq_lens_k`: flash attention's varlen keywords of packed rows (`longattn.packing`)."""
        outputs = _run_backbone(self.embeddings, self.rotary, self.encoder, self.config, **inputs)
        return outputs if _return_dict(self, return_dict) else outputs.to_tuple()

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
        decoder_input_ids: torch.Tensor | None = None,
        decoder_attention_mask: torch.Tensor | None = None,
        decoder_inputs_embeds: torch.Tensor | None = None,
        encoder_outputs: ModelOutput | tuple | None = None,
        cache: Cache | None = None,
        **kwargs: Any,
    ) -> BaseModelOutputWithPastAndCrossAttentions | Seq2SeqModelOutput | tuple:
        past_key_values = _cache_argument(cache, past_key_values)
        varlen = _varlen_kwargs(kwargs)
        seq2seq = self.decoder is not None
        if seq2seq and _is_packed(position_ids, varlen):
            raise ValueError(
                "packed documents (`position_ids` that restart, or `cu_seq_lens_q`/`cu_seq_lens_k`) are not "
                "supported by the encoder-decoder model: its cross-attention would read every document of a row. "
                "Pad each example to its own row."
            )
        # The cache is the decoder's: the seq2seq decoder, or the stack itself in a causal decoder-only model.
        use_cache = (seq2seq or self.is_causal) and (use_cache if use_cache is not None else self.config.use_cache)
        if use_cache and past_key_values is None:
            # No config: see `_supports_default_dynamic_cache`.
            past_key_values = EncoderDecoderCache(DynamicCache(), DynamicCache()) if seq2seq else DynamicCache()
        if not use_cache:
            past_key_values = None
        if not seq2seq or encoder_outputs is None:
            encoder_outputs = self.encode(
                input_ids=input_ids,
                attention_mask=attention_mask,
                global_attention_mask=global_attention_mask,
                inputs_embeds=inputs_embeds,
                position_ids=position_ids,
                output_hidden_states=output_hidden_states,
                output_attentions=output_attentions,
                return_dict=True if seq2seq else return_dict,
                past_key_values=None if seq2seq else past_key_values,
                cu_seq_lens_q=varlen.get("cu_seq_lens_q"),
                cu_seq_lens_k=varlen.get("cu_seq_lens_k"),
            )
            if not seq2seq:
                return encoder_outputs
        elif not isinstance(encoder_outputs, ModelOutput):
            encoder_outputs = BaseModelOutput(*encoder_outputs)  # a tuple from `return_dict=False`
        if decoder_input_ids is None and decoder_inputs_embeds is None and isinstance(input_ids, torch.Tensor):
            # BART's contract (`BartModel`): without decoder inputs, the decoder reads `input_ids` shifted right
            # (the encoder has checked them above, unless `encoder_outputs` was given).
            decoder_input_ids = shift_tokens_right(
                input_ids, self.config.pad_token_id, self.config.decoder_start_token_id
            )
        return self._decode(
            encoder_outputs,
            attention_mask=attention_mask,
            decoder_input_ids=decoder_input_ids,
            decoder_attention_mask=decoder_attention_mask,
            decoder_inputs_embeds=decoder_inputs_embeds,
            past_key_values=past_key_values,
            output_hidden_states=output_hidden_states,
            output_attentions=output_attentions,
            return_dict=return_dict,
        )

    def _decode(
        self,
        encoder_outputs: ModelOutput,
        *,
        attention_mask,
        decoder_input_ids,
        decoder_attention_mask,
        decoder_inputs_embeds,
        past_key_values,
        output_hidden_states,
        output_attentions,
        return_dict,
    ) -> Seq2SeqModelOutput | tuple:
        """The seq2seq decoder with cross-attention to `encoder_outputs`' states (`attention_mask`: the encoder's)."""
        decoder_outputs = self.decoder(
            input_ids=decoder_input_ids,
            inputs_embeds=decoder_inputs_embeds,
            attention_mask=decoder_attention_mask,
            encoder_hidden_states=encoder_outputs.last_hidden_state,
            encoder_attention_mask=attention_mask,
            past_key_values=past_key_values,
            output_hidden_states=output_hidden_states,
            output_attentions=output_attentions,
        )
        output = Seq2SeqModelOutput(
            last_hidden_state=decoder_outputs.last_hidden_state,
            **{_CACHE_FIELD: getattr(decoder_outputs, _CACHE_FIELD)},
            decoder_hidden_states=decoder_outputs.hidden_states,
            decoder_attentions=decoder_outputs.attentions,
            cross_attentions=decoder_outputs.cross_attentions,
            encoder_last_hidden_state=encoder_outputs.last_hidden_state,
            encoder_hidden_states=encoder_outputs.hidden_states,
            encoder_attentions=encoder_outputs.attentions,
        )
        return output if _return_dict(self, return_dict) else output.to_tuple()


ENCODER_INPUTS = (
    "input_ids",
    "attention_mask",
    "global_attention_mask",
    "inputs_embeds",
    "position_ids",
    "output_hidden_states",
    "output_attentions",
    "return_dict",
)
"""The arguments of a seq2seq model's encoder (`LongAttnEncoder`), in their positional order."""


class LongAttnEncoder(nn.Module):
    """The encoder of a seq2seq `LongAttnModel` as one module (embeddings, then the encoder stack): what
    `get_encoder()` returns, and `generate()` runs once per input.

    It holds no weights of its own: the model is kept out of the module tree (in a tuple), so no weight is listed
    under a second name.
    """

    def __init__(self, model: LongAttnModel):
        super().__init__()
        self._model = (model,)

    def forward(self, *args, **kwargs) -> BaseModelOutputWithPastAndCrossAttentions | tuple:
        """`LongAttnModel.encode` on `args` and the keywords among `ENCODER_INPUTS` (its arguments but the cache and
        the varlen ones: a seq2seq encoder has neither); `generate` passes every model keyword but the decoder's,
        and the others are ignored."""
        if len(args) > len(ENCODER_INPUTS):
            raise TypeError(f"the encoder takes at most {len(ENCODER_INPUTS)} positional arguments: {ENCODER_INPUTS}")
        inputs = {name: value for name, value in kwargs.items() if name in ENCODER_INPUTS}
        for name, value in zip(ENCODER_INPUTS, args):
            if name in inputs:
                raise TypeError(f"the encoder got `{name}` twice: by position and by name")
            inputs[name] = value
        return self._model[0].encode(**inputs)


# ---------------------------------------------------------------------------------------------- encoder heads
class _LongAttnHead(LongAttnPreTrainedModel):
    """A task head on `longattn` (a `LongAttnModel`): the forward pass every head shares.

    Each head keeps an explicit `forward` signature, because transformers reads its parameter names (Trainer, to
    keep dataset columns and to pass `num_items_in_batch`; `generate`, to route model keywords), and hands its
    arguments on as they came, first thing: `return self._forward(locals())`. A head states what differs:
    `output_class`; `_head_arguments`, the arguments that are the head's (targets, options of its logits) rather
    than the backbone's; `_backbone_arguments` (by default: every other argument, and the varlen keywords);
    `_task`, the output fields and the task loss; `_states`, the fields copied from the backbone's output.
    """

    output_class: type[ModelOutput]
    _head_arguments: tuple[str, ...] = ("labels",)

    def _forward(self, arguments: dict[str, Any]) -> ModelOutput | tuple:
        """The shared body, on a head forward's `arguments` by name (its `locals()`)."""
        arguments = {name: value for name, value in arguments.items() if name != "self"}
        varlen = _varlen_kwargs(arguments.pop("kwargs"))
        return_dict = arguments.pop("return_dict")
        num_items_in_batch = arguments.pop("num_items_in_batch", None)  # not a parameter where a head refuses it
        targets = {name: arguments.pop(name) for name in self._head_arguments}
        outputs = self.longattn(**self._backbone_arguments(arguments, varlen, targets), return_dict=True)
        fields, labels = self._task(
            outputs, num_items_in_batch=num_items_in_batch, attention_mask=arguments.get("attention_mask"), **targets
        )
        fields["loss"] = _with_auxiliary_loss(
            fields["loss"], self.longattn, labels=labels, num_items_in_batch=num_items_in_batch
        )
        output = self.output_class(**fields, **self._states(outputs))
        return output if _return_dict(self, return_dict) else output.to_tuple()

    def _backbone_arguments(
        self, arguments: dict[str, Any], varlen: dict[str, Any], targets: dict[str, Any]
    ) -> dict[str, Any]:
        """The keyword arguments of `self.longattn`, from the forward's `arguments` that are not the head's, the
        varlen keywords among its `**kwargs` (`varlen`), and the head's `targets` (for a head whose inputs come
        from them)."""
        return {**arguments, **varlen}

    def _task(
        self, outputs: ModelOutput, *, num_items_in_batch, attention_mask, **targets
    ) -> tuple[dict[str, Any], torch.Tensor | None]:
        """The backbone's `outputs` and the head's `targets` -> (the output's fields, "loss" the task loss or None;
        the labels whose labelled items `num_items_in_batch` counts, for the auxiliary loss's share)."""
        raise NotImplementedError

    def _states(self, outputs: ModelOutput) -> dict[str, Any]:
        """The output fields copied from the backbone's `outputs`."""
        return {"hidden_states": outputs.hidden_states, "attentions": outputs.attentions}


class _LongAttnEncoderHead(_LongAttnHead):
    """A task head on the bidirectional encoder (`longattn`) trained on `labels`: the forward signature they share.

    A head builds its layers after `super().__init__` and states `_head` (logits and loss from the encoder's
    states) and, optionally, `_backbone_arguments` (e.g. its default global tokens).

    Forward args:
        input_ids, attention_mask, global_attention_mask, inputs_embeds, position_ids, output_hidden_states,
            output_attentions: As in `LongAttnModel`.
        labels: The head's targets (see each head), -100 = ignored.
        return_dict: An `output_class` (default: the config's `return_dict`) or a tuple.
        num_items_in_batch: transformers' Trainer: the labelled items of the whole optimizer step.
    """

    def __init__(self, config: LongAttnConfig):
        super().__init__(config)
        self.longattn = LongAttnModel(config, add_decoder=False)

    def forward(
        self,
        input_ids=None,
        attention_mask=None,
        global_attention_mask=None,
        inputs_embeds=None,
        position_ids=None,
        labels=None,
        output_hidden_states=None,
        output_attentions=None,
        return_dict=None,
        num_items_in_batch=None,
        **kwargs,
    ) -> ModelOutput | tuple:
        return self._forward(locals())

    def _task(self, outputs, *, num_items_in_batch, attention_mask, labels):
        logits, loss = self._head(outputs.last_hidden_state, labels, num_items_in_batch, attention_mask=attention_mask)
        return {"loss": loss, "logits": logits}, labels

    def _head(
        self, hidden_states: torch.Tensor, labels: torch.Tensor | None, num_items_in_batch, attention_mask=None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Encoder states `[b, n, D]` -> (logits, the task loss against `labels` or None without them);
        `attention_mask` `[b, n]` (1 = token) for heads that pool over the real tokens."""
        raise NotImplementedError


class LongAttnForMaskedLM(_LongAttnEncoderHead):
    """Masked-LM head on the bidirectional encoder; `labels` `[b, n]` with -100 on unmasked positions."""

    _tied_weights_keys = {"lm_head.decoder.weight": "longattn.embeddings.word_embeddings.weight"}
    output_class = MaskedLMOutput

    def __init__(self, config: LongAttnConfig):
        super().__init__(config)
        self.lm_head = LongAttnLMHead(config)
        self.post_init()

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head.decoder

    def set_output_embeddings(self, value: nn.Linear) -> None:
        self.lm_head.decoder = value

    def _head(self, hidden_states, labels, num_items_in_batch, attention_mask=None):
        logits = self.lm_head(hidden_states)  # [b, n, V]
        return logits, _masked_lm_loss(logits, labels, self.config.vocab_size, num_items_in_batch=num_items_in_batch)


class LongAttnForSequenceClassification(_LongAttnEncoderHead):
    """Classification from the first token's state, or the mean state of the real tokens with
    `config.classifier_pooling="mean"`. The first token is global unless `global_attention_mask` is given
    (Longformer's recipe: the classification token then sees the whole document)."""

    output_class = SequenceClassifierOutput

    def __init__(self, config: LongAttnConfig):
        super().__init__(config)
        self.num_labels = config.num_labels
        self.classifier = LongAttnClassificationHead(config)
        self.post_init()

    def _backbone_arguments(self, arguments, varlen, targets):
        """Refuse empty and packed rows, and make the first token global unless `global_attention_mask` is given."""
        input_ids, inputs_embeds = arguments["input_ids"], arguments["inputs_embeds"]
        # Shapes only: the backbone checks the ids' values (one host sync per forward, not two).
        batch, length = _check_token_inputs(
            self.config, self.longattn.embeddings, input_ids, inputs_embeds, check_values=False
        )
        if length == 0:
            raise ValueError(
                "`input_ids` has length 0: sequence classification reads the first token's state, so "
                "pass at least one token."
            )
        if _is_packed(arguments["position_ids"], varlen, batch=batch, length=length):
            raise ValueError(
                "sequence classification reads one label per row from the row's first token: packed documents "
                "(`position_ids` that restart, or `cu_seq_lens_q`/`cu_seq_lens_k`) are not supported; pad each "
                "example to its own row."
            )
        if arguments["global_attention_mask"] is None:
            device = (input_ids if input_ids is not None else inputs_embeds).device
            global_attention_mask = torch.zeros(batch, length, dtype=torch.bool, device=device)
            global_attention_mask[:, 0] = True
            arguments = {**arguments, "global_attention_mask": global_attention_mask}
        return super()._backbone_arguments(arguments, varlen, targets)

    def _head(self, hidden_states, labels, num_items_in_batch, attention_mask=None):
        if self.config.classifier_pooling == "mean":
            pooled = _mean_over_tokens(hidden_states, attention_mask)  # [b, D]
        else:
            pooled = hidden_states[:, 0]  # [b, D]
        logits = self.classifier(pooled)  # [b, num_labels]
        return logits, _classification_loss(self.config, logits, labels, num_items_in_batch=num_items_in_batch)


class LongAttnForTokenClassification(_LongAttnEncoderHead):
    """Per-token classification; `labels` `[b, n]` with -100 on ignored positions."""

    output_class = TokenClassifierOutput

    def __init__(self, config: LongAttnConfig):
        super().__init__(config)
        self.num_labels = config.num_labels
        self.dropout = nn.Dropout(_classifier_dropout(config))
        self.classifier = nn.Linear(config.hidden_size, config.num_labels)
        self.post_init()

    def _head(self, hidden_states, labels, num_items_in_batch, attention_mask=None):
        logits = self.classifier(self.dropout(hidden_states))  # [b, n, num_labels]
        _check_labels("labels", labels, [logits.shape[:2]], classes=self.num_labels)
        loss = None
        if labels is not None:
            loss = fixed_cross_entropy(
                logits.view(-1, self.num_labels).float(), labels.reshape(-1).to(logits.device), num_items_in_batch
            )
        return logits, loss


class LongAttnForQuestionAnswering(_LongAttnEncoderHead):
    """Extractive QA: start/end logits per token. Put global attention on the question tokens
    (`global_attention_mask`), as Longformer does; none is added by default."""

    output_class = QuestionAnsweringModelOutput
    _head_arguments = ("start_positions", "end_positions")
    # The loss is the mean of two per-example means, which `num_items_in_batch` cannot split (and QA batches have no
    # `labels` for Trainer to count): Trainer divides it by the accumulation steps itself.
    accepts_loss_kwargs = False

    def __init__(self, config: LongAttnConfig):
        super().__init__(config)
        self.qa_outputs = nn.Linear(config.hidden_size, 2)
        self.post_init()

    def forward(
        self,
        input_ids=None,
        attention_mask=None,
        global_attention_mask=None,
        inputs_embeds=None,
        position_ids=None,
        start_positions=None,
        end_positions=None,
        output_hidden_states=None,
        output_attentions=None,
        return_dict=None,
        **kwargs,
    ) -> QuestionAnsweringModelOutput | tuple:
        return self._forward(locals())

    def _task(self, outputs, *, num_items_in_batch, attention_mask, start_positions, end_positions):
        start_logits, end_logits = self.qa_outputs(outputs.last_hidden_state).float().unbind(-1)  # [b, n] each
        batch = start_logits.shape[0]
        _check_labels("start_positions", start_positions, [(batch,), (batch, 1)])
        _check_labels("end_positions", end_positions, [(batch,), (batch, 1)])
        loss = None
        if start_positions is not None and end_positions is not None:
            length = start_logits.shape[1]
            # Positions outside the sequence are ignored, as in transformers' QA heads.
            start = start_positions.view(-1).clamp(0, length).to(start_logits.device)
            end = end_positions.view(-1).clamp(0, length).to(end_logits.device)
            loss = (
                F.cross_entropy(start_logits, start, ignore_index=length)
                + F.cross_entropy(end_logits, end, ignore_index=length)
            ) / 2
        return {"loss": loss, "start_logits": start_logits, "end_logits": end_logits}, None


# ---------------------------------------------------------------------------------------------- decoder heads
class LongAttnForCausalLM(_LongAttnHead, GenerationMixin):
    """Causal LM: the stack with causal attention (`config.is_decoder` is set), and a tied vocabulary projection.
    `labels` `[b, n]` are the inputs themselves (shifted inside), -100 ignored."""

    _tied_weights_keys = {"lm_head.weight": "longattn.embeddings.word_embeddings.weight"}
    output_class = CausalLMOutputWithPast
    _head_arguments = ("labels", "shift_labels", "logits_to_keep")

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

    def forward(
        self,
        input_ids=None,
        attention_mask=None,
        global_attention_mask=None,
        inputs_embeds=None,
        position_ids=None,
        past_key_values=None,
        use_cache=None,
        labels=None,
        output_hidden_states=None,
        output_attentions=None,
        return_dict=None,
        logits_to_keep: int = 0,
        shift_labels=None,
        num_items_in_batch=None,
        cache=None,
        **kwargs,
    ) -> CausalLMOutputWithPast | tuple:
        return self._forward(locals())

    def _task(self, outputs, *, num_items_in_batch, attention_mask, labels, shift_labels, logits_to_keep):
        hidden_states = outputs.last_hidden_state
        vocab = dict(classes=self.config.vocab_size, what="vocab_size")
        _check_labels("labels", labels, [hidden_states.shape[:2]], **vocab)
        _check_labels("shift_labels", shift_labels, [hidden_states.shape[:2]], **vocab)
        if logits_to_keep:
            hidden_states = hidden_states[:, -logits_to_keep:]
        logits = self.lm_head(hidden_states)  # [b, n, V]
        loss = None
        if labels is not None or shift_labels is not None:
            # `shift_labels` `[b, n]` (padding-free collators) are the targets of every position, already aligned.
            if shift_labels is None:
                shift_labels = F.pad(labels, (0, 1), value=-100)[:, 1:]
            loss = ForCausalLMLoss(
                logits,
                None,
                self.config.vocab_size,
                num_items_in_batch=num_items_in_batch,
                shift_labels=shift_labels.contiguous(),
            )
        return {"loss": loss, "logits": logits}, shift_labels

    def _states(self, outputs):
        return {**super()._states(outputs), _CACHE_FIELD: getattr(outputs, _CACHE_FIELD)}


class LongAttnDecoder(nn.Module):
    """The seq2seq decoder: causal self-attention (`config.decoder_attention_type`) + cross-attention. Its token
    table is tied to the encoder's by `LongAttnModel`."""

    def __init__(self, config: LongAttnConfig):
        super().__init__()
        self.config = config
        self.embeddings = LongAttnEmbeddings(config)
        self.rotary = LongAttnRotaryEmbedding(config) if config.position_embedding_type == "rope" else None
        self.stack = LongAttnStack(
            config, attention_types=config.decoder_layer_attention_types, is_causal=True, has_cross_attention=True
        )

    def forward(self, **inputs: Any) -> BaseModelOutputWithPastAndCrossAttentions:
        """`_run_backbone` on the decoder's layers: `inputs` are its keywords `input_ids` / `inputs_embeds`,
        `attention_mask`, `encoder_hidden_states`, `encoder_attention_mask`, `past_key_values` and the two output
        flags (no global tokens, positions counted from the cache)."""
        return _run_backbone(self.embeddings, self.rotary, self.stack, self.config, prefix="decoder_", **inputs)


def shift_tokens_right(labels: torch.Tensor, pad_token_id: int, decoder_start_token_id: int) -> torch.Tensor:
    """Decoder inputs from labels (or input ids) `[b, n]`: start token, then labels[:-1], with -100 replaced by
    padding (BART's `shift_tokens_right`).

    Raises:
        ValueError: `pad_token_id` or `decoder_start_token_id` is None (nothing to fill with).
    """
    for name, value in (("pad_token_id", pad_token_id), ("decoder_start_token_id", decoder_start_token_id)):
        if value is None:
            raise ValueError(
                f"`config.{name}` is None: set it to derive the decoder inputs, or pass `decoder_input_ids`."
            )
    shifted = labels.new_full(labels.shape, pad_token_id)
    shifted[:, 1:] = labels[:, :-1]
    shifted[:, 0] = decoder_start_token_id
    return shifted.masked_fill(shifted == -100, pad_token_id)


class LongAttnForSeq2SeqLM(_LongAttnHead, GenerationMixin):
    """Encoder-decoder like LED: a long encoder with the configured attention (`attention_type`), a decoder with causal
    self-attention (`decoder_attention_type`, "full" by default) and dense cross-attention, shared embeddings.

    The encoder-decoder is a `LongAttnModel` under `longattn` (see there why), plus the LM head."""

    _tied_weights_keys = {"lm_head.weight": "longattn.embeddings.word_embeddings.weight"}
    output_class = Seq2SeqLMOutput

    def __init__(self, config: LongAttnConfig):
        if not config.is_encoder_decoder or config.is_decoder:
            config.is_encoder_decoder, config.is_decoder = True, False
            config.validate_longattn()
        super().__init__(config)
        self.longattn = LongAttnModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_encoder(self) -> nn.Module:
        return self.longattn.get_encoder()

    def get_decoder(self) -> LongAttnDecoder:
        return self.longattn.decoder

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head

    def set_output_embeddings(self, value: nn.Linear) -> None:
        self.lm_head = value

    def prepare_decoder_input_ids_from_labels(self, labels: torch.Tensor) -> torch.Tensor:
        return shift_tokens_right(labels, self.config.pad_token_id, self.config.decoder_start_token_id)

    def forward(
        self,
        input_ids=None,
        attention_mask=None,
        global_attention_mask=None,
        inputs_embeds=None,
        decoder_input_ids=None,
        decoder_attention_mask=None,
        decoder_inputs_embeds=None,
        encoder_outputs=None,
        past_key_values=None,
        use_cache=None,
        labels=None,
        output_hidden_states=None,
        output_attentions=None,
        return_dict=None,
        num_items_in_batch=None,
        cache=None,
        **kwargs,
    ) -> Seq2SeqLMOutput | tuple:
        return self._forward(locals())

    def _backbone_arguments(self, arguments, varlen, targets):
        """Without decoder inputs the decoder reads the shifted `labels`; packed rows are not taken (no varlen)."""
        if targets["labels"] is not None:
            arguments = {**arguments, "use_cache": False}
            if arguments["decoder_input_ids"] is None and arguments["decoder_inputs_embeds"] is None:
                arguments["decoder_input_ids"] = self.prepare_decoder_input_ids_from_labels(targets["labels"])
        return arguments

    def _task(self, outputs, *, num_items_in_batch, attention_mask, labels):
        logits = self.lm_head(outputs.last_hidden_state)  # [b, t, V]
        # Labels are the decoder's targets, unshifted (the decoder inputs are the shifted labels).
        loss = _masked_lm_loss(logits, labels, self.config.vocab_size, num_items_in_batch=num_items_in_batch)
        return {"loss": loss, "logits": logits}, labels

    def _states(self, outputs):
        # Every field of the base model's output but its last hidden state (the cache, the decoder's and encoder's
        # states and attentions) has the same name in the LM output.
        return {name: value for name, value in outputs.items() if name != "last_hidden_state"}

    def auxiliary_loss(self) -> torch.Tensor | None:
        return self.longattn.auxiliary_loss()


AUTO_MAP = {
    "AutoConfig": "configuration_longattn.LongAttnConfig",
    "AutoModel": "modeling_longattn.LongAttnModel",
    "AutoModelForMaskedLM": "modeling_longattn.LongAttnForMaskedLM",
    "AutoModelForSequenceClassification": "modeling_longattn.LongAttnForSequenceClassification",
    "AutoModelForTokenClassification": "modeling_longattn.LongAttnForTokenClassification",
    "AutoModelForQuestionAnswering": "modeling_longattn.LongAttnForQuestionAnswering",
    "AutoModelForCausalLM": "modeling_longattn.LongAttnForCausalLM",
    "AutoModelForSeq2SeqLM": "modeling_longattn.LongAttnForSeq2SeqLM",
}
"""Every Auto class a saved folder answers to, whatever head saved it: a masked-LM folder also loads as `AutoModel`
(the encoder) and as a classifier to fine-tune."""

# The transformers way to share custom code: each class registered for its Auto class, so that every
# `save_pretrained` writes `auto_map` and copies this module and its siblings into the folder.
for _auto_class, _target in AUTO_MAP.items():
    if _auto_class != "AutoConfig":
        globals()[_target.split(".")[1]].register_for_auto_class(_auto_class)

__all__ = [
    "LongAttnPreTrainedModel",
    *(target.split(".")[1] for auto_class, target in AUTO_MAP.items() if auto_class != "AutoConfig"),
]
