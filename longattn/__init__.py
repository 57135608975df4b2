"""longattn: long-sequence transformers with a zoo of efficient attentions, at home in the Hugging Face ecosystem.

`import longattn` is cheap: it imports neither transformers' model machinery nor longattn's models. The public names
are module attributes resolved when first used, and the registrations with transformers (`register`: the Auto
classes, the `"longattn"` attention implementation, the shareable save) happen by themselves the first time they
are needed (`longattn._registration` says when), so `AutoModel.from_pretrained(folder)` works for any saved
longattn model, and for a stock model lengthened with longattn, after `import longattn` alone. The `longattn`
command (`longattn.tools.cli`) starts without torch or transformers: in that process the registrations wait for the
subcommand that needs them.

Layout: the flat modules are what a Hub folder loaded with `trust_remote_code` carries (the configuration, the model,
the attention kinds, ops, patterns, executors, numerics, the tokenizer) plus the library's entry points
(`apply_longattn`, `lengthen`); tooling no saved model needs lives in two subpackages: `longattn.train` (the recipes'
loop, collators, the offline tasks) and `longattn.tools` (Hub folders and uploads, pictures, the command lines).
"""

import sys as _sys
import types as _types


def _started_as_command() -> bool:
    """This process is the `longattn` command (`longattn ...`, `python -m longattn ...`): its start (`--help`, the
    choice of a subcommand) imports neither torch nor transformers; the subcommand registers what it needs."""
    argv = getattr(_sys, "orig_argv", None) or []
    module = [after for before, after in zip(argv, argv[1:]) if before == "-m"][:1]
    return _sys.argv[0].rsplit("/", 1)[-1] == "longattn" or module == ["longattn"]


def register() -> None:
    """Register `LongAttnConfig` and every model class with transformers' Auto classes, the `"longattn"` attention
    implementation (and its build hooks), and the shareable save of stock models running the kinds (idempotent).

    It runs by itself the first time it is needed (`longattn._registration`); call it to pay its cost up front, or
    in the `longattn` command, whose subcommands call it when they need it."""
    from . import _registration

    with _registration.registering():
        _register()


def _register() -> None:
    from transformers import (
        AutoConfig,
        AutoModel,
        AutoModelForCausalLM,
        AutoModelForMaskedLM,
        AutoModelForQuestionAnswering,
        AutoModelForSeq2SeqLM,
        AutoModelForSequenceClassification,
        AutoModelForTokenClassification,
    )

    from . import _moved, integration_transformers, modeling_longattn, modeling_stock  # noqa: F401  (they register)

    _moved.install()  # `longattn.training`, `longattn.hub`, ...: the old paths of `longattn.train` / `longattn.tools`
    config_class = modeling_longattn.LongAttnConfig
    AutoConfig.register(config_class.model_type, config_class, exist_ok=True)
    auto_classes = {
        AutoModel: modeling_longattn.LongAttnModel,
        AutoModelForMaskedLM: modeling_longattn.LongAttnForMaskedLM,
        AutoModelForSequenceClassification: modeling_longattn.LongAttnForSequenceClassification,
        AutoModelForTokenClassification: modeling_longattn.LongAttnForTokenClassification,
        AutoModelForQuestionAnswering: modeling_longattn.LongAttnForQuestionAnswering,
        AutoModelForCausalLM: modeling_longattn.LongAttnForCausalLM,
        AutoModelForSeq2SeqLM: modeling_longattn.LongAttnForSeq2SeqLM,
    }
    for auto_class, model_class in auto_classes.items():
        auto_class.register(config_class, model_class, exist_ok=True)


class _Package(_types.ModuleType):
    """The package's module type, for one attribute: `longattn.lengthen` is the function, never the module of that
    name. The import system binds a submodule to its package's attribute when the submodule is first imported (by
    `from longattn.lengthen import max_tokens`, by the tools, by this property), and nothing is registered at import
    any more to bind the function over it afterwards; a module `__getattr__` would never be asked again. A property
    outranks the module's dict, so the binding is kept but not returned."""

    @property
    def lengthen(self):
        chosen = vars(self).get("lengthen")
        if chosen is None or isinstance(chosen, _types.ModuleType):
            from .lengthen import lengthen as chosen
        return chosen

    @lengthen.setter
    def lengthen(self, value) -> None:  # a monkeypatch's function stands; the submodule is never returned
        vars(self)["lengthen"] = value


_MODEL_CLASSES = (
    "LongAttnPreTrainedModel",
    "LongAttnModel",
    "LongAttnForMaskedLM",
    "LongAttnForSequenceClassification",
    "LongAttnForTokenClassification",
    "LongAttnForQuestionAnswering",
    "LongAttnForCausalLM",
    "LongAttnForSeq2SeqLM",
)
# Public names -> the module that defines them, imported when first used (module `__getattr__`, PEP 562).
_LAZY = {
    "LongAttnConfig": "configuration_longattn",
    "available_attention_types": "attention_registry",
    "apply_longattn": "integration_transformers",
    "auxiliary_loss": "integration_transformers",
    "save_lengthened": "tools.lengthen",  # writing a folder is tooling: it lives beside the hub code
    **{name: "modeling_longattn" for name in _MODEL_CLASSES},
}
_SUBMODULES = ("ops", "patterns", "modeling_longattn", "modeling_stock", "integration_transformers")


def __getattr__(name: str):
    import importlib

    if name in _LAZY:
        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    if name in _SUBMODULES:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY, *_SUBMODULES, "lengthen"})


__version__ = "0.1.0"

__all__ = [
    "LongAttnConfig",
    *_MODEL_CLASSES,
    "apply_longattn",
    "auxiliary_loss",
    "available_attention_types",
    "lengthen",
    "save_lengthened",
    "ops",
    "patterns",
    "register",
]

_sys.modules[__name__].__class__ = _Package
if not _started_as_command():
    from . import _moved, _registration

    _moved.install()  # `longattn.training`, `longattn.hub`, ...: the old paths of `longattn.train` / `longattn.tools`
    _registration.install(register)
