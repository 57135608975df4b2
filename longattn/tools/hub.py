"""Hub-ready folders: weights, config with `auto_map`, tokenizer, the modeling code, and a model card.

A folder written by `save_hub_folder` loads in two ways, with the same outputs:

- `AutoModelFor...from_pretrained(folder, trust_remote_code=True)` in a process where longattn is not installed (only
  torch and transformers): `config.json`'s `auto_map` points at the copied `configuration_longattn.py` /
  `modeling_longattn.py`, and every sibling module they import (the attention kinds of the registry, the ops and
  patterns below them) is copied along;
- `AutoModelFor...from_pretrained(folder)` after `import longattn`.

The code and `auto_map` are written by transformers' own mechanism, in every `save_pretrained` (plain, Trainer's, a
merged PEFT model's, `push_to_hub`): longattn's classes are registered for their Auto classes. A stock family running
longattn's kinds (a lengthened BERT, RoBERTa, GPT-2, Llama, ... with a `longattn` dict in its config) is saved as its
shareable subclass (`longattn.modeling_stock`): its `auto_map` points at `modeling_stock.py`, which registers the
"longattn" attention implementation, so it loads the same two ways; its model card (`stock_model_card`) says so.

`push_folder` uploads it with huggingface_hub (`create_repo` + `upload_folder`); `longattn-hub check FOLDER`
lists what a folder lacks, `longattn-hub push FOLDER REPO_ID` uploads one.
"""

from __future__ import annotations

import ast
import json
import sys
from pathlib import Path
from typing import Any

from .command_line import CommandLineParser, redact_command

PACKAGE_DIR = Path(__file__).resolve().parents[1]  # the flat package the model files live in
CODE_ENTRY_POINTS = ("configuration_longattn.py", "modeling_longattn.py")


def __getattr__(name: str):
    """`AUTO_MAP` (every Auto class a longattn folder answers to: `modeling_longattn.AUTO_MAP`) and
    `MODEL_AUTO_CLASS` (model class name -> its Auto class), read from the model module when first used, so that
    the command line starts without importing torch."""
    if name in ("AUTO_MAP", "MODEL_AUTO_CLASS"):
        from ..modeling_longattn import AUTO_MAP

        if name == "AUTO_MAP":
            return AUTO_MAP
        return {target.split(".")[1]: auto for auto, target in AUTO_MAP.items() if auto != "AutoConfig"}
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# recipe task -> (pipeline tag, human name, Auto class)
TASKS = {
    "mlm": ("fill-mask", "masked language modelling", "AutoModelForMaskedLM"),
    "classification": ("text-classification", "sequence classification", "AutoModelForSequenceClassification"),
    "clm": ("text-generation", "causal language modelling", "AutoModelForCausalLM"),
    "seq2seq": ("text2text-generation", "sequence-to-sequence generation", "AutoModelForSeq2SeqLM"),
}
UPLOAD_IGNORE = ["checkpoints/**", "*.partial/**"]


# ---------------------------------------------------------------------------------------------- code files
def _sibling_imports(path: Path) -> tuple[set[str], set[str]]:
    """Sibling modules `path` imports: (all of them, those only imported as `from . import x`)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    from_module, from_package = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            if node.module:
                from_module.add(node.module.split(".")[0])
            else:
                from_package.update(alias.name for alias in node.names)
    return from_module | from_package, from_package - from_module


def code_closure(directory: Path = PACKAGE_DIR, entry_points: tuple[str, ...] = CODE_ENTRY_POINTS) -> list[str]:
    """The file names `save_pretrained` copies into a folder for `entry_points`: each with every sibling module it
    imports, transitively, as transformers finds them (`get_relative_import_files`), sorted."""
    from transformers.dynamic_module_utils import get_relative_import_files

    names = set(entry_points)
    for entry_point in entry_points:
        names.update(Path(path).name for path in get_relative_import_files(directory / entry_point))
    return sorted(names)


# ---------------------------------------------------------------------------------------------- saving
def save_hub_folder(model, tokenizer, folder: str | Path, *, card=None, state_dict: dict | None = None) -> Path:
    """Write `model` (`save_pretrained`: safetensors, `config.json` with `auto_map`, the modeling code), `tokenizer`
    and `card` (`README.md`) to `folder`.

    The code and `auto_map` come from transformers' own mechanism: longattn's classes are registered for their Auto
    classes (`register_for_auto_class`), and a stock model running longattn's kinds is saved as its shareable
    subclass (`longattn.modeling_stock`), so a plain `model.save_pretrained(folder)` writes the same folder; this
    adds the tokenizer and the model card.

    Args:
        model: A longattn model (any head), or a stock model running longattn's kinds.
        tokenizer: Its tokenizer (or None).
        folder: The output folder (created).
        card: A `huggingface_hub.ModelCard` (see `model_card`), or None.
        state_dict: The weights to save instead of `model.state_dict()` (e.g. gathered from FSDP shards).

    Raises:
        ValueError: `model` is neither a longattn model nor a stock model running longattn's kinds.
    """
    if getattr(type(model), "_auto_class", None) is None and not is_stock_longattn(model.config):
        raise ValueError(
            f"{type(model).__name__} is not a longattn model class ({sorted(__getattr__('MODEL_AUTO_CLASS'))}) and "
            "its config holds no `longattn` dict: run `longattn.apply_longattn(model, ...)` or "
            "`longattn.lengthen(...)` first."
        )
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder, state_dict=state_dict)
    if tokenizer is not None:
        tokenizer.save_pretrained(folder)
    if card is not None:
        card.save(folder / "README.md")
    return folder


def hub_folder_problems(folder: str | Path) -> list[str]:
    """What keeps `folder` from loading anywhere (empty when it is complete): config with `auto_map`, weights,
    tokenizer, model card, and modeling code whose relative imports all resolve inside the folder and are of the
    form transformers' remote-code loader follows (`from .module import name`)."""
    folder = Path(folder)
    problems = []
    config_path = folder / "config.json"
    if not config_path.is_file():
        return [f"no config.json in {folder}"]
    config = json.loads(config_path.read_text())
    auto_map = config.get("auto_map") or {}
    stock = config.get("model_type") != "longattn"
    if stock and config.get("longattn") and config.get("attn_implementation") != "longattn":
        problems.append("config.json holds a `longattn` dict but not attn_implementation='longattn'")
    if not stock and "AutoConfig" not in auto_map:
        problems.append("config.json has no auto_map['AutoConfig']")
    if stock and config.get("longattn") and not auto_map:
        problems.append(
            "config.json has no auto_map: saved without longattn's code, it loads only where longattn is installed "
            "(save it again after `import longattn`)"
        )
    for auto, target in auto_map.items():
        module = target.split(".")[0] if isinstance(target, str) else None
        if module and not (folder / f"{module}.py").is_file():
            problems.append(f"auto_map[{auto!r}] needs {module}.py, which is missing")
    if not any((folder / name).is_file() for name in ("model.safetensors", "model.safetensors.index.json")):
        problems.append("no model.safetensors")
    if not any((folder / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json")):
        problems.append("no tokenizer (tokenizer.json / tokenizer_config.json)")
    if not (folder / "README.md").is_file():
        problems.append("no model card (README.md)")
    for path in sorted(folder.glob("*.py")):
        siblings, package_only = _sibling_imports(path)
        for module in sorted(siblings):
            if not (folder / f"{module}.py").is_file():
                problems.append(f"{path.name} imports .{module}, which is not in the folder")
        for module in sorted(package_only):
            problems.append(
                f"{path.name} imports {module} only as `from . import {module}`, which transformers' "
                f"remote-code loader does not follow: use `from .{module} import ...`"
            )
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            names = (
                [node.module]
                if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module
                else [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else []
            )
            if any(name == "longattn" or name.startswith("longattn.") for name in names):
                problems.append(f"{path.name} imports the longattn package, which a Hub user may not have")
    return problems


# ---------------------------------------------------------------------------------------------- model card
def _card(
    header: str,
    how_to_load: str,
    *,
    task: str | None,
    unique_kinds: list[str],
    model_name: str,
    tags: list[str],
    base_model: str | None = None,
    metrics: dict[str, float] | None = None,
    training_data: str | None = None,
    command: str | None = None,
    datasets: list[str] | None = None,
    extra: dict[str, Any] | None = None,
):
    """The `ModelCard` both kinds of model get: metadata (library, task, tags with the attention kinds, datasets,
    evaluation results) and a body of `header`, the training sections and `how_to_load`."""
    from huggingface_hub import EvalResult, ModelCard, ModelCardData

    metrics = metrics or {}
    pipeline_tag = _task(task)[0] if task else None
    dataset_label = datasets[0] if datasets else "local data"
    eval_results = [
        EvalResult(
            task_type=pipeline_tag,
            dataset_type=dataset_label,
            dataset_name=dataset_label,
            metric_type=name.removeprefix("eval_"),
            metric_value=round(float(value), 6),
        )
        for name, value in metrics.items()
    ]
    card_data = ModelCardData(
        library_name="transformers",
        pipeline_tag=pipeline_tag,
        base_model=base_model,
        datasets=datasets,
        tags=["longattn", "long-context", *tags, *([task] if task else []), *(f"attention-{k}" for k in unique_kinds)],
        model_name=model_name,
        eval_results=eval_results or None,
    )
    training = _card_training_sections(training_data=training_data, metrics=metrics, extra=extra, command=command)
    return ModelCard(f"---\n{card_data.to_yaml()}\n---\n{header}\n\n{training}\n\n{how_to_load}")


def _card_training_sections(
    *, training_data: str | None, metrics: dict[str, float], extra: dict[str, Any] | None, command: str | None
) -> str:
    """The card's "Training data", "Results" and "Training" sections (secret flags in `command` redacted)."""
    metric_rows = "\n".join(f"| {name.removeprefix('eval_')} | {value:.4f} |" for name, value in metrics.items())
    facts = "\n".join(f"- {name}: {value}" for name, value in (extra or {}).items())
    return f"""## Training data

{training_data or "not recorded"}

## Results

| metric | value |
|---|---|
{metric_rows or "| - | - |"}

## Training

{facts or "-"}

```bash
{redact_command(command) if command else "not recorded"}
```"""


def _task(task: str) -> tuple[str, str, str]:
    """(pipeline tag, task name, Auto class) of a recipe task.

    Raises:
        ValueError: `task` is not one of `TASKS`.
    """
    if task not in TASKS:
        raise ValueError(f"`task`={task!r} is unknown: expected one of {list(TASKS)}.")
    return TASKS[task]


def is_stock_longattn(config) -> bool:
    """Whether `config` is a stock transformers family's running longattn's kinds (a `longattn` dict)."""
    return getattr(config, "model_type", None) != "longattn" and bool(getattr(config, "longattn", None))


def stock_model_card(
    config, *, task: str | None = None, base_model: str | None = None, model_name: str | None = None, **details: Any
):
    """A `huggingface_hub.ModelCard` for a stock family running longattn's kinds (a lengthened checkpoint): its
    attention settings and how to load it: with `trust_remote_code=True` (the folder's `modeling_stock.py` registers
    the attention implementation), or after `import longattn` where longattn is installed.

    Args: as `model_card` (`details`: its metrics, training_data, command, datasets and extra); `task` may be None
        (a lengthened checkpoint not yet fine-tuned), `base_model` the checkpoint it was lengthened from.
    """
    from ..configuration_longattn import max_tokens

    _, task_name, auto_class = _task(task) if task else (None, None, "AutoModel")
    family = (getattr(config, "architectures", None) or [config.model_type])[0]
    fields = dict(config.longattn)
    kinds = fields.get("attention_type", "sliding")
    unique_kinds = list(dict.fromkeys([kinds] if isinstance(kinds, str) else kinds))
    model_name = model_name or f"{config.model_type}-longattn-{'-'.join(unique_kinds)}" + (f"-{task}" if task else "")
    settings = "\n".join(f"| `{key}` | `{value}` |" for key, value in fields.items())
    header = f"""
# {model_name}

A `{family}` that reads up to {max_tokens(config)} tokens with longattn's attention kinds
(`attn_implementation="longattn"`){f", lengthened from `{base_model}`" if base_model else ""}{
        f", trained for {task_name}" if task else ""
    }.

## Attention

| field | value |
|---|---|
{settings or "| - | - |"}

Cross-attention (encoder-decoder models) stays dense."""
    how_to_load = f"""## How to load

With only torch and transformers installed: the code that runs the attention kinds is in this folder
(`modeling_stock.py` registers the `"longattn"` attention implementation and returns transformers' own
`{family}` class; the modules it imports hold the kinds).

```python
from transformers import {auto_class}

model = {auto_class}.from_pretrained("<this folder or repo id>", trust_remote_code=True)
```

With longattn installed (it is not on the package index: `pip install .` in a clone of its repository, or
`pip install longattn-<version>-py3-none-any.whl` from a built wheel), `import longattn` first and the same call works
without `trust_remote_code`.

Loaded with neither, transformers builds its own `{family}` and refuses the unknown attention implementation
`"longattn"` (it never silently runs full attention). The tokenizer is transformers' own: `AutoTokenizer` loads it
either way.
"""
    card = dict(task=task, unique_kinds=unique_kinds, model_name=model_name, tags=[], base_model=base_model)
    return _card(header, how_to_load, **card, **details)


def _kind_settings(config, layer_idx: int, name: str) -> str:
    from ..attention_registry import attention_class

    fields = attention_class(name).config_fields
    parts = []
    for field in fields:
        value = config.per_layer(field, layer_idx) if hasattr(config, field) else fields[field]
        parts.append(f"{field}={value}")
    return ", ".join(parts) or "-"


def model_card(config, *, task: str, model_name: str | None = None, **details: Any):
    """A `huggingface_hub.ModelCard` for a longattn model: metadata (library, tags with the attention kinds, task,
    datasets, evaluation results) and a body with the attention per layer, the training data, the metrics, the
    command used and how to load the model.

    Args:
        config: The model's `LongAttnConfig` (a stock family's config with a `longattn` dict: `stock_model_card`).
        task: A recipe task: "mlm", "classification", "clm" or "seq2seq".
        model_name: The title (default: "longattn <attention kinds> <task>").
        details: Keywords, each optional:
            metrics: `{"eval_accuracy": 0.97, ...}`.
            training_data: One line about the data.
            command: The training command (the values of secret flags such as `--hub_token` are redacted).
            datasets: Hub dataset ids, for the metadata.
            extra: More `{name: value}` facts for the training section (steps, batch size, ...).
    """
    if is_stock_longattn(config):
        return stock_model_card(config, task=task, model_name=model_name, **details)
    _, task_name, auto_class = _task(task)
    kinds = list(config.layer_attention_types)
    unique_kinds = list(dict.fromkeys(kinds))
    model_name = model_name or f"longattn-{'-'.join(unique_kinds)}-{task}"
    layers = "\n".join(f"| {i} | `{name}` | {_kind_settings(config, i, name)} |" for i, name in enumerate(kinds))
    if getattr(config, "is_encoder_decoder", False):
        decoder_kinds = ", ".join(f"`{k}`" for k in config.decoder_layer_attention_types)
        layers += f"\n\nDecoder self-attention per layer: {decoder_kinds}; cross-attention is dense."
    header = f"""
# {model_name}

A longattn model for {task_name}: {config.num_hidden_layers} layers, hidden size {config.hidden_size},
{config.num_attention_heads} heads, up to {config.max_position_embeddings} tokens ({config.position_embedding_type}
positions), vocabulary of {config.vocab_size}.

## Attention per layer

| layer | attention | settings |
|---|---|---|
{layers}"""
    how_to_load = f"""## How to load

With only torch and transformers installed (the modeling code is in this folder):

```python
from transformers import {auto_class}, AutoTokenizer

model = {auto_class}.from_pretrained("<this folder or repo id>", trust_remote_code=True)
tokenizer = AutoTokenizer.from_pretrained("<this folder or repo id>", trust_remote_code=True)
```

(`trust_remote_code` on the tokenizer too: `AutoTokenizer` reads `config.json`, which points at the code here; the
tokenizer itself is a plain `tokenizer.json`.)

With longattn installed, `import longattn` registers the classes and the same call works without
`trust_remote_code`.
"""
    card = dict(task=task, unique_kinds=unique_kinds, model_name=model_name, tags=["custom_code"])
    return _card(header, how_to_load, **card, **details)


# ---------------------------------------------------------------------------------------------- pushing
def push_folder(
    folder: str | Path,
    repo_id: str,
    *,
    token: str | None = None,
    private: bool = False,
    commit_message: str = "Upload longattn model",
) -> str:
    """Create the model repository `repo_id` if needed and upload `folder` (without its checkpoints); return the URL.

    Raises:
        ValueError: `folder` is not Hub-ready (see `hub_folder_problems`).
    """
    from huggingface_hub import create_repo, upload_folder

    problems = hub_folder_problems(folder)
    if problems:
        raise ValueError(f"{folder} is not Hub-ready: {problems}")
    repo = create_repo(repo_id, token=token, private=private, exist_ok=True)
    upload_folder(
        repo_id=repo.repo_id,
        folder_path=str(folder),
        token=token,
        commit_message=commit_message,
        ignore_patterns=UPLOAD_IGNORE,
    )
    return str(repo)


def main(argv: list[str] | None = None) -> int:
    parser = CommandLineParser(prog="longattn-hub", description="Check or push a Hub-ready folder.")
    sub = parser.add_subparsers(dest="command", required=True)
    check = sub.add_parser("check", help="list what keeps a folder from loading anywhere")
    check.add_argument("folder")
    push = sub.add_parser("push", help="create_repo + upload_folder")
    push.add_argument("folder")
    push.add_argument("repo_id")
    push.add_argument("--private", action="store_true")
    push.add_argument("--token")
    args = parser.parse_args(argv)
    problems = hub_folder_problems(args.folder)
    if args.command == "check" or problems:
        for problem in problems:
            print(f"{args.folder}: {problem}", file=sys.stderr)
        if not problems:
            print(f"{args.folder}: Hub-ready")
        return 1 if problems else 0
    print(push_folder(args.folder, args.repo_id, token=args.token, private=args.private))
    return 0


if __name__ == "__main__":
    sys.exit(main())


__all__ = [
    "save_hub_folder",
    "hub_folder_problems",
    "code_closure",
    "model_card",
    "stock_model_card",
    "is_stock_longattn",
    "push_folder",
]
