"""What a recipe run leaves behind and how it treats bad data, damaged checkpoints and changed arguments.

One real (tiny, three-step) classification run, launched as a new user would with `accelerate launch --cpu
--num_processes 2` and a fake `--hub_token`, with tracking on, then resumed from a damaged checkpoint with changed
data and learning rate, serves most tests; the rest run in-process and stop before training, or drive the training
loop with a stub model.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
import tomllib
import torch
import torch.nn.functional as F
from kind_configs import NO_DROPOUT, tiny_causal_lm_config
from test_recipes import BATCH_SIZES, REPO, TINY, _load_recipe, run, tiny_run_flags
from transformers import AutoConfig

from longattn import LongAttnForCausalLM
from longattn.tokenization_longattn import byte_tokenizer
from longattn.tools import command_line, hub
from longattn.train import data, training

FAKE_TOKEN = "hf_FakeTokenThatMustNeverBeWritten0123"

# A tracker that works offline whatever is installed: accelerate looks custom names up in LOGGER_TYPE_TO_CLASS.
TRACKED_LAUNCH = """
import json, runpy, sys
from pathlib import Path
from accelerate.tracking import LOGGER_TYPE_TO_CLASS, GeneralTracker

class JsonFileTracker(GeneralTracker):
    name = "jsonfile"
    requires_logging_directory = True

    def __init__(self, run_name, logging_dir, **kwargs):
        super().__init__()
        self.folder = Path(logging_dir) / "jsonfile" / run_name
        self.folder.mkdir(parents=True, exist_ok=True)

    @property
    def tracker(self):
        return None

    def store_init_configuration(self, values):
        (self.folder / "config.json").write_text(json.dumps(values))

    def log(self, values, step=None, **kwargs):
        with (self.folder / "log.jsonl").open("a") as f:
            f.write(json.dumps({"step": step, **values}) + "\\n")

LOGGER_TYPE_TO_CLASS["jsonfile"] = JsonFileTracker
recipe = sys.argv.pop(1)
sys.argv[0] = recipe
runpy.run_path(recipe, run_name="__main__")
"""


def _tracker() -> str:
    try:
        import tensorboard  # noqa: F401

        return "tensorboard"
    except ImportError:
        return "jsonfile"


@pytest.fixture(scope="module")
def workspace(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("safety")
    data.generate_task(
        "needle", root / "data", num_train=12, num_validation=4, num_test=0, seed=0, min_length=30, max_length=50
    )
    return root


def _args(workspace: Path, output_dir: Path, *extra: str) -> list[str]:
    return [
        *tiny_run_flags(output_dir, workspace / "data" / "train.jsonl", workspace / "data" / "validation.jsonl"),
        *BATCH_SIZES,
        "--max_train_steps",
        "3",
        "--checkpointing_steps",
        "1",
        "--checkpoints_total_limit",
        "3",
        "--logging_steps",
        "1",
        "--seed",
        "3",
        *extra,
    ]


@pytest.fixture(scope="module")
def first_run(workspace):
    """A fresh run into a folder that already holds an earlier `train_log.jsonl`, launched with `--cpu
    --num_processes 2` (one process: accelerate's simple launcher), a secret and tracking."""
    output_dir = workspace / "out"
    output_dir.mkdir()
    (output_dir / training.LOG_FILE).write_text(json.dumps({"step": 99, "loss": 1.0, "earlier": True}) + "\n")
    launcher = workspace / "tracked_launch.py"
    launcher.write_text(TRACKED_LAUNCH)
    # Both forms of a flag (argparse keeps the last): `--hub_token=...` and `--hub_token ...`.
    args = _args(
        workspace,
        output_dir,
        f"--hub_token={FAKE_TOKEN}",
        "--hub_token",
        FAKE_TOKEN,
        "--with_tracking",
        "--report_to",
        _tracker(),
    )
    env = {key: value for key, value in os.environ.items() if not key.startswith(("ACCELERATE_", "LONGATTN_"))}
    env.update(
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
        OMP_NUM_THREADS="1",
        PYTHONPATH=str(REPO),
    )
    command = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--cpu",
        "--num_processes",
        "2",
        str(launcher),
        str(REPO / "recipes" / "run_classification.py"),
        *args,
    ]
    done = subprocess.run(command, env=env, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    return SimpleNamespace(output_dir=output_dir, done=done)


def test_no_secret_and_no_absolute_path_in_the_output_folder(first_run, workspace):
    """Every file of the folder --push_to_hub uploads (and its checkpoints and tracker logs), text or binary."""
    files = [path for path in first_run.output_dir.rglob("*") if path.is_file()]
    tracker_files = [path for path in files if _tracker() in path.parts]
    assert tracker_files, "the tracker wrote nothing"
    roots = {str(workspace), str(workspace.resolve()), str(first_run.output_dir.resolve())}
    for path in files:
        content = path.read_bytes()
        assert FAKE_TOKEN.encode() not in content, path
        for root in roots:
            assert root.encode() not in content, (path, root)
    results = json.loads((first_run.output_dir / "all_results.json").read_text())
    assert "--hub_token=REDACTED --hub_token REDACTED" in results["command"]
    assert "--train_file ../data/train.jsonl" in results["command"] and "--output_dir ." in results["command"]
    assert "--hub_token REDACTED" in (first_run.output_dir / "README.md").read_text()
    if _tracker() == "jsonfile":
        config = json.loads(next(p for p in tracker_files if p.name == "config.json").read_text())
        assert config["hub_token"] == "REDACTED" and config["output_dir"] == "."


def test_redaction_of_secret_flags():
    kept = "--tokenizer_name bytes --global_tokens 4 --with_tracking --seed 1".split()  # no secret: as they are
    argv = "--hub_token s1 --db-password=s2 --wandb_api_key s3 --client_secret=s4 --token s5".split() + kept
    assert command_line.redact_argv(argv) == [
        *("--hub_token", "REDACTED", "--db-password=REDACTED", "--wandb_api_key", "REDACTED"),
        *("--client_secret=REDACTED", "--token", "REDACTED"),
        *kept,
    ]
    card = hub.model_card(
        __import__("longattn").LongAttnConfig(
            hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64
        ),
        task="mlm",
        command="python run_mlm.py --hub_token=hf_abc --output_dir out",
    )
    assert "hf_abc" not in str(card) and "--hub_token=REDACTED" in str(card)


def test_a_fresh_run_starts_its_log_afresh(first_run):
    log = [json.loads(line) for line in (first_run.output_dir / training.LOG_FILE).read_text().splitlines()]
    assert not any(record.get("earlier") for record in log)
    assert [record["step"] for record in log if "loss" in record] == [1, 2, 3]


def test_one_process_where_two_were_asked_for_says_how_to_get_two(first_run):
    results = json.loads((first_run.output_dir / "all_results.json").read_text())
    assert results["num_processes"] == 1
    assert "ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes 2" in first_run.done.stderr


def test_resume_falls_back_from_a_damaged_checkpoint_and_names_changed_arguments(first_run, workspace):
    """The newest checkpoint's weights are cut short; the data file changes contents (same name) and the learning
    rate changes: the run resumes from the checkpoint before, says so, and names what differs."""
    output_dir = first_run.output_dir
    weights = output_dir / "checkpoints" / "step_3" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    changed = workspace / "changed"
    shutil.copytree(workspace / "data", changed)
    rows = (changed / "train.jsonl").read_text().splitlines()
    (changed / "train.jsonl").write_text("\n".join([rows[1], rows[0], *rows[2:]]) + "\n")
    args = _args(
        workspace,
        output_dir,
        "--max_train_steps",
        "4",
        "--resume_from_checkpoint",
        "latest",
        "--learning_rate",
        "0.001",
    )
    args[args.index("--train_file") + 1] = str(changed / "train.jsonl")
    done = run("classification", args)
    assert done.returncode == 0, done.stderr[-4000:]
    warnings = [line for line in done.stderr.splitlines() if " WARNING " in line]
    assert any("checkpoints/step_3 does not load" in line and "falling back" in line for line in warnings), warnings
    changed_line = next(line for line in warnings if "other than it was written with" in line)
    assert "learning_rate (0.0005 -> 0.001)" in changed_line and "train_file" in changed_line
    assert "validation_file" not in changed_line and "seed" not in changed_line
    results = json.loads((output_dir / "all_results.json").read_text())
    assert results["resumed_from"] == "checkpoints/step_2" and results["train_steps"] == 4
    log = [json.loads(line) for line in (output_dir / training.LOG_FILE).read_text().splitlines()]
    assert [record["step"] for record in log if "loss" in record] == [1, 2, 3, 4]  # step 3 once: from the resume


# ---------------------------------------------------------------------------------------------- bad data
@pytest.mark.parametrize(
    "rows, extra, message",
    [
        (
            [{"text": "a", "label": 1}, {"body": "b", "label": 0}],
            (),
            "column 'text', row 2: expected a text, found None",
        ),
        (
            [{"text": "a", "label": 1}, {"text": "b", "label": "x"}],
            (),
            "column 'label', row 2: label 'x' is a string, but row 1 has number labels",
        ),
        ([{"text": "a", "label": 1}, {"text": "b"}], (), "column 'label', row 2: the label is missing"),
        (
            [{"text": "a", "label": 1}, {"text": "b", "label": 1.5}],
            (),
            "column 'label', row 2: label 1.5 is not a class (an integer or a string); pass --problem_type regression",
        ),
        (
            [{"text": "a", "label": 0.5}, {"text": "b", "label": "x"}],
            ("--problem_type", "regression"),
            "row 2: label 'x' is a string",
        ),
        ([{"text": "a"}, {"text": "b"}], (), "column 'label' is not in the train data"),
    ],
)
def test_bad_data_stops_with_one_line_naming_file_column_and_row(rows, extra, message, tmp_path, capsys):
    train = tmp_path / "train.jsonl"
    train.write_text("".join(json.dumps(row) + "\n" for row in rows))
    args = [*tiny_run_flags(tmp_path / "out", train, train), *extra]
    with pytest.raises(SystemExit) as exit_info:
        training.run_recipe(_load_recipe("classification").main, args)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if ": error: " in line]  # (datasets' progress bars aside)
    assert len(errors) == 1 and message in errors[0] and str(train) in errors[0] and "Traceback" not in err, err


def test_regression_labels_need_the_flag_and_then_train(tmp_path):
    rows = [{"text": f"text {i}", "label": i / 3} for i in range(8)]
    train = tmp_path / "train.jsonl"
    train.write_text("".join(json.dumps(row) + "\n" for row in rows))
    args = [
        *tiny_run_flags(tmp_path / "out", train, train),
        "--per_device_train_batch_size",
        "4",
        "--max_train_steps",
        "1",
        "--problem_type",
        "regression",
    ]
    results = _load_recipe("classification").main(args)
    assert "eval_accuracy" not in results and results["train_steps"] == 1
    config = AutoConfig.from_pretrained(tmp_path / "out")
    assert config.num_labels == 1 and config.problem_type == "regression"


def test_an_unwritable_output_folder_is_one_line(tmp_path, capsys):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    train = tmp_path / "train.jsonl"
    train.write_text(json.dumps({"text": "a", "label": 1}) + "\n")
    args = ["--train_file", str(train), "--config_overrides", TINY, "--output_dir", str(blocker / "out")]
    with pytest.raises(SystemExit) as exit_info:
        training.run_recipe(_load_recipe("classification").main, args)
    assert exit_info.value.code == 1
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if ": error: " in line]
    assert len(errors) == 1 and errors[0].startswith(f"{Path(sys.argv[0]).name}: error: ") and "a_file" in errors[0]
    assert "Traceback" not in err, err


# ---------------------------------------------------------------------------------------------- accumulation
class StubCausalLM(torch.nn.Module):
    """A causal LM whose loss follows transformers' `ForCausalLMLoss`: the sum of the shifted token losses over
    `num_items_in_batch` when given, else their mean. It stands in for the longattn heads, which take the same
    argument."""

    def __init__(self):
        super().__init__()
        generator = torch.Generator().manual_seed(0)
        self.embed = torch.nn.Parameter(torch.randn(12, 8, generator=generator))
        self.head = torch.nn.Parameter(torch.randn(8, 12, generator=generator))
        self.config = SimpleNamespace()

    def forward(self, input_ids, attention_mask=None, labels=None, num_items_in_batch=None, **kwargs):
        logits = self.embed[input_ids] @ self.head  # [b, n, v]
        targets = labels[:, 1:]
        total = F.cross_entropy(logits[:, :-1].transpose(1, 2), targets, ignore_index=-100, reduction="sum")
        count = num_items_in_batch if num_items_in_batch is not None else targets.ne(-100).sum()
        return SimpleNamespace(loss=total / count, logits=logits)


def tiny_longattn_causal_lm():
    """A real longattn causal LM head (dropout off), which takes `num_items_in_batch` like transformers' heads."""
    torch.manual_seed(0)
    return LongAttnForCausalLM(tiny_causal_lm_config(**NO_DROPOUT))


def _accumulated_gradients(
    tmp_path: Path, batch_size: int, steps: int, monkeypatch, make_model=StubCausalLM
) -> tuple[list, float]:
    """The gradients the optimizer sees at its first step, and the logged loss of that step."""
    seen = []

    class RecordingAdamW(torch.optim.AdamW):
        def step(self, closure=None):
            seen.append([p.grad.clone() for group in self.param_groups for p in group["params"]])
            return super().step(closure)

    monkeypatch.setattr(torch.optim, "AdamW", RecordingAdamW)
    (tmp_path / "train.jsonl").touch()
    parser = training.recipe_parser(None, task="clm")
    args = training.parse_args(
        parser,
        [
            "--train_file",
            str(tmp_path / "train.jsonl"),
            "--output_dir",
            str(tmp_path / f"out_{batch_size}"),
            "--per_device_train_batch_size",
            str(batch_size),
            "--gradient_accumulation_steps",
            str(steps),
            "--max_train_steps",
            "1",
            "--max_grad_norm",
            "0",
        ],
    )
    # Eight examples of length 6 with 1 to 5 labelled targets: micro-batch means differ from the token mean.
    examples = [
        {
            "input_ids": [(i + j) % 12 for j in range(6)],
            "labels": [(i + j) % 12 if j <= 1 + i % 5 else -100 for j in range(6)],
        }
        for i in range(8)
    ]
    results = training.train(
        args,
        training.make_accelerator(args),
        make_model(),
        examples,
        examples[:2],
        training.PadCollator(pad_token_id=0, align_labels=True),
        evaluate=lambda model, loader: {},
    )
    return seen[0], results["train_loss"]


@pytest.mark.parametrize("make_model", [StubCausalLM, tiny_longattn_causal_lm], ids=["stub", "longattn"])
def test_gradient_accumulation_equals_one_large_batch(tmp_path, monkeypatch, make_model):
    """Batch 2 x 4 accumulation steps gives the gradients and the loss of batch 8: the loop passes the labelled
    tokens of the whole optimizer step as `num_items_in_batch` and does not divide by the accumulation steps."""
    accumulated, accumulated_loss = _accumulated_gradients(tmp_path, 2, 4, monkeypatch, make_model)
    single, single_loss = _accumulated_gradients(tmp_path, 8, 1, monkeypatch, make_model)
    for got, expected in zip(accumulated, single):
        torch.testing.assert_close(got, expected)
    assert accumulated_loss == pytest.approx(single_loss, rel=1e-6)


def test_loss_items_are_counted_on_the_targets():
    batches = [{"labels": torch.tensor([[5, 6, -100], [7, -100, -100]])}, {"labels": torch.tensor([[1, 2, 3]])}]
    assert training.count_loss_items(batches, shifted_labels=True).item() == 1 + 0 + 2
    assert training.count_loss_items(batches, shifted_labels=False).item() == 3 + 3
    batches[1]["shift_labels"] = torch.tensor([[2, -100, -100]])
    assert training.count_loss_items(batches, shifted_labels=True).item() == 1 + 1


# ---------------------------------------------------------------------------------------------- tokenizer
def test_a_decoder_prompt_does_not_end_the_text_but_clm_training_text_does():
    encoder, decoder = byte_tokenizer(), byte_tokenizer(add_eos_token=False)
    assert encoder("ab")["input_ids"] == [1, 101, 102, 2]
    assert decoder("ab")["input_ids"] == [1, 101, 102]  # generate() continues "ab"
    args = training.recipe_parser(None, task="clm").parse_args(["--output_dir", "x"])
    config = training.LongAttnConfig()
    assert training.load_tokenizer(args, config)("ab")["input_ids"] == [1, 101, 102]
    clm = _load_recipe("clm")
    assert clm.tokenize_texts(decoder, ["ab", "c"]) == [[1, 101, 102, 2], [1, 103, 2]]
    assert clm.tokenize_texts(decoder, ["abcdef"], max_length=4) == [[1, 101, 102, 2]]  # the end survives truncation
    assert clm.tokenize_texts(encoder, ["ab"]) == [[1, 101, 102, 2]]  # no second </s>


# ---------------------------------------------------------------------------------------------- packaging
def test_the_license_is_an_spdx_string(monkeypatch):
    """setuptools >= 77 warns on every build about the `license = {text = ...}` table; the installed one reads the
    SPDX string without a warning."""
    setuptools = pytest.importorskip("setuptools")
    from setuptools.config import pyprojecttoml
    from setuptools.dist import Distribution

    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert project["project"]["license"] == "Apache-2.0"
    monkeypatch.chdir(REPO)  # the readme is found relative to the project
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pyprojecttoml.apply_configuration(Distribution(), "pyproject.toml")
    assert not [w for w in caught if "license" in str(w.message).lower()], setuptools.__version__
