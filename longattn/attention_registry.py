"""Attention registry: attention name -> attention module class.

Each kind is imported explicitly here (not self-registered on package import) so that a Hub folder, which receives
`modeling_longattn.py` and its sibling imports but never `__init__.py`, still knows every kind.
"""

from __future__ import annotations

from .attention_adaptive_span import AdaptiveSpanAttention
from .attention_base import LongAttnAttention
from .attention_binary_partition import BinaryPartitionAttention
from .attention_deformable import DeformableAttention
from .attention_efficient import EfficientAttention
from .attention_full import FullAttention
from .attention_linformer import LinformerAttention
from .attention_longformer import LongformerAttention
from .attention_lsh import LSHAttention
from .attention_reduction import ReductionAttention
from .attention_routing import RoutingAttention
from .attention_sinkhorn import SinkhornAttention
from .attention_sparse_transformer import FixedAttention, StridedAttention
from .attention_synthesizer import SynthesizerAttention

ATTENTION_CLASSES: dict[str, type[LongAttnAttention]] = {
    kind.attention_type: kind
    for kind in (
        AdaptiveSpanAttention,
        BinaryPartitionAttention,
        DeformableAttention,
        EfficientAttention,
        FullAttention,
        LinformerAttention,
        LongformerAttention,
        LSHAttention,
        ReductionAttention,
        StridedAttention,
        FixedAttention,
        RoutingAttention,
        SinkhornAttention,
        SynthesizerAttention,
    )
}


def available_attention_types() -> list[str]:
    """The registered attention names, usable in `LongAttnConfig.attention_type`."""
    return sorted(ATTENTION_CLASSES)


def attention_class(name: str) -> type[LongAttnAttention]:
    """The module class registered under `name`.

    Raises:
        ValueError: `name` is not registered; the message lists the registered names.
    """
    if name not in ATTENTION_CLASSES:
        raise ValueError(f"attention type {name!r} is not registered: expected one of {available_attention_types()}.")
    return ATTENTION_CLASSES[name]
