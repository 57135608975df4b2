#!/usr/bin/env python
"""Quality, measured: the lengthening study and every kind trained side by side, on the standard library's source.

Two studies, each a sequence of resumable steps (a step whose folder is finished is skipped; a training step
interrupted anywhere continues from its last checkpoint when the command is run again):

`lengthening` (Longformer's Table 5, Beltagy et al. 2020, at small scale):
  1. pretrain a stock `RobertaForMaskedLM` (built by transformers; bytes; full attention) at 512 tokens;
  2. lengthen it to 4,096 tokens with `longattn.lengthen` (sliding window of 256 per side, first token global), once
     with the copied position table and once with the new rows drawn at random; and once with a window of 512 per
     side, which covers every 512-token window (the check that lengthening itself changes nothing);
  3. continue training the lengthened model at 4,096 tokens, and the 512 model at 512 tokens for the same steps and
     tokens per step (the control);
  4. evaluate every folder with `longattn-eval` (bits per byte of a fixed, seeded 15% mask on the test split, at
     512 and 4,096 tokens).

`lengthening --objective clm` runs the same steps on a causal `RobertaForCausalLM` (`is_decoder`; bits per byte of
every token given its window's preceding context, no global token: a causal window ends at the query, so the first
token adds nothing a window cannot reach) into `lengthening-clm`: at this budget the masked LM stays on the
bag-of-bytes plateau (see the report's order test) while the causal one leaves it within a few hundred steps, so only
the causal study can show what lengthening does to a model that reads positions. It ends with a probe of where
the copied table breaks (`seam-probe.json`: queries whose window lies inside one later copy, in the long run
and read as fresh 512-token windows).

`kinds`: every kind at the same size, data and token budget, from scratch at 2,048 tokens with the same
hyper-parameters (chosen on full attention): causal LM for the kinds with a decoder form, masked LM for the
encoder-only ones (with a full-attention masked-LM control). Training CPU seconds are the training process's CPU time
inside optimizer steps with one thread (`train_cpu_seconds` of the recipes), peak memory its peak resident set.

`report` writes docs/quality.md from the results (`--doc`), with the table, the plots and the commands.

    python scripts/quality_study.py lengthening --output_dir runs/quality
    python scripts/quality_study.py lengthening --objective clm --output_dir runs/quality
    python scripts/quality_study.py kinds --output_dir runs/quality
    python scripts/quality_study.py report --output_dir runs/quality --doc docs/quality.md

Every subprocess runs with one intra-op thread (`OMP_NUM_THREADS=1`), so CPU seconds compare across kinds and
machines load does not change them much; two studies can run at once on two cores.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from quality_settings import (  # the sibling script
    CONTINUE,
    EVAL_DURING_TRAINING_BYTES,
    EVAL_TOKENS,
    KINDS,
    KINDS_EVAL_LENGTHS,
    KINDS_EVAL_TOKENS,
    KINDS_LENGTH,
    KINDS_MODEL,
    KINDS_TRAIN,
    LONG,
    PRETRAIN,
    ROBERTA,
    SHORT,
    WINDOW,
)

REPO = Path(__file__).resolve().parent.parent
RECIPES = REPO / "recipes"


def _env() -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    env.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    return env


def _run(command: list[str], log: Path, *, stop_on_failure: bool = True) -> bool:
    """Run one step, its output appended to `log`; a failure stops the study with the log's tail (or, without
    `stop_on_failure`, is reported and the study goes on)."""
    log.parent.mkdir(parents=True, exist_ok=True)
    print("+", " ".join(command), flush=True)
    with log.open("a") as f:
        result = subprocess.run(command, stdout=f, stderr=subprocess.STDOUT, env=_env(), cwd=REPO)
    if result.returncode:
        tail = "\n".join(log.read_text().splitlines()[-20:])
        if stop_on_failure:
            sys.exit(f"step failed ({result.returncode}); the end of {log}:\n{tail}")
        print(f"step failed ({result.returncode}); the end of {log}:\n{tail}", flush=True)
    return result.returncode == 0


def _finished(folder: Path) -> bool:
    return (folder / "all_results.json").is_file()


def _corpus(data: Path) -> Path:
    if not (data / "info.json").is_file():
        _run([sys.executable, "-m", "longattn.train.data", "stdlib", "--output_dir", str(data)], data / "data.log")
    head = data / "validation_head.jsonl"
    if not head.is_file():  # the evaluations during training: the first validation files, about 160 KB
        rows, size = [], 0
        for line in (data / "validation.jsonl").read_text().splitlines():
            rows.append(line)
            size += len(json.loads(line)["text"].encode("utf-8"))
            if size >= EVAL_DURING_TRAINING_BYTES:
                break
        head.write_text("\n".join(rows) + "\n")
    return data


def _train(
    recipe: str,
    output: Path,
    data: Path,
    *,
    steps: int,
    batch: int,
    lr: float,
    warmup: int,
    length: int,
    eval_every: int,
    source: list[str],
    extra: list[str] = (),
    stop_on_failure: bool = True,
) -> None:
    if _finished(output):
        print(f"{output}: done", flush=True)
        return
    command = [
        sys.executable, str(RECIPES / f"run_{recipe}.py"), *source,
        "--train_file", str(data / "train.jsonl"), "--validation_file", str(data / "validation_head.jsonl"),
        "--max_seq_length", str(length), "--per_device_train_batch_size", str(batch),
        "--per_device_eval_batch_size", str(batch), "--learning_rate", str(lr), "--num_warmup_steps", str(warmup),
        "--max_train_steps", str(steps), "--eval_steps", str(eval_every), "--checkpointing_steps", str(eval_every),
        "--checkpoints_total_limit", "1", "--resume_from_checkpoint", "latest", "--logging_steps", "10",
        "--seed", "0", "--output_dir", str(output), *extra,
    ]  # fmt: skip
    _run(command, output.parent / f"{output.name}.log", stop_on_failure=stop_on_failure)


def _evaluate(folders: list[Path], output: Path, data: Path, *, lengths: list[int], extra: list[str] = (),
              max_tokens: int | None = None) -> None:  # fmt: skip
    if (output / "results.json").is_file():
        print(f"{output}: done", flush=True)
        return
    command = [
        sys.executable, "-m", "longattn.tools.evaluate", *map(str, folders), "--corpus", str(data / "test.jsonl"),
        "--lengths", *map(str, lengths), "--max_tokens", str(max_tokens or EVAL_TOKENS), "--output_dir", str(output),
        *extra,
    ]  # fmt: skip
    _run(command, output.parent / f"{output.name}.log")


def _sinusoidal_positions(table, config) -> None:
    """Start the learned position table from sinusoids (Vaswani et al. 2017) at RoBERTa's initial scale.

    Sinusoids make the logit between two positions a function of their distance from the first step, which random
    rows do not; the table is still learned, and RoBERTa's architecture is unchanged. Measured on this study: it did
    not change the pretraining curve (the same losses as random rows over the first 700 steps, and the model still
    reads its window as a bag of bytes: docs/quality.md's order test), so it is a neutral choice kept for the record
    of the published run, not a fix for that plateau.
    """
    import torch

    rows, width = table.shape[0] - config.pad_token_id - 1, table.shape[1]
    position = torch.arange(rows, dtype=torch.float32)[:, None]
    frequency = torch.exp(torch.arange(0, width, 2, dtype=torch.float32) * (-torch.log(torch.tensor(1e4)) / width))
    values = torch.zeros(rows, width)
    values[:, 0::2], values[:, 1::2] = torch.sin(position * frequency), torch.cos(position * frequency)
    with torch.no_grad():  # each component of std initializer_range, as RoBERTa draws the rows; padding row stays 0
        table[config.pad_token_id + 1 :] = values * config.initializer_range * 2**0.5


# objective -> (its stock RoBERTa head, the recipe that trains it, the study's folder)
OBJECTIVES = {
    "mlm": ("RobertaForMaskedLM", "mlm", "lengthening"),
    "clm": ("RobertaForCausalLM", "clm", "lengthening-clm"),
}


def lengthening(root: Path, data: Path, objective: str = "mlm") -> None:
    import torch
    import transformers
    from transformers import RobertaConfig

    import longattn
    from longattn.tokenization_longattn import byte_tokenizer

    head, recipe, folder_name = OBJECTIVES[objective]
    masked = objective == "mlm"
    # Longformer's first token is global; a causal window ends at its query, so there the flag would add nothing
    global_first = ["--global_first_token"] if masked else []
    study = root / folder_name
    init = study / "roberta-512-init"
    if not (init / "config.json").is_file():
        tokenizer = byte_tokenizer(model_max_length=SHORT, add_eos_token=masked)
        config = RobertaConfig(
            vocab_size=len(tokenizer),
            max_position_embeddings=SHORT + tokenizer.pad_token_id + 1,  # RoBERTa counts positions after padding_idx
            pad_token_id=tokenizer.pad_token_id,
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            is_decoder=not masked,
            **ROBERTA,
        )
        torch.manual_seed(0)
        model = getattr(transformers, head)(config)
        _sinusoidal_positions(model.roberta.embeddings.position_embeddings.weight, config)
        # longattn's `full` kind: dense attention as sdpa computes it, and the folder trains with the recipes
        longattn.apply_longattn(model, attention_type="full")
        model.save_pretrained(init)
        tokenizer.save_pretrained(init)
    base = study / "roberta-512"
    p = PRETRAIN
    _train(recipe, base, data, steps=p["steps"], batch=p["batch"], lr=p["learning_rate"], warmup=p["warmup"],
           length=SHORT, eval_every=400, source=["--model_name_or_path", str(init)])  # fmt: skip

    lengthened = {
        "roberta-4096-copied": {"sliding_window": WINDOW, "copy": True},
        "roberta-4096-random": {"sliding_window": WINDOW, "copy": False},
        "roberta-4096-w512": {"sliding_window": SHORT, "copy": True},
    }
    for name, spec in lengthened.items():
        folder = study / name
        if (folder / "config.json").is_file():
            continue
        model = longattn.lengthen(str(base), max_length=LONG, attention_type="sliding",
                                  sliding_window=spec["sliding_window"])  # fmt: skip
        if not spec["copy"]:  # the new rows drawn as RoBERTa draws embeddings, the pretrained rows kept
            positions = model.roberta.embeddings.position_embeddings.weight
            generator = torch.Generator().manual_seed(0)
            with torch.no_grad():
                new = torch.randn(positions[SHORT + 1 :].shape, generator=generator) * model.config.initializer_range
                positions[SHORT + 1 :] = new
        tokenizer = byte_tokenizer(model_max_length=LONG, add_eos_token=masked)
        longattn.save_lengthened(model, folder, tokenizer=tokenizer)

    c = CONTINUE
    tokens = p["batch"] * SHORT
    _train(recipe, study / "roberta-4096-continued", data, steps=c["steps"], batch=tokens // LONG,
           lr=c["learning_rate"], warmup=c["warmup"], length=LONG, eval_every=100,
           source=["--model_name_or_path", str(study / "roberta-4096-copied")], extra=global_first)  # fmt: skip
    _train(recipe, study / "roberta-512-continued", data, steps=c["steps"], batch=p["batch"],
           lr=c["learning_rate"], warmup=c["warmup"], length=SHORT, eval_every=100,
           source=["--model_name_or_path", str(base)])  # fmt: skip

    _evaluate([base, study / "roberta-512-continued"], study / "eval-512", data, lengths=[SHORT])
    if masked:  # the order test: does the pretrained model read positions, or its window as a bag of bytes?
        _evaluate([base], study / "eval-512-shuffled", data, lengths=[SHORT], extra=["--shuffle_context"])
    _evaluate(
        [study / name for name in ("roberta-4096-w512", "roberta-4096-copied", "roberta-4096-random",
                                   "roberta-4096-continued")],
        study / "eval-4096", data, lengths=[SHORT, LONG], extra=global_first,
    )  # fmt: skip
    if not masked:
        _seam_probe(study, data)


def _seam_probe(study: Path, data: Path) -> None:
    """Where the causal copy breaks: the lengthened models' bits per byte at 4,096 tokens on the queries whose whole
    window lies inside one later copy of the table (position p >= 512 with p mod 512 >= 256: every key's row is at or
    before the query's, as in pretraining), against the same queries read as fresh 512-token windows.

    If the window itself were at fault the two would differ little (the window-256 row at 512 tokens already prices
    the window); a large gap is what the layers below carried across the seam: each layer reaches `window` tokens
    further back, so after the first copy every query's receptive field crosses a seam. Writes `seam-probe.json`.
    """
    import math

    import torch

    from longattn.tools.evaluate import load_folder, read_corpus, token_stream

    output = study / "seam-probe.json"
    if output.is_file():
        print(f"{output}: done", flush=True)
        return
    names = ("roberta-4096-copied", "roberta-4096-continued")
    models = {name: load_folder(study / name) for name in names}
    # Both folders carry the same byte-level tokenizer: one stream, one set of windows.
    ids, special = token_stream(models[names[0]].tokenizer, read_corpus([data / "test.jsonl"]), task="clm")
    windows = ids[: EVAL_TOKENS - EVAL_TOKENS % LONG].view(-1, LONG)
    scored = ~special[: windows.numel()].view_as(windows)[:, 1:]  # targets; a special target is never scored
    row = torch.arange(LONG - 1) % SHORT  # the query's row in its copy; the target is the next token
    inside = (torch.arange(LONG - 1) >= SHORT) & (row >= WINDOW) & (row < SHORT - 1)
    results = {}
    for name, loaded in models.items():
        sums = {"long": 0.0, "fresh": 0.0}
        with torch.no_grad():
            for window, keep in zip(windows, scored, strict=True):
                fresh_input = window.view(-1, SHORT)  # the same tokens, each 512 a window of its own
                for key, logits in (("long", loaded.model(input_ids=window[None]).logits[0, :-1]),
                                    ("fresh", loaded.model(input_ids=fresh_input).logits[:, :-1])):  # fmt: skip
                    targets = window[1:] if key == "long" else fresh_input[:, 1:]
                    nll = -torch.log_softmax(logits.float(), -1).gather(-1, targets[..., None])[..., 0]
                    if key == "fresh":  # [copies, 511] -> the long run's query positions (a copy's last query
                        nll = torch.cat([nll, nll.new_zeros(nll.shape[0], 1)], 1).flatten()[:-1]  # has no target)
                    sums[key] += nll[inside & keep].sum().item()
        count = int((inside[None] & scored).sum())
        results[name] = {key: value / count / math.log(2) for key, value in sums.items()} | {"queries": count}
    config = loaded.model.config
    results["reach_tokens"] = config.num_hidden_layers * WINDOW  # how far back the last layer's inputs reach
    output.write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps(results, indent=2), flush=True)


def kinds(root: Path, data: Path, only: list[str] | None, skip: list[str] | None = None) -> None:
    study = root / "kinds"
    t = KINDS_TRAIN
    for name, recipe, kind, settings in KINDS:
        if (only and name not in only) or (skip and name in skip):
            continue
        overrides = ",".join(filter(None, [f"attention_type={kind}", KINDS_MODEL, settings,
                                           f"max_position_embeddings={KINDS_LENGTH}"]))  # fmt: skip
        _train(recipe, study / name, data, steps=t["steps"], batch=t["batch"], lr=t["learning_rate"],
               warmup=t["warmup"], length=KINDS_LENGTH, eval_every=t["eval_every"],
               source=["--config_overrides", overrides], stop_on_failure=False)  # fmt: skip
    # Loss by context length on the test split, every finished run of an objective in one call (one plot each).
    for recipe in ("clm", "mlm"):
        folders = [study / name for name, r, _, _ in KINDS if r == recipe and _finished(study / name)]
        if folders and not only:
            _evaluate(folders, study / f"eval-{recipe}", data, lengths=KINDS_EVAL_LENGTHS, max_tokens=KINDS_EVAL_TOKENS)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                     allow_abbrev=False)  # fmt: skip
    parser.add_argument("study", choices=["lengthening", "kinds", "report"])
    parser.add_argument("--output_dir", default="runs/quality", help="where the runs go")
    parser.add_argument("--data_dir", default="data/stdlib", help="the stdlib corpus (written when absent)")
    parser.add_argument("--objective", choices=sorted(OBJECTIVES), default="mlm",
                        help="lengthening: the objective (clm: a causal RoBERTa, into lengthening-clm)")  # fmt: skip
    parser.add_argument("--only", nargs="*", help="kinds: only these runs (names as in the table)")
    parser.add_argument("--skip", nargs="*", help="kinds: leave these runs out (their rows say where they stopped)")
    parser.add_argument("--doc", default="docs/quality.md", help="report: the page to write")
    args = parser.parse_args(argv)
    root, data = Path(args.output_dir), _corpus(Path(args.data_dir))
    if args.study == "lengthening":
        lengthening(root, data, args.objective)
    elif args.study == "kinds":
        kinds(root, data, args.only, args.skip)
    else:
        from quality_report import write_report  # scripts/quality_report.py

        write_report(root, Path(args.doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
