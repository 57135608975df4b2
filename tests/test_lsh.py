"""Reformer LSH attention: dense equivalences, hashing, reproducibility, causality and parity with transformers."""

from __future__ import annotations

import logging
import math

import pytest
import torch
from attention_checks import (
    DOUBLE,
    EVERY_STACK,
    assert_same_on_kept_rows,
    check_causal_model_leaks_nothing,
    check_mixes_with_sliding_layers,
    check_op_leaks_nothing,
    lengths_mask,
    random_qkv,
    tiny_config,
)
from kind_configs import refused_values
from transformers import ReformerConfig
from transformers.models.reformer.modeling_reformer import LSHSelfAttention

import longattn
from longattn import LongAttnConfig
from longattn.ops_lsh import (
    SELF_SCORE,
    attend_gathered_windows,
    lsh_attention,
    lsh_attention_dense,
    lsh_buckets,
    lsh_rotations,
    normalize_keys,
)


def _inputs(b=2, h=2, n=13, d=8, seed=0, requires_grad=True):
    """`(qk, v)`: the first two of `random_qkv` (shared-QK attention has no separate keys)."""
    qk, v, _ = random_qkv(b, h, n, d, seed=seed, requires_grad=requires_grad)
    return qk, v


# Four buckets of four tokens: a sparse pattern at the test lengths (`lsh_seed` added where a test needs one).
BUCKETS = dict(lsh_bucket_size=4, lsh_num_buckets=4)


# transformers' LSH layer as ours: hidden 32 in 2 heads of 16, 4 buckets, no chunk after.
REFORMER = dict(hidden_size=32, num_attention_heads=2, attention_head_size=16, num_buckets=4, lsh_num_chunks_after=0)


def _reformer_config(**fields) -> ReformerConfig:
    """A Reformer config of one LSH layer (`REFORMER`, 64 positions), `fields` added."""
    return ReformerConfig(**REFORMER, max_position_embeddings=64, attn_layers=["lsh"], **fields)


def dense_shared_qk(qk, v, key_padding_mask=None, causal=False):
    """Plain dense shared-QK attention with Reformer's self rule: the textbook formula, [n, n] scores."""
    n = qk.shape[2]
    scores = qk @ normalize_keys(qk).transpose(-1, -2)  # [b, h, n, n], no 1/sqrt(d)
    visible = torch.ones(n, n, dtype=torch.bool)
    if causal:
        visible = visible.tril()
    visible = visible & ~torch.eye(n, dtype=torch.bool)
    if key_padding_mask is not None:
        visible = visible & key_padding_mask[:, None, None, :]
    scores = scores.masked_fill(~visible, -math.inf)
    scores = torch.where(torch.eye(n, dtype=torch.bool), torch.full_like(scores, SELF_SCORE), scores)
    return torch.softmax(scores, dim=-1) @ v


def explicit_reference(qk, v, *, rotations, bucket_size, before, after, causal, key_padding_mask=None):
    """Dense LSH with the permutation made explicit: sort each round, cut into chunks, mask [n, n], combine rounds."""
    b, h, n, _ = qk.shape
    valid = torch.ones(b, n, dtype=torch.bool) if key_padding_mask is None else key_padding_mask
    valid_list = valid.tolist()
    buckets = lsh_buckets(qk.detach(), rotations, valid=valid)  # [b, h, r, n]
    scores = qk @ normalize_keys(qk).transpose(-1, -2)  # [b, h, n, n]
    outs, lses = [], []
    for rnd in range(buckets.shape[2]):
        bucket = buckets[:, :, rnd].tolist()  # [b][h][n]
        visible = torch.zeros(b, h, n, n, dtype=torch.bool)
        for bi in range(b):
            for hi in range(h):
                bkt = bucket[bi][hi]
                order = sorted(range(n), key=lambda i: (bkt[i], i))
                rank = {pos: s for s, pos in enumerate(order)}
                for i in range(n):
                    for j in range(n):
                        if i == j or not valid_list[bi][j]:
                            continue
                        if causal:
                            ok = bkt[i] == bkt[j] and j < i and rank[i] - rank[j] <= bucket_size * before
                        else:
                            delta = rank[j] // bucket_size - rank[i] // bucket_size
                            ok = -before <= delta <= after
                        visible[bi, hi, i, j] = ok
        masked = scores.masked_fill(~visible, -math.inf)
        lonely = ~visible.any(-1, keepdim=True) & torch.eye(n, dtype=torch.bool)
        masked = torch.where(lonely, torch.full_like(masked, SELF_SCORE), masked)
        lse = masked.logsumexp(-1)  # [b, h, n]
        outs.append(torch.softmax(masked, -1) @ v)
        lses.append(lse)
    weights = torch.softmax(torch.stack(lses, 2), dim=2)  # [b, h, r, n]
    return (torch.stack(outs, 2) * weights[..., None]).sum(2)


# ---------------------------------------------------------------------------------------------- equivalences
@pytest.mark.parametrize("num_hashes", [1, 3])
def test_one_chunk_covering_the_sequence_is_dense_shared_qk_attention(num_hashes):
    qk, v = _inputs(n=13)
    mask = lengths_mask(13, [13, 9])
    # Through the public functional API, `longattn.ops`.
    fast = longattn.ops.lsh_attention(
        qk, v, num_hashes=num_hashes, bucket_size=16, num_buckets=4, key_padding_mask=mask, seed=0
    )
    slow = dense_shared_qk(qk, v, key_padding_mask=mask)
    assert_same_on_kept_rows(fast, slow, (qk, v), mask)


@pytest.mark.parametrize(
    "causal, before, after", [(False, 1, 0), (False, 1, 1), (False, 0, 0), (True, 1, 0), (True, 2, 0)]
)
def test_fast_path_equals_the_explicit_permutation_reference(causal, before, after):
    qk, v = _inputs(n=23, seed=1)
    mask = lengths_mask(23, [23, 17])
    rotations = lsh_rotations(heads=2, head_dim=8, num_hashes=2, num_buckets=4, seed=3, dtype=torch.float64)
    kwargs = dict(bucket_size=4, causal=causal, key_padding_mask=mask)
    fast = lsh_attention(
        qk, v, num_hashes=2, num_chunks_before=before, num_chunks_after=after, rotations=rotations, **kwargs
    )
    slow = explicit_reference(qk, v, rotations=rotations, before=before, after=after, **kwargs)
    assert_same_on_kept_rows(fast, slow, (qk, v), mask)
    dense, weights = lsh_attention_dense(
        qk, qk, v, rotations=rotations, num_chunks_before=before, num_chunks_after=after, **kwargs
    )
    rows = (mask[:, None, :].expand(2, 2, 23),)
    torch.testing.assert_close(dense[rows], fast[rows])
    torch.testing.assert_close(weights.sum(-1)[rows], torch.ones_like(weights.sum(-1)[rows]))


def test_the_dense_form_decodes_the_last_positions_like_the_full_pass():
    qk, v = _inputs(n=21, seed=2, requires_grad=False)
    rotations = lsh_rotations(heads=2, head_dim=8, num_hashes=3, num_buckets=4, seed=5, dtype=torch.float64)
    full = lsh_attention(qk, v, num_hashes=3, bucket_size=3, causal=True, rotations=rotations)
    last, _ = lsh_attention_dense(qk[:, :, -4:], qk, v, rotations=rotations, bucket_size=3, causal=True)
    torch.testing.assert_close(last, full[:, :, -4:])


def test_more_hash_rounds_approach_dense_attention_on_clustered_inputs():
    generator = torch.Generator().manual_seed(0)
    n, d, clusters = 128, 16, 8
    centres = torch.nn.functional.normalize(torch.randn(clusters, d, generator=generator, **DOUBLE), dim=-1) * 4
    members = torch.randint(0, clusters, (n,), generator=generator)
    qk = (centres[members] + 0.3 * torch.randn(n, d, generator=generator, **DOUBLE))[None, None]  # [1, 1, n, d]
    v = torch.randn(1, 1, n, d, generator=generator, **DOUBLE)
    dense = dense_shared_qk(qk, v)
    errors = {}
    for num_hashes in (1, 2, 4, 8):
        trials = [
            (
                lsh_attention(
                    qk, v, num_hashes=num_hashes, bucket_size=8, num_buckets=16, num_chunks_before=0, seed=seed
                )
                - dense
            ).norm()
            / dense.norm()
            for seed in range(6)
        ]
        errors[num_hashes] = torch.stack(trials).mean().item()
    assert errors[2] < errors[1] and errors[4] < errors[2] and errors[8] < errors[4], errors
    assert errors[8] < 0.5 * errors[1], errors


# ---------------------------------------------------------------------------------------------- hashing and seeds
def test_buckets_are_the_argmax_over_plus_and_minus_rotations():
    qk, _ = _inputs(n=9, requires_grad=False)
    rotations = lsh_rotations(heads=2, head_dim=8, num_hashes=2, num_buckets=6, seed=1, dtype=torch.float64)
    rotated = torch.einsum("bhnd,hdrk->bhrnk", qk, rotations)
    expected = torch.cat([rotated, -rotated], -1).argmax(-1)
    torch.testing.assert_close(lsh_buckets(qk, rotations), expected)
    valid = lengths_mask(9, [9, 5])
    assert (lsh_buckets(qk, rotations, valid=valid)[1, :, :, 5:] == 6).all()


def test_the_same_seed_gives_the_same_output_and_another_seed_another():
    qk, v = _inputs(n=40, requires_grad=False)
    kwargs = dict(num_hashes=2, bucket_size=4, num_buckets=8)
    first = lsh_attention(qk, v, seed=7, **kwargs)
    torch.testing.assert_close(lsh_attention(qk, v, seed=7, **kwargs), first, rtol=0, atol=0)
    assert not torch.allclose(lsh_attention(qk, v, seed=8, **kwargs), first)
    rotations = lsh_rotations(heads=2, head_dim=8, num_hashes=2, num_buckets=8, seed=7)
    torch.testing.assert_close(lsh_attention(qk, v, rotations=rotations.double(), **kwargs), first)


def test_model_layers_use_the_seed_and_explicit_rotations():
    torch.manual_seed(0)
    model = longattn.LongAttnModel(tiny_config("lsh", num_hidden_layers=1, lsh_seed=11, **BUCKETS)).eval()
    layer = model.encoder.layers[0].self_attn
    assert not hasattr(layer, "k_proj"), "shared-QK: no key projection"
    ids = torch.randint(4, 60, (1, 30))
    with torch.no_grad():
        seeded = model(input_ids=ids).last_hidden_state
        layer.set_rotations(lsh_rotations(heads=2, head_dim=16, num_hashes=2, num_buckets=4, seed=11))
        torch.testing.assert_close(model(input_ids=ids).last_hidden_state, seeded, rtol=0, atol=0)
        layer.set_rotations(lsh_rotations(heads=2, head_dim=16, num_hashes=2, num_buckets=4, seed=12))
        assert not torch.allclose(model(input_ids=ids).last_hidden_state, seeded)
    with pytest.raises(ValueError, match="rotations"):
        layer.set_rotations(torch.zeros(2, 15, 2, 2))


# ---------------------------------------------------------------------------------------------- eval rotations
def _lsh_lm(**overrides):
    fields = dict(**BUCKETS, lsh_num_hashes=2, hidden_dropout_prob=0.0)
    torch.manual_seed(0)
    return longattn.LongAttnForCausalLM(tiny_config("lsh", **{**fields, **overrides}))


def _rotations(model):
    return [layer.self_attn.eval_rotations for layer in model.longattn.encoder.layers]


def test_eval_is_deterministic_without_a_seed_and_training_draws_fresh_rotations():
    model = _lsh_lm()  # lsh_seed=None: the eval rotations are drawn once, at creation
    ids = torch.randint(4, 60, (2, 30), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        model.eval()
        first = model(input_ids=ids).logits
        torch.testing.assert_close(model(input_ids=ids).logits, first, rtol=0, atol=0)
        model.train()  # no dropout: only the rotations can change between two calls
        assert not torch.allclose(model(input_ids=ids).logits, model(input_ids=ids).logits)
        model.eval()
        torch.testing.assert_close(model(input_ids=ids).logits, first, rtol=0, atol=0)


@pytest.mark.parametrize("seed", [None, 7])
def test_each_layer_has_its_own_eval_rotations_derived_from_the_seed(seed):
    first, second = _rotations(_lsh_lm(lsh_seed=seed))
    assert not torch.allclose(first, second)
    if seed is not None:  # layer i: lsh_seed + i, so layer 0 keeps transformers' `hash_seed` rotations
        for layer_idx, rotations in enumerate((first, second)):
            expected = lsh_rotations(heads=2, head_dim=16, num_hashes=2, num_buckets=4, seed=seed + layer_idx)
            torch.testing.assert_close(rotations, expected, rtol=0, atol=0)
        torch.testing.assert_close(_rotations(_lsh_lm(lsh_seed=seed))[1], second, rtol=0, atol=0)


def test_seq2seq_decoder_layers_hash_apart_from_the_encoder_layers():
    from longattn.attention_lsh import LSHAttention

    config = tiny_config("lsh", num_decoder_layers=2, decoder_attention_type="lsh", lsh_seed=7, **BUCKETS)
    layers = [m for m in longattn.LongAttnForSeq2SeqLM(config).modules() if isinstance(m, LSHAttention)]
    seeds = sorted(layer.seed for layer in layers)
    assert seeds == [7, 8, 9, 10], seeds  # encoder layers 7 + i, decoder layers 7 + 2 + i
    for layer in layers:
        expected = lsh_rotations(heads=2, head_dim=16, num_hashes=2, num_buckets=4, seed=layer.seed)
        torch.testing.assert_close(layer.eval_rotations, expected, rtol=0, atol=0)


def test_save_and_reload_give_the_same_eval_outputs(tmp_path):
    model = _lsh_lm().eval()
    ids = torch.randint(4, 60, (2, 30), generator=torch.Generator().manual_seed(2))
    model.save_pretrained(tmp_path)
    torch.manual_seed(123)  # another global RNG state must not matter on reload
    reloaded = longattn.LongAttnForCausalLM.from_pretrained(tmp_path).eval()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(input_ids=ids).logits, model(input_ids=ids).logits, rtol=0, atol=0)


def test_cached_decoding_equals_the_full_forward_pass_without_a_seed():
    model = _lsh_lm().eval()
    ids = torch.randint(4, 60, (2, 21), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        full = model(input_ids=ids, use_cache=False).logits
        prefix = model(input_ids=ids[:, :13], use_cache=True)
        cache, steps = prefix.past_key_values, [prefix.logits]
        for t in range(13, 21):
            step = model(input_ids=ids[:, t : t + 1], past_key_values=cache, use_cache=True)
            cache = step.past_key_values
            steps.append(step.logits)
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-5, atol=1e-5)


def test_a_checkpoint_without_eval_rotations_loads_with_a_warning(tmp_path, caplog):
    """A folder saved before the eval rotations were kept (simulated: the buffers removed from the weights)."""
    from safetensors.torch import load_file, save_file

    model = _lsh_lm(lsh_seed=3).eval()
    model.save_pretrained(tmp_path)
    weights = load_file(tmp_path / "model.safetensors")
    old = {name: tensor for name, tensor in weights.items() if not name.endswith("eval_rotations")}
    assert len(old) == len(weights) - 2
    save_file(old, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with caplog.at_level(logging.WARNING, logger="longattn.attention_lsh"):
        reloaded = longattn.LongAttnForCausalLM.from_pretrained(tmp_path)
    warnings = [r.getMessage() for r in caplog.records if r.name == "longattn.attention_lsh"]
    assert len(warnings) == 2 and all("eval outputs differ" in message for message in warnings), warnings
    for got, expected in zip(_rotations(reloaded), _rotations(model), strict=True):  # drawn again from the seed
        torch.testing.assert_close(got, expected, rtol=0, atol=0)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="longattn.attention_lsh"):
        longattn.LongAttnForCausalLM.from_pretrained(tmp_path.parent / tmp_path.name)  # still old: warns again
        model.save_pretrained(tmp_path / "new")
        longattn.LongAttnForCausalLM.from_pretrained(tmp_path / "new")
    assert len([r for r in caplog.records if r.name == "longattn.attention_lsh"]) == 2


# ---------------------------------------------------------------------------------------------- causality
@pytest.mark.parametrize("t", [5, 17, 30])
def test_causal_lsh_leaks_nothing_at_op_level(t):
    qk, v = _inputs(b=2, h=2, n=41, seed=3, requires_grad=False)
    kwargs = dict(num_hashes=3, bucket_size=4, num_buckets=4, causal=True, seed=0)
    check_op_leaks_nothing(lambda qk, v: lsh_attention(qk, v, **kwargs), (qk, v), t, seed=1)


def test_sort_then_chunk_with_a_position_mask_does_leak():
    """The leak the causal design avoids is real: transformers' causal LSH (sort, chunk, mask by position) has it,
    and the op-level check above catches it on the same kind of input."""
    torch.manual_seed(0)
    config = _reformer_config(
        lsh_attn_chunk_length=4, num_hashes=1, lsh_num_chunks_before=1, hash_seed=0, is_decoder=True
    )
    reference = LSHSelfAttention(config).eval()
    hidden = torch.randn(1, 40, 32)
    changed = hidden.clone()
    changed[:, 21:] = torch.randn(1, 19, 32)
    with torch.no_grad():
        before = reference(hidden).hidden_states
        after = reference(changed).hidden_states
    assert not torch.allclose(after[:, :21], before[:, :21], atol=1e-6)


@pytest.mark.parametrize("t", [9, 23])
def test_causal_lsh_model_leaks_nothing(t):
    check_causal_model_leaks_nothing(tiny_config("lsh", lsh_num_hashes=2, lsh_seed=0, **BUCKETS), t)


# ---------------------------------------------------------------------------------------------- transformers parity
@pytest.mark.parametrize("length, before", [(32, 0), (8, 1)])
@pytest.mark.parametrize("explicit", [True, False])
def test_parity_with_transformers_lsh_self_attention(length, before, explicit):
    """Same output as `ReformerModel`'s LSHSelfAttention at equal rotations and settings.

    Settings where both define the same pattern: chunks without neighbours (transformers' neighbours wrap across
    hash rounds, ours do not), or a sequence within one chunk (both then attend densely, with the self rule).
    """
    heads, head_dim, hidden = 2, 16, 32
    config = _reformer_config(
        lsh_attn_chunk_length=8, num_hashes=2, lsh_num_chunks_before=before, hash_seed=5, is_decoder=False
    )
    torch.manual_seed(0)
    theirs = LSHSelfAttention(config).eval()
    fields = dict(lsh_bucket_size=8, lsh_num_buckets=4, lsh_num_hashes=2, lsh_num_chunks_before=before, lsh_seed=5)
    ours = longattn.LongAttnModel(tiny_config("lsh", num_hidden_layers=1, **fields)).encoder.layers[0].self_attn.eval()
    with torch.no_grad():
        ours.q_proj.weight.copy_(theirs.query_key.weight)
        ours.v_proj.weight.copy_(theirs.value.weight)
        ours.q_proj.bias.zero_()
        ours.v_proj.bias.zero_()
    if explicit:  # transformers draws its rotations with torch.manual_seed(hash_seed); take them from there
        torch.manual_seed(5)
        ours.set_rotations(torch.randn(heads, head_dim, 2, 2))
    hidden_states = torch.randn(2, length, hidden)
    with torch.no_grad():
        expected = theirs(hidden_states).hidden_states  # [b, n, h·d], before the output projection
        q, _, v = ours.project(hidden_states)
        got = ours.merge_heads(ours.attend(q, q, v, key_padding_mask=None, global_mask=None))
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------------------------- config and stacks
BAD_VALUES = {"lsh_num_buckets": [5, [4, 4, 4]], "lsh_bucket_size": [0], "lsh_num_hashes": [0], "lsh_seed": [-1]}


@pytest.mark.parametrize(
    "fields, message", [*refused_values(BAD_VALUES), (dict(lsh_num_chunks_before=0, is_decoder=True), "causal")]
)
def test_config_validation_names_the_field(fields, message):
    with pytest.raises(ValueError, match=message):
        LongAttnConfig(hidden_size=32, num_attention_heads=2, num_hidden_layers=2, attention_type="lsh", **fields)


@pytest.mark.parametrize("model_class", EVERY_STACK)
def test_lsh_mixes_with_sliding_layers_in_every_stack(model_class):
    check_mixes_with_sliding_layers(model_class, "lsh", lsh_seed=0, **BUCKETS)


# ---------------------------------------------------------------------------------------------- the window kernel
@pytest.mark.parametrize("stride, width, self_column", [(4, 8, 4), (6, 6, None), (3, 9, 0)])
def test_window_kernel_equals_dense_windows_with_and_without_kept_probabilities(stride, width, self_column):
    from longattn.ops_lsh import attend_windows

    generator = torch.Generator().manual_seed(0)
    chunks, c, d = 7, 4, 5
    rows = (chunks - 1) * stride + width
    q = torch.randn(chunks, c, d, generator=generator, **DOUBLE).requires_grad_()
    k = torch.randn(rows, d, generator=generator, **DOUBLE).requires_grad_()
    v = torch.randn(rows, d, generator=generator, **DOUBLE).requires_grad_()
    mask = torch.rand(chunks, c, width, generator=generator) > 0.4
    mask[2] = False  # rows without a visible key: zeros (or only their own key under the self rule)
    index = torch.arange(chunks)[:, None] * stride + torch.arange(width)  # [chunks, w]
    scores = torch.einsum("ucd,uwd->ucw", q, k[index]) * 0.7
    scores = scores.masked_fill(~mask, -math.inf)
    if self_column is not None:
        own = torch.zeros_like(mask)
        own[:, torch.arange(c), self_column + torch.arange(c)] = True
        scores = torch.where(own, torch.full_like(scores, SELF_SCORE), scores)
    sees = ~torch.isneginf(scores).all(-1, keepdim=True)
    expected = torch.einsum("ucw,uwd->ucd", torch.softmax(scores.masked_fill(~sees, 0), -1) * sees, v[index])
    cotangent = torch.randn_like(expected)
    grads_expected = torch.autograd.grad(expected, (q, k, v), cotangent)
    for keep in (True, False):
        out, lse = attend_windows(q, k, v, mask, stride=stride, scale=0.7, self_column=self_column, keep_probs=keep)
        torch.testing.assert_close(out, expected)
        for got, want in zip(torch.autograd.grad(out, (q, k, v), cotangent), grads_expected, strict=True):
            torch.testing.assert_close(got, want)


@pytest.mark.parametrize(
    "kind, fields",
    [
        ("lsh", dict(lsh_seed=0, **BUCKETS)),
        ("routing", dict(routing_num_clusters=3, routing_causal_window=5)),
        ("sinkhorn", dict(sinkhorn_block_size=4)),
        ("sinkhorn", dict(sinkhorn_block_size=4, sinkhorn_sortcut=2)),
    ],
)
@pytest.mark.parametrize("causal", [False, True])
def test_content_based_kinds_with_dropout_and_in_bf16(kind, fields, causal):
    """Attention dropout trains (and is off in eval); bf16 stays close to float32. For LSH, routing and Sinkhorn."""
    if causal and "sinkhorn_sortcut" in fields:
        pytest.skip("SortCut has no causal form")
    config = tiny_config(kind, attention_probs_dropout_prob=0.3, hidden_dropout_prob=0.0, **fields)
    torch.manual_seed(0)
    model = (longattn.LongAttnForCausalLM if causal else longattn.LongAttnForMaskedLM)(config)
    ids = torch.randint(4, 60, (2, 29))
    mask = torch.ones_like(ids)
    mask[1, 22:] = 0
    model.train()
    first = model(input_ids=ids, attention_mask=mask, labels=ids)
    first.loss.backward()
    assert torch.isfinite(first.loss)
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
    with torch.no_grad():
        assert not torch.allclose(model(input_ids=ids, attention_mask=mask).logits, first.logits)
        model.eval()
        reference = model(input_ids=ids, attention_mask=mask).logits
        torch.testing.assert_close(model(input_ids=ids, attention_mask=mask).logits, reference, rtol=0, atol=0)
        low = model.to(torch.bfloat16)(input_ids=ids, attention_mask=mask).logits.float()
    keep = mask.bool()
    # Loose: in bf16 a few tokens can land in another bucket, cluster or sorted block than in float32.
    error = (low - reference)[keep].abs().mean() / reference[keep].abs().mean()
    assert error < 0.1, error


@pytest.mark.parametrize("causal", [False, True])
def test_backward_keeps_rows_and_indices_not_sorted_copies_or_probabilities(causal):
    """Saved for backward: qk, v, the output and a few numbers per (round, position), O(n·d) floats, plus integer
    indices; neither the r sorted copies of q, k, v nor the r·n·w probabilities (nor a causal [r·n, w] mask)."""
    from attention_checks import saved_tensor_bytes

    b, h, n, d, r, c = 1, 2, 512, 16, 2, 32
    qk, v = (torch.randn(b, h, n, d, requires_grad=True) for _ in range(2))
    floating, other = saved_tensor_bytes(
        lambda: lsh_attention(qk, v, num_hashes=r, bucket_size=c, num_buckets=8, seed=0, causal=causal)
    )
    rows = b * h * n  # float32 rows of d: qk, v and the output take 3·rows·d·4 bytes
    assert floating <= 4 * rows * d * 4 + 2 * r * rows * 4, floating  # + a log-sum-exp per slot (and slack)
    # Integer indices: query, key, value and output slots (and a causal band's two ends), about r·rows each.
    assert other <= 8 * (r * rows + 4 * c * r * b * h) * 8, other


def test_gathered_windows_mask_per_window_equals_the_mask_per_query():
    """A `[U, 1, w]` mask (one row per window, as routing and LSH pass it; added as a 0 / -inf bias) hides exactly
    what the same mask repeated for every query `[U, c, w]` hides: identical outputs and gradients."""
    generator = torch.Generator().manual_seed(0)
    rows, d, c, w = 10, 8, 3, 6
    q, k, v = (torch.randn(rows, d, generator=generator, **DOUBLE).requires_grad_() for _ in range(3))
    n_windows = 4
    query_index = torch.randint(0, rows, (n_windows * c,), generator=generator)
    key_index = torch.randint(0, rows, (n_windows * w,), generator=generator)
    out_index = query_index.clone()
    out_index[[1, 7]] = -1  # slots that answer nothing
    mask = torch.rand(n_windows, 1, w, generator=generator) > 0.4
    mask[2] = False  # a window that sees no key
    settings = dict(query_index=query_index, key_index=key_index, value_index=key_index, out_index=out_index)
    settings.update(n_out=rows, chunk=c, width=w, stride=w, scale=0.5)
    results = []
    for window_mask in (mask, mask.expand(n_windows, c, w).contiguous()):
        out = attend_gathered_windows(q, k, v, mask=window_mask, **settings)
        results.append([out, *torch.autograd.grad((out * torch.linspace(-1, 1, d, **DOUBLE)).sum(), (q, k, v))])
    for per_window, per_query in zip(*results, strict=True):
        torch.testing.assert_close(per_window, per_query, rtol=0, atol=0)
