"""Stock transformers classes running longattn's kinds, as remote code: what makes a lengthened folder shareable.

A lengthened checkpoint (`longattn.lengthen`, `longattn.apply_longattn`) is a stock family (BERT, RoBERTa, GPT-2,
Llama, ...) whose config holds a `longattn` dict and `"attn_implementation": "longattn"`. Every `save_pretrained` of
such a model (plain, Trainer's, a merged PEFT model's, `push_to_hub`) saves it as an instance of
`shareable_class(type(model))`: a subclass of the stock class, of the same name, defined in this module and
registered for its Auto class the transformers way (`register_for_auto_class`). transformers then writes `auto_map`
(`"AutoModelForMaskedLM": "modeling_stock.RobertaForMaskedLM"`; this module adds the family's other Auto classes) and
copies this file with every sibling module it imports (the attention implementation, the kinds, their ops).

Loaded with `trust_remote_code=True` where longattn is not installed, importing this module registers the "longattn"
attention implementation and the build hooks (`integration_transformers`), and the class name in `auto_map`
resolves (the module's `__getattr__`) to the shareable subclass of transformers' class of that name: `from_pretrained`
builds the stock model with its kinds attached, as after `import longattn`. Without `trust_remote_code` and without
longattn, nothing of the folder runs: transformers builds its own class and refuses the unknown implementation
`"longattn"` (the model card says both ways to load it).
"""

from __future__ import annotations

import functools
from typing import Any

import transformers
from transformers import PreTrainedModel

from .integration_transformers import ATTN_IMPLEMENTATION  # registers the implementation and the build hooks

AUTO_CLASSES = (
    "AutoModel",
    "AutoModelForMaskedLM",
    "AutoModelForCausalLM",
    "AutoModelForSeq2SeqLM",
    "AutoModelForSequenceClassification",
    "AutoModelForTokenClassification",
    "AutoModelForQuestionAnswering",
    "AutoModelForMultipleChoice",
    "AutoModelForPreTraining",
)
"""The Auto classes a lengthened folder answers to, where its family has a class for them (in this order of
preference for the saving class's own)."""

_MODULE = __name__.rpartition(".")[2]  # "modeling_stock": the name `auto_map` uses inside the folder
_SHAREABLE: dict[type, type] = {}


def family_auto_map(model_type: str) -> dict[str, str]:
    """Auto class -> stock class name, for every Auto class of `AUTO_CLASSES` that has a class of `model_type`."""
    found = {}
    for auto in AUTO_CLASSES:
        names = getattr(transformers, auto)._model_mapping._model_mapping.get(model_type)
        if names:
            found[auto] = names if isinstance(names, str) else names[0]
    return found


def shareable_class(stock_class: type[PreTrainedModel]) -> type[PreTrainedModel]:
    """The subclass of `stock_class` (same name, this module) registered for its Auto class: saving an instance of it
    writes `auto_map` and copies this module and its siblings into the folder (cached; a shareable class is its
    own)."""
    if stock_class.__dict__.get("_longattn_shareable", False):
        return stock_class
    if stock_class not in _SHAREABLE:
        name = stock_class.__name__
        autos = [auto for auto, cls in family_auto_map(stock_class.config_class.model_type).items() if cls == name]
        shareable = type(
            name,
            (stock_class,),
            {"__module__": __name__, "__qualname__": name, "__doc__": stock_class.__doc__, "_longattn_shareable": True},
        )
        shareable.register_for_auto_class(autos[0] if autos else "AutoModel")
        _SHAREABLE[stock_class] = shareable
    return _SHAREABLE[stock_class]


def __getattr__(name: str) -> Any:
    """`modeling_stock.RobertaForMaskedLM` (what `auto_map` names): the shareable subclass of transformers' class."""
    stock = None if name.startswith("_") else getattr(transformers, name, None)
    if isinstance(stock, type) and issubclass(stock, PreTrainedModel):
        return shareable_class(stock)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def runs_longattn(config: Any) -> bool:
    """A stock family's config that runs longattn's kinds (a `longattn` dict, the `"longattn"` implementation)."""
    return (
        getattr(config, "model_type", None) != "longattn"
        and bool(getattr(config, "longattn", None))
        and getattr(config, "_attn_implementation", None) == ATTN_IMPLEMENTATION
    )


def share_code_on_save() -> None:
    """Make every `save_pretrained` of a stock model running longattn's kinds write a folder that loads with
    `trust_remote_code=True` (idempotent).

    The model is saved as an instance of `shareable_class(type(model))` (its class is put back afterwards), so
    transformers' own mechanism writes `auto_map` and copies the code; `auto_map` also names the family's other
    Auto classes (a lengthened masked LM loads as `AutoModel` or as a classifier to fine-tune). Other models are
    saved as before.
    """
    original = PreTrainedModel.save_pretrained
    if getattr(original, "_longattn_hook", False):
        return

    @functools.wraps(original)
    def save_pretrained(self, save_directory, *args, **kwargs):
        if not runs_longattn(self.config):
            return original(self, save_directory, *args, **kwargs)
        own_class = type(self)
        family = family_auto_map(self.config.model_type)
        self.config.auto_map = {
            **{auto: f"{_MODULE}.{name}" for auto, name in family.items()},
            **(getattr(self.config, "auto_map", None) or {}),
        }
        self.__class__ = shareable_class(own_class)
        try:
            return original(self, save_directory, *args, **kwargs)
        finally:
            self.__class__ = own_class

    save_pretrained._longattn_hook = True
    PreTrainedModel.save_pretrained = save_pretrained


share_code_on_save()

__all__ = ["AUTO_CLASSES", "family_auto_map", "runs_longattn", "share_code_on_save", "shareable_class"]
