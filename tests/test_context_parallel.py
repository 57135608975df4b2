"""Context parallelism for the sliding family (`longattn.context_parallel`): a sequence split across 2 and 3 CPU
processes (gloo) gives the single-process model's outputs, loss, gradients and optimizer step (fp32, 1e-5).

Each run spawns its processes once and goes through every case in them (process start-up costs more than the cases):
every rank builds the same tiny model and batch, computes the single-process reference itself, then its own chunk
with context parallelism, and compares. Cases: a bidirectional MLM with per-head dilation, two global tokens and
padding (learned absolute positions); a causal LM with rotary positions, a global token and a halo longer than a
chunk (fetched from ranks further away); the recipe's training step on a (dp, cp) mesh (gradient scale against one
process, with `--gradient_accumulation_steps`).
"""

from __future__ import annotations

import copy
import datetime
import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from kind_configs import tiny_config

from longattn import LongAttnForCausalLM, LongAttnForMaskedLM
from longattn.context_parallel import (
    chunk_bounds,
    enable_context_parallel,
    init_context_parallel,
    reduce_gradients,
    shard_batch,
)

TOLERANCE = dict(atol=1e-5, rtol=1e-5)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _mlm_case():
    config = tiny_config(
        "sliding",
        num_attention_heads=4,
        sliding_window=4,
        sliding_dilation=[1, 2, 1, 3],
        position_embedding_type="learned",
    )
    torch.manual_seed(0)
    model = LongAttnForMaskedLM(config)
    length = 61
    ids = torch.randint(4, 50, (2, length))
    attention_mask = torch.ones(2, length, dtype=torch.long)
    attention_mask[1, -7:] = 0
    global_mask = torch.zeros(2, length, dtype=torch.long)
    global_mask[:, 0] = 1
    global_mask[0, 33] = 1
    labels = torch.where(torch.rand(2, length) < 0.3, ids, torch.full_like(ids, -100))
    labels[attention_mask == 0] = -100
    batch = dict(input_ids=ids, attention_mask=attention_mask, global_attention_mask=global_mask, labels=labels)
    return model, batch, False


def _clm_case():
    # reach = 10 * 3 = 30 tokens: more than a chunk of 55 / 2 or 55 / 3 tokens.
    config = tiny_config("sliding", num_attention_heads=2, sliding_window=10, sliding_dilation=[1, 3])
    torch.manual_seed(1)
    model = LongAttnForCausalLM(config)
    length = 55
    ids = torch.randint(4, 50, (2, length))
    global_mask = torch.zeros(2, length, dtype=torch.long)
    global_mask[1, 20] = 1
    return model, dict(input_ids=ids, global_attention_mask=global_mask, labels=ids.clone()), True


def _reference(model, batch, causal):
    """Loss, logits and gradients of the whole batch on one process (loss: mean over the labelled tokens)."""
    model.zero_grad()
    out = model(**batch)
    out.loss.backward()
    return out.loss.detach(), out.logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _check_case(make_case, cp):
    model, batch, causal = make_case()
    loss, logits, grads = _reference(model, batch, causal)

    sharded = copy.deepcopy(model)
    enable_context_parallel(sharded, cp)
    local = shard_batch(batch, cp, causal=causal)
    targets = local["shift_labels"] if causal else local["labels"]
    count = targets.ne(-100).sum()
    dist.all_reduce(count, group=cp.group)
    out = sharded(**local, num_items_in_batch=count)
    start, stop = chunk_bounds(batch["input_ids"].shape[1], cp.size)[cp.rank : cp.rank + 2]
    torch.testing.assert_close(out.logits, logits[:, start:stop], **TOLERANCE)
    out.loss.backward()
    total = out.loss.detach().clone()
    dist.all_reduce(total, group=cp.group)
    torch.testing.assert_close(total, loss, **TOLERANCE)
    reduce_gradients(sharded, cp.group)
    for name, param in sharded.named_parameters():
        torch.testing.assert_close(param.grad, grads[name], **TOLERANCE, msg=lambda m, name=name: f"{name}: {m}")

    # One optimizer step from those gradients: the same weights. SGD, since Adam divides each gradient by its own
    # size: one that is 0 in exact arithmetic (the key bias, which softmax ignores) is rounding noise of either sign
    # that Adam turns into a full step.
    for net in (model, sharded):
        torch.optim.SGD(net.parameters(), lr=0.5).step()
    for (name, after), reference in zip(sharded.named_parameters(), model.parameters()):
        torch.testing.assert_close(after, reference, **TOLERANCE, msg=lambda m, name=name: f"{name}: {m}")


def _worker(rank: int, world: int, port: int, cp_size: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
    try:
        cp = init_context_parallel(cp_size)
        _check_case(_mlm_case, cp)
        _check_case(_clm_case, cp)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 3])
def test_context_parallel_equals_one_process(world):
    mp.spawn(_worker, args=(world, _free_port(), world), nprocs=world)


def test_chunk_bounds_split_like_tensor_split():
    for length, size in [(61, 2), (55, 3), (7, 7), (10, 4)]:
        bounds = chunk_bounds(length, size)
        sizes = [len(part) for part in torch.arange(length).tensor_split(size)]
        assert [b - a for a, b in zip(bounds, bounds[1:])] == sizes
