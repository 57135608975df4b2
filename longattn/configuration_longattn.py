"""`LongAttnConfig`: the one configuration of every longattn model, validated in one place.

Common transformer fields follow BERT/LED naming. Attention-kind fields are flat and prefixed by the kind
(`sliding_window`, `lsh_num_hashes`, ...): each kind declares its fields, defaults and allowed values in the static
table `attention_fields.KINDS`, which this module validates through, so that `LongAttnConfig(attention_type=name)`
works alone for every registered kind without importing any kind, op or executor.
"""

from __future__ import annotations

import contextvars
import dataclasses
import difflib
import functools
import inspect
import os
from collections.abc import Iterable
from typing import Any

from transformers import GenerationConfig, PreTrainedConfig
from transformers.activations import ACT2FN
from transformers.utils import logging

from .attention_fields import KINDS, check_backend_name, check_kind_backend, check_number, field_defaults, validate_kind

logger = logging.get_logger(__name__)

POSITION_EMBEDDING_TYPES = ("rope", "learned")
PROBLEM_TYPES = ("regression", "single_label_classification", "multi_label_classification")
CLASSIFIER_POOLINGS = ("cls", "mean")  # ModernBERT's names

# True while `from_dict` (hence `from_pretrained`, `AutoConfig`) builds a config from a saved file: a near-miss key
# there is a warning (the file was written elsewhere, and configs accept unknown keys), in code it is an error.
_LOADING = contextvars.ContextVar("longattn_config_loading", default=False)


# Stock families whose learned position table holds `pad_token_id + 1` rows before the first token's row.
PADDING_OFFSET_MODEL_TYPES = ("roberta", "xlm-roberta", "camembert", "roberta-prelayernorm", "longformer")


def max_tokens(config: Any) -> int | None:
    """The number of tokens a model of any family with `config` reads (RoBERTa: `max_position_embeddings -
    pad_token_id - 1`); None when the config states no limit."""
    limit = getattr(config, "max_position_embeddings", None)
    if limit is not None and getattr(config, "model_type", None) in PADDING_OFFSET_MODEL_TYPES:
        limit -= config.pad_token_id + 1
    return limit


class LongAttnConfig(PreTrainedConfig):
    r"""Configuration of a longattn encoder, decoder or encoder-decoder.

    Args:
        vocab_size: Size of the token vocabulary.
        hidden_size: Width of the residual stream.
        num_hidden_layers: Number of encoder layers (decoder layers of a causal LM).
        num_attention_heads: Heads per attention layer; must divide `hidden_size`.
        intermediate_size: Width of the feed-forward block.
        hidden_act: Activation of the feed-forward block (any name of `transformers.activations.ACT2FN`).
        hidden_dropout_prob: Dropout on embeddings and residual branches.
        attention_probs_dropout_prob: Dropout on attention probabilities.
        max_position_embeddings: Longest sequence the model accepts (the size of the learned position table).
        position_embedding_type: `"rope"` (rotary, relative; default) or `"learned"` (absolute, Longformer-style).
        rope_theta: Base of the rotary frequencies.
        layer_norm_eps: LayerNorm epsilon.
        initializer_range: Standard deviation of the normal weight initialisation.
        attention_type: One registered attention name for every layer, or a list with one name per layer
            (`longattn.available_attention_types()` lists them).
        num_decoder_layers: Decoder layers of an encoder-decoder model (defaults to `num_hidden_layers`).
        decoder_attention_type: Self-attention of the seq2seq decoder (causal), one name or one per decoder layer.
        classifier_dropout: Dropout before classification heads (defaults to `hidden_dropout_prob`).
        classifier_pooling: What the sequence-classification head reads: `"cls"` (default), the first token's
            state (a global token unless `global_attention_mask` says otherwise), or `"mean"`, the mean state of the
            real tokens (`attention_mask`), as LRA's models and ModernBERT may.
        is_decoder: A causal decoder (set by `LongAttnForCausalLM`).
        attention_backend: Which kernels compute the attention of the kinds that dispatch (`"sliding"`, `"full"`,
            `"strided"`, `"fixed"`): `"auto"` (default; the fastest that can run: xformers, then FlexAttention on
            CUDA, else the PyTorch executors), `"torch"`, `"flex"`, `"xformers"` or `"reference"` (see
            `longattn.backends`). An explicit back end that cannot run a layer's call raises with the reasons.
            The other kinds run on `"auto"`, `"torch"` (their own executor) or `"reference"` (their dense form);
            naming `"flex"` or `"xformers"` for them is a `ValueError` here, not a silent fallback.
        **kwargs: Attention-kind fields (see `attention_fields.KINDS`), the fields of every attention layer
            (`attention_fields.LAYER_FIELDS`: `relative_position_logits`, one bool or one per layer, and
            `relative_max_distance`, relative-position logits; see `longattn.relative_logits`) and
            `PreTrainedConfig` fields. Unknown keys are kept (as in every transformers config), except one within
            edit distance 2 of a longattn field: a `ValueError` ("did you mean ...?"), a warning when the config is
            loaded from a file. `head_dim` is accepted when it equals `hidden_size / num_attention_heads` (it is
            derived, not stored).

    Raises:
        ValueError: a field outside its allowed type or values (the message names the field, the value and what is
            allowed), a misspelt field, or a `model_type` other than "longattn" (a folder of another model).
    """

    model_type = "longattn"
    keys_to_ignore_at_inference = ["past_key_values"]

    def __init__(
        self,
        vocab_size: int = 260,
        hidden_size: int = 256,
        num_hidden_layers: int = 4,
        num_attention_heads: int = 4,
        intermediate_size: int = 1024,
        hidden_act: str = "gelu",
        hidden_dropout_prob: float = 0.1,
        attention_probs_dropout_prob: float = 0.0,
        max_position_embeddings: int = 4096,
        position_embedding_type: str = "rope",
        rope_theta: float = 10000.0,
        layer_norm_eps: float = 1e-5,
        initializer_range: float = 0.02,
        attention_type: str | list[str] = "sliding",
        num_decoder_layers: int | None = None,
        decoder_attention_type: str | list[str] = "full",
        classifier_dropout: float | None = None,
        classifier_pooling: str = "cls",
        is_decoder: bool = False,
        attention_backend: str = "auto",
        pad_token_id: int | None = 0,
        bos_token_id: int | None = 1,
        eos_token_id: int | None = 2,
        decoder_start_token_id: int | None = None,
        tie_word_embeddings: bool = True,
        use_cache: bool = True,
        **kwargs: Any,
    ):
        _check_model_type(kwargs.pop("model_type", None), source="the config")
        # `head_dim` is derived (hidden_size / num_attention_heads); a config that states it must agree (checked
        # below, once the sizes are known). Llama-style config.json files carry it.
        head_dim = kwargs.pop("head_dim", None)
        _check_near_misses(kwargs)
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.intermediate_size = intermediate_size
        self.hidden_act = hidden_act
        self.hidden_dropout_prob = hidden_dropout_prob
        self.attention_probs_dropout_prob = attention_probs_dropout_prob
        self.max_position_embeddings = max_position_embeddings
        self.position_embedding_type = position_embedding_type
        self.rope_theta = rope_theta
        self.layer_norm_eps = layer_norm_eps
        self.initializer_range = initializer_range
        self.attention_type = attention_type
        self.num_decoder_layers = num_hidden_layers if num_decoder_layers is None else num_decoder_layers
        self.decoder_attention_type = decoder_attention_type
        self.classifier_dropout = classifier_dropout
        self.classifier_pooling = classifier_pooling
        self.is_decoder = is_decoder
        self.attention_backend = attention_backend
        self.use_cache = use_cache
        # Every registered kind's own fields, with their defaults, so any kind works from its name alone.
        for field, default in field_defaults().items():
            setattr(self, field, kwargs.pop(field, default))
        # transformers' own validators (run by the base class below) divide by `num_attention_heads` and compare
        # token ids with `vocab_size`: check those fields first, so that a bad value gets longattn's message.
        self._validate_sizes()
        for field, value in (
            ("pad_token_id", pad_token_id),
            ("bos_token_id", bos_token_id),
            ("eos_token_id", eos_token_id),
            ("decoder_start_token_id", decoder_start_token_id),
        ):
            _check_token_id(field, value, vocab_size)
        super().__init__(
            pad_token_id=pad_token_id,
            bos_token_id=bos_token_id,
            eos_token_id=eos_token_id,
            decoder_start_token_id=bos_token_id if decoder_start_token_id is None else decoder_start_token_id,
            tie_word_embeddings=tie_word_embeddings,
            **kwargs,
        )
        self.validate_longattn()
        if head_dim is not None:
            self.head_dim = head_dim

    # ------------------------------------------------------------------ loading
    @classmethod
    def get_config_dict(cls, pretrained_model_name_or_path: str | os.PathLike, **kwargs: Any):
        """transformers' `get_config_dict`, refusing a folder that holds another model type (checked here, where
        the folder is known, before transformers would build a random longattn model from a foreign config)."""
        config_dict, kwargs = super().get_config_dict(pretrained_model_name_or_path, **kwargs)
        _check_model_type(config_dict.get("model_type"), source=f"{str(pretrained_model_name_or_path)!r}")
        return config_dict, kwargs

    @classmethod
    def from_dict(cls, config_dict: dict[str, Any], **kwargs: Any):
        """transformers' `from_dict`; a key of the saved config that looks like a misspelt longattn field is a
        warning here (an error when the config is built in code)."""
        token = _LOADING.set(True)
        try:
            return super().from_dict(config_dict, **kwargs)
        finally:
            _LOADING.reset(token)

    # ------------------------------------------------------------------ per-layer views
    @property
    def head_dim(self) -> int:
        """Width of one attention head: `hidden_size // num_attention_heads` (derived, never stored)."""
        return self.hidden_size // self.num_attention_heads

    @head_dim.setter
    def head_dim(self, value: Any) -> None:
        # Settable so that configs naming it (Llama's, transformers' `from_pretrained(..., head_dim=...)`) load,
        # but only to the derived value: another width would need projections this model does not have.
        if value != self.head_dim or isinstance(value, bool):
            raise ValueError(
                f"`head_dim`={value!r} is invalid: longattn derives it as `hidden_size` / `num_attention_heads` "
                f"= {self.hidden_size} / {self.num_attention_heads} = {self.head_dim}; give that value or none."
            )

    @property
    def layer_attention_types(self) -> list[str]:
        """The attention name of each encoder layer (decoder layers for a causal LM)."""
        return _expand(self.attention_type, self.num_hidden_layers)

    @property
    def decoder_layer_attention_types(self) -> list[str]:
        """The self-attention name of each decoder layer of an encoder-decoder model."""
        return _expand(self.decoder_attention_type, self.num_decoder_layers)

    def per_layer(self, field: str, layer_idx: int) -> Any:
        """The value of `field` for layer `layer_idx` (fields may hold one value or a list with one per layer)."""
        value = getattr(self, field)
        return value[layer_idx] if isinstance(value, (list, tuple)) else value

    # ------------------------------------------------------------------ validation
    def _validate_sizes(self) -> None:
        """The integer sizes, each >= 1 (an integer given as a string included), and heads dividing the width."""
        for field in (
            "vocab_size",
            "hidden_size",
            "num_hidden_layers",
            "num_attention_heads",
            "intermediate_size",
            "max_position_embeddings",
            "num_decoder_layers",
        ):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"`{field}`={value!r} is invalid: expected an integer >= 1.")
        if self.hidden_size % self.num_attention_heads != 0:
            raise ValueError(
                f"`num_attention_heads`={self.num_attention_heads} must divide `hidden_size`={self.hidden_size}."
            )

    def validate_longattn(self) -> None:
        """Check every field; raise `ValueError` naming the field, the value and what is allowed."""
        self._validate_sizes()
        for field in ("hidden_dropout_prob", "attention_probs_dropout_prob", "classifier_dropout"):
            check_number(
                field,
                getattr(self, field),
                minimum=0.0,
                maximum=1.0,
                exclusive_maximum=True,
                optional=field == "classifier_dropout",
            )
        for field in ("rope_theta", "layer_norm_eps"):
            check_number(field, getattr(self, field), minimum=0.0, exclusive_minimum=True)
        check_number("initializer_range", self.initializer_range, minimum=0.0)
        # A truthy string such as "no" would silently turn an encoder causal: booleans must be bools.
        for field in (
            "is_decoder",
            "is_encoder_decoder",
            "tie_word_embeddings",
            "use_cache",
            "output_hidden_states",
            "return_dict",
        ):
            value = getattr(self, field)
            if not isinstance(value, bool):
                raise ValueError(f"`{field}`={value!r} is invalid: expected True or False.")
        chunk = self.chunk_size_feed_forward
        if not isinstance(chunk, int) or isinstance(chunk, bool) or chunk < 0:
            raise ValueError(f"`chunk_size_feed_forward`={chunk!r} is invalid: expected an integer >= 0.")
        if self.problem_type is not None and self.problem_type not in PROBLEM_TYPES:
            raise ValueError(
                f"`problem_type`={self.problem_type!r} is unknown: expected None or one of {list(PROBLEM_TYPES)}."
            )
        if self.classifier_pooling not in CLASSIFIER_POOLINGS:
            raise ValueError(
                f"`classifier_pooling`={self.classifier_pooling!r} is unknown: expected one of "
                f"{list(CLASSIFIER_POOLINGS)}."
            )
        if self.hidden_act not in ACT2FN:
            raise ValueError(
                f"`hidden_act`={self.hidden_act!r} is unknown: expected a name of transformers' ACT2FN "
                f"(e.g. 'gelu', 'relu', 'silu')."
            )
        for field in ("pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id"):
            _check_token_id(field, getattr(self, field), self.vocab_size)
        if self.position_embedding_type not in POSITION_EMBEDDING_TYPES:
            raise ValueError(
                f"`position_embedding_type`={self.position_embedding_type!r} is unknown: "
                f"expected one of {list(POSITION_EMBEDDING_TYPES)}."
            )
        check_backend_name(self.attention_backend, field="attention_backend")
        encoder_types = _validated_types("attention_type", self.attention_type, self.num_hidden_layers)
        decoder_types = _validated_types("decoder_attention_type", self.decoder_attention_type, self.num_decoder_layers)
        # The stack of a causal LM is causal; a seq2seq encoder is bidirectional and its decoder causal.
        encoder_is_causal = bool(self.is_decoder) and not self.is_encoder_decoder
        for layer_idx, name in enumerate(encoder_types):
            validate_kind(name, self, layer_idx=layer_idx, is_causal=encoder_is_causal)
            check_kind_backend(name, self.attention_backend)
        if self.is_encoder_decoder:
            for layer_idx, name in enumerate(decoder_types):
                validate_kind(name, self, layer_idx=layer_idx, is_causal=True)
                check_kind_backend(name, self.attention_backend)


def _check_token_id(field: str, value: Any, vocab_size: int) -> None:
    """None, or a token id in [0, vocab_size) (`eos_token_id` may be a list of them, as in transformers)."""
    values = value if field == "eos_token_id" and isinstance(value, (list, tuple)) else [value]
    for item in values:
        if item is not None and (not isinstance(item, int) or isinstance(item, bool) or not 0 <= item < vocab_size):
            raise ValueError(
                f"`{field}`={value!r} is invalid: expected None or a token id in [0, {vocab_size}) "
                f"(`vocab_size`={vocab_size})."
            )


def _check_model_type(model_type: Any, *, source: str) -> None:
    """Refuse a config of another model: its weights would not fit, and the model would load as random."""
    if model_type is None or model_type == LongAttnConfig.model_type:
        return
    raise ValueError(
        f"{source} holds a {model_type!r} model, not a longattn model (`model_type`={model_type!r}, expected "
        f"'longattn'). Load it with transformers' `AutoModel` / `AutoConfig` (or its own model class); to reuse its "
        f"weights in a longattn model, convert them first instead of loading the folder with a longattn class."
    )


@functools.cache
def _longattn_fields() -> frozenset[str]:
    """The fields longattn defines: the arguments of `LongAttnConfig.__init__` and every kind's own fields."""
    arguments = {
        name
        for name, parameter in inspect.signature(LongAttnConfig.__init__).parameters.items()
        if parameter.kind is inspect.Parameter.KEYWORD_ONLY or parameter.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD
    } - {"self"}
    return frozenset(arguments | set(field_defaults()))


@functools.cache
def _transformers_keys() -> frozenset[str]:
    """Keys a config may carry for transformers itself (its fields and properties, generation parameters it pops,
    and what saved configs commonly hold), which are never reported as misspellings."""
    keys = {field.name for field in dataclasses.fields(PreTrainedConfig)}
    keys |= {name for name in dir(PreTrainedConfig) if not name.startswith("__")}
    keys |= set(GenerationConfig().to_dict())
    keys |= {
        "model_type",
        "transformers_version",
        "name_or_path",
        "torch_dtype",
        "attn_implementation",
        "experts_implementation",
        "per_layer_config",
        "num_labels",
        "auto_map",
        "tokenizer_class",
        "prefix",
        "task_specific_params",
        "finetuning_task",
        "add_cross_attention",
        "cross_attention_hidden_size",
        "tie_encoder_decoder",
        "rope_parameters",
        "rope_scaling",
        "custom_pipelines",
        "head_dim",
    }
    return frozenset(keys)


def _edit_distance(a: str, b: str) -> int:
    """Levenshtein distance (insertions, deletions, substitutions)."""
    previous = list(range(len(b) + 1))
    for i, char_a in enumerate(a, 1):
        current = [i]
        for j, char_b in enumerate(b, 1):
            current.append(min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (char_a != char_b)))
        previous = current
    return previous[-1]


def _check_near_misses(kwargs: dict[str, Any]) -> None:
    """An unknown key within edit distance 2 of a longattn field is almost surely a misspelling, which would keep
    the field's default silently: a `ValueError` in code, a warning when loading a saved config. Other unknown keys
    are kept, as transformers' configs do."""
    fields, known = _longattn_fields(), _transformers_keys()
    for key in kwargs:
        if (
            not isinstance(key, str)
            or key in fields
            or key in known
            or key.startswith("_")
            or key.endswith("_token_id")
        ):
            continue
        close = sorted((distance, field) for field in fields if (distance := _edit_distance(key, field)) <= 2)
        if not close:
            continue
        names = ", ".join(field for _, field in close[:3])
        message = (
            f"`{key}`={kwargs[key]!r} is not a LongAttnConfig field (did you mean {names}?); as it stands it would be "
            f"kept as an unused attribute and the default of {close[0][1]} used."
        )
        if _LOADING.get():
            logger.warning(message)
        else:
            raise ValueError(message)


def check_override_fields(keys: Iterable[str], known: Iterable[str], *, where: str, hint: str = "") -> None:
    """Refuse config overrides (`--config_overrides`, `--set`) that name no field: a config keeps an unknown key as
    an unused attribute, so a misspelt field would silently leave its default in place.

    Args:
        keys: The override keys.
        known: The fields that may be set.
        where: The flag, for the message (e.g. "--config_overrides").
        hint: Appended to the message.

    Raises:
        ValueError: naming every unknown key and, for each, the closest fields.
    """
    known = set(known)
    unknown = sorted(key for key in set(keys) if key not in known)
    if not unknown:
        return
    described = []
    for key in unknown:
        close = difflib.get_close_matches(key, known, n=3)
        described.append(repr(key) + (f" (did you mean {', '.join(close)}?)" if close else ""))
    raise ValueError(f"{where}: unknown config field(s) {', '.join(described)}{hint}.")


def _expand(value: str | list[str], num_layers: int) -> list[str]:
    return list(value) if isinstance(value, (list, tuple)) else [value] * num_layers


def _validated_types(field: str, value: Any, num_layers: int) -> list[str]:
    if isinstance(value, (list, tuple)) and len(value) != num_layers:
        raise ValueError(
            f"`{field}` has {len(value)} entries ({list(value)!r}) but the stack has {num_layers} layers: "
            f"give one name, or one per layer."
        )
    names = _expand(value, num_layers)
    for name in names:
        if name not in KINDS:
            raise ValueError(f"`{field}`={name!r} is not a registered attention type: expected one of {sorted(KINDS)}.")
    return names


# `save_pretrained` writes `auto_map["AutoConfig"]` and copies this module with every sibling it imports, so a saved
# folder loads with `trust_remote_code=True` where longattn is not installed (the models do the same:
# modeling_longattn.py).
LongAttnConfig.register_for_auto_class()

__all__ = ["LongAttnConfig", "check_override_fields"]
