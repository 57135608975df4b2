"""Sparse Transformer strided and fixed attention: predicates against the paper's formulas, executors against the
dense reference built from the SAME predicate (float64, whole tensors, outputs and the gradients of q, k, v).
"""

from __future__ import annotations

import pytest
import torch
from attention_checks import assert_all_close, check_op_leaks_nothing, dense_reference, outputs_and_grads, random_qkv
from kind_configs import refused_values

import longattn
from longattn import LongAttnConfig, ops, patterns
from longattn.tools.visualize import attention_pattern


def _padding(batch, length, kind):
    """None, or bool [b, n]: left-padded row 0, right-padded row 1, fully padded row 2 (when there are 3+ rows)."""
    if kind is None:
        return None
    mask = torch.ones(batch, length, dtype=torch.bool)
    mask[0, : max(1, length // 3)] = False
    if batch > 1:
        mask[1, length - length // 4 :] = False
    if batch > 2:
        mask[2] = False
    return mask


def _grid(picture: str) -> torch.Tensor:
    rows = [row.split() for row in picture.strip().splitlines()]
    return torch.tensor([[cell == "■" for cell in row] for row in rows])


# ---------------------------------------------------------------------------------------------- predicates
def _materialize(mask_fn, n, heads=1):
    return patterns.materialize_mask(mask_fn, batch=1, heads=heads, q_len=n, kv_len=n)[0]  # [h, n, n]


@pytest.mark.parametrize("stride", [1, 2, 3, 5])
@pytest.mark.parametrize("causal", [True, False])
def test_strided_predicate_matches_the_formula(stride, causal):
    n = 13
    actual = _materialize(patterns.strided_mask(stride, causal), n)[0]
    expected = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        for j in range(n):
            if causal:  # A1 = {max(0, i - l) .. i}, A2 = {j : (i - j) mod l = 0}, j <= i
                expected[i, j] = max(0, i - stride) <= j <= i or (j <= i and (i - j) % stride == 0)
            else:  # A1 mirrored: |i - j| <= l; A2 kept on both sides
                expected[i, j] = abs(i - j) <= stride or (i - j) % stride == 0
    torch.testing.assert_close(actual, expected)


@pytest.mark.parametrize("block_size, num_summary", [(1, 1), (4, 1), (4, 2), (5, 2), (4, 4)])
@pytest.mark.parametrize("causal", [True, False])
def test_fixed_predicate_matches_the_formula(block_size, num_summary, causal):
    n = 14
    actual = _materialize(patterns.fixed_pattern(block_size=block_size, num_summary=num_summary, causal=causal), n)[0]
    expected = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        for j in range(n):
            same_block = j // block_size == i // block_size
            summary = block_size - num_summary <= j % block_size <= block_size - 1
            expected[i, j] = (same_block or summary) and (j <= i or not causal)
    torch.testing.assert_close(actual, expected)


def test_fixed_per_head_predicate_gives_heads_distinct_summary_sub_blocks():
    block_size, num_summary, heads, n = 6, 2, 4, 12
    actual = _materialize(patterns.fixed_mask(block_size, num_summary, summary_per_head=True), n, heads=heads)
    for h in range(heads):
        group = h % (block_size // num_summary)  # 3 sub-blocks: heads 0, 1, 2, then head 3 reuses sub-block 0
        low, high = block_size - (group + 1) * num_summary, block_size - group * num_summary - 1
        for i in range(n):
            for j in range(n):
                expected = j // block_size == i // block_size or low <= j % block_size <= high
                assert bool(actual[h, i, j]) == expected, (h, i, j)
    torch.testing.assert_close(actual[3], actual[0])
    assert not torch.equal(actual[0], actual[1])


def test_predicates_match_hand_drawn_grids():
    strided_causal_3 = _grid("""
        ■ ⬚ ⬚ ⬚ ⬚ ⬚ ⬚ ⬚
        ■ ■ ⬚ ⬚ ⬚ ⬚ ⬚ ⬚
        ■ ■ ■ ⬚ ⬚ ⬚ ⬚ ⬚
        ■ ■ ■ ■ ⬚ ⬚ ⬚ ⬚
        ⬚ ■ ■ ■ ■ ⬚ ⬚ ⬚
        ⬚ ⬚ ■ ■ ■ ■ ⬚ ⬚
        ■ ⬚ ⬚ ■ ■ ■ ■ ⬚
        ⬚ ■ ⬚ ⬚ ■ ■ ■ ■
    """)
    strided_2 = _grid("""
        ■ ■ ■ ⬚ ■ ⬚ ■
        ■ ■ ■ ■ ⬚ ■ ⬚
        ■ ■ ■ ■ ■ ⬚ ■
        ⬚ ■ ■ ■ ■ ■ ⬚
        ■ ⬚ ■ ■ ■ ■ ■
        ⬚ ■ ⬚ ■ ■ ■ ■
        ■ ⬚ ■ ⬚ ■ ■ ■
    """)
    fixed_causal_3_1 = _grid("""
        ■ ⬚ ⬚ ⬚ ⬚ ⬚ ⬚ ⬚
        ■ ■ ⬚ ⬚ ⬚ ⬚ ⬚ ⬚
        ■ ■ ■ ⬚ ⬚ ⬚ ⬚ ⬚
        ⬚ ⬚ ■ ■ ⬚ ⬚ ⬚ ⬚
        ⬚ ⬚ ■ ■ ■ ⬚ ⬚ ⬚
        ⬚ ⬚ ■ ■ ■ ■ ⬚ ⬚
        ⬚ ⬚ ■ ⬚ ⬚ ■ ■ ⬚
        ⬚ ⬚ ■ ⬚ ⬚ ■ ■ ■
    """)
    fixed_4_2 = _grid("""
        ■ ■ ■ ■ ⬚ ⬚ ■ ■ ⬚
        ■ ■ ■ ■ ⬚ ⬚ ■ ■ ⬚
        ■ ■ ■ ■ ⬚ ⬚ ■ ■ ⬚
        ■ ■ ■ ■ ⬚ ⬚ ■ ■ ⬚
        ⬚ ⬚ ■ ■ ■ ■ ■ ■ ⬚
        ⬚ ⬚ ■ ■ ■ ■ ■ ■ ⬚
        ⬚ ⬚ ■ ■ ■ ■ ■ ■ ⬚
        ⬚ ⬚ ■ ■ ■ ■ ■ ■ ⬚
        ⬚ ⬚ ■ ■ ⬚ ⬚ ■ ■ ■
    """)
    torch.testing.assert_close(_materialize(patterns.strided_pattern(stride=3, causal=True), 8)[0], strided_causal_3)
    torch.testing.assert_close(_materialize(patterns.strided_pattern(stride=2), 7)[0], strided_2)
    torch.testing.assert_close(
        _materialize(patterns.fixed_pattern(block_size=3, num_summary=1, causal=True), 8)[0], fixed_causal_3_1
    )
    torch.testing.assert_close(_materialize(patterns.fixed_pattern(block_size=4, num_summary=2), 9)[0], fixed_4_2)


def test_fixed_blocks_are_counted_from_the_first_real_token():
    n, pad = 11, 3
    key_padding_mask = torch.arange(n)[None] >= pad  # left padding
    padded = patterns.materialize_mask(
        patterns.fixed_pattern(block_size=4, num_summary=1, causal=True, key_padding_mask=key_padding_mask),
        batch=1,
        heads=1,
        q_len=n,
        kv_len=n,
    )[0, 0]
    alone = _materialize(patterns.fixed_pattern(block_size=4, num_summary=1, causal=True), n - pad)[0]
    torch.testing.assert_close(padded[pad:, pad:], alone)
    assert not padded[:, :pad].any()


def test_predicate_names_describe_the_pattern():
    assert patterns.strided_mask(4).__name__ == "strided_4"
    assert patterns.strided_mask(4, causal=True).__name__ == "strided_causal_4"
    assert patterns.fixed_mask(8, 2).__name__ == "fixed_8_2"
    assert patterns.fixed_mask(8, 2, summary_per_head=True).__name__ == "fixed_8_2_per_head"


# ---------------------------------------------------------------------------------------------- executors
CASES = [
    # (batch, heads, n_q, n_k, size, causal, padding); size is the stride, or (block_size, num_summary[, per_head])
    pytest.param(1, 1, 1, 1, 3, True, None, id="n1-causal"),
    pytest.param(1, 2, 1, 1, 3, False, None, id="n1"),
    pytest.param(3, 2, 7, 7, 2, True, "pad", id="n7-causal-pad"),
    pytest.param(3, 2, 7, 7, 2, False, "pad", id="n7-pad"),
    pytest.param(2, 2, 7, 7, 9, False, "pad", id="n7-size>length"),
    pytest.param(3, 2, 100, 100, 7, True, "pad", id="n100-causal-pad"),
    pytest.param(3, 2, 100, 100, 7, False, "pad", id="n100-pad"),
    pytest.param(2, 3, 257, 257, 16, True, None, id="n257-causal"),
    pytest.param(3, 3, 257, 257, 16, False, "pad", id="n257-pad"),
    pytest.param(2, 2, 257, 257, 300, True, "pad", id="n257-size>length-causal"),
    pytest.param(3, 2, 1000, 1000, 31, True, "pad", id="n1000-causal-pad"),
    pytest.param(3, 2, 1000, 1000, 31, False, "pad", id="n1000-pad"),
    pytest.param(2, 2, 5, 100, 7, True, "pad", id="decode-5-of-100-causal"),
    pytest.param(2, 2, 30, 257, 16, False, "pad", id="last-30-of-257"),
]


def _strided_size(size):
    return {"stride": size}


def _fixed_sizes(size, length):
    """A few summary counts, the per-head variant, and (on short sequences) every cell a summary cell."""
    sizes = [
        {"block_size": size, "num_summary": max(1, size // 4)},
        {"block_size": size, "num_summary": 1, "summary_per_head": True},
    ]
    return sizes + ([{"block_size": size, "num_summary": size}] if length < 500 else [])


@pytest.mark.parametrize("batch, heads, n_q, n_k, size, causal, padding", CASES)
def test_strided_equals_dense_reference(batch, heads, n_q, n_k, size, causal, padding):
    q, k, v = random_qkv(batch, heads, n_q, n_k=n_k)
    key_padding_mask = _padding(batch, n_k, padding)
    pattern = patterns.strided_pattern(stride=size, causal=causal, key_padding_mask=key_padding_mask)
    actual = outputs_and_grads(
        lambda q, k, v: ops.strided_attention(q, k, v, stride=size, causal=causal, key_padding_mask=key_padding_mask),
        q,
        k,
        v,
    )
    expected = outputs_and_grads(lambda q, k, v: dense_reference(pattern, q, k, v), q, k, v)
    assert_all_close(actual, expected)


@pytest.mark.parametrize("batch, heads, n_q, n_k, size, causal, padding", CASES)
def test_fixed_equals_dense_reference(batch, heads, n_q, n_k, size, causal, padding):
    q, k, v = random_qkv(batch, heads, n_q, n_k=n_k)
    key_padding_mask = _padding(batch, n_k, padding)
    for sizes in _fixed_sizes(size, n_k):
        pattern = patterns.fixed_pattern(causal=causal, key_padding_mask=key_padding_mask, **sizes)
        actual = outputs_and_grads(
            lambda q, k, v: ops.fixed_attention(q, k, v, causal=causal, key_padding_mask=key_padding_mask, **sizes),
            q,
            k,
            v,
        )
        expected = outputs_and_grads(lambda q, k, v: dense_reference(pattern, q, k, v), q, k, v)
        assert_all_close(actual, expected)


def test_fully_padded_row_gives_zeros_and_finite_gradients():
    q, k, v = random_qkv(2, 2, 50)
    key_padding_mask = torch.ones(2, 50, dtype=torch.bool)
    key_padding_mask[1] = False
    for fn in (
        lambda q, k, v: ops.strided_attention(q, k, v, stride=4, causal=False, key_padding_mask=key_padding_mask),
        lambda q, k, v: ops.fixed_attention(q, k, v, block_size=6, num_summary=2, key_padding_mask=key_padding_mask),
    ):
        out, *grads = outputs_and_grads(fn, q, k, v)
        torch.testing.assert_close(out[1], torch.zeros_like(out[1]))
        assert all(torch.isfinite(grad).all() for grad in grads)


def test_size_covering_the_sequence_is_full_attention():
    n = 37
    q, k, v = random_qkv(2, 2, n)
    for causal in (True, False):
        full = ops.full_attention(q, k, v, causal=causal)
        # Stride >= n - 1: the band alone covers every key. Block >= n: one block holds every key.
        torch.testing.assert_close(ops.strided_attention(q, k, v, stride=n - 1, causal=causal), full)
        torch.testing.assert_close(ops.fixed_attention(q, k, v, block_size=n, num_summary=1, causal=causal), full)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_with_padding_has_no_nan(dtype):
    q, k, v = random_qkv(3, 2, 300, head_dim=16, dtype=dtype)
    key_padding_mask = _padding(3, 300, "pad")
    for fn in (
        lambda q, k, v: ops.strided_attention(q, k, v, stride=17, key_padding_mask=key_padding_mask),
        lambda q, k, v: ops.strided_attention(q, k, v, stride=17, causal=False, key_padding_mask=key_padding_mask),
        lambda q, k, v: ops.fixed_attention(q, k, v, block_size=20, num_summary=3, key_padding_mask=key_padding_mask),
        lambda q, k, v: ops.fixed_attention(
            q,
            k,
            v,
            block_size=20,
            num_summary=3,
            causal=False,
            summary_per_head=True,
            key_padding_mask=key_padding_mask,
        ),
    ):
        out, *grads = outputs_and_grads(fn, q, k, v)
        assert out.dtype == dtype
        assert torch.isfinite(out.float()).all()
        assert all(torch.isfinite(grad.float()).all() for grad in grads)
        reference = fn(*(t.detach().double() for t in (q, k, v)))
        torch.testing.assert_close(out.double(), reference, atol=3e-2, rtol=3e-2)


def test_causal_outputs_do_not_see_later_keys():
    q, k, v = random_qkv(1, 2, 200)
    for fn in (
        lambda k, v: ops.strided_attention(q, k, v, stride=11),
        lambda k, v: ops.fixed_attention(q, k, v, block_size=13, num_summary=3),
    ):
        check_op_leaks_nothing(fn, (k, v), 120, seed=1, atol=0)


def test_dropout_is_applied_and_seedable():
    q, k, v = random_qkv(1, 2, 90)
    for fn in (
        lambda p: ops.strided_attention(q, k, v, stride=5, dropout_p=p),
        lambda p: ops.fixed_attention(q, k, v, block_size=9, num_summary=2, dropout_p=p),
    ):
        torch.manual_seed(3)
        first = fn(0.3)
        torch.manual_seed(3)
        torch.testing.assert_close(fn(0.3), first)
        assert not torch.allclose(first, fn(0.0))
        assert torch.isfinite(first).all()


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda q: ops.strided_attention(q, q, q, stride=0), r"stride must be an int >= 1.*got 0"),
        (lambda q: ops.strided_attention(q, q, q, stride=2.5), r"stride must be an int >= 1.*got 2.5"),
        (lambda q: ops.strided_attention(q, q, q, stride=2, causal="yes"), r"causal must be a bool.*'yes'"),
        (lambda q: ops.fixed_attention(q, q, q, block_size=0, num_summary=1), r"block_size must be an int >= 1.*got 0"),
        (
            lambda q: ops.fixed_attention(q, q, q, block_size=4, num_summary=5),
            r"num_summary must be an int in \[1, block_size\] = \[1, 4\].*got 5",
        ),
        (lambda q: ops.fixed_attention(q, q, q, block_size=4, num_summary=0), r"num_summary.*got 0"),
        (
            lambda q: ops.fixed_attention(q, q, q, block_size=4, num_summary=1, summary_per_head=1),
            r"summary_per_head must be a bool",
        ),
        (
            lambda q: ops.strided_attention(q, q, q, stride=2, key_padding_mask=torch.ones(3, 5, dtype=torch.bool)),
            r"key_padding_mask must have shape \[batch, length\] = \[1, 6\]",
        ),
        (lambda q: ops.fixed_attention(q, q, q, block_size=4, num_summary=1, dropout_p=1.0), r"dropout_p"),
    ],
)
def test_invalid_arguments_raise_naming_them(call, message):
    q = torch.randn(1, 2, 6, 4)
    with pytest.raises(ValueError, match=message):
        call(q)


# ---------------------------------------------------------------------------------------------- attention kinds
@pytest.mark.parametrize(
    "fields, message",
    [
        *refused_values({"strided_stride": [0, [4, 4, 4]], "fixed_block_size": [0], "fixed_num_summary": [0]}),
        (dict(fixed_block_size=4, fixed_num_summary=5), r"fixed_num_summary.*fixed_block_size"),
        (dict(fixed_block_size=[8, 4], fixed_num_summary=6), r"fixed_num_summary.*layer 1.*fixed_block_size"),
        (dict(fixed_summary_per_head="no"), "fixed_summary_per_head"),
    ],
)
def test_config_validation_names_the_fields(fields, message):
    kind = "strided" if "strided_stride" in fields else "fixed"
    with pytest.raises(ValueError, match=message):
        LongAttnConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, attention_type=kind, **fields)


def test_kinds_are_registered_with_their_defaults():
    assert {"strided", "fixed"} <= set(longattn.available_attention_types())
    config = LongAttnConfig(attention_type="fixed")
    assert (config.strided_stride, config.fixed_block_size, config.fixed_num_summary) == (128, 128, 8)
    assert config.fixed_summary_per_head is False


# The model tests' size: 40 tokens, hidden 16 in 2 heads, intermediate 32.
SMALL = dict(vocab_size=40, hidden_size=16, num_attention_heads=2, intermediate_size=32)


def _small_config(layers: list, **fields) -> LongAttnConfig:
    """A `SMALL` model of one layer of each kind of `layers`, `fields` added."""
    return LongAttnConfig(**SMALL, num_hidden_layers=len(layers), attention_type=layers, **fields)


@pytest.mark.parametrize("is_decoder", [False, True])
def test_drawn_pattern_is_the_predicate(is_decoder):
    """The picture (through output_attentions) shows exactly the pattern, and the fast path agrees with it."""
    n = 23
    fields = dict(strided_stride=4, fixed_block_size=5, fixed_num_summary=2, fixed_summary_per_head=True)
    config = _small_config(["strided", "fixed"], is_decoder=is_decoder, **fields)
    model = longattn.LongAttnModel(config).eval()
    ids = torch.randint(4, 40, (1, n), generator=torch.Generator().manual_seed(0))
    for layer_idx, pattern in enumerate(
        (
            patterns.strided_pattern(stride=4, causal=is_decoder),
            patterns.fixed_pattern(block_size=5, num_summary=2, summary_per_head=True, causal=is_decoder),
        )
    ):
        drawn = attention_pattern(model, ids, layer_idx=layer_idx)
        expected = patterns.materialize_mask(pattern, batch=1, heads=2, q_len=n, kv_len=n)[0]
        torch.testing.assert_close(drawn, expected)
    with torch.no_grad():
        fast = model(input_ids=ids).last_hidden_state
        dense = model(input_ids=ids, output_attentions=True).last_hidden_state
    torch.testing.assert_close(fast, dense, rtol=1e-4, atol=1e-5)


def test_mixed_layers_train_in_a_causal_lm():
    fields = dict(strided_stride=3, sliding_window=2, fixed_block_size=4, fixed_num_summary=1, is_decoder=True)
    config = _small_config(["strided", "sliding", "fixed"], **fields)
    model = longattn.LongAttnForCausalLM(config).train()
    ids = torch.randint(4, 40, (2, 41), generator=torch.Generator().manual_seed(0))
    model(input_ids=ids, labels=ids).loss.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters() if p.requires_grad)
