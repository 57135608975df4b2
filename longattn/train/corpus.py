"""A real text corpus that every machine has: the Python standard library's own source.

Long-context language modelling needs documents long enough that context far away helps. The standard library's
`.py` files are such documents (median about 8 KB, one in ten over 35 KB: names are defined hundreds of lines above
their use, classes refer to their own methods, docstrings to the code below them), they are on every machine that
runs longattn, and their licence (PSF) allows any use.

The split is by file and deterministic: a file's split is a function of its path relative to the stdlib folder alone
(the first 8 bytes of its SHA-256, modulo 100: below `validation_percent + test_percent` the file is held out), so it
does not depend on the order the file system lists files in, on the machine or on the other files present. Test
suites (`test/`, `tests/`, `idle_test/`) are excluded by default (`include_tests=True` keeps them, split as any other
file); so are installed third-party packages (`site-packages`, `dist-packages`). Documents are kept whole, one jsonl
row each: `{"text": source, "path": "json/decoder.py"}`.

The figures trained on this corpus depend on the Python version (its standard library changes between releases):
`info.json` records it, and every results file written by `longattn-eval` records it again.

    longattn-data stdlib --output_dir data/stdlib
"""

from __future__ import annotations

import hashlib
import json
import platform
import sysconfig
from pathlib import Path
from typing import Any

TEST_FOLDERS = frozenset({"test", "tests", "idle_test"})
SPLITS = ("train", "validation", "test")
THIRD_PARTY_FOLDERS = frozenset({"site-packages", "dist-packages", "__pycache__"})


def stdlib_root() -> Path:
    """The folder of the running interpreter's standard library (`sysconfig`'s `stdlib` path)."""
    return Path(sysconfig.get_paths()["stdlib"])


def split_of(relative_path: str, *, validation_percent: int, test_percent: int) -> str:
    """The split of one file, from its relative path alone: `"train"`, `"validation"` or `"test"`."""
    digest = hashlib.sha256(relative_path.encode("utf-8")).digest()
    bucket = int.from_bytes(digest[:8], "little") % 100
    if bucket < test_percent:
        return "test"
    if bucket < test_percent + validation_percent:
        return "validation"
    return "train"


def stdlib_documents(root: Path | None = None, *, include_tests: bool = False) -> list[tuple[str, str]]:
    """`(relative path, source)` of every `.py` file under `root` (default: this interpreter's standard library),
    sorted by path; test suites and third-party packages excluded (tests kept with `include_tests`). Files that are
    not UTF-8 or are empty are skipped."""
    root = Path(root) if root is not None else stdlib_root()
    if not root.is_dir():
        raise ValueError(f"stdlib root {str(root)!r} is not a folder.")
    skipped = THIRD_PARTY_FOLDERS | (frozenset() if include_tests else TEST_FOLDERS)
    documents = []
    for path in sorted(root.rglob("*.py")):
        relative = path.relative_to(root)
        if skipped.intersection(relative.parts[:-1]):
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if text.strip():
            documents.append((relative.as_posix(), text))
    return documents


def write_stdlib_corpus(
    output_dir: str | Path,
    *,
    root: str | Path | None = None,
    validation_percent: int = 5,
    test_percent: int = 5,
    include_tests: bool = False,
) -> dict[str, Path]:
    """Write `train.jsonl`, `validation.jsonl`, `test.jsonl` and `info.json` (sizes, Python version) to
    `output_dir`; return {split: path}.

    Raises:
        ValueError: percentages outside [1, 49] or a split left empty (a root with too few files).
    """
    for name, value in (("validation_percent", validation_percent), ("test_percent", test_percent)):
        if not isinstance(value, int) or not 1 <= value <= 49:
            raise ValueError(f"{name}={value!r} must be an integer in [1, 49].")
    documents = stdlib_documents(None if root is None else Path(root), include_tests=include_tests)
    splits: dict[str, list[dict[str, str]]] = {name: [] for name in SPLITS}
    for relative, text in documents:
        split = split_of(relative, validation_percent=validation_percent, test_percent=test_percent)
        splits[split].append({"text": text, "path": relative})
    empty = [name for name, rows in splits.items() if not rows]
    if empty:
        raise ValueError(f"the corpus has {len(documents)} files, which leave the split(s) {empty} empty.")
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    paths = {}
    for name, rows in splits.items():
        path = output_dir / f"{name}.jsonl"
        with path.open("w", encoding="utf-8") as f:
            for row in rows:
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
        paths[name] = path
    info: dict[str, Any] = {
        "task": "stdlib",
        "python_version": platform.python_version(),
        "include_tests": include_tests,
        "validation_percent": validation_percent,
        "test_percent": test_percent,
        "files": {name: len(rows) for name, rows in splits.items()},
        "bytes": {name: sum(len(row["text"].encode("utf-8")) for row in rows) for name, rows in splits.items()},
        "columns": ["text", "path"],
    }
    (output_dir / "info.json").write_text(json.dumps(info, indent=2) + "\n")
    return paths
