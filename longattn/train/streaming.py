"""Streamed training data (`--streaming`): a `datasets.IterableDataset` read while training, never held whole.

- `StreamingSplits`: the splits of a streamed run, the training stream and the evaluation split (read into memory:
  an evaluation scores the same examples every time, so it is bounded, e.g. by --max_eval_samples); `map` maps both,
  like `DatasetDict.map`.
- `stream_for_process`: one process's share of the training stream, shuffled through a buffer.
- `stream_loader`: its DataLoader, on the process's device, that accelerate does not shard a second time.
- `common_group` and `skip_examples`: the processes end a pass together, and a resumed process replays its stream.

Resuming is exact by replay. `IterableDataset.state_dict()` records where the stream is in its files but not what the
shuffle buffer holds: a stream restored from it refills the buffer with later examples, so the examples that sat in
the buffer at the checkpoint are never trained on and the order differs from the uninterrupted run. Instead a
checkpoint records the pass (`epoch`) and, per process, how many examples that process has consumed in it; a resumed
run builds the same stream (same seed and pass: the same shard order and the same buffer draws), reads and discards
that many examples, and goes on with exactly the batches the uninterrupted run had. The price is reading (and
tokenizing) the consumed part of the current pass again, without training on it.

Nothing here imports `datasets` or `accelerate` at import time.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch


def is_stream(dataset) -> bool:
    """Whether `dataset` is read as a stream (a torch `IterableDataset`, which `datasets.IterableDataset` is)."""
    return isinstance(dataset, torch.utils.data.IterableDataset)


def num_examples(dataset) -> int | None:
    """The length of a `Dataset` (or list); None for a stream, whose length is unknown until it is read."""
    return None if is_stream(dataset) else len(dataset)


def is_empty(dataset) -> bool:
    """Whether `dataset` has no row; a stream is peeked (its first row is read, and mapped if it is mapped)."""
    if is_stream(dataset):
        return next(iter(dataset), None) is None
    return len(dataset) == 0


class StreamingSplits(dict):
    """`{"train": IterableDataset, "validation": Dataset}`, mapped like a `DatasetDict`: `map` applies the function
    to every split, the stream lazily (as it is read, in each process: `num_proc` and `desc` do not apply to it)."""

    def map(self, function: Callable, *, num_proc: int | None = None, desc: str | None = None, **kwargs: Any):
        return StreamingSplits(
            {
                split: dataset.map(function, **kwargs)
                if is_stream(dataset)
                else dataset.map(function, num_proc=num_proc, desc=desc, **kwargs)
                for split, dataset in self.items()
            }
        )


def stream_for_process(dataset, *, seed: int, buffer_size: int, rank: int, world_size: int):
    """The share of a training stream that process `rank` of `world_size` reads, shuffled.

    Args:
        dataset: A `datasets.IterableDataset`.
        seed: The shuffling seed, the same in every process: `split_dataset_by_node` hands out the shards after
            their order was shuffled, so every process must shuffle it alike.
        buffer_size: Examples in the shuffle buffer; 0 reads the stream in its order.
        rank / world_size: This process and the number of processes.

    Returns:
        A `datasets.IterableDataset`: whole shards (files) per process when their number is a multiple of
        `world_size`, else every `world_size`-th example (each process then reads the whole stream). Every example
        goes to exactly one process; the processes' shares may differ in length by up to a shard. `set_epoch(e)`
        reshuffles the shard order and the buffer for pass `e`.
    """
    from datasets.distributed import split_dataset_by_node

    if buffer_size:
        dataset = dataset.shuffle(seed=seed, buffer_size=buffer_size)
    return split_dataset_by_node(dataset, rank=rank, world_size=world_size) if world_size > 1 else dataset


def stream_loader(dataloader: torch.utils.data.DataLoader, *, device: torch.device):
    """`dataloader` (over this process's `stream_for_process`) with accelerate's device placement, `set_epoch` and
    batch skipping, prepared for this process alone.

    It must not go through `accelerator.prepare`: a `datasets.IterableDataset` is a torch `IterableDataset`, so by
    default accelerate reads the whole stream on rank 0 and sends each process its slice of every batch
    (`dispatch_batches`; it also refuses batches padded to different lengths), and with `dispatch_batches=False` it
    shards the dataset itself (`IterableDataset.shard` or `IterableDatasetShard`). Either way, on top of
    `split_dataset_by_node` a process would get only part of its own share, and the rest of the data would be
    silently dropped (tests/test_streaming.py sees it in the processes' positions). So each process reads its own
    share (`dispatch_batches=False`) and accelerate is told there is one process (no second split).
    """
    from accelerate.data_loader import prepare_data_loader

    return prepare_data_loader(
        dataloader, device=device, num_processes=1, process_index=0, put_on_device=True, dispatch_batches=False
    )


def batch_rows(batch: dict[str, torch.Tensor]) -> int:
    """The examples in a collated batch."""
    return len(next(iter(batch.values())))


def common_group(group: list[dict[str, torch.Tensor]], accelerator) -> list[dict[str, torch.Tensor]]:
    """The micro-batches of `group` that every process has: the processes' shares of a stream need not be equally
    long, and a process whose share has ended cannot take part in the next optimizer step (the gradient all-reduce
    would wait for it forever). So a pass ends for all processes when the first runs out; the other processes'
    remaining examples of that pass are not used (a new pass reshuffles and reads them again)."""
    if accelerator.num_processes == 1:
        return group
    sizes = accelerator.gather(torch.tensor([len(group)], device=accelerator.device))  # [num_processes]
    return group[: int(sizes.min())]


def skip_examples(batches: Iterator[dict[str, torch.Tensor]], count: int) -> tuple[int, int]:
    """Read and discard the batches holding the first `count` examples of `batches` (a resumed process replaying
    its stream); return (batches, examples) discarded. More examples than `count` (a batch that straddles it) or
    fewer (the stream ended first) mean the stream is not the one the checkpoint was written with."""
    skipped_batches = skipped = 0
    while skipped < count and (batch := next(batches, None)) is not None:  # never reads a batch beyond `count`
        skipped_batches += 1
        skipped += batch_rows(batch)
    return skipped_batches, skipped


__all__ = [
    "is_stream",
    "num_examples",
    "is_empty",
    "StreamingSplits",
    "stream_for_process",
    "stream_loader",
    "batch_rows",
    "common_group",
    "skip_examples",
]
