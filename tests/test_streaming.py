"""`--streaming`: the recipes read their training data as a `datasets.IterableDataset`.

- each process's share of the stream (`streaming.stream_for_process`, `split_dataset_by_node`), through the loader the
  training uses, holds every example exactly once across processes, whether the stream has one file or several;
- a streamed MLM run resumed from a checkpoint in the middle of a pass ends with the same weights and losses as the
  uninterrupted run (the resume replays the stream with the same seed and skips what was consumed);
- two gloo processes each read half of the stream: their positions in the checkpoint show that accelerate neither
  dispatched the batches from rank 0 nor split the shares a second time;
- the flags a stream needs (--max_train_steps, --label_names for classification) are refused when missing.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from test_recipes import (  # noqa: F401 (datasets_dir: a fixture)
    _load_recipe,
    assert_same_run,
    check_run,
    datasets_dir,
    recipe_args,
    run,
)

from longattn.train import streaming, training


def _stream(num_shards: int, tmp_path: Path):
    """23 examples `{"x": i}` in one jsonl file, or spread over `num_shards` generator shards."""
    import datasets

    if num_shards == 1:
        path = tmp_path / "train.jsonl"
        path.write_text("".join(json.dumps({"x": i}) + "\n" for i in range(23)))
        return datasets.load_dataset("json", data_files={"train": str(path)}, streaming=True)["train"]

    def generate(shards):
        for shard in shards:
            yield from ({"x": i} for i in range(23) if i % num_shards == shard)

    return datasets.IterableDataset.from_generator(generate, gen_kwargs={"shards": list(range(num_shards))})


def _share(dataset, *, rank: int, world_size: int, epoch: int) -> list[int]:
    """What the training loop of process `rank` reads in pass `epoch` (`prepare_training`'s loader)."""
    share = streaming.stream_for_process(dataset, seed=3, buffer_size=5, rank=rank, world_size=world_size)
    loader = streaming.stream_loader(
        torch.utils.data.DataLoader(
            share, batch_size=2, collate_fn=lambda rows: {"x": torch.tensor([r["x"] for r in rows])}
        ),
        device=torch.device("cpu"),
    )
    loader.set_epoch(epoch)
    return [x for batch in loader for x in batch["x"].tolist()]


@pytest.mark.parametrize("num_shards, world_size", [(1, 2), (4, 2), (3, 3), (1, 3)])
def test_each_example_goes_to_exactly_one_process(num_shards, world_size, tmp_path):
    """One file (every `world_size`-th example per process) or whole shards per process: the shares are disjoint
    and cover the stream, in every pass; a pass is a function of (seed, pass), and the next pass reshuffles."""
    dataset = _stream(num_shards, tmp_path)
    for epoch in (0, 1):
        shares = [_share(dataset, rank=rank, world_size=world_size, epoch=epoch) for rank in range(world_size)]
        assert sorted(x for share in shares for x in share) == list(range(23)), shares
        assert _share(dataset, rank=0, world_size=world_size, epoch=epoch) == shares[0]  # replayable
    assert _share(dataset, rank=0, world_size=world_size, epoch=0) != shares[0]  # reshuffled per pass


def test_skip_examples_stops_at_the_position():
    batches = iter(
        [{"input_ids": torch.zeros(2, 3)}, {"input_ids": torch.zeros(2, 3)}, {"input_ids": torch.ones(1, 3)}]
    )
    assert streaming.skip_examples(batches, 4) == (2, 4)
    assert next(batches)["input_ids"].shape == (1, 3)  # the batch after the position is not consumed
    assert streaming.skip_examples(iter([]), 4) == (0, 0)


STREAM_EXTRA = (
    "--streaming",
    "--shuffle_buffer_size",
    "4",
    "--max_train_steps",
    "9",
    "--gradient_accumulation_steps",
    "2",
    "--checkpointing_steps",
    "3",
)


def test_streamed_run_resumed_mid_pass_matches_the_uninterrupted_run(datasets_dir, tmp_path):  # noqa: F811
    """MLM (dropout, random masks), accumulation 2, a shuffle buffer: a pass of the stream is 4 steps. A copy of the
    run's folder cut back to its step-3 checkpoint (what a run killed after step 5 leaves) resumes in the middle of
    the first pass (the stream replayed and the examples consumed skipped), crosses into the second pass and ends
    where the uninterrupted run ends."""
    reference_dir = tmp_path / "reference"
    args = recipe_args("mlm", datasets_dir, reference_dir, *STREAM_EXTRA, "--checkpoints_total_limit", "3")
    reference = check_run("mlm", run("mlm", args), reference_dir, processes=1, steps=9)
    assert reference["epochs"] == 3 and reference["train_samples"] is None  # passes over the stream
    state = json.loads((reference_dir / "checkpoints" / "step_3" / training.STATE_FILE).read_text())
    assert (state["epoch"], state["batch_in_epoch"], state["stream_examples"]) == (0, 6, [12])  # mid-pass

    output_dir = tmp_path / "resumed"
    (output_dir / "checkpoints").mkdir(parents=True)
    shutil.copytree(reference_dir / "checkpoints" / "step_3", output_dir / "checkpoints" / "step_3")
    args[args.index("--output_dir") + 1] = str(output_dir)
    resumed = run("mlm", [*args, "--resume_from_checkpoint", "latest"])
    results = check_run("mlm", resumed, output_dir, processes=1, steps=9)
    assert results["resumed_from"].endswith("step_3") and "not what the checkpoint" not in resumed.stderr
    assert_same_run(results, reference, output_dir, reference_dir)


def test_two_processes_each_read_their_own_half(datasets_dir, tmp_path):  # noqa: F811
    """24 needle examples, the first 4 held out for evaluation: 20 to train on, 10 per process, 5 batches of 2, so a
    pass is 5 steps and step 8 is 3 batches (6 examples per process) into the second pass. Dispatched from rank 0 or
    split again by accelerate, each process would read 5 examples per pass and the position would differ."""
    output_dir = tmp_path / "out"
    args = recipe_args("classification", datasets_dir, output_dir, "--streaming", "--max_train_steps", "8")
    args[args.index("--validation_file") : args.index("--validation_file") + 2] = []
    args += ["--max_eval_samples", "4", "--label_names", ",".join(map(str, range(10))), "--checkpointing_steps", "8"]
    results = check_run("classification", run("classification", args, processes=2), output_dir, processes=2, steps=8)
    assert results["validation_samples"] == 4 and results["epochs"] == 2
    state = json.loads((output_dir / "checkpoints" / "step_8" / training.STATE_FILE).read_text())
    assert (state["epoch"], state["batch_in_epoch"], state["stream_examples"]) == (1, 3, [6, 6])


@pytest.mark.parametrize(
    "recipe, extra, message",
    [
        ("clm", ["--streaming"], "--streaming needs --max_train_steps"),
        ("seq2seq", ["--streaming", "--shuffle_buffer_size", "-1", "--max_train_steps", "2"], "--shuffle_buffer_size"),
        ("classification", ["--streaming", "--max_train_steps", "2"], "--streaming needs --label_names"),
        ("classification", ["--label_names", "a,,b"], "expected distinct, non-empty names"),
        ("classification", ["--label_names", "a,b", "--problem_type", "regression"], "a regression"),
    ],
)
def test_streaming_flags_are_checked_before_training(recipe, extra, message, datasets_dir, tmp_path, capsys):  # noqa: F811
    output_dir = tmp_path / "out"
    with pytest.raises(SystemExit) as exit_info:
        training.run_recipe(_load_recipe(recipe).main, recipe_args(recipe, datasets_dir, output_dir, *extra))
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err
    assert not output_dir.exists()  # stopped before the accelerator, the data and the model


def test_streamed_labels_outside_label_names_stop_the_run(tmp_path, capsys):
    """The validation labels are checked up front, the stream's as they are read."""
    for split, labels in (("train", "aacab"), ("validation", "ab")):
        rows = [{"text": f"text {i}", "label": label} for i, label in enumerate(labels)]
        (tmp_path / f"{split}.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    args = recipe_args("classification", tmp_path.parent, tmp_path / "out", "--streaming", "--max_train_steps", "3")
    args[args.index("--train_file") + 1] = str(tmp_path / "train.jsonl")
    args[args.index("--validation_file") + 1] = str(tmp_path / "validation.jsonl")
    module = _load_recipe("classification")
    with pytest.raises(SystemExit):
        training.run_recipe(module.main, [*args, "--label_names", "a"])
    assert "validation labels ['b'] are not in --label_names ['a']" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        training.run_recipe(module.main, [*args, "--label_names", "a,b"])
    assert "label 'c' of column 'label' is not in --label_names ['a', 'b']" in capsys.readouterr().err
