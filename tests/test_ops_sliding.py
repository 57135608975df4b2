"""Sliding window / dilated / global attention: the blocked executor against the dense reference.

Every comparison is on whole tensors (outputs and the gradients of q, k, v) in float64, against
`reference_attention` under the mask materialised from the SAME pattern definition the executor evaluates.
"""

from __future__ import annotations

import math

import pytest
import torch
from attention_checks import assert_all_close, dense_reference, outputs_and_grads, random_qkv, saved_tensor_bytes

from longattn import ops, patterns
from longattn.executor_blocked import attend_blocks, band_layout, banded_attention, merge_attention
from longattn.executor_gathered import _RepeatedBlockMask


def _reference(q, k, v, **pattern):
    return dense_reference(patterns.sliding_window_pattern(**pattern), q, k, v)


def _token_masks(batch, length, *, padding, global_tokens):
    """Padding: left-padded row 0, right-padded row 1, fully padded row 2 (when there are 3+ rows).
    Global tokens: none in row 0, first + last + middle in row 1, one in row 2+."""
    key_padding_mask = global_mask = None
    if padding:
        key_padding_mask = torch.ones(batch, length, dtype=torch.bool)
        key_padding_mask[0, : length // 3] = False
        if batch > 1:
            key_padding_mask[1, length - length // 4 :] = False
        if batch > 2:
            key_padding_mask[2] = False
    if global_tokens:
        global_mask = torch.zeros(batch, length, dtype=torch.bool)
        if batch > 1:
            global_mask[1, [0, length // 2, length - 1]] = True
        for row in range(2, batch):
            global_mask[row, (7 * row) % length] = True
    return key_padding_mask, global_mask


CASES = [
    # (batch, heads, length, window, dilation, causal, padding, global_tokens)
    pytest.param(1, 1, 1, 1, 1, False, False, False, id="n1"),
    pytest.param(2, 2, 7, 2, 1, False, True, False, id="n7-pad"),
    pytest.param(2, 2, 7, 9, 1, True, False, True, id="n7-window>length-causal-global"),
    pytest.param(3, 2, 100, 5, 1, False, True, True, id="n100-pad-global"),
    # Windows that reach every key (SDPA path) and one just short of it (blocked executor).
    pytest.param(3, 2, 100, 99, 1, False, True, True, id="n100-window=length-1-pad-global"),
    pytest.param(3, 2, 100, 99, 1, True, True, True, id="n100-window=length-1-causal-pad-global"),
    pytest.param(3, 2, 100, 98, 1, False, True, True, id="n100-window=length-2-pad-global"),
    pytest.param(3, 2, 100, 5, 1, True, True, True, id="n100-causal-pad-global"),
    pytest.param(2, 4, 257, 7, [1, 2, 3, 4], False, False, False, id="n257-dilation-per-head"),
    pytest.param(3, 4, 257, 7, [1, 2, 3, 4], True, True, True, id="n257-dilation-per-head-causal-pad-global"),
    pytest.param(3, 4, 257, 300, [2, 1, 2, 3], False, True, True, id="n257-window>length-dilated"),
    pytest.param(2, 2, 257, 16, 3, False, True, True, id="n257-dilation3"),
    pytest.param(3, 2, 1000, 40, 1, False, True, True, id="n1000-pad-global"),
    pytest.param(2, 2, 1000, 33, [1, 5], True, True, False, id="n1000-causal-dilated"),
]


@pytest.fixture(params=["fused", "attend_blocks"])
def band_path(request, monkeypatch):
    """Run a test through both local paths of `banded_attention`: the fused kernel (a plain band without dropout on
    CPU) and `attend_blocks` (always taken by dilated bands, dropout and compilers)."""
    import longattn.executor_blocked as executor

    if request.param == "attend_blocks":
        monkeypatch.setattr(executor, "_fused_band_applies", lambda *args: False)
    return request.param


@pytest.mark.parametrize("batch, heads, length, window, dilation, causal, padding, global_tokens", CASES)
def test_sliding_window_equals_reference(
    batch, heads, length, window, dilation, causal, padding, global_tokens, band_path
):
    q, k, v = random_qkv(batch, heads, length, seed=length + window)
    key_padding_mask, global_mask = _token_masks(batch, length, padding=padding, global_tokens=global_tokens)
    pattern = dict(
        window=window, dilation=dilation, causal=causal, global_mask=global_mask, key_padding_mask=key_padding_mask
    )
    actual = outputs_and_grads(lambda q, k, v: ops.sliding_window_attention(q, k, v, **pattern), q, k, v)
    expected = outputs_and_grads(lambda q, k, v: _reference(q, k, v, **pattern), q, k, v)
    assert_all_close(actual, expected)


GROUPED_CASES = [
    # (batch, heads, kv_heads, length, window, dilation, causal, padding, global_tokens)
    pytest.param(2, 4, 2, 37, 5, 1, False, True, False, id="n37-pad"),
    pytest.param(2, 4, 1, 37, 5, 1, True, True, False, id="n37-causal-pad-one-kv-head"),
    pytest.param(3, 6, 2, 101, 7, 1, False, True, True, id="n101-pad-global"),
    pytest.param(3, 4, 2, 101, 7, 1, True, True, True, id="n101-causal-pad-global"),
    pytest.param(2, 4, 2, 67, 4, [1, 2, 1, 3], False, True, True, id="n67-dilation-per-head-global"),
    pytest.param(2, 4, 2, 67, 4, 2, True, False, False, id="n67-dilation2-causal"),
    pytest.param(2, 4, 2, 30, 40, 1, False, True, False, id="n30-window>length"),
]


@pytest.mark.parametrize(
    "batch, heads, kv_heads, length, window, dilation, causal, padding, global_tokens", GROUPED_CASES
)
def test_grouped_query_heads_equal_repeated_keys(
    batch, heads, kv_heads, length, window, dilation, causal, padding, global_tokens
):
    """Grouped-query attention: k, v with fewer heads give what k, v repeated to the query heads give (float64,
    outputs and gradients; the gradient of a shared key/value head sums its group's)."""
    q, _, _ = random_qkv(batch, heads, length, seed=length)
    _, k, v = random_qkv(batch, kv_heads, length, seed=length + 1)
    key_padding_mask, global_mask = _token_masks(batch, length, padding=padding, global_tokens=global_tokens)
    pattern = dict(
        window=window, dilation=dilation, causal=causal, global_mask=global_mask, key_padding_mask=key_padding_mask
    )
    groups = heads // kv_heads

    def repeated(q, k, v):
        return ops.sliding_window_attention(
            q, k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1), **pattern
        )

    actual = outputs_and_grads(lambda q, k, v: ops.sliding_window_attention(q, k, v, **pattern), q, k, v)
    assert_all_close(actual, outputs_and_grads(repeated, q, k, v))
    with_reference = outputs_and_grads(
        lambda q, k, v: ops.sliding_window_attention(q, k, v, backend="reference", **pattern), q, k, v
    )
    assert_all_close(actual, with_reference)


@pytest.mark.parametrize("block_size", [1, 3, 16, 64])
@pytest.mark.parametrize("dilation", [1, [2, 3]])
def test_block_sizes_that_do_not_divide_the_length(block_size, dilation):
    q, k, v = random_qkv(3, 2, 53, seed=block_size)
    key_padding_mask, global_mask = _token_masks(3, 53, padding=True, global_tokens=True)
    pattern = dict(
        window=6, dilation=dilation, causal=False, global_mask=global_mask, key_padding_mask=key_padding_mask
    )

    def blocked(q, k, v):
        return banded_attention(
            q,
            k,
            v,
            mask_fn=patterns.sliding_window_pattern(**pattern),
            window_left=6,
            window_right=6,
            dilation=dilation,
            global_mask=global_mask,
            scale=q.shape[-1] ** -0.5,
            block_size=block_size,
        )

    assert_all_close(
        outputs_and_grads(blocked, q, k, v), outputs_and_grads(lambda q, k, v: _reference(q, k, v, **pattern), q, k, v)
    )


@pytest.mark.parametrize("n_q", [1, 5, 40])
@pytest.mark.parametrize("dilation", [1, [1, 3]])
def test_queries_are_the_last_positions_when_shorter_than_keys(n_q, dilation):
    q, k, v = random_qkv(3, 2, n_q, n_k=61, seed=n_q)
    key_padding_mask, global_mask = _token_masks(3, 61, padding=True, global_tokens=True)
    pattern = dict(window=9, dilation=dilation, causal=True, global_mask=global_mask, key_padding_mask=key_padding_mask)
    assert_all_close(
        outputs_and_grads(lambda q, k, v: ops.sliding_window_attention(q, k, v, **pattern), q, k, v),
        outputs_and_grads(lambda q, k, v: _reference(q, k, v, **pattern), q, k, v),
    )


def test_a_wrong_pattern_is_detected():
    """The comparisons above can fail: a window one too small, or a missing global token, changes the result."""
    q, k, v = random_qkv(2, 2, 100)
    _, global_mask = _token_masks(2, 100, padding=False, global_tokens=True)
    out = ops.sliding_window_attention(q, k, v, window=5, global_mask=global_mask)
    assert not torch.allclose(out, _reference(q, k, v, window=6, global_mask=global_mask))
    assert not torch.allclose(out, _reference(q, k, v, window=5))
    assert not torch.allclose(out, _reference(q, k, v, window=5, dilation=2, global_mask=global_mask))
    torch.testing.assert_close(out, _reference(q, k, v, window=5, global_mask=global_mask))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("length", [7, 100])
def test_window_at_least_length_equals_full_attention(causal, length):
    q, k, v = random_qkv(3, 2, length)
    key_padding_mask, global_mask = _token_masks(3, length, padding=True, global_tokens=True)
    kwargs = dict(causal=causal, key_padding_mask=key_padding_mask, global_mask=global_mask)
    assert_all_close(
        outputs_and_grads(lambda q, k, v: ops.sliding_window_attention(q, k, v, window=length, **kwargs), q, k, v),
        outputs_and_grads(lambda q, k, v: ops.full_attention(q, k, v, **kwargs), q, k, v),
    )


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("n_q", [30, 4])
def test_full_attention_equals_reference(causal, n_q):
    q, k, v = random_qkv(3, 2, n_q, n_k=30)
    key_padding_mask, _ = _token_masks(3, 30, padding=True, global_tokens=False)
    parts = [patterns.key_padding_predicate(key_padding_mask)] + ([patterns.causal_mask()] if causal else [])
    mask = patterns.materialize_mask(
        patterns.and_masks(*parts), batch=3, heads=2, q_len=n_q, kv_len=30, q_offset=30 - n_q
    )
    assert_all_close(
        outputs_and_grads(
            lambda q, k, v: ops.full_attention(q, k, v, causal=causal, key_padding_mask=key_padding_mask), q, k, v
        ),
        outputs_and_grads(lambda q, k, v: ops.reference_attention(q, k, v, mask), q, k, v),
    )


def test_causal_attention_does_not_leak_the_future():
    q, k, v = random_qkv(2, 2, 80)
    _, global_mask = _token_masks(2, 80, padding=False, global_tokens=True)
    kwargs = dict(window=6, dilation=[1, 2], causal=True, global_mask=global_mask)
    before = ops.sliding_window_attention(q, k, v, **kwargs)
    changed = [t.detach().clone() for t in (q, k, v)]
    for t in changed:
        t[:, :, 41:] = torch.randn_like(t[:, :, 41:])
    after = ops.sliding_window_attention(*changed, **kwargs)
    torch.testing.assert_close(after[:, :, :41], before[:, :, :41])
    assert not torch.allclose(after[:, :, 41:], before[:, :, 41:])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "attention",
    [
        pytest.param(
            lambda q, k, v, **kw: ops.sliding_window_attention(q, k, v, window=4, dilation=[1, 2], **kw), id="sliding"
        ),
        pytest.param(lambda q, k, v, **kw: ops.full_attention(q, k, v, **kw), id="full"),
    ],
)
def test_fully_padded_rows_give_zeros_not_nan_in_half_precision(dtype, attention):
    q, k, v = random_qkv(3, 2, 37, dtype=dtype)
    key_padding_mask, global_mask = _token_masks(3, 37, padding=True, global_tokens=True)
    for causal in (False, True):
        out = attention(q, k, v, causal=causal, key_padding_mask=key_padding_mask, global_mask=global_mask)
        grads = torch.autograd.grad(out.float().square().sum(), (q, k, v))
        assert out.dtype == dtype
        for tensor in (out, *grads):
            assert torch.isfinite(tensor).all()
        assert (out[2] == 0).all()  # row 2 is fully padded
        # Left padding and causality: the first queries of row 0 see no real key.
        if causal:
            assert (out[0, :, : 37 // 3] == 0).all()


def test_attend_blocks_takes_one_key_set_per_batch_row():
    """kv_index `[b, nb, m]` (the band plus each row's global keys, in one softmax) equals each row run with its
    own `[nb, m]` index, outputs and gradients, with grouped key/value heads."""
    q, _, _ = random_qkv(2, 4, 24)
    _, k, v = random_qkv(2, 2, 24, seed=3)
    generator = torch.Generator().manual_seed(4)
    kv_index = torch.randint(0, 24, (2, 3, 10), generator=generator)  # [b, nb, m]
    mask = torch.rand(2, 4, 3, 8, 10, generator=generator) > 0.3

    def per_batch(q, k, v):
        return attend_blocks(q.view(2, 4, 3, 8, 8), k, v, kv_index=kv_index, mask=mask, scale=0.3)[0]

    def row_by_row(q, k, v):
        rows = [
            attend_blocks(
                q[i : i + 1].reshape(1, 4, 3, 8, 8),
                k[i : i + 1],
                v[i : i + 1],
                kv_index=kv_index[i],
                mask=mask[i : i + 1],
                scale=0.3,
            )[0]
            for i in range(2)
        ]
        return torch.cat(rows)

    assert_all_close(outputs_and_grads(per_batch, q, k, v), outputs_and_grads(row_by_row, q, k, v))


@pytest.mark.parametrize("per_row", [False, True])
def test_traceable_blocks_equal_the_eager_kernel_with_grouped_heads(per_row):
    """The plain-ops form used under torch.compile reads grouped key/value heads and per-row key sets like the eager
    kernel (outputs and gradients)."""
    from longattn.executor_gathered import _attend_blocks_traceable

    q, _, _ = random_qkv(2, 4, 24)
    _, k, v = random_qkv(2, 2, 24, seed=3)
    generator = torch.Generator().manual_seed(5)
    kv_index = torch.randint(0, 24, (2, 3, 10) if per_row else (3, 10), generator=generator)
    mask = torch.rand(2, 1, 3, 8, 10, generator=generator) > 0.3
    kwargs = dict(kv_index=kv_index, mask=mask, scale=0.3)

    def eager(q, k, v):
        return attend_blocks(q.view(2, 4, 3, 8, 8), k, v, **kwargs)[0]

    def traceable(q, k, v):
        return _attend_blocks_traceable(q.view(2, 4, 3, 8, 8), k, v, dropout_p=0.0, **kwargs)[0]

    assert_all_close(outputs_and_grads(traceable, q, k, v), outputs_and_grads(eager, q, k, v))


def test_global_keys_join_the_band_in_one_pass(monkeypatch):
    """With global tokens, `attend_blocks`' band and global keys are one call (no merge), plus one for the global
    queries' dense rows (the fused path, which merges per chunk, is switched off here)."""
    import longattn.executor_blocked as executor

    monkeypatch.setattr(executor, "_fused_band_applies", lambda *args: False)
    calls = []
    original = executor.attend_blocks
    monkeypatch.setattr(
        executor, "attend_blocks", lambda *args, **kw: calls.append(kw["kv_index"]) or original(*args, **kw)
    )
    monkeypatch.setattr(executor, "merge_attention", lambda partials: pytest.fail("merged partial attentions"))
    q, k, v = random_qkv(2, 2, 100)
    _, global_mask = _token_masks(2, 100, padding=False, global_tokens=True)
    pattern = dict(window=5, global_mask=global_mask)
    actual = outputs_and_grads(lambda q, k, v: ops.sliding_window_attention(q, k, v, **pattern), q, k, v)
    assert len(calls) == 2 and calls[0].dim() == 3 and calls[0].shape[0] == 2 and calls[1] is None  # [b, nb, m + g]
    assert_all_close(actual, outputs_and_grads(lambda q, k, v: _reference(q, k, v, **pattern), q, k, v))


def test_half_precision_matches_float64_reference():
    q, k, v = random_qkv(2, 2, 90, dtype=torch.bfloat16)
    key_padding_mask, global_mask = _token_masks(2, 90, padding=True, global_tokens=True)
    pattern = dict(window=8, global_mask=global_mask, key_padding_mask=key_padding_mask)
    out = ops.sliding_window_attention(q, k, v, **pattern)
    expected = _reference(*(t.detach().double() for t in (q, k, v)), **pattern)
    torch.testing.assert_close(out.double(), expected, atol=2e-2, rtol=2e-2)


def test_dropout_gradients_match_finite_differences():
    q, k, v = random_qkv(2, 2, 11, head_dim=4)
    _, global_mask = _token_masks(2, 11, padding=False, global_tokens=True)

    def attention(q, k, v):
        torch.manual_seed(0)  # the same dropout mask on every call gradcheck makes
        return ops.sliding_window_attention(q, k, v, window=2, global_mask=global_mask, dropout_p=0.3)

    torch.testing.assert_close(attention(q, k, v), attention(q, k, v))
    assert not torch.allclose(
        attention(q, k, v), ops.sliding_window_attention(q, k, v, window=2, global_mask=global_mask)
    )
    assert torch.autograd.gradcheck(attention, (q, k, v), fast_mode=True)


def test_attend_blocks_returns_logsumexp_and_merges_disjoint_key_sets():
    """Attention over keys split into two gathered sets, merged by log-sum-exp, equals attention over all keys."""
    q, k, v = random_qkv(2, 3, 24)
    mask = torch.rand(2, 1, 24, 24, generator=torch.Generator().manual_seed(3)) > 0.5
    mask[0, 0, 5] = False  # a query that sees nothing
    q_blocks = q.view(2, 3, 4, 6, 8)  # [b, h, nb, c, d]
    first = torch.arange(0, 24, 2).expand(4, 12)  # [nb, m]: even keys for every block
    second = torch.arange(1, 24, 2).expand(4, 12)  # odd keys
    partials = [
        attend_blocks(q_blocks, k, v, kv_index=index, mask=mask[..., index[0]].view(2, 1, 4, 6, 12), scale=0.3)
        for index in (first, second)
    ]
    out, lse = merge_attention(partials)
    expected = ops.reference_attention(q, k, v, mask, scale=0.3)
    scores = (q @ k.transpose(-1, -2) * 0.3).masked_fill(~mask, -math.inf)
    torch.testing.assert_close(lse.reshape(2, 3, 24), torch.logsumexp(scores, dim=-1))
    assert_all_close(
        outputs_and_grads(
            lambda q, k, v: merge_attention(
                [
                    attend_blocks(
                        q.view(2, 3, 4, 6, 8),
                        k,
                        v,
                        kv_index=index,
                        mask=mask[..., index[0]].view(2, 1, 4, 6, 12),
                        scale=0.3,
                    )
                    for index in (first, second)
                ]
            )[0].reshape(2, 3, 24, 8),
            q,
            k,
            v,
        ),
        outputs_and_grads(lambda q, k, v: ops.reference_attention(q, k, v, mask, scale=0.3), q, k, v),
    )
    torch.testing.assert_close(out.reshape(2, 3, 24, 8), expected)


def test_sliding_window_picture_in_docstring_is_the_pattern():
    def draw(dilation):
        mask = patterns.materialize_mask(patterns.sliding_window_mask(2, dilation), batch=1, heads=1, q_len=7, kv_len=7)
        return [" ".join("■" if x else "⬚" for x in row) for row in mask[0, 0].tolist()]

    lines = [line.strip() for line in patterns.sliding_window_mask.__doc__.splitlines() if "■" in line]
    assert lines == [f"{left}        {right}" for left, right in zip(draw(1), draw(2), strict=True)]


def test_pattern_predicates_match_their_definition():
    window, dilation = 3, [1, 2]
    fn = patterns.sliding_window_mask(window, dilation)
    assert patterns.sliding_window_mask(4).__name__ == "sliding_window_4"
    mask = patterns.materialize_mask(fn, batch=1, heads=2, q_len=20, kv_len=20)
    for head, d in enumerate(dilation):
        for i in range(20):
            for j in range(20):
                assert bool(mask[0, head, i, j]) == (abs(i - j) <= window * d and abs(i - j) % d == 0)
    global_mask = torch.zeros(1, 20, dtype=torch.bool)
    global_mask[0, 10] = True
    full = patterns.materialize_mask(
        patterns.sliding_window_pattern(window=1, causal=True, global_mask=global_mask),
        batch=1,
        heads=1,
        q_len=20,
        kv_len=20,
    )[0, 0]
    assert full[10, :11].all() and not full[10, 11:].any()  # a global query still cannot see the future
    assert full[15, 10] and not full[5, 10]  # later queries see the global key, earlier ones do not


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(window=0), "window"),
        (dict(window=2.5), "window"),
        (dict(window=4, dilation=0), "dilation"),
        (dict(window=4, dilation=[1, 2, 3]), "dilation"),
        (dict(window=4, key_padding_mask=torch.ones(2, 9, dtype=torch.bool)), "key_padding_mask"),
        (dict(window=4, global_mask=torch.ones(3, 10, dtype=torch.bool)), "global_mask"),
        (dict(window=4, dropout_p=1.0), "dropout_p"),
    ],
)
def test_invalid_arguments_name_the_field(kwargs, field):
    q, k, v = random_qkv(2, 2, 10)
    with pytest.raises(ValueError, match=field):
        ops.sliding_window_attention(q, k, v, **kwargs)


def test_invalid_shapes_are_reported():
    q, k, v = random_qkv(2, 2, 10)
    q3, k3, v3 = random_qkv(2, 3, 10)
    with pytest.raises(ValueError, match="k must have shape"):  # 2 key/value heads do not divide 3 query heads
        ops.sliding_window_attention(q3, k3[:, :2], v3[:, :2], window=2)
    with pytest.raises(ValueError, match="v must have shape"):
        ops.sliding_window_attention(q, k[:, :1], v, window=2)
    with pytest.raises(ValueError, match="q has more positions"):  # causal queries are the last key positions
        ops.full_attention(q, k[:, :, :5], v[:, :, :5], causal=True)
    with pytest.raises(ValueError, match="key_padding_mask"):
        ops.full_attention(q, k, v, key_padding_mask=torch.ones(2, 11, dtype=torch.bool))
    with pytest.raises(ValueError, match="q_len"):
        patterns.materialize_mask(patterns.causal_mask(), batch=1, heads=1, q_len=-1, kv_len=3)


def test_and_or_masks_names_reach_and_empty_identity():
    """`and_masks` / `or_masks` share one fold: names after the parts, narrowest / widest reach, and the empty
    intersection sees everything while the empty union sees nothing."""
    window = patterns.sliding_window_mask(2)
    causal = patterns.causal_mask()
    both, either = patterns.and_masks(window, causal), patterns.or_masks(window, causal)
    assert both.__name__ == f"and({window.__name__}, causal)" and either.__name__ == f"or({window.__name__}, causal)"
    assert patterns.mask_reach(both) == patterns.mask_reach(window) and patterns.mask_reach(either) is None
    nothing, everything = patterns.or_masks(), patterns.and_masks()
    dense = {
        fn: patterns.materialize_mask(fn, batch=1, heads=1, q_len=5, kv_len=5)
        for fn in (window, causal, both, either, nothing, everything)
    }
    assert torch.equal(dense[both], dense[window] & dense[causal])
    assert torch.equal(dense[either], dense[window] | dense[causal])
    assert dense[everything].all() and not dense[nothing].any()
    for check, name in ((patterns.check_window, "window"), (patterns.check_stride, "stride")):
        assert check(3) == 3
        for bad in (0, True, 1.5):
            with pytest.raises(ValueError, match=f"{name} must be an int >= 1"):
                check(bad)


@pytest.mark.parametrize("causal, heads, kv_heads", [(False, 2, 2), (True, 4, 2)])
def test_fused_band_saves_no_mask(causal, heads, kv_heads, monkeypatch):
    """A plain band runs torch's fused CPU kernel and saves only O(n · d) tensors for backward (q, k, v, the output
    and its log-sum-exp), never a `[blocks, c, keys]` mask: it is evaluated again from the pattern in backward. Only
    the global queries' rows (g x n) keep a mask. The gradients still equal the dense reference's."""
    import longattn.executor_band as band

    n, window = 300, 40
    q, _, _ = random_qkv(2, heads, n, head_dim=16, dtype=torch.float32, seed=4)
    _, k, v = random_qkv(2, kv_heads, n, head_dim=16, dtype=torch.float32, seed=5)
    key_padding_mask, global_mask = _token_masks(2, n, padding=True, global_tokens=True)
    pattern = dict(window=window, causal=causal, global_mask=global_mask, key_padding_mask=key_padding_mask)
    calls, saved = [], []
    original = band._BandAttention.apply
    monkeypatch.setattr(band._BandAttention, "apply", lambda *args: calls.append(1) or original(*args))
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        actual = outputs_and_grads(lambda q, k, v: ops.sliding_window_attention(q, k, v, **pattern), q, k, v)
    assert calls == [1]
    assert all(t.numel() <= 2 * q.numel() for t in saved if t.dtype != torch.bool), [tuple(t.shape) for t in saved]
    assert all(t.numel() < n * window for t in saved if t.dtype == torch.bool), [tuple(t.shape) for t in saved]
    expected = outputs_and_grads(
        lambda q, k, v: ops.sliding_window_attention(q, k, v, backend="reference", **pattern),
        *(t.detach().double().requires_grad_() for t in (q, k, v)),
    )
    assert_all_close(actual, [t.float() for t in expected], atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("causal", [False, True])
def test_fused_band_reads_keys_in_place(causal, monkeypatch):
    """The fused band path reads the keys of blocks inside the sequence as strided views of k and v and writes their
    gradients straight into the key/value gradients: only the first and last chunks go through a small padded piece,
    so forward + backward allocate no padded O(n · d) copy of k, v or their gradients. With chunks of a few blocks
    (interior chunks read in place, edge chunks padded), the result is still exact (float64, outputs and gradients,
    padding, global tokens, grouped heads) and the peak of tensor bytes stays below 5 key-sized tensors."""
    from attention_checks import peak_tensor_bytes

    import longattn.executor_band as band

    monkeypatch.setattr(band, "_BAND_CHUNK_ELEMENTS", 2**12)
    n, window = 203, 9
    q, _, _ = random_qkv(2, 4, n, head_dim=8, seed=6)
    _, k, v = random_qkv(2, 2, n, head_dim=8, seed=7)
    key_padding_mask, global_mask = _token_masks(2, n, padding=True, global_tokens=True)
    pattern = dict(window=window, causal=causal, global_mask=global_mask, key_padding_mask=key_padding_mask)
    actual = outputs_and_grads(lambda q, k, v: ops.sliding_window_attention(q, k, v, **pattern), q, k, v)
    expected = outputs_and_grads(
        lambda q, k, v: _reference(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), **pattern), q, k, v
    )
    assert_all_close(actual, expected)

    # Peak memory: long enough that a key-sized tensor dwarfs a chunk's workspaces; q, k, v as the `[b, n, h, d]`
    # memory of projections, whose gradients must come back in that layout (else autograd copies them).
    n, window, d = 4096, 8, 16
    bases = [torch.randn(1, n, 2, d, requires_grad=True) for _ in range(3)]
    mask_fn = patterns.sliding_window_pattern(window=window, causal=causal)

    def step():
        q, k, v = (t.transpose(1, 2) for t in bases)
        out = banded_attention(
            q, k, v, mask_fn=mask_fn, window_left=window, window_right=window, scale=0.25, block_size=16
        )
        out.sum().backward()

    step()  # warm-up: first-call allocations of the profiler and autograd
    for t in bases:
        t.grad = None
    key_bytes = bases[0].numel() * bases[0].element_size()
    # Measured at this size: 4.6 key-sized tensors (q, k, v gradients, the output and its saved slot copy, chunk
    # workspaces); padded copies of k and v (forward, backward) and of their gradients took 6.5, key/value gradients
    # in another layout than k and v's 5.2.
    assert peak_tensor_bytes(step) < 5 * key_bytes


PLAIN_CASES = [
    # (batch, heads, kv_heads, n_q, n_k, window, causal, padding, global_tokens, layout)
    pytest.param(1, 2, 2, 203, 203, 9, False, False, False, "bhnd", id="n203-plain-only"),
    pytest.param(1, 2, 2, 203, 203, 9, True, False, False, "bnhd", id="n203-causal-projection-layout"),
    pytest.param(3, 2, 2, 203, 203, 9, False, True, True, "bnhd", id="n203-pad-global"),
    pytest.param(3, 4, 2, 203, 203, 9, True, True, True, "bhnd", id="n203-causal-pad-global-grouped"),
    pytest.param(2, 4, 1, 150, 150, 12, False, True, False, "bnhd", id="n150-pad-one-kv-head"),
    pytest.param(3, 2, 2, 70, 203, 9, True, True, True, "bhnd", id="queries-shorter-than-keys-causal"),
]


def _grouped_qkv(batch, heads, kv_heads, n_q, n_k, layout, generator):
    """Float64 q `[b, heads, n_q, 8]`, k and v `[b, kv_heads, n_k, 8]`, leaves; with `layout="bnhd"` they are
    transposed views of `[b, n, h, 8]` memory, as a projection's output is."""

    def draw(h, n):
        shape = (batch, h, n, 8) if layout == "bhnd" else (batch, n, h, 8)
        t = torch.randn(shape, generator=generator, dtype=torch.float64)
        return (t if layout == "bhnd" else t.transpose(1, 2)).detach().requires_grad_()

    return draw(heads, n_q), draw(kv_heads, n_k), draw(kv_heads, n_k)


def _assert_grouped_band_equals_reference(q, k, v, **pattern):
    """`ops.sliding_window_attention` on grouped heads equals the dense reference on k, v repeated to every query
    head: outputs and gradients."""
    groups = q.shape[1] // k.shape[1]
    actual = outputs_and_grads(lambda q, k, v: ops.sliding_window_attention(q, k, v, **pattern), q, k, v)
    expected = outputs_and_grads(
        lambda q, k, v: _reference(q, k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1), **pattern),
        q,
        k,
        v,
    )
    assert_all_close(actual, expected)


@pytest.mark.parametrize(
    "batch, heads, kv_heads, n_q, n_k, window, causal, padding, global_tokens, layout", PLAIN_CASES
)
def test_fused_plain_blocks_equal_reference(
    batch, heads, kv_heads, n_q, n_k, window, causal, padding, global_tokens, layout, monkeypatch
):
    """Blocks of a plain band whose keys hold no padding, global or out-of-range key (`_plain_blocks`) take one
    shared band mask and read their queries, output gradients and outputs as views; the others evaluate the
    predicate. Chunks of a few blocks mix both kinds. Outputs and gradients equal the dense reference (float64),
    with odd lengths, padding, global tokens, causal and not, grouped heads, and queries shorter than the keys."""
    import longattn.executor_band as band
    import longattn.executor_blocked as executor

    monkeypatch.setattr(executor, "_fused_block_size", lambda group: 8)
    monkeypatch.setattr(band, "_BAND_CHUNK_ELEMENTS", 2**11)
    classified = []
    original = executor._plain_blocks
    monkeypatch.setattr(executor, "_plain_blocks", lambda *args: classified.append(original(*args)) or classified[-1])
    generator = torch.Generator().manual_seed(n_q + heads)
    q, k, v = _grouped_qkv(batch, heads, kv_heads, n_q, n_k, layout, generator)
    key_padding_mask, global_mask = _token_masks(batch, n_k, padding=padding, global_tokens=global_tokens)
    pattern = dict(window=window, causal=causal, global_mask=global_mask, key_padding_mask=key_padding_mask)
    _assert_grouped_band_equals_reference(q, k, v, **pattern)
    (plain,) = classified
    flags = [flag for row in plain for flag in row]
    assert any(flags), "no block took the shared band mask"
    assert not all(flags), "the edge blocks must evaluate the predicate"


def test_plain_blocks_are_those_without_edge_padding_or_global_keys():
    """`_plain_blocks` on a known layout: 9 blocks of 4 queries, window 2 per side (blocks read 8 keys from 4 i - 2).
    Blocks 0 and 8 reach outside the sequence, block 8 also holds padding query slots (34 queries); a padding key at
    position 20 removes blocks 4 and 5 of row 0; a global key at position 9 removes blocks 1 and 2 of row 1."""
    from longattn.executor_band import _plain_blocks, band_layout

    layout = band_layout(q_len=34, kv_len=34, window_left=2, window_right=2, block_size=4)
    key_padding_mask = torch.ones(2, 34, dtype=torch.bool)
    key_padding_mask[0, 20] = False
    global_mask = torch.zeros(2, 34, dtype=torch.bool)
    global_mask[1, 9] = True
    plain = _plain_blocks(layout, -2, 34, 2, global_mask, key_padding_mask)
    assert plain == [
        [False, True, True, True, False, False, True, True, False],
        [False, False, False, True, True, True, True, True, False],
    ]
    assert _plain_blocks(layout, -2, 34, 2, None, None) == [[False] + [True] * 7 + [False]] * 2


def test_plain_blocks_evaluate_no_predicate(monkeypatch):
    """Only the blocks at the edges (and next to padding or global keys) evaluate the pattern predicate, in forward
    and backward; every other block takes the plan's one band mask (before, every chunk evaluated it twice)."""
    import longattn.executor_band as band

    monkeypatch.setattr(band, "_BAND_CHUNK_ELEMENTS", 1)  # one block per chunk
    evaluated = []
    original = band._BandPlan.local_bias
    monkeypatch.setattr(
        band._BandPlan, "local_bias", lambda self, *args: evaluated.append(args[1]) or original(self, *args)
    )
    q, k, v = random_qkv(1, 2, 160, seed=3)
    mask_fn = patterns.sliding_window_pattern(window=8)
    out = banded_attention(
        q, k, v, mask_fn=mask_fn, window_left=8, window_right=8, scale=0.5, block_size=8, exact_band=True
    )
    out.sum().backward()
    # 20 blocks, 24 keys each from 8 i - 8: only blocks 0 and 19 reach outside the sequence.
    assert sorted(evaluated) == [0, 0, 19, 19]
    assert_all_close(
        outputs_and_grads(
            lambda q, k, v: banded_attention(
                q, k, v, mask_fn=mask_fn, window_left=8, window_right=8, scale=0.5, block_size=8, exact_band=True
            ),
            q,
            k,
            v,
        ),
        outputs_and_grads(lambda q, k, v: dense_reference(mask_fn, q, k, v, scale=0.5), q, k, v),
    )


def test_a_wrong_shared_band_mask_is_detected(monkeypatch):
    """The plain-block comparisons can fail: a shared band mask one key too wide changes outputs and gradients."""
    import longattn.executor_band as band

    original = band._BandPlan.band_bias

    def one_key_too_wide(self, group, dtype):
        bias = original(self, group, dtype).clone()
        c, m = self.layout.q_pos.shape[1], self.layout.kv_pos.shape[1]
        bias[..., 0, m - c + 1] = 0.0  # the first query of a block sees one key past its window
        return bias

    q, k, v = random_qkv(1, 2, 203, seed=8)
    pattern = dict(window=9)
    expected = _reference(q, k, v, **pattern)
    torch.testing.assert_close(ops.sliding_window_attention(q, k, v, **pattern), expected)
    monkeypatch.setattr(band._BandPlan, "band_bias", one_key_too_wide)
    assert not torch.allclose(ops.sliding_window_attention(q, k, v, **pattern), expected)


def test_fused_path_runs_global_queries_on_the_fused_kernel(monkeypatch):
    """On the fused path the global queries' dense rows are computed inside `_BandAttention` (products head by head,
    k and v read in place, grouped heads without repeating them), not by `attend_blocks`; outputs and gradients still
    equal the dense reference (float64, padding, a fully padded row holding a global token, causal)."""
    import longattn.executor_blocked as executor

    monkeypatch.setattr(executor, "attend_blocks", lambda *args, **kw: pytest.fail("attend_blocks was called"))
    q, _, _ = random_qkv(3, 4, 101, seed=9)
    _, k, v = random_qkv(3, 2, 101, seed=10)
    key_padding_mask, global_mask = _token_masks(3, 101, padding=True, global_tokens=True)
    pattern = dict(window=7, causal=True, global_mask=global_mask, key_padding_mask=key_padding_mask)
    actual = outputs_and_grads(lambda q, k, v: ops.sliding_window_attention(q, k, v, **pattern), q, k, v)
    expected = outputs_and_grads(
        lambda q, k, v: _reference(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), **pattern), q, k, v
    )
    assert_all_close(actual, expected)


def test_fused_plain_blocks_in_half_precision(monkeypatch):
    """bfloat16 inputs on the plain-block path (queries and keys copied into float32 workspaces, no views): close to
    the float64 reference, with padding and a global token."""
    import longattn.executor_blocked as executor

    monkeypatch.setattr(executor, "_fused_block_size", lambda group: 8)
    q, k, v = random_qkv(2, 2, 203, dtype=torch.bfloat16, seed=11)
    key_padding_mask, global_mask = _token_masks(2, 203, padding=True, global_tokens=True)
    pattern = dict(window=9, global_mask=global_mask, key_padding_mask=key_padding_mask)
    actual = outputs_and_grads(lambda q, k, v: ops.sliding_window_attention(q, k, v, **pattern), q, k, v)
    expected = outputs_and_grads(
        lambda q, k, v: _reference(q, k, v, **pattern), *(t.detach().double().requires_grad_() for t in (q, k, v))
    )
    assert_all_close([t.double() for t in actual], expected, atol=3e-2, rtol=3e-2)


GLOBAL_QUERY_CASES = [
    # (batch, heads, kv_heads, n_q, n_k, window, causal, padding, layout, global positions per row)
    pytest.param(2, 2, 2, 203, 203, 9, False, False, "bnhd", [[0], [0, 1, 2, 101, 202]], id="n203-many-adjacent"),
    pytest.param(3, 4, 2, 151, 151, 7, True, True, "bhnd", [[5], [0, 75, 150], [9]], id="n151-causal-pad-grouped"),
    pytest.param(3, 6, 2, 97, 97, 12, False, True, "bnhd", [[], [0, 96], [40]], id="n97-pad-grouped-no-global-row"),
    pytest.param(2, 4, 1, 60, 181, 8, True, True, "bhnd", [[3, 150], [170, 180]], id="queries-shorter-key-only"),
    pytest.param(2, 2, 2, 181, 181, 8, False, False, "bhnd", [[], []], id="no-global-token-at-all"),
]


@pytest.mark.parametrize(
    "batch, heads, kv_heads, n_q, n_k, window, causal, padding, layout, positions", GLOBAL_QUERY_CASES
)
def test_fused_path_computes_global_tokens_inside_the_band(
    batch, heads, kv_heads, n_q, n_k, window, causal, padding, layout, positions, monkeypatch
):
    """With one head group the fused band path computes the global queries' dense rows itself (written over the band's
    rows in its output, their key/value gradients added in place, the band's rows getting no gradient) instead of
    `_global_queries` outside; the global keys' mask is evaluated once per pass. Outputs and gradients equal the dense
    reference (float64): several global tokens per row (adjacent, at both ends), rows with none, padding and a fully
    padded row holding a global token, causal and not, grouped heads, projection-layout q/k/v, global tokens before
    the first query (keys only), and blocks of 8 in chunks of 2."""
    import longattn.executor_band as band
    import longattn.executor_blocked as executor

    monkeypatch.setattr(executor, "_fused_block_size", lambda group: 8)
    monkeypatch.setattr(band, "_BAND_CHUNK_ELEMENTS", 2**11)
    monkeypatch.setattr(executor, "_global_queries", lambda *args: pytest.fail("_global_queries was called"))
    monkeypatch.setattr(executor, "attend_blocks", lambda *args, **kw: pytest.fail("attend_blocks was called"))
    generator = torch.Generator().manual_seed(n_k + heads)
    q, k, v = _grouped_qkv(batch, heads, kv_heads, n_q, n_k, layout, generator)
    key_padding_mask, _ = _token_masks(batch, n_k, padding=padding, global_tokens=False)
    global_mask = torch.zeros(batch, n_k, dtype=torch.bool)
    for row, row_positions in enumerate(positions):
        global_mask[row, row_positions] = True
    pattern = dict(window=window, causal=causal, global_mask=global_mask, key_padding_mask=key_padding_mask)
    _assert_grouped_band_equals_reference(q, k, v, **pattern)


def test_global_query_rows_replace_the_band_rows():
    """A global query's row is its dense row over every key, not merged with the band's own result for that row:
    checked directly (window 2 of 64 keys, where the band alone would differ), outputs and gradients."""
    q, k, v = random_qkv(1, 2, 64, seed=12)
    global_mask = torch.zeros(1, 64, dtype=torch.bool)
    global_mask[0, 30] = True

    def row_30(q, k, v):
        return ops.sliding_window_attention(q, k, v, window=2, global_mask=global_mask)[:, :, 30:31]

    def dense_row_30(q, k, v):
        return torch.softmax(q[:, :, 30:31] @ k.transpose(2, 3) / math.sqrt(8), dim=-1) @ v  # [1, h, 1, d]

    assert_all_close(outputs_and_grads(row_30, q, k, v), outputs_and_grads(dense_row_30, q, k, v))


def test_band_chunks_stay_within_an_eighth_of_the_keys():
    """Chunks hold at most `_BAND_CHUNK_ELEMENTS` key-gradient elements and at most an eighth of q's (one batch row),
    but never fewer than 2 blocks; plain and edge blocks never share a chunk."""
    from longattn.executor_band import _BAND_CHUNK_ELEMENTS, _band_chunks

    def sizes(nb, per_block, query_elements, plain=None):
        return [stop - start for start, stop in _band_chunks(nb, per_block, plain, query_elements)]

    per_block = 4 * 576 * 64  # 4 key/value heads, w = 256 per side, blocks of 64, head dim 64
    assert max(sizes(256, per_block, 16384 * 4 * 64)) == 3  # 16K queries on 4 heads: an eighth of q is 3.6 blocks
    assert max(sizes(256, per_block, 16384 * 16 * 64)) == 7  # 16 query heads on 4 key/value heads: the cap
    assert max(sizes(64, 12 * 576 * 64, 4096 * 12 * 64)) == 2  # an eighth would be under 1 block: 2
    assert max(sizes(4096, per_block, 2**22 * 4 * 64)) == _BAND_CHUNK_ELEMENTS // per_block  # the cap
    chunks = list(_band_chunks(10, 100, [[False] + [True] * 8 + [False]], 1000))  # an eighth: 1.25 blocks
    assert chunks == [(0, 1), (1, 3), (3, 5), (5, 7), (7, 9), (9, 10)]


# ------------------------------------------------------------------------------------------ the saved block mask
@pytest.mark.parametrize("causal", [False, True])
def test_a_dilated_band_keeps_one_block_of_its_mask_and_equals_the_reference(causal, monkeypatch):
    """A dilated band (`attend_blocks` with a mask tensor) keeps, for backward, its repeated block and the blocks at
    the edges, beside padding and beside global keys (`_RepeatedBlockMask`), not the [b, h, nb, c, m] mask; the
    rebuilt mask gives the reference's outputs and gradients (float64, padding, global tokens, odd length)."""
    batch, heads, length, window, block = 3, 2, 601, 5, 16
    q, k, v = random_qkv(batch, heads, length, seed=11)
    key_padding_mask, global_mask = _token_masks(batch, length, padding=True, global_tokens=True)
    pattern = dict(window=window, dilation=2, causal=causal, global_mask=global_mask, key_padding_mask=key_padding_mask)

    def blocked(q, k, v):
        return banded_attention(
            q,
            k,
            v,
            mask_fn=patterns.sliding_window_pattern(**pattern),
            window_left=window,
            window_right=0 if causal else window,
            dilation=2,
            global_mask=global_mask,
            scale=q.shape[-1] ** -0.5,
            block_size=block,
        )

    assert_all_close(
        outputs_and_grads(blocked, q, k, v), outputs_and_grads(lambda q, k, v: _reference(q, k, v, **pattern), q, k, v)
    )
    _, kept = saved_tensor_bytes(lambda: blocked(q, k, v))
    monkeypatch.setattr(_RepeatedBlockMask, "compress", staticmethod(lambda mask: None))
    _, whole = saved_tensor_bytes(lambda: blocked(q, k, v))
    layout = band_layout(
        q_len=length, kv_len=length, window_left=window, window_right=0 if causal else window, dilation=2,
        block_size=block,
    )  # fmt: skip
    mask_bytes = batch * layout.kv_pos.numel() * block + batch * layout.q_pos.numel() * 3  # band keys + 3 global slots
    assert whole - kept > 2 / 3 * mask_bytes, (whole, kept, mask_bytes)


def test_the_repeated_block_mask_rebuilds_every_chunk_exactly():
    generator = torch.Generator().manual_seed(0)
    band = torch.rand(2, 1, 1, 8, 12, generator=generator) > 0.5
    mask = band.expand(2, 1, 40, 8, 12).clone()
    mask[0, 0, [0, 1, 17]] = torch.rand(3, 8, 12, generator=generator) > 0.5  # edges, a padding boundary
    mask[0, 0, 2:17] = False  # inside row 0's padding: no key
    mask[1, 0, 39, 3] = ~mask[1, 0, 39, 3]
    template, differs, empty, stored_blocks = _RepeatedBlockMask.compress(mask)
    assert differs.flatten(0, 1).any(0).nonzero().flatten().tolist() == [*range(18), 39]
    assert stored_blocks.shape == (4, 8, 12)  # the padded blocks are kept as a flag only
    rebuilt = _RepeatedBlockMask(template, differs, empty, stored_blocks)
    for start, stop in [(0, 40), (0, 1), (1, 18), (17, 18), (18, 39), (39, 40), (5, 9), (20, 30)]:
        assert torch.equal(rebuilt(start, stop), mask[:, :, start:stop]), (start, stop)
    # A mask whose blocks mostly differ is kept as it is.
    assert _RepeatedBlockMask.compress(torch.rand(1, 1, 40, 8, 12, generator=generator) > 0.5) is None
