"""The training loop: `train` runs epochs of optimizer steps; one step (`train_step`) reads top to bottom here:
gather the micro-batches, prepare them, forward and backward each (`accumulation_step`), clip, step, advance.

With --gradient_accumulation_steps K, one optimizer step is K batches gathered first: their labelled tokens, counted
over all processes, go to the model as `num_items_in_batch` (transformers' convention), so the step's gradient is
that of one batch K times larger."""

from __future__ import annotations

import argparse
import contextlib
import inspect
import itertools
import logging
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from . import context_parallel as cp_lib
from . import streaming
from .checkpoints import (
    TrainState,
    batch_generator,
    begin_run,
    checkpoint_every,
    fault_injection,
    reset_peak_rss,
    save_checkpoint,
)
from .records import LOG_FILE, RecipeError, format_metrics, log_record
from .results import summarize

logger = logging.getLogger(__name__)


def train(
    args: argparse.Namespace,
    accelerator,
    model,
    train_dataset,
    eval_dataset,
    collate_fn: Callable,
    *,
    evaluate: Callable[[Any, Any], dict[str, float]],
    prepare_batch: Callable[[dict[str, torch.Tensor], torch.Generator], dict[str, torch.Tensor]] | None = None,
    eval_collate_fn: Callable | None = None,
) -> dict[str, Any]:
    """Train with checkpoints and resumption, evaluate each epoch (and every --eval_steps), return the results.

    Args:
        args: The parsed recipe flags.
        accelerator: From `make_accelerator`.
        model: The model to train (not yet prepared).
        train_dataset / eval_dataset: Tokenized `datasets.Dataset`s; the training set may be a stream (a
            `datasets.IterableDataset`, --streaming), which needs --max_train_steps (see `longattn.train.streaming`).
        collate_fn: Batches features (`PadCollator` or a task's own).
        evaluate: `(model, eval_dataloader) -> metrics` (keys without the `eval_` prefix); runs on every process.
        prepare_batch: `(batch, generator) -> batch` applied to each training batch before the forward pass, with a
            generator seeded by the batch's position (MLM masking).
        eval_collate_fn: A different collator for evaluation.

    Returns:
        The metrics of the last evaluation (`eval_*`), `train_loss` (mean over every optimizer step of the run,
        resumed parts included), `train_last_loss`, `train_runtime` (seconds in this process), `train_steps`,
        `epochs`, `num_processes`, `ranks_seen` (a gather across processes), `global_batch_size`, the model limits
        and `resumed_from` (the checkpoint, relative to the output folder).
    """
    from tqdm.auto import tqdm

    state = prepare_training(args, accelerator, model, train_dataset, eval_dataset, collate_fn, eval_collate_fn)
    resumed_from = begin_run(args, accelerator, state)
    reset_peak_rss()  # the peak memory recorded is the training's, not the tokenisation's before it
    ranks_seen = accelerator.gather(torch.tensor([accelerator.process_index], device=accelerator.device)).tolist()
    logger.info(
        "training: %s, %d processes %s, global batch %d, %d optimizer steps (%s)",
        "a stream" if state.streaming else f"{len(train_dataset)} examples",
        accelerator.num_processes,
        ranks_seen,
        state.global_batch_size,
        state.max_train_steps,
        "as many passes as they need" if state.streaming else f"{state.num_epochs} epochs",
    )
    progress = tqdm(
        total=state.max_train_steps,
        initial=state.completed_steps,
        desc="train",
        disable=not accelerator.is_local_main_process,
        dynamic_ncols=True,
    )
    start = time.perf_counter()
    for epoch in range(state.epoch, state.num_epochs):
        if state.completed_steps >= state.max_train_steps:
            break
        train_epoch(args, accelerator, state, epoch, evaluate=evaluate, prepare_batch=prepare_batch, progress=progress)
        if args.checkpointing_steps == "epoch":
            save_checkpoint(accelerator, args, state)
        if state.last_eval_step != state.completed_steps:
            run_evaluation(args, accelerator, state, evaluate)
    progress.close()
    if state.last_eval_step is None:  # resumed after the last step: nothing trained, evaluate what was loaded
        run_evaluation(args, accelerator, state, evaluate)
    runtime = time.perf_counter() - start
    if args.with_tracking:
        accelerator.end_training()
    return summarize(
        args,
        accelerator,
        state,
        runtime=runtime,
        ranks_seen=ranks_seen,
        resumed_from=resumed_from,
        train_samples=streaming.num_examples(train_dataset),
        validation_samples=len(eval_dataset),
    )


def train_epoch(
    args: argparse.Namespace,
    accelerator,
    state: TrainState,
    epoch: int,
    *,
    evaluate: Callable,
    prepare_batch: Callable | None,
    progress,
) -> None:
    """The optimizer steps of `epoch` (from the batches a resumed run has not seen yet) until its end or
    `max_train_steps`, with the logging, checkpoints and evaluations due after each step."""
    state.model.train()
    state.train_dataloader.set_epoch(epoch)
    skip = state.batch_in_epoch if epoch == state.epoch else 0
    if state.streaming:
        loader = _replayed_stream(state, skip)
    else:
        loader = iter(accelerator.skip_first_batches(state.train_dataloader, skip) if skip else state.train_dataloader)
    batch_index = skip
    # One optimizer step per group of --gradient_accumulation_steps batches (the last group of an epoch may be
    # shorter), gathered first so that the loss is normalised by the labelled tokens of the whole step.
    while group := _next_group(args, accelerator, state, loader):
        started = time.process_time()
        step_loss = train_step(
            args, accelerator, state, group, epoch=epoch, first_batch=batch_index, prepare_batch=prepare_batch
        )
        state.count_compute(time.process_time() - started)
        batch_index += len(group)
        progress.update(1)
        progress.set_postfix(loss=f"{step_loss:.4f}")
        step = state.completed_steps
        if step % args.logging_steps == 0:
            log_record(
                accelerator,
                Path(args.output_dir) / LOG_FILE,
                {
                    "step": step,
                    "loss": step_loss,
                    "lr": state.lr_scheduler.get_last_lr()[0],
                    "epoch": epoch,
                    "train_cpu_seconds": round(state.train_cpu_seconds, 2),
                },
                args,
            )
        if (every := checkpoint_every(args)) and step % every == 0:
            save_checkpoint(accelerator, args, state)
        fault_injection("LONGATTN_RECIPE_SIGKILL_AT_STEP", step)
        if args.eval_steps and step % args.eval_steps == 0:
            run_evaluation(args, accelerator, state, evaluate)
        if step >= state.max_train_steps:
            break
    else:  # the data ran out before max_train_steps
        if state.streaming:
            _end_stream_pass(state, epoch, batch_index)


def _next_group(args: argparse.Namespace, accelerator, state: TrainState, loader) -> list[dict[str, torch.Tensor]]:
    """The micro-batches of the next optimizer step (fewer at the end of an epoch, none after it); of a stream, as
    many as every process has (`streaming.common_group`)."""
    group = list(itertools.islice(loader, args.gradient_accumulation_steps))
    return streaming.common_group(group, accelerator) if state.streaming else group


def _replayed_stream(state: TrainState, skip: int):
    """The batches of this process's stream for the current pass, after the `skip` batches (`examples_in_epoch`
    examples) a resumed run already trained on: read again and discarded (see `longattn.train.streaming`)."""
    loader = iter(state.train_dataloader)
    if skip:
        replayed = streaming.skip_examples(loader, state.examples_in_epoch)
        if replayed != (skip, state.examples_in_epoch):
            logger.warning(
                "the stream replayed to the checkpoint's position gave %d batches of %d examples where the run had "
                "consumed %d of %d: the data is not what the checkpoint was written with; the resumed run will not "
                "repeat the interrupted one.",
                *replayed,
                skip,
                state.examples_in_epoch,
            )
    return loader


def _end_stream_pass(state: TrainState, epoch: int, batch_index: int) -> None:
    """A pass over the stream ended after `batch_index` batches: the next one starts (reshuffled) at its beginning.

    Raises:
        RecipeError: the pass gave no batch at all (the run would never make a step).
    """
    if batch_index == 0:
        raise RecipeError(
            "the training stream gives no batch (in at least one process's share): it is empty, or (MLM / CLM) "
            "its texts make no block of --max_seq_length tokens."
        )
    if state.epoch == epoch:  # the last step's group was full: `train_step` did not see the end
        state.epoch, state.batch_in_epoch, state.examples_in_epoch = epoch + 1, 0, 0


def train_step(
    args: argparse.Namespace,
    accelerator,
    state: TrainState,
    group: list[dict[str, torch.Tensor]],
    *,
    epoch: int,
    first_batch: int,
    prepare_batch: Callable[[dict[str, torch.Tensor], torch.Generator], dict[str, torch.Tensor]] | None = None,
) -> float:
    """One optimizer step over `group`, the micro-batches `first_batch`, ... of `epoch`: forward and backward
    (`accumulation_step`), clipping, the optimizer and schedule, then the state's position and running loss.

    Returns:
        The step's loss (all processes).
    """
    if prepare_batch is not None:
        # The ranks of a context-parallel group prepare their shared batch alike (the same MLM masking).
        reader = accelerator.process_index if state.context_parallel is None else state.context_parallel.dp_rank
        group = [
            prepare_batch(batch, batch_generator(args.seed, "batch", epoch, first_batch + i, reader))
            for i, batch in enumerate(group)
        ]
    step_loss = accumulation_step(
        accelerator,
        state.model,
        group,
        use_num_items=state.loss_takes_num_items,
        shifted_labels=args.task == "clm",
        seeds=state.step_seeds(epoch, first_batch, len(group)),
        context_parallel=state.context_parallel,
    )
    if args.max_grad_norm > 0:
        accelerator.clip_grad_norm_(state.model.parameters(), args.max_grad_norm)
    state.optimizer.step()
    state.lr_scheduler.step()
    state.optimizer.zero_grad()
    batch_index = first_batch + len(group)
    state.completed_steps += 1
    state.loss_sum += step_loss
    state.loss_count += 1
    state.last_loss = step_loss
    if state.streaming:  # a short group: a process's share of the stream ran out (`streaming.common_group`)
        end_of_epoch = len(group) < args.gradient_accumulation_steps
        state.examples_in_epoch = 0 if end_of_epoch else state.examples_in_epoch + sum(map(streaming.batch_rows, group))
    else:
        end_of_epoch = batch_index >= len(state.train_dataloader)
    state.epoch, state.batch_in_epoch = (epoch + 1, 0) if end_of_epoch else (epoch, batch_index)
    return step_loss


def accumulation_step(
    accelerator,
    model,
    group: list[dict[str, torch.Tensor]],
    *,
    use_num_items: bool,
    shifted_labels: bool,
    seeds: list[int],
    context_parallel: cp_lib.ContextParallel | None = None,
) -> float:
    """Forward and backward over the micro-batches of one optimizer step; return the step's loss (all processes).

    With `use_num_items` (the model takes `num_items_in_batch`, as transformers' heads do), every micro-batch's
    loss is its sum of token losses over the labelled tokens of the whole step across all processes (N), so the
    accumulated gradient is that of one batch of `len(group)` x processes micro-batches, however the labelled tokens
    fall; the loss is multiplied by the number of processes because DDP averages gradients over them (transformers'
    `average_tokens_across_devices`). Without, each micro-batch's mean loss is divided by `len(group)`.

    Args:
        group: The micro-batches, already prepared (MLM masking).
        shifted_labels: The model shifts `labels` itself (causal LM), see `count_loss_items`.
        seeds: One seed per micro-batch for dropout, so that a resumed run repeats the interrupted one.
        context_parallel: Split each micro-batch's sequences across this group (`--context_parallel`): every rank
            takes its chunk (`shift_labels` made before the split), the loss is normalised by the labelled tokens of
            every chunk and batch, and the model, which no DDP wraps, gets its gradients summed over every process
            (`context_parallel.reduce_gradients`).
    """
    if context_parallel is not None:
        group = [cp_lib.shard_batch(batch, context_parallel, causal=shifted_labels) for batch in group]
    num_items = None
    if use_num_items and ("labels" in group[0] or "shift_labels" in group[0]):
        num_items = accelerator.reduce(count_loss_items(group, shifted_labels=shifted_labels), reduction="sum").clamp(
            min=1
        )
    step_loss = torch.zeros((), device=accelerator.device)
    for i, (batch, seed) in enumerate(zip(group, seeds)):
        torch.manual_seed(seed)
        with synchronised_if(accelerator, model, last=i == len(group) - 1):
            if num_items is not None:
                loss = model(**batch, num_items_in_batch=num_items).loss
                # DDP averages over the processes; without DDP (context parallelism) the gradients are summed.
                accelerator.backward(loss * (1 if context_parallel is not None else accelerator.num_processes))
            else:
                loss = model(**batch).loss
                accelerator.backward(loss / len(group))
        step_loss += loss.detach().float()
    if context_parallel is not None:
        cp_lib.reduce_gradients(model)
    if num_items is not None:  # each process holds its share of the step's token mean
        return accelerator.reduce(step_loss, reduction="sum").item()
    return accelerator.reduce(step_loss / len(group), reduction="mean").item()


def synchronised_if(accelerator, model, *, last: bool):
    """The context of one micro-batch's forward and backward: gradients are synchronised across processes on the
    `last` micro-batch of an optimizer step only.

    DDP and FSDP skip the other micro-batches' all-reduce through `accelerator.no_sync`; DeepSpeed, which steps its
    engine inside `backward` at a synchronisation boundary, is told which micro-batch is one through accelerate's
    gradient state. accelerate's public way (`accelerator.accumulate`, whose `sync_gradients` it sets) cannot serve:
    it counts micro-batches itself against the Accelerator's `gradient_accumulation_steps`, which must stay 1 here
    (its `backward` would divide the loss again, where the recipe normalises by the step's labelled tokens), and it
    cannot close a group early (a short last group of an epoch, a stream share that ran out). So the flag is set as
    transformers' Trainer sets it, in this one place.
    """
    accelerator.gradient_state._set_sync_gradients(last)
    return contextlib.nullcontext() if last else accelerator.no_sync(model)


def _accepts_loss_kwargs(model) -> bool:
    """Whether `model.forward` normalises its loss by a `num_items_in_batch` argument (transformers' Trainer test:
    an explicit `accepts_loss_kwargs`, else a `**kwargs` in the signature)."""
    if hasattr(model, "accepts_loss_kwargs"):
        return bool(model.accepts_loss_kwargs)
    return any(p.kind == inspect.Parameter.VAR_KEYWORD for p in inspect.signature(model.forward).parameters.values())


def count_loss_items(batches: list[dict[str, torch.Tensor]], *, shifted_labels: bool) -> torch.Tensor:
    """The labelled items (label != -100) of the micro-batches of one optimizer step, in this process: `shift_labels`
    where a batch has them, else `labels[..., 1:]` when the model shifts its labels (a causal LM: the first label is
    never a target), else every label (one per example for classification)."""
    counts = []
    for batch in batches:
        if "shift_labels" in batch:
            labels = batch["shift_labels"]
        else:
            labels = batch["labels"][..., 1:] if shifted_labels else batch["labels"]
        counts.append(labels.ne(-100).sum())  # on the labels' device: a batch need not hold input_ids
    return torch.stack(counts).sum()


def run_evaluation(
    args: argparse.Namespace, accelerator, state: TrainState, evaluate: Callable[[Any, Any], dict[str, float]]
) -> dict[str, float]:
    """The recipe's `evaluate(model, eval_dataloader)` without gradients, its metrics prefixed `eval_`, logged and
    kept in `state.metrics`."""
    state.model.eval()
    # With --context_parallel, every process evaluates whole sequences of its own batches (no gradients to keep).
    with torch.no_grad(), cp_lib.context_parallel_paused(state.model):
        result = {f"eval_{k}": v for k, v in evaluate(state.model, state.eval_dataloader).items()}
    state.model.train()
    compute = {"train_cpu_seconds": round(state.train_cpu_seconds, 2), "peak_rss_mb": round(state.peak_rss_mb, 1)}
    log_record(
        accelerator, Path(args.output_dir) / LOG_FILE, {"step": state.completed_steps, **result, **compute}, args
    )
    logger.info("step %d: %s", state.completed_steps, format_metrics(result))
    state.metrics, state.last_eval_step = result, state.completed_steps
    return result


def prepare_training(
    args: argparse.Namespace, accelerator, model, train_dataset, eval_dataset, collate_fn, eval_collate_fn=None
) -> TrainState:
    """The data loaders, optimizer and learning-rate schedule, prepared by accelerate, in a `TrainState` at step 0
    (the arguments are those of `train`)."""
    from torch.utils.data import DataLoader
    from transformers import get_scheduler

    stream = streaming.is_stream(train_dataset)
    train_dataloader = _train_dataloader(args, accelerator, train_dataset, collate_fn)
    eval_dataloader = DataLoader(
        eval_dataset,
        shuffle=False,
        collate_fn=eval_collate_fn or collate_fn,
        batch_size=args.per_device_eval_batch_size,
    )
    optimizer = build_optimizer(args, model)
    context_parallel = _context_parallel_group(args, accelerator)
    data_parallel = accelerator.num_processes // args.context_parallel  # processes that read different batches
    # Steps are counted in optimizer updates; accelerate's prepared scheduler advances num_processes times per update.
    max_train_steps = args.max_train_steps or args.num_train_epochs * math.ceil(
        len(train_dataloader) / data_parallel / args.gradient_accumulation_steps
    )
    lr_scheduler = get_scheduler(
        args.lr_scheduler_type,
        optimizer=optimizer,
        num_warmup_steps=args.num_warmup_steps * accelerator.num_processes,
        num_training_steps=max_train_steps * accelerator.num_processes,
    )
    model, optimizer, train_dataloader, eval_dataloader, lr_scheduler = _prepare(
        accelerator, model, optimizer, train_dataloader, eval_dataloader, lr_scheduler, stream, context_parallel
    )
    global_batch_size = args.per_device_train_batch_size * data_parallel * args.gradient_accumulation_steps
    return TrainState(
        model=model,
        optimizer=optimizer,
        lr_scheduler=lr_scheduler,
        train_dataloader=train_dataloader,
        eval_dataloader=eval_dataloader,
        max_train_steps=max_train_steps,
        # A pass over a stream makes at least one step (`train_epoch` stops the run otherwise).
        num_epochs=max_train_steps
        if stream
        else math.ceil(max_train_steps / math.ceil(len(train_dataloader) / args.gradient_accumulation_steps)),
        global_batch_size=global_batch_size,
        num_processes=accelerator.num_processes,
        seed=args.seed,
        process_index=accelerator.process_index,
        loss_takes_num_items=_accepts_loss_kwargs(accelerator.unwrap_model(model)),
        streaming=stream,
        context_parallel=context_parallel,
    )


def build_optimizer(args: argparse.Namespace, model) -> torch.optim.Optimizer:
    """AdamW at --learning_rate with --weight_decay on every parameter but biases and normalisation weights."""
    no_decay = ("bias", "layer_norm.weight", "LayerNorm.weight", "norm.weight")
    groups = [
        {
            "params": [p for n, p in model.named_parameters() if not n.endswith(no_decay)],
            "weight_decay": args.weight_decay,
        },
        {"params": [p for n, p in model.named_parameters() if n.endswith(no_decay)], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=args.learning_rate)


def _train_dataloader(args: argparse.Namespace, accelerator, train_dataset, collate_fn: Callable):
    """The training DataLoader: over a `Dataset`, shuffled (by accelerate's seedable sampler once prepared); over a
    stream, this process's shuffled share of it (`streaming.stream_for_process`), in a loader already prepared."""
    from torch.utils.data import DataLoader

    if not streaming.is_stream(train_dataset):
        return DataLoader(
            train_dataset, shuffle=True, collate_fn=collate_fn, batch_size=args.per_device_train_batch_size
        )
    if args.max_train_steps is None:
        raise RecipeError("a streamed training set needs --max_train_steps: its length is unknown until it is read.")
    share = streaming.stream_for_process(
        train_dataset,
        seed=args.seed,
        buffer_size=args.shuffle_buffer_size,
        rank=accelerator.process_index,
        world_size=accelerator.num_processes,
    )
    loader = DataLoader(share, collate_fn=collate_fn, batch_size=args.per_device_train_batch_size)
    return streaming.stream_loader(loader, device=accelerator.device)


def _context_parallel_group(args: argparse.Namespace, accelerator) -> cp_lib.ContextParallel | None:
    """This process's context-parallel group on a (dp, cp) device mesh for --context_parallel N > 1, else None."""
    if args.context_parallel == 1:
        return None
    running = str(accelerator.distributed_type).split(".")[-1]
    if running in ("FSDP", "DEEPSPEED"):
        raise RecipeError(
            f"--context_parallel {args.context_parallel} runs its own gradient reduction, not under {running}: "
            "launch it with a DDP config (recipes/configs/cpu_2proc.yaml, multi_gpu_bf16.yaml)."
        )
    if accelerator.num_processes % args.context_parallel:
        raise RecipeError(
            f"--context_parallel {args.context_parallel} must divide the number of processes "
            f"({accelerator.num_processes}): launch with accelerate launch --num_processes N."
        )
    return cp_lib.init_context_parallel(args.context_parallel, device_type=accelerator.device.type)


def _prepare(accelerator, model, optimizer, train_dataloader, eval_dataloader, lr_scheduler, stream, cp):
    """`accelerator.prepare` of the model, optimizer, data loaders and schedule (`prepare_training`), but for

    - a streamed training set (`stream`): its loader is this process's alone, and must not be prepared again
      (`streaming.stream_loader`);
    - context parallelism (`cp`), which `accelerator.prepare` cannot give: its DDP averages gradients over every
      process (a context-parallel group's shares must be summed: `accumulation_step` reduces them itself), and its
      data loader gives every process a different batch (the ranks of a group must share one). So the model is only
      placed and registered for checkpoints (no DDP), and the data is sharded over the data-parallel group alone
      with accelerate's own `prepare_data_loader`.
    """
    from accelerate.data_loader import prepare_data_loader

    if stream:
        model, optimizer, eval_dataloader, lr_scheduler = accelerator.prepare(
            model, optimizer, eval_dataloader, lr_scheduler
        )
        return model, optimizer, train_dataloader, eval_dataloader, lr_scheduler
    if cp is None:
        return accelerator.prepare(model, optimizer, train_dataloader, eval_dataloader, lr_scheduler)
    model = accelerator.prepare_model(model, evaluation_mode=True)
    cp_lib.enable_context_parallel(model, cp)
    train_dataloader = prepare_data_loader(
        train_dataloader,
        accelerator.device,
        num_processes=cp.dp_size,
        process_index=cp.dp_rank,
        put_on_device=True,
        rng_types=accelerator.rng_types.copy(),
        use_seedable_sampler=True,
        data_seed=accelerator.dataloader_config.data_seed,
    )
    accelerator._dataloaders.append(train_dataloader)  # saved and restored with the checkpoints, as a prepared one
    optimizer, eval_dataloader, lr_scheduler = accelerator.prepare(optimizer, eval_dataloader, lr_scheduler)
    return model, optimizer, train_dataloader, eval_dataloader, lr_scheduler
