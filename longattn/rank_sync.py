"""Keeping the per-rank state of attention kinds in step under data parallelism (DDP, FSDP, DeepSpeed).

Most kinds hold nothing but parameters, which the engine keeps identical on every rank. Two kinds also hold state
that each rank would otherwise compute on its own shard of the batch:

- LSH draws fresh random rotations in every training forward. Each rank draws from its own generator (the recipes
  seed dropout per process), so the ranks would hash their halves of one global batch with different functions:
  `same_on_every_rank` sends rank 0's draw to all ranks, so a global batch is hashed as one process would hash it.
- Routing moves its centroids by k-means statistics (sums and counts of the vectors each centroid holds).
  `sum_over_ranks` adds them up across ranks, so every rank takes the same step, that of the whole global batch
  (DDP would otherwise overwrite the other ranks' centroids with rank 0's before each forward, and FSDP, which does
  not broadcast buffers, would let them drift apart).

Both are collectives on the default process group: every rank must run the same training forwards and backwards, as
data parallelism requires anyway. Without `torch.distributed`, or with a single process, they do nothing.

This module imports only torch.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["is_multi_process", "same_on_every_rank", "sum_over_ranks"]


def is_multi_process() -> bool:
    """Whether a `torch.distributed` process group with more than one process is initialised."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


@torch.no_grad()
def same_on_every_rank(tensor: Tensor) -> Tensor:
    """`tensor` as rank 0 holds it, on every rank (in place; a broadcast when several processes run)."""
    if is_multi_process():
        dist.broadcast(tensor, src=0)
    return tensor


@torch.no_grad()
def sum_over_ranks(*tensors: Tensor) -> tuple[Tensor, ...]:
    """Each tensor summed over all ranks (in place; an all-reduce when several processes run)."""
    if is_multi_process():
        for tensor in tensors:
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensors
