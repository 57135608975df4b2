"""The byte-level tokenizer: id layout, round trips, special tokens, saving and loading without custom code."""

from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from longattn import LongAttnConfig
from longattn.tokenization_longattn import BYTE_OFFSET, VOCAB_SIZE, byte_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return byte_tokenizer(model_max_length=64)


def test_ids_match_the_config_defaults(tokenizer):
    config = LongAttnConfig()
    assert len(tokenizer) == VOCAB_SIZE == config.vocab_size == 260
    assert (tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id) == (
        config.pad_token_id,
        config.bos_token_id,
        config.eos_token_id,
    )
    assert tokenizer.mask_token_id == 3
    assert BYTE_OFFSET == 4


@pytest.mark.parametrize("text", ["hello", "a b  c\n\td", "héllo wörld ✓ 日本", "[MAX 4 3 [MIN 2 3 ] 1 0 ]", ""])
def test_every_byte_is_one_token(tokenizer, text):
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert ids == [BYTE_OFFSET + b for b in text.encode("utf-8")]
    assert tokenizer.decode(ids) == text


def test_all_256_bytes_round_trip(tokenizer):
    text = bytes(range(256)).decode("latin-1")  # 256 characters, 384 UTF-8 bytes
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert ids == [BYTE_OFFSET + b for b in text.encode("utf-8")]
    assert tokenizer.decode(ids) == text
    assert set(range(BYTE_OFFSET, VOCAB_SIZE)) == set(
        tokenizer.convert_tokens_to_ids(tokenizer.convert_ids_to_tokens(list(range(BYTE_OFFSET, VOCAB_SIZE))))
    )


def test_special_tokens_frame_single_and_pair(tokenizer):
    assert tokenizer("ab")["input_ids"] == [1, 4 + 97, 4 + 98, 2]
    pair = tokenizer("a", "b")
    assert pair["input_ids"] == [1, 4 + 97, 2, 4 + 98, 2]
    assert tokenizer.decode(pair["input_ids"], skip_special_tokens=True) == "ab"
    assert tokenizer("a <mask> b", add_special_tokens=False)["input_ids"][2] == tokenizer.mask_token_id


def test_padding_and_truncation(tokenizer):
    batch = tokenizer(["abc", "a"], padding=True, return_tensors="pt")
    assert batch["input_ids"].tolist() == [[1, 101, 102, 103, 2], [1, 101, 2, 0, 0]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]]
    long = tokenizer("x" * 100, truncation=True)["input_ids"]
    assert len(long) == 64 and long[0] == 1 and long[-1] == 2


def test_saved_tokenizer_loads_without_custom_code(tokenizer, tmp_path):
    tokenizer.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert "auto_map" not in saved  # nothing to execute: a plain tokenizer.json
    for loaded in (AutoTokenizer.from_pretrained(tmp_path), PreTrainedTokenizerFast.from_pretrained(tmp_path)):
        text = "long documents, bytes ✓"
        assert loaded(text)["input_ids"] == tokenizer(text)["input_ids"]
        assert loaded.mask_token_id == 3 and loaded.pad_token_id == 0
        assert loaded.model_max_length == 64
