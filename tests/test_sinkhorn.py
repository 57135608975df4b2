"""Sparse Sinkhorn attention and SortCut: Sinkhorn balancing, explicit-permutation references, causality, padding."""

from __future__ import annotations

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
    tiny_config,
)
from kind_configs import refused_values
from transformers import AutoModelForMaskedLM

import longattn
from longattn.attention_sinkhorn import (
    log_sinkhorn,
    sinkhorn_attention,
    sinkhorn_attention_dense,
    sinkhorn_sort_matrix,
)

SETTINGS = dict(block_size=4, iterations=6, temperature=0.75)


def _inputs(b=2, h=2, n=22, d=8, seed=0, requires_grad=True):
    generator = torch.Generator().manual_seed(seed)
    tensors = [torch.randn(b, h, n, d, generator=generator, **DOUBLE) for _ in range(3)]
    weight = torch.randn(d, d, generator=generator, **DOUBLE)
    return [t.requires_grad_(requires_grad) for t in tensors] + [weight.requires_grad_(requires_grad)]


def _blocked(x, valid, s):
    """Rotate each row so its first real token comes first, pad to whole blocks, zero the padding."""
    b, h, n, d = x.shape
    first = [int(valid[i].nonzero()[0]) if valid[i].any() else 0 for i in range(b)]
    rows = torch.stack([torch.roll(x[i], -first[i], dims=1) for i in range(b)])
    row_valid = torch.stack([torch.roll(valid[i], -first[i]) for i in range(b)])
    n_pad = math.ceil(n / s) * s
    rows = torch.nn.functional.pad(rows, (0, 0, 0, n_pad - n))
    row_valid = torch.nn.functional.pad(row_valid, (0, n_pad - n), value=False)
    return rows * row_valid[:, None, :, None], row_valid, first


def reference(q, k, v, weight, *, valid, causal, sortcut, scale, block_size, iterations, temperature):
    """Sinkhorn attention with its permutation made explicit, one query at a time."""
    s = block_size
    b, h, n, d = q.shape
    q_l, valid_l, first = _blocked(q, valid, s)
    k_l, _, _ = _blocked(k, valid, s)
    v_l, _, _ = _blocked(v, valid, s)
    sort = sinkhorn_sort_matrix(
        k_l, valid_l, weight, block_size=s, iterations=iterations, temperature=temperature, causal=causal
    )  # [b, h, B, B]
    blocks = sort.shape[-1]
    out = torch.zeros_like(q_l)
    for bi in range(b):
        for hi in range(h):
            k_blocks = k_l[bi, hi].view(blocks, s, d)
            v_blocks = v_l[bi, hi].view(blocks, s, d)
            ok_blocks = valid_l[bi].view(blocks, s)
            for t in range(blocks * s):
                if not valid_l[bi, t]:
                    continue
                i = t // s
                if sortcut:
                    kept = min(sortcut, blocks)
                    rows = [p for p in range(kept) if sort[bi, hi, p].sum() > 0]
                    keys = torch.cat([torch.einsum("j,jsd->sd", sort[bi, hi, p], k_blocks) for p in rows])
                    values = torch.cat([torch.einsum("j,jsd->sd", sort[bi, hi, p], v_blocks) for p in rows])
                else:
                    own = [u for u in range(s) if ok_blocks[i, u] and (not causal or i * s + u <= t)]
                    keys, values = k_blocks[i, own], v_blocks[i, own]
                    if sort[bi, hi, i].max() > 0:
                        j = int(sort[bi, hi, i].argmax())
                        w = sort[bi, hi, i, j]
                        other = [u for u in range(s) if ok_blocks[j, u]]
                        keys = torch.cat([keys, w * k_blocks[j, other]])
                        values = torch.cat([values, w * v_blocks[j, other]])
                probs = torch.softmax(q_l[bi, hi, t] @ keys.T * scale, -1)
                out[bi, hi, t] = probs @ values
    result = torch.zeros_like(q)
    for bi in range(b):
        result[bi] = torch.roll(out[bi, :, :n], first[bi], dims=1)
    return result


# ---------------------------------------------------------------------------------------------- Sinkhorn
def test_sinkhorn_balancing_gives_a_doubly_stochastic_matrix():
    logits = torch.randn(3, 6, 6, generator=torch.Generator().manual_seed(0), **DOUBLE)
    allowed = torch.ones(6, 6, dtype=torch.bool)
    sort = log_sinkhorn(logits, allowed, iterations=50, causal=False)
    torch.testing.assert_close(sort.sum(-1), torch.ones(3, 6, **DOUBLE))
    torch.testing.assert_close(sort.sum(-2), torch.ones(3, 6, **DOUBLE), atol=1e-6, rtol=0)
    # A lower temperature approaches a permutation: the largest entry of each row grows toward 1.
    peaks = [log_sinkhorn(logits / t, allowed, iterations=50, causal=False).amax(-1).mean() for t in (1, 0.3, 0.05)]
    assert peaks[0] < peaks[1] < peaks[2] and peaks[2] > 0.85, peaks


def test_causal_sinkhorn_rows_depend_only_on_earlier_rows():
    logits = torch.randn(2, 7, 7, **DOUBLE)
    allowed = torch.ones(7, 7, dtype=torch.bool).tril(-1)
    changed = logits.clone()
    changed[:, 4:] = torch.randn(2, 3, 7, **DOUBLE)
    before = log_sinkhorn(logits, allowed, iterations=5, causal=True)
    after = log_sinkhorn(changed, allowed, iterations=5, causal=True)
    torch.testing.assert_close(after[:, :4], before[:, :4])
    assert not torch.allclose(after[:, 4:], before[:, 4:])
    plain = log_sinkhorn(logits, allowed, iterations=5, causal=False)
    plain_after = log_sinkhorn(changed, allowed, iterations=5, causal=False)
    assert not torch.allclose(plain_after[:, :4], plain[:, :4]), "plain Sinkhorn couples every row (the leak)"
    torch.testing.assert_close(before[:, 1:].sum(-1), torch.ones(2, 6, **DOUBLE))
    assert (before[:, 0] == 0).all() and (before.triu() == 0).all()


# ---------------------------------------------------------------------------------------------- references
@pytest.mark.parametrize("causal, left", [(False, False), (False, True), (True, False), (True, True)])
def test_sinkhorn_attention_equals_the_explicit_permutation_reference(causal, left):
    q, k, v, weight = _inputs(n=22)
    valid = lengths_mask(22, [22, 15], left=left)
    kwargs = dict(causal=causal, sortcut=None, scale=0.4, **SETTINGS)
    fast = sinkhorn_attention(q, k, v, weight, key_padding_mask=valid, **kwargs)
    slow = reference(q, k, v, weight, valid=valid, **kwargs)
    assert_same_on_kept_rows(fast, slow, (q, k, v, weight), valid)
    dense, weights = sinkhorn_attention_dense(q, k, v, weight, key_padding_mask=valid, **kwargs)
    keep = valid[:, None, :, None]
    torch.testing.assert_close(dense * keep, fast * keep)
    torch.testing.assert_close((weights @ v) * keep, fast * keep)


@pytest.mark.parametrize("budget", [1, 2])
def test_sortcut_equals_the_explicit_reference(budget):
    q, k, v, weight = _inputs(n=21, seed=1)
    valid = lengths_mask(21, [21, 14])
    kwargs = dict(causal=False, sortcut=budget, scale=0.4, **SETTINGS)
    fast = sinkhorn_attention(q, k, v, weight, key_padding_mask=valid, **kwargs)
    slow = reference(q, k, v, weight, valid=valid, **kwargs)
    assert_same_on_kept_rows(fast, slow, (q, k, v, weight), valid)


@pytest.mark.parametrize("budget", [6, 100])
def test_sortcut_with_a_budget_covering_all_blocks_attends_to_all_sorted_blocks(budget):
    q, k, v, weight = _inputs(n=24, seed=2)
    fast = sinkhorn_attention(q, k, v, weight, causal=False, sortcut=budget, scale=0.4, **SETTINGS)
    sort = sinkhorn_sort_matrix(k, torch.ones(2, 24, dtype=torch.bool), weight, causal=False, **SETTINGS)
    sorted_k = torch.einsum("bhpj,bhjsd->bhpsd", sort, k.view(2, 2, 6, 4, 8)).reshape(2, 2, 24, 8)
    sorted_v = torch.einsum("bhpj,bhjsd->bhpsd", sort, v.view(2, 2, 6, 4, 8)).reshape(2, 2, 24, 8)
    every = torch.softmax(q @ sorted_k.transpose(-1, -2) * 0.4, -1) @ sorted_v
    assert_same_on_kept_rows(fast, every, (q, k, v, weight), torch.ones(2, 24, dtype=torch.bool))


def test_the_dense_form_decodes_the_last_positions_like_the_full_pass():
    q, k, v, weight = _inputs(n=27, seed=3, requires_grad=False)
    valid = lengths_mask(27, [27, 20], left=True)
    kwargs = dict(causal=True, scale=0.4, **SETTINGS)
    full = sinkhorn_attention(q, k, v, weight, key_padding_mask=valid, **kwargs)
    last, _ = sinkhorn_attention_dense(q[:, :, -3:], k, v, weight, key_padding_mask=valid, **kwargs)
    torch.testing.assert_close(last, full[:, :, -3:])


def test_left_padding_does_not_move_the_blocks():
    q, k, v, weight = _inputs(b=1, n=18, seed=4, requires_grad=False)
    pad = torch.zeros(1, 2, 5, 8, **DOUBLE)
    padded = [torch.cat([pad, x], dim=2) for x in (q, k, v)]
    valid = torch.arange(23)[None] >= 5
    for causal in (False, True):
        alone = sinkhorn_attention(q, k, v, weight, causal=causal, scale=0.4, **SETTINGS)
        with_padding = sinkhorn_attention(*padded, weight, key_padding_mask=valid, causal=causal, scale=0.4, **SETTINGS)
        torch.testing.assert_close(with_padding[:, :, 5:], alone)


# ---------------------------------------------------------------------------------------------- causality
@pytest.mark.parametrize("t", [3, 10, 17])
def test_causal_sinkhorn_leaks_nothing_at_op_level(t):
    q, k, v, weight = _inputs(n=26, seed=5, requires_grad=False)
    kwargs = dict(causal=True, scale=0.4, **SETTINGS)
    check_op_leaks_nothing(lambda *qkv: sinkhorn_attention(*qkv, weight, **kwargs), (q, k, v), t, seed=9)


@pytest.mark.parametrize("t", [9, 22])
def test_causal_sinkhorn_model_leaks_nothing_even_with_noise(t):
    # training adds Gumbel noise to the sorting: the same draw for both runs
    config = tiny_config("sinkhorn", sinkhorn_block_size=4, hidden_dropout_prob=0.0)
    check_causal_model_leaks_nothing(config, t, seed=1, modes=(False, True))


# ---------------------------------------------------------------------------------------------- the module
def _config(**fields):
    return tiny_config(**{"attention_type": "sinkhorn", "sinkhorn_block_size": 4, **fields})


def test_noise_only_in_training_and_the_sorting_network_learns():
    torch.manual_seed(0)
    model = longattn.LongAttnForMaskedLM(_config(sinkhorn_sortcut=[None, 2]))
    ids = torch.randint(4, 60, (2, 30))
    with torch.no_grad():
        model.eval()
        torch.testing.assert_close(model(input_ids=ids).logits, model(input_ids=ids).logits, rtol=0, atol=0)
        model.train()
        assert not torch.allclose(model(input_ids=ids).logits, model(input_ids=ids).logits)
    model(input_ids=ids, labels=ids).loss.backward()
    for layer in model.longattn.encoder.layers:
        assert layer.self_attn.sort_proj.weight.grad.abs().sum() > 0


def test_sortcut_models_save_and_load_through_auto_classes(tmp_path):
    torch.manual_seed(0)
    model = longattn.LongAttnForMaskedLM(_config(sinkhorn_sortcut=2)).eval()
    model.save_pretrained(tmp_path)
    loaded = AutoModelForMaskedLM.from_pretrained(tmp_path).eval()
    ids = torch.randint(4, 60, (2, 30))
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids).logits, model(input_ids=ids).logits, rtol=0, atol=0)
        out = model(input_ids=ids, output_attentions=True)
    assert out.attentions[0].shape == (2, 2, 30, 30)


BAD_VALUES = {
    "sinkhorn_block_size": [0],
    "sinkhorn_iterations": [0],
    "sinkhorn_temperature": [0.0],
    "sinkhorn_sortcut": [0, [1, 2, 3]],
}


@pytest.mark.parametrize(
    "fields, message", [*refused_values(BAD_VALUES), (dict(sinkhorn_sortcut=2, is_decoder=True), "causal")]
)
def test_config_validation_names_the_field(fields, message):
    with pytest.raises(ValueError, match=message):
        _config(**fields)


@pytest.mark.parametrize("model_class", EVERY_STACK)
def test_sinkhorn_mixes_with_sliding_layers_in_every_stack(model_class):
    check_mixes_with_sliding_layers(model_class, "sinkhorn", sinkhorn_block_size=4)


@pytest.mark.parametrize("padded", [False, True])
def test_dropout_backward_uses_the_forward_draws(padded):
    """With attention dropout, the hand-written backward must apply the same dropout draws as its forward: gradcheck
    (float64) on a function that fixes torch's seed, from which each call draws its dropout seed."""
    q, k, v, weight = _inputs(b=1, h=2, n=11, d=4, seed=5)
    mask = lengths_mask(11, [8]) if padded else None

    def attention(q, k, v, weight, dropout_p=0.4):
        torch.manual_seed(0)
        return sinkhorn_attention(q, k, v, weight, key_padding_mask=mask, dropout_p=dropout_p, **SETTINGS)

    assert torch.autograd.gradcheck(attention, (q, k, v, weight))
    # The dropout is real: it changes the output, and with p = 0 the same call is the plain attention.
    assert not torch.allclose(attention(q, k, v, weight), attention(q, k, v, weight, dropout_p=0.0))
    torch.testing.assert_close(
        attention(q, k, v, weight, dropout_p=0.0),
        sinkhorn_attention(q, k, v, weight, key_padding_mask=mask, **SETTINGS),
    )


# ---------------------------------------------------------------------------------------------- the executor
@pytest.mark.parametrize("traceable", [False, True])
def test_attend_blocks_per_head_key_sets_and_differentiable_key_weights(traceable):
    """`attend_blocks`' extension for Sinkhorn: one key set per (batch row, head) and a weight per gathered key that
    multiplies its key and value, against the gathered keys written out, for outputs and every gradient."""
    from longattn import executor_gathered

    b, h, nb, c, m, n, d = 2, 3, 4, 3, 5, 12, 4
    generator = torch.Generator().manual_seed(7)
    q = torch.randn(b, h, nb, c, d, generator=generator, **DOUBLE).requires_grad_()
    k, v = (torch.randn(b, n, h, d, generator=generator, **DOUBLE).transpose(1, 2).requires_grad_() for _ in range(2))
    kv_index = torch.randint(0, n, (b, h, nb, m), generator=generator)
    kv_weight = torch.rand(b, h, nb, m, generator=generator, **DOUBLE).requires_grad_()
    mask = torch.rand(b, h, nb, c, m, generator=generator) > 0.3
    mask[0, 1, 2, 0] = False  # a query that sees no key: zeros

    def gathered(x):  # [b, h, nb, m, d], weighted
        return (
            x.gather(2, kv_index.flatten(2)[..., None].expand(-1, -1, -1, d)).view(b, h, nb, m, d)
            * kv_weight[..., None]
        )

    scores = (q @ gathered(k).transpose(-1, -2) * 0.6).masked_fill(~mask, -math.inf)
    sees = mask.any(-1, keepdim=True)
    expected = torch.softmax(scores.masked_fill(~sees, 0.0), -1) * sees @ gathered(v)
    run = executor_gathered._attend_blocks_traceable if traceable else executor_gathered.attend_blocks
    actual, _ = run(q, k, v, kv_index=kv_index, mask=mask, scale=0.6, dropout_p=0.0, kv_weight=kv_weight)
    torch.testing.assert_close(actual, expected)
    cotangent = torch.randn(actual.shape, generator=generator, **DOUBLE)
    inputs = (q, k, v, kv_weight)
    for grad_actual, grad_expected in zip(
        torch.autograd.grad(actual, inputs, cotangent), torch.autograd.grad(expected, inputs, cotangent), strict=True
    ):
        torch.testing.assert_close(grad_actual, grad_expected)


@pytest.mark.parametrize("traceable", [False, True])
@pytest.mark.parametrize("gathered", [False, True])
def test_attend_blocks_without_a_mask_equals_an_all_visible_mask(traceable, gathered):
    """`mask=None` means every key is visible: outputs, log-sum-exps and the gradients of q, k, v (through the
    output and the log-sum-exp) equal those of an all-True mask, eager and traceable, all keys or gathered ones,
    grouped query heads."""
    from longattn import executor_gathered

    b, h, h_kv, nb, c, n, d = 2, 4, 2, 3, 4, 12, 4
    generator = torch.Generator().manual_seed(11)
    q = torch.randn(b, h, nb, c, d, generator=generator, **DOUBLE).requires_grad_()
    k, v = (torch.randn(b, h_kv, n, d, generator=generator, **DOUBLE).requires_grad_() for _ in range(2))
    kv_index = torch.randint(0, n, (nb, 5), generator=generator) if gathered else None
    m = n if kv_index is None else kv_index.shape[-1]
    run = executor_gathered._attend_blocks_traceable if traceable else executor_gathered.attend_blocks
    results = []
    for mask in (None, torch.ones((), dtype=torch.bool).expand(b, h, nb, c, m)):
        out, lse = run(q, k, v, kv_index=kv_index, mask=mask, scale=0.5, dropout_p=0.0)
        loss = (out * torch.linspace(-1, 1, d, **DOUBLE)).sum() + lse.square().sum()
        results.append([out, lse, *torch.autograd.grad(loss, (q, k, v))])
    for none, all_true in zip(*results, strict=True):
        torch.testing.assert_close(none, all_true)


def _record_masks(monkeypatch) -> list:
    """The list that the `mask` of every `attend_blocks` call of Sinkhorn attention goes into, from now on."""
    from longattn import ops_sinkhorn

    masks = []
    original = ops_sinkhorn.attend_blocks
    monkeypatch.setattr(
        ops_sinkhorn,
        "attend_blocks",
        lambda *args, **kwargs: masks.append(kwargs["mask"]) or original(*args, **kwargs),
    )
    return masks


def test_unpadded_sinkhorn_passes_no_mask(monkeypatch):
    """Unpadded, non-causal Sinkhorn attention sees every key: it calls `attend_blocks` with `mask=None` (no
    all-True mask to negate and reduce) and still equals the explicit-permutation reference."""
    masks = _record_masks(monkeypatch)
    q, k, v, weight = _inputs(n=20, seed=3)
    kwargs = dict(causal=False, sortcut=None, scale=0.4, **SETTINGS)
    fast = sinkhorn_attention(q, k, v, weight, **kwargs)
    slow = reference(q, k, v, weight, valid=torch.ones(2, 20, dtype=torch.bool), **kwargs)
    assert masks == [None]
    torch.testing.assert_close(fast, slow)


def test_unpadded_sortcut_passes_no_mask(monkeypatch):
    """Unpadded, non-causal SortCut: every row of S sums to 1, so every mixed block exists and `attend_blocks` gets
    `mask=None` (no all-True mask to reduce and add); the output and gradients equal the masked path's (every token
    real) and the explicit reference."""
    masks = _record_masks(monkeypatch)
    q, k, v, weight = _inputs(n=20, seed=3)
    kwargs = dict(causal=False, sortcut=2, scale=0.4, **SETTINGS)
    every = torch.ones(2, 20, dtype=torch.bool)
    fast = sinkhorn_attention(q, k, v, weight, **kwargs)
    masked = sinkhorn_attention(q, k, v, weight, key_padding_mask=every, **kwargs)
    assert masks[0] is None and masks[1] is not None
    torch.testing.assert_close(fast, masked)
    grads = [torch.autograd.grad(out.square().sum(), (q, k, v, weight)) for out in (fast, masked)]
    for fast_grad, masked_grad in zip(*grads, strict=True):
        torch.testing.assert_close(fast_grad, masked_grad)
    torch.testing.assert_close(fast, reference(q, k, v, weight, valid=every, **kwargs))


def test_attend_blocks_refuses_key_weights_without_a_matching_key_set():
    from longattn.executor_blocked import attend_blocks

    q, k = torch.randn(1, 2, 3, 4, 8), torch.randn(1, 2, 12, 8)
    mask = torch.ones(1, 1, 3, 4, 5, dtype=torch.bool)
    with pytest.raises(ValueError, match="kv_weight"):
        attend_blocks(
            q,
            k,
            k,
            kv_index=torch.zeros(3, 5, dtype=torch.long),
            mask=mask,
            scale=1.0,
            kv_weight=torch.ones(1, 2, 3, 4),
        )
    with pytest.raises(ValueError, match="kv_index"):
        attend_blocks(q, k, k, kv_index=torch.zeros(1, 3, 3, 5, dtype=torch.long), mask=mask, scale=1.0)


def test_forward_and_backward_workspaces_stay_within_their_budget():
    """The blocked executor sizes its chunks by ALL their workspaces (scores, gathered and weighted keys and values,
    their gradients), not by the scores alone: Sinkhorn's blocks gather 2s keys for s queries, and budgeting the
    scores let its workspaces reach 42 MB at 16K tokens. At 4K tokens, 4 heads of 64: forward + backward peak at
    about 6 q-sized tensors (the output, the three gradients, 8 MB of workspaces); it was 15."""
    from attention_checks import peak_tensor_bytes

    b, h, n, d = 1, 4, 4096, 64
    # q, k, v as the [b, n, h, d] memory of projections, whose gradients must come back in that layout
    bases = [torch.randn(b, n, h, d, requires_grad=True) for _ in range(3)]
    sort_weight = torch.randn(d, d, requires_grad=True)
    cotangent = torch.randn(b, h, n, d)

    def step():
        q, k, v = (t.transpose(1, 2) for t in bases)
        sinkhorn_attention(q, k, v, sort_weight, block_size=64, iterations=8, temperature=0.75).backward(cotangent)

    step()  # warm-up: first-call allocations of the profiler and autograd
    q_bytes = bases[0].numel() * bases[0].element_size()
    assert peak_tensor_bytes(step) < 8 * q_bytes


@pytest.mark.parametrize("traceable", [False, True])
@pytest.mark.parametrize("mask_as", ["tensor", "function", "none"])
@pytest.mark.parametrize("weight_per", ["key", "block", "none"])
def test_attend_blocks_own_keys_equal_them_gathered(traceable, mask_as, weight_per):
    """`own_keys=s`: block i's first s keys are k[i·s : i·s + s], read in place and unweighted, then the gathered
    ones (weighted per key or per block). Outputs, log-sum-exps and every gradient (q, k, v, the weights) equal the
    same keys passed as one gathered index with weight 1 on the own block, for a mask given as a tensor, as a
    function of the chunk, or none; grouped query heads, k and v as transposed views, chunks of one block."""
    from longattn import executor_gathered

    b, h, h_kv, nb, c, s, m, n, d = 2, 4, 2, 4, 3, 3, 5, 14, 4
    generator = torch.Generator().manual_seed(5)
    q = torch.randn(b, h, nb, c, d, generator=generator, **DOUBLE).requires_grad_()
    k, v = (
        torch.randn(b, n, h_kv, d, generator=generator, **DOUBLE).transpose(1, 2).requires_grad_() for _ in range(2)
    )
    kv_index = torch.randint(0, n, (b, h_kv, nb, m), generator=generator)
    weight = None
    if weight_per != "none":
        columns = m if weight_per == "key" else 1
        weight = torch.rand(b, h_kv, nb, columns, generator=generator, **DOUBLE).requires_grad_()
    mask = torch.rand(b, h, nb, c, s + m, generator=generator) > 0.3
    mask[1, 2, 3, 1] = False  # a query that sees no key: zeros
    own = torch.arange(nb * s).view(nb, s).expand(b, h_kv, nb, s)
    full_index = torch.cat([own, kv_index], dim=-1)
    full_weight = None
    if weight is not None:
        full_weight = torch.cat([torch.ones(b, h_kv, nb, s, **DOUBLE), weight.expand(b, h_kv, nb, m)], dim=-1)
    given_mask = {"tensor": mask, "function": lambda start, stop: mask[:, :, start:stop], "none": None}[mask_as]
    run = executor_gathered._attend_blocks_traceable if traceable else executor_gathered.attend_blocks
    inputs = (q, k, v) if weight is None else (q, k, v, weight)
    results = []
    for index, kv_weight, own_keys in ((kv_index, weight, s), (full_index, full_weight, 0)):
        out, lse = run(
            q,
            k,
            v,
            kv_index=index,
            mask=given_mask if own_keys else (None if mask_as == "none" else mask),
            scale=0.7,
            dropout_p=0.0,
            kv_weight=kv_weight,
            own_keys=own_keys,
        )
        loss = (out * torch.linspace(-1, 1, d, **DOUBLE)).sum() + lse.masked_fill(lse.isinf(), 0).square().sum()
        results.append([out, lse, *torch.autograd.grad(loss, inputs)])
    for own_result, gathered_result in zip(*results, strict=True):
        torch.testing.assert_close(own_result, gathered_result)


def test_attend_blocks_refuses_own_keys_without_room_or_an_index():
    from longattn.executor_blocked import attend_blocks

    q, k = torch.randn(1, 2, 3, 4, 8), torch.randn(1, 2, 12, 8)
    with pytest.raises(ValueError, match="own_keys"):
        attend_blocks(q, k, k, kv_index=None, mask=None, scale=1.0, own_keys=4)
    with pytest.raises(ValueError, match="own_keys"):
        attend_blocks(q, k, k, kv_index=torch.zeros(3, 2, dtype=torch.long), mask=None, scale=1.0, own_keys=5)


@pytest.mark.parametrize("causal", [False, True])
def test_padded_and_causal_sinkhorn_keep_no_mask_for_backward(causal):
    """Padded or causal Sinkhorn attention hands the executor its mask as a function of the chunk (own block and
    sorted block visibility from the token mask, the sorted index and the empty rows of S), evaluated again in
    backward: nothing of n x keys-per-query elements is saved. The causal mask passed as a tensor was
    [b, h, B, s, 2s], 2s bools per query and head; now the largest saved integer or bool tensor is the sorted
    index, one entry per query and head (or the sorting step's block x block tensors). Float tensors saved stay
    O(n·d)."""
    b, h, n, d, s = 1, 2, 1000, 8, 16
    generator = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(b, n, h, d, generator=generator).transpose(1, 2).requires_grad_() for _ in range(3))
    sort_weight = torch.randn(d, d, generator=generator).requires_grad_()
    valid = torch.ones(b, n, dtype=torch.bool)
    valid[:, -37:] = False
    sizes = []

    def pack(tensor):
        sizes.append((tensor.untyped_storage().nbytes() // tensor.element_size(), tensor.is_floating_point()))
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        out = sinkhorn_attention(
            q, k, v, sort_weight, block_size=s, iterations=3, temperature=0.75, causal=causal, key_padding_mask=valid
        )
    out.sum().backward()
    n_pad = -(-n // s) * s
    blocks = n_pad // s  # the sorting step keeps [b, h, B, B] tensors (B = n / s blocks)
    assert max(size for size, floating in sizes if not floating) <= b * h * max(n_pad, blocks * blocks)
    assert max(size for size, floating in sizes if floating) <= b * h * max(n_pad * d, blocks * blocks)
