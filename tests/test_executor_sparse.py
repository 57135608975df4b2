"""`longattn.executor_sparse` directly: the strided and fixed executors equal the dense reference of the same
predicate (`patterns.materialize_mask` + `ops.reference_attention`) in float64, outputs and gradients, at odd
lengths, with padding, causal and not, in cached decoding (fewer queries than keys), and with block sizes small
enough that every block / sub-block / causal-group loop runs more than once."""

from __future__ import annotations

import pytest
from attention_checks import assert_all_close, dense_reference, outputs_and_grads, random_qkv, three_padded_rows

from longattn import executor_sparse, patterns

B, H, D = 3, 4, 8
SCALE = 0.3
TIGHT = dict(rtol=1e-10, atol=1e-10)
LENGTHS = [(37, 37), (7, 37), (1, 23)]
LENGTH_IDS = ["37", "decode-7-of-37", "decode-1-of-23"]


def _check(executor, mask_fn, n_q, n_k, **kwargs):
    q, k, v = random_qkv(B, H, n_q, D, n_k=n_k, seed=n_q + n_k)
    expected = outputs_and_grads(lambda q, k, v: dense_reference(mask_fn, q, k, v, scale=SCALE), q, k, v)
    actual = outputs_and_grads(lambda q, k, v: executor(q, k, v, mask_fn=mask_fn, scale=SCALE, **kwargs), q, k, v)
    assert_all_close(actual, expected, **TIGHT)
    return actual


# ---------------------------------------------------------------------------------------------- strided
@pytest.mark.parametrize("stride", [1, 3, 5, 40])
@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
@pytest.mark.parametrize("padding", [False, True], ids=["no-padding", "padding"])
@pytest.mark.parametrize(("n_q", "n_k"), LENGTHS, ids=LENGTH_IDS)
def test_strided_equals_the_dense_reference(stride, causal, padding, n_q, n_k):
    key_padding_mask = three_padded_rows(n_k, left=True) if padding else None
    mask_fn = patterns.strided_pattern(stride=stride, causal=causal, key_padding_mask=key_padding_mask)
    # Small blocks: several band blocks and several class sub-blocks (each its own call when causal).
    out = _check(
        executor_sparse.strided_blocked_attention,
        mask_fn,
        n_q,
        n_k,
        stride=stride,
        causal=causal,
        block_size=4,
        class_block=2,
    )[0]
    if padding:
        assert not out[2].any(), "a query that sees no key gets zeros"


@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
def test_strided_default_blocks_equal_the_dense_reference(causal):
    mask_fn = patterns.strided_pattern(stride=4, causal=causal, key_padding_mask=three_padded_rows(53))
    _check(executor_sparse.strided_blocked_attention, mask_fn, 53, 53, stride=4, causal=causal)


# ---------------------------------------------------------------------------------------------- fixed
FIXED = [(5, 2, False), (6, 2, True), (4, 4, False), (1, 1, False), (8, 3, True)]
FIXED_IDS = ["5-2", "6-2-per-head", "4-4", "1-1", "8-3-per-head"]


@pytest.mark.parametrize(("block_size", "num_summary", "summary_per_head"), FIXED, ids=FIXED_IDS)
@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
@pytest.mark.parametrize("padding", [False, True], ids=["no-padding", "right-padding"])
@pytest.mark.parametrize(("n_q", "n_k"), LENGTHS, ids=LENGTH_IDS)
def test_fixed_equals_the_dense_reference(block_size, num_summary, summary_per_head, causal, padding, n_q, n_k):
    # Right padding only: the executor's blocks start at position 0, as the pattern's do when the first real token
    # is at 0 (`ops.fixed_attention` rolls left-padded rows before calling the executor).
    key_padding_mask = three_padded_rows(n_k, left=False) if padding else None
    mask_fn = patterns.fixed_pattern(
        block_size=block_size,
        num_summary=num_summary,
        summary_per_head=summary_per_head,
        causal=causal,
        key_padding_mask=key_padding_mask,
    )
    # Sub-blocks of 2 rows and 3 causal groups: every loop of the executor runs more than once.
    out = _check(
        executor_sparse.fixed_blocked_attention,
        mask_fn,
        n_q,
        n_k,
        block_size=block_size,
        num_summary=num_summary,
        summary_per_head=summary_per_head,
        causal=causal,
        max_block_rows=2,
        causal_groups=3,
    )[0]
    if padding:
        assert not out[2].any(), "a query that sees no key gets zeros"


@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
def test_fixed_default_blocks_equal_the_dense_reference(causal):
    mask_fn = patterns.fixed_pattern(block_size=6, num_summary=2, summary_per_head=True, causal=causal)
    _check(
        executor_sparse.fixed_blocked_attention,
        mask_fn,
        53,
        53,
        block_size=6,
        num_summary=2,
        summary_per_head=True,
        causal=causal,
    )


# ---------------------------------------------------------------------------------------------- edges
@pytest.mark.parametrize(
    "executor, kwargs",
    [
        (executor_sparse.strided_blocked_attention, dict(stride=3)),
        (executor_sparse.fixed_blocked_attention, dict(block_size=4, num_summary=1)),
    ],
    ids=["strided", "fixed"],
)
def test_no_query_gives_an_empty_output(executor, kwargs):
    q, k, v = random_qkv(B, H, 0, D, n_k=9)
    out = executor(q, k, v, mask_fn=patterns.causal_mask(), causal=True, scale=SCALE, **kwargs)
    assert out.shape == (B, H, 0, D)


def test_a_narrower_predicate_inside_the_geometry_is_followed():
    """The geometry says where keys can be, the predicate which are seen: strided geometry, window-1 predicate."""
    mask_fn = patterns.and_masks(patterns.strided_pattern(stride=3), patterns.sliding_window_mask(1))
    _check(executor_sparse.strided_blocked_attention, mask_fn, 19, 19, stride=3, causal=False, block_size=4)
