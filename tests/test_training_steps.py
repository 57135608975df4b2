"""The training loop in steps: a `TrainState` and the small functions every recipe's `train` is made of (prepare,
begin, one step, evaluate, save, resume, summarize), each usable alone and each short."""

from __future__ import annotations

import ast
import inspect
import textwrap

import pytest
import torch
from kind_configs import tiny_causal_lm_config

from longattn import LongAttnForCausalLM
from longattn.train import training

STEP_FUNCTIONS = (
    "build_optimizer",
    "prepare_training",
    "begin_run",
    "train_step",
    "run_evaluation",
    "train_epoch",
    "save_checkpoint",
    "resume",
    "summarize",
    "train",
)


def _args(tmp_path, *extra: str):
    (tmp_path / "train.jsonl").touch()
    parser = training.recipe_parser(None, task="clm")
    return training.parse_args(
        parser,
        [
            "--train_file",
            str(tmp_path / "train.jsonl"),
            "--output_dir",
            str(tmp_path / "out"),
            "--per_device_train_batch_size",
            "2",
            "--seed",
            "3",
            *extra,
        ],
    )


def _state(args):
    torch.manual_seed(0)
    config = tiny_causal_lm_config()
    examples = [
        {"input_ids": [(i + j) % 12 for j in range(6)], "labels": [(i + j) % 12 for j in range(6)]} for i in range(8)
    ]
    accelerator = training.make_accelerator(args)
    state = training.prepare_training(
        args,
        accelerator,
        LongAttnForCausalLM(config),
        examples,
        examples[:2],
        training.PadCollator(pad_token_id=0, align_labels=True),
    )
    return accelerator, state


def _params(state) -> list[torch.Tensor]:
    return [p.detach().clone() for p in state.model.parameters()]


def _step(args, accelerator, state) -> float:
    """The next optimizer step of the state's position (one batch per step, no accumulation)."""
    state.train_dataloader.set_epoch(state.epoch)
    batches = list(state.train_dataloader)
    first = state.batch_in_epoch
    return training.train_step(
        args, accelerator, state, batches[first : first + 1], epoch=state.epoch, first_batch=first
    )


def test_steps_saved_then_resumed_continue_identically(tmp_path):
    """Two steps, a checkpoint, a third step; a fresh state resumed from the checkpoint has the same position and
    weights, and its third step gives the same loss and weights (dropout seeded from the position)."""
    args = _args(tmp_path, "--checkpointing_steps", "2")
    accelerator, state = _state(args)
    assert training.begin_run(args, accelerator, state) is None
    losses = [_step(args, accelerator, state) for _ in range(2)]
    assert (state.completed_steps, state.epoch, state.batch_in_epoch) == (2, 0, 2)
    assert state.loss_sum == pytest.approx(sum(losses)) and state.last_loss == losses[-1]
    checkpoint = training.save_checkpoint(accelerator, args, state)
    saved_position, saved_params = state.position(), _params(state)
    third_loss = _step(args, accelerator, state)
    third_params = _params(state)

    resumed_args = _args(tmp_path, "--checkpointing_steps", "2", "--resume_from_checkpoint", "latest")
    accelerator, resumed = _state(resumed_args)
    assert training.begin_run(resumed_args, accelerator, resumed) == checkpoint
    assert resumed.position() == saved_position
    for got, expected in zip(_params(resumed), saved_params):
        torch.testing.assert_close(got, expected, rtol=0, atol=0)
    assert _step(resumed_args, accelerator, resumed) == pytest.approx(third_loss, rel=1e-6)
    for got, expected in zip(_params(resumed), third_params):
        torch.testing.assert_close(got, expected)

    results = training.summarize(
        resumed_args,
        accelerator,
        resumed,
        runtime=1.0,
        ranks_seen=[0],
        resumed_from=checkpoint,
        train_samples=8,
        validation_samples=2,
    )
    assert results["train_steps"] == 3 and results["resumed_from"] == "checkpoints/step_2"
    assert results["train_loss"] == pytest.approx((sum(losses) + third_loss) / 3, rel=1e-6)


def test_evaluation_is_logged_and_kept_in_the_state(tmp_path):
    args = _args(tmp_path)
    accelerator, state = _state(args)
    seen = []
    metrics = training.run_evaluation(
        args, accelerator, state, lambda model, loader: seen.append(model.training) or {"loss": 1.5}
    )
    assert metrics == state.metrics == {"eval_loss": 1.5} and state.last_eval_step == 0
    assert seen == [False] and state.model.training  # evaluated in eval mode, back to training after
    assert '"eval_loss": 1.5' in (tmp_path / "out" / training.LOG_FILE).read_text()


@pytest.mark.parametrize("name", STEP_FUNCTIONS)
def test_each_step_of_the_loop_is_short(name):
    """Every function of the loop fits on a screen: at most 50 lines of code, its docstring not counted."""
    source = textwrap.dedent(inspect.getsource(getattr(training, name)))
    function = ast.parse(source).body[0]
    body = function.body[1:] if isinstance(function.body[0], ast.Expr) else function.body
    lines = body[-1].end_lineno - body[0].lineno + 1
    assert lines <= 50, f"{name} has {lines} lines of code"


def test_language_model_rows_are_arranged_and_an_empty_split_is_refused():
    from argparse import Namespace

    from datasets import Dataset, DatasetDict

    texts = DatasetDict(
        {split: Dataset.from_dict({"input_ids": [[1, 2, 3], [4, 5, 6, 7, 8]]}) for split in ("train", "validation")}
    )
    options = dict(preprocessing_num_workers=None)
    blocks = training.arrange_rows(texts, Namespace(packing=False, line_by_line=False, **options), 4)
    assert blocks["train"]["input_ids"] == [[1, 2, 3, 4], [5, 6, 7, 8]]  # joined into blocks of 4
    rows = training.arrange_rows(texts, Namespace(packing=False, line_by_line=True, **options), 4)
    assert rows["train"]["input_ids"] == [[1, 2, 3], [4, 5, 6, 7, 8]]  # one text a row
    too_long = training.arrange_rows(texts, Namespace(packing=False, line_by_line=False, **options), 64)
    with pytest.raises(training.RecipeError, match="the train texts make no block of 64 tokens"):
        training.check_rows_exist(too_long, 64)


@pytest.mark.skipif(not training.reset_peak_rss(), reason="no /proc/self/clear_refs: the peak is the process's")
def test_peak_memory_is_measured_from_the_start_of_training():
    # A run's `peak_rss_mb` is its training's: the memory the process held before (tokenising) does not count.
    # In a fresh process, so that no earlier test's freed (still resident) memory serves the allocation.
    import subprocess
    import sys

    code = (
        "from longattn.train.checkpoints import peak_rss_mb, reset_peak_rss\n"
        "assert reset_peak_rss()\n"
        "before = peak_rss_mb()\n"
        "held = b'x' * (64 * 2**20)\n"
        "grown = peak_rss_mb() - before\n"
        "del held\n"
        "assert reset_peak_rss()\n"
        "print(grown, peak_rss_mb() - before)\n"
    )
    grown, after_reset = map(float, subprocess.check_output([sys.executable, "-c", code], text=True).split())
    assert grown >= 60
    assert after_reset < 30
