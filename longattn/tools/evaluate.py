"""`longattn-eval`: does a long model use its context? Loss by context length, passkey retrieval, needle accuracy.

For any folder a user has: a longattn model or a stock transformers model (with or without longattn's kinds,
lengthened or not), causal LM, masked LM or sequence classifier.

**Loss by context length** (`loss_by_length`). The corpus (jsonl with a `text` column, or plain text files) is
tokenized document by document as the recipes tokenize it (a masked LM's tokenizer adds its own `<s>`/`</s>`; a
causal LM's text ends with the end-of-text token), concatenated into one stream and cut at a multiple of the longest
length, so that every length scores exactly the same tokens. At each context length L the stream is cut into
**non-overlapping windows** of L tokens (as Longformer's Table 5 evaluates; a token near a window's start has little
context, so the mean context is about L / 2):
- causal LM: every token is predicted from the tokens before it in its window; a token that starts a window at any of
  the lengths has no context there and is scored at none of them;
- masked LM: a fixed 15% of the stream's non-special tokens (drawn once from `seed`, the same at every length and for
  every model) are replaced by the mask token and predicted.
Bits per token are the mean negative log-likelihood in bits of the scored tokens; bits per byte multiply them by the
stream's tokens per UTF-8 byte (exact for byte-level tokenizers, where both are 1).

**Passkey retrieval** (`passkey_accuracy`, causal LMs; Mohtashami & Jaggi 2023): a 5-digit key sentence hidden at a
chosen depth of repeated filler text, then "What is the pass key? The pass key is"; a trial is retrieved when the
model's greedy prediction of every key token, read teacher-forced, is right. Accuracy by length and depth.

**Needle accuracy** (`needle_accuracy`, sequence classifiers trained on `longattn-data needle`): a digit hidden
anywhere in a random haystack of L characters; accuracy by length.

Output: a JSON results file (`results.json`), a table on the terminal, a PNG plot of bits per byte against context
length with one line per model (`loss_by_length.png`, needs matplotlib), and a progress bar.

    longattn-eval runs/model-a runs/model-b --corpus data/stdlib/test.jsonl --lengths 512 1024 2048 4096 \\
        --output_dir runs/eval
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import random
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

TASKS = ("clm", "mlm", "classification")
# The head class suffixes of transformers' families, by the task they evaluate.
_ARCHITECTURE_TASKS = {
    "ForCausalLM": "clm",
    "LMHeadModel": "clm",
    "ForMaskedLM": "mlm",
    "ForSequenceClassification": "classification",
}
DEFAULT_MASK_PROBABILITY = 0.15
PASSKEY_FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
PASSKEY_INTRO = "There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. "
PASSKEY_QUESTION = "What is the pass key? The pass key is "


@dataclass
class LoadedModel:
    """A model ready to evaluate: the module (eval mode), its tokenizer, its task and the folder's short name."""

    model: Any
    tokenizer: Any
    task: str
    name: str
    max_length: int | None
    takes_global_tokens: bool


# ---------------------------------------------------------------------------------------------- loading
def task_of(config, folder: str) -> str:
    """The task a folder's model is evaluated on, from its config (longattn) or its architecture (any family).

    Raises:
        ValueError: an encoder-decoder or a head no evaluation here applies to.
    """
    if getattr(config, "is_encoder_decoder", False):
        raise ValueError(
            f"{folder!r} is an encoder-decoder ({config.model_type}): longattn-eval evaluates causal LMs, masked "
            f"LMs and sequence classifiers."
        )
    for architecture in getattr(config, "architectures", None) or []:
        for suffix, task in _ARCHITECTURE_TASKS.items():
            if architecture.endswith(suffix):
                return task
    if getattr(config, "model_type", None) == "longattn":
        return "clm" if config.is_decoder else "mlm"
    raise ValueError(
        f"{folder!r} holds a {getattr(config, 'model_type', '?')} model with architectures "
        f"{getattr(config, 'architectures', None)}: longattn-eval needs a causal LM (…ForCausalLM, …LMHeadModel), "
        f"a masked LM (…ForMaskedLM) or a sequence classifier (…ForSequenceClassification); pass --task to say which."
    )


def load_folder(folder: str | Path, *, task: str | None = None) -> LoadedModel:
    """Load a saved folder with the Auto class of its task (longattn's kinds attached where its config has them).

    Raises:
        ValueError: not a model folder, an unsupported family or task.
    """
    from transformers import (
        AutoConfig,
        AutoModelForCausalLM,
        AutoModelForMaskedLM,
        AutoModelForSequenceClassification,
        AutoTokenizer,
    )

    import longattn  # noqa: F401  (the Auto classes and the "longattn" implementation then register when first needed)

    from ..configuration_longattn import max_tokens

    folder = str(folder)
    try:
        config = AutoConfig.from_pretrained(folder)
    except (OSError, ValueError) as error:
        raise ValueError(f"{folder!r} is not a model folder: {' '.join(str(error).split())}") from None
    if task is not None and task not in TASKS:
        raise ValueError(f"task={task!r} is not one of {TASKS}.")
    task = task or task_of(config, folder)
    auto = {
        "clm": AutoModelForCausalLM,
        "mlm": AutoModelForMaskedLM,
        "classification": AutoModelForSequenceClassification,
    }
    stock_kinds = getattr(config, "model_type", None) != "longattn" and getattr(config, "longattn", None)
    kwargs = {"attn_implementation": "longattn"} if stock_kinds else {}
    model = auto[task].from_pretrained(folder, **kwargs).eval()
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder)
    except (OSError, ValueError) as error:
        raise ValueError(
            f"{folder!r} has no tokenizer to read the corpus with: {' '.join(str(error).split())}"
        ) from None
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        task=task,
        name=Path(folder).name or folder,
        max_length=max_tokens(config),
        takes_global_tokens=bool(stock_kinds) or getattr(config, "model_type", None) == "longattn",
    )


# ---------------------------------------------------------------------------------------------- the corpus
def read_corpus(paths: Sequence[str | Path], *, text_column: str = "text") -> list[str]:
    """The documents of jsonl files (`text_column` of each row) or plain text files (one document each).

    Raises:
        ValueError: a missing file, a row without the column, or no text at all.
    """
    documents = []
    for path in map(Path, paths):
        if not path.is_file():
            raise ValueError(f"corpus file {str(path)!r} does not exist.")
        if path.suffix in (".jsonl", ".json"):
            for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
                if not line.strip():
                    continue
                row = json.loads(line)
                if text_column not in row:
                    raise ValueError(f"{path.name} line {number} has no {text_column!r} column (has {sorted(row)}).")
                documents.append(row[text_column])
        else:
            documents.append(path.read_text(encoding="utf-8"))
    documents = [text for text in documents if text.strip()]
    if not documents:
        raise ValueError(f"the corpus {[str(p) for p in paths]} holds no text.")
    return documents


def token_stream(tokenizer, documents: Sequence[str], *, task: str):
    """The corpus as one `[N]` id tensor, tokenized as the recipes tokenize (see the module docstring), and a
    bool `[N]` tensor marking special tokens (never scored)."""
    import torch

    pieces = []
    eos = tokenizer.eos_token_id
    for text in documents:
        ids = list(tokenizer(text, verbose=False)["input_ids"])
        if task == "clm" and eos is not None and (not ids or ids[-1] != eos):
            ids.append(eos)
        pieces.extend(ids)
    ids = torch.tensor(pieces, dtype=torch.long)
    special = torch.isin(ids, torch.tensor(sorted(set(tokenizer.all_special_ids)), dtype=torch.long))
    return ids, special


# ---------------------------------------------------------------------------------------------- loss by length
def _forward_logits(model, input_ids, *, global_first_token: bool):
    import torch

    kwargs = {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids)}
    if global_first_token:
        global_mask = torch.zeros_like(input_ids)
        global_mask[:, 0] = 1
        kwargs["global_attention_mask"] = global_mask
    return model(**kwargs).logits.float()


def loss_by_length(
    model,
    tokenizer,
    documents: Sequence[str],
    lengths: Sequence[int],
    *,
    task: str,
    seed: int = 0,
    mask_probability: float = DEFAULT_MASK_PROBABILITY,
    max_tokens: int | None = None,
    tokens_per_batch: int = 8192,
    global_first_token: bool = False,
    shuffle_context: bool = False,
    progress: bool = True,
) -> list[dict[str, Any]]:
    """Bits per token and per byte of the same tokens at each context length (non-overlapping windows).

    Args:
        model: A causal or masked LM (`model(input_ids=, attention_mask=[, global_attention_mask=]).logits`
            `[b, n, vocab]`), in eval mode.
        tokenizer: Its tokenizer.
        documents: The corpus texts.
        lengths: Context lengths in tokens.
        task: "clm" or "mlm".
        seed: The masked-LM mask's seed.
        mask_probability: The masked share of non-special tokens (masked LM).
        max_tokens: Evaluate the first `max_tokens` tokens of the stream only (rounded down to a multiple of the
            longest length).
        tokens_per_batch: Windows per forward pass: this many tokens' worth.
        global_first_token: Make each window's first token global (models with longattn's kinds).
        shuffle_context: Masked LM only: the order test. In each window the visible tokens trade places at random
            (seeded), the masked slots stay where they are: a model that reads its context as a bag of tokens scores
            the same, one that reads order and positions scores worse.
        progress: Show a progress bar.

    Returns:
        One row per length: `length`, `windows`, `tokens_scored`, `bits_per_token`, `bits_per_byte`,
        `bytes_per_token`.

    Raises:
        ValueError: a task other than clm/mlm, a bad length, a corpus shorter than the longest length, or
            `shuffle_context` with a causal LM.
    """
    from tqdm.auto import tqdm

    if task not in ("clm", "mlm"):
        raise ValueError(f"loss by length needs a causal or masked LM, not task={task!r}.")
    if shuffle_context and task != "mlm":
        raise ValueError("shuffle_context is the masked-LM order test: a causal LM's context is its order.")
    if not lengths or any(not isinstance(n, int) or n < 2 for n in lengths):
        raise ValueError(f"lengths={list(lengths)!r} must be integers >= 2.")
    ids, inputs, scored, bytes_per_token = _scored_stream(
        tokenizer, documents, lengths, task=task, seed=seed, mask_probability=mask_probability, max_tokens=max_tokens
    )
    total = len(ids)
    rows = []
    bar = tqdm(total=sum(total // n for n in lengths), desc="windows", disable=not progress, leave=False)
    for length in lengths:
        nll_sum, count = _windows_nll(
            model,
            ids,
            inputs,
            scored,
            length,
            task=task,
            seed=seed,
            tokens_per_batch=tokens_per_batch,
            global_first_token=global_first_token,
            shuffle_context=shuffle_context,
            bar=bar,
        )
        rows.append(_length_row(length, total // length, nll_sum, count, bytes_per_token))
    bar.close()
    return rows


def _length_row(length: int, windows: int, nll_sum: float, count: int, bytes_per_token: float) -> dict[str, Any]:
    """One row of `loss_by_length`, from the summed negative log-likelihood (nats) of `count` scored tokens."""
    bits_per_token = nll_sum / max(count, 1) / math.log(2)
    return {
        "length": length,
        "windows": windows,
        "tokens_scored": count,
        "bits_per_token": bits_per_token,
        "bits_per_byte": bits_per_token / bytes_per_token,
        "bytes_per_token": bytes_per_token,
    }


def _scored_stream(
    tokenizer,
    documents: Sequence[str],
    lengths: Sequence[int],
    *,
    task: str,
    seed: int,
    mask_probability: float,
    max_tokens: int | None,
):
    """The stream `loss_by_length` scores, cut to a multiple of the longest length (T tokens): the target ids `[T]`,
    the model's inputs `[T]` (the masked LM's with its mask tokens), which targets are scored (bool `[T]`) and the
    stream's UTF-8 bytes per text token.

    Raises:
        ValueError: a corpus shorter than the longest length.
    """
    import torch

    ids, special = token_stream(tokenizer, documents, task=task)
    longest = max(lengths)
    total = len(ids) if max_tokens is None else min(len(ids), max_tokens)
    total -= total % longest
    if total == 0:
        raise ValueError(
            f"the corpus has {len(ids)} tokens{'' if max_tokens is None else f' (max_tokens={max_tokens})'}, fewer "
            f"than the longest length {longest}: give more text or shorter lengths."
        )
    ids, special = ids[:total], special[:total]
    text_tokens = int((~special).sum())
    text_bytes = len(tokenizer.decode(ids[~special].tolist(), skip_special_tokens=True).encode("utf-8"))
    bytes_per_token = text_bytes / max(text_tokens, 1)

    positions = torch.arange(total)
    if task == "mlm":
        generator = torch.Generator().manual_seed(seed)
        scored = (torch.rand(total, generator=generator) < mask_probability) & ~special
        inputs = ids.masked_fill(scored, tokenizer.mask_token_id)
    else:  # a target is scored where it has context at every length, and is text
        scored = ~special
        for length in lengths:
            scored &= positions % length != 0
        inputs = ids
    return ids, inputs, scored, bytes_per_token


def _windows_nll(
    model,
    ids,
    inputs,
    scored,
    length: int,
    *,
    task: str,
    seed: int,
    tokens_per_batch: int,
    global_first_token: bool,
    shuffle_context: bool,
    bar,
) -> tuple[float, int]:
    """The summed negative log-likelihood (nats) of the `scored` targets `ids` of the stream, read in
    non-overlapping windows of `length` `inputs` (a batch of windows per forward pass), and how many were scored;
    `bar` counts the windows."""
    import torch

    windows = len(ids) // length
    batch = max(1, tokens_per_batch // length)
    nll_sum, count = 0.0, 0
    for start in range(0, windows, batch):
        stop = min(windows, start + batch)
        window_inputs = inputs[start * length : stop * length].view(-1, length)
        targets = ids[start * length : stop * length].view(-1, length)
        mask = scored[start * length : stop * length].view(-1, length)
        if shuffle_context:
            window_inputs = _shuffle_visible(window_inputs, mask, seed=seed + start)
        with torch.no_grad():
            logits = _forward_logits(model, window_inputs, global_first_token=global_first_token)
        if task == "clm":  # the logits at i predict the token at i + 1
            logits, targets, mask = logits[:, :-1], targets[:, 1:], mask[:, 1:]
        nll = torch.nn.functional.cross_entropy(logits[mask], targets[mask], reduction="sum")
        nll_sum += float(nll)
        count += int(mask.sum())
        bar.update(stop - start)
    return nll_sum, count


# ---------------------------------------------------------------------------------------------- passkey, needle
def _shuffle_visible(inputs, scored, *, seed: int):
    """`inputs` `[w, n]` with the tokens outside `scored` permuted at random within each row (seeded); the scored
    (masked) slots keep their place."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    shuffled = inputs.clone()
    for row in range(inputs.shape[0]):
        visible = (~scored[row]).nonzero().squeeze(1)
        shuffled[row, visible] = inputs[row, visible[torch.randperm(len(visible), generator=generator)]]
    return shuffled


def passkey_prompt(tokenizer, length: int, depth: float, key: str) -> tuple[list[int], list[int]]:
    """The ids of a passkey prompt of about `length` tokens with the key sentence at `depth` (0 = start, 1 = end
    of the filler), ending with the key itself; and the positions of the key's tokens (the last ones)."""
    needle = f"The pass key is {key}. Remember it. {key} is the pass key. "

    def encode(text: str) -> list[int]:
        return list(tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"])

    fixed = len(encode(PASSKEY_INTRO + needle + PASSKEY_QUESTION + key))
    if length < fixed:
        raise ValueError(f"passkey length {length} is shorter than the prompt without filler ({fixed} tokens).")
    filler_unit = encode(PASSKEY_FILLER)
    repeats = max(0, (length - fixed) // max(len(filler_unit), 1))
    before = round(repeats * depth)
    text = PASSKEY_INTRO + PASSKEY_FILLER * before + needle + PASSKEY_FILLER * (repeats - before) + PASSKEY_QUESTION
    prompt = encode(text)
    answer = encode(key)
    ids = prompt + answer
    return ids, list(range(len(prompt), len(ids)))


def passkey_accuracy(
    model,
    tokenizer,
    lengths: Sequence[int],
    depths: Sequence[float] = (0.0, 0.25, 0.5, 0.75, 1.0),
    *,
    trials: int = 5,
    seed: int = 0,
    global_first_token: bool = False,
    progress: bool = True,
) -> list[dict[str, Any]]:
    """Passkey retrieval by length and depth: the share of `trials` random 5-digit keys whose every token the
    model predicts (greedy, teacher-forced). Rows: `length`, `depth`, `tokens` (the prompt's length), `accuracy`,
    `digit_accuracy` (the share of key tokens predicted)."""
    import torch
    from tqdm.auto import tqdm

    rng = random.Random(seed)
    rows = []
    bar = tqdm(total=len(lengths) * len(depths) * trials, desc="passkey", disable=not progress, leave=False)
    for length in lengths:
        for depth in depths:
            if not 0.0 <= depth <= 1.0:
                raise ValueError(f"depth={depth!r} must lie in [0, 1].")
            retrieved, digits, total_digits, tokens = 0, 0, 0, 0
            for _ in range(trials):
                key = f"{rng.randrange(10**5):05d}"
                ids, answer = passkey_prompt(tokenizer, length, depth, key)
                tokens = len(ids)
                with torch.no_grad():
                    logits = _forward_logits(model, torch.tensor([ids]), global_first_token=global_first_token)[0]
                predicted = logits[[i - 1 for i in answer]].argmax(-1)
                hits = predicted == torch.tensor([ids[i] for i in answer])
                retrieved += bool(hits.all())
                digits += int(hits.sum())
                total_digits += len(answer)
                bar.update(1)
            rows.append(
                {
                    "length": length,
                    "depth": depth,
                    "tokens": tokens,
                    "accuracy": retrieved / trials,
                    "digit_accuracy": digits / max(total_digits, 1),
                }
            )
    bar.close()
    return rows


def needle_accuracy(
    model,
    tokenizer,
    lengths: Sequence[int],
    *,
    examples: int = 50,
    seed: int = 0,
    global_first_token: bool = True,
    progress: bool = True,
) -> list[dict[str, Any]]:
    """A `longattn-data needle` classifier's accuracy at each haystack length (characters; chance 0.1)."""
    import torch
    from tqdm.auto import tqdm

    from .needles import needle_examples

    id2label = getattr(model.config, "id2label", None) or {}
    rows = []
    for length in lengths:
        correct = 0
        rows_of_length = needle_examples(examples, seed=seed + length, min_length=length, max_length=length)
        for example in tqdm(rows_of_length, desc=f"needle {length}", disable=not progress, leave=False):
            ids = torch.tensor([tokenizer(example["text"], verbose=False)["input_ids"]])
            with torch.no_grad():
                logits = _forward_logits(model, ids, global_first_token=global_first_token)
            label = int(logits.argmax(-1))
            correct += str(id2label.get(label, label)) == str(example["label"])
        rows.append({"length": length, "examples": examples, "accuracy": correct / examples})
    return rows


# ---------------------------------------------------------------------------------------------- the command
def check_lengths(loaded: LoadedModel, lengths: Sequence[int], *, flag: str = "--lengths") -> None:
    """Raises ValueError when a length exceeds what the model reads."""
    too_long = [n for n in lengths if loaded.max_length is not None and n > loaded.max_length]
    if too_long:
        raise ValueError(
            f"{flag} {too_long} exceed the {loaded.max_length} tokens {loaded.name!r} reads: pass lengths up to "
            f"{loaded.max_length}, or lengthen the model first (longattn-lengthen SRC OUT --max_length N)."
        )


def evaluate_folders(args: argparse.Namespace) -> dict[str, Any]:
    """Evaluate every folder of `args` (see `build_parser`); the results dict that `results.json` holds."""
    loaded_models = [load_folder(folder, task=args.task) for folder in args.folders]
    documents = None
    results: dict[str, Any] = {
        "python_version": platform.python_version(),
        "corpus": [Path(p).name for p in args.corpus or []],
        "windows": "non-overlapping",
        "seed": args.seed,
        "mask_probability": args.mask_probability,
        "max_tokens": args.max_tokens,
        "shuffle_context": args.shuffle_context,
        "models": [],
    }
    for loaded in loaded_models:
        record: dict[str, Any] = {"name": loaded.name, "task": loaded.task, "max_length": loaded.max_length}
        global_first = args.global_first_token and loaded.takes_global_tokens
        record["global_first_token"] = global_first
        if loaded.task in ("clm", "mlm"):
            check_lengths(loaded, args.lengths)
            if args.corpus:
                documents = documents or read_corpus(args.corpus)
                record["loss_by_length"] = loss_by_length(
                    loaded.model,
                    loaded.tokenizer,
                    documents,
                    args.lengths,
                    task=loaded.task,
                    seed=args.seed,
                    mask_probability=args.mask_probability,
                    max_tokens=args.max_tokens,
                    global_first_token=global_first,
                    shuffle_context=args.shuffle_context,
                )
        if loaded.task == "clm" and args.passkey_lengths:
            check_lengths(loaded, args.passkey_lengths, flag="--passkey_lengths")
            record["passkey"] = passkey_accuracy(
                loaded.model,
                loaded.tokenizer,
                args.passkey_lengths,
                args.passkey_depths,
                trials=args.passkey_trials,
                seed=args.seed,
                global_first_token=global_first,
            )
        if loaded.task == "classification":
            record["needle"] = needle_accuracy(
                loaded.model,
                loaded.tokenizer,
                args.needle_lengths,
                examples=args.needle_examples,
                seed=args.seed,
                global_first_token=loaded.takes_global_tokens,
            )
        results["models"].append(record)
    return results


def format_table(results: dict[str, Any]) -> str:
    """The terminal table: one line per model and measure."""
    lines = []
    for record in results["models"]:
        if "loss_by_length" in record:
            cells = "  ".join(f"{row['length']:>6}: {row['bits_per_byte']:.4f}" for row in record["loss_by_length"])
            lines.append(f"{record['name']:<32} {record['task']:<4} bits/byte  {cells}")
        for row in record.get("passkey", []):
            lines.append(
                f"{record['name']:<32} clm  passkey length {row['length']} depth {row['depth']:.2f}: "
                f"accuracy {row['accuracy']:.2f} (key tokens {row['digit_accuracy']:.2f})"
            )
        for row in record.get("needle", []):
            lines.append(f"{record['name']:<32} cls  needle length {row['length']}: accuracy {row['accuracy']:.2f}")
    return "\n".join(lines)


def plot_loss_by_length(results: dict[str, Any], path: Path) -> Path | None:
    """Bits per byte against context length, one line per model; None when no model has loss rows or matplotlib
    is not installed (the `plot` extra)."""
    records = [r for r in results["models"] if r.get("loss_by_length")]
    if not records:
        return None
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (pip install matplotlib): no plot written", file=sys.stderr)
        return None
    figure, axis = plt.subplots(figsize=(6, 4))
    for record in records:
        rows = record["loss_by_length"]
        axis.plot([r["length"] for r in rows], [r["bits_per_byte"] for r in rows], marker="o", label=record["name"])
    axis.set_xscale("log", base=2)
    axis.set_xlabel("context length (tokens, non-overlapping windows)")
    axis.set_ylabel("bits per byte")
    axis.set_title(f"Loss by context length ({', '.join(results['corpus'])}, Python {results['python_version']})")
    axis.grid(alpha=0.3)
    axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path


def build_parser() -> argparse.ArgumentParser:
    from .command_line import CommandLineParser  # flags only as spelled: no abbreviation

    parser = CommandLineParser(
        prog="longattn-eval", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("folders", nargs="+", help="model folders (several: one line each in the table and the plot)")
    parser.add_argument("--corpus", nargs="*", help="jsonl files (a `text` column) or text files: loss by length")
    parser.add_argument("--lengths", nargs="+", type=int, default=[256, 512, 1024, 2048], help="context lengths")
    parser.add_argument("--task", choices=TASKS, help="default: from the folder's architecture")
    parser.add_argument("--seed", type=int, default=0, help="the masked-LM mask's and the passkeys' seed")
    parser.add_argument("--mask_probability", type=float, default=DEFAULT_MASK_PROBABILITY)
    parser.add_argument("--max_tokens", type=int, help="evaluate only the first N tokens of the corpus")
    parser.add_argument(
        "--global_first_token", action="store_true", help="each window's first token global (longattn's kinds)"
    )
    parser.add_argument(
        "--shuffle_context",
        action="store_true",
        help="masked LMs: the order test (each window's visible tokens shuffled, the masked slots kept)",
    )
    parser.add_argument("--passkey_lengths", nargs="*", type=int, default=[], help="causal LMs: passkey lengths")
    parser.add_argument("--passkey_depths", nargs="+", type=float, default=[0.0, 0.25, 0.5, 0.75, 1.0])
    parser.add_argument("--passkey_trials", type=int, default=5)
    parser.add_argument("--needle_lengths", nargs="+", type=int, default=[128, 256, 512], help="classifiers")
    parser.add_argument("--needle_examples", type=int, default=50)
    parser.add_argument("--output_dir", default="runs/eval", help="results.json and loss_by_length.png go here")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not 0 < args.mask_probability < 1:
        parser.error(f"--mask_probability {args.mask_probability} must lie in (0, 1).")
    try:
        results = evaluate_folders(args)
    except ValueError as error:
        print(f"{parser.prog}: error: {' '.join(str(error).split())}", file=sys.stderr)
        return 2
    output_dir = Path(args.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    (output_dir / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    print(format_table(results))
    print(f"results: {output_dir / 'results.json'}")
    plot = plot_loss_by_length(results, output_dir / "loss_by_length.png")
    if plot is not None:
        print(f"plot: {plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
