"""Helpers the test files share: the dense reference of a pattern, outputs + gradients compared as one, seeded q/k/v
and padding masks, the parametrised sliding-window cases, and the checks several kinds repeat: a causal op or model
leaks nothing from later positions, a mixed stack trains, what autograd keeps, why xformers refuses a request."""

from __future__ import annotations

import dataclasses
import inspect

import torch
from kind_configs import SIZES

import longattn
from longattn import LongAttnConfig, ops, patterns

# Keyword arguments of a float64 tensor (`torch.randn(..., **DOUBLE)`): the references' precision.
DOUBLE = dict(dtype=torch.float64)

# The tiny model the kinds' model-level checks build: 60 tokens, `SIZES` (hidden 32, 2 heads, 2 layers), 64 positions,
# the default dropout.
TINY_MODEL = dict(vocab_size=60, **SIZES, max_position_embeddings=64)

# Every stack a kind can serve in: encoder (masked LM), decoder (causal LM), encoder-decoder.
EVERY_STACK = [longattn.LongAttnForMaskedLM, longattn.LongAttnForCausalLM, longattn.LongAttnForSeq2SeqLM]


def tiny_config(attention_type, **fields) -> LongAttnConfig:
    """The `TINY_MODEL` config with `attention_type`, `fields` over it."""
    return LongAttnConfig(**{**TINY_MODEL, "attention_type": attention_type, **fields})


def dense_reference(mask_fn, q, k, v, **kwargs):
    """`reference_attention` under `mask_fn` materialised for these shapes (queries are the last n_q positions)."""
    b, h, n_q = q.shape[:3]
    n_k = k.shape[2]
    mask = patterns.materialize_mask(mask_fn, batch=b, heads=h, q_len=n_q, kv_len=n_k, q_offset=n_k - n_q)
    return ops.reference_attention(q, k, v, mask, **kwargs)


def outputs_and_grads(fn, q, k, v, seed=1):
    """`(out, grad_q, grad_k, grad_v)` of `fn(q, k, v)` under a seeded random output gradient."""
    out = fn(q, k, v)
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(
        out.device, out.dtype
    )
    return (out, *torch.autograd.grad(out, (q, k, v), grad_out))


def assert_all_close(actual, expected, **tolerance):
    """Compare two `outputs_and_grads` results, naming the tensor that differs."""
    for name, a, e in zip(("out", "grad_q", "grad_k", "grad_v"), actual, expected, strict=True):
        torch.testing.assert_close(a, e, msg=lambda m, name=name: f"{name}: {m}", **tolerance)


def random_qkv(batch, heads, n_q, head_dim=8, *, n_k=None, dtype=torch.float64, seed=0, requires_grad=True):
    """`[q, k, v]`: q `[b, h, n_q, d]`, k and v `[b, h, n_k, d]` (n_k defaults to n_q), drawn in that order from one
    seeded generator in float64, then cast to `dtype`."""
    generator = torch.Generator().manual_seed(seed)
    n_k = n_q if n_k is None else n_k
    return [
        torch.randn(batch, heads, n, head_dim, generator=generator, dtype=torch.float64)
        .to(dtype)
        .requires_grad_(requires_grad)
        for n in (n_q, n_k, n_k)
    ]


def lengths_mask(length, lengths, *, left=False):
    """Bool `[b, length]`, True = real token: row i holds `lengths[i]` real tokens, at the start (or the end)."""
    keep = torch.arange(length)[None, :] < torch.tensor(lengths)[:, None]
    return keep.flip(-1) if left else keep


def assert_same_on_kept_rows(fast, slow, inputs, keep):
    """Outputs `[b, h, n, d]` equal on the positions `keep` `[b, n]`, and so do the gradients of `inputs` under a
    random cotangent that is zero elsewhere (other positions, e.g. padded queries, may differ)."""
    keep = keep[:, None, :, None].to(fast.dtype)
    torch.testing.assert_close(fast * keep, slow * keep)
    cotangent = torch.randn_like(fast) * keep
    for grad_fast, grad_slow in zip(
        torch.autograd.grad(fast, inputs, cotangent), torch.autograd.grad(slow, inputs, cotangent), strict=True
    ):
        torch.testing.assert_close(grad_fast, grad_slow)


def assert_no_future_leak(model, ids, changed, t, *, seed=None):
    """A causal LM's logits up to position t are the same for `ids` and `changed` (which differ after t only), and
    differ after t (so the check can see a change). `seed`: reseed torch before each run (same random draws)."""
    with torch.no_grad():
        logits = []
        for input_ids in (ids, changed):
            if seed is not None:
                torch.manual_seed(seed)
            logits.append(model(input_ids=input_ids, use_cache=False).logits)
    before, after = logits
    torch.testing.assert_close(after[:, : t + 1], before[:, : t + 1])
    assert not torch.allclose(after[:, t + 1 :], before[:, t + 1 :]), "the test must be able to see a change"


def changed_after(tensors, t, seed):
    """Copies of `tensors` (each `[b, h, n, d]`) whose positions after t are drawn again: standard normal, in each
    tensor's dtype, one after the other from one generator seeded with `seed`."""
    generator = torch.Generator().manual_seed(seed)
    changed = [x.detach().clone() for x in tensors]
    for x in changed:
        x[:, :, t + 1 :] = torch.randn(x[:, :, t + 1 :].shape, generator=generator, dtype=torch.float64).to(x.dtype)
    return changed


def check_op_leaks_nothing(fn, inputs, t, *, seed, atol=1e-12):
    """A causal op: `fn(*inputs)` (`[b, h, n, d]`) up to position t is the same when the inputs change after t
    (`changed_after` with `seed`), and differs after t (so the check can see a change)."""
    before = fn(*inputs)
    after = fn(*changed_after(inputs, t, seed))
    torch.testing.assert_close(after[:, :, : t + 1], before[:, :, : t + 1], rtol=0, atol=atol)
    assert not torch.allclose(after[:, :, t + 1 :], before[:, :, t + 1 :]), "the test must be able to see a change"


def check_causal_model_leaks_nothing(config, t, *, seed=None, modes=(False,)):
    """The causal LM of `config` (seed 0) on 2 x 40 random tokens and on the same tokens changed after position t:
    `assert_no_future_leak` in each training mode of `modes` (False: eval), reseeded with `seed` before each run."""
    torch.manual_seed(0)
    model = longattn.LongAttnForCausalLM(config)
    ids = torch.randint(4, 60, (2, 40))
    changed = ids.clone()
    changed[:, t + 1 :] = torch.randint(4, 60, (2, 40 - t - 1))
    for train in modes:
        model.train(train)
        assert_no_future_leak(model, ids, changed, t, seed=seed)


def check_mixes_with_sliding_layers(model_class, kind, **fields):
    """`assert_mixed_stack_trains` for a tiny model whose encoder alternates sliding and `kind` layers and whose
    decoder (if any) has a `kind` layer then a full one; `fields`: the kind's settings."""
    config = tiny_config(
        ["sliding", kind, "sliding", kind],
        num_hidden_layers=4,
        num_decoder_layers=2,
        decoder_attention_type=[kind, "full"],
        sliding_window=3,
        **fields,
    )
    assert_mixed_stack_trains(model_class, config)


def three_padded_rows(length, *, left=True):
    """Bool `[3, length]`, True = real token: row 0 left-padded by a third (unpadded when not `left`), row 1
    right-padded by a quarter, row 2 all padding (a query that sees no key)."""
    mask = torch.ones(3, length, dtype=torch.bool)
    if left:
        mask[0, : length // 3] = False
    mask[1, length - length // 4 :] = False
    mask[2] = False
    return mask


def padding_and_global_masks(batch, length):
    """`(key_padding_mask, global_mask)`, bool `[batch, length]` (batch >= 2). Padding: row 0 left-padded by 5, row 1
    right-padded by 4, rows 2+ all padding. Global: row 0 token 3; row 1 the first, middle and last tokens."""
    key_padding_mask = torch.ones(batch, length, dtype=torch.bool)
    key_padding_mask[0, :5] = False
    key_padding_mask[1, -4:] = False
    key_padding_mask[2:] = False
    global_mask = torch.zeros(batch, length, dtype=torch.bool)
    global_mask[0, 3] = True
    global_mask[1, [0, length // 2, length - 1]] = True
    return key_padding_mask, global_mask


def sliding_window_case(batch, length, masks, *, dilation, causal, window=2):
    """The keyword arguments of a parametrised sliding-window case (of `ops.sliding_window_attention` and
    `patterns.sliding_window_pattern` alike): `window`, `dilation`, `causal`, and those of the masks of
    `padding_and_global_masks(batch, length)` that `masks` names ("none", "padding", "global", "padding+global")."""
    key_padding_mask, global_mask = padding_and_global_masks(batch, length)
    return dict(
        window=window,
        dilation=dilation,
        causal=causal,
        key_padding_mask=key_padding_mask if "padding" in masks else None,
        global_mask=global_mask if "global" in masks else None,
    )


def assert_mixed_stack_trains(model_class, config):
    """One training step of `model_class(config)` (seed 0) on 2 x 37 tokens, row 1 padded from position 30 (a
    seq2seq model gets the first 11 tokens as decoder input and labels): the loss is finite and every parameter
    receives a gradient."""
    torch.manual_seed(0)
    model = model_class(config).train()
    ids = torch.randint(4, 60, (2, 37))
    mask = torch.ones_like(ids)
    mask[1, 30:] = 0
    extra = {"decoder_input_ids": ids[:, :11]} if model_class is longattn.LongAttnForSeq2SeqLM else {}
    out = model(input_ids=ids, attention_mask=mask, labels=ids[:, :11] if extra else ids, **extra)
    out.loss.backward()
    assert torch.isfinite(out.loss)
    missing = [name for name, p in model.named_parameters() if p.grad is None]
    assert not missing, missing


def xformers_reasons(request, **fields):
    """Why the xformers layouts cannot serve `request` (a `backends.AttentionRequest`) with `fields` replaced:
    `executor_xformers.request_reasons` of its fields (empty: nothing in the layouts' own requirements refuses it)."""
    from longattn import executor_xformers

    request = dataclasses.replace(request, **fields)
    parameters = inspect.signature(executor_xformers.request_reasons).parameters
    return executor_xformers.request_reasons(**{name: getattr(request, name) for name in parameters})


def saved_tensor_bytes(fn):
    """`(floating, other)`: bytes of the distinct tensor storages autograd keeps for backward while `fn()` runs
    (floating point: values and activations; other: integer indices and bool masks)."""
    storages = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        storages[storage.data_ptr()] = (storage.nbytes(), tensor.is_floating_point())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        fn()
    floating = sum(size for size, is_float in storages.values() if is_float)
    return floating, sum(size for size, is_float in storages.values() if not is_float)


def peak_tensor_bytes(fn):
    """Peak of allocated-minus-freed CPU tensor bytes while `fn()` runs, from the profiler's allocation events
    (the tensor MB column of scripts/benchmark.py): what a step adds to memory, workspaces included."""
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    sizes, stack = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        if node.tag == _EventType.Allocation and str(node.extra_fields.device) == "cpu":
            sizes.append((node.start_time_ns, node.extra_fields.alloc_size))
        stack.extend(node.children)
    current = peak = 0
    for _, size in sorted(sizes):
        current += size
        peak = max(peak, current)
    return peak
