"""`LongAttnConfig`: the one configuration of every longattn model, validated in one place.

Common transformer fields follow BERT/LED naming. Attention-kind fields are flat and prefixed by the kind
(`sliding_window`, `lsh_num_hashes`, ...): each kind declares its own fields and defaults next to its module
(`config_fields` on the attention class), and the registry collects them here, so that
`LongAttnConfig(attention_type=name)` works alone for every registered kind.
"""

from __future__ import annotations

from typing import Any

from transformers import PreTrainedConfig

from .attention_registry import ATTENTION_CLASSES, attention_class, available_attention_types
from .backends import check_backend_name

POSITION_EMBEDDING_TYPES = ("rope", "learned")


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
        is_decoder: A causal decoder (set by `LongAttnForCausalLM`).
        attention_backend: Which kernels compute the attention of the kinds that dispatch (`"sliding"`, `"full"`,
            `"strided"`, `"fixed"`): `"auto"` (default; the fastest that can run: xformers, then FlexAttention on
            CUDA, else the PyTorch executors), `"torch"`, `"flex"`, `"xformers"` or `"reference"` (see
            `longattn.backends`). An explicit back end that cannot run a layer's call raises with the reasons.
            The other kinds run on `"auto"`, `"torch"` (their own executor) or `"reference"` (their dense form);
            naming `"flex"` or `"xformers"` for them is a `ValueError` here, not a silent fallback.
        **kwargs: Attention-kind fields (see each kind's `config_fields`) and `PreTrainedConfig` fields.

    Raises:
        ValueError: a field outside its allowed values; the message names the field, the value and what is allowed.
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
        self.is_decoder = is_decoder
        self.attention_backend = attention_backend
        self.use_cache = use_cache
        # Every registered kind's own fields, with their defaults, so any kind works from its name alone.
        for kind_class in ATTENTION_CLASSES.values():
            for field, default in kind_class.config_fields.items():
                setattr(self, field, kwargs.pop(field, default))
        super().__init__(
            pad_token_id=pad_token_id,
            bos_token_id=bos_token_id,
            eos_token_id=eos_token_id,
            decoder_start_token_id=bos_token_id if decoder_start_token_id is None else decoder_start_token_id,
            tie_word_embeddings=tie_word_embeddings,
            **kwargs,
        )
        self.validate_longattn()

    # ------------------------------------------------------------------ per-layer views
    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

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
    def validate_longattn(self) -> None:
        """Check every field; raise `ValueError` naming the field, the value and what is allowed."""
        for field in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
                      "max_position_embeddings", "num_decoder_layers"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"`{field}`={value!r} is invalid: expected an integer >= 1.")
        if self.hidden_size % self.num_attention_heads != 0:
            raise ValueError(
                f"`num_attention_heads`={self.num_attention_heads} must divide `hidden_size`={self.hidden_size}."
            )
        for field in ("hidden_dropout_prob", "attention_probs_dropout_prob"):
            value = getattr(self, field)
            if not 0.0 <= value < 1.0:
                raise ValueError(f"`{field}`={value!r} is invalid: expected a probability in [0, 1).")
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
            attention_class(name).validate_config(self, layer_idx=layer_idx, is_causal=encoder_is_causal)
            attention_class(name).check_backend(self.attention_backend)
        if self.is_encoder_decoder:
            for layer_idx, name in enumerate(decoder_types):
                attention_class(name).validate_config(self, layer_idx=layer_idx, is_causal=True)
                attention_class(name).check_backend(self.attention_backend)


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
        if name not in ATTENTION_CLASSES:
            raise ValueError(
                f"`{field}`={name!r} is not a registered attention type: expected one of {available_attention_types()}."
            )
    return names


__all__ = ["LongAttnConfig"]
