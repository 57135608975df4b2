"""The `recipes/run_*.py` scripts end to end on tiny generated data, on CPU.

- every recipe under plain `python`: a few steps, `all_results.json`, checkpoints, a Hub-ready folder that loads
  through the Auto classes;
- under `accelerate launch` with two gloo processes (recipes/configs/cpu_2proc.yaml + ACCELERATE_USE_CPU=1), checking
  that the processes really see each other (`ranks_seen` is a gather across them). Classification and seq2seq run by
  default; MLM and CLM are marked `slow` (`pytest -m slow`) to keep the suite short;
- a run killed with SIGKILL in the middle of a checkpoint, then resumed with `--resume_from_checkpoint latest`, ends
  with the same weights and losses as the uninterrupted run;
- bad arguments stop with a one-line error before any training.
"""

from __future__ import annotations

import json
import math
import os
import socket
import subprocess
import sys
from pathlib import Path

import child_processes
import pytest
import torch
from safetensors.torch import load_file
from script_loading import load_script
from transformers import (
    AutoModelForCausalLM,
    AutoModelForMaskedLM,
    AutoModelForSeq2SeqLM,
    AutoModelForSequenceClassification,
    AutoTokenizer,
)

import longattn  # noqa: F401
from longattn.tools import hub
from longattn.train import data, training

REPO = Path(__file__).resolve().parents[1]
RECIPES = REPO / "recipes"
TINY = (
    "hidden_size=32,num_hidden_layers=2,num_attention_heads=2,intermediate_size=64,sliding_window=4,"
    "max_position_embeddings=256"
)
AUTO_CLASSES = {
    "mlm": AutoModelForMaskedLM,
    "classification": AutoModelForSequenceClassification,
    "clm": AutoModelForCausalLM,
    "seq2seq": AutoModelForSeq2SeqLM,
}
METRICS = {
    "mlm": ("eval_loss", "eval_perplexity", "eval_accuracy"),
    "classification": ("eval_loss", "eval_accuracy"),
    "clm": ("eval_loss", "eval_perplexity", "eval_accuracy"),
    "seq2seq": ("eval_loss", "eval_token_accuracy", "eval_exact_match", "eval_rougeL"),
}


@pytest.fixture(scope="module")
def datasets_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("recipe_data")
    for task, fields in {
        "needle": dict(num_train=24, num_test=4, min_length=30, max_length=60),
        "listops": dict(num_train=32, num_test=0, min_length=20, max_length=60, max_depth=5, max_args=5),
        "needles": dict(num_train=24, num_test=0, min_length=30, max_length=50, max_needles=2),
    }.items():
        data.generate_task(task, root / task, num_validation=8, seed=0, **fields)
    return root


def tiny_run_flags(output_dir: Path, train: Path | None = None, validation: Path | None = None) -> list[str]:
    """A recipe's flags for a run of the `TINY` model into `output_dir`, on the JSON-lines files `train` and
    `validation` when given."""
    files = [] if train is None else ["--train_file", str(train), "--validation_file", str(validation)]
    return [*files, "--config_overrides", TINY, "--output_dir", str(output_dir)]


# Two training rows a process and step, four evaluation rows a batch.
BATCH_SIZES = ("--per_device_train_batch_size", "2", "--per_device_eval_batch_size", "4")


def recipe_args(
    recipe: str, datasets_dir: Path, output_dir: Path, *extra: str, dataset_folder: bool = False
) -> list[str]:
    task_data = (
        datasets_dir / {"mlm": "listops", "clm": "listops", "classification": "needle", "seq2seq": "needles"}[recipe]
    )
    if dataset_folder:  # the generator's folder read as a local dataset (--dataset_name), splits found by file name
        args = ["--dataset_name", str(task_data), *tiny_run_flags(output_dir)]
    else:
        args = tiny_run_flags(output_dir, task_data / "train.jsonl", task_data / "validation.jsonl")
    args += [*BATCH_SIZES, "--seed", "7"]
    if recipe in ("mlm", "clm"):
        args += ["--max_seq_length", "64", "--max_train_samples", "12"]
    if recipe == "seq2seq":
        args += ["--max_target_length", "8"]
    return args + list(extra)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run(
    recipe: str, args: list[str], *, processes: int = 1, env: dict[str, str] | None = None, cwd: Path | None = None
) -> subprocess.CompletedProcess:
    script = str(RECIPES / f"run_{recipe}.py")
    if processes == 1:
        command = [sys.executable, script, *args]
    else:
        command = [
            sys.executable,
            "-m",
            "accelerate.commands.launch",
            "--config_file",
            str(RECIPES / "configs" / "cpu_2proc.yaml"),
            "--num_processes",
            str(processes),
            "--main_process_port",
            str(_free_port()),
            script,
            *args,
        ]
    full_env = {k: v for k, v in os.environ.items() if not k.startswith(("ACCELERATE_", "LONGATTN_RECIPE_"))}
    full_env.update(
        HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1", **(env or {})
    )
    # The script's folder (recipes/) comes first on sys.path: without this, an installed longattn would be tested
    # instead of this checkout's.
    full_env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), full_env.get("PYTHONPATH")]))
    if processes > 1:
        full_env["ACCELERATE_USE_CPU"] = "1"
    return child_processes.run(command, env=full_env, cwd=cwd or REPO, timeout=600)


def check_run(recipe: str, done: subprocess.CompletedProcess, output_dir: Path, *, processes: int, steps: int) -> dict:
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    results = json.loads((output_dir / "all_results.json").read_text())
    assert results["num_processes"] == processes
    assert results["ranks_seen"] == list(range(processes))
    assert results["global_batch_size"] == 2 * processes * results["gradient_accumulation_steps"]
    assert results["train_steps"] == steps and results["task"] == recipe
    for metric in METRICS[recipe]:
        assert math.isfinite(results[metric]), (metric, results)
    assert math.isfinite(results["train_loss"])
    assert "train: 100%" in done.stderr  # the tqdm bar of the main process
    assert hub.hub_folder_problems(output_dir) == []

    # the folder loads through the Auto classes (longattn imported) and runs on the validation text
    model = AUTO_CLASSES[recipe].from_pretrained(output_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(output_dir)
    assert type(model).__name__.startswith("LongAttnFor")
    assert model.config.layer_attention_types == ["sliding", "sliding"] and model.config.hidden_size == 32
    batch = tokenizer(["[MAX 1 2 ] abc", "xyz"], padding=True, return_tensors="pt")
    kwargs = {"decoder_input_ids": torch.tensor([[1, 20], [1, 21]])} if recipe == "seq2seq" else {}
    with torch.no_grad():
        assert torch.isfinite(model(**batch, **kwargs).logits).all()
    saved = load_file(output_dir / "model.safetensors")
    assert all(torch.isfinite(t).all() for t in saved.values())
    return results


def skip_unless_selected(request) -> None:
    """`slow` tests run only when asked for (`pytest -m slow`), so the default suite stays short."""
    if request.node.get_closest_marker("slow") and "slow" not in (request.config.getoption("markexpr") or ""):
        pytest.skip("slow: run with `pytest -m slow`")


# ---------------------------------------------------------------------------------------------- plain python
_REFERENCE_RUNS: dict[str, tuple[Path, dict]] = {}
REFERENCE_EXTRA = ("--max_train_steps", "9", "--gradient_accumulation_steps", "2", "--checkpointing_steps", "2")


def assert_same_run(results: dict, reference: dict, output_dir: Path, reference_dir: Path) -> None:
    """A resumed run (`results`, saved in `output_dir`) ends as the uninterrupted one: the same losses and accuracy,
    to float noise, and the same saved weights."""
    for key in ("train_loss", "train_last_loss", "eval_loss", "eval_accuracy"):
        assert results[key] == pytest.approx(reference[key], rel=1e-5, abs=1e-6), key
    expected, actual = load_file(reference_dir / "model.safetensors"), load_file(output_dir / "model.safetensors")
    assert expected.keys() == actual.keys()
    for name in expected:
        torch.testing.assert_close(actual[name], expected[name], msg=name)


def reference_run(recipe: str, datasets_dir: Path, tmp_path_factory) -> tuple[Path, dict]:
    """One uninterrupted plain-python run per recipe, shared by the recipe test and the resume test."""
    if recipe not in _REFERENCE_RUNS:
        output_dir = tmp_path_factory.mktemp(f"{recipe}_python")
        done = run(recipe, recipe_args(recipe, datasets_dir, output_dir, *REFERENCE_EXTRA))
        _REFERENCE_RUNS[recipe] = (output_dir, check_run(recipe, done, output_dir, processes=1, steps=9))
    return _REFERENCE_RUNS[recipe]


@pytest.mark.parametrize("recipe", ["mlm", "classification", "clm", "seq2seq"])
def test_recipe_runs_under_python(recipe, datasets_dir, tmp_path_factory):
    output_dir, results = reference_run(recipe, datasets_dir, tmp_path_factory)
    assert results["distributed_type"] == "NO"
    assert results["gradient_accumulation_steps"] == 2 and results["epochs"] >= 1
    checkpoints = training.list_checkpoints(output_dir / "checkpoints")
    assert [p.name for p in checkpoints] == ["step_6", "step_8"]  # --checkpoints_total_limit 2
    state = json.loads((checkpoints[-1] / "trainer_state.json").read_text())
    assert state["completed_steps"] == 8
    log = [json.loads(line) for line in (output_dir / "train_log.jsonl").read_text().splitlines()]
    assert any("eval_loss" in record for record in log)
    card = (output_dir / "README.md").read_text()
    assert f"python recipes/run_{recipe}.py --train_file" in card  # the command used
    assert "longattn-data" in card  # the training data section names the generator


# ---------------------------------------------------------------------------------------------- two processes
@pytest.mark.parametrize(
    "recipe",
    [
        "classification",
        "seq2seq",
        pytest.param("mlm", marks=pytest.mark.slow),
        pytest.param("clm", marks=pytest.mark.slow),
    ],
)
def test_recipe_runs_on_two_cpu_processes(recipe, datasets_dir, tmp_path, request):
    skip_unless_selected(request)
    output_dir = tmp_path / "out"
    done = run(
        recipe,
        recipe_args(
            recipe,
            datasets_dir,
            output_dir,
            "--max_train_steps",
            "3",
            "--checkpointing_steps",
            "2",
            dataset_folder=recipe == "classification",
        ),
        processes=2,
    )
    results = check_run(recipe, done, output_dir, processes=2, steps=3)
    assert results["distributed_type"] == "MULTI_CPU"
    checkpoint = training.list_checkpoints(output_dir / "checkpoints")[-1]
    assert (checkpoint / "random_states_0.pkl").is_file() and (checkpoint / "random_states_1.pkl").is_file()
    assert "accelerate launch --num_processes 2" in (output_dir / "README.md").read_text()


# ---------------------------------------------------------------------------------------------- never lose a run
def test_sigkill_during_a_checkpoint_then_resume_matches_the_uninterrupted_run(
    datasets_dir, tmp_path, tmp_path_factory
):
    """MLM (dropout and random masks), gradient accumulation 2, epoch boundaries on the way: killed while writing
    the checkpoint of step 6, the run resumes from step 3, in the middle of an epoch (skipping the batches of that
    epoch already seen), and ends where the uninterrupted run (checkpoints every 2 steps) ends."""
    reference_dir, reference = reference_run("mlm", datasets_dir, tmp_path_factory)
    assert reference["epochs"] >= 2
    output_dir = tmp_path / "killed"
    extra = list(REFERENCE_EXTRA)
    extra[extra.index("--checkpointing_steps") + 1] = "3"
    args = recipe_args("mlm", datasets_dir, output_dir, *extra)

    killed = run("mlm", args, env={"LONGATTN_RECIPE_SIGKILL_IN_SAVE": "6"})
    assert killed.returncode == -9, killed.stderr[-3000:]
    checkpoints = output_dir / "checkpoints"
    assert (checkpoints / ".step_6.partial").is_dir()  # the interrupted save is left incomplete...
    assert [p.name for p in training.list_checkpoints(checkpoints)] == ["step_3"]  # ...and ignored
    assert not (output_dir / "all_results.json").exists()
    state = json.loads((checkpoints / "step_3" / training.STATE_FILE).read_text())
    assert state["epoch"] == 0 and state["batch_in_epoch"] == 6  # mid-epoch: the resume must skip 6 batches

    resumed = run("mlm", [*args, "--resume_from_checkpoint", "latest"])
    results = check_run("mlm", resumed, output_dir, processes=1, steps=9)
    assert results["resumed_from"].endswith("step_3")
    assert not (checkpoints / ".step_6.partial").exists()
    assert_same_run(results, reference, output_dir, reference_dir)


@pytest.mark.slow
def test_resume_refuses_a_different_global_batch(datasets_dir, tmp_path_factory, request):
    skip_unless_selected(request)
    reference_dir, _ = reference_run("classification", datasets_dir, tmp_path_factory)
    done = run(
        "classification",
        recipe_args(
            "classification",
            datasets_dir,
            reference_dir,
            *REFERENCE_EXTRA,
            "--per_device_train_batch_size",
            "3",
            "--resume_from_checkpoint",
            "latest",
        ),
    )
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1].startswith("run_classification.py: error: ")
    assert "global batch" in done.stderr


# ---------------------------------------------------------------------------------------------- bad arguments
def _load_recipe(recipe: str):
    return load_script(f"recipes/run_{recipe}.py", f"recipe_{recipe}")


@pytest.mark.parametrize(
    "recipe, change, message",
    [
        ("mlm", {"--train_file": "missing.jsonl"}, "does not exist"),
        ("classification", {"--validation_file": "missing.csv"}, "does not exist"),
        ("clm", {"--config_overrides": TINY + ",attention_type=no_such_attention"}, "no_such_attention"),
        ("mlm", {"--config_overrides": "attention_type=[sliding,bogus],num_hidden_layers=2"}, "bogus"),
        ("seq2seq", {"--max_seq_length": "100000"}, "exceeds the model's limit max_position_embeddings=256"),
        ("seq2seq", {"--max_target_length": "300"}, "exceeds the model's limit"),
        ("classification", {"--config_overrides": TINY + ",hiden_size=8"}, "'hiden_size' (did you mean hidden_size"),
        ("mlm", {"--checkpointing_steps": "often"}, "--checkpointing_steps"),
        ("clm", {"--resume_from_checkpoint": "nowhere"}, "not a complete checkpoint"),
        ("classification", {"--max_target_length": "8"}, "unrecognized arguments: --max_target_length (and 1 value(s)"),
        ("mlm", {"--lr_scheduler_type": "sawtooth"}, "invalid choice: 'sawtooth'"),
        ("classification", {"--packing": None}, "--packing is not supported for classification"),
        ("clm", {"--packing": None, "--line_by_line": None}, "--packing and --line_by_line are exclusive"),
        ("mlm", {"--packing": None, "--context_parallel": "2"}, "--packing with --context_parallel 2"),
    ],
)
def test_bad_arguments_stop_with_one_line_before_training(recipe, change, message, datasets_dir, tmp_path, capsys):
    output_dir = tmp_path / "out"
    args = recipe_args(recipe, datasets_dir, output_dir)
    for flag, value in change.items():
        if flag in args:
            args[args.index(flag) + 1] = value
        else:
            args += [flag] if value is None else [flag, value]  # None: a switch
    module = _load_recipe(recipe)
    with pytest.raises(SystemExit) as exit_info:
        training.run_recipe(module.main, args)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"{Path(sys.argv[0]).name}: error: "), err
    assert message in err
    assert not output_dir.exists()  # stopped before the accelerator, the data and the model


def test_existing_checkpoints_need_resume_or_overwrite(datasets_dir, tmp_path_factory, capsys):
    reference_dir, _ = reference_run("clm", datasets_dir, tmp_path_factory)
    module = _load_recipe("clm")
    with pytest.raises(SystemExit):
        training.run_recipe(module.main, recipe_args("clm", datasets_dir, reference_dir))
    assert "--resume_from_checkpoint latest" in capsys.readouterr().err


def test_bad_arguments_in_a_real_process(datasets_dir, tmp_path):
    """A column that is not in the data is found after the data is loaded, still before training; the process
    prints that one line and nothing else (no traceback, no warnings, no progress bar)."""
    recipe, message = "mlm", "column 'body' is not in the train data"
    output_dir = tmp_path / "out"
    done = run(recipe, recipe_args(recipe, datasets_dir, output_dir, "--text_column", "body"), cwd=tmp_path)
    assert done.returncode == 2, done.stderr[-3000:]
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"run_{recipe}.py: error: ") and message in lines[0], lines
    assert "Traceback" not in done.stderr and "train:" not in done.stderr
    assert not (output_dir / "checkpoints").exists() and not (output_dir / "train_log.jsonl").exists()


def test_config_overrides_parsing():
    assert training.parse_config_overrides(
        "attention_type=sliding,sliding_window=64,hidden_dropout_prob=0.0,"
        "attention_type=[sliding, full],use_cache=false,x=none"
    ) == {
        "attention_type": ["sliding", "full"],
        "sliding_window": 64,
        "hidden_dropout_prob": 0.0,
        "use_cache": False,
        "x": None,
    }
    with pytest.raises(training.RecipeError):
        training.parse_config_overrides("hidden_size")


def test_collator_pads_to_the_block_multiple():
    collate = training.PadCollator(pad_token_id=0, pad_to_multiple_of=8)
    batch = collate([{"input_ids": [1, 5, 6, 2], "labels": 3}, {"input_ids": [1, 2], "labels": 1}])
    assert batch["input_ids"].shape == (2, 8) and batch["attention_mask"].sum().item() == 6
    assert batch["labels"].tolist() == [3, 1]
    seq = training.PadCollator(pad_token_id=0, pad_to_multiple_of=4, labels_multiple=1)(
        [{"input_ids": [1, 5, 2], "labels": [7, 2]}, {"input_ids": [1, 2], "labels": [2]}]
    )
    assert seq["input_ids"].shape == (2, 4) and seq["labels"].tolist() == [[7, 2], [2, -100]]
    assert seq["decoder_attention_mask"].tolist() == [[1, 1], [1, 0]]
    config = longattn.LongAttnConfig(attention_type="sliding")
    assert training.length_multiple(config) == 1
    # Each layer's kind states its multiple; the stack pads to their least common multiple.
    mixed = longattn.LongAttnConfig(
        attention_type=["fixed", "sliding", "fixed"],
        num_hidden_layers=3,
        fixed_block_size=[8, 16, 12],
        fixed_num_summary=2,
    )
    assert training.length_multiple(mixed) == 24
    assert training.length_multiple(longattn.LongAttnConfig(attention_type="sinkhorn", sinkhorn_block_size=20)) == 20


def test_mask_tokens_never_masks_padding_or_special_tokens():
    ids = torch.tensor([[1, 10, 11, 12, 2, 0, 0], [1, 13, 2, 0, 0, 0, 0]])
    mask = (ids != 0).long()
    draws = torch.rand((3, *ids.shape), generator=torch.Generator().manual_seed(0))
    draws[0] = 0.0  # pick everything that may be picked
    masked, labels = training.mask_tokens(
        ids,
        mask,
        draws=draws,
        special_ids=torch.tensor([0, 1, 2, 3]),
        mask_token_id=3,
        vocab_size=260,
        probability=0.15,
    )
    picked = labels != -100
    assert picked.tolist() == (ids >= 4).tolist()
    assert (masked[~picked] == ids[~picked]).all() and (labels[picked] == ids[picked]).all()
    none_picked = training.mask_tokens(
        ids,
        mask,
        draws=torch.ones((3, *ids.shape)),
        special_ids=torch.tensor([0, 1, 2, 3]),
        mask_token_id=3,
        vocab_size=260,
        probability=0.15,
    )[1]
    assert (none_picked != -100).sum() == 1  # at least one target, so the loss is defined


def test_pack_documents_keeps_documents_whole_and_restarts_positions():
    examples = {"input_ids": [[1] * 5, [2] * 9, [3] * 4, [4] * 12], "labels": [[1] * 5, [2] * 9, [3] * 4, [4] * 12]}
    packed = training.pack_documents(examples, block_size=10)
    assert all(len(row) <= 10 for row in packed["input_ids"])
    assert sorted(x for row in packed["input_ids"] for x in row) == sorted([1] * 5 + [2] * 9 + [3] * 4 + [4] * 10)
    for ids, positions, labels in zip(packed["input_ids"], packed["position_ids"], packed["labels"]):
        for p, (token, position) in enumerate(zip(ids, positions)):
            starts = p == 0 or token != ids[p - 1]
            assert position == (0 if starts else positions[p - 1] + 1)
            assert labels[p] == (-100 if starts else token)  # no document predicts the next one's first token


@pytest.mark.parametrize("recipe", ["mlm", "clm"])
def test_recipe_trains_with_packing(recipe, datasets_dir, tmp_path):
    """`--packing`: whole texts in rows with restarting positions, one step, a finite loss (the attention side is
    tested in tests/test_packing.py)."""
    output_dir = tmp_path / "out"
    done = run(recipe, recipe_args(recipe, datasets_dir, output_dir, "--packing", "--max_train_steps", "2"))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    results = json.loads((output_dir / "all_results.json").read_text())
    assert results["train_steps"] == 2 and math.isfinite(results["train_loss"]) and math.isfinite(results["eval_loss"])
