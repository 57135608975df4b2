"""longattn: long-sequence transformers with a zoo of efficient attentions, at home in the Hugging Face ecosystem.

`import longattn` registers `LongAttnConfig` and every model class with transformers' Auto classes, so
`AutoModel.from_pretrained(folder)` works for any saved longattn model.

Layout: the flat modules are what a Hub folder loaded with `trust_remote_code` carries (the configuration, the model,
the attention kinds, ops, patterns, executors, numerics, the tokenizer) plus the library's entry points
(`apply_longattn`, `lengthen`); tooling no saved model needs lives in two subpackages: `longattn.train` (the recipes'
loop, collators, the offline tasks) and `longattn.tools` (Hub folders and uploads, pictures, the command lines).
"""

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

# modeling_stock: every save of a stock model running the kinds writes a folder that loads with trust_remote_code.
from . import _moved, modeling_longattn, modeling_stock, ops, patterns  # noqa: F401
from .attention_registry import available_attention_types
from .configuration_longattn import LongAttnConfig
from .integration_transformers import apply_longattn, auxiliary_loss  # registers the "longattn" implementation
from .lengthen import lengthen
from .modeling_longattn import (  # noqa: F401  (public names: modeling_longattn.__all__, listed in __all__ below)
    LongAttnForCausalLM,
    LongAttnForMaskedLM,
    LongAttnForQuestionAnswering,
    LongAttnForSeq2SeqLM,
    LongAttnForSequenceClassification,
    LongAttnForTokenClassification,
    LongAttnModel,
    LongAttnPreTrainedModel,
)

__version__ = "0.1.0"

AUTO_CLASSES = {
    AutoModel: LongAttnModel,
    AutoModelForMaskedLM: LongAttnForMaskedLM,
    AutoModelForSequenceClassification: LongAttnForSequenceClassification,
    AutoModelForTokenClassification: LongAttnForTokenClassification,
    AutoModelForQuestionAnswering: LongAttnForQuestionAnswering,
    AutoModelForCausalLM: LongAttnForCausalLM,
    AutoModelForSeq2SeqLM: LongAttnForSeq2SeqLM,
}

_moved.install()  # `longattn.training`, `longattn.hub`, ...: the old paths of `longattn.train` / `longattn.tools`

AutoConfig.register(LongAttnConfig.model_type, LongAttnConfig, exist_ok=True)
for _auto_class, _model_class in AUTO_CLASSES.items():
    _auto_class.register(LongAttnConfig, _model_class, exist_ok=True)


def __getattr__(name: str):
    """`longattn.save_lengthened`: writing a folder is tooling (`longattn.tools.lengthen`), imported when first used."""
    if name == "save_lengthened":
        from .tools.lengthen import save_lengthened

        return save_lengthened
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "LongAttnConfig",
    *modeling_longattn.__all__,
    "apply_longattn",
    "auxiliary_loss",
    "available_attention_types",
    "lengthen",
    "save_lengthened",
    "ops",
    "patterns",
]
