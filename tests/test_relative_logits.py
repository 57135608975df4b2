"""Relative-position logits (Shaw et al. 2018; seed 003 in 1-D): q·r of the clipped distance added to the logits of
the kept pairs, per layer; exact against the dense reference with the same bias, refused where it has no meaning."""

from __future__ import annotations

import pytest
import torch
from attention_checks import padding_and_global_masks, random_qkv
from kind_configs import kind_config, random_ids

from longattn import LongAttnConfig, LongAttnForCausalLM, LongAttnModel, ops
from longattn.attention_fields import KINDS
from longattn.backends import AttentionRequest, backend_reasons
from longattn.relative_logits import materialize_bias, relative_bias

M = 3  # the largest distance told apart at the test lengths (shorter than the sequences, so clipping is exercised)
TAKES = ["full", "sliding", "strided", "fixed", "sinkhorn", "lsh", "routing", "binary_partition"]
REFUSES = ["efficient", "linformer", "reduction", "synthesizer", "deformable", "adaptive_span"]


def _embedding(d: int = 8, seed: int = 5) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(2 * M + 1, d, generator=generator, dtype=torch.float64).requires_grad_(True)


def _shaw_logits(q: torch.Tensor, embedding: torch.Tensor, scale: float, n_k: int) -> torch.Tensor:
    """scale · q_i · r[clip(j − i, −M, M) + M] for every pair, written out: `[b, h, n_q, n_k]`."""
    n_q = q.shape[2]
    i = torch.arange(n_k - n_q, n_k)[:, None]
    j = torch.arange(n_k)[None, :]
    r = embedding[(j - i).clamp(-M, M) + M]  # [n_q, n_k, d]
    return torch.einsum("bhid,ijd->bhij", q, r) * scale


def test_bias_is_shaws_clipped_term():
    q, _, _ = random_qkv(2, 2, 5, n_k=9)  # cached decoding: the queries are the last 5 of 9 positions
    embedding = _embedding()
    bias_fn = relative_bias(q, embedding, scale=0.3, kv_len=9)
    dense = materialize_bias(bias_fn, batch=2, heads=2, q_len=5, kv_len=9, q_offset=4, device=q.device)
    torch.testing.assert_close(dense, _shaw_logits(q, embedding, 0.3, 9))


def test_reference_adds_the_bias_to_the_scaled_scores():
    q, k, v = random_qkv(1, 2, 11)
    embedding = _embedding()
    scale = 8**-0.5
    scores = q @ k.transpose(-1, -2) * scale + _shaw_logits(q, embedding, scale, 11)
    expected = torch.softmax(scores, dim=-1) @ v
    torch.testing.assert_close(ops.full_attention(q, k, v, backend="reference", relative_embedding=embedding), expected)


OPS = {
    "full": dict(fn=ops.full_attention),
    "sliding": dict(fn=ops.sliding_window_attention, window=4, dilation=[1, 2], global_tokens=True),
    "sliding_band": dict(fn=ops.sliding_window_attention, window=3),
    "strided": dict(fn=ops.strided_attention, stride=5),
    "fixed": dict(fn=ops.fixed_attention, block_size=8, num_summary=2, summary_per_head=True),
}


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("name", sorted(OPS))
def test_ops_equal_reference_with_the_same_bias(name, causal):
    """Every op that computes q·k on kept pairs, its fast executor against the dense reference: outputs and the
    gradients of q, k, v and r, in float64, odd length, left and right padding (and global tokens)."""
    settings = dict(OPS[name])
    fn = settings.pop("fn")
    padding, global_mask = padding_and_global_masks(3, 37)
    if settings.pop("global_tokens", False):
        settings["global_mask"] = global_mask
    results = []
    for backend in ("torch", "reference"):
        q, k, v = random_qkv(3, 2, 37)
        embedding = _embedding()
        out = fn(
            q, k, v, causal=causal, key_padding_mask=padding, backend=backend, relative_embedding=embedding, **settings
        )
        cotangent = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=out.dtype)
        results.append((out, *torch.autograd.grad(out, (q, k, v, embedding), cotangent)))
    for label, fast, slow in zip(("out", "grad_q", "grad_k", "grad_v", "grad_r"), *results, strict=True):
        torch.testing.assert_close(fast, slow, msg=lambda m, label=label: f"{label}: {m}")


def test_flex_score_mod_equals_reference():
    pytest.importorskip("torch.nn.attention.flex_attention")
    q, k, v = random_qkv(2, 2, 29, requires_grad=False)
    padding, _ = padding_and_global_masks(2, 29)
    embedding = _embedding().detach()
    outs = [
        ops.sliding_window_attention(
            q, k, v, window=4, key_padding_mask=padding, backend=backend, relative_embedding=embedding
        )
        for backend in ("flex", "reference")
    ]
    torch.testing.assert_close(*outs)


def _models(kind: str, causal: bool):
    """The same weights under the fast executors and under the dense reference (`attention_backend="reference"`)."""
    config = kind_config(kind, is_decoder=causal, relative_position_logits=True, relative_max_distance=M)
    fast = LongAttnModel(config).double().eval()
    reference_config = kind_config(
        kind, is_decoder=causal, relative_position_logits=True, relative_max_distance=M, attention_backend="reference"
    )
    reference = LongAttnModel(reference_config).double().eval()
    reference.load_state_dict(fast.state_dict())
    return fast, reference


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("kind", TAKES)
def test_kinds_equal_dense_reference(kind, causal):
    """A layer's relative logits, through its kind's executor, equal the dense reference with the same bias: outputs
    on real tokens and the gradients of every parameter, r included, in float64 with padding and an odd length."""
    fast, reference = _models(kind, causal)
    ids = random_ids(2, 23)
    mask = torch.ones(2, 23, dtype=torch.long)
    mask[0, :4] = 0  # left padding
    mask[1, -3:] = 0  # right padding
    keep = mask.bool()[..., None]
    results = []
    for model in (fast, reference):
        model.zero_grad()
        out = model(input_ids=ids, attention_mask=mask).last_hidden_state * keep
        out.pow(2).sum().backward()
        results.append((out, {name: p.grad for name, p in model.named_parameters() if p.grad is not None}))
    (out_fast, grads_fast), (out_ref, grads_ref) = results
    torch.testing.assert_close(out_fast, out_ref)
    assert {f"encoder.layers.{i}.self_attn.relative_embedding.weight" for i in (0, 1)} <= grads_fast.keys()
    assert grads_fast.keys() == grads_ref.keys()
    for name in grads_fast:
        torch.testing.assert_close(grads_fast[name], grads_ref[name], msg=lambda m, name=name: f"{name}: {m}")


def test_relative_logits_change_the_output_and_zero_r_is_the_plain_model():
    config = kind_config("sliding", relative_position_logits=True, relative_max_distance=M)
    model = LongAttnModel(config).double().eval()
    plain = LongAttnModel(kind_config("sliding")).double().eval()
    missing, unexpected = plain.load_state_dict(model.state_dict(), strict=False)
    assert not missing and all("relative_embedding" in key for key in unexpected)
    ids = random_ids(1, 19)
    with torch.no_grad():
        out = model(input_ids=ids).last_hidden_state
        assert not torch.allclose(out, plain(input_ids=ids).last_hidden_state), "r must change the output"
        for layer in model.encoder.layers:
            layer.self_attn.relative_embedding.weight.zero_()
        torch.testing.assert_close(model(input_ids=ids).last_hidden_state, plain(input_ids=ids).last_hidden_state)


def test_save_and_reload_keep_r(tmp_path):
    config = kind_config("strided", relative_position_logits=[False, True], relative_max_distance=M)
    model = LongAttnModel(config).eval()
    model.save_pretrained(tmp_path)
    loaded, info = LongAttnModel.from_pretrained(tmp_path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert loaded.config.relative_position_logits == [False, True] and loaded.config.relative_max_distance == M
    assert loaded.encoder.layers[0].self_attn.relative_embedding is None
    weight = loaded.encoder.layers[1].self_attn.relative_embedding.weight
    assert weight.shape == (2 * M + 1, config.head_dim)
    torch.testing.assert_close(weight, model.encoder.layers[1].self_attn.relative_embedding.weight)
    ids = random_ids(1, 17)
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids).last_hidden_state, model(input_ids=ids).last_hidden_state)


@pytest.mark.parametrize("kind", ["sliding", "fixed"])
def test_bf16_with_padding_has_no_nan(kind):
    model = LongAttnModel(kind_config(kind, relative_position_logits=True, relative_max_distance=M)).to(torch.bfloat16)
    ids = random_ids(3, 21)
    mask = torch.ones(3, 21, dtype=torch.long)
    mask[0, :6] = 0
    mask[1, -5:] = 0
    mask[2] = 0  # a row of padding only: its queries see no key
    out = model(input_ids=ids, attention_mask=mask).last_hidden_state
    out.float().sum().backward()
    assert torch.isfinite(out.float()).all()
    assert all(torch.isfinite(p.grad.float()).all() for p in model.parameters() if p.grad is not None)


def test_cached_generation_equals_uncached():
    """Cached decoding (the dense path, queries the last positions) reads the same relative logits as the full pass."""
    config = kind_config("sliding", relative_position_logits=True, relative_max_distance=M, is_decoder=True)
    model = LongAttnForCausalLM(config).eval()
    ids = random_ids(1, 9)
    cached = model.generate(ids, max_new_tokens=6, do_sample=False, use_cache=True, pad_token_id=0)
    uncached = model.generate(ids, max_new_tokens=6, do_sample=False, use_cache=False, pad_token_id=0)
    assert torch.equal(cached, uncached)


# ---------------------------------------------------------------------------------------------- refusals
@pytest.mark.parametrize("kind", REFUSES)
def test_kinds_without_pair_logits_refuse(kind):
    with pytest.raises(ValueError, match=rf"`relative_position_logits`=True .*'{kind}'.* Allowed"):
        kind_config(kind, relative_position_logits=True)
    # Per layer: the flag may stay off on that kind's layers.
    kind_config(kind, attention_type=[kind, "full"], relative_position_logits=[False, True])


def test_table_states_which_kinds_take_it():
    assert sorted(name for name, spec in KINDS.items() if not spec.no_relative_logits) == sorted(TAKES)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (dict(relative_position_logits="yes"), "`relative_position_logits`='yes' is invalid: expected True, False"),
        (dict(relative_position_logits=[True]), r"`relative_position_logits`=\[True\] has 1 entries"),
        (dict(relative_position_logits=True, relative_max_distance=0), "`relative_max_distance`=0 is invalid"),
        (dict(relative_position_logits=True, relative_max_distance=2.5), "`relative_max_distance`=2.5 is invalid"),
    ],
)
def test_bad_fields_are_named(fields, message):
    with pytest.raises(ValueError, match=message):
        kind_config("full", **fields)


def test_sortcut_and_xformers_refuse():
    with pytest.raises(ValueError, match="`relative_position_logits`=True cannot be used with `sinkhorn_sortcut`"):
        kind_config("sinkhorn", sinkhorn_sortcut=2, relative_position_logits=True)
    with pytest.raises(ValueError, match="`attention_backend`='xformers' cannot run `relative_position_logits`"):
        LongAttnConfig(attention_type="full", attention_backend="xformers", relative_position_logits=True)
    with pytest.raises(ValueError, match="`attention_backend`='triton' cannot run `relative_position_logits`"):
        LongAttnConfig(attention_type="sliding", attention_backend="triton", relative_position_logits=True)
    request = AttentionRequest(
        pattern="sliding", device="cuda", dtype=torch.float16, head_dim=64, value_head_dim=64, q_len=64, kv_len=64
    )
    assert not any("relative" in reason for reason in backend_reasons("xformers", request))
    relative = AttentionRequest(**{**request.__dict__, "relative_logits": True})
    assert any("relative-position logits only as a dense" in reason for reason in backend_reasons("xformers", relative))


def test_bad_embedding_is_named():
    q, k, v = random_qkv(1, 2, 7)
    with pytest.raises(ValueError, match=r"relative_embedding must have shape \[2·max_distance \+ 1, d=8\]"):
        ops.full_attention(q, k, v, relative_embedding=torch.zeros(6, 8, dtype=torch.float64))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("kind", ["lsh", "routing"])
def test_window_dropout_paths_take_the_bias(kind, causal, monkeypatch):
    """With attention dropout, LSH and routing run `attend_windows` on gathered copies instead of the gathered-window
    kernel; its bias carries the relative logits too. Dropout drawn as the identity, so it must equal the dense form."""
    from longattn.attention_routing import routing_attention
    from longattn.ops_lsh import lsh_attention, lsh_rotations

    q, k, v = random_qkv(2, 2, 19)
    embedding = _embedding()
    if kind == "lsh":
        rotations = lsh_rotations(heads=2, head_dim=8, num_hashes=2, num_buckets=4, seed=0)
        settings = dict(rotations=rotations, bucket_size=4, num_buckets=4, causal=causal, relative_embedding=embedding)
        dense = lsh_attention(q, v, num_hashes=2, backend="reference", **settings)
        monkeypatch.setattr(torch.nn.functional, "dropout", lambda x, p=0.5, training=True, inplace=False: x)
        fast = lsh_attention(q, v, num_hashes=2, dropout_p=0.1, **settings)
        inputs = (q, v, embedding)
    else:
        centroids = torch.nn.functional.normalize(torch.randn(2, 3, 8, dtype=torch.float64), dim=-1)
        settings = dict(causal=causal, causal_window=5, relative_embedding=embedding)
        dense = routing_attention(q, k, v, centroids, dense=True, **settings)[0]
        monkeypatch.setattr(torch.nn.functional, "dropout", lambda x, p=0.5, training=True, inplace=False: x)
        fast = routing_attention(q, k, v, centroids, dropout_p=0.1, **settings)
        inputs = (q, k, v, embedding)
    torch.testing.assert_close(fast, dense)
    cotangent = torch.randn(fast.shape, generator=torch.Generator().manual_seed(2), dtype=fast.dtype)
    for grad_fast, grad_dense in zip(
        torch.autograd.grad(fast, inputs, cotangent), torch.autograd.grad(dense, inputs, cotangent), strict=True
    ):
        torch.testing.assert_close(grad_fast, grad_dense)


def test_reference_refuses_a_bias_of_the_wrong_shape():
    q, k, v = random_qkv(1, 2, 7)
    with pytest.raises(ValueError, match=r"bias must be a float tensor broadcastable to \[b, h, n_q, n_k\]"):
        ops.reference_attention(q, k, v, None, bias=torch.zeros(1, 2, 7, 6, dtype=torch.float64))
