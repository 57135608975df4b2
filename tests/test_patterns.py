"""`longattn.patterns` directly: every predicate equals its brute-force definition (a Python loop over (b, h, i, j)
on small n), compositions with `and_masks` / `or_masks`, `materialize_mask`'s offsets and checks, declared reaches,
and the validators' errors."""

from __future__ import annotations

import pytest
import torch

from longattn import patterns

B, H = 2, 4
# Read once here: the predicate's name may change (it clashes with the `key_padding_mask=` argument), the tests not.
padding_predicate = patterns.key_padding_predicate
# Row 0 left-padded, row 1 right-padded: a predicate that reads the wrong batch row or position shows.
PADDING = torch.tensor(
    [
        [False, False, True, True, True, True, True, True, True, True, True],
        [True, True, True, True, True, True, True, True, False, False, False],
    ]
)
GLOBAL = torch.zeros(B, 11, dtype=torch.bool)
GLOBAL[0, 4] = GLOBAL[1, 0] = GLOBAL[1, 9] = True


def brute_force(visible, *, n_q, n_k=None, batch=B, heads=H, q_offset=None):
    """Bool `[batch, heads, n_q, n_k]` from `visible(b, h, i, j) -> bool` on plain ints (queries are the last n_q
    positions unless `q_offset` says otherwise)."""
    n_k = n_q if n_k is None else n_k
    q_offset = n_k - n_q if q_offset is None else q_offset
    return torch.tensor(
        [
            [[[bool(visible(b, h, q_offset + i, j)) for j in range(n_k)] for i in range(n_q)] for h in range(heads)]
            for b in range(batch)
        ],
        dtype=torch.bool,
    ).view(batch, heads, n_q, n_k)


def materialize(mask_fn, *, n_q, n_k=None, q_offset=None):
    n_k = n_q if n_k is None else n_k
    return patterns.materialize_mask(
        mask_fn, batch=B, heads=H, q_len=n_q, kv_len=n_k, q_offset=n_k - n_q if q_offset is None else q_offset
    )


def assert_pattern(mask_fn, visible, *, n_q=11, n_k=None):
    actual = materialize(mask_fn, n_q=n_q, n_k=n_k)
    expected = brute_force(visible, n_q=n_q, n_k=n_k)
    assert torch.equal(actual, expected), f"{mask_fn.__name__}: differs at {(actual != expected).nonzero().tolist()}"
    # And the declared band holds: no visible pair lies farther than `mask_reach`.
    reach = patterns.mask_reach(mask_fn)
    if reach is not None:
        q_pos = torch.arange(actual.shape[3] - actual.shape[2], actual.shape[3]).view(-1, 1)
        assert not (actual & ((q_pos - torch.arange(actual.shape[3])).abs() > reach)).any()


# ---------------------------------------------------------------------------------------------- single predicates
@pytest.mark.parametrize(("n_q", "n_k"), [(11, 11), (3, 11), (1, 11)], ids=["square", "decode-3", "decode-1"])
def test_causal(n_q, n_k):
    assert_pattern(patterns.causal_mask(), lambda b, h, i, j: j <= i, n_q=n_q, n_k=n_k)


@pytest.mark.parametrize("window", [1, 2, 5, 20])
@pytest.mark.parametrize(("n_q", "n_k"), [(11, 11), (4, 11)], ids=["square", "decode-4"])
def test_sliding_window(window, n_q, n_k):
    mask_fn = patterns.sliding_window_mask(window)
    assert_pattern(mask_fn, lambda b, h, i, j: abs(i - j) <= window, n_q=n_q, n_k=n_k)
    assert patterns.mask_reach(mask_fn) == window


@pytest.mark.parametrize(("window", "dilation"), [(1, 2), (2, 3), (3, 2), (2, 7)])
def test_dilated_sliding_window(window, dilation):
    mask_fn = patterns.sliding_window_mask(window, dilation)
    assert_pattern(mask_fn, lambda b, h, i, j: abs(i - j) <= window * dilation and abs(i - j) % dilation == 0)
    assert patterns.mask_reach(mask_fn) == window * dilation


@pytest.mark.parametrize("dilation", [[1, 2, 3, 2], [3, 3, 1, 1], [2, 2, 2, 2]])
def test_per_head_dilation(dilation):
    mask_fn = patterns.sliding_window_mask(2, dilation)
    assert_pattern(mask_fn, lambda b, h, i, j: abs(i - j) <= 2 * dilation[h] and abs(i - j) % dilation[h] == 0)
    assert patterns.mask_reach(mask_fn) == 2 * max(dilation)


def test_key_padding():
    assert_pattern(padding_predicate(PADDING), lambda b, h, i, j: bool(PADDING[b, j]))


def test_global_tokens_are_symmetric():
    assert_pattern(patterns.global_token_mask(GLOBAL), lambda b, h, i, j: bool(GLOBAL[b, i] or GLOBAL[b, j]))


@pytest.mark.parametrize("stride", [1, 2, 3, 4, 12])
def test_strided(stride):
    assert_pattern(patterns.strided_mask(stride), lambda b, h, i, j: abs(i - j) <= stride or (i - j) % stride == 0)


@pytest.mark.parametrize("stride", [1, 2, 3, 4, 12])
def test_strided_causal(stride):
    assert_pattern(
        patterns.strided_mask(stride, causal=True),
        lambda b, h, i, j: j <= i and (i - j <= stride or (i - j) % stride == 0),
    )


@pytest.mark.parametrize(("block_size", "num_summary"), [(1, 1), (3, 1), (4, 2), (5, 5), (12, 3)])
def test_fixed(block_size, num_summary):
    assert_pattern(
        patterns.fixed_mask(block_size, num_summary),
        lambda b, h, i, j: i // block_size == j // block_size or j % block_size >= block_size - num_summary,
    )


@pytest.mark.parametrize(("block_size", "num_summary"), [(4, 1), (4, 2), (6, 2), (5, 2), (3, 3)])
def test_fixed_summary_per_head(block_size, num_summary):
    """Head h summarises with sub-block g = h mod floor(l / c): cells [l − (g + 1)·c, l − g·c) of every block."""

    def visible(b, h, i, j):
        g = h % (block_size // num_summary)
        return (
            i // block_size == j // block_size
            or block_size - (g + 1) * num_summary <= j % block_size < block_size - g * num_summary
        )

    assert_pattern(patterns.fixed_mask(block_size, num_summary, summary_per_head=True), visible)


def test_from_first_real_token_counts_positions_from_each_rows_first_real_token():
    first = [2, 0]  # PADDING's first real token per row
    block_size, num_summary = 4, 1

    def visible(b, h, i, j):
        i, j = (i - first[b]) % 11, (j - first[b]) % 11
        return i // block_size == j // block_size or j % block_size >= block_size - num_summary

    assert_pattern(patterns.from_first_real_token(patterns.fixed_mask(block_size, num_summary), PADDING), visible)


# ---------------------------------------------------------------------------------------------- composition
def test_and_or_masks_are_intersection_and_union():
    window, stride = patterns.sliding_window_mask(1), patterns.strided_mask(3)
    near, strided = (lambda b, h, i, j: abs(i - j) <= 1), (lambda b, h, i, j: abs(i - j) <= 3 or (i - j) % 3 == 0)
    pad = lambda b, h, i, j: bool(PADDING[b, j])  # noqa: E731
    assert_pattern(
        patterns.and_masks(window, padding_predicate(PADDING)), lambda b, h, i, j: near(b, h, i, j) and pad(b, h, i, j)
    )
    assert_pattern(
        patterns.or_masks(window, patterns.global_token_mask(GLOBAL)),
        lambda b, h, i, j: near(b, h, i, j) or bool(GLOBAL[b, i] or GLOBAL[b, j]),
    )
    assert_pattern(
        patterns.and_masks(patterns.or_masks(window, stride), patterns.causal_mask()),
        lambda b, h, i, j: (near(b, h, i, j) or strided(b, h, i, j)) and j <= i,
    )


def test_empty_and_sees_everything_and_empty_or_nothing():
    assert materialize(patterns.and_masks(), n_q=5).all()
    assert not materialize(patterns.or_masks(), n_q=5).any()


def test_reach_of_compositions():
    narrow, wide = patterns.sliding_window_mask(1), patterns.sliding_window_mask(2, 3)
    unbounded = patterns.global_token_mask(GLOBAL)
    assert patterns.mask_reach(patterns.and_masks(narrow, wide, unbounded)) == 1  # the narrowest band
    assert patterns.mask_reach(patterns.or_masks(narrow, wide)) == 6  # the widest
    assert patterns.mask_reach(patterns.or_masks(narrow, unbounded)) is None  # one unbounded part: unbounded
    assert patterns.mask_reach(patterns.and_masks(unbounded)) is None
    assert patterns.mask_reach(patterns.causal_mask()) is None


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dilation", [1, 2, [1, 2, 3, 1]])
def test_sliding_window_pattern_is_window_or_global_then_causal_and_real(causal, dilation):
    """Longformer's composition: `(window OR global) AND causal? AND real key?` (causality after the union)."""

    def visible(b, h, i, j):
        d = dilation[h] if isinstance(dilation, list) else dilation
        local = abs(i - j) <= 2 * d and abs(i - j) % d == 0
        return (local or bool(GLOBAL[b, i] or GLOBAL[b, j])) and (not causal or j <= i) and bool(PADDING[b, j])

    mask_fn = patterns.sliding_window_pattern(
        window=2, dilation=dilation, causal=causal, global_mask=GLOBAL, key_padding_mask=PADDING
    )
    assert_pattern(mask_fn, visible)


@pytest.mark.parametrize("causal", [False, True])
def test_strided_pattern_with_padding(causal):
    def visible(b, h, i, j):
        distance = i - j
        geometry = (0 <= distance if causal else True) and (abs(distance) <= 3 or distance % 3 == 0)
        return geometry and bool(PADDING[b, j])

    assert_pattern(patterns.strided_pattern(stride=3, causal=causal, key_padding_mask=PADDING), visible)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("summary_per_head", [False, True])
def test_fixed_pattern_counts_blocks_from_the_first_real_token(causal, summary_per_head):
    first, block_size, num_summary = [2, 0], 4, 2

    def visible(b, h, i, j):
        g = h % (block_size // num_summary) if summary_per_head else 0
        si, sj = (i - first[b]) % 11, (j - first[b]) % 11  # positions counted from the first real token
        geometry = (
            si // block_size == sj // block_size
            or block_size - (g + 1) * num_summary <= sj % block_size < block_size - g * num_summary
        )
        return geometry and (not causal or j <= i) and bool(PADDING[b, j])

    fixed = dict(block_size=block_size, num_summary=num_summary, causal=causal)
    assert_pattern(
        patterns.fixed_pattern(**fixed, summary_per_head=summary_per_head, key_padding_mask=PADDING), visible
    )
    # Without padding the blocks start at 0.
    unpadded = patterns.fixed_pattern(**fixed)
    assert_pattern(unpadded, lambda b, h, i, j: (i // 4 == j // 4 or j % 4 >= 2) and (not causal or j <= i))


# ---------------------------------------------------------------------------------------------- materialize_mask
def test_materialize_mask_shape_offset_and_names():
    mask = patterns.materialize_mask(patterns.causal_mask(), batch=3, heads=2, q_len=4, kv_len=9, q_offset=5)
    assert mask.shape == (3, 2, 4, 9) and mask.dtype == torch.bool and mask.is_contiguous()
    assert torch.equal(mask, brute_force(lambda b, h, i, j: j <= i, batch=3, heads=2, n_q=4, n_k=9, q_offset=5))
    # A predicate that reads neither b nor h broadcasts to every row and head.
    assert torch.equal(mask[2, 1], mask[0, 0])
    assert patterns.sliding_window_mask(3, 2).__name__ == "sliding_window_3_dilated_2"
    assert patterns.strided_mask(4, causal=True).__name__ == "strided_causal_4"
    assert patterns.and_masks(patterns.causal_mask(), patterns.fixed_mask(4, 1)).__name__ == "and(causal, fixed_4_1)"


@pytest.mark.parametrize("field", ["batch", "heads", "q_len", "kv_len", "q_offset"])
@pytest.mark.parametrize("value", [-1, 2.0, True])
def test_materialize_mask_refuses_bad_sizes_naming_them(field, value):
    sizes = dict(batch=1, heads=1, q_len=3, kv_len=3, q_offset=0) | {field: value}
    with pytest.raises(ValueError, match=rf"^{field} must be an int >= 0, got {value!r}$"):
        patterns.materialize_mask(patterns.causal_mask(), **sizes)


def test_materialize_mask_of_empty_sizes():
    assert patterns.materialize_mask(patterns.causal_mask(), batch=2, heads=1, q_len=0, kv_len=5).shape == (2, 1, 0, 5)


# ---------------------------------------------------------------------------------------------- validators
@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: patterns.sliding_window_mask(0), r"window must be an int >= 1 .*got 0"),
        (lambda: patterns.sliding_window_mask(True), r"window must be an int >= 1 .*got True"),
        (lambda: patterns.sliding_window_mask(2.0), r"window must be an int >= 1 .*got 2\.0"),
        (lambda: patterns.sliding_window_mask(2, 0), r"dilation must be an int >= 1 .*got 0"),
        (
            lambda: patterns.sliding_window_mask(2, []),
            r"dilation must be an int >= 1 or a non-empty sequence .*got \[\]",
        ),
        (lambda: patterns.sliding_window_mask(2, [1, 0]), r"dilation entries must be ints >= 1, got \[1, 0\]"),
        (lambda: patterns.sliding_window_mask(2, "2"), r"dilation must be an int >= 1 .*got '2'"),
        (
            lambda: patterns.check_dilation([1, 2], heads=3),
            r"dilation has one entry per head: expected 3 .*got 2: \[1, 2\]",
        ),
        (lambda: patterns.check_window(0, name="sliding_window"), r"^sliding_window must be an int >= 1"),
        (lambda: patterns.strided_mask(0), r"stride must be an int >= 1 .*got 0"),
        (lambda: patterns.fixed_mask(0, 1), r"block_size must be an int >= 1 .*got 0"),
        (lambda: patterns.fixed_mask(4, 5), r"num_summary must be an int in \[1, block_size\] = \[1, 4\] .*got 5"),
        (lambda: patterns.fixed_mask(4, 0), r"num_summary must be an int in \[1, block_size\] = \[1, 4\] .*got 0"),
        (
            lambda: padding_predicate(torch.ones(4, dtype=torch.bool)),
            r"key_padding_mask must have shape \[batch, length\], got \(4,\)",
        ),
        (
            lambda: patterns.global_token_mask(torch.ones(1, 2, 3)),
            r"global_mask must have shape \[batch, length\], got \(1, 2, 3\)",
        ),
        (
            lambda: patterns.from_first_real_token(patterns.causal_mask(), torch.ones(3)),
            r"key_padding_mask must have shape \[batch, length\], got \(3,\)",
        ),
    ],
)
def test_validators_raise_naming_the_argument_and_value(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_validators_return_valid_values():
    assert patterns.check_window(3) == 3
    assert patterns.check_dilation(2) == 2 and patterns.check_dilation([1, 2], heads=2) == (1, 2)
    assert patterns.check_stride(5) == 5
    assert patterns.check_fixed_sizes(4, 4) == (4, 4)
