"""The xformers path's mask translation, on CPU, with xformers' own `attn_bias` objects: what the path BUILDS when
`longattn.ops` runs with `backend="xformers"` is captured (the layouts given to `run_layout`, the biases given to the
kernel) and, materialised (`materialize()` of every bias, scattered back to positions), must equal
`patterns.materialize_mask` of the pattern predicate: padding, causal, window, dilation, global tokens, strided and
fixed blocks, block-diagonal buckets.

xformers' kernels need a GPU, its bias classes do not: the kernel is `ReferenceKernel` (the `reference_kernel`
fixture), which materialises the very bias objects it receives, so the calls also run end to end.
"""

from __future__ import annotations

import pytest
import torch
from attention_checks import padding_and_global_masks, random_qkv, sliding_window_case

from longattn import executor_xformers, ops, patterns

B, H, N, D = 3, 4, 23, 8
SCALE = 0.3


@pytest.fixture
def layouts(monkeypatch, reference_kernel):
    """`(layout, n_q, n_k)` of every layout the xformers path runs, in order (it still runs)."""
    seen = []
    run_layout = executor_xformers.run_layout

    def spy(q, k, v, layout, **kwargs):
        seen.append((layout, q.shape[2], k.shape[2]))
        return run_layout(q, k, v, layout, **kwargs)

    monkeypatch.setattr(executor_xformers, "run_layout", spy)
    return seen


@pytest.fixture
def kernel_biases(reference_kernel, monkeypatch):
    """`(q, bias)` of every `attention` call of the kernel: the `[B, M, H, K]` queries and the bias object."""
    seen = []
    attention = reference_kernel.attention

    def spy(q, k, v, attn_bias, **kwargs):
        seen.append((q.detach(), attn_bias))
        return attention(q, k, v, attn_bias, **kwargs)

    monkeypatch.setattr(reference_kernel, "attention", spy)
    return seen


def _assert_built_layout_is_the_pattern(layouts, mask_fn, *, roll=None):
    """The one layout the call built, materialised, equals the predicate's mask, and covers each key at most once.

    `roll`: long `[b]`, rows were rolled left by this many positions before the layout was built."""
    assert len(layouts) == 1, f"expected one layout, the path built {len(layouts)}"
    layout, n_q, n_k = layouts[0]
    for part in layout.parts + layout.overrides:
        assert part.bias is None or isinstance(part.bias, executor_xformers._attn_bias().AttentionBias)
    mask, count = executor_xformers.materialize_layout(layout, executor_xformers.LayoutGrid(B, H, n_q, n_k))
    expected = patterns.materialize_mask(mask_fn, batch=B, heads=H, q_len=n_q, kv_len=n_k, q_offset=n_k - n_q)
    if roll is not None:  # slot s of row b holds position (s + roll[b]) mod n
        index = (torch.arange(n_k)[None, :] + roll[:, None]) % n_k  # [b, n]
        expected = expected.gather(2, index[:, None, :, None].expand(B, H, n_k, n_k))
        expected = expected.gather(3, index[:, None, None, :].expand(B, H, n_k, n_k))
    assert torch.equal(mask, expected), f"differs at {(mask != expected).nonzero()[:8].tolist()}"
    assert int(count.max()) <= 1, "parts overlap: a log-sum-exp merge would count a key twice"


# ---------------------------------------------------------------------------------------------- sliding window
@pytest.mark.parametrize(
    ("n_q", "causal", "dilation", "masks"),
    [
        (N, False, 1, "none"),
        (N, True, 1, "padding"),
        (N, False, 2, "padding"),
        (N, True, 3, "global"),
        (N, False, [1, 2, 3, 2], "padding+global"),
        (N, True, [1, 2, 3, 2], "padding+global"),
        (5, True, 2, "padding+global"),
        (1, False, 1, "padding"),
    ],
)
def test_sliding_window_layout_built_by_ops_is_the_pattern(layouts, n_q, causal, dilation, masks):
    pattern = sliding_window_case(B, N, masks, dilation=dilation, causal=causal)
    q, k, v = random_qkv(B, H, n_q, D, n_k=N, requires_grad=False)
    ops.sliding_window_attention(q, k, v, scale=SCALE, backend="xformers", **pattern)
    _assert_built_layout_is_the_pattern(layouts, patterns.sliding_window_pattern(**pattern))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dilation", [2, 3])
def test_dilated_band_on_residue_views_is_the_pattern(kernel_biases, causal, dilation):
    """n a multiple of the dilation, no padding: one band bias over class steps, the classes read in place."""
    n = 24
    q, k, v = random_qkv(B, H, n, D, requires_grad=False)
    ops.sliding_window_attention(q, k, v, window=2, dilation=dilation, causal=causal, scale=SCALE, backend="xformers")
    assert len(kernel_biases) == B  # one call per batch row
    _, band = kernel_biases[0]
    assert isinstance(band, executor_xformers._attn_bias().LocalAttentionFromBottomRightMask)
    steps = n // dilation
    in_class = torch.isfinite(band.materialize((steps, steps)))  # [steps, steps], over class steps
    position = torch.arange(n)
    residue, step = position % dilation, position // dilation
    built = (residue[:, None] == residue[None, :]) & in_class[step[:, None], step[None, :]]
    expected = patterns.materialize_mask(
        patterns.sliding_window_pattern(window=2, dilation=dilation, causal=causal), batch=1, heads=1, q_len=n, kv_len=n
    )[0, 0]
    assert torch.equal(built, expected)


# ---------------------------------------------------------------------------------------------- strided and fixed
@pytest.mark.parametrize("stride", [1, 3, 5])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("padding", [False, True])
def test_strided_layout_built_by_ops_is_the_pattern(layouts, stride, causal, padding):
    key_padding_mask = padding_and_global_masks(B, N)[0] if padding else None
    q, k, v = random_qkv(B, H, N, D, requires_grad=False)
    ops.strided_attention(
        q, k, v, stride=stride, causal=causal, key_padding_mask=key_padding_mask, scale=SCALE, backend="xformers"
    )
    _assert_built_layout_is_the_pattern(
        layouts, patterns.strided_pattern(stride=stride, causal=causal, key_padding_mask=key_padding_mask)
    )


@pytest.mark.parametrize(("block_size", "num_summary", "summary_per_head"), [(5, 2, False), (6, 2, True), (4, 1, True)])
@pytest.mark.parametrize(
    ("causal", "padding"),
    [(False, False), (True, False), (False, True)],
    ids=["bidirectional", "causal", "bidirectional-padding"],
)
def test_fixed_layout_built_by_ops_is_the_pattern(layouts, block_size, num_summary, summary_per_head, causal, padding):
    key_padding_mask = padding_and_global_masks(B, N)[0] if padding else None
    kwargs = dict(
        block_size=block_size,
        num_summary=num_summary,
        summary_per_head=summary_per_head,
        causal=causal,
        key_padding_mask=key_padding_mask,
    )
    q, k, v = random_qkv(B, H, N, D, requires_grad=False)
    ops.fixed_attention(q, k, v, scale=SCALE, backend="xformers", **kwargs)
    # Left-padded rows are rolled to their first real token first: the layout's blocks from 0 are the pattern's
    # blocks from the first real token.
    roll = patterns.first_real_token(key_padding_mask) if padding else None
    _assert_built_layout_is_the_pattern(layouts, patterns.fixed_pattern(**kwargs), roll=roll)


# ---------------------------------------------------------------------------------------------- full
@pytest.mark.parametrize(("n_q", "causal"), [(N, False), (N, True), (4, True)])
def test_full_layout_built_by_ops_is_the_pattern(layouts, n_q, causal):
    key_padding_mask, _ = padding_and_global_masks(B, N)
    q, k, v = random_qkv(B, H, n_q, D, n_k=N, requires_grad=False)
    ops.full_attention(q, k, v, causal=causal, key_padding_mask=key_padding_mask, scale=SCALE, backend="xformers")
    parts = [patterns.key_padding_predicate(key_padding_mask)] + ([patterns.causal_mask()] if causal else [])
    _assert_built_layout_is_the_pattern(layouts, patterns.and_masks(*parts))


# ---------------------------------------------------------------------------------------------- block-diagonal
@pytest.mark.parametrize("causal", [False, True])
def test_bucketed_attention_builds_a_block_diagonal_of_same_bucket_keys(kernel_biases, causal):
    """The `BlockDiagonalMask` the executor builds, un-sorted by the slots' original positions (read from the
    queries it handed the kernel, which carry their flat index), is "same (row, head) and same bucket"."""
    b, h, n = 2, 3, 17
    buckets = torch.randint(0, 5, (b, h, n), generator=torch.Generator().manual_seed(0))
    flat = torch.arange(b * h * n, dtype=torch.float64).view(b, h, n, 1)
    q = torch.cat([flat, torch.zeros(b, h, n, 7, dtype=torch.float64)], dim=-1)  # q[..., 0] = flat index
    executor_xformers.bucketed_attention(q, q, q, buckets=buckets, causal=causal, scale=SCALE)
    ((sorted_q, blocks),) = kernel_biases
    assert isinstance(blocks, executor_xformers._attn_bias().BlockDiagonalMask)
    order = sorted_q[0, :, 0, 0].long()  # the flat index of each sorted slot
    assert torch.equal(order.sort().values, torch.arange(b * h * n))
    sorted_visible = torch.isfinite(blocks.materialize((order.numel(), order.numel())))
    visible = torch.zeros_like(sorted_visible)
    visible[order[:, None], order[None, :]] = sorted_visible
    row = torch.arange(b * h * n) // n
    position = torch.arange(b * h * n) % n
    bucket = buckets.reshape(-1)
    expected = (row[:, None] == row[None, :]) & (bucket[:, None] == bucket[None, :])
    if causal:
        expected &= position[None, :] <= position[:, None]
    assert torch.equal(visible, expected)
