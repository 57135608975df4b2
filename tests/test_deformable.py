"""Deformable attention on sequences: the definition written out, the fast path against the dense form (outputs and
gradients, float64, odd lengths, padding), offsets' gradients by finite differences, padding never sampled, bf16,
the model's training step and reload, and the refused causal use."""

from __future__ import annotations

import functools

import pytest
import torch
from kind_configs import tiny_config
from transformers import AutoModel

import longattn
from longattn.attention_deformable import (
    DeformableAttention,
    deformable_attention,
    deformable_weights,
    sampling_positions,
    token_positions,
)

# The tiny config of kind_configs.py in deformable layers of 3 levels and 2 points, 512 positions (fields over it).
config = functools.partial(
    tiny_config, "deformable", max_position_embeddings=512, deformable_levels=3, deformable_points=2
)


def inputs(b=2, h=2, n=13, d=4, levels=3, points=2, seed=0, spread=3.0):
    """Random float64 values, offsets (a few cells, fractional) and weights (one softmax over levels and points)."""
    generator = torch.Generator().manual_seed(seed)
    v = torch.randn(b, h, n, d, generator=generator, dtype=torch.float64)
    offsets = torch.randn(b, h, n, levels, points, generator=generator, dtype=torch.float64) * spread
    logits = torch.randn(b, h, n, levels * points, generator=generator, dtype=torch.float64)
    probs = torch.softmax(logits, -1).view(b, h, n, levels, points)
    return v, offsets, probs


def padding(n: int) -> torch.Tensor:
    """Row 0 left-padded by 4, row 1 right-padded from 9 (odd real lengths, n - 4 and 9)."""
    mask = torch.ones(2, n, dtype=torch.bool)
    mask[0, :4] = False
    mask[1, 9:] = False
    return mask


def written_out(v, offsets, probs, mask):
    """The definition, one query and one sample at a time: pool the real tokens of the row into groups of 2^l, read
    cells floor(x), floor(x) + 1 of the level with weights 1 - frac, frac (zero outside the real cells)."""
    b, h, n, d = v.shape
    levels, points = offsets.shape[3:]
    out = torch.zeros_like(v)
    for row in range(b):
        real = v[row][:, mask[row]] if mask is not None else v[row]  # [h, r, d]
        r = real.shape[1]
        positions = torch.arange(n) if mask is None else (mask[row].long().cumsum(0) - 1).clamp(min=0)
        for level in range(levels):
            ratio = 2**level
            cells = [real[:, j * ratio : (j + 1) * ratio].mean(1) for j in range(-(-r // ratio))]  # each [h, d]
            for head in range(h):
                for i in range(n):
                    reference = (positions[i].item() + 0.5) / ratio - 0.5
                    for point in range(points):
                        x = reference + offsets[row, head, i, level, point]
                        left = int(torch.floor(x))
                        frac = x - left
                        for cell, weight in ((left, 1 - frac), (left + 1, frac)):
                            if 0 <= cell < len(cells):
                                out[row, head, i] += probs[row, head, i, level, point] * weight * cells[cell][head]
    return out


@pytest.mark.parametrize("with_padding", [False, True])
def test_fast_and_dense_paths_equal_the_definition_written_out(with_padding):
    v, offsets, probs = inputs(n=11)
    mask = padding(11) if with_padding else None
    expected = written_out(v, offsets, probs, mask)
    fast = deformable_attention(v, offsets, probs, mask)
    dense = deformable_weights(offsets, probs, mask, 11) @ v
    real = slice(None) if mask is None else mask[:, None, :, None].expand_as(v)
    torch.testing.assert_close(fast[real], expected[real])
    torch.testing.assert_close(dense[real], expected[real])


@pytest.mark.parametrize("n", [13, 17])
@pytest.mark.parametrize("with_padding", [False, True])
def test_fast_path_equals_dense_reference_outputs_and_gradients(n, with_padding):
    v, offsets, probs = inputs(n=n, levels=3, points=3)
    mask = padding(n) if with_padding else None
    leaves = [t.clone().requires_grad_() for t in (v, offsets, probs)]
    grad_out = torch.randn(v.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)

    def outputs_and_grads(fn):
        out = fn(*leaves)
        return (out, *torch.autograd.grad(out, leaves, grad_out))

    fast = outputs_and_grads(lambda v, o, p: deformable_attention(v, o, p, mask))
    dense = outputs_and_grads(lambda v, o, p: deformable_weights(o, p, mask, n) @ v)
    for name, a, e in zip(("out", "grad_v", "grad_offsets", "grad_probs"), fast, dense, strict=True):
        torch.testing.assert_close(a, e, msg=lambda m, name=name: f"{name}: {m}")


def test_layer_fast_path_equals_its_dense_form_with_parameter_gradients():
    """The layer on the torch back end and with `output_attentions` (the dense map): outputs, every gradient."""
    torch.manual_seed(0)
    layer = DeformableAttention(config(), layer_idx=0, is_causal=False).double()
    for p in layer.parameters():  # away from the zero-weight start, so that offsets depend on the token
        torch.nn.init.normal_(p, std=0.5)
    hidden = torch.randn(2, 15, 32, dtype=torch.float64)
    mask = padding(15)

    def run(dense):
        layer.zero_grad()
        out, weights = layer(hidden, attention_mask=mask, output_attentions=dense)
        out[mask].square().sum().backward()
        return out[mask], {name: p.grad.clone() for name, p in layer.named_parameters()}, weights

    fast_out, fast_grads, _ = run(False)
    dense_out, dense_grads, weights = run(True)
    torch.testing.assert_close(fast_out, dense_out)
    assert fast_grads.keys() == dense_grads.keys() and {"offset_proj.weight", "weight_proj.weight"} <= fast_grads.keys()
    for name in fast_grads:
        torch.testing.assert_close(fast_grads[name], dense_grads[name], msg=name)
    assert weights.shape == (2, 2, 15, 15) and not weights[~mask[:, None, None, :].expand_as(weights)].any()


def test_gradients_to_the_offsets_match_finite_differences():
    """gradcheck in float64 with every sampling position at least 0.2 from an integer (interpolation has kinks
    there), some of them outside the row or in its padding (their neighbour reads zero)."""
    v, _, probs = inputs(b=2, h=2, n=7, d=3, levels=2, points=2)
    mask = torch.ones(2, 7, dtype=torch.bool)
    mask[1, 5:] = False
    generator = torch.Generator().manual_seed(3)
    cell = torch.randint(-2, 8, probs.shape, generator=generator).double()
    target = cell + 0.2 + 0.6 * torch.rand(probs.shape, generator=generator, dtype=torch.float64)
    reference = sampling_positions(torch.zeros_like(probs), token_positions(mask, 2, 7, v.device))
    offsets = (target - reference).requires_grad_()
    torch.autograd.gradcheck(lambda o: deformable_attention(v, o, probs, mask), (offsets,), eps=1e-6, atol=1e-7)
    assert torch.autograd.grad(deformable_attention(v, offsets, probs, mask).sum(), offsets)[0].abs().sum() > 0


def test_zero_offsets_on_one_level_read_the_querys_own_value():
    """Level 0, one point, offset 0: the reference point is the query's own token, also under left padding."""
    v, _, _ = inputs(n=9, levels=1, points=1)
    mask = padding(9)
    ones = torch.ones(2, 2, 9, 1, 1, dtype=torch.float64)
    out = deformable_attention(v, torch.zeros_like(ones), ones, mask)
    real = mask[:, None, :, None].expand_as(v)
    torch.testing.assert_close(out[real], v[real])


def test_padded_positions_are_never_sampled():
    """Changing the values (and tokens) at padded positions changes no real token's output; the dense map gives
    padded tokens zero weight; a row padded left or right equals the row alone."""
    v, offsets, probs = inputs(n=13, spread=8.0)
    mask = padding(13)
    changed = v.masked_fill(~mask[:, None, :, None], 1e3)
    real = mask[:, None, :, None].expand_as(v)
    torch.testing.assert_close(
        deformable_attention(changed, offsets, probs, mask)[real], deformable_attention(v, offsets, probs, mask)[real]
    )
    weights = deformable_weights(offsets, probs, mask, 13)
    assert not weights[~mask[:, None, None, :].expand_as(weights)].any()

    torch.manual_seed(0)
    model = longattn.LongAttnModel(config()).eval()
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.3)
    ids = torch.randint(4, 50, (1, 11))
    attention = torch.ones(1, 16, dtype=torch.long)
    attention[0, :5] = 0
    with torch.no_grad():
        alone = model(input_ids=ids).last_hidden_state
        for pad in (0, 7):
            padded = torch.cat([torch.full((1, 5), pad), ids], 1)
            torch.testing.assert_close(
                model(input_ids=padded, attention_mask=attention).last_hidden_state[:, 5:], alone, rtol=1e-4, atol=1e-5
            )


def test_softmax_is_one_over_all_levels_and_points():
    torch.manual_seed(0)
    layer = DeformableAttention(config(deformable_levels=3, deformable_points=2), layer_idx=0, is_causal=False)
    torch.nn.init.normal_(layer.weight_proj.weight)
    offsets, probs = layer.sampling(torch.randn(2, 9, 32))
    assert offsets.shape == probs.shape == (2, 2, 9, 3, 2)
    torch.testing.assert_close(probs.sum((-1, -2)), torch.ones(2, 2, 9))
    assert not torch.allclose(probs.sum(-1)[..., 0], torch.full((2, 2, 9), 0.5)), "levels must share one softmax"


def test_fast_path_never_builds_an_n_by_n_tensor():
    from torch.utils._python_dispatch import TorchDispatchMode

    class Shapes(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.shapes = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, torch.Tensor):
                    self.shapes.append(tuple(t.shape))
            return out

    n = 96
    v, offsets, probs = inputs(n=n, levels=4, points=4)
    with Shapes() as recorded:
        deformable_attention(v, offsets, probs, padding(n))
    assert recorded.shapes and all(sum(size >= n for size in shape) <= 1 for shape in recorded.shapes)


def test_bf16_forward_and_backward_with_padding_have_no_nan():
    torch.manual_seed(0)
    model = longattn.LongAttnForMaskedLM(config()).to(torch.bfloat16).train()
    ids = torch.randint(4, 50, (2, 301))
    mask = torch.ones_like(ids)
    mask[0, :37] = 0
    mask[1, 200:] = 0
    out = model(input_ids=ids, attention_mask=mask, labels=ids)
    assert torch.isfinite(out.logits.float()).all() and torch.isfinite(out.loss.float())
    out.loss.backward()
    assert all(torch.isfinite(p.grad.float()).all() for p in model.parameters() if p.grad is not None)


def test_model_trains_a_step_and_reloads_through_auto_model(tmp_path):
    torch.manual_seed(0)
    model = longattn.LongAttnForMaskedLM(config(deformable_levels=[2, 3])).train()
    ids = torch.randint(4, 50, (2, 23))
    before = model.longattn.encoder.layers[0].self_attn.offset_proj.weight.detach().clone()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    after = model.longattn.encoder.layers[0].self_attn.offset_proj.weight
    assert not torch.equal(before, after), "the offsets must learn"
    model.longattn.save_pretrained(tmp_path)
    loaded = AutoModel.from_pretrained(tmp_path).eval()
    assert type(loaded.encoder.layers[1].self_attn) is DeformableAttention and loaded.config.deformable_levels == [2, 3]
    with torch.no_grad():
        torch.testing.assert_close(
            loaded(input_ids=ids).last_hidden_state,
            model.longattn.eval()(input_ids=ids).last_hidden_state,
            rtol=0,
            atol=0,
        )


def test_decoder_use_is_refused_with_the_reason():
    with pytest.raises(
        ValueError,
        match=r"`attention_type`='deformable' cannot be causal: a pooled level averages "
        r"later tokens and interpolation reads the next cell",
    ):
        config(is_decoder=True)


@pytest.mark.parametrize(
    "field, value", [("deformable_levels", 0), ("deformable_points", [2, 2, 2]), ("deformable_points", 1.5)]
)
def test_bad_fields_name_the_field(field, value):
    with pytest.raises(ValueError, match=f"`{field}`="):
        config(**{field: value})


def test_stock_transformers_models_refuse_the_kind():
    from transformers import BertConfig, BertModel

    model = BertModel(
        BertConfig(vocab_size=50, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64)
    )
    with pytest.raises(ValueError, match="'deformable' cannot run in a stock transformers model.*hidden states"):
        longattn.apply_longattn(model, attention_type="deformable")


def test_training_keeps_only_its_inputs_for_backward():
    """Forward keeps v, offsets and weights for backward, nothing per sample: the pooled levels, neighbour indices,
    interpolation weights and gathered cells are recomputed in backward."""
    v, offsets, probs = inputs(b=2, h=2, n=1029, d=16, levels=4, points=4)
    leaves = [t.float().requires_grad_() for t in (v, offsets, probs)]
    mask = padding(1029)
    storages = {}

    def pack(x):
        storages[x.untyped_storage().data_ptr()] = x.untyped_storage().nbytes()
        return x

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        deformable_attention(*leaves, mask)
    assert sum(storages.values()) <= sum(t.nbytes for t in leaves) + mask.nbytes + 4096, storages


@pytest.mark.parametrize("n", [37, 50])
@pytest.mark.parametrize("with_padding", [False, True])
def test_chunked_backward_equals_the_dense_reference(n, with_padding, monkeypatch):
    """Many chunks of queries (two queries each), four levels: outputs and gradients equal the dense form."""
    import longattn.attention_deformable as deformable

    monkeypatch.setattr(deformable, "_CHUNK_SAMPLES", 2 * 2 * 2 * 2 * 4 * 3)
    v, offsets, probs = inputs(n=n, levels=4, points=3, spread=5.0)
    mask = padding(n) if with_padding else None
    leaves = [t.clone().requires_grad_() for t in (v, offsets, probs)]
    grad_out = torch.randn(v.shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    fast = deformable_attention(*leaves, mask)
    dense = deformable_weights(leaves[1], leaves[2], mask, n) @ leaves[0]
    torch.testing.assert_close(fast, dense)
    names = ("grad_v", "grad_offsets", "grad_probs")
    pairs = zip(torch.autograd.grad(fast, leaves, grad_out), torch.autograd.grad(dense, leaves, grad_out), strict=True)
    for name, (a, e) in zip(names, pairs, strict=True):
        torch.testing.assert_close(a, e, msg=lambda m, name=name: f"{name}: {m}")
