"""Routing attention: explicit-selection references, causality, centroid updates, save/load and local heads."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from attention_checks import (
    DOUBLE,
    EVERY_STACK,
    assert_same_on_kept_rows,
    changed_after,
    check_causal_model_leaks_nothing,
    check_mixes_with_sliding_layers,
    check_op_leaks_nothing,
    lengths_mask,
    random_qkv,
    tiny_config,
)
from kind_configs import refused_values
from transformers import AutoModelForMaskedLM

import longattn
from longattn import LongAttnConfig
from longattn.attention_routing import cluster_statistics, routing_attention, routing_attention_dense
from longattn.numerics import apply_rotary
from longattn.ops import sliding_window_attention
from longattn.ops_routing import _balanced_members, _top_members


def _inputs(b=2, h=2, n=23, d=8, seed=0, requires_grad=True):
    return random_qkv(b, h, n, d, seed=seed, requires_grad=requires_grad)


def _centroids(h=2, clusters=4, d=8, seed=1):
    generator = torch.Generator().manual_seed(seed)
    return F.normalize(torch.randn(h, clusters, d, generator=generator, **DOUBLE), dim=-1)


def _cosines(x, centroids):
    return torch.einsum("bhnd,hcd->bhnc", F.normalize(x.detach(), dim=-1), centroids)


def balanced_reference(q, k, v, centroids, valid, scale):
    """The balanced clusters made explicit: each centroid's top-k queries and keys, a softmax per cluster, and a
    query in several clusters combining them by their log-sum-exp (one softmax over the union of their keys)."""
    b, h, n, _ = q.shape
    clusters = centroids.shape[1]
    out = torch.zeros_like(v)
    for bi in range(b):
        real = int(valid[bi].sum())
        size = math.ceil(real / clusters)
        for hi in range(h):
            cos_q = _cosines(q, centroids)[bi, hi].masked_fill(~valid[bi, :, None], -math.inf)  # [n, C]
            cos_k = _cosines(k, centroids)[bi, hi].masked_fill(~valid[bi, :, None], -math.inf)
            parts = {i: [] for i in range(n)}
            for c in range(clusters):
                queries = cos_q[:, c].topk(size).indices.tolist()
                keys = cos_k[:, c].topk(size).indices
                scores = q[bi, hi, queries] @ k[bi, hi, keys].T * scale  # [size, size]
                lse = scores.logsumexp(-1)
                outs = torch.softmax(scores, -1) @ v[bi, hi, keys]
                for slot, i in enumerate(queries):
                    parts[i].append((lse[slot], outs[slot]))
            for i, found in parts.items():
                if found:
                    weights = torch.softmax(torch.stack([lse for lse, _ in found]), 0)
                    out[bi, hi, i] = sum(w * o for w, (_, o) in zip(weights, found, strict=True))
    return out


def causal_reference(q, k, v, centroids, valid, scale, window):
    """Each query t: the keys j <= t of its own nearest centroid, the most recent `window` of them."""
    b, h, n, _ = q.shape
    out = torch.zeros_like(v)
    query_cluster = _cosines(q, centroids).argmax(-1)
    key_cluster = _cosines(k, centroids).argmax(-1)
    for bi in range(b):
        for hi in range(h):
            for t in range(n):
                if not valid[bi, t]:
                    continue
                keys = [j for j in range(t + 1) if valid[bi, j] and key_cluster[bi, hi, j] == query_cluster[bi, hi, t]]
                keys = keys[-window:]
                if keys:
                    scores = q[bi, hi, t] @ k[bi, hi, keys].T * scale
                    out[bi, hi, t] = torch.softmax(scores, -1) @ v[bi, hi, keys]
    return out


# ---------------------------------------------------------------------------------------------- references
@pytest.mark.parametrize("n, lengths", [(23, [23, 17]), (8, [8, 5])])
def test_balanced_routing_equals_the_explicit_cluster_reference(n, lengths):
    q, k, v = _inputs(n=n)
    centroids = _centroids()
    valid = lengths_mask(n, lengths)
    scale = 0.35
    fast = routing_attention(q, k, v, centroids, causal=False, causal_window=4, key_padding_mask=valid, scale=scale)
    slow = balanced_reference(q, k, v, centroids, valid, scale)
    assert_same_on_kept_rows(fast, slow, (q, k, v), valid)
    dense, weights = routing_attention_dense(
        q, k, v, centroids, causal=False, causal_window=4, key_padding_mask=valid, scale=scale
    )
    torch.testing.assert_close(dense * valid[:, None, :, None], fast * valid[:, None, :, None])
    assert (weights.sum(-1)[valid[:, None, :].expand(2, 2, n)] > 0).any()


@pytest.mark.parametrize("n, size", [(4096, 64), (1000, 10), (333, 20), (64, 64)])
def test_top_members_are_topk(n, size):
    generator = torch.Generator().manual_seed(n)
    scores = torch.randn(6, n, generator=generator)
    scores[1, n // 2 :] = -math.inf  # padding at the end
    scores[2, ::3] = -math.inf  # and spread out
    scores[3] = scores[3].sort().values  # positions in the order of the scores
    scores[4, 5:] = -math.inf  # fewer real scores than members
    expected = scores.topk(size, dim=-1)
    found = _top_members(scores, size)
    torch.testing.assert_close(scores.gather(-1, found), expected.values, rtol=0, atol=0)  # most similar first
    real = torch.isfinite(expected.values)
    assert torch.equal(found[real], expected.indices[real])


@pytest.mark.parametrize("n, clusters", [(1000, 50), (4096, 32), (300, 3)])
def test_balanced_members_are_each_centroids_topk(n, clusters):
    """The strip-wise similarities (with a rest of positions after the last whole strip, and padding) select each
    centroid's most similar positions, most similar first, as one top-k over all its cosines would."""
    generator = torch.Generator().manual_seed(n)
    x = torch.randn(2, 3, n, 16, generator=generator) * torch.rand(2, 3, n, 1, generator=generator)
    centroids = F.normalize(torch.randn(3, clusters, 16, generator=generator), dim=-1)
    valid = lengths_mask(n, [n, n - n // 3])
    size = -(-n // clusters)
    top, used = _balanced_members(x, centroids, valid, size)
    cosines = torch.einsum("hcd,bhnd->bhcn", centroids, F.normalize(x, dim=-1)).masked_fill(
        ~valid[:, None, None, :], -math.inf
    )
    expected = cosines.topk(size, dim=-1)
    real = used.expand_as(top) & torch.isfinite(expected.values)
    torch.testing.assert_close(cosines.gather(-1, top)[real], expected.values[real])
    assert torch.equal(top.sort(-1).values[:1], expected.indices.sort(-1).values[:1])  # no padding in row 0
    assert valid.gather(-1, top[1].reshape(1, -1)).view_as(top[1])[used[1].expand_as(top[1])].all()


def test_balanced_routing_with_many_clusters_equals_the_reference():
    """Enough clusters that each centroid's members are found by the grouped selection, padding included."""
    q, k, v = _inputs(n=256, d=4)
    centroids = _centroids(clusters=16, d=4)
    valid = lengths_mask(256, [256, 200])
    fast = routing_attention(q, k, v, centroids, causal=False, causal_window=4, key_padding_mask=valid, scale=0.35)
    slow = balanced_reference(q, k, v, centroids, valid, 0.35)
    assert_same_on_kept_rows(fast, slow, (q, k, v), valid)


@pytest.mark.parametrize("window", [3, 5, 40])
def test_causal_routing_equals_the_most_recent_keys_of_the_cluster(window):
    q, k, v = _inputs(n=29, seed=2)
    centroids = _centroids(clusters=3)
    valid = lengths_mask(29, [29, 21])
    valid[0, :4] = False  # left padding too
    scale = 0.35
    fast = routing_attention(q, k, v, centroids, causal=True, causal_window=window, key_padding_mask=valid, scale=scale)
    slow = causal_reference(q, k, v, centroids, valid, scale, window)
    assert_same_on_kept_rows(fast, slow, (q, k, v), valid)
    dense, _ = routing_attention_dense(
        q, k, v, centroids, causal=True, causal_window=window, key_padding_mask=valid, scale=scale
    )
    torch.testing.assert_close(dense * valid[:, None, :, None], fast * valid[:, None, :, None])


def test_causal_dense_form_decodes_the_last_positions_like_the_full_pass():
    q, k, v = _inputs(n=30, seed=3, requires_grad=False)
    centroids = _centroids(clusters=3)
    full = routing_attention(q, k, v, centroids, causal=True, causal_window=4)
    last, _ = routing_attention_dense(q[:, :, -5:], k, v, centroids, causal=True, causal_window=4)
    torch.testing.assert_close(last, full[:, :, -5:])


# ---------------------------------------------------------------------------------------------- causality
@pytest.mark.parametrize("t", [4, 17])
def test_causal_routing_leaks_nothing_at_op_level(t):
    q, k, v = _inputs(n=33, seed=4, requires_grad=False)
    centroids = _centroids(clusters=3)
    check_op_leaks_nothing(
        lambda *qkv: routing_attention(*qkv, centroids, causal=True, causal_window=4), (q, k, v), t, seed=9
    )


def balanced_with_causal_mask(q, k, v, centroids, scale):
    """The tempting causal variant: balanced top-k clusters over the whole sequence, a causal mask inside each."""
    _, _, n, _ = q.shape
    clusters = centroids.shape[1]
    size = math.ceil(n / clusters)
    out = torch.zeros_like(v)
    cos_q, cos_k = _cosines(q, centroids)[0, 0], _cosines(k, centroids)[0, 0]
    for c in range(clusters):
        queries, keys = cos_q[:, c].topk(size).indices, cos_k[:, c].topk(size).indices
        scores = (q[0, 0, queries] @ k[0, 0, keys].T * scale).masked_fill(keys[None, :] > queries[:, None], -math.inf)
        probs = torch.softmax(scores, -1).nan_to_num(0.0)
        out[0, 0, queries] += probs @ v[0, 0, keys]
    return out


def test_balancing_over_the_whole_sequence_would_leak():
    """Why the causal variant does not balance: with top-k clusters over the whole sequence, changing later tokens
    changes which earlier keys an early query sees, even with a causal mask inside each cluster."""
    q, k, v = _inputs(b=1, h=1, n=33, seed=4, requires_grad=False)
    centroids = _centroids(h=1, clusters=3)
    changed = changed_after((q, k, v), 19, seed=9)
    before = balanced_with_causal_mask(q, k, v, centroids, 0.35)
    after = balanced_with_causal_mask(*changed, centroids, 0.35)
    assert not torch.allclose(after[:, :, :20], before[:, :, :20])
    ours_before = routing_attention(q, k, v, centroids, causal=True, causal_window=11)
    ours_after = routing_attention(*changed, centroids, causal=True, causal_window=11)
    torch.testing.assert_close(ours_after[:, :, :20], ours_before[:, :, :20])


@pytest.mark.parametrize("t", [11, 25])
def test_causal_routing_model_leaks_nothing(t):
    check_causal_model_leaks_nothing(tiny_config("routing", routing_num_clusters=3, routing_causal_window=5), t)


# ---------------------------------------------------------------------------------------------- centroids
def _config(**fields) -> LongAttnConfig:
    """The tiny model of attention_checks.py in one routing layer of 3 clusters, `fields` added."""
    return tiny_config("routing", num_hidden_layers=1, routing_num_clusters=3, **fields)


def _masked_lm(**fields):
    torch.manual_seed(0)
    return longattn.LongAttnForMaskedLM(_config(**fields))


def _member_alignment(layer, hidden):
    """Mean cosine between each centroid and the mean of the unit queries and keys it holds."""
    q, k, _ = layer.project(hidden)
    sums, counts = cluster_statistics(q, k, layer.centroids, causal=False)
    means = F.normalize(sums, dim=-1)
    cos = (means * layer.centroids).sum(-1)
    return cos[counts > 0].mean()


def test_centroids_move_toward_their_members_in_training_only():
    model = _masked_lm(routing_ema_decay=0.9)
    layer = model.longattn.encoder.layers[0].self_attn
    ids = torch.randint(4, 60, (2, 30))
    hidden = model.longattn.encoder.layers[0].self_attn_layer_norm(
        model.longattn.embeddings(model.longattn.embeddings.word_embeddings(ids), torch.arange(30).expand(2, 30))
    )
    start = layer.centroids.clone()
    with torch.no_grad():
        model.eval()(input_ids=ids, labels=ids)
        model.train()(input_ids=ids, labels=ids)  # no backward pass: no update
    torch.testing.assert_close(layer.centroids, start, rtol=0, atol=0)
    with torch.no_grad():
        before = _member_alignment(layer, hidden)
    model.train()(input_ids=ids, labels=ids).loss.backward()
    assert not torch.equal(layer.centroids, start)
    torch.testing.assert_close(layer.centroids.norm(dim=-1), torch.ones(2, 3))
    with torch.no_grad():
        assert _member_alignment(layer, hidden) > before


def _members_mean(q, k, centroids, causal):
    """The mean unit member of each centroid, written out: its top-k queries and keys (balanced), or the queries and
    keys nearest to it (causal)."""
    unit_q, unit_k = F.normalize(q, dim=-1), F.normalize(k, dim=-1)
    h, clusters, _ = centroids.shape
    n = q.shape[2]
    means = centroids.clone()
    for hi in range(h):
        for c in range(clusters):
            members = []
            for unit in (unit_q, unit_k):
                cosine = unit[:, hi] @ centroids[hi].T  # [b, n, C]
                for bi in range(q.shape[0]):
                    if causal:
                        members.append(unit[bi, hi, cosine[bi].argmax(-1) == c])
                    else:
                        members.append(unit[bi, hi, cosine[bi, :, c].topk(math.ceil(n / clusters)).indices])
            members = torch.cat(members)
            if len(members):
                means[hi, c] = F.normalize(members.mean(0), dim=0)
    return means


@pytest.mark.parametrize("causal", [False, True])
def test_one_update_with_zero_decay_puts_centroids_on_their_members_mean(causal):
    torch.manual_seed(0)
    model = (longattn.LongAttnForCausalLM if causal else longattn.LongAttnForMaskedLM)(_config(routing_ema_decay=0.0))
    model.train()
    layer = model.longattn.encoder.layers[0].self_attn
    assert layer.is_causal == causal
    captured = {}
    layer.register_forward_pre_hook(
        lambda module, args, kwargs: captured.update(hidden=kwargs.get("hidden_states", args[0] if args else None)),
        with_kwargs=True,
    )
    ids = torch.randint(4, 60, (2, 30))
    start = layer.centroids.clone()
    model(input_ids=ids, labels=ids).loss.backward()
    with torch.no_grad():
        q, k, _ = layer.project(captured["hidden"])
        cos, sin = model.longattn.rotary(torch.arange(30).expand(2, 30))
        q, k = apply_rotary(q, k, cos, sin)
        expected = _members_mean(q, k, start, causal)
    torch.testing.assert_close(layer.centroids, expected.float())


def test_gradient_checkpointing_updates_the_centroids_once():
    ids = torch.randint(4, 60, (2, 30))
    results = []
    for checkpointing in (False, True):
        model = _masked_lm(routing_ema_decay=0.5).train()
        if checkpointing:
            model.activation_checkpointing_enable()  # transformers 5.x name
        model(input_ids=ids, labels=ids).loss.backward()
        results.append(model.longattn.encoder.layers[0].self_attn.centroids.clone())
    torch.testing.assert_close(results[1], results[0])


def test_centroids_are_saved_and_loaded_through_auto_classes(tmp_path):
    model = _masked_lm(routing_ema_decay=0.5).train()
    ids = torch.randint(4, 60, (2, 30))
    model(input_ids=ids, labels=ids).loss.backward()  # centroids now differ from any fresh draw
    assert "longattn.encoder.layers.0.self_attn.centroids" in model.state_dict()
    model.save_pretrained(tmp_path)
    torch.manual_seed(123)
    loaded = AutoModelForMaskedLM.from_pretrained(tmp_path)
    torch.testing.assert_close(
        loaded.longattn.encoder.layers[0].self_attn.centroids,
        model.longattn.encoder.layers[0].self_attn.centroids,
        rtol=0,
        atol=0,
    )
    with torch.no_grad():
        torch.testing.assert_close(loaded.eval()(input_ids=ids).logits, model.eval()(input_ids=ids).logits)


# ---------------------------------------------------------------------------------------------- local heads, config
@pytest.mark.parametrize("causal", [False, True])
def test_local_heads_are_sliding_window_heads(causal):
    config = _config(num_attention_heads=4, routing_num_local_heads=2, routing_local_window=4, routing_causal_window=6)
    torch.manual_seed(0)
    layer = longattn.LongAttnModel(config).encoder.layers[0].self_attn.eval()
    layer.is_causal = causal
    q, k, v = (torch.randn(2, 4, 21, 8) for _ in range(3))
    valid = lengths_mask(21, [21, 15])
    with torch.no_grad():
        out = layer.attend(q, k, v, key_padding_mask=valid, global_mask=None)
        local = sliding_window_attention(
            q[:, 2:], k[:, 2:], v[:, 2:], window=4, causal=causal, key_padding_mask=valid, scale=layer.scale
        )
        routed = routing_attention(
            q[:, :2],
            k[:, :2],
            v[:, :2],
            layer.centroids,
            causal=causal,
            causal_window=6,
            key_padding_mask=valid,
            scale=layer.scale,
        )
        dense, weights = layer.attend_dense(q, k, v, key_padding_mask=valid, global_mask=None)
    torch.testing.assert_close(out[:, 2:], local)
    torch.testing.assert_close(out[:, :2], routed)
    keep = valid[:, None, :, None]
    torch.testing.assert_close(dense * keep, out * keep, rtol=1e-4, atol=1e-5)
    assert weights.shape == (2, 4, 21, 21)


BAD_VALUES = {
    "routing_num_clusters": [0],
    "routing_num_local_heads": [2],
    "routing_local_window": [0],
    "routing_causal_window": [0],
    "routing_ema_decay": [1.0],
}


@pytest.mark.parametrize("fields, message", refused_values(BAD_VALUES))
def test_config_validation_names_the_field(fields, message):
    with pytest.raises(ValueError, match=message):
        LongAttnConfig(hidden_size=32, num_attention_heads=2, num_hidden_layers=2, attention_type="routing", **fields)


@pytest.mark.parametrize("model_class", EVERY_STACK)
def test_routing_mixes_with_sliding_layers_in_every_stack(model_class):
    check_mixes_with_sliding_layers(model_class, "routing", routing_num_clusters=3, routing_causal_window=5)


@pytest.mark.parametrize("causal", [False, True])
def test_backward_keeps_rows_and_indices_not_gathered_copies_or_probabilities(causal):
    """Saved for backward: q, k, v, the output and a number per slot, O(n·d) floats, plus integer indices;
    neither the gathered copies of the clusters' rows nor their [k, k] probabilities (nor a causal [n, 2W] bias)."""
    from attention_checks import saved_tensor_bytes

    b, h, n, d, clusters, window = 1, 2, 512, 16, 4, 64
    q, k, v = (torch.randn(b, h, n, d, requires_grad=True) for _ in range(3))
    centroids = F.normalize(torch.randn(h, clusters, d), dim=-1)
    floating, other = saved_tensor_bytes(
        lambda: routing_attention(q, k, v, centroids, causal=causal, causal_window=window)
    )
    rows = b * h * n
    assert floating <= 5 * rows * d * 4, floating  # q, k, v, the output, and per-slot numbers
    assert other <= 8 * (4 * rows + 4 * rows) * 8, other
