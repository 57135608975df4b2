"""The attention interface every kind implements, and what all kinds share.

Shape legend: b batch, h heads, n query length, m key length, d head dim, D hidden size.

A kind subclasses `LongAttnAttention` and declares:
- `attention_type`: its registry name, with a row in `attention_fields.KINDS` (its config fields with defaults,
  their checks and the back ends it runs on: `config_fields`, `validate_config`, `backends` come from there);
- `settings`: which of those fields it reads, as the attributes that hold them (`("window", "dilation")` reads
  `sliding_window` into `window` and `sliding_dilation` into `dilation`); the base's `__init__` sets them, this
  layer's value of each, before the kind's own `__init__` goes on;
- `attend`: the fast executor for a whole sequence (q, k, v -> out);
- `pattern`: the mask predicate that defines which keys a query sees, used by the dense path (cached decoding, where
  queries are the last positions, and `output_attentions`) and by pictures of the pattern. Content-based kinds, whose
  pattern depends on the input, override `attend_dense` instead.

Packed rows (`document_ids`, several documents per row): a kind with `supports_packing = True` takes a
`document_ids` keyword in `attend`, `attend_dense` and `pattern` (passed only when a batch is packed, so kinds that
cannot pack keep their signatures) and never lets a query see a key of another document; the base refuses packed
batches for the other kinds with a `ValueError`.

There is one `forward` (project, rotary, cache, attend, output projection). A kind that changes which keys exist
overrides `attention_inputs` (reduction: one key per group of tokens; Linformer: the length projected), and one
with its own attention over them overrides `attend_inputs` (Linformer's projected keys, the synthesizer's
synthesised scores).

Parameter names (`q_proj`, `k_proj`, `v_proj`, `o_proj`) are the same for every kind, so a checkpoint reloads under
another `attention_type` with only the kind-specific weights reported missing.

A layer with `relative_position_logits` also holds `relative_embedding` (an `nn.Embedding` of
2 · `relative_max_distance` + 1 rows of width d, shared by the heads as in Shaw et al. 2018); its kind passes
`relative_weight` to its executor (`relative_embedding=` of `longattn.ops`), and `attend_dense` adds the same
logits densely (`longattn.relative_logits`).
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from . import patterns
from .attention_fields import KINDS, check_kind_backend, field_defaults, validate_kind
from .backends import runs_dense_form
from .numerics import apply_rotary, default_scale
from .ops import reference_attention
from .patterns import MaskFn, and_masks, causal_mask, materialize_mask
from .relative_logits import materialize_bias, relative_bias


def _packing_kinds() -> list[str]:
    """The defined kinds that pack (`supports_packing`), for error messages."""
    kinds, pending = set(), list(LongAttnAttention.__subclasses__())
    while pending:
        cls = pending.pop()
        kinds.update([cls.attention_type] if cls.supports_packing else [])
        pending.extend(cls.__subclasses__())
    return sorted(kinds)


class LongAttnAttention(nn.Module):
    """Multi-head self-attention with a pluggable pattern; the base of every attention kind.

    Args:
        config: A `LongAttnConfig`.
        layer_idx: Index of the layer in its stack (per-layer config fields and the KV cache use it).
        is_causal: Causal self-attention (decoders).
    """

    attention_type: ClassVar[str] = ""
    config_fields: ClassVar[dict[str, Any]] = {}
    """The kind's own config fields and their defaults (from its row of `attention_fields.KINDS`)."""
    backends: ClassVar[tuple[str, ...]] = ("auto", "torch", "reference")
    """Values of `attention_backend` this kind runs on (from its row of `attention_fields.KINDS`)."""
    supports_packing: ClassVar[bool] = False
    """The kind keeps packed documents apart (takes `document_ids`); False: packed batches raise `ValueError`."""
    settings: ClassVar[tuple[str | tuple[str, str], ...]] = ()
    """The kind's config fields its layers hold: an attribute name reads the field `<attention_type>_<name>`, an
    (attribute, field) pair a field named otherwise. `__init__` sets each attribute to the layer's value of its field
    (`attention_fields.Field.layer_value`: a per-layer field's entry for `layer_idx`, a per-head one as a list, a
    number as a float)."""
    setting_fields: ClassVar[dict[str, str]] = {}
    """Attribute -> config field, as `settings` declares them (derived once per class)."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        # A kind's fields, back ends and checks are declared once, in the static table the configuration reads.
        super().__init_subclass__(**kwargs)
        if cls.attention_type not in KINDS:
            raise TypeError(
                f"{cls.__name__}: `attention_type`={cls.attention_type!r} has no row in `attention_fields.KINDS` "
                f"(its config fields, back ends and checks); expected one of {sorted(KINDS)}."
            )
        cls.config_fields = field_defaults(cls.attention_type)
        cls.backends = KINDS[cls.attention_type].backends
        cls.setting_fields = dict(
            item if isinstance(item, tuple) else (item, f"{cls.attention_type}_{item}") for item in cls.settings
        )
        unknown = sorted(set(cls.setting_fields.values()) - set(cls.config_fields))
        if unknown:
            raise TypeError(
                f"{cls.__name__}: `settings` reads {unknown}, which are not fields of `attention_type`="
                f"{cls.attention_type!r}; expected some of {sorted(cls.config_fields)}."
            )

    def __init__(self, config: Any, *, layer_idx: int, is_causal: bool):
        super().__init__()
        self.layer_idx = layer_idx
        self.is_causal = is_causal
        self.num_heads = config.num_attention_heads
        self.head_dim = config.hidden_size // config.num_attention_heads
        self.scale = default_scale(self.head_dim)
        self.dropout_p = config.attention_probs_dropout_prob
        # Kinds that dispatch pass it to `longattn.ops` (`backend=`); configs saved before the field mean "auto".
        self.backend = getattr(config, "attention_backend", "auto")
        self.q_proj = nn.Linear(config.hidden_size, config.hidden_size)
        self.k_proj = nn.Linear(config.hidden_size, config.hidden_size)
        self.v_proj = nn.Linear(config.hidden_size, config.hidden_size)
        self.o_proj = nn.Linear(config.hidden_size, config.hidden_size)
        # r of the relative-position logits: row δ + M for the distance j − i clipped to [−M, M]. An embedding, so
        # the model's `_init_weights` initialises it like every other table (normal, `initializer_range`).
        self.relative_embedding = None
        if getattr(config, "relative_position_logits", False) and config.per_layer(
            "relative_position_logits", layer_idx
        ):
            max_distance = config.per_layer("relative_max_distance", layer_idx)
            self.relative_embedding = nn.Embedding(2 * max_distance + 1, self.head_dim)
        fields = KINDS[self.attention_type].fields if self.setting_fields else {}
        for attribute, name in self.setting_fields.items():
            setattr(self, attribute, fields[name].layer_value(name, config, layer_idx))

    @property
    def relative_weight(self) -> Tensor | None:
        """r `[2M + 1, d]` of this layer's relative-position logits, or None when the layer has none."""
        return None if self.relative_embedding is None else self.relative_embedding.weight

    @property
    def active_dropout_p(self) -> float:
        """The attention dropout of this call: `dropout_p` in training, none in eval."""
        return self.dropout_p if self.training else 0.0

    def layer_arguments(self, *names: str) -> dict[str, Any]:
        """The executor keywords `names` as this layer fills them, so that every kind fills them alike: `causal`,
        `scale`, `dropout_p` (`active_dropout_p`), `backend` and `relative_embedding` (`relative_weight`)."""
        values = {
            "causal": self.is_causal,
            "scale": self.scale,
            "dropout_p": self.active_dropout_p,
            "backend": self.backend,
            "relative_embedding": self.relative_weight,
        }
        return {name: values[name] for name in names}

    # -------------------------------------------------------------- what a kind provides
    @classmethod
    def validate_config(cls, config: Any, *, layer_idx: int, is_causal: bool) -> None:
        """Check this kind's fields for layer `layer_idx`; raise `ValueError` naming field, value and allowed."""
        validate_kind(cls.attention_type, config, layer_idx=layer_idx, is_causal=is_causal)

    @classmethod
    def check_backend(cls, backend: str) -> None:
        """Raise `ValueError` when this kind cannot run on `backend` (the config's `attention_backend`), rather
        than quietly running it on another."""
        check_kind_backend(cls.attention_type, backend)

    @classmethod
    def length_multiple(cls, config: Any, *, layer_idx: int) -> int:
        """The length batches are best padded to a multiple of, for layer `layer_idx` (collators use it).

        Every executor accepts any length, so this is never required. A kind whose executor rounds the sequence up
        to whole blocks internally returns its block length: padding the batch there costs no extra work and keeps
        every batch on the whole-block path. Default 1 (padding would only add work).
        """
        return 1

    def attend(
        self, q: Tensor, k: Tensor, v: Tensor, *, key_padding_mask: Tensor | None, global_mask: Tensor | None
    ) -> Tensor:
        """The fast executor: q, k, v `[b, h, n, d]` -> `[b, h, n, d]`."""
        raise NotImplementedError

    def pattern(
        self,
        *,
        key_padding_mask: torch.Tensor | None,
        global_mask: torch.Tensor | None,
        document_ids: torch.Tensor | None = None,
    ) -> MaskFn:
        """Which keys each query sees, as a predicate over absolute positions (the default: all keys of the
        query's document)."""
        fns = [causal_mask()] if self.is_causal else []
        if key_padding_mask is not None:
            fns.append(patterns.key_padding_predicate(key_padding_mask))
        if document_ids is not None:
            fns.append(patterns.same_document_mask(document_ids))
        return and_masks(*fns)

    def reset_kind_parameters(self) -> None:
        """Initialise the kind's own parameters and buffers (called by the model's `_init_weights`, also when a
        checkpoint of another kind is loaded); use `transformers.initialization` so loaded weights are kept."""

    def auxiliary_loss(self) -> torch.Tensor | None:
        """A loss term the model adds to its training loss (e.g. adaptive span's L1 penalty); None if none."""
        return None

    # -------------------------------------------------------------- shared machinery
    def document_kwargs(self, document_ids: Tensor | None) -> dict[str, Tensor]:
        """`{"document_ids": document_ids}` for the kind's `attend` / `attend_dense` / `pattern`, `{}` without them.

        Raises:
            ValueError: `document_ids` is given and the kind cannot keep packed documents apart.
        """
        if document_ids is None:
            return {}
        if not self.supports_packing:
            raise ValueError(
                f"attention_type {self.attention_type!r} (layer {self.layer_idx}) cannot run packed documents "
                "(`position_ids` that restart, or `cu_seq_lens_q`/`cu_seq_lens_k`): its keys or state would mix the "
                "documents of a row. Pad each document to its own row instead, or use a kind that packs: "
                f"{_packing_kinds()}."
            )
        return {"document_ids": document_ids}

    def split_heads(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        return x.view(b, n, self.num_heads, self.head_dim).transpose(1, 2)  # [b, h, n, d]

    def merge_heads(self, x: torch.Tensor) -> torch.Tensor:
        b, _, n, _ = x.shape
        return x.transpose(1, 2).reshape(b, n, self.num_heads * self.head_dim)  # [b, n, D]

    def op_arguments(self) -> dict[str, Any]:
        """What every `longattn.ops` pattern function takes from the layer: `scale`, `dropout_p` (in training only),
        `backend` and the relative-position logits' `relative_embedding` (None without them)."""
        return self.layer_arguments("scale", "dropout_p", "backend", "relative_embedding")

    def project(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v `[b, h, n, d]` from hidden states `[b, n, D]` (LSH overrides this to share q and k)."""
        return (
            self.split_heads(self.q_proj(hidden_states)),
            self.split_heads(self.k_proj(hidden_states)),
            self.split_heads(self.v_proj(hidden_states)),
        )

    def attend_dense(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        *,
        key_padding_mask: Tensor | None,
        global_mask: Tensor | None,
        **documents: Tensor,
    ) -> tuple[Tensor, Tensor]:
        """Attention over all m keys for the n queries that are the *last* n positions, masked by `pattern`.

        Costs O(n * m): used for cached decoding (n is the number of new tokens) and when attention weights are
        requested (`output_attentions=True` materialises the `[b, h, n, m]` weights; that is what was asked for).
        """
        b, _, n, _ = q.shape
        m = k.shape[2]
        mask = materialize_mask(
            self.pattern(key_padding_mask=key_padding_mask, global_mask=global_mask, **documents),
            batch=b,
            heads=self.num_heads,
            q_len=n,
            kv_len=m,
            q_offset=m - n,
            device=q.device,
        )
        bias = None
        if self.relative_embedding is not None:
            bias_fn = relative_bias(q, self.relative_weight, scale=self.scale, kv_len=m)
            bias = materialize_bias(
                bias_fn, batch=b, heads=self.num_heads, q_len=n, kv_len=m, q_offset=m - n, device=q.device
            )  # [b, h, n, m]
        dropout_p = self.active_dropout_p
        return reference_attention(q, k, v, mask, scale=self.scale, dropout_p=dropout_p, return_weights=True, bias=bias)

    def attention_inputs(
        self,
        hidden_states: Tensor,
        *,
        key_padding_mask: Tensor | None,
        position_embeddings: tuple[Tensor, Tensor] | None,
    ) -> tuple[Tensor | None, Tensor, Tensor]:
        """The queries, and the keys and values they attend to, from the hidden states.

        By default one key and value per token, from `project`, rotated with the queries. A kind that changes which
        keys exist returns its own (reduction: one per group of tokens; Linformer: the length projected).

        Args:
            hidden_states: `[b, n, D]`.
            key_padding_mask: Bool over all tokens, True = real token: `[b, n]`, or `[b, m]` with a KV cache (cached
                tokens first; the kinds that read it, reduction and Linformer, have no causal form, so no cache);
                None = no padding.
            position_embeddings: rotary (cos, sin) `[b, n, d]`, or None with learned absolute positions.

        Returns:
            (q `[b, h, n, d]` or None for a kind whose scores need no queries, k `[b, h, m, d]`, v `[b, h, m, d]`).
        """
        q, k, v = self.project(hidden_states)  # [b, h, n, d]
        if position_embeddings is not None:
            q, k = apply_rotary(q, k, *position_embeddings)
        return q, k, v

    def attend_inputs(
        self,
        q: Tensor | None,
        k: Tensor,
        v: Tensor,
        *,
        hidden_states: Tensor,
        key_padding_mask: Tensor | None,
        global_mask: Tensor | None,
        dense: bool,
        **documents: Tensor,
    ) -> tuple[Tensor, Tensor | None]:
        """Attention over the keys and values of `attention_inputs` (with the cached ones before them).

        By default the fast executor `attend`, or the dense form `attend_dense` when `dense`. A kind with its own
        keys or its own scores (the synthesizer's synthesised logits) overrides this.

        Args:
            q: `[b, h, n, d]` or None; k, v: `[b, h, m, d]`.
            hidden_states: `[b, n, D]`, the layer's input (the tokens a kind may synthesise its scores from).
            key_padding_mask: `[b, m_tokens]` bool over the tokens (cached ones included), True = real token.
            global_mask: `[b, m_tokens]` bool, True = global token; None = none.
            dense: Return the weights too (`output_attentions`, cached decoding, the "reference" back end).
            **documents: `document_ids` `[b, m]` of packed rows, given only for a packed batch.

        Returns:
            (`[b, h, n, d]` output, weights `[b, h, n, m]` when `dense`, else None).
        """
        if dense:
            return self.attend_dense(q, k, v, key_padding_mask=key_padding_mask, global_mask=global_mask, **documents)
        return self.attend(q, k, v, key_padding_mask=key_padding_mask, global_mask=global_mask, **documents), None

    def forward(
        self,
        hidden_states: Tensor,
        *,
        attention_mask: Tensor | None = None,
        global_attention_mask: Tensor | None = None,
        position_embeddings: tuple[Tensor, Tensor] | None = None,
        past_key_values: Any = None,
        output_attentions: bool = False,
        document_ids: Tensor | None = None,
    ) -> tuple[Tensor, Tensor | None]:
        """Self-attention: the one forward of every kind (they state what differs in `attention_inputs`,
        `attend_inputs`, `attend` and `attend_dense`).

        Args:
            hidden_states: `[b, n, D]`.
            attention_mask: `[b, m]` bool, True = real token, over all keys (cached ones included); None = no padding.
            global_attention_mask: `[b, m]` bool, True = global token (kinds without global tokens ignore it).
            position_embeddings: rotary (cos, sin) `[b, n, d]`, or None with learned absolute positions.
            past_key_values: a transformers `Cache` (decoders), updated in place with this layer's keys and values.
            output_attentions: Also return the attention weights `[b, h, n, m]` (costs O(n * m)).
            document_ids: `[b, m]` integer, the document of each token of packed rows (contiguous runs of one id;
                `longattn.packing` derives them); None = one document per row.

        Returns:
            (`[b, n, D]` output, weights or None).

        Raises:
            ValueError: `document_ids` is given to a kind that cannot keep packed documents apart.
        """
        documents = self.document_kwargs(document_ids)
        if attention_mask is not None:
            # Padding may hold anything (NaN, inf). The kinds that sum, pool or project along the length (Linformer,
            # Sinkhorn's block sums, BP-Transformer's spans, ...) would carry it into real tokens, and 0 · NaN is NaN:
            # padded hidden states are replaced by zeros before any projection, once, for every kind.
            padded = ~attention_mask[:, -hidden_states.shape[1] :, None]  # [b, n, 1]; the cache's keys are older
            hidden_states = hidden_states.masked_fill(padded, 0.0)
        q, k, v = self.attention_inputs(
            hidden_states, key_padding_mask=attention_mask, position_embeddings=position_embeddings
        )
        decoding = False
        if past_key_values is not None:
            k, v = past_key_values.update(k, v, self.layer_idx)
            # Cached decoding: the n new queries are the last of m keys, which only the dense form takes.
            decoding = k.shape[2] != hidden_states.shape[1]
        out, weights = self.attend_inputs(
            q,
            k,
            v,
            hidden_states=hidden_states,
            key_padding_mask=attention_mask,
            global_mask=global_attention_mask,
            dense=output_attentions or decoding or runs_dense_form(self.backend),
            **documents,
        )
        return self.o_proj(self.merge_heads(out)), weights
