"""Offline data generators: ListOps with the Long Range Arena rules, the needle tasks, the jsonl files and the CLI."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from longattn.train import data


@pytest.mark.parametrize(
    "text, value",
    [
        ("[MAX 4 3 [MIN 2 3 ] 1 0 ]", 4),
        ("[MIN 4 3 [MAX 2 9 ] 1 ]", 1),
        ("[MED 1 5 8 ]", 5),
        ("[MED 1 2 ]", 1),  # even count: mean of the middle two (1.5), rounded down
        ("[MED 3 8 9 0 ]", 5),  # sorted 0 3 8 9 -> 5.5 -> 5
        ("[SM 9 8 7 ]", 4),  # 24 mod 10
        ("[SM [MAX 9 1 ] [MED 7 7 ] ]", 6),
        ("7", 7),
    ],
)
def test_listops_value_follows_the_rules(text, value):
    assert data.listops_value(data.parse_listops(text)) == value
    assert data.listops_string(data.parse_listops(text)) == text


@pytest.mark.parametrize("bad", ["[MAX 1 2", "[FOO 1 ]", "[MAX 1 ] 2", "12"])
def test_malformed_listops_is_rejected(bad):
    with pytest.raises(ValueError):
        data.parse_listops(bad)


def _depth(text: str) -> int:
    depth = deepest = 0
    for token in text.split():
        depth += token.startswith("[")
        deepest = max(deepest, depth)
        depth -= token == "]"
    return deepest


def _argument_counts(tree) -> list[int]:
    if isinstance(tree, int):
        return []
    _, children = tree
    return [len(children)] + [n for child in children for n in _argument_counts(child)]


def test_listops_examples_respect_lengths_depth_arguments_and_labels():
    examples = data.listops_examples(60, seed=3, min_length=30, max_length=90, max_depth=5, max_args=4)
    assert len({e["text"] for e in examples}) == 60
    for example in examples:
        tokens = example["text"].split()
        assert 30 < len(tokens) < 90
        assert _depth(example["text"]) <= 4  # operators at depth < max_depth only (the root is depth 1)
        assert set(tokens) <= {"[MAX", "[MIN", "[MED", "[SM", "]", *map(str, range(10))}
        assert example["label"] == data.listops_value(data.parse_listops(example["text"]))
        assert all(2 <= n <= 4 for n in _argument_counts(data.parse_listops(example["text"])))
    assert len({e["label"] for e in examples}) >= 5


def test_listops_lra_defaults_generate():
    examples = data.listops_examples(3, seed=0)  # depth 10, 10 arguments, 500 < length < 2000
    assert all(500 < len(e["text"].split()) < 2000 for e in examples)


def test_listops_is_deterministic_and_rejects_impossible_windows():
    kwargs = dict(min_length=20, max_length=60, max_depth=4, max_args=4)
    assert data.listops_examples(5, seed=1, **kwargs) == data.listops_examples(5, seed=1, **kwargs)
    assert data.listops_examples(5, seed=1, **kwargs) != data.listops_examples(5, seed=2, **kwargs)
    with pytest.raises(ValueError, match="max_depth"):
        data.listops_examples(3, min_length=500, max_length=2000, max_depth=2, max_args=2, max_tries=200)
    with pytest.raises(ValueError):
        data.listops_examples(3, min_length=10, max_length=5)


def test_needle_hides_exactly_one_digit_that_is_the_label():
    examples = data.needle_examples(50, seed=0, min_length=40, max_length=80)
    positions = []
    for example in examples:
        digits = [(i, c) for i, c in enumerate(example["text"]) if c.isdigit()]
        assert len(digits) == 1 and int(digits[0][1]) == example["label"]
        assert 40 <= len(example["text"]) <= 80
        assert set(example["text"]) - set("0123456789") <= set(data.HAYSTACK_ALPHABET)
        positions.append(digits[0][0] / len(example["text"]))
    assert min(positions) < 0.25 and max(positions) > 0.75  # anywhere, not only near the start


def test_needles_target_is_the_sorted_hidden_digits():
    for example in data.needles_examples(50, seed=0, min_length=30, max_length=60, max_needles=4):
        digits = sorted(int(c) for c in example["source"] if c.isdigit())
        assert 1 <= len(digits) <= 4
        assert example["target"] == " ".join(map(str, digits))


def test_generate_task_writes_disjoint_jsonl_splits(tmp_path):
    paths = data.generate_task(
        "listops",
        tmp_path,
        num_train=20,
        num_validation=10,
        num_test=10,
        seed=5,
        min_length=10,
        max_length=40,
        max_depth=4,
        max_args=4,
    )
    splits = {split: data.read_jsonl(path) for split, path in paths.items()}
    assert [len(splits[s]) for s in data.SPLITS] == [20, 10, 10]
    texts = [{e["text"] for e in splits[s]} for s in data.SPLITS]
    assert not (texts[0] & texts[1]) and not (texts[0] & texts[2]) and not (texts[1] & texts[2])
    info = json.loads((tmp_path / "info.json").read_text())
    assert info["task"] == "listops" and info["columns"] == ["text", "label"] and info["max_depth"] == 4


def test_cli_writes_files_and_reports_bad_knobs_in_one_line(tmp_path, capsys):
    out = tmp_path / "needles"
    assert (
        data.main(
            [
                "needles",
                "--output_dir",
                str(out),
                "--num_train",
                "4",
                "--num_validation",
                "2",
                "--num_test",
                "1",
                "--min_length",
                "20",
                "--max_length",
                "30",
            ]
        )
        == 0
    )
    assert "train: " in capsys.readouterr().out
    rows = data.read_jsonl(out / "train.jsonl")
    assert len(rows) == 4 and set(rows[0]) == {"source", "target"}
    bad = subprocess.run(
        [
            sys.executable,
            "-m",
            "longattn.train.data",
            "needle",
            "--output_dir",
            str(tmp_path / "x"),
            "--min_length",
            "50",
            "--max_length",
            "10",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode == 2
    assert bad.stderr.strip().count("\n") == 0 and "min_length" in bad.stderr


def test_empty_splits_are_not_written_and_the_folder_loads_as_a_dataset(tmp_path):
    from datasets import load_dataset

    (tmp_path / "test.jsonl").write_text("stale\n")
    paths = data.generate_task(
        "needle", tmp_path, num_train=6, num_validation=3, num_test=0, seed=1, min_length=10, max_length=20
    )
    assert set(paths) == {"train", "validation"} and not (tmp_path / "test.jsonl").exists()
    loaded = load_dataset(str(tmp_path), cache_dir=str(tmp_path / "cache"))
    assert {split: len(loaded[split]) for split in loaded} == {"train": 6, "validation": 3}
    assert loaded["train"].column_names == ["text", "label"]
