"""Offline data for demos and tests: the Long Range Arena ListOps task and long-range synthetic tasks, as jsonl.

Every generator is a pure function of its arguments and a seed, and writes `train.jsonl`, `validation.jsonl`,
`test.jsonl` (plus `info.json` with the parameters) that the recipes read like any user data:

- `listops` (Tay et al. 2021, after Nangia & Bowman 2018): `{"text": "[MAX 4 3 [MIN 2 3 ] 1 0 ]", "label": 4}`.
  Nested lists of the operators MAX, MIN, MED (median, rounded down) and SM (sum modulo 10) over the digits 0-9,
  ten classes. The rules of the LRA generator: a node at depth < `max_depth` is an operator with probability 0.25
  (else a digit; always a digit at `max_depth`), an operator takes 2..`max_args` arguments, the length counts one
  token per operator, digit and closing bracket, and trees are drawn until `min_length < length < max_length`
  (LRA: depth 10, 10 arguments, lengths 500-2000, duplicates dropped). Splits never share an expression.
  `--lra` gives LRA's split sizes (96,000 / 2,000 / 2,000; about 25 s of CPU: the trees are drawn thousands at a
  time with numpy) and `--tokenizer_dir` saves `listops_tokenizer`, the word-level tokenizer that reads an
  expression at its LRA length (one id per token, plus `<s>` and `</s>`).
- `needle` (classification): `{"text": "qz ujvb...7...kd", "label": 7}`: one digit hidden at a uniformly random
  position of a random lowercase haystack; the label is the digit. Half of the needles lie farther from the first
  token than any local window reaches, so a model must move information across the whole sequence (global tokens,
  or a receptive field that covers it); a small sliding-window model with a global first token learns it in minutes.
- `needles` (sequence to sequence): `{"source": "...3...9...1...", "target": "1 3 9"}`: 1..`max_needles` digits
  hidden in a haystack; the target lists them in increasing order (order-free, so the decoder's cross-attention
  needs no absolute positions). A long-document "summarisation" in miniature, evaluated by generation.
- `stdlib` (language modelling, `longattn.train.corpus`): the Python standard library's source, one document per
  file, split by a hash of each file's path; a real corpus every machine has.

CLI (see `--help`):

    longattn-data needle --output_dir data/generated/needle --num_train 4000
    longattn-data stdlib --output_dir data/stdlib
    longattn-data listops --lra --output_dir data/generated/listops-lra \\
        --tokenizer_dir data/generated/listops-lra-tokenizer
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
from pathlib import Path
from typing import Any, Callable, Union

import numpy as np

from ..tools.command_line import CommandLineParser
from ..tools.needles import HAYSTACK_ALPHABET, needle_examples, needles_examples  # noqa: F401 (the tasks' home)

# ---------------------------------------------------------------------------------------------- ListOps
LISTOPS_OPERATORS = ("MAX", "MIN", "MED", "SM")
LISTOPS_OPERATOR_PROBABILITY = 0.25  # LRA: a node below the depth limit is an operator with this probability
LISTOPS_LRA_DEFAULTS = {"max_depth": 10, "max_args": 10, "min_length": 500, "max_length": 2000}
# LRA's split sizes (the flags num_train_samples / num_valid_samples / num_test_samples of its generator).
LISTOPS_LRA_SIZES = {"num_train": 96_000, "num_validation": 2_000, "num_test": 2_000}
# Every token of an expression (the words of `listops_tokenizer`): digit d has code d, operator i code 10 + i.
LISTOPS_WORDS = (*map(str, range(10)), *(f"[{operator}" for operator in LISTOPS_OPERATORS), "]")
_CLOSE = len(LISTOPS_WORDS) - 1  # the code of "]"
_TREES_PER_DRAW = 4096  # a fixed number, so that the first n examples of a seed do not depend on how many are asked

# A tree is a digit or (operator, [children]).
Tree = Union[int, tuple[str, list["Tree"]]]


@dataclasses.dataclass
class _Level:
    """The nodes of many trees at one depth, each `[nodes]`: ordered by parent, a node's arguments contiguous and in
    order (`np.repeat` of the level above)."""

    tree: np.ndarray  # which tree
    parent: np.ndarray  # index of the parent in the level above (-1 for the roots)
    is_operator: np.ndarray  # bool
    symbol: np.ndarray  # the operator's index in LISTOPS_OPERATORS, or the digit
    num_args: np.ndarray  # arguments of an operator, 0 for a digit


def _draw_listops_levels(
    rng: np.random.Generator, num_trees: int, *, max_depth: int, max_args: int, max_length: int
) -> tuple[list[_Level], np.ndarray, np.ndarray]:
    """`num_trees` trees drawn with LRA's rules (see the module docstring), all at once, one depth at a time.

    A tree stops growing once it holds `max_length` tokens (counting one per argument still to draw): LRA would
    reject it, so the rest of it is not drawn, which leaves the distribution of the kept trees unchanged.

    Returns:
        (levels, length `[num_trees]` tokens, complete `[num_trees]` bool: drawn to the end, its length exact).
    """
    levels = []
    tree, parent = np.arange(num_trees), np.full(num_trees, -1)
    length = np.ones(num_trees, dtype=np.int64)  # a node counts 1 when its parent draws it
    complete = np.ones(num_trees, dtype=bool)
    for depth in range(1, max_depth + 1):
        n = len(tree)
        is_operator = rng.random(n) < LISTOPS_OPERATOR_PROBABILITY if depth < max_depth else np.zeros(n, bool)
        num_args = np.where(is_operator, rng.integers(2, max_args + 1, n), 0)
        symbol = np.where(is_operator, rng.integers(0, len(LISTOPS_OPERATORS), n), rng.integers(0, 10, n))
        # An operator adds its closing bracket and one token per argument (an argument's own bracket comes later).
        length += np.bincount(tree, weights=(1 + num_args) * is_operator, minlength=num_trees).astype(np.int64)
        complete &= length < max_length
        stopped = ~complete[tree]
        is_operator[stopped], num_args[stopped] = False, 0
        levels.append(_Level(tree, parent, is_operator, symbol, num_args))
        parent = np.repeat(np.arange(n), num_args)
        tree = tree[parent]
        if len(tree) == 0:
            break
    return levels, length, complete


def _operator_values(
    operators: np.ndarray, counts: np.ndarray, child_values: np.ndarray, child_parent: np.ndarray
) -> np.ndarray:
    """The values of operator nodes `[m]` from their arguments' values, contiguous groups of `counts` `[m]`."""
    starts = np.cumsum(counts) - counts
    ordered = child_values[np.lexsort((child_values, child_parent))]  # each group sorted, for the median
    median = (ordered[starts + (counts - 1) // 2] + ordered[starts + counts // 2]) // 2  # even: rounded down
    by_operator = {
        "MAX": np.maximum.reduceat(child_values, starts),
        "MIN": np.minimum.reduceat(child_values, starts),
        "MED": median,
        "SM": np.add.reduceat(child_values, starts) % 10,
    }
    table = np.stack([by_operator[operator] for operator in LISTOPS_OPERATORS])  # [4, m]
    return table[operators, np.arange(len(operators))]


def _listops_batch(levels: list[_Level], selected: np.ndarray) -> tuple[list[str], np.ndarray]:
    """The text and value of the `selected` trees (`[num_trees]` bool, complete trees only), in tree order.

    Bottom-up: the tokens of every subtree (`size`) and the value of every node; top-down: where each node's first
    token lies in its tree (`start`): an argument starts after its operator's token and the arguments before it.
    """
    sizes, values = [None] * len(levels), [None] * len(levels)
    for d in reversed(range(len(levels))):
        level = levels[d]
        sizes[d] = np.ones(len(level.tree), dtype=np.int64)
        values[d] = level.symbol.copy()
        ops = np.flatnonzero(level.is_operator)
        if len(ops):
            child = levels[d + 1]
            sizes[d][ops] = 2 + np.bincount(child.parent, weights=sizes[d + 1], minlength=len(level.tree))[ops]
            values[d][ops] = _operator_values(level.symbol[ops], level.num_args[ops], values[d + 1], child.parent)
    starts = [np.zeros(len(levels[0].tree), dtype=np.int64)]
    for d in range(1, len(levels)):
        child, above = levels[d], levels[d - 1]
        before = np.cumsum(sizes[d]) - sizes[d]  # tokens of the level before each node
        first = (np.cumsum(above.num_args) - above.num_args)[child.parent]  # the first argument of the same operator
        starts.append(starts[d - 1][child.parent] + 1 + before - before[first])
    lengths = sizes[0][selected]
    base = np.full(len(selected), -1)
    base[selected] = np.cumsum(lengths) - lengths
    codes = np.empty(int(lengths.sum()), dtype=np.int64)
    for level, size, start in zip(levels, sizes, starts):
        keep = selected[level.tree]
        position = base[level.tree[keep]] + start[keep]
        operator = level.is_operator[keep]
        codes[position] = np.where(operator, 10 + level.symbol[keep], level.symbol[keep])
        codes[position[operator] + size[keep][operator] - 1] = _CLOSE
    words = np.array(LISTOPS_WORDS, dtype=object)
    texts = [" ".join(words[piece].tolist()) for piece in np.split(codes, np.cumsum(lengths)[:-1])]
    return texts, values[0][selected]


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

    Trees are drawn `_TREES_PER_DRAW` at a time with numpy (LRA's 100,000 expressions take seconds, not minutes), so
    the examples of a seed are a function of the seed alone: asking for fewer gives a prefix of the same list.

    Args:
        num_examples: How many examples.
        seed: Seed of the generator's own `numpy.random.Generator`.
        max_depth / max_args / min_length / max_length: LRA's knobs (its values are the defaults).
        exclude: Expressions to skip (another split's), updated with the new ones.
        max_tries: Give up once this many trees were drawn (default 2000 per example).

    Raises:
        ValueError: invalid knobs, or the length window is too rare for these depth/argument limits.
    """
    if max_depth < 2 or max_args < 2:
        raise ValueError(f"max_depth={max_depth} and max_args={max_args} must both be >= 2.")
    if not 0 <= min_length < max_length - 1:
        raise ValueError(
            f"need 0 <= min_length < max_length - 1, got min_length={min_length}, max_length={max_length}."
        )
    rng = np.random.default_rng(seed)
    seen = exclude if exclude is not None else set()
    examples: list[dict[str, Any]] = []
    max_tries = max_tries if max_tries is not None else 2000 * max(num_examples, 1)
    tries = 0
    while len(examples) < num_examples:
        if tries >= max_tries:
            raise ValueError(
                f"only {len(examples)} of {num_examples} ListOps trees fell in {min_length} < length < {max_length} "
                f"after {tries} tries: raise max_depth ({max_depth}) / max_args ({max_args}) or widen the window."
            )
        tries += _TREES_PER_DRAW
        levels, length, complete = _draw_listops_levels(
            rng, _TREES_PER_DRAW, max_depth=max_depth, max_args=max_args, max_length=max_length
        )
        texts, labels = _listops_batch(levels, complete & (length > min_length))
        for text, label in zip(texts, labels.tolist()):
            if len(examples) == num_examples:
                break
            if text not in seen:
                seen.add(text)
                examples.append({"text": text, "label": label})
    return examples


def listops_tokenizer(model_max_length: int = LISTOPS_LRA_DEFAULTS["max_length"] + 1):
    """The word-level tokenizer of ListOps (`tokenization_longattn.word_level_tokenizer` over `LISTOPS_WORDS`):
    20 ids, one per digit, operator and `]` plus `<pad> <s> </s> <mask> <unk>`, so an expression of n tokens
    is read as n + 2 ids (at most 2,001 with LRA's lengths, the default `model_max_length`) where the byte tokenizer
    needs 2-3 ids per token."""
    from ..tokenization_longattn import word_level_tokenizer  # transformers is loaded only when a tokenizer is asked

    return word_level_tokenizer(LISTOPS_WORDS, model_max_length=model_max_length)


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
DEFAULT_SIZES = {"num_train": 4000, "num_validation": 500, "num_test": 500}
COLUMNS = {"listops": ["text", "label"], "needle": ["text", "label"], "needles": ["source", "target"]}


def build_parser() -> argparse.ArgumentParser:
    parser = CommandLineParser(
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
        for split, size in DEFAULT_SIZES.items():
            p.add_argument(
                f"--{split}", type=int, help=f"default {size}" + (", LRA's with --lra" * (task == "listops"))
            )
        p.add_argument("--seed", type=int, default=0)
        p.add_argument("--min_length", type=int, default=defaults[task][0])
        p.add_argument("--max_length", type=int, default=defaults[task][1])
        if task == "listops":
            p.add_argument("--max_depth", type=int, default=LISTOPS_LRA_DEFAULTS["max_depth"])
            p.add_argument("--max_args", type=int, default=LISTOPS_LRA_DEFAULTS["max_args"])
            p.add_argument(
                "--lra",
                action="store_true",
                help="LRA's split sizes: 96,000 / 2,000 / 2,000 (the other defaults are LRA's already)",
            )
            p.add_argument("--tokenizer_dir", help="also save the word-level ListOps tokenizer (AutoTokenizer) here")
        if task == "needles":
            p.add_argument("--max_needles", type=int, default=3)
    stdlib_help = "the Python standard library's source, one document per file, split by file (a real corpus)."
    p = sub.add_parser("stdlib", help=stdlib_help, description=stdlib_help)
    p.add_argument("--output_dir", default="data/stdlib", help="where the jsonl files go")
    p.add_argument("--validation_percent", type=int, default=5, help="share of files held out for validation")
    p.add_argument("--test_percent", type=int, default=5, help="share of files held out for test")
    p.add_argument("--include_tests", action="store_true", help="keep the stdlib's test suites (excluded by default)")
    p.add_argument("--root", help="another source tree instead of this interpreter's standard library")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    write = _write_stdlib if args.task == "stdlib" else _write_generated
    try:
        write(parser, args)
    except ValueError as error:  # a setting the task refuses: a usage error, said without a traceback
        print(f"{parser.prog}: error: {error}", file=sys.stderr)
        return 2
    return 0


def _write_generated(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """A generated task (`generate_task`): its splits, and ListOps' tokenizer when asked."""
    sizes = LISTOPS_LRA_SIZES if getattr(args, "lra", False) else DEFAULT_SIZES
    for name, default in sizes.items():  # an explicit size wins over --lra's
        if getattr(args, name) is None:
            setattr(args, name, default)
        if getattr(args, name) < 0:
            parser.error(f"--{name} must be >= 0")
    tokenizer_dir = getattr(args, "tokenizer_dir", None)
    settings = {"task", "output_dir", "num_train", "num_validation", "num_test", "seed", "lra", "tokenizer_dir"}
    knobs = {k: v for k, v in vars(args).items() if k not in settings}
    split_sizes = {name: getattr(args, name) for name in sizes}
    paths = generate_task(args.task, args.output_dir, seed=args.seed, **split_sizes, **knobs)
    for split, path in paths.items():
        print(f"{split}: {path}")
    if tokenizer_dir:
        # The longest expression (max_length - 1 tokens) with <s> and </s>.
        listops_tokenizer(model_max_length=args.max_length + 1).save_pretrained(tokenizer_dir)
        print(f"tokenizer: {tokenizer_dir}")


def _write_stdlib(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """The standard-library corpus (`corpus.write_stdlib_corpus`): its splits and their sizes."""
    from . import corpus

    options = ("root", "validation_percent", "test_percent", "include_tests")
    paths = corpus.write_stdlib_corpus(args.output_dir, **{name: getattr(args, name) for name in options})
    info = json.loads((Path(args.output_dir) / "info.json").read_text())
    for split, path in paths.items():
        print(f"{split}: {path} ({info['files'][split]} files, {info['bytes'][split]:,} bytes)")
    print(f"Python {info['python_version']}")


if __name__ == "__main__":
    sys.exit(main())
