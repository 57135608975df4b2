"""What a run leaves: its results dict, the token metrics of the language-model recipes' evaluations,
`all_results.json` and the Hub-ready folder."""

from __future__ import annotations

import argparse
import logging
import math
from pathlib import Path
from typing import Any

import torch

from .arguments import attention_types
from .checkpoints import TrainState
from .inputs import describe_data
from .records import format_metrics, recorded_path, write_json

logger = logging.getLogger(__name__)


def summarize(
    args: argparse.Namespace,
    accelerator,
    state: TrainState,
    *,
    runtime: float,
    ranks_seen: list[int],
    resumed_from: Path | None,
    train_samples: int | None,
    validation_samples: int,
) -> dict[str, Any]:
    """The results of a run (see `train`)."""
    return {
        **state.metrics,
        "train_loss": state.loss_sum / max(state.loss_count, 1),
        "train_last_loss": state.last_loss,
        "train_runtime": round(runtime, 2),
        "train_cpu_seconds": round(state.train_cpu_seconds, 2),
        "peak_rss_mb": round(state.peak_rss_mb, 1),
        "train_steps": state.completed_steps,
        # a stream's passes: those finished, and the current one if started
        "epochs": state.epoch + (state.batch_in_epoch > 0) if state.streaming else state.num_epochs,
        "train_samples": train_samples,
        "validation_samples": validation_samples,
        "num_processes": accelerator.num_processes,
        "ranks_seen": ranks_seen,
        "distributed_type": str(accelerator.distributed_type).split(".")[-1],
        "mixed_precision": accelerator.mixed_precision,
        "per_device_train_batch_size": args.per_device_train_batch_size,
        "gradient_accumulation_steps": args.gradient_accumulation_steps,
        "global_batch_size": state.global_batch_size,
        "max_seq_length": args.max_seq_length,
        "attention_types": attention_types(accelerator.unwrap_model(state.model).config),
        "resumed_from": recorded_path(resumed_from, args.output_dir) if resumed_from is not None else None,
        "seed": args.seed,
    }


def token_stats(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Per example `[b, 3]`: summed cross-entropy, correct predictions, and counted tokens (labels != -100)."""
    valid = labels != -100  # [b, n]
    safe = labels.clamp(min=0)
    nll = torch.nn.functional.cross_entropy(logits.float().transpose(1, 2), safe, reduction="none")  # [b, n]
    correct = (logits.argmax(-1) == labels) & valid
    return torch.stack([(nll * valid).sum(-1), correct.sum(-1).float(), valid.sum(-1).float()], dim=-1)


def summarize_token_stats(stats: torch.Tensor) -> dict[str, float]:
    """`eval_loss`, `perplexity`, `accuracy` from the gathered `[N, 3]` rows of `token_stats`."""
    loss_sum, correct, count = stats.double().sum(0).tolist()
    loss = loss_sum / max(count, 1.0)
    return {"loss": loss, "perplexity": math.exp(min(loss, 50.0)), "accuracy": correct / max(count, 1.0)}


def finish(
    args: argparse.Namespace,
    accelerator,
    model,
    tokenizer,
    results: dict[str, Any],
    *,
    task: str,
    dataset_description: str | None = None,
) -> None:
    """Write `all_results.json` and the Hub-ready folder (model, tokenizer, code, model card) in --output_dir, check
    the folder, and push it with --push_to_hub."""
    from ..tools import hub

    accelerator.wait_for_everyone()
    state_dict = accelerator.get_state_dict(model)  # a collective under FSDP: every process takes part
    if accelerator.is_main_process:
        output_dir = Path(args.output_dir)
        results = {**results, "task": task, "command": args.command}
        write_json(output_dir / "all_results.json", results)
        card = hub.model_card(
            accelerator.unwrap_model(model).config,
            task=task,
            metrics={k: v for k, v in results.items() if k.startswith("eval_") and isinstance(v, (int, float))},
            training_data=dataset_description or describe_data(args),
            command=_launch_command(results, args.command),
            datasets=[args.dataset_name] if args.dataset_name else None,
            extra={
                k: results[k]
                for k in ("train_steps", "global_batch_size", "num_processes", "max_seq_length", "train_runtime")
                if k in results
            },
        )
        hub.save_hub_folder(accelerator.unwrap_model(model), tokenizer, output_dir, card=card, state_dict=state_dict)
        problems = hub.hub_folder_problems(output_dir)
        if problems:
            raise RuntimeError(f"the folder {output_dir} is not Hub-ready: {problems}")
        logger.info(
            "wrote the Hub-ready folder %s: %s",
            output_dir,
            format_metrics({k: v for k, v in results.items() if k.startswith("eval_")}),
        )
        if args.push_to_hub:
            repo_id = args.hub_model_id or output_dir.resolve().name
            url = hub.push_folder(output_dir, repo_id, token=args.hub_token, private=args.hub_private_repo)
            logger.info("pushed to %s", url)
    accelerator.wait_for_everyone()


def _launch_command(results: dict[str, Any], command: str) -> str:
    if results.get("num_processes", 1) > 1:
        return f"accelerate launch --num_processes {results['num_processes']} {command}"
    return f"python {command}"
