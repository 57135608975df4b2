"""The pattern picture shows exactly the configured pattern (fixed kinds), and the PNG's cells are coloured where the
pattern is True and nowhere else; the command line reads config overrides in the recipes' key=value grammar, and its
default picture of every kind shows a pattern."""

import numpy as np
import pytest
import torch
from attention_checks import tiny_config

import longattn
from longattn.config_overrides import format_config_overrides, parse_config_overrides
from longattn.patterns import materialize_mask, sliding_window_pattern
from longattn.tools import visualize
from longattn.tools.visualize import attention_pattern, draw_pattern, main

# Kinds whose non-causal weights are dense by nature: every query gives every key (or key group) a weight
# (binary_partition: the spans a token sees cover the sequence, each span's weight spread over its tokens).
DENSE_BY_NATURE = {"full", "efficient", "synthesizer", "reduction", "binary_partition"}


def cells_of_png(path, *, heads: int, length: int) -> torch.Tensor:
    """Read a `draw_pattern` PNG back as bool `[heads, length, length]`: True where a cell is the colour map's 1.

    Each head's image is found by its dark-blue pixels (text and frames are grey or black, the background white);
    every cell centre must be exactly the colour of 1 or of 0 (to PNG rounding). The pattern must see its first and
    last key from some query (a diagonal does), so that the coloured pixels span the whole image.
    """
    import matplotlib

    on, off = (np.array(matplotlib.colormaps["Blues"](value)[:3]) for value in (1.0, 0.0))
    rgb = matplotlib.image.imread(path)[..., :3]
    ys, xs = np.nonzero(rgb[..., 2] - rgb[..., 0] > 0.3)  # dark blue: blue well above red
    columns = np.unique(xs)
    splits = np.sort(np.argsort(np.diff(columns))[::-1][: heads - 1])  # the gaps between the heads' images
    cells = torch.zeros(heads, length, length, dtype=torch.bool)
    for head, part in enumerate(np.split(columns, splits + 1)):
        x0, x1 = part[0], part[-1] + 1
        rows = ys[(xs >= x0) & (xs < x1)]
        y0, y1 = rows.min(), rows.max() + 1
        for i in range(length):
            for j in range(length):
                colour = rgb[int(y0 + (i + 0.5) * (y1 - y0) / length), int(x0 + (j + 0.5) * (x1 - x0) / length)]
                is_on, is_off = np.abs(colour - on).max() < 0.01, np.abs(colour - off).max() < 0.01
                assert is_on or is_off, f"head {head} cell ({i}, {j}) has colour {colour}, neither 1 nor 0"
                cells[head, i, j] = bool(is_on)
    return cells


@pytest.fixture
def drawn(monkeypatch):
    """The patterns `main` draws, in order (no PNG is written)."""
    patterns = []
    monkeypatch.setattr(visualize, "draw_pattern", lambda pattern, path, title="": patterns.append(pattern))
    return patterns


def test_picture_of_a_fixed_pattern_is_its_mask(tmp_path):
    model = longattn.LongAttnModel(
        tiny_config("sliding", num_hidden_layers=1, sliding_window=3, sliding_dilation=[1, 3])
    )
    ids = torch.randint(4, 50, (1, 41))
    global_mask = torch.zeros_like(ids)
    global_mask[0, 17] = 1
    drawn = attention_pattern(model, ids, global_attention_mask=global_mask)
    expected = materialize_mask(
        sliding_window_pattern(window=3, dilation=[1, 3], global_mask=global_mask.bool()),
        batch=1,
        heads=2,
        q_len=41,
        kv_len=41,
    )[0]
    assert torch.equal(drawn, expected)
    assert draw_pattern(drawn, tmp_path / "p.png").stat().st_size > 1000
    assert torch.equal(cells_of_png(tmp_path / "p.png", heads=2, length=41), expected)


def test_png_cells_are_coloured_in_the_band_and_nowhere_else(tmp_path):
    # Two heads with different patterns: the PNG keeps each head's cells, in order, and each cell's colour.
    pattern = materialize_mask(
        sliding_window_pattern(window=2, dilation=[1, 3]), batch=1, heads=2, q_len=12, kv_len=12
    )[0]
    path = draw_pattern(pattern, tmp_path / "band.png", title="sliding")
    cells = cells_of_png(path, heads=2, length=12)
    assert torch.equal(cells, pattern)
    distance = (torch.arange(12)[:, None] - torch.arange(12)[None, :]).abs()
    assert cells[0][distance <= 2].all() and not cells[0][distance > 2].any()


def test_command_line_writes_a_png(tmp_path):
    main(
        [
            "--attention_type",
            "sliding",
            "--config_overrides",
            "sliding_window=2",
            "--length",
            "24",
            "--causal",
            "--output",
            str(tmp_path / "causal.png"),
        ]
    )
    assert (tmp_path / "causal.png").exists()
    # The picture settings' dilations [1, 3] under the override window 2, causal.
    expected = materialize_mask(
        sliding_window_pattern(window=2, dilation=[1, 3], causal=True), batch=1, heads=2, q_len=24, kv_len=24
    )[0]
    assert torch.equal(cells_of_png(tmp_path / "causal.png", heads=2, length=24), expected)


def test_config_overrides_take_the_recipes_grammar(drawn):
    main(
        [
            "--attention_type",
            "sliding",
            "--config_overrides",
            "sliding_window=2,sliding_dilation=[1,3]",
            "--length",
            "24",
        ]
    )
    expected = materialize_mask(
        sliding_window_pattern(window=2, dilation=[1, 3]), batch=1, heads=2, q_len=24, kv_len=24
    )[0]
    assert torch.equal(drawn[0], expected)


def test_json_overrides_are_a_usage_error_naming_the_grammar(drawn, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--config_overrides", '{"sliding_window": 2}'])
    assert exit_info.value.code == 2 and drawn == []
    error = capsys.readouterr().err
    assert "--config_overrides" in error and "key=value" in error


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--global_tokens", "0", "64"], "--global_tokens [64] lie outside the 64 positions"),
        (["--length", "0"], "--length must be >= 1"),
        (["--heads", "0"], "--heads must be >= 1"),
    ],
)
def test_bad_sizes_are_a_usage_error_naming_the_flag(drawn, capsys, argv, message):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2 and drawn == []
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("kind", longattn.available_attention_types())
def test_default_picture_shows_the_pattern(drawn, kind):
    # The config defaults (e.g. a window of 256 keys each side) would cover a 64-token picture entirely.
    main(["--attention_type", kind])
    seen = drawn[0]
    if kind in DENSE_BY_NATURE:
        assert seen.all()
    else:
        assert seen.any() and not seen.all(), f"{kind}: {seen.float().mean():.0%} of the cells seen"


def test_overrides_round_trip():
    overrides = {
        "attention_type": ["sliding", "full"],
        "sliding_window": 4,
        "dropout": 0.5,
        "use_cache": False,
        "lsh_seed": None,
        "synthesizer_mode": "dense",
    }
    assert parse_config_overrides(format_config_overrides(overrides)) == overrides
