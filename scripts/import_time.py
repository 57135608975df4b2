"""Start-up cost of longattn, step by step in one process: torch, transformers, transformers' model machinery
(`PreTrainedModel`, the Auto classes: what registering model classes needs), the stock modeling modules whose
attention classes get longattn's build hooks, then longattn itself; and `longattn --help` in a fresh process.

    python scripts/import_time.py            # docs/benchmarks.md, "Start-up time"

The steps are cumulative: each line is what that import adds to the ones above it.
"""

from __future__ import annotations

import importlib
import subprocess
import sys
import time

FAMILIES = "bert roberta xlm_roberta electra gpt2 opt llama mistral qwen2 qwen3 phi3 gemma bart".split()


def main() -> None:
    started = last = time.perf_counter()

    def step(name: str, load) -> None:
        nonlocal last
        load()
        now = time.perf_counter()
        print(f"{name:48s} {now - last:6.2f} s   (total {now - started:6.2f} s)")
        last = now

    step("import torch", lambda: importlib.import_module("torch"))
    step("import transformers", lambda: importlib.import_module("transformers"))
    machinery = ("PreTrainedModel", "AutoModel", "AutoModelForCausalLM", "GenerationMixin", "AttentionInterface")
    step(
        "transformers.PreTrainedModel, Auto classes",
        lambda: [getattr(sys.modules["transformers"], n) for n in machinery],
    )
    step(
        "the 13 stock modeling modules (build hooks)",
        lambda: [importlib.import_module(f"transformers.models.{f}.modeling_{f}") for f in FAMILIES],
    )
    step("import longattn (the rest)", lambda: importlib.import_module("longattn"))
    begin = time.perf_counter()
    subprocess.run([sys.executable, "-m", "longattn", "--help"], check=True, capture_output=True)
    print(f"{'python -m longattn --help (fresh process)':48s} {time.perf_counter() - begin:6.2f} s")


if __name__ == "__main__":
    main()
