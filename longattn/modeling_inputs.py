"""The inputs of a longattn model: their checks (token ids, embeddings, positions, labels), packed rows, and the
shared body of every model that embeds them and runs a stack (`_run_backbone`).

Shape legend: b batch, n length (new tokens), m length of all keys (cached ones included), D hidden size.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import PreTrainedModel
from transformers.cache_utils import Cache
from transformers.modeling_outputs import BaseModelOutputWithPastAndCrossAttentions

from .configuration_longattn import LongAttnConfig
from .modeling_blocks import LongAttnEmbeddings, LongAttnRotaryEmbedding, LongAttnStack
from .ops_checks import check_input_mask, check_tensor_on
from .packing import packed_document_ids
from .patterns import document_starts


def _is_integer(tensor: torch.Tensor) -> bool:
    return not (tensor.is_floating_point() or tensor.is_complex() or tensor.dtype == torch.bool)


def _check_range(name: str, tensor: torch.Tensor, limit: int, what: str) -> None:
    """Raise `ValueError` unless every value of an integer tensor is in [0, limit) (`what` names the limit).

    One `aminmax` and one host sync in eager mode. Skipped while `torch.compile` or `torch.export` traces: reading
    the values there would break the graph (a compiled model with a bad id fails in the embedding lookup instead).
    """
    if tensor.numel() == 0 or torch.compiler.is_compiling():
        return
    low, high = (int(value) for value in torch.aminmax(tensor))
    if low < 0 or high >= limit:
        bad = low if low < 0 else high
        raise ValueError(f"`{name}` holds {bad}: expected values in [0, {limit}) ({what}={limit}).")


def _check_token_inputs(
    config: LongAttnConfig,
    embeddings: LongAttnEmbeddings,
    input_ids: torch.Tensor | None,
    inputs_embeds: torch.Tensor | None,
    *,
    prefix: str = "",
    check_values: bool = True,
) -> tuple[int, int]:
    """Check the token inputs of one stack and return (b, n): exactly one of `input_ids` `[b, n]` (integer ids in
    [0, vocab_size)) and `inputs_embeds` `[b, n, D]` (floating point, in the embedding table's dtype unless autocast
    is on). `prefix` is "decoder_" for the seq2seq decoder, whose arguments are named so. `check_values=False` checks
    types and shapes only (no host sync), for a head that reads the shapes before the backbone checks the ids.

    Raises:
        ValueError: naming the argument, its shape, dtype or offending value, and what is allowed.
    """
    ids_name, embeds_name = f"{prefix}input_ids", f"{prefix}inputs_embeds"
    if (input_ids is None) == (inputs_embeds is None):
        made_from = " (or `labels`, from which the decoder inputs are made)" if prefix else ""
        raise ValueError(f"Pass exactly one of `{ids_name}` and `{embeds_name}`{made_from}.")
    if input_ids is not None:
        if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
            shape = list(input_ids.shape) if isinstance(input_ids, torch.Tensor) else type(input_ids).__name__
            raise ValueError(f"`{ids_name}` has shape {shape}: expected a tensor [batch, length].")
        if not _is_integer(input_ids):
            raise ValueError(
                f"`{ids_name}` has dtype {input_ids.dtype}: {ids_name} must be integer token ids "
                f"(torch.long); pass vectors as `{embeds_name}`."
            )
        if check_values:
            _check_range(ids_name, input_ids, config.vocab_size, "vocab_size")
        return input_ids.shape[0], input_ids.shape[1]
    hidden = config.hidden_size
    if not isinstance(inputs_embeds, torch.Tensor) or inputs_embeds.dim() != 3 or inputs_embeds.shape[2] != hidden:
        shape = list(inputs_embeds.shape) if isinstance(inputs_embeds, torch.Tensor) else type(inputs_embeds).__name__
        raise ValueError(f"`{embeds_name}` has shape {shape}: expected [batch, length, hidden_size={hidden}].")
    table_dtype = embeddings.word_embeddings.weight.dtype
    # Under autocast the layers cast their inputs themselves; otherwise LayerNorm and the linear layers need the
    # model's dtype.
    autocast = torch.is_autocast_enabled(inputs_embeds.device.type)
    if not inputs_embeds.is_floating_point() or (inputs_embeds.dtype != table_dtype and not autocast):
        raise ValueError(
            f"`{embeds_name}` has dtype {inputs_embeds.dtype}: expected the model's {table_dtype} "
            f"(e.g. `{embeds_name}.to({table_dtype})`)."
        )
    return inputs_embeds.shape[0], inputs_embeds.shape[1]


def _check_position_ids(
    position_ids: torch.Tensor | None, config: LongAttnConfig, *, batch: int, length: int, device: torch.device
) -> None:
    """`position_ids`, when given: integer `[b, n]` or `[1, n]` on the inputs' device; with learned positions, in
    [0, max_position_embeddings) (they index a table).

    Raises:
        ValueError: naming `position_ids`, its shape, dtype, device or offending value.
    """
    if position_ids is None:
        return
    check_tensor_on("position_ids", position_ids, device)
    if position_ids.dim() != 2 or position_ids.shape[0] not in (1, batch) or position_ids.shape[1] != length:
        raise ValueError(
            f"`position_ids` has shape {list(position_ids.shape)}: expected [batch, length] = "
            f"[{batch}, {length}] (or [1, {length}])."
        )
    if not _is_integer(position_ids):
        raise ValueError(f"`position_ids` has dtype {position_ids.dtype}: expected integer positions (torch.long).")
    if config.position_embedding_type == "learned":
        _check_range("position_ids", position_ids, config.max_position_embeddings, "max_position_embeddings")


IGNORE_INDEX = -100  # a label position the loss skips (PyTorch's cross-entropy default, transformers' convention)


def _check_labels(
    name: str,
    labels: torch.Tensor | None,
    shapes: list[tuple[int, ...]],
    *,
    integer: bool = True,
    classes: int | None = None,
    what: str = "num_labels",
) -> None:
    """Raise `ValueError` unless `labels` (when given) is a tensor of one of `shapes`, of an integer dtype when
    `integer`, holding class ids in [0, `classes`) or -100 (ignored) when `classes` is given (`what` names that
    limit). The range is read once per forward, as token ids are, and not while `torch.compile` traces (see
    `_check_range`)."""
    if labels is None:
        return
    if not isinstance(labels, torch.Tensor):
        raise ValueError(f"`{name}` must be a torch.Tensor, got {type(labels).__name__}.")
    if tuple(labels.shape) not in [tuple(shape) for shape in shapes]:
        expected = " or ".join(str(list(shape)) for shape in shapes)
        raise ValueError(f"`{name}` has shape {list(labels.shape)}: expected {expected}.")
    if integer and not _is_integer(labels):
        raise ValueError(f"`{name}` has dtype {labels.dtype}: expected integer class ids (torch.long; -100 = ignored).")
    if classes is None or labels.numel() == 0 or torch.compiler.is_compiling():
        return
    counted = labels.masked_fill(labels == IGNORE_INDEX, 0)  # an ignored position is in range
    low, high = (int(value) for value in torch.aminmax(counted))
    if low < 0 or high >= classes:
        bad = low if low < 0 else high
        raise ValueError(
            f"`{name}` holds {bad}: expected class ids in [0, {classes}) ({what}={classes}) or {IGNORE_INDEX} "
            "(ignored)."
        )


def _position_ids(attention_mask: torch.Tensor | None, *, batch: int, past: int, length: int, device) -> torch.Tensor:
    """Positions of the new tokens `[b, n]`: counted over real tokens, so that left padding does not shift them."""
    if attention_mask is None:
        return torch.arange(past, past + length, device=device).expand(batch, length)
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)[:, -length:]


def _run_backbone(
    embeddings: LongAttnEmbeddings,
    rotary: LongAttnRotaryEmbedding | None,
    stack: LongAttnStack,
    config: LongAttnConfig,
    *,
    input_ids: torch.Tensor | None = None,
    inputs_embeds: torch.Tensor | None = None,
    attention_mask: torch.Tensor | None = None,
    global_attention_mask: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    past_key_values: Cache | None = None,
    encoder_hidden_states: torch.Tensor | None = None,
    encoder_attention_mask: torch.Tensor | None = None,
    output_hidden_states: bool | None = None,
    output_attentions: bool | None = None,
    prefix: str = "",
    **varlen: torch.Tensor | None,
) -> BaseModelOutputWithPastAndCrossAttentions:
    """Validate inputs, embed, add positions, and run `stack`: the shared body of every model (`prefix`: the
    arguments' prefix in error messages, "decoder_" for the seq2seq decoder).

    Packed rows (several documents per row) are recognised once here, from `position_ids` that restart or the
    varlen keywords `cu_seq_lens_q` / `cu_seq_lens_k` (`varlen`, as `longattn.packing.packed_document_ids` takes
    them), and their `document_ids` `[b, n]` go to every layer; positions (learned or rotary) restart per
    document."""
    batch, length = _check_token_inputs(config, embeddings, input_ids, inputs_embeds, prefix=prefix)
    device = (input_ids if input_ids is not None else inputs_embeds).device
    _check_position_ids(position_ids, config, batch=batch, length=length, device=device)
    if inputs_embeds is None:
        inputs_embeds = embeddings.word_embeddings(input_ids)
    past = past_key_values.get_seq_length() if past_key_values is not None else 0
    if past + length > config.max_position_embeddings:
        raise ValueError(
            f"sequence length {past + length} exceeds `max_position_embeddings`={config.max_position_embeddings}: "
            f"pass at most {config.max_position_embeddings} tokens or build the model with a larger limit."
        )
    attention_mask = check_input_mask(
        attention_mask, name=f"{prefix}attention_mask", batch=batch, length=past + length, device=device
    )
    global_attention_mask = check_input_mask(
        global_attention_mask, name="global_attention_mask", batch=batch, length=past + length, device=device
    )
    if encoder_hidden_states is not None:
        encoder_attention_mask = check_input_mask(
            encoder_attention_mask,
            name="encoder_attention_mask",
            batch=batch,
            length=encoder_hidden_states.shape[1],
            device=device,
        )
    document_ids = None
    if past == 0:  # with a cache the new tokens continue the cached ones: packing is a training-time layout
        document_ids = packed_document_ids(
            position_ids=position_ids, batch=batch, length=length, attention_mask=attention_mask, **varlen
        )
    if position_ids is None and document_ids is not None:  # varlen keywords alone: positions restart per document
        position_ids = torch.arange(length, device=device) - document_starts(document_ids)
    if position_ids is None:
        position_ids = _position_ids(attention_mask, batch=batch, past=past, length=length, device=inputs_embeds.device)
    hidden_states = embeddings(inputs_embeds, position_ids)
    position_embeddings = rotary(position_ids) if rotary is not None else None
    return stack(
        hidden_states,
        attention_mask=attention_mask,
        global_attention_mask=global_attention_mask,
        position_embeddings=position_embeddings,
        encoder_hidden_states=encoder_hidden_states,
        encoder_attention_mask=encoder_attention_mask,
        past_key_values=past_key_values,
        output_hidden_states=_flag(config, "output_hidden_states", output_hidden_states),
        output_attentions=_flag(config, "output_attentions", output_attentions),
        document_ids=document_ids,
    )


VARLEN_KWARGS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")
"""transformers' keywords for packed (varlen) attention, as `DataCollatorWithFlattening(return_flash_attn_kwargs=True)`
produces them; the lengths are read from `cu_seq_lens_*` (the maxima only size flash kernels)."""


def _varlen_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    """The varlen keywords among a forward's `kwargs`, to pass on to the backbone."""
    return {name: kwargs[name] for name in VARLEN_KWARGS if kwargs.get(name) is not None}


def _is_packed(
    position_ids: Any, varlen: dict[str, Any], *, batch: int | None = None, length: int | None = None
) -> bool:
    """Whether a model that cannot pack (classification, encoder-decoder) is given packed documents. Invalid
    `position_ids` are not packed here: the backbone refuses them, naming the argument."""
    if varlen:
        return True
    if not isinstance(position_ids, torch.Tensor) or position_ids.dim() != 2 or not _is_integer(position_ids):
        return False
    batch = position_ids.shape[0] if batch is None else batch
    length = position_ids.shape[1] if length is None else length
    if position_ids.shape[0] not in (1, batch) or position_ids.shape[1] != length:
        return False
    return packed_document_ids(position_ids=position_ids, batch=batch, length=length) is not None


def _flag(config: LongAttnConfig, name: str, value: bool | None) -> bool:
    """The caller's flag `value`, or the config's field `name` where it is None."""
    return bool(value if value is not None else getattr(config, name))


def _return_dict(model: PreTrainedModel, return_dict: bool | None) -> bool:
    return return_dict if return_dict is not None else model.config.return_dict
