"""Helpers the executor tests share: the dense reference of a pattern, and outputs + gradients compared as one."""

from __future__ import annotations

import torch

from longattn import ops, patterns


def dense_reference(mask_fn, q, k, v, **kwargs):
    """`reference_attention` under `mask_fn` materialised for these shapes (queries are the last n_q positions)."""
    b, h, n_q = q.shape[:3]
    n_k = k.shape[2]
    mask = patterns.materialize_mask(mask_fn, batch=b, heads=h, q_len=n_q, kv_len=n_k, q_offset=n_k - n_q)
    return ops.reference_attention(q, k, v, mask, **kwargs)


def outputs_and_grads(fn, q, k, v, seed=1):
    """`(out, grad_q, grad_k, grad_v)` of `fn(q, k, v)` under a seeded random output gradient."""
    out = fn(q, k, v)
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(out.device, out.dtype)
    return (out, *torch.autograd.grad(out, (q, k, v), grad_out))


def assert_all_close(actual, expected, **tolerance):
    """Compare two `outputs_and_grads` results, naming the tensor that differs."""
    for name, a, e in zip(("out", "grad_q", "grad_k", "grad_v"), actual, expected, strict=True):
        torch.testing.assert_close(a, e, msg=lambda m, name=name: f"{name}: {m}", **tolerance)


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
