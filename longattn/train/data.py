"""Offline data for demos and tests: the Long Range Arena ListOps task and long-range synthetic tasks, as jsonl.

Every generator is a pure function of its arguments and a seed, and writes `train.jsonl`, `validation.jsonl`,
`test.jsonl` (plus `info.json` with the parameters) that the recipes read like any user data:

- `listops` (Tay et al. 2021, after Nangia & Bowman 2018): `{"text": "[MAX 4 3 [MIN 2 3 ] 1 0 ]", "label": 4}`.
  Nested lists of the operators MAX, MIN, MED (median, rounded down) and SM (sum modulo 10) over the digits 0-9,
  ten classes. The rules of the LRA generator: a node at depth < `max_depth` is an operator with probability 0.25
  (else a digit; always a digit at `max_depth`), an operator takes 2..`max_args` arguments, the length counts one
  token per operator, digit and closing bracket, and trees are drawn until `min_length < length < max_length`
  (LRA: depth 10, 10 arguments, lengths 500-2000, duplicates dropped). Splits never share an expression.
- `needle` (classification): `{"text": "qz ujvb...7...kd", "label": 7}`: one digit hidden at a uniformly random
  position of a random lowercase haystack; the label is the digit. Half of the needles lie farther from the first
  token than any local window reaches, so a model must move information across the whole sequence (global tokens,
  or a receptive field that covers it); a small sliding-window model with a global first token learns it in minutes.
- `needles` (sequence to sequence): `{"source": "...3...9...1...", "target": "1 3 9"}`: 1..`max_needles` digits
  hidden in a haystack; the target lists them in increasing order (order-free, so the decoder's cross-attention
  needs no absolute positions). A long-document "summarisation" in miniature, evaluated by generation.

CLI: `longattn-data needle --output_dir data/generated/needle --num_train 4000` (see `--help`).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import string
import sys
from pathlib import Path
from typing import Any, Callable, Union

# ---------------------------------------------------------------------------------------------- ListOps
LISTOPS_OPERATORS = ("MAX", "MIN", "MED", "SM")
LISTOPS_OPERATOR_PROBABILITY = 0.25  # LRA: a node below the depth limit is an operator with this probability
LISTOPS_LRA_DEFAULTS = {"max_depth": 10, "max_args": 10, "min_length": 500, "max_length": 2000}

# A tree is a digit or (operator, [children]).
Tree = Union[int, tuple[str, list["Tree"]]]


def _listops_tree(rng: random.Random, depth: int, max_depth: int, max_args: int) -> tuple[Tree, int]:
    """A random tree and its length in tokens (operator + arguments + closing bracket)."""
    if depth >= max_depth or rng.random() >= LISTOPS_OPERATOR_PROBABILITY:
        return rng.randrange(10), 1
    operator = rng.choice(LISTOPS_OPERATORS)
    children, length = [], 2
    for _ in range(rng.randint(2, max_args)):
        child, child_length = _listops_tree(rng, depth + 1, max_depth, max_args)
        children.append(child)
        length += child_length
    return (operator, children), length


def listops_value(tree: Tree) -> int:
    """The value (0-9) of a ListOps tree."""
    if isinstance(tree, int):
        return tree
    operator, children = tree
    values = [listops_value(child) for child in children]
    if operator == "MAX":
        return max(values)
    if operator == "MIN":
        return min(values)
    if operator == "MED":
        return int(statistics.median(values))  # the mean of the two middle values when even, rounded down
    if operator == "SM":
        return sum(values) % 10
    raise ValueError(f"unknown ListOps operator {operator!r}: expected one of {list(LISTOPS_OPERATORS)}.")


def listops_string(tree: Tree) -> str:
    """`[MAX 4 3 [MIN 2 3 ] 1 0 ]`: one space-separated token per operator, digit and closing bracket."""
    if isinstance(tree, int):
        return str(tree)
    operator, children = tree
    return " ".join([f"[{operator}", *(listops_string(child) for child in children), "]"])


def parse_listops(text: str) -> Tree:
    """Inverse of `listops_string` (raises `ValueError` on malformed input)."""
    tokens = text.split()
    position = 0

    def parse() -> Tree:
        nonlocal position
        if position >= len(tokens):
            raise ValueError("unexpected end of ListOps expression")
        token = tokens[position]
        position += 1
        if token.isdigit() and len(token) == 1:
            return int(token)
        if token.startswith("[") and token[1:] in LISTOPS_OPERATORS:
            children = []
            while position < len(tokens) and tokens[position] != "]":
                children.append(parse())
            if position >= len(tokens):
                raise ValueError(f"unclosed {token}")
            position += 1
            return token[1:], children
        raise ValueError(f"unexpected ListOps token {token!r}")

    tree = parse()
    if position != len(tokens):
        raise ValueError(f"trailing tokens after a complete expression: {tokens[position:]}")
    return tree


def listops_examples(
    num_examples: int,
    *,
    seed: int = 0,
    max_depth: int = 10,
    max_args: int = 10,
    min_length: int = 500,
    max_length: int = 2000,
    exclude: set[str] | None = None,
    max_tries: int | None = None,
) -> list[dict[str, Any]]:
    """`num_examples` distinct ListOps examples `{"text", "label"}` with `min_length < tokens < max_length`.

    Args:
        num_examples: How many examples.
        seed: Seed of the generator's own `random.Random`.
        max_depth / max_args / min_length / max_length: LRA's knobs (its values are the defaults).
        exclude: Expressions to skip (another split's), updated with the new ones.
        max_tries: Give up after this many trees (default 2000 per example).

    Raises:
        ValueError: invalid knobs, or the length window is too rare for these depth/argument limits.
    """
    if max_depth < 2 or max_args < 2:
        raise ValueError(f"max_depth={max_depth} and max_args={max_args} must both be >= 2.")
    if not 0 <= min_length < max_length - 1:
        raise ValueError(
            f"need 0 <= min_length < max_length - 1, got min_length={min_length}, max_length={max_length}."
        )
    rng = random.Random(seed)
    seen = exclude if exclude is not None else set()
    examples: list[dict[str, Any]] = []
    max_tries = max_tries if max_tries is not None else 2000 * max(num_examples, 1)
    tries = 0
    while len(examples) < num_examples:
        tries += 1
        if tries > max_tries:
            raise ValueError(
                f"only {len(examples)} of {num_examples} ListOps trees fell in {min_length} < length < {max_length} "
                f"after {max_tries} tries: raise max_depth ({max_depth}) / max_args ({max_args}) or widen the window."
            )
        tree, length = _listops_tree(rng, 1, max_depth, max_args)
        if not min_length < length < max_length:
            continue
        text = listops_string(tree)
        if text in seen:
            continue
        seen.add(text)
        examples.append({"text": text, "label": listops_value(tree)})
    return examples


# ---------------------------------------------------------------------------------------------- needles
HAYSTACK_ALPHABET = string.ascii_lowercase + " "


def _haystack(rng: random.Random, length: int) -> list[str]:
    return rng.choices(HAYSTACK_ALPHABET, k=length)


def _check_lengths(min_length: int, max_length: int, *, least: int) -> None:
    if not least <= min_length <= max_length:
        raise ValueError(
            f"need {least} <= min_length <= max_length, got min_length={min_length}, max_length={max_length}."
        )


def needle_examples(
    num_examples: int, *, seed: int = 0, min_length: int = 256, max_length: int = 512
) -> list[dict[str, Any]]:
    """`{"text", "label"}`: one digit at a uniform position of a `min_length..max_length`-character haystack."""
    _check_lengths(min_length, max_length, least=1)
    rng = random.Random(seed)
    examples = []
    for _ in range(num_examples):
        chars = _haystack(rng, rng.randint(min_length, max_length))
        digit = rng.randrange(10)
        chars[rng.randrange(len(chars))] = str(digit)
        examples.append({"text": "".join(chars), "label": digit})
    return examples


def needles_examples(
    num_examples: int, *, seed: int = 0, min_length: int = 256, max_length: int = 512, max_needles: int = 3
) -> list[dict[str, Any]]:
    """`{"source", "target"}`: 1..`max_needles` digits hidden in a haystack; target = the digits, sorted."""
    _check_lengths(min_length, max_length, least=max(max_needles, 1))
    if max_needles < 1:
        raise ValueError(f"max_needles={max_needles} must be >= 1.")
    rng = random.Random(seed)
    examples = []
    for _ in range(num_examples):
        chars = _haystack(rng, rng.randint(min_length, max_length))
        digits = [rng.randrange(10) for _ in range(rng.randint(1, max_needles))]
        for position, digit in zip(rng.sample(range(len(chars)), len(digits)), digits):
            chars[position] = str(digit)
        examples.append({"source": "".join(chars), "target": " ".join(str(d) for d in sorted(digits))})
    return examples


# ---------------------------------------------------------------------------------------------- files and CLI
SPLITS = ("train", "validation", "test")


def write_jsonl(path: str | Path, examples: list[dict[str, Any]]) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        for example in examples:
            f.write(json.dumps(example, ensure_ascii=False) + "\n")
    return path


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    with Path(path).open(encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def generate_task(
    task: str,
    output_dir: str | Path,
    *,
    num_train: int,
    num_validation: int,
    num_test: int,
    seed: int = 0,
    **knobs: Any,
) -> dict[str, Path]:
    """Write the splits of `task` to `output_dir` (a split of size 0 is not written); return {split: path}.

    `output_dir` also loads as a dataset folder: `datasets.load_dataset(output_dir)` (or the recipes'
    `--dataset_name output_dir`) finds the splits by their file names. Each split has its own seed (`seed`, `seed + 1`,
    `seed + 2`); ListOps splits never share an expression.
    """
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}: expected one of {sorted(TASKS)}.")
    sizes = {"train": num_train, "validation": num_validation, "test": num_test}
    generator = TASKS[task]
    output_dir = Path(output_dir)
    paths = {}
    extra: dict[str, Any] = {"exclude": set()} if task == "listops" else {}
    for offset, split in enumerate(SPLITS):
        path = output_dir / f"{split}.jsonl"
        path.unlink(missing_ok=True)
        if sizes[split] == 0:  # no empty file: `datasets.load_dataset(output_dir)` rejects empty splits
            continue
        examples = generator(sizes[split], seed=seed + offset, **knobs, **extra)
        paths[split] = write_jsonl(path, examples)
    info = {"task": task, "seed": seed, "sizes": sizes, **knobs, "columns": COLUMNS[task]}
    (output_dir / "info.json").write_text(json.dumps(info, indent=2) + "\n")
    return paths


TASKS: dict[str, Callable[..., list[dict[str, Any]]]] = {
    "listops": listops_examples,
    "needle": needle_examples,
    "needles": needles_examples,
}
COLUMNS = {"listops": ["text", "label"], "needle": ["text", "label"], "needles": ["source", "target"]}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="longattn-data",
        description="Generate offline long-range tasks as train/validation/test jsonl files.",
    )
    sub = parser.add_subparsers(dest="task", required=True)
    defaults = {"listops": (500, 2000), "needle": (256, 512), "needles": (256, 512)}
    helps = {
        "listops": "Long Range Arena ListOps (text, label); lengths in tokens, LRA defaults.",
        "needle": "one digit hidden in a random haystack (text, label); lengths in characters.",
        "needles": "several digits hidden in a haystack, target = them sorted (source, target).",
    }
    for task in TASKS:
        p = sub.add_parser(task, help=helps[task], description=helps[task])
        p.add_argument("--output_dir", default=f"data/generated/{task}", help="where the jsonl files go")
        p.add_argument("--num_train", type=int, default=4000)
        p.add_argument("--num_validation", type=int, default=500)
        p.add_argument("--num_test", type=int, default=500)
        p.add_argument("--seed", type=int, default=0)
        p.add_argument("--min_length", type=int, default=defaults[task][0])
        p.add_argument("--max_length", type=int, default=defaults[task][1])
        if task == "listops":
            p.add_argument("--max_depth", type=int, default=LISTOPS_LRA_DEFAULTS["max_depth"])
            p.add_argument("--max_args", type=int, default=LISTOPS_LRA_DEFAULTS["max_args"])
        if task == "needles":
            p.add_argument("--max_needles", type=int, default=3)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    knobs = {
        k: v
        for k, v in vars(args).items()
        if k not in {"task", "output_dir", "num_train", "num_validation", "num_test", "seed"}
    }
    for name in ("num_train", "num_validation", "num_test"):
        if getattr(args, name) < 0:
            parser.error(f"--{name} must be >= 0")
    try:
        paths = generate_task(
            args.task,
            args.output_dir,
            num_train=args.num_train,
            num_validation=args.num_validation,
            num_test=args.num_test,
            seed=args.seed,
            **knobs,
        )
    except ValueError as error:
        print(f"{parser.prog}: error: {error}", file=sys.stderr)
        return 2
    for split, path in paths.items():
        print(f"{split}: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
