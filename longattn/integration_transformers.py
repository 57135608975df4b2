"""longattn's attention kinds inside stock transformers models, through `AttentionInterface`.

Shape legend: b batch, h query heads, h_kv key/value heads, n query length, m key length, d head dim.

Importing this module registers the implementation `"longattn"` with transformers' `AttentionInterface` and its mask
function with `AttentionMaskInterface`; after `import longattn` that happens by itself before it can be needed (when
transformers imports a supported family's modeling module, or longattn's models are used: `longattn._registration`).
A stock model (BERT, RoBERTa, XLM-RoBERTa, ELECTRA, GPT-2, OPT, Llama, Mistral, Qwen2, Qwen3, Phi-3, Gemma, BART:
`SUPPORTED_ATTENTION_CLASSES`) runs longattn's kinds when its config holds a `longattn` dict and its
`attn_implementation` is `"longattn"`:

    model = AutoModel.from_pretrained("roberta-base")
    longattn.apply_longattn(model, attention_type="sliding", sliding_window=256)
    model(input_ids, attention_mask=mask, global_attention_mask=globals_)   # global tokens: a forward kwarg
    model.save_pretrained(out)            # config.json keeps "attn_implementation" and the "longattn" dict
    AutoModel.from_pretrained(out)        # after `import longattn`: same kinds, same parameters

The `longattn` dict holds the fields of `LongAttnConfig` that choose and shape the kinds: `attention_type` (one
name or one per layer), `decoder_attention_type` (the causal self-attention of an encoder-decoder's decoder;
default "full"), `attention_backend`, each kind's own fields (`sliding_window`, `sliding_dilation`, ...) and the
relative-position logits of every layer (`relative_position_logits`, `relative_max_distance`: a table r per layer,
zero when attached, so the pretrained attention is unchanged until fine-tuning moves it). They
are validated by building a `LongAttnConfig` from them with the model's geometry (heads, head dim, layers,
`max_position_embeddings`), so they fail with the same `ValueError`s; an unknown field is a `ValueError` too.

Where the kinds' parameters live: each self-attention module gets its kind as a submodule, `<attention>.longattn`
(its projections removed: the stock module keeps its own), so they are saved and loaded like any other weight.
They are attached

- by `apply_longattn(model, **fields)` on a built model (the entry point for lengthening a checkpoint), and
- when a model is built by `from_pretrained` or `from_config` (Auto classes included) from a config that holds a
  `longattn` dict and names the implementation: this module registers a build hook for each supported
  attention class through transformers' patch mapping (`transformers.monkey_patching`), which those two
  constructors apply. The hook returns the stock module itself, its kind attached; models without a `longattn`
  dict are built unchanged.

Generation: `model.generate(input_ids, global_attention_mask=...)` makes those prompt tokens global (`import
longattn` lets `generate` accept the keyword for models that run the kinds); tokens generated later are not global.
Switching implementation: `set_attn_implementation` keeps the `attn_implementation` that `save_pretrained` writes
equal to the one in use, and refuses to leave `"longattn"` while a kind holds parameters. Training: a stock head's
loss does not include the kinds' auxiliary losses (adaptive span's penalty): add `auxiliary_loss(model)`.

Any other construction (`RobertaModel(config)` on such a config) builds stock modules without kinds; their first
forward raises a `ValueError` that says what to call, never runs a model whose kind parameters are missing.

Cost: the kinds run through the same `longattn.ops` executors and back ends as longattn's own models; the mask
function returns the `[b, m]` padding mask, never an `[n, m]` mask, and a sparse kind never builds an `[n, m]` score
matrix (cached decoding and `output_attentions=True` use the kind's dense form over the n new queries, like the
native stack).

Not supported (each a `ValueError` naming the family or kind and why): families whose layers never call the
registered function (DeBERTa-v2), attentions that add a dense bias to the scores (T5's `position_bias`), families
outside `SUPPORTED_ATTENTION_CLASSES`, the kinds `reduction` and `deformable` and the dense and factorized-dense
synthesizer (they need the layer's hidden states, which the interface does not pass), `lsh` (shared queries and
keys: a stock model has separate q and k projections), Linformer's `layerwise` sharing, a user's 4-D attention
mask with a sparse kind, packed documents (restarting `position_ids` or the varlen keywords, as
`DataCollatorWithFlattening` produces) with a kind that cannot pack them (Linformer, synthesizer, adaptive span,
BP-Transformer, SortCut; the other kinds attend within each document).
"""

from __future__ import annotations

import functools
import inspect
import logging
from typing import Any

import torch
from torch import nn
from transformers import AttentionInterface, GenerationMixin, PreTrainedModel
from transformers import initialization as init
from transformers.integrations.sdpa_attention import repeat_kv
from transformers.masking_utils import AttentionMaskInterface, prepare_padding_mask
from transformers.monkey_patching import get_patch_mapping, register_patch_mapping

from .attention_base import LongAttnAttention
from .attention_fields import LAYER_FIELDS
from .attention_registry import ATTENTION_CLASSES, attention_class
from .backends import runs_dense_form
from .configuration_longattn import LongAttnConfig, check_override_fields
from .numerics import default_scale
from .ops import full_attention
from .ops_checks import check_input_mask
from .packing import packed_document_ids

logger = logging.getLogger(__name__)

ATTN_IMPLEMENTATION = "longattn"
"""The name registered with `AttentionInterface` and `AttentionMaskInterface`."""

SUPPORTED_ATTENTION_CLASSES = {
    "BertSelfAttention": "bert",
    "RobertaSelfAttention": "roberta",
    "XLMRobertaSelfAttention": "xlm_roberta",
    "ElectraSelfAttention": "electra",
    "GPT2Attention": "gpt2",
    "OPTAttention": "opt",
    "LlamaAttention": "llama",
    "MistralAttention": "mistral",
    "Qwen2Attention": "qwen2",
    "Qwen3Attention": "qwen3",
    "Phi3Attention": "phi3",
    "GemmaAttention": "gemma",
    "BartAttention": "bart",
}
"""The stock attention classes (and their `transformers.models` package) whose modules receive a kind: at
`from_pretrained` / `from_config` through the patch mapping, and in `apply_longattn`. Each calls the attention
interface with q, k, v and a mask only, and each is tested against `sdpa`."""

REFUSED_KINDS = {
    "reduction": "it pools the layer's hidden states into memory keys, which the attention interface does not pass "
    "(it receives q, k and v only)",
    "deformable": "it reads its sampling offsets and weights from the layer's hidden states, which the attention "
    "interface does not pass (it receives q, k and v only)",
    "lsh": "it hashes shared queries and keys (one projection), while a stock model has separate q and k projections",
}

_GENERAL_FIELDS = ("attention_type", "decoder_attention_type", "attention_backend")
# Fields of every layer whatever its kind, passed to the stack's `LongAttnConfig` with the kinds' own.
_LAYER_FIELDS = tuple(LAYER_FIELDS)
_KIND_MODULE_NAME = "longattn"


def allowed_fields() -> list[str]:
    """The keys a `longattn` dict may hold: the general fields and every registered kind's own fields."""
    kind_fields = {field for kind in ATTENTION_CLASSES.values() for field in kind.config_fields}
    return sorted(set(_GENERAL_FIELDS) | set(_LAYER_FIELDS) | kind_fields)


# ------------------------------------------------------------------------------------------ config of the kinds
def _check_fields(fields: dict[str, Any]) -> None:
    check_override_fields(
        fields,
        allowed_fields(),
        where="`longattn` dict",
        hint=" (LongAttnConfig's fields: `longattn.integration_transformers.allowed_fields()`)",
    )
    names = _kind_names(fields)
    refused = sorted(names & set(REFUSED_KINDS))
    if refused:
        name = refused[0]
        raise ValueError(f"`attention_type`={name!r} cannot run in a stock transformers model: {REFUSED_KINDS[name]}.")
    if "synthesizer" in names and fields.get("synthesizer_mode", "dense") in ("dense", "factorized_dense"):
        raise ValueError(
            f"`synthesizer_mode`={fields.get('synthesizer_mode', 'dense')!r} cannot run in a stock transformers model: "
            "the dense forms synthesise the weights from the layer's hidden states, which the attention interface "
            "does not pass (it receives q, k and v only). Use 'random' or 'factorized_random'."
        )
    if fields.get("linformer_sharing") == "layerwise":
        raise ValueError(
            "`linformer_sharing`='layerwise' is not supported in stock models (one projection shared across layers "
            "would be owned by one layer's attention module): use 'headwise', 'key_value' or 'none'."
        )


def _kind_names(fields: dict[str, Any]) -> set[str]:
    """Every kind named by `attention_type` and `decoder_attention_type` (one name or one per layer)."""
    names = set()
    for key in ("attention_type", "decoder_attention_type"):
        value = fields.get(key, [])
        names.update(value if isinstance(value, (list, tuple)) else [value])
    return names


def _stack_geometry(config: Any, stack: str) -> tuple[int, int, int]:
    """(layers, query heads, head dim) of a stack: "decoder" is an encoder-decoder's decoder, else the main stack."""
    if stack == "decoder":
        layers = getattr(config, "decoder_layers", None) or config.num_hidden_layers
        heads = getattr(config, "decoder_attention_heads", None) or config.num_attention_heads
    else:
        layers, heads = config.num_hidden_layers, config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return layers, heads, head_dim


def kind_config(config: Any, stack: str, *, is_causal: bool, fields: dict[str, Any] | None = None) -> LongAttnConfig:
    """The `LongAttnConfig` that feeds the kinds of one stack of a stock model (and validates its `longattn` dict).

    Args:
        config: The stock model's config.
        stack: `"decoder"` for the self-attention of an encoder-decoder's decoder (`decoder_attention_type`), else
            `"encoder"` / `"self"` (`attention_type`).
        is_causal: The stack's self-attention is causal.
        fields: The `longattn` dict; default `config.longattn`.

    Raises:
        ValueError: an unknown or refused field, or any field `LongAttnConfig` rejects.
    """
    fields = dict(config.longattn if fields is None else fields)
    _check_fields(fields)
    layers, heads, head_dim = _stack_geometry(config, stack)
    kind_fields = {key: value for key, value in fields.items() if key not in _GENERAL_FIELDS}
    attention_type = (
        fields.get("decoder_attention_type", "full") if stack == "decoder" else fields.get("attention_type", "sliding")
    )
    return LongAttnConfig(
        hidden_size=heads * head_dim,
        num_attention_heads=heads,
        num_hidden_layers=layers,
        max_position_embeddings=getattr(config, "max_position_embeddings", None) or 4096,
        attention_probs_dropout_prob=0.0,  # the stock module passes its dropout with each call
        attention_type=attention_type,
        attention_backend=fields.get("attention_backend", "auto"),
        is_decoder=is_causal,
        **kind_fields,
    )


# ------------------------------------------------------------------------------------------ attention modules
def _role(module: nn.Module) -> str:
    """ "cross" (decoder-to-encoder), "decoder" (an encoder-decoder's decoder self-attention), "encoder" (its
    encoder's) or "self" (the one stack of an encoder or decoder-only model)."""
    if getattr(module, "is_cross_attention", False) or "Cross" in type(module).__name__:
        return "cross"
    if getattr(getattr(module, "config", None), "is_encoder_decoder", False):
        # BART's three uses of one class: the decoder's cross-attention is a decoder module that is not causal.
        if getattr(module, "is_decoder", False) and not getattr(module, "is_causal", False):
            return "cross"
        return "decoder" if getattr(module, "is_causal", False) else "encoder"
    return "self"


def _attach(module: nn.Module, fields: dict[str, Any] | None = None) -> None:
    """Give a self-attention `module` its kind as the submodule `longattn` (cross-attention stays full)."""
    role = _role(module)
    if role == "cross":
        return
    is_causal = bool(getattr(module, "is_causal", False))
    config = kind_config(module.config, role, is_causal=is_causal, fields=fields)
    kind = _stock_kind_class(attention_class(config.layer_attention_types[module.layer_idx]))(
        config, layer_idx=module.layer_idx, is_causal=is_causal
    )
    # The stock module projects q, k, v and the output itself.
    for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
        if name in kind._modules:
            del kind._modules[name]
    if kind.relative_embedding is not None:
        # Zero logits: the pretrained attention is kept exactly until fine-tuning moves the table.
        nn.init.zeros_(kind.relative_embedding.weight)
    reference = next(module.parameters(), None)
    if reference is not None and reference.device.type != "meta":
        kind.to(device=reference.device, dtype=reference.dtype)
    module.add_module(_KIND_MODULE_NAME, kind)


_STOCK_KIND_CLASSES: dict[type, type] = {}


def _stock_kind_class(kind_class: type[LongAttnAttention]) -> type[LongAttnAttention]:
    """`kind_class` whose own parameters a stock model initialises when a checkpoint lacks them.

    `from_pretrained` builds the model on the meta device and, for every module, asks `_is_hf_initialized` before
    calling the stock `_init_weights`, which knows nothing of a kind's own tensors (adaptive span's spans, routing's
    centroids would stay uninitialised memory). Answering that question runs `reset_kind_parameters` first; it goes
    through `transformers.initialization`, which keeps the tensors loaded from the checkpoint.
    """
    if kind_class not in _STOCK_KIND_CLASSES:

        def get_initialized(self) -> bool:
            if not self.__dict__.get("_longattn_initialized", False):
                if all(t.device.type != "meta" for t in (*self.parameters(), *self.buffers())):
                    self.reset_kind_parameters()
            return self.__dict__.get("_longattn_initialized", False)

        def set_initialized(self, value: bool) -> None:
            self.__dict__["_longattn_initialized"] = value

        def reset_kind_parameters(self) -> None:
            kind_class.reset_kind_parameters(self)
            if self.relative_embedding is not None:
                # Zero logits, as `_attach` starts them: the stock `_init_weights` would draw the table like a word
                # embedding and change the pretrained attention. The flag keeps it from doing so afterwards.
                init.zeros_(self.relative_embedding.weight)
                self.relative_embedding._is_hf_initialized = True

        _STOCK_KIND_CLASSES[kind_class] = type(
            kind_class.__name__,
            (kind_class,),
            {
                "_is_hf_initialized": property(get_initialized, set_initialized),
                "reset_kind_parameters": reset_kind_parameters,
                "__module__": kind_class.__module__,
            },
        )
    return _STOCK_KIND_CLASSES[kind_class]


def _family(module_or_model: nn.Module) -> str:
    return type(module_or_model).__name__


def _calls_attention_interface(cls: type) -> bool:
    try:
        source = inspect.getsource(cls.forward)
    except (OSError, TypeError):
        return False
    return "ALL_ATTENTION_FUNCTIONS" in source


def _self_attention_modules(model: nn.Module) -> list[nn.Module]:
    """The modules of `model` that get a kind; raises `ValueError` for families that cannot run one."""
    family = _family(model)
    supported = [m for m in model.modules() if _original_class(type(m)).__name__ in SUPPORTED_ATTENTION_CLASSES]
    if supported:
        return [m for m in supported if _role(m) != "cross"]
    callers = {
        type(m)
        for m in model.modules()
        if type(m).__module__.startswith("transformers.models") and _calls_attention_interface(type(m))
    }
    if not callers:
        raise ValueError(
            f"{family} cannot run longattn attention: its layers never call transformers' AttentionInterface (they "
            "compute attention themselves), so the registered implementation would never run."
        )
    if any("position_bias" in inspect.getsource(cls.forward) for cls in callers):
        raise ValueError(
            f"{family} cannot run longattn attention: its attention adds a dense position bias (`position_bias`, "
            "one score per query-key pair) to the scores, which a sparse kind cannot take without an n x n matrix."
        )
    raise ValueError(
        f"{family} is not a supported family: its attention classes {sorted(c.__name__ for c in callers)} are not "
        f"among {list(SUPPORTED_ATTENTION_CLASSES)}, whose kinds longattn rebuilds when a saved model is loaded."
    )


def _configure_cache(model: nn.Module) -> None:
    """Make transformers' cache follow the `longattn` dict (it wins over a model's own `sliding_window`).

    A plain causal sliding window (every layer "sliding", no dilation, one window) bounds the cache: transformers
    counts the current token in its window (`sliding_window` = keys seen), longattn does not (`sliding_window` =
    earlier keys seen), hence window + 1. Any other kind, dilation or encoder-decoder keeps full cache layers
    (correct, never truncated), so a model's own `sliding_window` (Mistral's default 4096) is cleared.
    """
    config = model.config
    causal = _is_causal_lm(model)
    if not causal and not hasattr(config, "sliding_window"):
        return
    window = _bounded_cache_window(config) if causal else None
    config.sliding_window = window
    if getattr(config, "layer_types", None) is not None:
        config.layer_types = ["sliding_attention" if window else "full_attention"] * config.num_hidden_layers
        for module in model.modules():
            if hasattr(module, "has_sliding_layers"):
                module.has_sliding_layers = window is not None
    if hasattr(config, "use_sliding_window"):
        config.use_sliding_window = window is not None


def _bounded_cache_window(config: Any) -> int | None:
    """transformers' `sliding_window` for a causal stack whose every layer is one plain window, else None."""
    kinds = kind_config(config, "self", is_causal=True)
    windows = {kinds.per_layer("sliding_window", i) for i in range(kinds.num_hidden_layers)}
    dilation = kinds.sliding_dilation
    dilations = set(dilation) if isinstance(dilation, (list, tuple)) else {dilation}
    if set(kinds.layer_attention_types) == {"sliding"} and len(windows) == 1 and dilations == {1}:
        return windows.pop() + 1
    return None


def _is_causal_lm(model: nn.Module) -> bool:
    """A decoder-only model (or BERT-like decoder): its one stack of self-attention is causal."""
    return any(getattr(m, "is_causal", False) and _role(m) == "self" for m in _self_attention_modules(model))


def apply_longattn(model: nn.Module, **fields: Any) -> nn.Module:
    """Run longattn's kinds in a built stock transformers model; the entry point for lengthening a checkpoint.

    Attaches each self-attention module's kind (`<attention>.longattn`, its parameters freshly initialised), writes
    the fields to `config.longattn`, selects the `"longattn"` implementation (kept in `config.json` by every
    `save_pretrained`) and makes the cache follow the dict (see `_configure_cache`). Cross-attention stays full;
    an encoder-decoder's decoder self-attention runs `decoder_attention_type` (default "full"). Calling it again
    replaces the kinds. Position tables are not touched (that is lengthening's job). The saved implementation is
    the plain config attribute `attn_implementation`, which `model.set_attn_implementation(other)` keeps equal to
    the implementation in use (refused when a kind holds parameters that `other` would drop).

    Args:
        model: A `PreTrainedModel` whose attention classes are in `SUPPORTED_ATTENTION_CLASSES`.
        **fields: The `longattn` dict: `attention_type` (one name or one per layer), `decoder_attention_type`,
            `attention_backend` and kind fields (`sliding_window`, `sliding_dilation`, ...). None given: the
            model's existing `config.longattn`.

    Returns:
        `model`, modified in place.

    Raises:
        ValueError: `model` is not a built transformers model, an unknown, refused or invalid field (the same
            messages as `LongAttnConfig`), or a family that cannot run a kind (named, with the reason).
    """
    if not isinstance(model, PreTrainedModel):
        raise ValueError(
            f"`model` must be a built transformers model (a PreTrainedModel), got "
            f"{type(model).__name__}: load it first, e.g. `AutoModel.from_pretrained(...)`."
        )
    config = model.config
    fields = dict(fields) if fields else dict(getattr(config, "longattn", None) or {})
    modules = _self_attention_modules(model)
    previous = getattr(config, "longattn", None)
    config.longattn = fields
    try:
        for role, is_causal in {(_role(m), bool(getattr(m, "is_causal", False))) for m in modules}:
            kind_config(config, role, is_causal=is_causal, fields=fields)  # every stack valid before any change
        for module in modules:
            _attach(module, fields)
        _configure_cache(model)
    except ValueError:
        config.longattn = previous
        raise
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
    _remember_implementation(config)
    return model


def _remember_implementation(config: Any) -> None:
    # `save_pretrained` drops the internal `_attn_implementation`; a plain attribute of that name is written to
    # config.json, which `from_pretrained` reads back as the implementation to use. `set_attn_implementation`
    # keeps it equal to the current implementation (`_follow_implementation_switches`).
    config.attn_implementation = ATTN_IMPLEMENTATION


def _runs_longattn(config: Any) -> bool:
    """The model of `config` runs longattn's kinds (a `longattn` dict and the `"longattn"` implementation)."""
    return bool(getattr(config, "longattn", None)) and config._attn_implementation == ATTN_IMPLEMENTATION


def _attached_kinds(model: nn.Module) -> list[LongAttnAttention]:
    """The kinds attached to the self-attention modules of a stock model (`<attention>.longattn`)."""
    return [
        kind
        for module in model.modules()
        if isinstance(kind := module._modules.get(_KIND_MODULE_NAME), LongAttnAttention)
    ]


def auxiliary_loss(model: nn.Module) -> torch.Tensor | None:
    """The sum of the auxiliary losses of a stock model's kinds (adaptive span's span penalty), or None.

    longattn's own models add it to the loss they return; a stock model's head computes its loss without knowing
    the kinds, so add it yourself in training: `loss = outputs.loss + longattn.auxiliary_loss(model)` (when not
    None). Like the native heads, add it once per optimizer step's worth of data: with gradient accumulation over
    g micro-batches, add `auxiliary_loss(model) / g` to each.

    Args:
        model: A stock transformers model with kinds attached (`apply_longattn`, `lengthen`, or loaded after
            `import longattn`).

    Returns:
        A scalar tensor (differentiable in the kinds' parameters), or None when no kind has an auxiliary loss.
    """
    losses = [loss for kind in _attached_kinds(model) if (loss := kind.auxiliary_loss()) is not None]
    return torch.stack(losses).sum() if losses else None


# ------------------------------------------------------------------------------------------ transformers hooks
def _follow_implementation_switches() -> None:
    """Make `set_attn_implementation` on a longattn model keep its saved implementation current.

    `save_pretrained` writes the plain `attn_implementation` attribute that `apply_longattn` / the build hook set.
    After a switch it follows the new implementation, so the saved config.json says what the model runs. Switching
    away is refused when a kind holds parameters or buffers (projections, spans, centroids): saved under another
    implementation they would come back UNEXPECTED and be dropped. Models that do not run longattn are untouched.
    """
    original = PreTrainedModel.set_attn_implementation
    if getattr(original, "_longattn_hook", False):
        return

    @functools.wraps(original)
    def set_attn_implementation(self, attn_implementation, *args, **kwargs):
        requested = (
            attn_implementation.get("", self.config._attn_implementation)
            if isinstance(attn_implementation, dict)
            else attn_implementation
        )
        if requested != ATTN_IMPLEMENTATION and _runs_longattn(self.config):
            holding = sorted({kind.attention_type for kind in _attached_kinds(self) if kind.state_dict()})
            if holding:
                raise ValueError(
                    f"`attn_implementation`={requested!r}: {_family(self)} runs the longattn kinds {holding}, whose "
                    "trained parameters a model under another implementation neither uses nor reloads. Keep "
                    "'longattn', or load a separate copy with `from_pretrained(folder, attn_implementation="
                    f"{requested!r})` to compare."
                )
        result = original(self, attn_implementation, *args, **kwargs)
        if "attn_implementation" in vars(self.config) and isinstance(self.config._attn_implementation, str):
            self.config.attn_implementation = self.config._attn_implementation
        return result

    set_attn_implementation._longattn_hook = True
    PreTrainedModel.set_attn_implementation = set_attn_implementation


def _accept_global_attention_mask_in_generate() -> None:
    """Let `generate(..., global_attention_mask=...)` through on a model that runs longattn's kinds.

    `generate` refuses model kwargs that neither `prepare_inputs_for_generation` nor `forward` name, although a
    stock forward hands its `**kwargs` to the attention function, where the kinds read `global_attention_mask`;
    `prepare_inputs_for_generation` passes it to every step unchanged. After each step it grows by one 0 (not
    global) per generated token, as `attention_mask` grows by ones, so that it always covers every key `[b, m]` and
    is checked like any other input. Other models still refuse it.
    """
    validate = GenerationMixin._validate_model_kwargs
    if getattr(validate, "_longattn_hook", False):
        return
    update = GenerationMixin._update_model_kwargs_for_generation

    @functools.wraps(validate)
    def _validate_model_kwargs(self, model_kwargs):
        if _runs_longattn(self.config) and "global_attention_mask" in model_kwargs:
            model_kwargs = {key: value for key, value in model_kwargs.items() if key != "global_attention_mask"}
        return validate(self, model_kwargs)

    @functools.wraps(update)
    def _update_model_kwargs_for_generation(self, outputs, model_kwargs, *args, **kwargs):
        model_kwargs = update(self, outputs, model_kwargs, *args, **kwargs)
        global_mask = model_kwargs.get("global_attention_mask")
        if isinstance(global_mask, torch.Tensor) and global_mask.dim() == 2 and _runs_longattn(self.config):
            new_tokens = kwargs.get("num_new_tokens", args[1] if len(args) > 1 else 1)
            model_kwargs["global_attention_mask"] = torch.cat(
                [global_mask, global_mask.new_zeros((global_mask.shape[0], new_tokens))], dim=-1
            )
        return model_kwargs

    _validate_model_kwargs._longattn_hook = True
    GenerationMixin._validate_model_kwargs = _validate_model_kwargs
    GenerationMixin._update_model_kwargs_for_generation = _update_model_kwargs_for_generation


# ------------------------------------------------------------------------------------------ build hook
class _BuildHookMeta(type):
    """Instances of the stock class count as instances of its hook class (transformers' output recorders, which
    the patch mapping points at the hook class, then still find the stock modules)."""

    def __instancecheck__(cls, instance: Any) -> bool:
        return isinstance(instance, cls.original_class)

    def __subclasscheck__(cls, subclass: type) -> bool:
        return issubclass(subclass, cls.original_class)


def _original_class(cls: type) -> type:
    return getattr(cls, "original_class", cls)


def _build_hook(original: type[nn.Module]) -> type[nn.Module]:
    """A stand-in for `original` that transformers' patch mapping puts in place while `from_pretrained` /
    `from_config` build a model: it builds the stock module and attaches its kind when the config asks for one."""

    def __new__(cls, *args: Any, **kwargs: Any) -> nn.Module:
        module = original(*args, **kwargs)  # not an instance of `cls`: Python does not call __init__ again
        config = getattr(module, "config", None)
        if getattr(config, "longattn", None):
            if config._attn_implementation == ATTN_IMPLEMENTATION:
                _attach(module)
                _remember_implementation(config)
            else:
                logger.warning(
                    "%s: the config holds a `longattn` dict but the model is built with attn_implementation=%r: "
                    "the longattn kinds are not used (pass attn_implementation='longattn' to use them).",
                    type(module).__name__,
                    config._attn_implementation,
                )
        return module

    return _BuildHookMeta(
        original.__name__, (original,), {"__new__": __new__, "original_class": original, "__module__": __name__}
    )


def register_build_hooks() -> None:
    """Register the build hook of every supported attention class with transformers' patch mapping (idempotent)."""
    import importlib

    mapping = {}
    for name, family in SUPPORTED_ATTENTION_CLASSES.items():
        original = getattr(importlib.import_module(f"transformers.models.{family}.modeling_{family}"), name)
        mapping[f"^{name}$"] = _build_hook(_original_class(original))
    registered = get_patch_mapping()
    register_patch_mapping({key: hook for key, hook in mapping.items() if key not in registered})


# ------------------------------------------------------------------------------------------ the implementation
GROUPED_KINDS = ("sliding",)
"""Kinds whose fast path reads grouped-query key/value heads without repeating them."""


def _dense(query, key, value, mask, *, dropout, scaling):
    """Dense attention under a user's 4-D mask (bool or additive), like transformers' `sdpa`."""
    return torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=mask, dropout_p=dropout, scale=scaling
    )


def longattn_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    position_bias: torch.Tensor | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The `"longattn"` attention function: the kind attached to `module` over q, k, v.

    Args:
        module: The stock attention module (its kind is `module.longattn`; cross-attention runs full).
        query: `[b, h, n, d]`; the last n of the m positions when a cache holds earlier keys.
        key, value: `[b, h_kv, m, d]` (h_kv < h: grouped-query attention).
        attention_mask: `[b, m]` bool from `longattn_mask` (True = real token), None (no padding), or a user's 4-D
            mask (full attention only).
        dropout: Attention dropout probability (0 in eval).
        scaling: Multiplier of q·k (default 1/sqrt(d)).
        position_bias: A dense bias (T5): refused.
        **kwargs: `global_attention_mask` `[b, m]` (self-attention, not an encoder-decoder's decoder),
            `position_ids` and the varlen keywords `cu_seq_lens_q` / `cu_seq_lens_k` (packed documents: positions
            that restart at 0 per document, as `DataCollatorWithFlattening` produces them; attention never crosses
            from one document to another), `output_attentions`; others are ignored.

    Returns:
        (`[b, n, h, d]` output, weights `[b, h, n, m]` or None).

    Raises:
        ValueError: the module has no kind (built without the hook), a dense bias, a score modifier, a 4-D mask with
            a sparse kind, packed documents with a kind that cannot pack, global tokens with a bounded cache.
    """
    family = _family(module)
    _refuse_score_modifiers(family, position_bias, kwargs)
    role = _role(module)
    four_d = attention_mask is not None and attention_mask.dim() == 4
    kind: LongAttnAttention | None = module._modules.get(_KIND_MODULE_NAME)
    key, value = _key_value_heads(kind, role, four_d, query, key, value, kwargs.get("output_attentions"))
    if role == "cross":  # dense: n decoder queries over the m encoder states, like longattn's own CrossAttention
        if four_d:
            out = _dense(query, key, value, attention_mask, dropout=dropout, scaling=scaling)
        else:
            out = full_attention(query, key, value, key_padding_mask=attention_mask, scale=scaling, dropout_p=dropout)
        return out.transpose(1, 2).contiguous(), None
    if kind is None:
        raise ValueError(
            f"{family} has no longattn kind attached, so its parameters would be missing: build the model with "
            "`from_pretrained` or `from_config` (Auto classes included) after `import longattn`, or call "
            "`longattn.apply_longattn(model, **fields)` on a built model."
        )
    if four_d:
        if kind.attention_type != "full":
            raise ValueError(
                f"{family}: a 4-D attention mask cannot be applied by the sparse kind {kind.attention_type!r} "
                "(it would need an n x n mask); pass a 2-D padding mask [batch, length]."
            )
        out = _dense(query, key, value, attention_mask, dropout=dropout, scaling=scaling)
        return out.transpose(1, 2).contiguous(), None
    n, m = query.shape[2], key.shape[2]
    if attention_mask is not None and attention_mask.shape[-1] != m:
        raise ValueError(f"{family}: the padding mask covers {attention_mask.shape[-1]} keys, the layer has {m}.")
    global_mask = _global_tokens(family, module, kind, role, query, m, kwargs.get("global_attention_mask"))
    # Packing is a layout of whole rows: a cache continues one document.
    documents = _packed_documents(kind, query, attention_mask, kwargs) if n == m and n > 1 else {}
    kind.scale = scaling if scaling is not None else default_scale(query.shape[-1])
    kind.dropout_p = dropout
    return _attend(kind, query, key, value, attention_mask, global_mask, documents, kwargs.get("output_attentions"))


def _refuse_score_modifiers(family: str, position_bias: torch.Tensor | None, kwargs: dict[str, Any]) -> None:
    """Raise `ValueError` for a dense position bias or a score modifier, which no kind implements."""
    if position_bias is not None:
        raise ValueError(
            f"{family}: its attention adds a dense position bias (`position_bias`, one score per query-key pair), "
            "which a sparse kind cannot take without an n x n matrix; longattn does not support this family."
        )
    for name in ("softcap", "sinks", "s_aux"):
        if kwargs.get(name) is not None:
            raise ValueError(f"{family}: its attention passes `{name}`, which longattn's kinds do not implement.")


def _key_value_heads(
    kind: LongAttnAttention | None,
    role: str,
    four_d: bool,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    output_attentions: bool | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Grouped-query attention: the sliding kinds' fast path reads each key/value head in place for its group of
    query heads (`ops.sliding_window_attention`); every other path gets k/v repeated to the query heads."""
    grouped_fast_path = (
        role != "cross"
        and kind is not None
        and kind.attention_type in GROUPED_KINDS
        and not four_d
        and query.shape[2] == key.shape[2]
        and not runs_dense_form(kind.backend)
        and not output_attentions
    )
    if grouped_fast_path:
        return key, value
    groups = query.shape[1] // key.shape[1]
    return repeat_kv(key, groups), repeat_kv(value, groups)  # [b, h, m, d]


def _global_tokens(
    family: str,
    module: nn.Module,
    kind: LongAttnAttention,
    role: str,
    query: torch.Tensor,
    m: int,
    global_mask: torch.Tensor | None,
) -> torch.Tensor | None:
    """The checked `global_attention_mask` `[b, m]` of a self-attention layer (None for a decoder's).

    Raises:
        ValueError: global tokens in cached decoding with a bounded cache, or a mask that is not one entry per key.
    """
    if role == "decoder" or global_mask is None:
        return None
    if query.shape[2] != m and kind.is_causal and getattr(module.config, "sliding_window", None):
        # A bounded cache (a plain causal window) has dropped the earlier global keys.
        raise ValueError(
            f"{family}: cached decoding with global tokens needs a full cache, but this model's cache keeps only "
            f"the last {module.config.sliding_window} keys (a plain sliding window); generate without "
            "`global_attention_mask`, or use a dilated window (full cache layers)."
        )
    # The check longattn's own models make: one entry per key (`generate` grows it with the tokens it adds).
    return check_input_mask(
        global_mask, name="global_attention_mask", batch=query.shape[0], length=m, device=query.device
    )


def _packed_documents(
    kind: LongAttnAttention, query: torch.Tensor, attention_mask: torch.Tensor | None, kwargs: dict[str, Any]
) -> dict[str, torch.Tensor]:
    """The kind's document keywords (`document_kwargs`) of packed rows, from `position_ids` or the varlen keywords
    (`packing.packed_document_ids`); empty without packing."""
    n = query.shape[2]
    position_ids = kwargs.get("position_ids")
    return kind.document_kwargs(
        packed_document_ids(
            position_ids=None if position_ids is None else position_ids.expand(query.shape[0], -1)[:, -n:],
            batch=query.shape[0],
            length=n,
            cu_seq_lens_q=kwargs.get("cu_seq_lens_q"),
            cu_seq_lens_k=kwargs.get("cu_seq_lens_k"),
            attention_mask=attention_mask,
        )
    )


def _attend(
    kind: LongAttnAttention,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    global_mask: torch.Tensor | None,
    documents: dict[str, torch.Tensor],
    output_attentions: bool | None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The kind over q `[b, h, n, d]`, k, v `[b, h, m, d]`: its dense form for weights, cached decoding (n != m) or
    the back end that runs it (`backends.runs_dense_form`), else its own executor. Returns (`[b, n, h, d]`, weights
    `[b, h, n, m]` or None)."""
    n, m = query.shape[2], key.shape[2]
    if kind.attention_type == "synthesizer":  # the random forms: weights from positions, applied to v (no packing)
        out, weights = kind.attend_synthesized(
            query if kind.mix else None, key, value, attention_mask=attention_mask, hidden_states=None, query_length=n
        )
        weights = weights if output_attentions else None  # already [b, h, n, m]
    elif output_attentions or n != m or runs_dense_form(kind.backend):
        out, weights = kind.attend_dense(
            query, key, value, key_padding_mask=attention_mask, global_mask=global_mask, **documents
        )
    else:
        out = kind.attend(query, key, value, key_padding_mask=attention_mask, global_mask=global_mask, **documents)
        weights = None
    return out.transpose(1, 2).contiguous(), weights  # [b, n, h, d]


def longattn_mask(
    *,
    batch_size: int,
    q_length: int,
    kv_length: int,
    kv_offset: int = 0,
    attention_mask: torch.Tensor | None = None,
    use_vmap: bool = False,
    **kwargs: Any,
) -> torch.Tensor | None:
    """The `"longattn"` mask function: the `[b, kv_length]` padding mask of the keys the layer sees, or None.

    transformers calls it once per forward (keyword arguments only); the pattern itself is the kind's, so the
    causal / sliding / bidirectional mask function it is given is not evaluated and no `[n, m]` mask is built.

    Raises:
        ValueError: the model overlays its own mask predicate (`or_mask_function` / `and_mask_function`, e.g.
            image tokens), which longattn's kinds cannot apply.
    """
    if use_vmap:
        raise ValueError(
            "this model overlays its own mask predicate on the attention pattern (or_mask_function / "
            "and_mask_function), which longattn's kinds cannot apply without an n x n mask."
        )
    if attention_mask is None:
        return None
    padding = prepare_padding_mask(attention_mask, kv_length, kv_offset)
    return padding[:, kv_offset : kv_offset + kv_length].bool()  # [b, m]


def register() -> None:
    """Register the implementation, its mask function and the build hooks (called when this module is imported)."""
    AttentionInterface.register(ATTN_IMPLEMENTATION, longattn_attention_forward)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, longattn_mask)
    register_build_hooks()
    _follow_implementation_switches()
    _accept_global_attention_mask_in_generate()


register()

__all__ = [
    "ATTN_IMPLEMENTATION",
    "SUPPORTED_ATTENTION_CLASSES",
    "allowed_fields",
    "apply_longattn",
    "auxiliary_loss",
    "kind_config",
    "longattn_attention_forward",
    "longattn_mask",
]
