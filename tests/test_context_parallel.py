"""Context parallelism for the sliding family (`longattn.context_parallel`): a sequence split across 2 and 3 CPU
processes (gloo) gives the single-process model's outputs, loss, gradients and optimizer step (fp32, 1e-5).

Each run forks its processes once and goes through every case in them: every rank builds the same tiny model and
batch, computes the single-process reference itself, then its own chunk with context parallelism, and compares.
Cases: a bidirectional MLM with per-head dilation, two global tokens and padding (learned absolute positions); a
causal LM with rotary positions, a global token, a halo longer than a chunk (fetched from ranks further away) and
activation checkpointing; the recipes' step (`training.accumulation_step`, 2 micro-batches) on a 2 x 2 (dp, cp)
mesh: the loss and the gradient scale of one process over every data-parallel batch. The whole recipe against one
process is `slow`.
"""

from __future__ import annotations

import contextlib
import copy
import datetime
import json
import re

import pytest
import torch
import torch.distributed as dist
from child_processes import start_ranks
from kind_configs import tiny_config
from test_recipes import TINY, datasets_dir, recipe_args, run, skip_unless_selected  # noqa: F401 (a fixture)

from longattn import LongAttnForCausalLM, LongAttnForMaskedLM
from longattn.train import training
from longattn.train.context_parallel import (
    check_context_parallel,
    chunk_bounds,
    enable_context_parallel,
    init_context_parallel,
    reduce_gradients,
    shard_batch,
)

TOLERANCE = dict(atol=1e-5, rtol=1e-5)


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
    if causal:  # activation checkpointing: backward runs each layer's exchanges again
        sharded.activation_checkpointing_enable()
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


class _Processes:
    """The members of an `Accelerator` that `training.accumulation_step` uses, over every launched process."""

    num_processes = property(lambda self: dist.get_world_size())
    device = torch.device("cpu")

    def reduce(self, tensor, reduction):
        total = tensor.clone()
        dist.all_reduce(total)
        return total if reduction == "sum" else total / self.num_processes

    class gradient_state:  # noqa: N801 (accelerate's attribute name)
        @staticmethod
        def _set_sync_gradients(flag):
            pass

    def no_sync(self, model):
        return contextlib.nullcontext()

    def backward(self, loss):
        loss.backward()


def _check_training_step(cp):
    """The recipes' step (`training.accumulation_step`, 2 micro-batches) on the (dp, cp) mesh: loss and gradients
    of one process over every data-parallel rank's micro-batches, whatever their labelled tokens."""
    model, batch, _ = _clm_case()
    ids = batch["input_ids"]
    micro_batches = []  # [dp][2]
    for i in range(2 * cp.dp_size):
        labels = torch.roll(ids, i, dims=0)
        labels[:, : 5 * i + 3] = -100  # a different number of labelled tokens in each micro-batch
        global_mask = torch.zeros_like(ids)
        global_mask[i % 2, 7 * i] = 1
        micro_batches.append(
            dict(input_ids=torch.roll(ids, i, dims=1), global_attention_mask=global_mask, labels=labels)
        )
    targets = sum(int(mb["labels"][:, 1:].ne(-100).sum()) for mb in micro_batches)
    loss = 0.0
    for mb in micro_batches:
        out = model(**mb, num_items_in_batch=torch.tensor(targets))
        out.loss.backward()
        loss += out.loss.item()

    sharded = copy.deepcopy(model)
    sharded.zero_grad()
    enable_context_parallel(sharded, cp)
    mine = micro_batches[2 * cp.dp_rank : 2 * cp.dp_rank + 2]
    step_loss = training.accumulation_step(
        _Processes(), sharded, mine, use_num_items=True, shifted_labels=True, seeds=[0, 0], context_parallel=cp
    )
    assert abs(step_loss - loss) < 1e-5, (step_loss, loss)
    for (name, param), reference in zip(sharded.named_parameters(), model.parameters()):
        torch.testing.assert_close(param.grad, reference.grad, **TOLERANCE, msg=lambda m, name=name: f"{name}: {m}")


def _check_refusals(cp):
    model, batch, _ = _mlm_case()
    enable_context_parallel(model, cp)
    with pytest.raises(ValueError, match="output_attentions"):
        model(**shard_batch(batch, cp, causal=False), output_attentions=True)
    with pytest.raises(ValueError, match=f"cannot be split across {cp.size} ranks"):
        shard_batch({"input_ids": torch.zeros(1, cp.size - 1, dtype=torch.long)}, cp, causal=False)
    # Packed rows (positions restarting in every rank's chunk): a rank's halo would read other documents' keys.
    packed = dict(batch, position_ids=torch.arange(batch["input_ids"].shape[1]).expand_as(batch["input_ids"]) % 10)
    with pytest.raises(ValueError, match="context parallelism cannot run packed documents"):
        model(**shard_batch(packed, cp, causal=False))


def _worker(rank: int, world: int, store: str, cp_size: int) -> None:
    torch.set_num_threads(1)
    # A file store: no port that a parallel test could take between choosing it and binding it.
    dist.init_process_group(
        "gloo", init_method=f"file://{store}", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60)
    )
    try:
        cp = init_context_parallel(cp_size)
        if cp.dp_size == 1:
            _check_case(_mlm_case, cp)
            _check_case(_clm_case, cp)
        if world == 2:
            _check_refusals(cp)
        if cp.dp_size > 1:
            _check_training_step(cp)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(
    "world, cp_size",
    [(2, 2), (3, 3), (4, 2)],
    ids=["2 ranks", "3 ranks", "dp 2 x cp 2"],
)
def test_context_parallel_equals_one_process(world, cp_size, tmp_path):
    # Each rank sets one thread before any torch op.
    start_ranks(_worker, args=(world, str(tmp_path / "store"), cp_size), nprocs=world)


@pytest.mark.parametrize(
    "fields, message",
    [
        (
            dict(attention_type=["sliding", "full"]),
            "layer longattn.encoder.layers.1.self_attn has `attention_type`='full'",
        ),
        (dict(attention_type="sliding", attention_backend="reference"), "attention_backend"),
        (dict(attention_type="sliding", relative_position_logits=True), "relative_position_logits"),
    ],
)
def test_kinds_without_a_halo_are_refused(fields, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        check_context_parallel(LongAttnForMaskedLM(tiny_config(**fields)))


def test_recipe_refuses_context_parallel_it_cannot_run(tmp_path):
    parser = training.recipe_parser(None, task="classification")
    argv = ["--train_file", str(tmp_path / "x.jsonl"), "--output_dir", str(tmp_path), "--context_parallel", "2"]
    (tmp_path / "x.jsonl").write_text("{}\n")
    with pytest.raises(training.RecipeError, match="only run_mlm.py and run_clm.py"):
        training.parse_args(parser, argv)


def test_chunk_bounds_split_like_tensor_split():
    for length, size in [(61, 2), (55, 3), (7, 7), (10, 4)]:
        bounds = chunk_bounds(length, size)
        sizes = [len(part) for part in torch.arange(length).tensor_split(size)]
        assert [b - a for a, b in zip(bounds, bounds[1:])] == sizes


@pytest.mark.slow
def test_recipe_with_context_parallel_logs_the_losses_of_one_process(datasets_dir, tmp_path, request):  # noqa: F811
    """run_clm.py on 2 processes with --context_parallel 2 (one sequence split in two) against one process: the
    same losses at every step and the same evaluation."""
    skip_unless_selected(request)
    logs = []
    no_dropout = ("--config_overrides", TINY + ",hidden_dropout_prob=0,attention_probs_dropout_prob=0")
    for processes, extra in ((1, ()), (2, ("--context_parallel", "2"))):
        output_dir = tmp_path / f"run_{processes}"
        args = recipe_args("clm", datasets_dir, output_dir, "--max_train_steps", "3", "--logging_steps", "1")
        args += [*no_dropout, *extra]
        done = run("clm", args, processes=processes)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
        logs.append([json.loads(line) for line in (output_dir / "train_log.jsonl").read_text().splitlines()])
    one, split = logs
    assert [sorted(record) for record in one] == [sorted(record) for record in split]
    for expected, actual in zip(one, split):
        for key, value in expected.items():
            assert actual[key] == pytest.approx(value, rel=1e-5, abs=1e-6), (key, expected, actual)


def test_the_halo_comes_from_the_neighbours_or_from_further_when_longer_than_a_chunk():
    from longattn.context_parallel import _Shard

    def halos(reach: int, rank: int) -> dict[int, tuple[int, int]]:
        bounds = [0, 20, 40, 60]
        shard = _Shard(
            bounds=bounds,
            left=[min(reach, bounds[r]) for r in range(3)],
            right=[min(reach, 60 - bounds[r + 1]) for r in range(3)],
            rank=rank,
        )
        ranges = {owner: shard.needs(rank, owner) for owner in range(3)}
        return {owner: (lo, hi) for owner, (lo, hi) in ranges.items() if lo < hi}

    assert halos(5, 1) == {0: (15, 20), 2: (40, 45)}  # only the neighbours' edges
    assert halos(5, 0) == {1: (20, 25)}
    assert halos(30, 2) == {0: (10, 20), 1: (20, 40)}  # 30 keys: past the neighbour, from rank 0 directly
