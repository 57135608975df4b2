"""Back ends and their dispatcher: choices and reasons, the xformers mapping, FlexAttention on CPU.

Runs on CPU. The xformers layouts are checked twice: their bias objects, materialised, must equal the dense mask of
the SAME pattern predicate (every (query, key) covered at most once, so log-sum-exp merges count each key once);
and the whole xformers path (permutations, merges, hidden-key column, merged backward) runs end to end with its
kernel replaced by `ReferenceKernel`, a dense implementation of the same `[B, M, H, K]` contract, and must equal
`ops.reference_attention` in float64, outputs and gradients. Tests marked `gpu` run the real kernels and skip
themselves without CUDA.
"""

from __future__ import annotations

import logging
import math
import re

import pytest
import torch
from attention_checks import (
    assert_all_close,
    outputs_and_grads,
    padding_and_global_masks,
    random_qkv,
    sliding_window_case,
    xformers_reasons,
)
from kind_configs import tiny_config

from longattn import LongAttnConfig, backends, executor_flex, executor_xformers, ops, patterns
from longattn.attention_registry import ATTENTION_CLASSES
from longattn.backends import AttentionRequest, select_backend
from longattn.modeling_longattn import LongAttnModel

B, H, N, D = 3, 4, 23, 8
SCALE = 0.3


def _request(**fields) -> AttentionRequest:
    """A float32 sliding-window request on CPU: 2 rows of 4 heads of 64, 1,024 queries and keys; `fields` over it."""
    sizes = dict(head_dim=64, value_head_dim=64, q_len=1024, kv_len=1024, batch=2, heads=4)
    return AttentionRequest(**{"pattern": "sliding", "device": "cpu", "dtype": torch.float32, **sizes, **fields})


def _qkv(n_q=N, n_k=N, dtype=torch.float64, seed=0):
    return random_qkv(B, H, n_q, D, n_k=n_k, dtype=dtype, seed=seed)


def _reference_fn(mask_fn, n_q=N, n_k=N, heads=H):
    mask = patterns.materialize_mask(mask_fn, batch=B, heads=heads, q_len=n_q, kv_len=n_k, q_offset=n_k - n_q)
    return lambda q, k, v: ops.reference_attention(q, k, v, mask, scale=SCALE)


# ---------------------------------------------------------------------------------------------- the dispatcher
def test_unknown_backend_name_lists_the_allowed_ones():
    with pytest.raises(ValueError, match=r"'cuda'.*'auto', 'reference', 'torch', 'flex', 'xformers', 'triton'"):
        select_backend("cuda", _request())
    with pytest.raises(ValueError, match="attention_backend"):
        LongAttnConfig(attention_type="sliding", attention_backend="cuda")
    assert LongAttnConfig(attention_type="sliding").attention_backend == "auto"
    # The Triton kernels compute the sliding window only: other kinds refuse them at config time.
    assert LongAttnConfig(attention_type="sliding", attention_backend="triton").attention_backend == "triton"
    with pytest.raises(ValueError, match=r"`attention_backend`='triton' cannot run `attention_type`='strided'"):
        LongAttnConfig(attention_type="strided", attention_backend="triton")


@pytest.mark.parametrize("pattern", ["full", "sliding", "strided", "fixed"])
@pytest.mark.parametrize("requires_grad", [False, True])
def test_auto_on_cpu_is_the_torch_executor(pattern, requires_grad):
    assert select_backend("auto", _request(pattern=pattern, requires_grad=requires_grad)) == "torch"


def test_explicit_backend_that_cannot_run_raises_with_its_reasons(monkeypatch):
    with pytest.raises(ValueError, match=r"'xformers' cannot run.*device 'cpu' is not supported \(needs cuda\)"):
        select_backend("xformers", _request())
    with pytest.raises(ValueError, match="no backward on CPU"):
        select_backend("flex", _request(requires_grad=True))
    with pytest.raises(ValueError, match="no attention dropout"):
        select_backend("flex", _request(dropout=True))
    monkeypatch.setattr(backends, "xformers_unavailable_reasons", lambda: ["xformers is not installed (pip ...)"])
    with pytest.raises(ValueError, match="not installed"):
        select_backend("xformers", _request(device="cuda"))
    # Back ends that can run are returned as asked, the reference and FlexAttention forward included.
    assert select_backend("reference", _request(requires_grad=True)) == "reference"
    assert select_backend("flex", _request()) == "flex"
    assert select_backend("torch", _request(dropout=True)) == "torch"


def test_select_named_backend_keeps_auto_on_torch_and_checks_a_named_one(monkeypatch):
    """The kinds not yet measured on another back end (routing, Sinkhorn): "auto" is the PyTorch executor without a
    request being built; a named back end is checked against the call's request, with its reasons."""
    q, k, v = random_qkv(1, 2, 8, 4, seed=0)
    monkeypatch.setattr(AttentionRequest, "for_inputs", None)  # "auto" must not build a request
    assert backends.select_named_backend("auto", q, k, v, pattern="windows", causal=False) == "torch"
    monkeypatch.undo()
    assert backends.select_named_backend("reference", q, k, v, pattern="sinkhorn", causal=True) == "reference"
    with pytest.raises(ValueError, match=r"'xformers' cannot run this 'windows' attention on cpu"):
        backends.select_named_backend("xformers", q, k, v, pattern="windows", dropout_p=0.1, key_padding=True)


def test_xformers_declares_what_its_layouts_cannot_serve():
    def reasons(**fields):  # one row of 64 bf16 queries and keys, no dropout, padding or global token
        return xformers_reasons(_request(device="cuda", dtype=torch.bfloat16, q_len=64, kv_len=64, batch=1), **fields)

    assert reasons() == []
    assert reasons(dropout=True) == []  # one band call: xformers' own autograd kernel has dropout
    assert any("float64" in r for r in reasons(dtype=torch.float64))
    assert any("multiple of 8" in r for r in reasons(head_dim=12))
    assert any("hidden-key flag" in r for r in reasons(head_dim=256, key_padding=True))
    assert any("value head dim" in r for r in reasons(value_head_dim=32))
    assert any("dropout" in r for r in reasons(dropout=True, global_tokens=True))
    assert any("as many queries as keys" in r for r in reasons(pattern="strided", q_len=1))
    assert any("first real token" in r for r in reasons(pattern="fixed", causal=True, key_padding=True))


def test_auto_on_cuda_prefers_xformers_then_flex_then_torch(monkeypatch):
    monkeypatch.setattr(backends, "xformers_unavailable_reasons", lambda: [])
    monkeypatch.setattr(backends, "xformers_probe_reasons", lambda *args, **kwargs: [])
    monkeypatch.setattr(backends, "flex_unavailable_reasons", lambda: [])
    cuda = dict(device="cuda", dtype=torch.bfloat16, requires_grad=True)
    assert select_backend("auto", _request(**cuda, dilation=4)) == "xformers"
    assert select_backend("auto", _request(**cuda, dilation=(1, 2, 4, 8), global_tokens=True)) == "xformers"
    assert select_backend("auto", _request(**cuda, key_padding=True)) == "xformers"
    # A plain band is FlexAttention's (measured faster); with dropout, which Flex lacks, it goes back to xformers.
    assert select_backend("auto", _request(**cuda)) == "flex"
    assert select_backend("auto", _request(**cuda, dilation=(1, 1, 1, 1))) == "flex"
    assert select_backend("auto", _request(**cuda, dropout=True)) == "xformers"
    # Dense attention without padding stays on SDPA; with padding xformers skips the padded keys.
    assert select_backend("auto", _request(**cuda, pattern="full")) == "torch"
    assert select_backend("auto", _request(**cuda, pattern="full", key_padding=True)) == "xformers"
    # A head dim xformers cannot take falls back to FlexAttention, dropout on a merged layout to the executor.
    assert select_backend("auto", _request(**cuda, head_dim=12, value_head_dim=12)) == "flex"
    assert select_backend("auto", _request(**cuda, dropout=True, key_padding=True)) == "torch"
    # A GPU whose xformers kernels fail their smoke test is passed over, and says why when asked explicitly.
    monkeypatch.setattr(backends, "xformers_probe_reasons", lambda *args, **kwargs: ["xformers local band failed"])
    assert select_backend("auto", _request(**cuda, dilation=4)) == "flex"
    with pytest.raises(ValueError, match="local band failed"):
        select_backend("xformers", _request(**cuda))


def test_auto_logs_its_choice_once(caplog, monkeypatch):
    monkeypatch.setattr(backends, "_LOGGED", set())
    with caplog.at_level(logging.INFO, logger="longattn.backends"):
        for _ in range(3):
            select_backend("auto", _request())
    records = [r for r in caplog.records if r.name == "longattn.backends"]
    assert len(records) == 1
    assert "'torch'" in records[0].getMessage() and "xformers:" in records[0].getMessage()


def test_default_backend_keeps_the_cpu_executor_exactly():
    q, k, v = _qkv(dtype=torch.float32)
    key_padding_mask, global_mask = padding_and_global_masks(B, N)
    kwargs = dict(
        window=2, dilation=[1, 2, 3, 2], key_padding_mask=key_padding_mask, global_mask=global_mask, scale=SCALE
    )
    torch.testing.assert_close(
        ops.sliding_window_attention(q, k, v, **kwargs),
        ops.sliding_window_attention(q, k, v, backend="torch", **kwargs),
        rtol=0,
        atol=0,
    )
    torch.testing.assert_close(
        ops.full_attention(q, k, v, causal=True),
        ops.full_attention(q, k, v, causal=True, backend="torch"),
        rtol=0,
        atol=0,
    )


@pytest.mark.parametrize("kind", ["sliding", "full"])
def test_config_backend_reaches_the_kinds(kind):
    def model(backend):
        torch.manual_seed(0)
        config = tiny_config(kind, max_position_embeddings=64, sliding_window=3, attention_backend=backend)
        return LongAttnModel(config).eval()

    input_ids = torch.randint(3, 50, (2, 20), generator=torch.Generator().manual_seed(0))
    attention_mask = torch.ones(2, 20, dtype=torch.long)
    attention_mask[1, 15:] = 0
    with torch.no_grad():
        expected = model("torch")(input_ids, attention_mask=attention_mask).last_hidden_state
        for backend in ("auto", "reference", "flex"):
            actual = model(backend)(input_ids, attention_mask=attention_mask).last_hidden_state
            torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)
        with pytest.raises(ValueError, match="'xformers' cannot run"):
            model("xformers")(input_ids, attention_mask=attention_mask)


@pytest.mark.parametrize("kind", sorted(ATTENTION_CLASSES))
def test_a_kind_refuses_a_backend_it_cannot_run_at_config_time(kind):
    gpu_paths = {
        "full": {"flex", "xformers"},
        "sliding": {"flex", "xformers", "triton"},
        "strided": {"flex", "xformers"},
        "fixed": {"flex", "xformers"},
        "sinkhorn": {"xformers"},
        "lsh": {"xformers"},
        "routing": {"xformers"},
    }.get(kind, set())
    assert set(ATTENTION_CLASSES[kind].backends) == {"auto", "torch", "reference"} | gpu_paths
    for backend in ("auto", "torch", "reference"):
        LongAttnConfig(attention_type=kind, attention_backend=backend)
    for backend in ("flex", "xformers", "triton"):
        if backend in gpu_paths:
            LongAttnConfig(attention_type=kind, attention_backend=backend)
        else:
            message = f"`attention_backend`='{backend}' cannot run `attention_type`='{kind}'"
            with pytest.raises(ValueError, match=message):
                LongAttnConfig(attention_type=kind, attention_backend=backend)


@pytest.mark.parametrize("kind", ["lsh", "sinkhorn", "efficient"])
def test_reference_backend_runs_a_kinds_dense_form(kind):
    def model(backend):
        torch.manual_seed(0)
        config = tiny_config(
            kind,
            max_position_embeddings=64,
            attention_backend=backend,
            lsh_bucket_size=4,
            lsh_seed=0,
            sinkhorn_block_size=4,
        )
        return LongAttnModel(config).eval()

    input_ids = torch.randint(3, 50, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        dense = model("auto")(input_ids, output_attentions=True).last_hidden_state  # the dense form, by request
        reference = model("reference")(input_ids).last_hidden_state
        fast = model("auto")(input_ids).last_hidden_state
    torch.testing.assert_close(reference, dense, rtol=0, atol=0)
    torch.testing.assert_close(reference, fast, rtol=1e-4, atol=1e-4)


# ---------------------------------------------------------------------------------------------- FlexAttention
@pytest.mark.parametrize(
    ("n_q", "causal", "dilation", "masks"),
    [
        (N, False, 1, "none"),
        (N, True, 1, "padding"),
        (N, False, 3, "padding"),
        (N, True, 3, "none"),
        (N, False, [1, 2, 3, 2], "padding+global"),
        (N, True, [1, 2, 3, 2], "padding+global"),
        (5, True, 1, "padding+global"),
        (5, False, 2, "padding"),
    ],
)
def test_flex_forward_on_cpu_equals_the_reference(n_q, causal, dilation, masks):
    q, k, v = (t.detach() for t in _qkv(n_q=n_q))
    pattern = sliding_window_case(B, N, masks, dilation=dilation, causal=causal)
    expected = _reference_fn(patterns.sliding_window_pattern(**pattern), n_q=n_q)(q, k, v)
    actual = ops.sliding_window_attention(q, k, v, scale=SCALE, backend="flex", **pattern)
    torch.testing.assert_close(actual, expected, rtol=1e-10, atol=1e-10)


def test_flex_full_attention_and_block_mask_cache():
    q, k, v = (t.detach() for t in _qkv())
    key_padding_mask, _ = padding_and_global_masks(B, N)
    for causal in (False, True):
        parts = [patterns.key_padding_predicate(key_padding_mask)] + ([patterns.causal_mask()] if causal else [])
        expected = _reference_fn(patterns.and_masks(*parts))(q, k, v)
        actual = ops.full_attention(
            q, k, v, causal=causal, key_padding_mask=key_padding_mask, scale=SCALE, backend="flex"
        )
        torch.testing.assert_close(actual, expected, rtol=1e-10, atol=1e-10)
    executor_flex.clear_block_mask_cache()
    mask_fn = patterns.sliding_window_pattern(window=2, causal=True)
    grid = dict(batch=None, heads=None, q_len=N, kv_len=N, device=q.device, cache_key=mask_fn.__name__)
    first = executor_flex.block_mask(mask_fn, **grid)
    again = executor_flex.block_mask(patterns.sliding_window_pattern(window=2, causal=True), **grid)  # same key
    assert again is first


# ---------------------------------------------------------------------------------------------- xformers layouts
def _assert_layout_is_the_pattern(layout, mask_fn, *, n_q=N, n_k=N):
    mask, count = executor_xformers.materialize_layout(layout, executor_xformers.LayoutGrid(B, H, n_q, n_k))
    expected = patterns.materialize_mask(mask_fn, batch=B, heads=H, q_len=n_q, kv_len=n_k, q_offset=n_k - n_q)
    assert torch.equal(mask, expected)
    assert int(count.max()) <= 1, "parts overlap: a log-sum-exp merge would count a key twice"


@pytest.mark.parametrize("n_q", [N, 5, 1])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dilation", [1, 3, [1, 2, 3, 2]])
@pytest.mark.parametrize("masks", ["none", "padding", "global", "padding+global"])
def test_sliding_layout_biases_materialise_to_the_pattern(n_q, causal, dilation, masks):
    pytest.importorskip("xformers")
    pattern = sliding_window_case(B, N, masks, dilation=dilation, causal=causal)
    layout = executor_xformers.sliding_window_layout(executor_xformers.LayoutGrid(B, H, n_q, N), **pattern)
    _assert_layout_is_the_pattern(layout, patterns.sliding_window_pattern(**pattern), n_q=n_q)
    # Dilation runs over residue classes: a plain band per class, no dense mask anywhere but the causal global part.
    assert isinstance(layout.parts[0].bias, executor_xformers._attn_bias().LocalAttentionFromBottomRightMask)


@pytest.mark.parametrize("stride", [1, 2, 3, 5, 30])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("padding", [False, True])
def test_strided_layout_biases_materialise_to_the_pattern(stride, causal, padding):
    pytest.importorskip("xformers")
    key_padding_mask = padding_and_global_masks(B, N)[0] if padding else None
    layout = executor_xformers.strided_layout(
        executor_xformers.LayoutGrid(B, H, N, N), stride=stride, causal=causal, key_padding_mask=key_padding_mask
    )
    mask_fn = patterns.strided_pattern(stride=stride, causal=causal, key_padding_mask=key_padding_mask)
    _assert_layout_is_the_pattern(layout, mask_fn)


@pytest.mark.parametrize(("block_size", "num_summary"), [(4, 1), (4, 2), (5, 5), (1, 1), (30, 3)])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("summary_per_head", [False, True])
def test_fixed_layout_biases_materialise_to_the_pattern(block_size, num_summary, causal, summary_per_head):
    pytest.importorskip("xformers")
    right_padding = torch.ones(B, N, dtype=torch.bool)
    right_padding[0, 20:] = False  # blocks count from the first real token: right padding keeps them at 0
    kwargs = dict(
        block_size=block_size,
        num_summary=num_summary,
        summary_per_head=summary_per_head,
        causal=causal,
        key_padding_mask=right_padding,
    )
    layout = executor_xformers.fixed_layout(executor_xformers.LayoutGrid(B, H, N, N), **kwargs)
    _assert_layout_is_the_pattern(layout, patterns.fixed_pattern(**kwargs))


def test_full_layout_and_bucket_blocks_materialise_to_their_masks():
    pytest.importorskip("xformers")
    key_padding_mask, _ = padding_and_global_masks(B, N)
    for n_q, causal in ((N, False), (N, True), (4, True)):
        layout = executor_xformers.full_layout(
            executor_xformers.LayoutGrid(B, H, n_q, N), causal=causal, key_padding_mask=key_padding_mask
        )
        parts = [patterns.key_padding_predicate(key_padding_mask)] + ([patterns.causal_mask()] if causal else [])
        _assert_layout_is_the_pattern(layout, patterns.and_masks(*parts), n_q=n_q)
    # Buckets sorted into a block-diagonal layout: un-sorted, the blocks are "same bucket".
    buckets = torch.randint(0, 5, (2, 3, 17), generator=torch.Generator().manual_seed(0))
    order, seqlens = executor_xformers.bucket_order(buckets)
    blocks = executor_xformers._attn_bias().BlockDiagonalMask.from_seqlens(seqlens)
    for causal in (False, True):
        bias = blocks.make_causal() if causal else blocks
        sorted_visible = torch.isfinite(bias.materialize((order.numel(), order.numel())))
        visible = torch.zeros_like(sorted_visible)
        visible[order[:, None], order[None, :]] = sorted_visible
        flat = buckets.reshape(-1)
        row = torch.arange(flat.numel()) // 17
        position = torch.arange(flat.numel()) % 17
        expected = (row[:, None] == row[None, :]) & (flat[:, None] == flat[None, :])
        if causal:
            expected &= position[None, :] <= position[:, None]
        assert torch.equal(visible, expected)


# ---------------------------------------------------------------------------------------------- xformers end to end
@pytest.mark.parametrize(
    ("n_q", "causal", "dilation", "masks"),
    [
        (N, False, 1, "none"),
        (N, True, 1, "padding"),
        (N, False, 3, "none"),
        (N, False, 3, "padding+global"),
        (N, True, [1, 2, 3, 2], "padding+global"),
        (N, False, [1, 2, 3, 2], "global"),
        (5, True, 2, "padding+global"),
        (1, False, [1, 2, 3, 2], "padding"),
    ],
)
def test_xformers_sliding_path_equals_the_reference(reference_kernel, n_q, causal, dilation, masks):
    q, k, v = _qkv(n_q=n_q)
    pattern = sliding_window_case(B, N, masks, dilation=dilation, causal=causal)
    expected = outputs_and_grads(_reference_fn(patterns.sliding_window_pattern(**pattern), n_q=n_q), q, k, v)
    actual = outputs_and_grads(
        lambda q, k, v: ops.sliding_window_attention(q, k, v, scale=SCALE, backend="xformers", **pattern), q, k, v
    )
    assert_all_close(actual, expected, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("n, dilation", [(42, 3), (40, 4), (41, 4)])  # 41: not a multiple, the gathered layout
def test_xformers_dilated_window_on_residue_views_equals_the_reference(
    reference_kernel, monkeypatch, n, dilation, causal
):
    calls = []
    monkeypatch.setattr(
        executor_xformers,
        "residue_view",
        lambda x, m, view=executor_xformers.residue_view: calls.append(m) or view(x, m),
    )
    q, k, v = _qkv(n_q=n, n_k=n)
    pattern = dict(window=2, dilation=dilation, causal=causal)
    expected = outputs_and_grads(_reference_fn(patterns.sliding_window_pattern(**pattern), n_q=n, n_k=n), q, k, v)
    actual = outputs_and_grads(
        lambda q, k, v: ops.sliding_window_attention(q, k, v, scale=SCALE, backend="xformers", **pattern), q, k, v
    )
    assert_all_close(actual, expected, rtol=1e-10, atol=1e-10)
    assert calls == ([] if n % dilation else [dilation] * 3)


def test_residue_view_is_a_view_in_class_order():
    x = torch.arange(2 * 3 * 12 * 2).view(2, 3, 12, 2)
    view = executor_xformers.residue_view(x, 4)  # [b, 4, 3, h, d]
    assert view.data_ptr() == x.data_ptr() and view.shape == (2, 4, 3, 3, 2)
    for r in range(4):
        assert torch.equal(view[:, r], x[:, :, r::4].transpose(1, 2))


@pytest.mark.parametrize(
    ("n", "causal", "padding", "sortcut"),
    [
        (24, False, False, None),  # no bias: every key visible, one plain call
        (23, False, False, None),  # length not a multiple of the block
        (25, True, True, None),
        (24, False, True, None),
        (24, False, False, 2),
        (22, False, True, 3),
    ],
)
def test_xformers_sinkhorn_path_equals_the_torch_executor(reference_kernel, n, causal, padding, sortcut):
    from longattn.attention_sinkhorn import sinkhorn_attention

    q, k, v = _qkv(n_q=n, n_k=n)
    sort_weight = torch.randn(D, D, generator=torch.Generator().manual_seed(3), dtype=torch.float64, requires_grad=True)
    key_padding_mask = padding_and_global_masks(B, n)[0] if padding else None
    if padding:
        key_padding_mask[2, :3] = True  # the fully padded row gets three real tokens
    kwargs = dict(
        block_size=4,
        iterations=3,
        temperature=0.75,
        causal=causal,
        sortcut=sortcut,
        key_padding_mask=key_padding_mask,
        scale=SCALE,
    )

    def run(backend):
        out = sinkhorn_attention(q, k, v, sort_weight, backend=backend, **kwargs)
        grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
        return (out, *torch.autograd.grad(out, (q, k, v, sort_weight), grad))

    for name, actual, expected in zip(("out", "dq", "dk", "dv", "dW"), run("xformers"), run("torch"), strict=True):
        torch.testing.assert_close(actual, expected, rtol=1e-9, atol=1e-9, msg=lambda m, name=name: f"{name}: {m}")


def test_sinkhorn_kernel_call_zeroes_rows_that_see_no_key(reference_kernel):
    from longattn.ops_sinkhorn import _attend_on_kernel

    generator = torch.Generator().manual_seed(0)
    q = torch.randn(1, 2, 8, 8, generator=generator, dtype=torch.float64)  # 2 blocks of 4 queries
    keys, values = (torch.randn(1, 2, 12, 8, generator=generator, dtype=torch.float64) for _ in range(2))
    visible = torch.rand(1, 2, 2, 4, 6, generator=generator) > 0.3
    visible[0, 1, 0, 2] = False  # head 1, block 0, query 2 sees nothing (its hidden keys have real values)
    visible[..., 0] |= ~visible.any(-1) & (torch.arange(4).view(1, 1, 1, 4) != 2)
    out = _attend_on_kernel(q, keys, values, visible=visible, queries_per_key_block=4, scale=0.5, dropout_p=0.0)
    mask = torch.block_diag(*[torch.ones(4, 6, dtype=torch.bool)] * 2).view(1, 1, 8, 12) & torch.cat(
        [torch.nn.functional.pad(visible[:, :, 0], (0, 6)), torch.nn.functional.pad(visible[:, :, 1], (6, 0))], dim=2
    )
    expected = ops.reference_attention(q, keys, values, mask, scale=0.5)
    torch.testing.assert_close(out, expected, rtol=1e-10, atol=1e-10)
    assert torch.equal(out[0, 1, 2], torch.zeros(8, dtype=torch.float64))


def test_config_xformers_reaches_the_sinkhorn_kind(reference_kernel):
    def model(backend):
        torch.manual_seed(0)
        config = tiny_config("sinkhorn", max_position_embeddings=64, sinkhorn_block_size=4, attention_backend=backend)
        return LongAttnModel(config).eval().double()

    input_ids = torch.randint(3, 50, (2, 21), generator=torch.Generator().manual_seed(0))
    attention_mask = torch.ones(2, 21, dtype=torch.long)
    attention_mask[1, :5] = 0
    calls = []
    original = reference_kernel.attention
    reference_kernel.attention = lambda *args, **kwargs: calls.append(1) or original(*args, **kwargs)
    with torch.no_grad():
        expected = model("torch")(input_ids, attention_mask=attention_mask).last_hidden_state
        assert not calls
        actual = model("xformers")(input_ids, attention_mask=attention_mask).last_hidden_state
    assert len(calls) == 2  # one kernel call per layer
    torch.testing.assert_close(actual, expected, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("self_column", [None, 4])
@pytest.mark.parametrize("float_mask", [False, True])
def test_kernel_windows_equal_attend_windows_outputs_lse_and_gradients(reference_kernel, self_column, float_mask):
    from longattn.ops_lsh import attend_windows, attend_windows_on_kernel

    generator = torch.Generator().manual_seed(0)
    chunks, c, stride, w, d = 6, 4, 4, 8, 5  # overlapping windows: each chunk and the one before it
    q = torch.randn(chunks, c, d, generator=generator, dtype=torch.float64, requires_grad=True)
    k = torch.randn(stride * (chunks - 1) + w, d, generator=generator, dtype=torch.float64, requires_grad=True)
    v = torch.randn(k.shape[0], 3, generator=generator, dtype=torch.float64, requires_grad=True)
    mask = torch.rand(chunks, c, w, generator=generator) > 0.5
    mask[1] = False  # a chunk whose rows see nothing (but, under the self rule, themselves)
    mask[2, :, :] = False
    mask[2, :, 1] = True
    if float_mask:
        mask = torch.zeros(mask.shape, dtype=torch.float64).masked_fill(~mask, -math.inf)
    weights = torch.randn(chunks, c, 3, generator=generator, dtype=torch.float64)
    lse_weights = torch.randn(chunks, c, generator=generator, dtype=torch.float64)

    def run(windows):
        out, lse = windows(q, k, v, mask, stride=stride, scale=0.7, self_column=self_column)
        # Rows that see only their own key report a different (constant vs. penalised) lse by design: leave
        # their lse out of the loss; everything else must agree, gradients through lse included.
        sees_other = (mask if mask.dtype == torch.bool else ~torch.isneginf(mask)).clone()
        if self_column is not None:
            sees_other[:, :, self_column : self_column + c].diagonal(dim1=-2, dim2=-1).fill_(False)
        counted = sees_other.any(-1) & torch.isfinite(lse)
        loss = (out * weights).sum() + (torch.where(counted, lse, 0.0) * lse_weights).sum()
        return (out, torch.where(counted, lse, 0.0), *torch.autograd.grad(loss, (q, k, v)))

    for name, actual, expected in zip(
        ("out", "lse", "dq", "dk", "dv"), run(attend_windows_on_kernel), run(attend_windows), strict=True
    ):
        torch.testing.assert_close(actual, expected, rtol=1e-9, atol=1e-9, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize(("causal", "padding", "hashes"), [(False, False, 1), (False, True, 3), (True, True, 2)])
def test_xformers_lsh_path_equals_the_torch_kernel(reference_kernel, causal, padding, hashes):
    generator = torch.Generator().manual_seed(0)
    qk = torch.randn(2, 2, 37, 8, generator=generator, dtype=torch.float64, requires_grad=True)
    v = torch.randn(2, 2, 37, 8, generator=generator, dtype=torch.float64, requires_grad=True)
    key_padding_mask = None
    if padding:
        key_padding_mask = torch.ones(2, 37, dtype=torch.bool)
        key_padding_mask[0, :6] = False
        key_padding_mask[1, -9:] = False
    kwargs = dict(
        num_hashes=hashes, bucket_size=4, num_buckets=4, causal=causal, key_padding_mask=key_padding_mask, seed=3
    )

    def run(backend):
        return outputs_and_grads(lambda qk, _, v: ops.lsh_attention(qk, v, backend=backend, **kwargs), qk, qk, v)

    actual, expected = run("xformers"), run("torch")
    real = torch.ones(2, 1, 37, 1) if key_padding_mask is None else key_padding_mask[:, None, :, None]
    for name, a, e in zip(("out", "grad_qk", "grad_qk(again)", "grad_v"), actual, expected, strict=True):
        if name == "out":  # padded queries' outputs are not part of the contract
            a, e = a * real, e * real
        torch.testing.assert_close(a, e, rtol=1e-9, atol=1e-9, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize(("causal", "padding"), [(False, False), (False, True), (True, True)])
def test_xformers_routing_path_equals_the_torch_kernel(reference_kernel, causal, padding):
    from longattn.attention_routing import routing_attention

    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 2, 41, 8, generator=generator, dtype=torch.float64, requires_grad=True) for _ in range(3))
    centroids = torch.nn.functional.normalize(torch.randn(2, 4, 8, generator=generator, dtype=torch.float64), dim=-1)
    key_padding_mask = None
    if padding:
        key_padding_mask = torch.ones(2, 41, dtype=torch.bool)
        key_padding_mask[1, -7:] = False
    kwargs = dict(causal=causal, causal_window=6, key_padding_mask=key_padding_mask)
    expected = outputs_and_grads(
        lambda q, k, v: routing_attention(q, k, v, centroids, backend="torch", **kwargs), q, k, v
    )
    actual = outputs_and_grads(
        lambda q, k, v: routing_attention(q, k, v, centroids, backend="xformers", **kwargs), q, k, v
    )
    assert_all_close(actual, expected, rtol=1e-9, atol=1e-9)


def test_xformers_sinkhorn_is_explicit_only(monkeypatch):
    monkeypatch.setattr(backends, "xformers_unavailable_reasons", lambda: [])
    monkeypatch.setattr(backends, "xformers_probe_reasons", lambda *args, **kwargs: [])
    monkeypatch.setattr(backends, "flex_unavailable_reasons", lambda: [])
    request = _request(pattern="sinkhorn", device="cuda", dtype=torch.bfloat16)
    assert select_backend("auto", request) == "torch"
    assert select_backend("xformers", request) == "xformers"
    with pytest.raises(ValueError, match="pattern 'sinkhorn' is not served"):
        select_backend("flex", request)


@pytest.mark.parametrize("stride", [1, 3, 5])
@pytest.mark.parametrize("causal", [False, True])
def test_xformers_strided_path_equals_the_reference(reference_kernel, stride, causal):
    q, k, v = _qkv()
    key_padding_mask, _ = padding_and_global_masks(B, N)
    mask_fn = patterns.strided_pattern(stride=stride, causal=causal, key_padding_mask=key_padding_mask)
    expected = outputs_and_grads(_reference_fn(mask_fn), q, k, v)
    actual = outputs_and_grads(
        lambda q, k, v: executor_xformers.xformers_strided_attention(
            q, k, v, stride=stride, causal=causal, key_padding_mask=key_padding_mask, scale=SCALE
        ),
        q,
        k,
        v,
    )
    assert_all_close(actual, expected, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize(
    ("block_size", "num_summary", "summary_per_head"), [(4, 1, False), (5, 2, True), (30, 3, False)]
)
@pytest.mark.parametrize("causal", [False, True])
def test_xformers_fixed_path_equals_the_reference(reference_kernel, block_size, num_summary, summary_per_head, causal):
    q, k, v = _qkv()
    right_padding = torch.ones(B, N, dtype=torch.bool)
    right_padding[0, 20:] = False
    right_padding[2, 9:] = False
    kwargs = dict(
        block_size=block_size,
        num_summary=num_summary,
        summary_per_head=summary_per_head,
        causal=causal,
        key_padding_mask=right_padding,
    )
    expected = outputs_and_grads(_reference_fn(patterns.fixed_pattern(**kwargs)), q, k, v)
    actual = outputs_and_grads(
        lambda q, k, v: executor_xformers.xformers_fixed_attention(q, k, v, scale=SCALE, **kwargs), q, k, v
    )
    assert_all_close(actual, expected, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize(("n_q", "causal"), [(N, False), (N, True), (4, True)])
def test_xformers_full_path_equals_the_reference(reference_kernel, n_q, causal):
    q, k, v = _qkv(n_q=n_q)
    key_padding_mask, _ = padding_and_global_masks(B, N)
    parts = [patterns.key_padding_predicate(key_padding_mask)] + ([patterns.causal_mask()] if causal else [])
    expected = outputs_and_grads(_reference_fn(patterns.and_masks(*parts), n_q=n_q), q, k, v)
    actual = outputs_and_grads(
        lambda q, k, v: ops.full_attention(
            q, k, v, causal=causal, key_padding_mask=key_padding_mask, scale=SCALE, backend="xformers"
        ),
        q,
        k,
        v,
    )
    assert_all_close(actual, expected, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("causal", [False, True])
def test_xformers_bucketed_attention_equals_same_bucket_attention(reference_kernel, causal):
    q, k, v = _qkv(n_q=17, n_k=17)
    buckets = torch.randint(0, 4, (B, H, 17), generator=torch.Generator().manual_seed(2))
    mask = buckets[..., :, None] == buckets[..., None, :]  # [b, h, n, n]
    if causal:
        mask &= torch.ones(17, 17, dtype=torch.bool).tril()
    expected = outputs_and_grads(lambda q, k, v: ops.reference_attention(q, k, v, mask, scale=SCALE), q, k, v)
    actual = outputs_and_grads(
        lambda q, k, v: executor_xformers.bucketed_attention(q, k, v, buckets=buckets, causal=causal, scale=SCALE),
        q,
        k,
        v,
    )
    assert_all_close(actual, expected, rtol=1e-10, atol=1e-10)


def test_xformers_dropout_runs_on_single_call_layouts_only(reference_kernel):
    q, k, v = _qkv(dtype=torch.float32)
    out = ops.sliding_window_attention(q, k, v, window=2, dilation=3, dropout_p=0.5, backend="xformers")
    out.sum().backward()
    assert torch.isfinite(out).all() and torch.isfinite(q.grad).all()
    layout = executor_xformers.sliding_window_layout(
        executor_xformers.LayoutGrid(B, H, N, N), window=2, key_padding_mask=padding_and_global_masks(B, N)[0]
    )
    with pytest.raises(ValueError, match="no attention dropout"):
        executor_xformers.run_layout(q, k, v, layout, scale=SCALE, dropout_p=0.5)


def test_xformers_half_precision_matches_float64(reference_kernel):
    """bfloat16 through the hidden-key column: the flag's rounding still hides keys completely."""
    q, k, v = _qkv()
    key_padding_mask, global_mask = padding_and_global_masks(B, N)
    pattern = dict(window=3, dilation=2, key_padding_mask=key_padding_mask, global_mask=global_mask)
    expected = _reference_fn(patterns.sliding_window_pattern(**pattern))(q, k, v)
    half = [t.detach().to(torch.bfloat16) for t in (q, k, v)]
    actual = ops.sliding_window_attention(*half, scale=SCALE, backend="xformers", **pattern)
    torch.testing.assert_close(actual.double(), expected.detach(), rtol=2e-2, atol=2e-2)


def _xformers_modules():
    import importlib

    pytest.importorskip("xformers.ops")  # imported before any test patches torch.cuda (xformers probes it on import)
    return importlib.import_module("xformers._cpp_lib"), importlib.import_module("xformers.ops.fmha.common")


def _xformers_globals() -> dict:
    """Every plain module-level value (bool, number, string, None) of xformers' fmha package and its modules."""
    import sys

    modules = [
        module
        for name, module in sorted(sys.modules.items())
        if module is not None and (name == "xformers" or name.startswith(("xformers.ops", "xformers._cpp_lib")))
    ]
    return {
        (module.__name__, name): value
        for module in modules
        for name, value in vars(module).items()
        if isinstance(value, (bool, int, float, str, type(None))) and not name.startswith("__")
    }


def test_xformers_admits_its_pytorch_kernel_operators_only_when_its_extension_failed_and_only_during_a_call(
    monkeypatch,
):
    from longattn import fused_kernel

    cpp_lib, common = _xformers_modules()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for failed, expected in ((None, False), (ImportError("built for another torch"), True)):
        monkeypatch.setattr(cpp_lib, "_cpp_library_load_exception", failed)
        monkeypatch.setattr(common, "_built_with_cuda", False)
        with fused_kernel.xformers_call():
            assert common._built_with_cuda is expected
        assert common._built_with_cuda is False
        with pytest.raises(RuntimeError, match="inside"), fused_kernel.xformers_call():
            raise RuntimeError("inside")
        assert common._built_with_cuda is False


@pytest.mark.parametrize("call", ["attention", "forward", "backward"])
def test_xformers_kernel_calls_leave_xformers_globals_as_they_were(monkeypatch, call):
    """A real kernel call through xformers' dispatcher, with the admission active (its extension failed to load, a
    CUDA device "is available"): on CPU tensors the dispatcher finds no operator and raises; whatever happened
    inside, xformers' module globals afterwards are what they were before (they used to stay admitted for good).
    A fake kernel entry then shows that the admission was in force during a call that returns."""
    cpp_lib, common = _xformers_modules()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(cpp_lib, "_cpp_library_load_exception", ImportError("built for another torch"))
    monkeypatch.setattr(common, "_built_with_cuda", False)
    kernel = executor_xformers.XformersKernel()
    q = torch.randn(1, 8, 2, 8)
    run = {
        "attention": lambda: kernel.attention(q, q, q, None, p=0.0, scale=0.3),
        "forward": lambda: kernel.forward(q, q, q, None, scale=0.3),
        "backward": lambda: kernel.backward(q, q, torch.zeros(1, 2, 8), q, q, q, None, scale=0.3),
    }[call]
    before = _xformers_globals()
    with pytest.raises(NotImplementedError, match="No operator found"):
        run()
    assert _xformers_globals() == before

    import xformers.ops

    seen = []
    name = {
        "attention": "memory_efficient_attention",
        "forward": "memory_efficient_attention_forward_requires_grad",
        "backward": "memory_efficient_attention_backward",
    }[call]

    def fake_kernel_entry(*args, **kwargs):
        seen.append(common._built_with_cuda)
        return (q, torch.zeros(1, 2, 8)) if call == "forward" else q

    monkeypatch.setattr(xformers.ops, name, fake_kernel_entry)
    run()
    assert seen == [True]
    assert _xformers_globals() == before


def _tile_flags(num_blocks, indices, kv_tiles):
    """A BlockMask's ordered (count, indices) form as dense tile flags `[b, h, Q, K]`."""
    taken = torch.arange(indices.shape[-1]) < num_blocks[..., None].long()
    dense = torch.zeros(*indices.shape[:-1], kv_tiles + 1, dtype=torch.long)
    dense.scatter_add_(-1, torch.where(taken, indices.long(), kv_tiles), taken.long())
    return dense[..., :kv_tiles]


@pytest.mark.parametrize(
    "q_len, kv_len, window, dilation, causal, padded, block_size",
    [
        (300, 300, 40, 1, False, False, 16),
        (300, 300, 17, 1, False, False, 16),  # reach = B + 1: the last visible key opens a new tile
        (301, 301, 17, 3, True, True, 16),
        (7, 250, 30, (1, 2, 1, 4), False, True, 16),  # decoding: the queries are the last 7 positions
        (1000, 1000, 64, 1, True, False, 128),
        (129, 129, 200, 1, False, False, 128),  # the band covers every tile
    ],
)
def test_banded_block_mask_equals_create_block_mask(q_len, kv_len, window, dilation, causal, padded, block_size):
    flex = pytest.importorskip("torch.nn.attention.flex_attention")
    key_padding_mask = None
    if padded:
        key_padding_mask = torch.ones(2, kv_len, dtype=torch.bool)
        key_padding_mask[1, kv_len - kv_len // 3 :] = False
    mask_fn = patterns.sliding_window_pattern(
        window=window, dilation=dilation, causal=causal, key_padding_mask=key_padding_mask
    )
    assert patterns.mask_reach(mask_fn) == window * (max(dilation) if isinstance(dilation, tuple) else dilation)
    q_offset = kv_len - q_len

    def mask_mod(b, h, q_idx, kv_idx):
        return mask_fn(b, h, q_idx + q_offset, kv_idx)

    batch = 2 if padded else None
    heads = 4 if isinstance(dilation, tuple) else None
    # A small chunk bound makes the evaluation run in several chunks.
    actual = executor_flex.banded_block_mask(
        mask_mod,
        batch=batch,
        heads=heads,
        q_len=q_len,
        kv_len=kv_len,
        reach=patterns.mask_reach(mask_fn),
        device=torch.device("cpu"),
        block_size=block_size,
        max_elements=50_000,
    )
    expected = flex.create_block_mask(mask_mod, batch, heads, q_len, kv_len, device="cpu", BLOCK_SIZE=block_size)
    kv_tiles = -(-kv_len // block_size)
    for fields in (("kv_num_blocks", "kv_indices"), ("full_kv_num_blocks", "full_kv_indices")):
        got = _tile_flags(*(getattr(actual, f) for f in fields), kv_tiles)
        want = _tile_flags(*(getattr(expected, f) for f in fields), kv_tiles)
        assert torch.equal(got, want), fields
    assert torch.equal(actual.to_dense(), expected.to_dense())


def test_sliding_flex_block_mask_is_banded_and_global_tokens_are_not(monkeypatch):
    calls = []
    monkeypatch.setattr(
        executor_flex, "banded_block_mask", lambda *args, **kwargs: calls.append(kwargs["reach"]) or "banded"
    )
    executor_flex.clear_block_mask_cache()
    executor_flex.block_mask(
        patterns.sliding_window_pattern(window=5, causal=True),
        batch=None,
        heads=None,
        q_len=50,
        kv_len=50,
        device=torch.device("cpu"),
    )
    assert calls == [5]
    global_mask = torch.zeros(1, 50, dtype=torch.bool)
    global_mask[0, 3] = True
    executor_flex.block_mask(
        patterns.sliding_window_pattern(window=5, global_mask=global_mask),
        batch=1,
        heads=None,
        q_len=50,
        kv_len=50,
        device=torch.device("cpu"),
    )
    assert calls == [5]  # global tokens see everything: no band, create_block_mask


def test_per_head_dilation_predicate_reads_no_captured_tensor():
    # Compiled FlexAttention cannot read a host tensor inside its mask; the predicate is built from scalars only.
    mask_fn = patterns.sliding_window_mask(2, dilation=(1, 3, 1, 2))
    assert not any(isinstance(cell.cell_contents, torch.Tensor) for cell in mask_fn.__closure__ or ())
    q_idx, kv_idx = torch.arange(12).view(-1, 1), torch.arange(12).view(1, -1)
    for head, dilation in enumerate((1, 3, 1, 2)):
        distance = (q_idx - kv_idx).abs()
        expected = (distance <= 2 * dilation) & (distance % dilation == 0)
        assert torch.equal(mask_fn(torch.tensor(0), torch.tensor(head), q_idx, kv_idx), expected)


# ---------------------------------------------------------------------------------------------- GPU
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _gpu_qkv(length=1000):
    """bf16 q, k, v `[2, 4, length, 64]` on the GPU that require grad, and the generator that drew them."""
    generator = torch.Generator(device="cuda").manual_seed(0)
    return [
        torch.randn(2, 4, length, 64, device="cuda", dtype=torch.bfloat16, generator=generator).requires_grad_()
        for _ in range(3)
    ], generator


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("backend", ["flex", "xformers"])
def test_gpu_backends_equal_the_reference(backend):
    if backend == "xformers":
        pytest.importorskip("xformers")
    (q, k, v), generator = _gpu_qkv()
    key_padding_mask = torch.ones(2, 1000, dtype=torch.bool, device="cuda")
    key_padding_mask[1, 900:] = False
    global_mask = torch.zeros(2, 1000, dtype=torch.bool, device="cuda")
    global_mask[:, 0] = True
    pattern = dict(window=64, dilation=[1, 1, 2, 4], key_padding_mask=key_padding_mask, global_mask=global_mask)
    mask = patterns.materialize_mask(
        patterns.sliding_window_pattern(**pattern), batch=2, heads=4, q_len=1000, kv_len=1000, device="cuda"
    )
    expected = outputs_and_grads(lambda q, k, v: ops.reference_attention(q, k, v, mask), q, k, v)
    actual = outputs_and_grads(
        lambda q, k, v: ops.sliding_window_attention(q, k, v, backend=backend, **pattern), q, k, v
    )
    assert_all_close(actual, expected, rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize(("causal", "padding", "sortcut"), [(False, False, None), (True, True, None), (False, True, 2)])
def test_gpu_sinkhorn_on_xformers_equals_the_torch_executor(causal, padding, sortcut):
    pytest.importorskip("xformers")
    from longattn.attention_sinkhorn import sinkhorn_attention

    (q, k, v), generator = _gpu_qkv()
    sort_weight = torch.randn(64, 64, device="cuda", dtype=torch.bfloat16, generator=generator) / 8
    key_padding_mask = None
    if padding:
        key_padding_mask = torch.ones(2, 1000, dtype=torch.bool, device="cuda")
        key_padding_mask[1, :130] = False
    kwargs = dict(
        block_size=64, iterations=5, temperature=0.75, causal=causal, sortcut=sortcut, key_padding_mask=key_padding_mask
    )
    expected = outputs_and_grads(
        lambda q, k, v: sinkhorn_attention(q, k, v, sort_weight, backend="torch", **kwargs), q, k, v
    )
    actual = outputs_and_grads(
        lambda q, k, v: sinkhorn_attention(q, k, v, sort_weight, backend="xformers", **kwargs), q, k, v
    )
    assert_all_close(actual, expected, rtol=3e-2, atol=3e-2)


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_flex_banded_block_mask_at_a_length_of_many_tiles(causal):
    generator = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(1, 2, 3001, 64, device="cuda", dtype=torch.bfloat16, generator=generator) for _ in range(3))
    pattern = dict(window=200, dilation=3, causal=causal)
    mask = patterns.materialize_mask(
        patterns.sliding_window_pattern(**pattern), batch=1, heads=2, q_len=3001, kv_len=3001, device="cuda"
    )
    with torch.no_grad():
        expected = ops.reference_attention(q, k, v, mask)
        actual = ops.sliding_window_attention(q, k, v, backend="flex", **pattern)
    torch.testing.assert_close(actual, expected, rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("kind", ["lsh", "routing"])
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_lsh_and_routing_on_xformers_equal_the_torch_kernel(kind, causal):
    pytest.importorskip("xformers")
    from longattn.attention_routing import routing_attention

    (q, k, v), generator = _gpu_qkv()
    key_padding_mask = torch.ones(2, 1000, dtype=torch.bool, device="cuda")
    key_padding_mask[1, 870:] = False
    if kind == "lsh":

        def run(backend):
            return lambda q, k, v: ops.lsh_attention(
                q,
                v,
                num_hashes=2,
                bucket_size=64,
                causal=causal,
                seed=0,
                key_padding_mask=key_padding_mask,
                backend=backend,
            )
    else:
        centroids = torch.nn.functional.normalize(torch.randn(4, 8, 64, device="cuda", generator=generator), dim=-1).to(
            torch.bfloat16
        )

        def run(backend):
            return lambda q, k, v: routing_attention(
                q, k, v, centroids, causal=causal, causal_window=128, key_padding_mask=key_padding_mask, backend=backend
            )

    real = key_padding_mask[:, None, :, None]
    expected = [t * real if i == 0 else t for i, t in enumerate(outputs_and_grads(run("torch"), q, k, v))]
    actual = [t * real if i == 0 else t for i, t in enumerate(outputs_and_grads(run("xformers"), q, k, v))]
    assert_all_close(actual, expected, rtol=3e-2, atol=3e-2)


def _sibling_imports(module: str) -> set[str]:
    """The longattn modules `longattn/<module>.py` imports (relative imports, any depth of the file)."""
    import ast
    from pathlib import Path

    import longattn

    tree = ast.parse((Path(longattn.__file__).parent / f"{module}.py").read_text())
    return {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.level == 1}


# LSH's functional attention and its step modules (hashing, sorting, the window kernels).
LSH_MODULES = ("ops_lsh", "ops_lsh_hashing", "ops_lsh_sorting", "ops_lsh_chunks", "ops_lsh_gathered")


def test_ops_dispatch_down_to_leaf_executors():
    """ops -> backends -> executors -> patterns / numerics: no executor, pattern or back-end table imports the ops
    (the dense reference is an executor of its own, re-exported by `ops`)."""
    from longattn import executor_reference

    assert ops.reference_attention is executor_reference.reference_attention
    assert "executor_reference" in _sibling_imports("ops")
    for module in (
        "backends",
        "patterns",
        "numerics",
        "executor_reference",
        "executor_blocked",
        "executor_chunks",
        "executor_gathered",
        "executor_block_sets",
        "executor_band",
        "executor_sparse",
        "executor_flex",
        "executor_xformers",
        "executor_xformers_layouts",
        "executor_families",
    ):
        assert not _sibling_imports(module) & {"ops", "ops_linear", *LSH_MODULES, "ops_routing", "ops_sinkhorn"}, module
    # The functional attentions import no kind (the kinds import them).
    for module in ("ops", "ops_linear", *LSH_MODULES, "ops_routing", "ops_sinkhorn"):
        kinds = {name for name in _sibling_imports(module) if name.startswith("attention_")} - {"attention_fields"}
        assert not kinds, (module, kinds)


def test_kinds_re_export_their_functional_attention():
    """The routing and Sinkhorn kinds hold their settings and hooks; their functional attentions live in flat
    `ops_<family>` modules and are still importable from the kind modules, as the same objects."""
    from longattn import attention_routing, attention_sinkhorn, ops_routing, ops_sinkhorn

    for kind, functional in ((attention_routing, ops_routing), (attention_sinkhorn, ops_sinkhorn)):
        names = set(kind.__all__) - {"RoutingAttention", "SinkhornAttention"}
        assert names and names <= set(functional.__all__), kind.__name__
        for name in names:
            assert getattr(kind, name) is getattr(functional, name), name


def test_executor_names_do_not_clash_with_the_ops():
    """An executor's functions say whose they are: `executor_xformers` exports no `ops` name, and the padding
    predicate is not named like the `key_padding_mask` argument it takes."""
    from longattn import executor_reference

    for executor in (executor_xformers, executor_flex, executor_reference):
        assert not set(executor.__all__) & (set(ops.__all__) - {"reference_attention"}), executor.__name__
    assert {
        "xformers_sliding_window_attention",
        "xformers_strided_attention",
        "xformers_fixed_attention",
        "xformers_full_attention",
    } <= set(executor_xformers.__all__)
    assert "key_padding_mask" not in patterns.__all__ and not hasattr(patterns, "key_padding_mask")
    padding = torch.tensor([[True, False, True]])
    mask = patterns.materialize_mask(patterns.key_padding_predicate(padding), batch=1, heads=1, q_len=2, kv_len=3)
    assert mask.tolist() == [[[[True, False, True]] * 2]]


@pytest.mark.parametrize("name", ["reference", "torch", "flex", "xformers", "triton"])
def test_each_back_end_declares_an_executor_per_op_family_and_dispatch_returns_it(name):
    """The pattern functions of `ops` get the executor from the dispatch: the chosen back end's, for the family."""
    backend = backends.BACKENDS[name]
    assert set(backend.executors) <= set(backend.patterns) and backend.executors
    for pattern, executor in backend.executors.items():
        assert callable(executor) and backend.executor(pattern) is executor
    with pytest.raises(ValueError, match="no executor"):
        backend.executor("windows")
    request = _request(pattern="sliding")
    assert backends.select_executor("torch", request) is backends.BACKENDS["torch"].executors["sliding"]
    assert backends.select_executor("auto", request) is backends.BACKENDS[select_backend("auto", request)].executor(
        "sliding"
    )


def test_step_families_declare_an_executor_per_back_end_and_dispatch_returns_it(monkeypatch):
    """The kinds that run their own steps (LSH, routing, Sinkhorn, efficient attention) declare one executor per back
    end that runs them (`StepExecutors`), and `select_step_executor` returns it: `"auto"` the PyTorch one without a
    request, a named one once its reasons are checked; a back end without one is refused, naming those with one."""
    from longattn import ops_linear, ops_lsh, ops_routing, ops_sinkhorn

    q, k, v = random_qkv(1, 2, 8, 4, seed=0)
    families = (ops_lsh.LSH_STEPS, ops_routing.ROUTING_WINDOWS, ops_sinkhorn.SINKHORN_STEPS, ops_linear.EFFICIENT_STEPS)
    for steps in families:
        assert "torch" in steps.executors and set(steps.executors) < set(backends.BACKEND_NAMES) - {"auto"}
        for name, executor in steps.executors.items():
            if name != "xformers":  # CUDA only
                assert callable(executor)
                assert backends.select_step_executor(name, steps, q, k, v, causal=False) is executor
    monkeypatch.setattr(AttentionRequest, "for_inputs", None)  # "auto" must not build a request
    for steps in families:
        assert backends.select_step_executor("auto", steps, q, k, v, causal=False) is steps.executors["torch"]
    monkeypatch.undo()
    message = (
        "`backend`='reference' cannot run routing attention here: use 'auto', 'torch' or 'xformers' (the kind's "
        "dense form is `routing_attention_dense`)."
    )
    with pytest.raises(ValueError, match=re.escape(message)):
        backends.select_step_executor("reference", ops_routing.ROUTING_WINDOWS, q, k, v, causal=False)
    with pytest.raises(ValueError, match=r"'xformers' cannot run this 'sinkhorn' attention on cpu"):
        backends.select_step_executor("xformers", ops_sinkhorn.SINKHORN_STEPS, q, k, v, causal=False)
    with pytest.raises(ValueError, match="pattern 'windows' is not served"):
        backends.select_step_executor("flex", ops_lsh.LSH_STEPS, q, k, v, causal=False)


def test_only_the_reference_runs_a_kind_in_its_dense_form():
    assert [name for name in backends.BACKEND_NAMES if backends.runs_dense_form(name)] == ["reference"]


def test_only_the_dispatcher_branches_on_a_back_end_name():
    """No flat module but `backends` compares a value with a back-end name: the others ask the dispatcher for the
    executor (`select_executor`, `select_step_executor`) or whether a back end runs a kind's dense form
    (`runs_dense_form`)."""
    import ast
    from pathlib import Path

    import longattn

    names = set(backends.BACKEND_NAMES)
    found = []
    for path in sorted(Path(longattn.__file__).parent.glob("*.py")):
        if path.name == "backends.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Compare):
                continue
            operands = [node.left, *node.comparators]
            items = [i for o in operands for i in (o.elts if isinstance(o, (ast.Tuple, ast.List, ast.Set)) else [o])]
            if any(isinstance(item, ast.Constant) and item.value in names for item in items):
                found.append(f"{path.name}:{node.lineno}: {ast.unparse(node)}")
    assert not found, found
