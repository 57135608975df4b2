"""Every Python code block of README.md and recipes/README.md runs, as written, so that a snippet cannot rot.

The one substitution (the fixture `hub_stand_ins`): a block that names a Hub model (`"roberta-base"`) or a folder the
reader is assumed to have (`"my-longattn-model"`) gets a tiny local folder of the same kind instead (`STAND_INS`),
so nothing is downloaded and each block takes seconds. A block that needs what only its surroundings give (the
context-parallel block runs inside launched processes, on a model and a batch) gets those names from `CONTEXTS`,
and runs in two gloo processes. Everything else a block uses, it defines.
"""

from __future__ import annotations

import datetime
import os
import re
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from child_processes import start_ranks
from kind_configs import SIZES
from transformers import RobertaConfig, RobertaForMaskedLM

import longattn
from longattn.tokenization_longattn import byte_tokenizer

REPO = Path(__file__).resolve().parents[1]
DOCS = ("README.md", "recipes/README.md")
STAND_INS = {
    "roberta-base": "a RoBERTa of 2 layers x 32 reading 2048 tokens, the byte tokenizer",
    "my-longattn-model": "a longattn masked LM of 2 layers x 32, sliding window 4, the byte tokenizer",
}
# Names a block is given because its text assumes them (a marker in the block -> the setup that defines them).
CONTEXTS = {"init_context_parallel": "_context_parallel_setup"}


def python_blocks() -> list[tuple[str, int, str]]:
    """(document, line of the opening fence, code) of every ```python block."""
    blocks = []
    for name in DOCS:
        text = (REPO / name).read_text()
        for match in re.finditer(r"^```python\n(.*?)^```", text, flags=re.MULTILINE | re.DOTALL):
            blocks.append((name, text[: match.start()].count("\n") + 1, match.group(1)))
    return blocks


BLOCKS = python_blocks()


@pytest.fixture
def hub_stand_ins(tmp_path, monkeypatch) -> dict[str, str]:
    """Tiny local folders for the Hub ids and assumed folders the blocks name (`STAND_INS`), in a fresh working
    folder (where the blocks write theirs): name -> folder."""
    folders = {}
    torch.manual_seed(0)
    roberta = RobertaForMaskedLM(
        # 2048 tokens after RoBERTa's padding offset; the byte tokenizer's ids.
        RobertaConfig(
            vocab_size=260, **SIZES, max_position_embeddings=2050, pad_token_id=0, bos_token_id=1, eos_token_id=2
        )
    )
    mlm = longattn.LongAttnForMaskedLM(longattn.LongAttnConfig(**SIZES, sliding_window=4))
    for name, model in (("roberta-base", roberta), ("my-longattn-model", mlm)):
        folders[name] = str(tmp_path / "stand-ins" / name)
        model.save_pretrained(folders[name])
        byte_tokenizer(model_max_length=2048).save_pretrained(folders[name])
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    return folders


def substitute(code: str, folders: dict[str, str]) -> str:
    for name, folder in folders.items():
        code = code.replace(f'"{name}"', repr(folder))
    return code


def _context_parallel_setup() -> dict:
    from longattn.train.context_parallel import init_context_parallel  # noqa: F401  (the block imports it too)

    torch.manual_seed(0)  # the same model and batch on every rank
    model = longattn.LongAttnForCausalLM(longattn.LongAttnConfig(**SIZES, sliding_window=4))
    ids = torch.randint(4, 260, (1, 32))
    batch = {"input_ids": ids, "labels": ids.clone()}
    return {"model": model, "batch": batch, "labelled_tokens_of_the_whole_batch": 31}


def _run_in_ranks(rank: int, world: int, store: str, code: str, setup: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{store}", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60)
    )
    try:
        exec(compile(code, "<README block>", "exec"), {"__name__": "__readme__", **globals()[setup]()})
    finally:
        dist.destroy_process_group()


def test_the_docs_have_python_blocks():
    assert len(BLOCKS) >= 6  # the README's; a regex that stopped matching would make the test below vacuous


@pytest.mark.parametrize("document, line, code", BLOCKS, ids=[f"{d}:{line}" for d, line, _ in BLOCKS])
def test_python_block_runs(document, line, code, hub_stand_ins, tmp_path):
    code = substitute(code, hub_stand_ins)
    setups = [setup for marker, setup in CONTEXTS.items() if marker in code]
    if setups:
        store = str(tmp_path / "store")
        start_ranks(_run_in_ranks, args=(2, store, code, setups[0]), nprocs=2)
        return
    env = {"__name__": "__readme__"}
    exec(compile(code, f"{document}:{line}", "exec"), env)
    assert os.getcwd() == str(tmp_path / "work")  # the blocks wrote their folders in the working folder
