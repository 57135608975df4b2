"""`longattn-eval` and the stdlib corpus: bits per byte computed by hand on models whose probabilities are known,
passkey retrieval by a model that copies and by one that cannot see the key, the command end to end on a tiny
model, bad input, and a corpus split that depends on nothing but the file's path."""

from __future__ import annotations

import json
import math
import random
from types import SimpleNamespace

import pytest
import torch
from kind_configs import SIZES

import longattn
from longattn.tokenization_longattn import byte_tokenizer
from longattn.tools import evaluate
from longattn.train import corpus

DOCUMENTS = [
    "def add(a, b):\n    return a + b\n" * 6,
    "class Point:\n    x: int\n    y: int\n" * 5,
    "import os\nprint(os.getcwd())\n" * 7,
]


class UnigramModel(torch.nn.Module):
    """Predicts every token from a fixed distribution, whatever the context: its loss is known in closed form."""

    def __init__(self, vocab_size: int, seed: int = 0):
        super().__init__()
        self.weights = torch.randn(vocab_size, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)

    def forward(self, input_ids, attention_mask=None, **kwargs):
        logits = self.weights.expand(*input_ids.shape, -1)
        return SimpleNamespace(logits=logits)


class CopyingModel(torch.nn.Module):
    """Predicts the token that followed the longest earlier match of the current suffix (an induction head), within
    `reach` tokens back; a token seen nowhere gets a uniform prediction. With an unlimited reach it retrieves any
    passkey; with a short one it cannot see the key."""

    def __init__(self, vocab_size: int, reach: int | None = None, max_match: int = 24):
        super().__init__()
        self.vocab_size, self.reach, self.max_match = vocab_size, reach, max_match

    def forward(self, input_ids, attention_mask=None, **kwargs):
        batch, length = input_ids.shape
        logits = torch.zeros(batch, length, self.vocab_size)
        for b in range(batch):
            ids = input_ids[b].tolist()
            for i in range(length):
                first = 0 if self.reach is None else max(0, i - self.reach)
                best, best_next = 0, None
                for j in range(i - 1, first - 1, -1):  # j: an earlier position whose next token is known
                    size = 0
                    while size < self.max_match and j - size >= first and ids[j - size] == ids[i - size]:
                        size += 1
                    if size > best:
                        best, best_next = size, ids[j + 1]
                if best_next is not None:
                    logits[b, i, best_next] = 10.0
        return SimpleNamespace(logits=logits)


def _expected_bits(model: UnigramModel, tokenizer, documents, lengths, *, task, mask_probability=0.15, seed=0):
    """The mean bits of the scored tokens, counted by hand from the definition in the module docstring."""
    ids, special = evaluate.token_stream(tokenizer, documents, task=task)
    total = len(ids) - len(ids) % max(lengths)
    ids, special = ids[:total].tolist(), special[:total].tolist()
    log_probs = torch.log_softmax(model.weights, -1).tolist()
    if task == "mlm":
        draws = torch.rand(total, generator=torch.Generator().manual_seed(seed)).tolist()
        scored = [i for i in range(total) if draws[i] < mask_probability and not special[i]]
    else:
        scored = [i for i in range(total) if not special[i] and all(i % n for n in lengths)]
    return sum(-log_probs[ids[i]] for i in scored) / len(scored) / math.log(2), len(scored)


@pytest.mark.parametrize("task", ["clm", "mlm"])
def test_bits_per_byte_of_a_model_with_known_probabilities(task):
    tokenizer = byte_tokenizer(add_eos_token=task == "mlm")
    model = UnigramModel(len(tokenizer))
    lengths = [16, 32, 64]
    rows = evaluate.loss_by_length(model, tokenizer, DOCUMENTS, lengths, task=task, progress=False)
    expected, count = _expected_bits(model, tokenizer, DOCUMENTS, lengths, task=task)
    for row in rows:
        # a context-free model scores the same tokens at every length, so every length gives the same figure
        assert row["tokens_scored"] == count
        assert row["bits_per_token"] == pytest.approx(expected, rel=1e-6)
        assert row["bytes_per_token"] == 1.0  # bytes: one token each
        assert row["bits_per_byte"] == pytest.approx(expected, rel=1e-6)


def test_uniform_prediction_costs_log2_vocab_bits():
    tokenizer = byte_tokenizer(add_eos_token=False)
    model = UnigramModel(len(tokenizer))
    model.weights.zero_()
    (row,) = evaluate.loss_by_length(model, tokenizer, DOCUMENTS, [32], task="clm", progress=False)
    assert row["bits_per_byte"] == pytest.approx(math.log2(len(tokenizer)))


def test_context_lowers_the_loss_of_a_model_that_copies():
    """Repetitive text: a copying model gains from longer windows, so loss falls with the length."""
    tokenizer = byte_tokenizer(add_eos_token=False)
    rows = evaluate.loss_by_length(
        CopyingModel(len(tokenizer)), tokenizer, DOCUMENTS, [8, 64], task="clm", progress=False
    )
    assert rows[1]["bits_per_byte"] < rows[0]["bits_per_byte"]


def test_masked_lm_masks_are_seeded():
    tokenizer = byte_tokenizer()
    model = UnigramModel(len(tokenizer))
    first = evaluate.loss_by_length(model, tokenizer, DOCUMENTS, [32], task="mlm", seed=1, progress=False)
    again = evaluate.loss_by_length(model, tokenizer, DOCUMENTS, [32], task="mlm", seed=1, progress=False)
    other = evaluate.loss_by_length(model, tokenizer, DOCUMENTS, [32], task="mlm", seed=2, progress=False)
    assert first == again
    assert first[0]["bits_per_token"] != other[0]["bits_per_token"]


def test_passkey_retrieved_by_a_copying_model_and_not_by_one_that_cannot_see_the_key():
    tokenizer = byte_tokenizer(add_eos_token=False)
    kwargs = dict(depths=[0.0, 0.5], trials=3, progress=False)
    sees = evaluate.passkey_accuracy(CopyingModel(len(tokenizer)), tokenizer, [400], **kwargs)
    blind = evaluate.passkey_accuracy(CopyingModel(len(tokenizer), reach=40), tokenizer, [400], **kwargs)
    assert all(row["accuracy"] == 1.0 for row in sees)
    assert all(row["tokens"] == pytest.approx(400, abs=100) for row in sees)
    # the key is 5 digits: without it, a prediction is right by chance only (a tenth of digits, no whole key)
    assert all(row["accuracy"] == 0.0 for row in blind)
    assert all(row["digit_accuracy"] <= 0.4 for row in blind)


def test_passkey_prompt_puts_the_key_at_the_depth():
    tokenizer = byte_tokenizer(add_eos_token=False)
    for depth in (0.0, 0.5, 1.0):
        ids, answer = evaluate.passkey_prompt(tokenizer, 1000, depth, "12345")
        text = tokenizer.decode(ids)
        assert text.endswith("The pass key is 12345")
        where = text.index("The pass key is 12345.") / len(text)
        assert where == pytest.approx(depth, abs=0.12)
        assert tokenizer.decode([ids[i] for i in answer]) == "12345"


def _tiny_clm(folder, *, max_position_embeddings=256):
    sliding = dict(attention_type="sliding", sliding_window=8, is_decoder=True)  # 260 token ids: the byte tokenizer's
    config = longattn.LongAttnConfig(**SIZES, max_position_embeddings=max_position_embeddings, **sliding)
    torch.manual_seed(0)
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    byte_tokenizer(model_max_length=max_position_embeddings, add_eos_token=False).save_pretrained(folder)
    return folder


def test_command_end_to_end(tmp_path, capsys):
    model = _tiny_clm(tmp_path / "tiny-clm")
    data = tmp_path / "test.jsonl"
    data.write_text("".join(json.dumps({"text": text}) + "\n" for text in DOCUMENTS))
    out = tmp_path / "eval"
    status = evaluate.main(
        [str(model), "--corpus", str(data), "--lengths", "16", "64", "--passkey_lengths", "240",
         "--passkey_trials", "1", "--passkey_depths", "0.5", "--global_first_token", "--output_dir", str(out)]
    )  # fmt: skip
    assert status == 0
    printed = capsys.readouterr().out
    assert "tiny-clm" in printed and "bits/byte" in printed and "passkey" in printed
    results = json.loads((out / "results.json").read_text())
    (record,) = results["models"]
    assert [row["length"] for row in record["loss_by_length"]] == [16, 64]
    assert all(0 < row["bits_per_byte"] < 12 for row in record["loss_by_length"])
    assert record["passkey"][0]["length"] == 240
    assert results["python_version"] and results["corpus"] == ["test.jsonl"]
    assert str(tmp_path) not in (out / "results.json").read_text()  # no absolute local path
    assert (out / "loss_by_length.png").stat().st_size > 1000


def test_bad_input_is_refused(tmp_path):
    model = _tiny_clm(tmp_path / "tiny-clm", max_position_embeddings=64)
    empty = tmp_path / "empty.jsonl"
    empty.write_text('{"text": "  "}\n')
    data = tmp_path / "data.jsonl"
    data.write_text(json.dumps({"text": DOCUMENTS[0]}) + "\n")
    with pytest.raises(ValueError, match="holds no text"):
        evaluate.read_corpus([empty])
    with pytest.raises(ValueError, match="exceed the 64 tokens"):
        evaluate.evaluate_folders(evaluate.build_parser().parse_args([str(model), "--corpus", str(data),
                                                                      "--lengths", "128"]))  # fmt: skip
    from transformers import BartConfig, BertConfig, BertModel

    BartConfig(vocab_size=50, d_model=16, encoder_layers=1, decoder_layers=1).save_pretrained(tmp_path / "bart")
    with pytest.raises(ValueError, match="encoder-decoder"):
        evaluate.load_folder(tmp_path / "bart")
    BertModel(BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2)).save_pretrained(
        tmp_path / "bert"
    )
    with pytest.raises(ValueError, match="causal LM .* masked LM .* sequence classifier"):
        evaluate.load_folder(tmp_path / "bert")
    with pytest.raises(ValueError, match="shorter than the prompt"):
        evaluate.passkey_prompt(byte_tokenizer(), 50, 0.5, "12345")
    with pytest.raises(ValueError, match="fewer than the longest length"):
        evaluate.loss_by_length(UnigramModel(260), byte_tokenizer(), ["ab"], [64], task="mlm", progress=False)
    assert evaluate.main([str(tmp_path / "missing"), "--corpus", str(data)]) == 2


# ---------------------------------------------------------------------------------------------- the corpus
def _tree(root, names):
    for name in names:
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"# {name}\n" + "x = 1\n" * 20)


def test_stdlib_split_depends_only_on_each_path(tmp_path):
    names = [f"pkg{i % 7}/module_{i}.py" for i in range(300)]
    skipped = ["test/test_x.py", "idlelib/idle_test/t.py", "site-packages/third.py", "lib2to3/tests/data.py"]
    shuffled = names[:]
    random.Random(0).shuffle(shuffled)
    _tree(tmp_path / "a", names + skipped)
    _tree(tmp_path / "b", skipped + shuffled)  # another creation order: another listing order
    outputs = []
    for tree in ("a", "b"):
        corpus.write_stdlib_corpus(tmp_path / f"out-{tree}", root=tmp_path / tree)
        outputs.append({s: (tmp_path / f"out-{tree}" / f"{s}.jsonl").read_text() for s in corpus.SPLITS})
    assert outputs[0] == outputs[1]
    paths = {s: [json.loads(line)["path"] for line in outputs[0][s].splitlines()] for s in corpus.SPLITS}
    assert sorted(sum(paths.values(), [])) == sorted(names)  # tests and third-party packages left out, nothing lost
    assert 0.8 < len(paths["train"]) / len(names) < 0.97
    # a file keeps its split whatever else is in the tree
    for name in names[:50]:
        split = corpus.split_of(name, validation_percent=5, test_percent=5)
        assert name in paths[split]
    info = json.loads((tmp_path / "out-a" / "info.json").read_text())
    assert info["python_version"] and sum(info["files"].values()) == len(names)


def test_stdlib_split_of_known_paths_is_stable():
    """The split is part of every recorded figure: a change to the rule must show here."""
    assert [corpus.split_of(p, validation_percent=5, test_percent=5) for p in STABLE_PATHS] == STABLE_SPLITS


def test_stdlib_corpus_refuses_bad_settings(tmp_path):
    _tree(tmp_path / "few", ["a.py"])
    with pytest.raises(ValueError, match="empty"):
        corpus.write_stdlib_corpus(tmp_path / "out", root=tmp_path / "few")
    with pytest.raises(ValueError, match="test_percent"):
        corpus.write_stdlib_corpus(tmp_path / "out", test_percent=0)


STABLE_PATHS = ["json/decoder.py", "typing.py", "asyncio/streams.py", "abc.py", "_weakrefset.py", "bz2.py"]
STABLE_SPLITS = ["train", "validation", "validation", "test", "test", "validation"]


class PeriodicCopyModel(torch.nn.Module):
    """A masked LM that predicts, at every position, the tokens one line length (29, 31 or 33 tokens: the lines of
    `DOCUMENTS`) to its left: it reads order, so shuffling its context costs it; the unigram model does not."""

    def __init__(self, vocab_size: int):
        super().__init__()
        self.vocab_size = vocab_size

    def forward(self, input_ids, attention_mask=None, **kwargs):
        logits = torch.zeros(*input_ids.shape, self.vocab_size)
        for period in (29, 31, 33):
            logits[:, period:].scatter_add_(
                -1,
                input_ids[:, :-period, None],
                torch.full((1, 1, 1), 3.0).expand(input_ids.shape[0], input_ids.shape[1] - period, 1).contiguous(),
            )
        return SimpleNamespace(logits=logits)


def test_order_test_costs_a_model_that_reads_order_and_not_a_bag_of_tokens():
    tokenizer = byte_tokenizer()

    def bits(model, shuffle):
        (row,) = evaluate.loss_by_length(
            model, tokenizer, DOCUMENTS, [64], task="mlm", shuffle_context=shuffle, progress=False
        )
        return row["bits_per_byte"]

    bag = UnigramModel(len(tokenizer))
    assert bits(bag, True) == pytest.approx(bits(bag, False))
    reader = PeriodicCopyModel(len(tokenizer))
    assert bits(reader, True) > 1.1 * bits(reader, False)
    with pytest.raises(ValueError, match="shuffle_context"):
        evaluate.loss_by_length(bag, tokenizer, DOCUMENTS, [64], task="clm", shuffle_context=True, progress=False)
