"""BP-Transformer graph attention (`binary_partition`): the nodes a token sees are disjoint tree nodes covering the
sequence, the gathered executor equals the dense [n, tokens + spans] reference (outputs and gradients, the relative
bias included), the causal form never reads a later token, and the kind trains, reloads and generates."""

from __future__ import annotations

import functools

import pytest
import torch
from kind_configs import tiny_config
from transformers import AutoModelForCausalLM

import longattn
from longattn.attention_binary_partition import (
    BinaryPartitionAttention,
    binary_partition_attention,
    binary_partition_edges,
    binary_partition_levels,
    binary_partition_reference,
    level_layout,
    level_offsets,
    num_edge_types,
    num_levels,
)

# The tiny config of kind_configs.py in binary-partition layers of context 2, 40 tokens, 64 positions (fields over it).
_config = functools.partial(
    tiny_config, "binary_partition", vocab_size=40, max_position_embeddings=64, binary_partition_context=2
)


def _float64_layer(causal: bool) -> BinaryPartitionAttention:
    """A layer of `_config()` (seed 0) in float64 and eval mode, its relative bias drawn (it starts at zero)."""
    torch.manual_seed(0)
    layer = BinaryPartitionAttention(_config(), layer_idx=0, is_causal=causal).double().eval()
    with torch.no_grad():
        layer.relative_bias.normal_()
    return layer


def _node_ranges(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The token range [start, stop) of every node of the node list `[N]`."""
    offsets = level_offsets(n, num_levels(n, 1))  # the most levels any k needs
    level = torch.cat([torch.full((offsets[i + 1] - offsets[i],), i) for i in range(len(offsets) - 1)])
    start = (torch.arange(offsets[-1]) - torch.tensor(offsets[:-1])[level]) * 2**level
    return start, (start + 2**level).clamp(max=n)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("context", [1, 2, 3])
def test_the_nodes_a_token_sees_are_disjoint_and_cover_the_sequence(context, causal):
    for n in range(1, 41):
        edges = binary_partition_edges(n, context=context, causal=causal)  # [n, N]
        start, stop = _node_ranges(n)
        start, stop = start[: edges.shape[1]], stop[: edges.shape[1]]
        tokens = torch.arange(n)
        inside = (start[:, None] <= tokens) & (tokens < stop[:, None])  # [N, n]
        covered = (edges >= 0).long() @ inside.long()  # [n, n]: how many seen nodes hold each token
        expected = torch.ones(n, n, dtype=torch.long)
        if causal:  # exactly the tokens at or before the query
            expected = expected.tril()
        assert torch.equal(covered, expected), (n, context, causal)
        # O(k · log(n/k)) nodes per query: at most k + 1 per level and side, each edge type once.
        seen = edges >= 0
        assert seen.sum(1).max() <= 1 + (1 if causal else 2) * (context + 1) * num_levels(n, context)
        for row in edges:
            assert row[row >= 0].unique().numel() == int((row >= 0).sum())


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("context", [1, 3, 4])
def test_the_level_windows_hold_every_node_a_query_sees_once(context, causal):
    """Both sides' windows (every tier, every group) hold every node of the dense table with its edge type, and no
    (query, node) pair twice; the one-pattern bias of a tier agrees with every group's visible edges."""
    for n in (1, 2, 5, 31, 32, 33, 70, 257, 600):
        dense = binary_partition_edges(n, context=context, causal=causal)  # [n, N]
        table = torch.full((n, dense.shape[1]), -1)
        seen = torch.zeros(n, dense.shape[1], dtype=torch.long)
        for side in level_layout(n, context=context, causal=causal):
            for tier in side.tiers:
                groups, g, m = tier.hidden.shape
                query = (torch.arange(groups * g) - side.shift).view(groups, g, 1).expand(-1, -1, m)
                node = tier.index[:, None, :].expand(-1, g, -1)
                types = tier.types.expand(groups, g, m)
                keep = ~tier.hidden
                assert bool(((query >= 0) & (query < n))[keep].all())
                table[query[keep], node[keep]] = types[keep]
                seen.index_put_((query[keep], node[keep]), torch.ones_like(node[keep]), accumulate=True)
        assert torch.equal(table, dense), (n, context, causal)
        assert int(seen.max()) <= 1, (n, context, causal)


def test_levels_of_the_documented_example():
    """n = 12, k = 1, query 5: left 4, [2, 4), [0, 2); right 6, 7, [8, 10), [10, 12) (the module docstring)."""
    levels = binary_partition_levels(12, context=1, causal=False)[5]
    assert levels.tolist() == [1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1]
    assert binary_partition_levels(12, context=1, causal=True)[5].tolist() == [1] * 4 + [0, 0] + [-1] * 6


def _inputs(n: int, *, dtype=torch.float64, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(3, 2, n, 8, generator=generator, dtype=dtype, requires_grad=True) for _ in range(3))
    mask = torch.ones(3, n, dtype=torch.bool)
    mask[1, n - min(n - 1, 5) :] = False  # right padding
    mask[2, : n // 2] = False  # left padding
    bias = (torch.randn(2, num_edge_types(2), generator=generator, dtype=dtype) * 0.5).requires_grad_(True)
    return q, k, v, mask, bias


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("n", [1, 6, 13, 37, 70])
def test_gathered_executor_equals_the_dense_reference_outputs_and_gradients(n, causal):
    q, k, v, mask, bias = _inputs(n)
    kwargs = dict(context=2, causal=causal, key_padding_mask=mask, relative_bias=bias, scale=0.35)
    fast = binary_partition_attention(q, k, v, **kwargs)
    dense, weights = binary_partition_reference(q, k, v, **kwargs)
    torch.testing.assert_close(fast, dense)
    torch.testing.assert_close(weights @ v, dense)  # the span weights spread over their tokens give the output
    grad = torch.randn_like(fast)
    fast_grads = torch.autograd.grad(fast, (q, k, v, bias), grad)
    dense_grads = torch.autograd.grad(dense, (q, k, v, bias), grad)
    for name, a, b in zip("qkvb", fast_grads, dense_grads):
        torch.testing.assert_close(a, b, msg=name)
    if n > 1:
        assert fast_grads[3].abs().sum() > 0  # the relative bias is trained


@pytest.mark.parametrize("causal", [False, True])
def test_layer_fast_path_equals_its_dense_form_with_left_padding(causal):
    """The layer counts the tree from each row's first real token; both paths do, and padding does not move it."""
    layer = _float64_layer(causal)
    hidden = torch.randn(2, 21, 32, dtype=torch.float64)
    mask = torch.ones(2, 21, dtype=torch.bool)
    mask[1, :6] = False
    fast, _ = layer(hidden, attention_mask=mask)
    dense, weights = layer(hidden, attention_mask=mask, output_attentions=True)
    torch.testing.assert_close(fast[mask], dense[mask])
    alone, _ = layer(hidden[1:, 6:])  # the padded row's real tokens on their own
    torch.testing.assert_close(fast[1, 6:], alone[0])
    assert weights.shape == (2, 2, 21, 21)


def test_cached_decoding_queries_equal_the_full_pass_with_left_padding():
    """Decoding: the last queries against all cached keys (the dense form, rows rolled) give the full pass's rows."""
    layer = _float64_layer(True)
    q, k, v = (torch.randn(2, 2, 26, 16, dtype=torch.float64) for _ in range(3))
    mask = torch.ones(2, 26, dtype=torch.bool)
    mask[1, :7] = False
    full = layer.attend(q, k, v, key_padding_mask=mask, global_mask=None)
    last, weights = layer.attend_dense(q[:, :, -3:], k, v, key_padding_mask=mask, global_mask=None)
    torch.testing.assert_close(last, full[:, :, -3:])
    assert weights.shape == (2, 2, 3, 26) and not weights[1, :, :, :7].any()


@pytest.mark.parametrize("dense", [False, True])
def test_causal_form_does_not_leak_later_tokens(dense):
    layer = _float64_layer(True)
    hidden = torch.randn(1, 29, 32, dtype=torch.float64)
    changed = hidden.clone()
    changed[:, 12:] = torch.randn(1, 17, 32, dtype=torch.float64)
    before, _ = layer(hidden, output_attentions=dense)
    after, _ = layer(changed, output_attentions=dense)
    torch.testing.assert_close(after[:, :12], before[:, :12], rtol=0, atol=0)
    assert not torch.allclose(after[:, 12:], before[:, 12:])


@pytest.mark.parametrize("causal", [False, True])
def test_bf16_with_padding_has_no_nan(causal):
    torch.manual_seed(0)
    layer = BinaryPartitionAttention(_config(), layer_idx=0, is_causal=causal).to(torch.bfloat16).train()
    hidden = torch.randn(3, 23, 32, dtype=torch.bfloat16, requires_grad=True)
    mask = torch.ones(3, 23, dtype=torch.bool)
    mask[1, 17:] = False
    mask[2, :] = False  # a row of padding only: no visible key anywhere
    out, _ = layer(hidden, attention_mask=mask)
    out.float().sum().backward()
    assert torch.isfinite(out).all() and torch.isfinite(hidden.grad).all()
    assert torch.isfinite(layer.relative_bias.grad).all()


def test_model_trains_a_step_reloads_and_generates(tmp_path):
    torch.manual_seed(0)
    model = longattn.LongAttnForCausalLM(_config(is_decoder=True, initializer_range=0.5))
    ids = torch.randint(4, 40, (2, 27))
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    assert torch.isfinite(loss)
    biases = [p for name, p in model.named_parameters() if name.endswith("relative_bias")]
    assert biases and all(p.grad is not None and p.grad.abs().sum() > 0 for p in biases)
    torch.optim.SGD(model.parameters(), lr=0.1).step()
    model.eval().save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids).logits, model(input_ids=ids).logits, rtol=0, atol=0)
    # Cached decoding runs the dense form on the cache: it gives the tokens of decoding without a cache.
    greedy = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    cached = loaded.generate(ids[:, :9], **greedy)
    uncached = loaded.generate(ids[:, :9], use_cache=False, **greedy)
    torch.testing.assert_close(cached, uncached, rtol=0, atol=0)


def test_context_below_one_is_refused_naming_the_field():
    with pytest.raises(ValueError, match=r"`binary_partition_context`=0 is invalid"):
        _config(binary_partition_context=0)


def _saved_bytes(fn, *tensors) -> int:
    """Bytes of the distinct storages autograd keeps for backward while `fn(*tensors)` runs."""
    storages = {}

    def pack(x):
        storages[x.untyped_storage().data_ptr()] = x.untyped_storage().nbytes()
        return x

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        fn(*tensors)
    return sum(storages.values())


@pytest.mark.parametrize("causal", [False, True])
def test_training_keeps_only_its_inputs_for_backward(causal):
    """Forward keeps q, k, v, the bias and the relative table for backward, with its output and log-sum-exp,
    nothing per node, edge or chunk: the spans (about n rows), gathered windows and biases are recomputed."""
    n, h, d = 1027, 2, 16
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, h, n, d, generator=generator, requires_grad=True) for _ in range(3))
    bias = torch.zeros(h, num_edge_types(2), requires_grad=True)
    embedding = torch.randn(9, d, generator=generator, requires_grad=True)
    mask = torch.ones(1, n, dtype=torch.bool)
    mask[0, -5:] = False
    kwargs = dict(context=2, causal=causal, key_padding_mask=mask, relative_bias=bias, scale=0.25)
    saved = _saved_bytes(lambda *x: binary_partition_attention(*x, relative_embedding=embedding, **kwargs), q, k, v)
    # q, k, v, the relative table [b, h, n, 9] (and what builds it from q: q itself), bias, embedding and mask; the
    # output and its log-sum-exp [b, h, n] (the flash-attention backward reads them).
    inputs = 3 * q.nbytes + h * n * 9 * 4 + bias.nbytes + embedding.nbytes + mask.nbytes + q.nbytes + h * n * 4
    assert saved <= inputs + 4096, (saved, inputs)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("n", [150, 301])
def test_chunked_backward_equals_the_dense_reference(n, causal, monkeypatch):
    """Many chunks (the fewest rows each), levels in both tiers, padding on both sides and the relative-position
    logits: outputs and every gradient equal the dense form in float64."""
    import longattn.attention_binary_partition as bp

    monkeypatch.setattr(bp, "_CHUNK_ELEMENTS", 1)
    q, k, v, mask, bias = _inputs(n)
    embedding = torch.randn(7, 8, dtype=torch.float64, requires_grad=True)
    kwargs = dict(context=1, causal=causal, key_padding_mask=mask, relative_bias=bias, scale=0.35)
    kwargs["relative_embedding"] = embedding
    assert num_levels(n, 1) > bp.HIGH_LEVEL  # both tiers: groups of GROUP and of HIGH_GROUP queries
    fast = binary_partition_attention(q, k, v, **kwargs)
    dense = binary_partition_reference(q, k, v, **kwargs)[0]
    torch.testing.assert_close(fast, dense)
    grad = torch.randn_like(fast)
    leaves = (q, k, v, bias, embedding)
    for name, a, b in zip("qkvbe", torch.autograd.grad(fast, leaves, grad), torch.autograd.grad(dense, leaves, grad)):
        torch.testing.assert_close(a, b, msg=name)


def test_attention_dropout_path_runs_forward_and_backward():
    """With attention dropout the chunks are recomputed by `torch.utils.checkpoint` (which replays the masks):
    finite gradients, and without dropout the same path equals the dense form."""
    q, k, v, mask, bias = _inputs(45)
    kwargs = dict(context=2, causal=False, key_padding_mask=mask, relative_bias=bias, scale=0.35)
    torch.manual_seed(0)
    out = binary_partition_attention(q, k, v, dropout_p=0.3, **kwargs)
    grads = torch.autograd.grad(out.sum(), (q, k, v, bias))
    assert all(torch.isfinite(g).all() for g in grads)
    import longattn.attention_binary_partition as bp

    recomputed = bp._forward_levels(q, k, v, mask, bias, None, 2, False, 0.35, 0.0, "checkpoint")[0]  # p = 0
    dense = binary_partition_reference(q, k, v, **kwargs)[0]
    torch.testing.assert_close(recomputed, dense)
    grad = torch.randn_like(dense)
    for a, b in zip(
        torch.autograd.grad(recomputed, (q, k, v, bias), grad), torch.autograd.grad(dense, (q, k, v, bias), grad)
    ):
        torch.testing.assert_close(a, b)
