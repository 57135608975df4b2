"""Packed documents (several per row, `position_ids` restarting at 0 or the varlen keywords): attention never
crosses a document boundary, in every kind and back end.

For kinds whose pattern does not depend on content, a packed forward and backward equals each document run alone
(float64); for content-based kinds (LSH, routing, Sinkhorn) no weight crosses a boundary; kinds that cannot pack
refuse with a `ValueError`.
"""

from __future__ import annotations

import pytest
import torch
from kind_configs import kind_config, random_ids

from longattn import LongAttnForSequenceClassification, LongAttnModel, executor_xformers, ops, patterns
from longattn.backends import BACKENDS, AttentionRequest
from longattn.packing import document_ids_from_cu_seq_lens, document_ids_from_position_ids, packed_document_ids

# Two packed rows of 24 tokens; odd lengths, so no document starts on a block boundary.
ROWS = ((7, 12, 5), (11, 13))
PATTERN_KINDS = ("full", "sliding", "strided", "fixed")
# Content or state that is per document once packed: Sinkhorn sorts each document's blocks among themselves (laid
# out on block boundaries), efficient attention runs each document as a row of its own.
EXACT_KINDS = (*PATTERN_KINDS, "sinkhorn", "efficient")
CONTENT_KINDS = ("lsh", "routing", "sinkhorn")
REFUSING_KINDS = ("linformer", "synthesizer", "reduction", "adaptive_span", "binary_partition", "deformable")


def _positions(rows=ROWS) -> torch.Tensor:
    return torch.stack([torch.cat([torch.arange(n) for n in row]) for row in rows])  # [b, n]


def _documents(rows=ROWS):
    """(row, start, stop) of every document."""
    spans = []
    for r, row in enumerate(rows):
        start = 0
        for n in row:
            spans.append((r, start, start + n))
            start += n
    return spans


def _model(kind: str, *, causal: bool, backend: str = "torch", **fields) -> LongAttnModel:
    config = kind_config(
        kind, is_decoder=causal, use_cache=False, attention_backend=backend, position_embedding_type="rope", **fields
    )
    torch.manual_seed(0)
    return LongAttnModel(config).double().eval()


def _forward_backward(model, ids, weights, **inputs):
    """Output `[b, n, D]` and the gradients of `(output * weights).sum()` with respect to every parameter."""
    out = model(ids, **inputs).last_hidden_state
    params = [p for p in model.parameters() if p.requires_grad]
    grads = torch.autograd.grad((out * weights).sum(), params, allow_unused=True)
    return out, [torch.zeros_like(p) if g is None else g for p, g in zip(params, grads)]


def assert_packed_equals_alone(model, *, global_first: bool = False, rows=ROWS, **packed_inputs):
    """Packed rows give each document's output, and the sum of its gradients, of the document run alone."""
    ids = random_ids(len(rows), sum(rows[0]))
    weights = torch.randn(
        *ids.shape, model.config.hidden_size, dtype=torch.float64, generator=torch.Generator().manual_seed(1)
    )
    packed_inputs.setdefault("position_ids", _positions(rows))
    if global_first:
        packed_inputs["global_attention_mask"] = packed_inputs["position_ids"] == 0
    out, grads = _forward_backward(model, ids, weights, **packed_inputs)
    alone_grads = [torch.zeros_like(g) for g in grads]
    for r, start, stop in _documents(rows):
        inputs = {}
        if global_first:
            inputs["global_attention_mask"] = (torch.arange(stop - start) == 0)[None]
        out_doc, grads_doc = _forward_backward(
            model, ids[r : r + 1, start:stop], weights[r : r + 1, start:stop], **inputs
        )
        torch.testing.assert_close(out[r : r + 1, start:stop], out_doc, atol=1e-9, rtol=0)
        alone_grads = [a + g for a, g in zip(alone_grads, grads_doc)]
    for packed, alone in zip(grads, alone_grads):
        torch.testing.assert_close(packed, alone, atol=1e-9, rtol=0)


# ---------------------------------------------------------------------------------------------- document ids
def test_document_ids_from_position_ids_and_cu_seq_lens_agree():
    documents = document_ids_from_position_ids(_positions())
    assert documents.tolist() == [[0] * 7 + [1] * 12 + [2] * 5, [0] * 11 + [1] * 13]
    cu = torch.tensor([0, 7, 19, 24, 35, 48], dtype=torch.int32)
    by_lengths = document_ids_from_cu_seq_lens(cu, batch=2, length=24)
    assert torch.equal(by_lengths == by_lengths[:, :1], documents == 0)  # the same boundaries
    assert packed_document_ids(position_ids=torch.arange(24)[None], batch=2, length=24) is None  # not packed
    # Left padding, whose positions generation fills with a constant, is not a document of its own.
    left_padded = torch.tensor([[1, 1, 1, 0, 1, 2, 3], [0, 1, 2, 3, 4, 5, 6]])
    mask = left_padded.new_tensor([[0, 0, 0, 1, 1, 1, 1], [1] * 7])
    assert packed_document_ids(position_ids=left_padded, batch=2, length=7, attention_mask=mask) is None


@pytest.mark.parametrize(
    ("cu_q", "cu_k", "match"),
    [
        ([0, 20, 48], [0, 20, 48], "crossing the end of a row"),
        ([0, 7, 40], [0, 7, 40], "rise from 0 to batch"),
        ([0, 24, 48], [0, 20, 48], "differs from"),
        ([0, 24, 48], None, "given alone"),
    ],
)
def test_bad_varlen_keywords_are_refused(cu_q, cu_k, match):
    with pytest.raises(ValueError, match=match):
        packed_document_ids(
            position_ids=None,
            batch=2,
            length=24,
            cu_seq_lens_q=torch.tensor(cu_q),
            cu_seq_lens_k=None if cu_k is None else torch.tensor(cu_k),
        )


# ---------------------------------------------------------------------------------------------- exact kinds
@pytest.mark.parametrize("backend", ["torch", "reference"])
@pytest.mark.parametrize("causal", [False, True], ids=["encoder", "decoder"])
@pytest.mark.parametrize("kind", EXACT_KINDS)
def test_packed_kind_equals_documents_alone(kind, causal, backend):
    assert_packed_equals_alone(_model(kind, causal=causal, backend=backend))


@pytest.mark.parametrize("backend", ["torch", "reference"])
def test_packed_causal_routing_equals_documents_alone(backend):
    """Causal routing splits each cluster per document: a query's W most recent keys are those it has alone."""
    assert_packed_equals_alone(_model("routing", causal=True, backend=backend))


@pytest.mark.parametrize(
    ("kind", "causal"),
    [("sliding", False), ("sliding", True), ("fixed", False), ("sinkhorn", False), ("sinkhorn", True)],
)
def test_packed_relative_logits_equal_documents_alone(kind, causal):
    """Documents are contiguous, so j - i of a kept (same-document) pair is its distance within the document:
    relative-position logits give a packed row each document's output of the document alone (fixed: on the laid-out
    rows, read at the original positions; Sinkhorn: blocks sorted within their document)."""
    model = _model(kind, causal=causal, relative_position_logits=True, relative_max_distance=3)
    assert_packed_equals_alone(model)


# ---------------------------------------------------------------------------------------------- content kinds
@pytest.mark.parametrize("causal", [False, True], ids=["encoder", "decoder"])
@pytest.mark.parametrize("kind", CONTENT_KINDS)
def test_content_kind_never_attends_across_documents(kind, causal):
    """No attention weight joins two documents: the dense weights are zero across boundaries, and in the fast path
    the outputs of one document have zero gradient with respect to every other document's inputs (bucket, cluster
    and block choices carry no gradient, so only an attention weight could carry one)."""
    model = _model(kind, causal=causal)
    positions = _positions()
    documents = document_ids_from_position_ids(positions)
    embeds = model.get_input_embeddings()(random_ids(*positions.shape)).detach().requires_grad_(True)
    weights = model(inputs_embeds=embeds, position_ids=positions, output_attentions=True).attentions
    across = documents[:, None, :, None] != documents[:, None, None, :]  # [b, 1, n, n]
    for layer_weights in weights:
        assert layer_weights.masked_select(across).abs().max() == 0
        assert layer_weights.masked_select(~across).abs().max() > 0
    out = model(inputs_embeds=embeds, position_ids=positions).last_hidden_state
    probe = torch.randn(out.shape, dtype=out.dtype, generator=torch.Generator().manual_seed(1))  # LayerNorm: not .sum()
    for r, start, stop in _documents():
        (grad,) = torch.autograd.grad((out * probe)[r, start:stop].sum(), embeds, retain_graph=True)
        inside = torch.zeros_like(documents, dtype=torch.bool)
        inside[r, start:stop] = True
        assert grad[~inside].abs().max() == 0, f"document {r}:{start}-{stop} reads another document"
        assert grad[inside].abs().max() > 0


# ---------------------------------------------------------------------------------------------- refusals
@pytest.mark.parametrize("kind", REFUSING_KINDS)
def test_kind_without_packing_refuses_packed_rows(kind):
    model = _model(kind, causal=False)
    with pytest.raises(ValueError, match=f"attention_type '{kind}'.*cannot run packed documents"):
        model(random_ids(2, 24), position_ids=_positions())
    model(random_ids(2, 24), position_ids=torch.arange(24)[None])  # restarting nowhere: not packed, runs


def test_sequence_classification_refuses_packed_rows():
    config = kind_config("sliding", num_labels=3)
    model = LongAttnForSequenceClassification(config).eval()
    with pytest.raises(ValueError, match="sequence classification reads one label per row"):
        model(random_ids(2, 24), position_ids=_positions())


def test_encoder_decoder_refuses_packed_rows():
    model = LongAttnModel(kind_config("sliding", is_encoder_decoder=True)).eval()
    with pytest.raises(ValueError, match="encoder-decoder model"):
        model(random_ids(2, 24), position_ids=_positions(), decoder_input_ids=random_ids(2, 5))


def test_sinkhorn_sortcut_refuses_packed_rows():
    model = _model("sinkhorn", causal=False, sinkhorn_sortcut=2)
    with pytest.raises(ValueError, match="SortCut"):
        model(random_ids(2, 24), position_ids=_positions())


@pytest.mark.parametrize("causal", [False, True], ids=["encoder", "decoder"])
def test_packed_global_tokens_are_global_within_their_document(causal):
    assert_packed_equals_alone(_model("sliding", causal=causal), global_first=True)


def test_varlen_keywords_equal_restarting_positions():
    """`cu_seq_lens_q` / `cu_seq_lens_k` over the flattened batch (one row) mark the same documents; positions
    restart from them when `position_ids` is not given."""
    rows = ((7, 12, 5),)
    cu = torch.tensor([0, 7, 19, 24], dtype=torch.int32)
    model = _model("fixed", causal=True)
    varlen = dict(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=12, max_length_k=12)
    assert_packed_equals_alone(model, rows=rows, position_ids=None, **varlen)


# ---------------------------------------------------------------------------------------------- GPU back ends on CPU
def _qkv(b=2, h=2, n=24, d=8, dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(b, h, n, d, generator=g, dtype=dtype) for _ in range(3)]


OPS_CASES = [
    ("full", ops.full_attention, {}),
    ("sliding", ops.sliding_window_attention, {"window": 3}),
    ("dilated", ops.sliding_window_attention, {"window": 2, "dilation": 2}),
    ("strided", ops.strided_attention, {"stride": 4}),
    ("fixed", ops.fixed_attention, {"block_size": 5, "num_summary": 2}),
]


@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
@pytest.mark.parametrize(("name", "fn", "fields"), OPS_CASES, ids=[case[0] for case in OPS_CASES])
def test_flex_document_mask_equals_reference(name, fn, fields, causal):
    """FlexAttention (forward only on CPU) reads the same document predicate as the reference."""
    pytest.importorskip("torch.nn.attention.flex_attention")
    q, k, v = _qkv()
    documents = document_ids_from_position_ids(_positions())
    expected = fn(q, k, v, causal=causal, document_ids=documents, backend="reference", **fields)
    with torch.no_grad():
        got = fn(q, k, v, causal=causal, document_ids=documents, backend="flex", **fields)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
def test_long_packed_band_keeps_documents_apart_in_plain_blocks(causal):
    """Rows long enough for the fused band path's plain blocks (whose one shared band mask knows only the window,
    global and padding keys): the same-document test still hides the keys of the neighbouring documents, global
    tokens (each document's first) included."""
    rows = ((150, 90, 160), (230, 170))
    q, k, v = (
        torch.randn(2, 2, 400, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(i)) for i in range(3)
    )
    positions = _positions(rows)
    documents = document_ids_from_position_ids(positions)
    fields = dict(window=16, causal=causal, document_ids=documents, global_mask=positions == 0)  # global per document
    expected = ops.sliding_window_attention(q, k, v, backend="reference", **fields)
    got = ops.sliding_window_attention(q, k, v, backend="torch", **fields)
    torch.testing.assert_close(got, expected, atol=1e-9, rtol=0)


@pytest.mark.parametrize(("causal", "window"), [(False, None), (True, None), (True, 3)])
def test_xformers_block_diagonal_bias_is_the_document_pattern(causal, window):
    """The xformers bias built for packed documents, materialised, is the pattern's mask over the flattened batch."""
    pytest.importorskip("xformers")
    documents = document_ids_from_position_ids(_positions())
    b, n = documents.shape
    bias = executor_xformers.document_bias(documents, causal=causal, window=window)
    visible = bias.materialize((b * n, b * n), dtype=torch.float32).isfinite()  # [b·n, b·n]
    if window is None:
        mask_fn = patterns.and_masks(
            *([patterns.causal_mask()] if causal else []), patterns.same_document_mask(documents)
        )
    else:
        mask_fn = patterns.sliding_window_pattern(window=window, causal=True, document_ids=documents)
    expected = patterns.materialize_mask(mask_fn, batch=b, heads=1, q_len=n, kv_len=n)[:, 0]  # [b, n, n]
    assert torch.equal(visible, torch.block_diag(*expected))


@pytest.mark.parametrize(
    ("fn", "fields", "causal"),
    [
        (ops.full_attention, {}, False),
        (ops.full_attention, {}, True),
        (ops.sliding_window_attention, {"window": 3}, True),
    ],
)
def test_xformers_document_path_runs_and_equals_reference(reference_kernel, fn, fields, causal):
    q, k, v = _qkv()
    documents = document_ids_from_position_ids(_positions())
    expected = fn(q, k, v, causal=causal, document_ids=documents, backend="reference", **fields)
    got = fn(q, k, v, causal=causal, document_ids=documents, backend="xformers", **fields)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_dispatcher_keeps_xformers_off_documents_it_cannot_map():
    q, k, v = _qkv()
    request = AttentionRequest.for_inputs(q, k, v, pattern="sliding", causal=False, documents=True)
    assert any("packed documents" in reason for reason in BACKENDS["xformers"].reasons_not_supported(request))
    causal = AttentionRequest.for_inputs(q, k, v, pattern="sliding", causal=True, documents=True)
    assert not any("packed documents" in reason for reason in BACKENDS["xformers"].reasons_not_supported(causal))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="FlexAttention's compiled kernels and xformers need CUDA")
@pytest.mark.parametrize("backend", ["flex", "xformers"])
@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
@pytest.mark.parametrize(("name", "fn", "fields"), OPS_CASES, ids=[case[0] for case in OPS_CASES])
def test_gpu_back_ends_keep_documents_apart(name, fn, fields, causal, backend):
    """On CUDA, in float32 (no float64 kernels): output and gradients equal the reference within 1e-5."""
    if backend == "xformers":
        pytest.importorskip("xformers")
        if not (name == "full" or (name == "sliding" and causal)):
            pytest.skip("xformers maps full attention and causal windows of packed documents only")
    q, k, v = (t.cuda().requires_grad_() for t in _qkv())
    documents = document_ids_from_position_ids(_positions()).cuda()
    results = []
    for run in ("reference", backend):
        out = fn(q, k, v, causal=causal, document_ids=documents, backend=run, **fields)
        results.append((out, *torch.autograd.grad(out.square().sum(), (q, k, v))))
    for expected, got in zip(*results):
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
