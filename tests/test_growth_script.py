"""scripts/growth.py and scripts/flop_models.py: the FLOP model each kind's measured growth is held against, and the
report's verdicts."""

from __future__ import annotations

import argparse

import pytest
from script_loading import load_script


@pytest.fixture(scope="module")
def growth():
    return load_script("scripts/growth.py", "longattn_growth_script")


@pytest.fixture(scope="module")
def flop_models():
    return load_script("scripts/flop_models.py", "longattn_flop_models_script")


ARGS = argparse.Namespace(hidden=256, heads=4, window=256)


def test_pattern_pairs_are_counted_exactly_from_the_predicates(flop_models):
    from longattn import patterns

    n, w = 700, 5  # rows near both ends see fewer keys
    expected = sum(min(n - 1, i + w) - max(0, i - w) + 1 for i in range(n))
    count = flop_models._pattern_pairs
    assert count(patterns.sliding_window_mask(w), n) == expected  # every query: exact
    assert count(patterns.sliding_window_mask(w), n, samples=99) == pytest.approx(expected, rel=0.01)


def test_flop_model_grows_linearly_for_linear_kinds_and_faster_where_the_pattern_does(growth):
    def model_growth(kind):
        return growth.flop_model(kind, 32768, ARGS)[0] / growth.flop_model(kind, 8192, ARGS)[0]

    for kind in ("sliding", "lsh", "linformer", "efficient", "deformable", "adaptive_span"):
        assert model_growth(kind) == pytest.approx(4.0, rel=0.02), kind
    assert model_growth("fixed") > 8  # c·n/l summary cells per query (diluted by the linear projections)
    assert 4.2 < model_growth("routing") < 8  # the n x n/128 assignment
    assert model_growth("reduction") > 10  # n²/R (diluted by the linear projections)
    assert 4.0 < model_growth("binary_partition") < 5  # n log n
    with pytest.raises(ValueError, match="no FLOP model for kind 'full'"):
        growth.flop_model("full", 1024, ARGS)


def test_report_takes_the_median_of_per_run_growths(growth):
    args = argparse.Namespace(
        lengths=[8192, 32768],
        kinds=["sliding"],
        runs=3,
        repeats=3,
        clock="cpu",
        threads=1,
        allocator="reuse",
        **vars(ARGS),
    )
    times = {"sliding": {8192: [1.0, 1.0, 2.0], 32768: [4.0, 6.0, 8.0]}}  # growths 4, 6, 4 -> median 4
    text = growth.report(args, times, "python scripts/growth.py")
    row = next(line for line in text.splitlines() if line.startswith("| sliding"))
    assert "4.00, 6.00, 4.00" in row and "| 4.00x (4.00-6.00) |" in row and row.endswith("| met |")
    times["sliding"][32768] = [8.0, 8.0, 16.0]  # growth 8 against a model of ~4: 2x, over the 1.3x target
    row = next(line for line in growth.report(args, times, "x").splitlines() if line.startswith("| sliding"))
    assert "missed by" in row
