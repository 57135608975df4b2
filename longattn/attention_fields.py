"""Every attention kind's config fields, in one static table, and the checks that read it.

`KINDS` maps each registered attention name to its `KindSpec`: the fields it reads (default, type, allowed range or
values, one value or one per layer / per head), the back ends it runs on, whether it has a causal form, and the rules
between its fields. `LongAttnConfig` validates through this table alone, and every kind's class takes its
`config_fields`, `backends` and `validate_config` from its row (`LongAttnAttention.__init_subclass__`): one definition.

This module imports nothing from longattn and has no import side effects, so the configuration stands on the ground
floor: `import configuration_longattn` (a Hub folder's config, loaded with `trust_remote_code`) loads no kind, op or
executor. A Hub folder carries this file, as a sibling import of `configuration_longattn.py`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "BACKEND_NAMES",
    "KINDS",
    "LAYER_FIELDS",
    "Field",
    "KindSpec",
    "check_backend_name",
    "check_bool_field",
    "check_int_field",
    "check_kind_backend",
    "check_number",
    "field_defaults",
    "validate_kind",
]

BACKEND_NAMES = ("auto", "reference", "torch", "flex", "xformers", "triton")
"""Accepted values of `attention_backend` and of the `backend=` argument of `longattn.ops`."""

_PATTERN_BACKENDS = BACKEND_NAMES[:-1]  # the kinds whose pattern FlexAttention and xformers run; not the Triton band

EFFICIENT_NORMALIZATIONS = ("softmax", "scaling")
LINFORMER_SHARING = ("none", "headwise", "key_value", "layerwise")
SYNTHESIZER_MODES = ("dense", "random", "factorized_dense", "factorized_random")


# ---------------------------------------------------------------------------------------------- field checks
def check_backend_name(name: str, *, field: str = "backend") -> str:
    """Validate a back-end name (one of `BACKEND_NAMES`) and return it.

    Raises:
        ValueError: naming `field`, the value and `BACKEND_NAMES`.
    """
    if not isinstance(name, str) or name not in BACKEND_NAMES:
        raise ValueError(f"`{field}`={name!r} is unknown: expected one of {list(BACKEND_NAMES)}.")
    return name


def check_int_field(
    config: Any, field: str, layer_idx: int, *, minimum: int, per: str = "layer", optional: bool = False
) -> int | None:
    """Validate an integer field that holds one value or a list (one per layer / per head); return this layer's value.

    With `optional`, None is allowed as the value and as an entry of the list.

    Raises:
        ValueError: a list of the wrong length, a non-integer or a value below `minimum`.
    """
    value = getattr(config, field)
    expected = config.num_attention_heads if per == "head" else config.num_hidden_layers
    if optional and value is None:
        return None
    or_none = "None, " if optional else ""
    if isinstance(value, (list, tuple)):
        if len(value) != expected:
            raise ValueError(
                f"`{field}`={list(value)!r} has {len(value)} entries: expected {or_none}one integer or one per {per} "
                f"({expected})."
            )
        values = list(value)
    else:
        values = [value]
    for item in values:
        if optional and item is None:
            continue
        if not isinstance(item, int) or isinstance(item, bool) or item < minimum:
            raise ValueError(
                f"`{field}`={value!r} is invalid: expected {'None or ' if optional else ''}integers >= {minimum}."
            )
    return values[layer_idx] if per == "layer" and len(values) > 1 else values[0]


def check_bool_field(config: Any, field: str, layer_idx: int) -> bool:
    """Validate a boolean field that holds one bool or a list of one per layer; return this layer's value.

    Raises:
        ValueError: a list of the wrong length, or an entry that is not a bool.
    """
    value = getattr(config, field)
    expected = config.num_hidden_layers
    values = list(value) if isinstance(value, (list, tuple)) else [value]
    if isinstance(value, (list, tuple)) and len(values) != expected:
        raise ValueError(
            f"`{field}`={values!r} has {len(values)} entries: expected True, False or one bool per layer ({expected})."
        )
    if not all(isinstance(item, bool) for item in values):
        raise ValueError(f"`{field}`={value!r} is invalid: expected True, False or a list of one bool per layer.")
    return values[layer_idx] if len(values) > 1 else values[0]


def check_number(
    field: str,
    value: Any,
    *,
    minimum: float,
    maximum: float = math.inf,
    exclusive_minimum: bool = False,
    exclusive_maximum: bool = False,
    optional: bool = False,
) -> None:
    """Validate a real-valued field: an int or float (not a bool), finite, within [minimum, maximum] (bounds made
    exclusive on request); None too when `optional`.

    Raises:
        ValueError: naming the field, the value and the allowed range.
    """
    if optional and value is None:
        return
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if ok:
        ok = (value > minimum if exclusive_minimum else value >= minimum) and (
            value < maximum if exclusive_maximum else value <= maximum
        )
    if not ok:
        low = f"{'(' if exclusive_minimum else '['}{minimum:g}"
        high = "inf)" if maximum == math.inf else f"{maximum:g}{')' if exclusive_maximum else ']'}"
        or_none = " or None" if optional else ""
        raise ValueError(f"`{field}`={value!r} is invalid: expected a finite number in {low}, {high}{or_none}.")


@dataclass(frozen=True)
class Field:
    """One config field of an attention kind.

    Attributes:
        default: The value a config gets when it does not name the field.
        type: `"int"`, `"number"` (int or float, finite), `"bool"` or `"choice"` (one of `choices`).
        minimum: Smallest allowed value (`"int"`, `"number"`).
        maximum: Largest allowed value (`"number"`).
        exclusive_minimum: `minimum` itself is not allowed (`"number"`).
        exclusive_maximum: `maximum` itself is not allowed (`"number"`).
        per: `"layer"` or `"head"`: one integer or a list with one per layer / head (`"int"`; `"bool"` per layer
            too); `""`: one value.
        optional: None is allowed (for a per-layer integer, also as an entry of the list).
        choices: The allowed values (`"choice"`).
    """

    default: Any
    type: str
    minimum: float = 0
    maximum: float = math.inf
    exclusive_minimum: bool = False
    exclusive_maximum: bool = False
    per: str = ""
    optional: bool = False
    choices: tuple[str, ...] = ()

    def check(self, name: str, config: Any, layer_idx: int) -> Any:
        """Validate `config.<name>` and return its value for layer `layer_idx`.

        Raises:
            ValueError: naming the field, the value and what is allowed.
        """
        value = getattr(config, name)
        if self.type == "bool" and self.per == "layer":
            return check_bool_field(config, name, layer_idx)
        if self.type == "int" and self.per:
            return check_int_field(
                config, name, layer_idx, minimum=int(self.minimum), per=self.per, optional=self.optional
            )
        if self.optional and value is None:
            return None
        if self.type == "int":
            if not isinstance(value, int) or isinstance(value, bool) or value < self.minimum:
                allowed = f"{'None or ' if self.optional else ''}an integer >= {int(self.minimum)}"
                raise ValueError(f"`{name}`={value!r} is invalid: expected {allowed}.")
        elif self.type == "number":
            check_number(
                name,
                value,
                minimum=self.minimum,
                maximum=self.maximum,
                exclusive_minimum=self.exclusive_minimum,
                exclusive_maximum=self.exclusive_maximum,
            )
        elif self.type == "bool":
            if not isinstance(value, bool):
                raise ValueError(f"`{name}`={value!r} is invalid: expected True or False.")
        elif value not in self.choices:
            raise ValueError(f"`{name}`={value!r} is unknown: expected one of {list(self.choices)}.")
        return value

    def layer_value(self, name: str, config: Any, layer_idx: int) -> Any:
        """What a layer `layer_idx` holds of `config.<name>` (checked by `check` when the config was built): a
        per-layer field's entry for the layer, a per-head field's list (a copy) or its one value, a number as a
        float, any other value as it is."""
        value = getattr(config, name)
        if isinstance(value, (list, tuple)):
            return value[layer_idx] if self.per == "layer" else list(value)
        return float(value) if self.type == "number" and value is not None else value


Rule = Callable[[Any, int, bool], None]
"""A check between a kind's fields: `rule(config, layer_idx, is_causal)`, run after every field passed its own."""


@dataclass(frozen=True)
class KindSpec:
    """What an attention kind declares to the configuration.

    Attributes:
        fields: Its own config fields (flat, prefixed by the kind), in the order they are checked.
        backends: Values of `attention_backend` it runs on. Every kind has its PyTorch executor (`"torch"`, which
            `"auto"` uses where nothing faster serves it) and its dense form (`"reference"`); kinds whose pattern
            the GPU back ends compute add `"flex"` and / or `"xformers"`.
        no_causal_form: Why the kind cannot be causal (a decoder use is refused with this reason); "" if it can.
        no_relative_logits: Why the kind cannot add relative-position logits (`relative_position_logits` on one of
            its layers is refused with this reason); "" if it takes them on every pair it computes q·k for.
        rules: Checks between its fields.
    """

    fields: dict[str, Field] = field(default_factory=dict)
    backends: tuple[str, ...] = ("auto", "torch", "reference")
    no_causal_form: str = ""
    no_relative_logits: str = ""
    rules: tuple[Rule, ...] = ()


def _layer_value(config: Any, name: str, layer_idx: int) -> Any:
    value = getattr(config, name)
    return value[layer_idx] if isinstance(value, (list, tuple)) else value


def _linformer_one_length(config: Any, layer_idx: int, is_causal: bool) -> None:
    """Layerwise sharing holds one projection for every Linformer layer, so one projected length."""
    proj_len = config.linformer_proj_len
    if config.linformer_sharing == "layerwise" and isinstance(proj_len, (list, tuple)):
        lengths = {proj_len[i] for i, t in enumerate(config.layer_attention_types) if t == "linformer"}
        if len(lengths) > 1:
            raise ValueError(
                f"`linformer_proj_len`={list(proj_len)!r} differs between Linformer layers, but "
                f"`linformer_sharing`='layerwise' shares one projection: expected one length (got "
                f"{_layer_value(config, 'linformer_proj_len', layer_idx)} among {sorted(lengths)})."
            )


def _lsh_even_buckets(config: Any, layer_idx: int, is_causal: bool) -> None:
    buckets = _layer_value(config, "lsh_num_buckets", layer_idx)
    if buckets is not None and buckets % 2:
        raise ValueError(
            f"`lsh_num_buckets`={config.lsh_num_buckets!r} is invalid: expected even integers "
            "(a rotation gives buckets in ± pairs), or None."
        )


def _lsh_causal_band(config: Any, layer_idx: int, is_causal: bool) -> None:
    if is_causal and _layer_value(config, "lsh_num_chunks_before", layer_idx) < 1:
        raise ValueError(
            f"`lsh_num_chunks_before`={config.lsh_num_chunks_before!r} is invalid for a causal (decoder) LSH "
            "layer: a causal query sees the earlier keys of its bucket in a band of lsh_bucket_size · "
            "lsh_num_chunks_before, so expected >= 1."
        )


def _routing_one_head_routes(config: Any, layer_idx: int, is_causal: bool) -> None:
    if _layer_value(config, "routing_num_local_heads", layer_idx) >= config.num_attention_heads:
        raise ValueError(
            f"`routing_num_local_heads`={config.routing_num_local_heads!r} is invalid: expected fewer than "
            f"`num_attention_heads`={config.num_attention_heads}, so that at least one head routes."
        )


def _fixed_summary_in_block(config: Any, layer_idx: int, is_causal: bool) -> None:
    block_size = _layer_value(config, "fixed_block_size", layer_idx)
    if _layer_value(config, "fixed_num_summary", layer_idx) > block_size:
        raise ValueError(
            f"`fixed_num_summary`={config.fixed_num_summary!r} is invalid for layer {layer_idx}: expected "
            f"1 <= fixed_num_summary <= `fixed_block_size` (= {block_size}), the summary cells are part of a block."
        )


def _at_most_the_longest_sequence(field: str, why: str, *, factor: int = 1, minimum: int = 1) -> Rule:
    """A rule bounding a size that shapes a parameter or buffer (so it is allocated at construction, whatever the
    input) by what the longest sequence can use: `factor · max_position_embeddings` (no bound when the config
    states no length)."""

    def rule(config: Any, layer_idx: int, is_causal: bool) -> None:
        limit = getattr(config, "max_position_embeddings", None)
        value = _layer_value(config, field, layer_idx)
        if not isinstance(limit, int) or isinstance(limit, bool) or value is None or value <= factor * limit:
            return
        times = f"{factor} · " if factor != 1 else ""
        raise ValueError(
            f"`{field}`={getattr(config, field)!r} is invalid for layer {layer_idx}: expected integers in "
            f"[{minimum}, {factor * limit}] ({times}`max_position_embeddings`={limit}): {why}."
        )

    rule.__name__ = f"_{field}_bounded"
    return rule


def _deformable_levels_bounded(config: Any, layer_idx: int, is_causal: bool) -> None:
    """Level l pools cells of 2^l tokens: past the level whose one cell spans the longest sequence, every level is
    that same cell again (and its offsets, per level and point, are parameters)."""
    limit = getattr(config, "max_position_embeddings", None)
    if not isinstance(limit, int) or isinstance(limit, bool):
        return
    most = (limit - 1).bit_length() + 1  # ceil(log2(limit)) + 1
    if _layer_value(config, "deformable_levels", layer_idx) > most:
        raise ValueError(
            f"`deformable_levels`={config.deformable_levels!r} is invalid for layer {layer_idx}: expected integers in "
            f"[1, {most}] (ceil(log2(`max_position_embeddings`={limit})) + 1): level {most - 1} already pools the "
            "longest sequence into one cell."
        )


def _relative_logits_on(config: Any, layer_idx: int) -> bool:
    """Whether layer `layer_idx` has relative-position logits (validated `LAYER_FIELDS`; a config saved before them
    has none)."""
    if not hasattr(config, "relative_position_logits"):
        return False
    return check_bool_field(config, "relative_position_logits", layer_idx)


def _sortcut_no_relative_logits(config: Any, layer_idx: int, is_causal: bool) -> None:
    if _layer_value(config, "sinkhorn_sortcut", layer_idx) is not None and _relative_logits_on(config, layer_idx):
        raise ValueError(
            f"`relative_position_logits`={config.relative_position_logits!r} cannot be used with "
            f"`sinkhorn_sortcut`={config.sinkhorn_sortcut!r} (layer {layer_idx}): SortCut's keys are mixtures of "
            "blocks, with no position to measure a distance to. Allowed: sinkhorn_sortcut=None, or False for this "
            "layer."
        )


def _sortcut_not_causal(config: Any, layer_idx: int, is_causal: bool) -> None:
    if is_causal and _layer_value(config, "sinkhorn_sortcut", layer_idx) is not None:
        raise ValueError(
            f"`sinkhorn_sortcut`={config.sinkhorn_sortcut!r} has no causal form (decoder layers): every query would "
            "attend to sorted mixtures of the whole sequence, later tokens included. Use it in encoders only."
        )


_XFORMERS_BLOCKS = ("auto", "torch", "reference", "xformers")  # kinds whose inner dense step xformers runs


def _positive_int(default: Any, *, per: str = "layer", minimum: int = 1, optional: bool = False) -> Field:
    return Field(default, "int", minimum=minimum, per=per, optional=optional)


# `backends=_PATTERN_BACKENDS`: the kind passes `backend=` to `longattn.ops`, whose dispatcher runs it on every back end
# but the Triton kernels, which compute the sliding window only.
KINDS: dict[str, KindSpec] = {
    "adaptive_span": KindSpec(
        {
            "adaptive_span_max": _positive_int(1024),
            "adaptive_span_ramp": _positive_int(32, per=""),
            "adaptive_span_loss_coef": Field(2e-6, "number"),
        },
        no_relative_logits="its banded kernel (the soft span mask) takes no logit bias: not implemented",
    ),
    "binary_partition": KindSpec(
        {"binary_partition_context": _positive_int(4)},
        rules=(
            _at_most_the_longest_sequence(
                "binary_partition_context",
                "its learned bias has a column per (side, level, offset) edge type, and a context of n - 1 already "
                "shows every token of an n-token sequence at level 0",
            ),
        ),
    ),
    "deformable": KindSpec(
        {"deformable_levels": _positive_int(4), "deformable_points": _positive_int(4)},
        rules=(
            _deformable_levels_bounded,
            _at_most_the_longest_sequence(
                "deformable_points",
                "each point has its own offset and weight outputs per head and level, and a query has no more "
                "distinct positions to sample than the longest sequence holds",
            ),
        ),
        no_causal_form="a pooled level averages later tokens and interpolation reads the next cell, so a decoder "
        "would see the future",
        no_relative_logits="its weights come from a linear map of the query and one softmax over sampling points, "
        "not from q·k logits of key pairs",
    ),
    "efficient": KindSpec(
        {"efficient_normalization": Field("softmax", "choice", choices=EFFICIENT_NORMALIZATIONS)},
        no_relative_logits="it computes Q (Kᵀ V) and never forms a logit per (query, key) pair",
    ),
    "full": KindSpec(backends=_PATTERN_BACKENDS),
    "linformer": KindSpec(
        {
            "linformer_proj_len": _positive_int(256),
            "linformer_sharing": Field("headwise", "choice", choices=LINFORMER_SHARING),
        },
        no_causal_form="projecting the length mixes every position into every projected key, so a decoder would "
        "see the future",
        no_relative_logits="its keys are projections of the whole length, with no position to measure a distance to",
        rules=(
            _linformer_one_length,
            _at_most_the_longest_sequence(
                "linformer_proj_len",
                "its projections E, F hold max_position_embeddings x heads · k entries, and projecting n tokens to "
                "more than n rows adds no information",
            ),
        ),
    ),
    "sliding": KindSpec(
        {"sliding_window": _positive_int(256), "sliding_dilation": _positive_int(1, per="head")},
        backends=BACKEND_NAMES,  # the Triton kernels included
    ),
    "lsh": KindSpec(
        {
            "lsh_num_hashes": _positive_int(2),
            "lsh_bucket_size": _positive_int(64),
            "lsh_num_buckets": _positive_int(None, minimum=2, optional=True),
            "lsh_num_chunks_before": _positive_int(1, minimum=0),
            "lsh_num_chunks_after": _positive_int(0, minimum=0),
            "lsh_seed": Field(None, "int", optional=True),
        },
        backends=_XFORMERS_BLOCKS,
        rules=(
            _lsh_even_buckets,
            _lsh_causal_band,
            _at_most_the_longest_sequence(
                "lsh_num_buckets",
                "each layer keeps rotations with a column per two buckets, and n tokens fill at most n of them",
                factor=2,
                minimum=2,
            ),
        ),
    ),
    "reduction": KindSpec(
        {"reduction_ratio": _positive_int(8)},
        no_causal_form="each reduced key mixes R consecutive tokens, so a decoder would see later tokens",
        no_relative_logits="each key pools R tokens, so it has no single position to measure a distance to",
        rules=(
            _at_most_the_longest_sequence(
                "reduction_ratio",
                "its projection `reduction_proj` is a Linear(R · hidden_size, hidden_size), and a group longer than "
                "the longest sequence holds only zeros past it",
            ),
        ),
    ),
    "strided": KindSpec({"strided_stride": _positive_int(128)}, backends=_PATTERN_BACKENDS),
    "fixed": KindSpec(
        {
            "fixed_block_size": _positive_int(128),
            "fixed_num_summary": _positive_int(8),
            "fixed_summary_per_head": Field(False, "bool"),
        },
        backends=_PATTERN_BACKENDS,
        rules=(_fixed_summary_in_block,),
    ),
    "routing": KindSpec(
        {
            "routing_num_clusters": _positive_int(64),
            "routing_num_local_heads": _positive_int(0, minimum=0),
            "routing_local_window": _positive_int(128),
            "routing_causal_window": _positive_int(None, optional=True),
            "routing_ema_decay": Field(0.999, "number", maximum=1.0, exclusive_maximum=True),
        },
        backends=_XFORMERS_BLOCKS,
        rules=(
            _routing_one_head_routes,
            _at_most_the_longest_sequence(
                "routing_num_clusters",
                "the centroids are a buffer [heads, C, head_dim], and more clusters than tokens leave clusters of "
                "one query and one key",
            ),
        ),
    ),
    "sinkhorn": KindSpec(
        {
            "sinkhorn_block_size": _positive_int(64),
            "sinkhorn_iterations": _positive_int(5),
            "sinkhorn_temperature": Field(0.75, "number", exclusive_minimum=True),
            "sinkhorn_sortcut": _positive_int(None, optional=True),
        },
        backends=_XFORMERS_BLOCKS,
        rules=(_sortcut_not_causal, _sortcut_no_relative_logits),
    ),
    "synthesizer": KindSpec(
        {
            "synthesizer_mode": Field("dense", "choice", choices=SYNTHESIZER_MODES),
            "synthesizer_random_trainable": Field(True, "bool"),
            "synthesizer_factor_k": _positive_int(8, per=""),
            "synthesizer_mix": Field(False, "bool"),
        },
        no_relative_logits="its weights are synthesised from each token alone (or learned), without q·k logits",
        rules=(
            _at_most_the_longest_sequence(
                "synthesizer_factor_k",
                "its factor layers and tables have a column per head and factor, and a factor (or rank) above the "
                "length adds nothing",
            ),
        ),
    ),
}
"""Attention name -> what the kind declares. The registry (`attention_registry`) holds one class per row."""

LAYER_FIELDS: dict[str, Field] = {
    "relative_position_logits": Field(False, "bool", per="layer"),
    "relative_max_distance": _positive_int(16),
}
"""Fields of every attention layer, whatever its kind: relative-position logits (`longattn.relative_logits`), one
value or one per layer. A layer with `relative_position_logits` holds r `[2 · relative_max_distance + 1, head_dim]`
and adds q·r of the clipped distance to the logits of the pairs its pattern keeps; a kind whose row states
`no_relative_logits` refuses it."""


def field_defaults(name: str | None = None) -> dict[str, Any]:
    """The default of each field of kind `name`, or of every kind's fields and the `LAYER_FIELDS` when `name` is
    None."""
    specs = KINDS.values() if name is None else [KINDS[name]]
    defaults = {field_name: spec_field.default for spec in specs for field_name, spec_field in spec.fields.items()}
    if name is None:
        defaults.update({field_name: spec_field.default for field_name, spec_field in LAYER_FIELDS.items()})
    return defaults


def validate_kind(name: str, config: Any, *, layer_idx: int, is_causal: bool) -> None:
    """Check kind `name`'s fields for layer `layer_idx` of `config` (a causal layer when `is_causal`).

    Raises:
        ValueError: naming the field, the value and what is allowed (or why the kind has no causal form).
    """
    spec = KINDS[name]
    if is_causal and spec.no_causal_form:
        raise ValueError(
            f"`attention_type`={name!r} cannot be causal: {spec.no_causal_form}. Use it in encoders; for decoders "
            "pick a kind with a causal form (e.g. 'full', 'sliding', 'efficient')."
        )
    for field_name, spec_field in spec.fields.items():
        spec_field.check(field_name, config, layer_idx)
    if hasattr(config, "relative_position_logits"):  # configs saved before these fields have none
        for field_name, spec_field in LAYER_FIELDS.items():
            spec_field.check(field_name, config, layer_idx)
    for rule in spec.rules:
        rule(config, layer_idx, is_causal)
    _check_relative_logits(name, config, layer_idx)


def _check_relative_logits(name: str, config: Any, layer_idx: int) -> None:
    """Whether the kind and the back end of layer `layer_idx` take its relative-position logits, if it has them."""
    if not _relative_logits_on(config, layer_idx):
        return
    reason = KINDS[name].no_relative_logits
    if reason:
        takes = sorted(kind for kind, spec in KINDS.items() if not spec.no_relative_logits)
        raise ValueError(
            f"`relative_position_logits`={config.relative_position_logits!r} asks for relative-position logits on "
            f"layer {layer_idx}, whose `attention_type`={name!r} cannot add them: {reason}. Allowed: False for this "
            f"layer, or one of {takes}."
        )
    _at_most_the_longest_sequence(
        "relative_max_distance",
        "the table r has 2M + 1 rows, and no distance between two tokens exceeds the longest sequence",
    )(config, layer_idx, False)
    backend = getattr(config, "attention_backend", "auto")
    why_not = {
        "xformers": "xformers takes only a dense [b, h, n, n] bias, the table the sparse kinds avoid",
        "triton": "the Triton band kernels take no logit bias",
    }
    if backend in why_not:
        raise ValueError(
            f"`attention_backend`={backend!r} cannot run `relative_position_logits` (layer {layer_idx}): "
            f"{why_not[backend]}. Use 'auto', 'torch', 'flex' or 'reference'."
        )


def check_kind_backend(name: str, backend: str) -> None:
    """Raise `ValueError` when kind `name` cannot run on `backend` (the config's `attention_backend`), rather than
    quietly running it on another."""
    backends = KINDS[name].backends
    if backend not in backends:
        raise ValueError(
            f"`attention_backend`={backend!r} cannot run `attention_type`={name!r}: this kind runs "
            f"on {', '.join(repr(item) for item in backends)} ('reference' is its dense form). Use 'auto' to "
            "let every layer take the fastest back end it has."
        )
