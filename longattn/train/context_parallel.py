"""Context parallelism at the model and training-step level: turning it on for a longattn model (each sliding layer
gets the group, the base model a forward pre-hook that fills in global `position_ids`), the model checks, cutting a
batch into this rank's chunk, and summing the gradients. The attention itself (the process group / device mesh, the
halo exchange, the global tokens) is `longattn.context_parallel`, flat beside the sliding kind that calls it, since a
Hub folder carries it; this module sits above the model it hooks, beside the recipes' loop that uses it.

A training step with context parallelism:

    from longattn.train.context_parallel import (
        enable_context_parallel, init_context_parallel, reduce_gradients, shard_batch,
    )

    cp = init_context_parallel(2)                           # a (dp, cp) device mesh over the launched processes
    enable_context_parallel(model, cp)                      # the sliding layers attend across the cp group
    batch = shard_batch(batch, cp, causal=True)             # every rank of a cp group starts from the same batch
    loss = model(**batch, num_items_in_batch=global_count).loss   # normalised by the labelled tokens of all shards
    loss.backward()
    reduce_gradients(model)                                 # summed over every process (see its docstring)

Positions: `enable_context_parallel` makes the base model fill in global `position_ids` (absolute and rotary alike)
when none are passed. Causal LM labels are shifted before the split (`shard_batch`), since the target of a chunk's
last token is the next chunk's first.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ..attention_base import LongAttnAttention
from ..context_parallel import CONTEXT_PARALLEL_KINDS, ContextParallel, chunk_bounds, init_context_parallel
from ..modeling_longattn import LongAttnModel

__all__ = [
    "CONTEXT_PARALLEL_KINDS",
    "ContextParallel",
    "check_context_parallel",
    "chunk_bounds",
    "context_parallel_paused",
    "enable_context_parallel",
    "init_context_parallel",
    "reduce_gradients",
    "shard_batch",
]


# ------------------------------------------------------------------------------------------------ sharding a batch
def shard_batch(batch: Mapping[str, Tensor], cp: ContextParallel, *, causal: bool) -> dict[str, Tensor]:
    """This rank's chunk of every per-token tensor of `batch` (`[b, N, ...]`: ids, masks, labels, positions);
    other entries (a classification label, `num_items_in_batch`) stay as they are.

    With `causal`, `labels` become `shift_labels` before the split (the target of position i is token i + 1, which
    may sit on the next rank), as transformers' padding-free collators pass them.

    Raises:
        ValueError: no `input_ids` / `inputs_embeds`, or fewer tokens than ranks.
    """
    ids = batch.get("input_ids", batch.get("inputs_embeds"))
    if ids is None:
        raise ValueError(f"shard_batch: the batch has no `input_ids` or `inputs_embeds` (keys: {sorted(batch)}).")
    length = ids.shape[1]
    if length < cp.size:
        raise ValueError(f"shard_batch: a sequence of {length} tokens cannot be split across {cp.size} ranks.")
    batch = dict(batch)
    if causal and "labels" in batch:
        labels = batch.pop("labels")
        batch["shift_labels"] = torch.nn.functional.pad(labels[:, 1:], (0, 1), value=-100)
    start, stop = chunk_bounds(length, cp.size)[cp.rank : cp.rank + 2]
    return {
        key: value[:, start:stop]
        if isinstance(value, Tensor) and value.dim() >= 2 and value.shape[1] == length
        else value
        for key, value in batch.items()
    }


def reduce_gradients(model: nn.Module, group: dist.ProcessGroup | None = None) -> None:
    """Sum every parameter's gradient over `group` (default: every process).

    Each rank's backward leaves its share of the gradient of the *sum* of the ranks' losses: within a
    context-parallel group the shares add up to the single-process gradient. Across data-parallel ranks, a loss
    normalised by the labelled tokens of every rank's batch (`num_items_in_batch` counted over all processes) makes
    the sum the gradient of the mean over the global batch, as DDP's average of losses scaled by the number of
    processes does. accelerate's prepared model cannot do this: its DDP averages over every process, dividing the
    context-parallel sum by the group size.
    """
    for param in model.parameters():
        if param.grad is not None:
            dist.all_reduce(param.grad, op=dist.ReduceOp.SUM, group=group)


# ------------------------------------------------------------------------------------------------ the model hooks
def check_context_parallel(model: nn.Module) -> None:
    """Raise `ValueError` unless every attention layer of `model` can run context-parallel.

    Raises:
        ValueError: a layer whose kind is not in `CONTEXT_PARALLEL_KINDS` (naming it), an `attention_backend` other
            than "auto" or "torch" (context parallelism has its own executor), or an encoder-decoder model.
    """

    if not any(isinstance(module, LongAttnModel) for module in model.modules()):
        raise ValueError(
            f"context parallelism: {type(model).__name__} is not a longattn model (LongAttnModel or a LongAttnFor* "
            "head); stock transformers models running longattn's kinds are not supported."
        )
    config = model.config
    if getattr(config, "is_encoder_decoder", False):
        raise ValueError(
            "context parallelism: encoder-decoder models are not supported (the decoder's cross-attention sees the "
            "whole encoder output)."
        )
    backend = getattr(config, "attention_backend", "auto")
    if backend not in ("auto", "torch"):
        raise ValueError(
            f"context parallelism: `attention_backend`={backend!r} cannot run it; use 'auto' or 'torch' (the blocked "
            "executor runs each shard)."
        )
    for name, module in model.named_modules():
        if not isinstance(module, LongAttnAttention):
            continue
        if module.attention_type not in CONTEXT_PARALLEL_KINDS:
            raise ValueError(
                f"context parallelism: layer {name} has `attention_type`={module.attention_type!r}; only "
                f"{list(CONTEXT_PARALLEL_KINDS)} can split a sequence across processes (a bounded window exchanges a "
                "halo; full attention would need ring attention, see the `longattn.context_parallel` docstring)."
            )
        if getattr(module, "relative_embedding", None) is not None:
            raise ValueError(
                f"context parallelism: layer {name} has `relative_position_logits`, which the context-parallel "
                "executor does not add; train it on one process per sequence."
            )


def enable_context_parallel(model: nn.Module, cp: ContextParallel | None) -> None:
    """Make `model` (a longattn model) attend across `cp`: each sliding layer gets the group, and the base model
    fills in global `position_ids` when none are given. `cp=None` turns it off again.

    Raises:
        ValueError: as `check_context_parallel`.
    """

    if cp is not None:
        check_context_parallel(model)
    for module in model.modules():
        if isinstance(module, LongAttnAttention):
            module.context_parallel = cp
        if isinstance(module, LongAttnModel):
            module.context_parallel = cp
            if cp is not None and not hasattr(module, "_context_parallel_hook"):
                module._context_parallel_hook = module.register_forward_pre_hook(_global_positions, with_kwargs=True)


@contextlib.contextmanager
def context_parallel_paused(model: nn.Module) -> Iterator[None]:
    """Run `model` on whole sequences inside the block (evaluation, where every process takes its own batch), with
    context parallelism as it was afterwards."""

    cp = next((getattr(m, "context_parallel", None) for m in model.modules() if isinstance(m, LongAttnModel)), None)
    if cp is None:
        yield
        return
    enable_context_parallel(model, None)
    try:
        yield
    finally:
        enable_context_parallel(model, cp)


def _global_positions(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """A forward pre-hook of `LongAttnModel` giving it the global `position_ids` of this rank's chunk: those of the
    single-process model (counted over real tokens, as `modeling_inputs._position_ids`)."""
    cp = getattr(module, "context_parallel", None)
    if cp is None or kwargs.get("position_ids") is not None or len(args) > 1:
        return args, kwargs
    ids = args[0] if args else kwargs.get("input_ids")
    ids = ids if ids is not None else kwargs["inputs_embeds"]
    batch, length = ids.shape[:2]
    mask = kwargs.get("attention_mask")
    counts = torch.full((batch,), length, device=ids.device) if mask is None else mask.bool().sum(dim=1)
    before = _gather_rows(counts[:, None].long(), cp)[:, : cp.rank].sum(dim=1, keepdim=True)  # [b, 1]
    if mask is None:
        positions = before + torch.arange(length, device=ids.device)
    else:
        positions = (before + mask.long().cumsum(-1) - 1).clamp(min=0)
    return args, {**kwargs, "position_ids": positions}


def _gather_rows(x: Tensor, cp: ContextParallel) -> Tensor:
    """`[b, k]` from every rank of the group, side by side in rank order: `[b, P·k]` (no gradient)."""
    parts = [torch.empty_like(x) for _ in range(cp.size)]
    dist.all_gather(parts, x.contiguous(), group=cp.group)
    return torch.cat(parts, dim=1)
