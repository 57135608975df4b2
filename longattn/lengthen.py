"""Lengthening a pretrained checkpoint: the same family, reading `max_length` tokens with longattn's kinds.

    model = longattn.lengthen("roberta-base", max_length=4096, attention_type="sliding", sliding_window=256)
    longattn.save_lengthened(model, "roberta-base-4096", tokenizer=tokenizer)   # model, tokenizer, model card
    AutoModel.from_pretrained("roberta-base-4096")   # after `import longattn`: same kinds, same parameters

What changes, by family (`max_length` is a token count; each table's size follows from it):

- learned absolute position tables are extended by copying the pretrained table over the new rows, as Longformer
  did: BERT's and ELECTRA's `position_embeddings` (`max_length` rows), RoBERTa's and XLM-RoBERTa's
  (`padding_idx + 1` more rows, kept in front: roberta-base has 514 rows for 512 tokens, 4098 for 4096), GPT-2's
  `wpe`, OPT's `embed_positions` and BART's encoder and decoder `embed_positions` (2 offset rows each); the
  embeddings' `position_ids` / `token_type_ids` buffers follow. A model with causal self-attention gets a warning:
  the copy does not lengthen a causal model before long training (docs/quality.md measures why);
- rotary models (Llama, Mistral, Qwen2, Qwen3, Phi-3, Gemma): `max_position_embeddings` is raised, and
  `rope_type` ("linear", "dynamic" or "yarn") optionally scales the rotation by
  `max_length / max_position_embeddings`, written as transformers 5.x `rope_parameters`;
- the attention: `apply_longattn(model, **fields)` attaches the kinds (their parameters freshly initialised, since
  kinds such as Linformer's projections depend on the new length) and selects the `"longattn"` implementation,
  which every `save_pretrained` keeps in `config.json`.

A saved folder loads after `import longattn`, or with `trust_remote_code=True` where longattn is not installed (it
carries the code: `modeling_stock.py`); with neither, `from_pretrained` fails with transformers' own error about the
unknown attention implementation, never a silent full-attention model.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .configuration_longattn import max_tokens
from .integration_transformers import apply_longattn

ROPE_TYPES = ("linear", "dynamic", "yarn")
"""The rotary scalings `lengthen(..., rope_type=...)` writes into `rope_parameters`."""


def _position_tables(model: nn.Module) -> list[tuple[nn.Module, str, int, bool]]:
    """Every learned absolute position table of `model`: (owner, attribute, offset rows, whether the config's
    `max_position_embeddings` counts the offset rows)."""
    tables = []
    for owner in model.modules():
        for name in ("position_embeddings", "wpe", "embed_positions"):
            table = owner._modules.get(name)
            if not isinstance(table, nn.Embedding):
                continue
            if hasattr(table, "offset"):  # BART: positions are looked up at `position + offset`
                tables.append((owner, name, table.offset, False))
            elif table.padding_idx is not None:  # RoBERTa: positions start at padding_idx + 1
                tables.append((owner, name, table.padding_idx + 1, True))
            else:
                tables.append((owner, name, 0, True))
    return tables


def _extend_table(table: nn.Embedding, rows: int, offset: int) -> None:
    """Grow `table` to `rows` rows in place: the `offset` rows in front are kept, the pretrained positions after them
    are copied over and over into the new rows (Longformer's initialisation)."""
    old = table.weight.data
    positions = old[offset:]  # [tokens_old, dim]
    repeats = -(-(rows - offset) // positions.shape[0])
    new = torch.cat([old[:offset], positions.repeat(repeats, 1)[: rows - offset]])  # [rows, dim]
    table.weight = nn.Parameter(new, requires_grad=table.weight.requires_grad)
    table.num_embeddings = rows


CAUSAL_COPY_WARNING = (
    "{model} has causal self-attention: its learned position table is extended by copying, which lengthens "
    "bidirectional encoders (Longformer's result) but not a causal model before long training. Measured on a small "
    "causal RoBERTa (docs/quality.md, 'Lengthening a pretrained causal model'): each copy's seam reaches later "
    "queries through the layers below, and loss at 4,096 tokens more than doubles. Train at the new length before "
    "relying on it, or prefer a rotary model."
)


def _extend_learned_positions(model: nn.Module, max_length: int) -> None:
    config = model.config
    tables = _position_tables(model)
    if any(getattr(module, "is_causal", False) is True for module in model.modules()):
        warnings.warn(CAUSAL_COPY_WARNING.format(model=type(model).__name__), UserWarning, stacklevel=3)
    for owner, name, offset, config_counts_offset in tables:
        table = owner._modules[name]
        tokens = table.num_embeddings - offset
        if max_length < tokens:
            raise ValueError(
                f"`max_length`={max_length} is shorter than the {tokens} tokens {type(model).__name__} "
                f"already reads: expected max_length >= {tokens}."
            )
        _extend_table(table, max_length + offset, offset)
        # BERT / RoBERTa embeddings keep [1, rows] buffers of position and token type ids.
        if isinstance(getattr(owner, "position_ids", None), torch.Tensor):
            owner.position_ids = torch.arange(max_length + offset, device=owner.position_ids.device)[None]
        if isinstance(getattr(owner, "token_type_ids", None), torch.Tensor):
            owner.token_type_ids = owner.token_type_ids.new_zeros(1, max_length + offset)
        config.max_position_embeddings = max_length + (offset if config_counts_offset else 0)


def _extend_rotary(model: nn.Module, max_length: int, rope_type: str | None) -> None:
    config = model.config
    current = config.max_position_embeddings
    if rope_type is not None:
        if rope_type not in ROPE_TYPES:
            raise ValueError(
                f"`rope_type`={rope_type!r} is not a rotary scaling lengthen writes: expected one of "
                f"{list(ROPE_TYPES)} (or None: no scaling)."
            )
        if max_length <= current:
            raise ValueError(
                f"`rope_type`={rope_type!r} scales by max_length / max_position_embeddings, but "
                f"`max_length`={max_length} is not beyond the model's {current} positions."
            )
        previous = config.rope_parameters
        parameters = {"rope_type": rope_type, "rope_theta": previous["rope_theta"], "factor": max_length / current}
        if rope_type == "yarn":
            parameters["original_max_position_embeddings"] = current
        config.rope_parameters = parameters
    config.max_position_embeddings = max(current, max_length)
    # The rotary modules computed their frequencies from the config at build time.
    for owner in list(model.modules()):
        for name, child in list(owner.named_children()):
            if type(child).__name__.endswith("RotaryEmbedding"):
                rotary = type(child)(config=config)
                owner.add_module(name, rotary.to(device=child.inv_freq.device))


def _load(source: str | Path) -> nn.Module:
    """The model of a folder or Hub id, of the class that saved it (`config.architectures`, else `AutoModel`)."""
    import transformers
    from transformers import AutoConfig, AutoModel

    config = AutoConfig.from_pretrained(source)
    architectures = getattr(config, "architectures", None) or []
    model_class = getattr(transformers, architectures[0], AutoModel) if architectures else AutoModel
    return model_class.from_pretrained(source, config=config)


def lengthen(
    model_or_path: nn.Module | str | Path, max_length: int, *, rope_type: str | None = None, **fields: Any
) -> nn.Module:
    """A model of the same family that reads `max_length` tokens with longattn's kinds.

    Args:
        model_or_path: A built stock model (modified in place) or a folder / Hub id (loaded with the class that
            saved it).
        max_length: Tokens the model reads. Learned tables hold `max_length` plus their offset rows.
        rope_type: Rotary models only: "linear", "dynamic" or "yarn" scaling by max_length / the model's
            `max_position_embeddings`; None raises the limit without scaling.
        **fields: The `longattn` dict (`attention_type`, `sliding_window`, ...; see `apply_longattn`); none given:
            the model's existing dict, else a sliding window with `LongAttnConfig`'s defaults.

    Returns:
        The lengthened model (in eval mode when loaded from a path).

    Raises:
        ValueError: `max_length` < 1 or shorter than a learned table, `rope_type` unknown or given to a model
            without rotary positions, or any `apply_longattn` refusal (field, kind or family).
    """
    if isinstance(max_length, bool) or not isinstance(max_length, int) or max_length < 1:
        raise ValueError(f"`max_length`={max_length!r} must be a positive number of tokens.")
    model = model_or_path if isinstance(model_or_path, nn.Module) else _load(model_or_path)
    rotary = getattr(model.config, "rope_parameters", None) is not None
    if rotary:
        _extend_rotary(model, max_length, rope_type)
    else:
        if rope_type is not None:
            raise ValueError(
                f"`rope_type`={rope_type!r}: {type(model).__name__} has learned position tables, "
                "not rotary positions (they are extended by copying instead)."
            )
        if not _position_tables(model):
            raise ValueError(
                f"{type(model).__name__} has neither a learned position table nor rotary positions that lengthen knows."
            )
        _extend_learned_positions(model, max_length)
    return apply_longattn(model, **fields)


__all__ = ["ROPE_TYPES", "lengthen", "max_tokens"]
