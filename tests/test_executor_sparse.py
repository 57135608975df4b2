"""`longattn.executor_sparse` directly: the strided and fixed executors equal the dense reference of the same
predicate (`patterns.materialize_mask` + `ops.reference_attention`) in float64, outputs and gradients, at odd
lengths, with padding, causal and not, in cached decoding (fewer queries than keys), and with block sizes small
enough that every block / sub-block / causal-group loop runs more than once."""

from __future__ import annotations

import pytest
import torch
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
    strided = dict(stride=stride, causal=causal)
    mask_fn = patterns.strided_pattern(**strided, key_padding_mask=key_padding_mask)
    # Small blocks: several band blocks and several class sub-blocks (each its own call when causal).
    blocks = dict(block_size=4, class_block=2)
    out, *_ = _check(executor_sparse.strided_blocked_attention, mask_fn, n_q, n_k, **strided, **blocks)
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
    fixed = dict(block_size=block_size, num_summary=num_summary, summary_per_head=summary_per_head, causal=causal)
    mask_fn = patterns.fixed_pattern(**fixed, key_padding_mask=key_padding_mask)
    # Sub-blocks of 2 rows and 3 causal groups: every loop of the executor runs more than once.
    blocks = dict(max_block_rows=2, causal_groups=3)
    out = _check(executor_sparse.fixed_blocked_attention, mask_fn, n_q, n_k, **fixed, **blocks)[0]
    if padding:
        assert not out[2].any(), "a query that sees no key gets zeros"


@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
def test_fixed_default_blocks_equal_the_dense_reference(causal):
    fixed = dict(block_size=6, num_summary=2, summary_per_head=True, causal=causal)
    _check(executor_sparse.fixed_blocked_attention, patterns.fixed_pattern(**fixed), 53, 53, **fixed)


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


# ---------------------------------------------------------------------------------------------- memory
@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
@pytest.mark.parametrize(
    "executor, kwargs",
    [
        (executor_sparse.strided_blocked_attention, dict(stride=16, class_block=32)),
        (executor_sparse.fixed_blocked_attention, dict(block_size=32, num_summary=2)),
    ],
    ids=["strided", "fixed"],
)
def test_backward_keeps_rows_not_masks_gathered_queries_or_partial_outputs(executor, kwargs, causal, monkeypatch):
    """Saved for backward: q, k, v, the merged output and one log-sum-exp per query (O(n·d) floats), no bool mask
    (each set's is kept as its few distinct rows, within the peak below), no gathered copy of q and no part's own
    output. Forward + backward, with chunk workspaces made small, peak below 7 q-sized tensors (the output, the
    three gradients, masks and workspaces of a chunk); the parts as separate autograd calls merged afterwards took
    10.3-11 (two sets of gradients, the parts' outputs and masks, gathered and reordered copies)."""
    from attention_checks import peak_tensor_bytes, saved_tensor_bytes

    from longattn import executor_chunks

    monkeypatch.setattr(executor_chunks, "_WORKSPACE_ELEMENTS", 2**14, raising=False)
    monkeypatch.setattr(executor_chunks, "_CHUNK_ELEMENTS", 2**13)
    b, h, n, d = 1, 2, 2048, 16
    # q, k, v as the [b, n, h, d] memory of projections, whose gradients must come back in that layout
    bases = [torch.randn(b, n, h, d, requires_grad=True) for _ in range(3)]
    cotangent = torch.randn(b, h, n, d)
    pattern = (patterns.strided_pattern if "stride" in kwargs else patterns.fixed_pattern)(
        causal=causal, **{key: value for key, value in kwargs.items() if key != "class_block"}
    )

    def step():
        q, k, v = (t.transpose(1, 2) for t in bases)
        executor(q, k, v, mask_fn=pattern, causal=causal, scale=0.25, **kwargs).backward(cotangent)

    floating, other = saved_tensor_bytes(step)
    assert floating <= (4 * d + 1) * b * h * (n + 1) * 4, floating  # q, k, v, the output, the log-sum-exp
    assert other == 0, other
    step()  # warm-up: first-call allocations of the profiler and autograd
    q_bytes = bases[0].numel() * bases[0].element_size()
    peak = peak_tensor_bytes(step)
    assert peak < 7 * q_bytes, peak / q_bytes


@pytest.mark.parametrize(
    "executor, kwargs",
    [
        (executor_sparse.strided_blocked_attention, dict(stride=16, class_block=32)),
        (executor_sparse.fixed_blocked_attention, dict(block_size=32, num_summary=2)),
    ],
    ids=["strided", "fixed"],
)
def test_backward_with_relative_logits_keeps_rows_and_the_table_only(executor, kwargs, monkeypatch):
    """With relative-position logits: saved for backward are q, k, v, the output, the log-sum-exp and the
    `[b, h, n, 2M + 1]` table's own inputs (q and r), nothing n x keys; the bias is read again per chunk in backward
    and its gradient goes to the table chunk by chunk. The executor before (a materialised bias per part, fed to
    per-part autograd calls) kept the biases of every part (n x keys floats)."""
    from attention_checks import peak_tensor_bytes, saved_tensor_bytes

    from longattn import executor_chunks
    from longattn.relative_logits import relative_bias

    monkeypatch.setattr(executor_chunks, "_WORKSPACE_ELEMENTS", 2**14, raising=False)
    monkeypatch.setattr(executor_chunks, "_CHUNK_ELEMENTS", 2**13)
    b, h, n, d, reach = 1, 2, 2048, 16, 4
    bases = [torch.randn(b, n, h, d, requires_grad=True) for _ in range(3)]
    embedding = torch.randn(2 * reach + 1, d, requires_grad=True)
    cotangent = torch.randn(b, h, n, d)
    pattern = (patterns.strided_pattern if "stride" in kwargs else patterns.fixed_pattern)(
        causal=True, **{key: value for key, value in kwargs.items() if key != "class_block"}
    )

    def step():
        q, k, v = (t.transpose(1, 2) for t in bases)
        bias_fn = relative_bias(q, embedding, scale=0.25, kv_len=n)
        out = executor(q, k, v, mask_fn=pattern, causal=True, scale=0.25, bias_fn=bias_fn, **kwargs)
        out.backward(cotangent)

    floating, _ = saved_tensor_bytes(step)
    table_bytes = b * h * n * (2 * reach + 1) * 4
    # q, k, v, the output, the log-sum-exp; r and a contiguous copy of q saved by the table's own product
    assert floating <= (5 * d + 1) * b * h * (n + 1) * 4 + embedding.numel() * 4, floating
    step()  # warm-up
    q_bytes = bases[0].numel() * bases[0].element_size()
    peak = peak_tensor_bytes(step)
    # Besides the 7 of the test above: the table's product (q's copy, then its gradient to q) and three tables (the
    # table, its gradient, and one chunk's contribution to it).
    assert peak < 8 * q_bytes + 3 * table_bytes, peak / q_bytes
    assert embedding.grad is not None and embedding.grad.abs().sum() > 0


# ---------------------------------------------------------------------------------------------- attend_block_sets
def _two_sets(n, heads=None):
    """A band of width 2 on blocks of 4 consecutive queries (last block padded) and, beyond it, every third key
    (one set of keys shared by all blocks of the second set): disjoint geometries, as a union pattern needs."""
    from longattn.executor_blocked import BlockSet, band_layout
    from longattn.executor_sparse import _beyond_band, _within_band

    layout = band_layout(q_len=n, kv_len=n, window_left=2, window_right=2, block_size=4)
    band = BlockSet(_within_band(2), layout.q_pos, layout.q_valid, layout.kv_pos, layout.kv_valid)
    third = torch.arange(0, n, 3)
    q_pos = torch.arange(n).flip(0).view(-1, 1)  # one query per block, in reverse order
    sparse = BlockSet(_beyond_band(2), q_pos, torch.ones_like(q_pos, dtype=torch.bool), third[None], heads=heads)
    return [band, sparse]


@pytest.mark.parametrize("kv_heads", [4, 2], ids=["heads", "grouped-heads"])
def test_attend_block_sets_equals_its_plain_op_form_with_a_log_sum_exp_gradient(kv_heads):
    """Output, log-sum-exp and the gradients of both (the log-sum-exp gradient is what `merge_attention` of a caller
    sends back) equal the plain-op form (`_attend_block_sets_traceable`: masks materialised, sets merged by
    `merge_attention`), with grouped key/value heads and with a set serving only some heads."""
    from longattn.executor_block_sets import _attend_block_sets_traceable, attend_block_sets

    n = 23
    q, _, _ = random_qkv(2, 4, n, D, seed=3)
    _, k, v = random_qkv(2, kv_heads, n, D, seed=4)
    sets = _two_sets(n, heads=torch.tensor([1, 3]) if kv_heads == 4 else None)
    results = []
    for run in (attend_block_sets, _attend_block_sets_traceable):
        out, lse = run(q, k, v, sets, scale=SCALE, dropout_p=0.0)
        loss = (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum() + (lse.exp() * 0.1).sum()
        results.append((out, lse, *torch.autograd.grad(loss, (q, k, v))))
    for actual, expected in zip(*results, strict=True):
        torch.testing.assert_close(actual, expected, **TIGHT)


@pytest.mark.parametrize("kv_heads", [4, 2], ids=["heads", "grouped-heads"])
def test_attend_block_sets_with_relative_logits_equals_its_plain_op_form(kv_heads, monkeypatch):
    """With relative-position logits (read per chunk, in forward and again in backward), output, log-sum-exp and the
    gradients of q, k, v and the embedding r (through the table the bias reads) equal the plain-op form, where the
    biases are materialised and autograd differentiates them; the fused function is the one that ran."""
    from longattn import executor_block_sets
    from longattn.executor_block_sets import _attend_block_sets_traceable, attend_block_sets
    from longattn.relative_logits import relative_bias

    calls = []
    apply = executor_block_sets._BlockSetAttention.apply
    monkeypatch.setattr(executor_block_sets._BlockSetAttention, "apply", lambda *args: calls.append(1) or apply(*args))
    n = 23
    q, _, _ = random_qkv(2, 4, n, D, seed=3)
    _, k, v = random_qkv(2, kv_heads, n, D, seed=4)
    embedding = torch.randn(2 * 3 + 1, D, requires_grad=True)
    sets = _two_sets(n, heads=torch.tensor([1, 3]) if kv_heads == 4 else None)
    results = []
    for run in (attend_block_sets, _attend_block_sets_traceable):
        bias_fn = relative_bias(q, embedding, scale=SCALE, kv_len=n)
        out, lse = run(q, k, v, sets, scale=SCALE, dropout_p=0.0, bias_fn=bias_fn)
        loss = (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum() + (lse.exp() * 0.1).sum()
        results.append((out, lse, *torch.autograd.grad(loss, (q, k, v, embedding))))
    assert calls == [1]
    for actual, expected in zip(*results, strict=True):
        torch.testing.assert_close(actual, expected, **TIGHT)


def test_attend_block_sets_dropout_has_matching_gradients():
    """With dropout, backward draws the same keep masks as forward: the gradients are those of the function that
    forward computed (finite differences, same seed for every evaluation)."""
    from longattn.executor_blocked import attend_block_sets

    n = 11
    q, k, v = random_qkv(1, 2, n, 4, seed=5)
    sets = _two_sets(n)

    def run(q, k, v):
        torch.manual_seed(0)
        return attend_block_sets(q, k, v, sets, scale=SCALE, dropout_p=0.3)[0]

    assert not torch.equal(run(q, k, v), attend_block_sets(q, k, v, sets, scale=SCALE)[0]), "dropout must act"
    assert torch.autograd.gradcheck(run, (q, k, v))


@pytest.mark.parametrize("book", ["kept", "hash-collisions"])
@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
@pytest.mark.parametrize("kind", ["strided", "fixed"])
def test_masks_kept_for_backward_equal_the_predicate_under_padding_and_documents(kind, causal, book, monkeypatch):
    """Forward keeps each set's mask as its distinct rows (`_MaskBook`) and backward reads them instead of the
    predicate: outputs and gradients (float64) equal the dense reference of the same pattern with padding (left,
    right, a row of padding only) AND packed documents, at an odd length, in chunks far smaller than a set (forward's
    and backward's chunks then differ). With every row hashed alike the book finds different rows under one hash,
    is dropped, and backward evaluates the predicate again, with the same results."""
    from longattn import executor_block_sets, executor_chunks, ops

    monkeypatch.setattr(executor_chunks, "_WORKSPACE_ELEMENTS", 2**12)
    if book == "hash-collisions":

        def every_row_alike(self, words, workspace):
            return torch.zeros(words.shape[0], dtype=torch.int64)

        monkeypatch.setattr(executor_block_sets._MaskBook, "_hash", every_row_alike)
    n = 203
    padding = three_padded_rows(n)
    documents = (torch.arange(n) >= 61).long() + (torch.arange(n) >= 150).long()  # three packed documents
    documents = documents.expand(3, n).clone()
    documents[1] = (torch.arange(n) >= 97).long()
    if kind == "strided":
        sizes, fn = dict(stride=9), ops.strided_attention
        pattern = patterns.strided_pattern(causal=causal, key_padding_mask=padding, document_ids=documents, **sizes)
    else:
        sizes, fn = dict(block_size=16, num_summary=3), ops.fixed_attention
        pattern = patterns.fixed_pattern(causal=causal, key_padding_mask=padding, document_ids=documents, **sizes)
    evaluated = []
    mask = executor_block_sets.BlockSet.mask
    monkeypatch.setattr(
        executor_block_sets.BlockSet, "mask", lambda self, *args: evaluated.append(1) or mask(self, *args)
    )
    q, k, v = random_qkv(3, 2, n, D, seed=3)
    out = fn(q, k, v, causal=causal, key_padding_mask=padding, document_ids=documents, scale=SCALE, **sizes)
    in_forward = len(evaluated)
    cotangent = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    actual = (out, *torch.autograd.grad(out, (q, k, v), cotangent))
    assert in_forward > 0
    assert (len(evaluated) > in_forward) == (book == "hash-collisions"), (in_forward, len(evaluated))
    expected = outputs_and_grads(lambda q, k, v: dense_reference(pattern, q, k, v, scale=SCALE), q, k, v)
    assert_all_close(actual, expected, **TIGHT)


@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
@pytest.mark.parametrize("kind", ["strided", "fixed", "fixed-per-head"])
def test_periodic_masks_evaluated_once_equal_the_predicate(kind, causal, monkeypatch):
    """Sets whose predicate is periodic (`patterns.mask_period`) evaluate it once per call on one block of each group
    of alike blocks (`_MaskTemplate`): every block's template equals the predicate evaluated on that block (edges,
    padding slots and keys of an odd length included), and outputs and gradients (float64, chunks far smaller than a
    set) equal the dense reference of the pattern."""
    from longattn import executor_block_sets, executor_chunks, ops

    monkeypatch.setattr(executor_chunks, "_WORKSPACE_ELEMENTS", 2**12)
    n = 203
    if kind == "strided":
        sizes, fn = dict(stride=9), ops.strided_attention
        pattern = patterns.strided_pattern(causal=causal, **sizes)
    else:
        sizes = dict(block_size=16, num_summary=3, summary_per_head=kind == "fixed-per-head")
        fn, pattern = ops.fixed_attention, patterns.fixed_pattern(causal=causal, **sizes)
    templates = []
    template_of = executor_block_sets._MaskTemplate.of

    def recorded(plan, batch):
        template = template_of(plan, batch)
        if template is not None:
            templates.append((plan, template))
        return template

    monkeypatch.setattr(executor_block_sets._MaskTemplate, "of", staticmethod(recorded))
    q, k, v = random_qkv(2, 4, n, D, seed=4)
    out = fn(q, k, v, causal=causal, scale=SCALE, **sizes)
    assert templates, "a periodic pattern must take templates"
    for plan, template in templates:
        nb = plan.block_set.q_pos.shape[0]
        hidden, blind = template.hidden(0, nb, executor_chunks._Workspace(torch.float64, q.device))
        evaluated = ~plan.block_set.mask(2, plan.heads, 0, nb)
        assert torch.equal(hidden, evaluated.expand_as(hidden))
        assert torch.equal(blind, evaluated.expand_as(hidden).all(-1, keepdim=True))
    cotangent = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    actual = (out, *torch.autograd.grad(out, (q, k, v), cotangent))
    expected = outputs_and_grads(lambda q, k, v: dense_reference(pattern, q, k, v, scale=SCALE), q, k, v)
    assert_all_close(actual, expected, **TIGHT)


@pytest.mark.parametrize("shared_keys", [False, True])
def test_attend_blocks_with_a_mask_function_equals_the_mask_and_keeps_no_mask(shared_keys, monkeypatch):
    """`executor_blocked.block_mask` hands `attend_blocks` the predicate as a function of the chunk: outputs,
    log-sum-exps and gradients (float64, padding slots and keys, a query that sees nothing, chunks of one block)
    equal those of the evaluated mask tensor, and the mask's bytes ([b|1, h|1, nb, c, m] bools, saved when the mask
    is a tensor) are not among the tensors saved for backward."""
    from attention_checks import saved_tensor_bytes

    from longattn import executor_blocked, executor_chunks

    monkeypatch.setattr(executor_chunks, "_WORKSPACE_ELEMENTS", 2**8)
    b, h, nb, c, m, n, d = 2, 2, 5, 4, 6, 20, 8
    generator = torch.Generator().manual_seed(2)
    q = torch.randn(b, h, nb, c, d, generator=generator, dtype=torch.float64).requires_grad_()
    k, v = (torch.randn(b, h, n, d, generator=generator, dtype=torch.float64).requires_grad_() for _ in range(2))
    q_pos = torch.arange(nb * c).view(1, nb, c)
    kv_pos = torch.randint(0, n, (1, 1 if shared_keys else nb, m), generator=generator)
    q_valid = torch.ones(1, nb, c, dtype=torch.bool)
    q_valid[0, -1, -1] = False
    kv_valid = torch.rand(1, kv_pos.shape[1], m, generator=generator) > 0.2
    pattern = patterns.and_masks(patterns.sliding_window_mask(window=6), lambda b_, h_, q_idx, kv_idx: h_ + q_idx != 3)
    arguments = dict(mask_fn=pattern, batch=b, heads=torch.arange(h), q_pos=q_pos, kv_pos=kv_pos, q_valid=q_valid)
    arguments["kv_valid"] = kv_valid
    tensor = executor_blocked.evaluate_block_mask(**arguments)
    function = executor_blocked.block_mask(**arguments)
    kv_index = kv_pos[0].expand(nb, m)
    results = []
    for mask in (tensor, function):
        out, lse = executor_blocked.attend_blocks(q, k, v, kv_index=kv_index, mask=mask, scale=0.4)
        loss = (out * torch.linspace(-1, 1, d, dtype=torch.float64)).sum() + lse.masked_fill(lse.isinf(), 0).sum()
        results.append([out, lse, *torch.autograd.grad(loss, (q, k, v))])
    for from_tensor, from_function in zip(*results, strict=True):
        torch.testing.assert_close(from_function, from_tensor, rtol=1e-10, atol=1e-10)

    def step(mask):
        out, _ = executor_blocked.attend_blocks(q, k, v, kv_index=kv_index, mask=mask, scale=0.4)
        out.sum().backward()

    _, saved_with_tensor = saved_tensor_bytes(lambda: step(tensor))
    _, saved_with_function = saved_tensor_bytes(lambda: step(function))
    assert saved_with_function <= saved_with_tensor - tensor.numel(), (saved_with_function, saved_with_tensor)
