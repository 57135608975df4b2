"""torch.compile and torch.export of longattn models: no graph break for the kinds whose pattern does not depend on the
content, and the same outputs as eager.

Dynamo runs with `backend="eager"` (it traces, nothing is compiled by inductor) and `fullgraph=True`, so the first graph
break raises with its reason. Content-dependent kinds (LSH, routing, Sinkhorn: sizes read from a sort or a clustering)
are not covered.
"""

from __future__ import annotations

import logging

import pytest
import torch
from kind_configs import tiny_config

import longattn
from longattn import LongAttnConfig, LongAttnForMaskedLM, LongAttnModel

CONTENT_DEPENDENT = {"lsh", "routing", "sinkhorn"}
STATIC_KINDS = [kind for kind in longattn.available_attention_types() if kind not in CONTENT_DEPENDENT]
# One layer (tracing time grows with the layers); small windows and blocks so the patterns are sparse at length 24.
ONE_LAYER_OVERRIDES: dict[str, dict] = {
    "adaptive_span": {"adaptive_span_max": 8, "adaptive_span_ramp": 4},
    "fixed": {"fixed_block_size": 5, "fixed_num_summary": 2, "fixed_summary_per_head": True},
    "linformer": {"linformer_proj_len": 8},
    "reduction": {"reduction_ratio": 3},
    "sliding": {"sliding_window": 3, "sliding_dilation": [1, 2]},
    "strided": {"strided_stride": 4},
    "synthesizer": {"synthesizer_mode": "factorized_dense", "synthesizer_factor_k": 5, "synthesizer_mix": True},
}


def _tiny(kind: str, **overrides) -> LongAttnConfig:
    return tiny_config(
        kind, **{"vocab_size": 64, "num_hidden_layers": 1, **ONE_LAYER_OVERRIDES.get(kind, {}), **overrides}
    )


def _inputs(batch: int = 2, length: int = 24) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(4, 60, (batch, length), generator=generator)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, :3] = 0  # left padding: the fixed pattern rolls its rows
    global_attention_mask = torch.zeros_like(input_ids)
    global_attention_mask[:, 5] = 1
    global_attention_mask[0, 11] = 1  # rows with different numbers of global tokens
    return {"input_ids": input_ids, "attention_mask": attention_mask, "global_attention_mask": global_attention_mask}


@pytest.mark.parametrize("kind", STATIC_KINDS)
def test_compile_forward_has_no_graph_break_and_matches_eager(kind):
    torch.manual_seed(0)
    model = LongAttnModel(_tiny(kind)).eval()
    inputs = _inputs()
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="eager", fullgraph=True)  # raises at the first graph break
    with torch.no_grad():
        torch.testing.assert_close(compiled(**inputs).last_hidden_state, model(**inputs).last_hidden_state)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["sliding", "fixed"])
def test_compile_training_step_has_no_graph_break_and_matches_eager(kind):
    """Forward and backward: dynamo also traces the blocked executor's hand-written backward."""
    torch.manual_seed(0)
    model = LongAttnForMaskedLM(_tiny(kind)).train()
    inputs = _inputs()
    labels = inputs["input_ids"].masked_fill(inputs["attention_mask"] == 0, -100)
    torch._dynamo.reset()
    loss = torch.compile(model, backend="eager", fullgraph=True)(**inputs, labels=labels).loss
    loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    expected = model(**inputs, labels=labels).loss
    expected.backward()
    torch.testing.assert_close(loss, expected)
    assert grads.keys() == {name for name, p in model.named_parameters() if p.grad is not None}
    for name, p in model.named_parameters():
        if p.grad is not None:
            torch.testing.assert_close(grads[name], p.grad, msg=name)


def test_backend_choice_is_logged_eagerly_not_from_a_compiled_graph(caplog):
    from longattn import backends

    model = LongAttnModel(_tiny("full")).eval()
    inputs = _inputs()
    backends._LOGGED.clear()
    torch._dynamo.reset()
    with caplog.at_level(logging.INFO, logger="longattn.backends"):
        torch.compile(model, backend="eager", fullgraph=True)(inputs["input_ids"])
    assert not caplog.records  # a log call inside the graph would be a graph break
    with caplog.at_level(logging.INFO, logger="longattn.backends"):
        model(inputs["input_ids"])
    assert any("attention back end 'torch'" in record.getMessage() for record in caplog.records)


@pytest.mark.slow
def test_export_sliding_with_global_tokens_matches_eager():
    torch.manual_seed(0)
    model = LongAttnModel(_tiny("sliding")).eval()
    inputs = _inputs(length=16)
    input_ids = inputs.pop("input_ids")
    exported = torch.export.export(model, args=(input_ids,), kwargs=inputs)
    torch.testing.assert_close(
        exported.module()(input_ids, **inputs)["last_hidden_state"], model(input_ids, **inputs).last_hidden_state
    )
    # Other global tokens with the same shapes: the exported program did not bake in the count of this batch.
    inputs["global_attention_mask"] = torch.zeros_like(input_ids)
    inputs["global_attention_mask"][:, [0, 2, 9]] = 1
    torch.testing.assert_close(
        exported.module()(input_ids, **inputs)["last_hidden_state"], model(input_ids, **inputs).last_hidden_state
    )


def test_log_lines_go_above_the_progress_bar_not_into_it():
    """The recipes' handler: the back-end line logged on the first forward pass must not land inside the bar."""
    import io

    from tqdm import tqdm

    from longattn.train.training import TqdmLoggingHandler

    stream = io.StringIO()
    handler = TqdmLoggingHandler(stream)
    handler.setFormatter(logging.Formatter("%(message)s"))
    logger = logging.getLogger("longattn.test_progress")
    logger.addHandler(handler)
    logger.propagate = False
    try:
        with tqdm(total=2, desc="train", file=stream) as progress:
            progress.update(1)
            logger.warning("attention back end 'torch'")
            progress.update(1)
    finally:
        logger.removeHandler(handler)
    segments = [segment for line in stream.getvalue().split("\n") for segment in line.split("\r")]
    assert "attention back end 'torch'" in segments, stream.getvalue()


def test_benchmark_compile_option_times_eager_and_compiled_side_by_side(monkeypatch, tmp_path):
    from script_loading import load_script

    benchmark = load_script("scripts/benchmark.py", "longattn_benchmark_compile")
    calls = []

    def fake_run_one(args, impl, length, mode, compiled=False):  # no worker process: the report is under test
        calls.append((impl, compiled))
        return {
            "impl": impl,
            "length": length,
            "mode": mode,
            "time_s": 0.1 if compiled else 0.3,
            "other_load": 0.0,
            "peak_rss_mb": 10.0,
            "tensor_peak_mb": None,
        }

    monkeypatch.setattr(benchmark, "run_one", fake_run_one)
    out = tmp_path / "report.md"
    benchmark.main(
        [
            "--impls",
            "full",
            "sliding",
            "--lengths",
            "64",
            "--mode",
            "fwd",
            "--baseline",
            "full",
            "--compile",
            "--out",
            str(out),
        ]
    )
    assert calls == [("full", False), ("full", True), ("sliding", False), ("sliding", True)]
    report = out.read_text()
    assert "## torch.compile" in report
    assert "| sliding | 64 | fwd | 0.300 | 0.100 | 3.00x |" in report
