"""The needle tasks (`longattn-data needle` / `needles`): digits hidden at uniform positions of a random haystack of
letters and spaces, so that a classifier or a seq2seq model must find them anywhere in a long input. Also what
`longattn-eval` scores a needle classifier on."""

from __future__ import annotations

import random
import string
from typing import Any

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


__all__ = ["HAYSTACK_ALPHABET", "needle_examples", "needles_examples"]
