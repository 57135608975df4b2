"""Fixtures shared by the test files (helpers that are plain functions live in attention_checks.py, kind_configs.py
and script_loading.py, which the test files import)."""

from __future__ import annotations

import pytest


@pytest.fixture
def reference_kernel(monkeypatch):
    """The xformers path on CPU: its kernel replaced by `ReferenceKernel`, the dense reference of the same
    `[B, M, H, K]` contract that materialises xformers' own bias objects; the dispatcher told that xformers can run
    (a test checks itself, where it matters, that its call is one the dispatcher admits on CUDA)."""
    pytest.importorskip("xformers")
    from longattn import backends, executor_xformers

    monkeypatch.setattr(backends.BACKENDS["xformers"], "reasons_not_supported", lambda request: [])
    with executor_xformers.use_kernel(executor_xformers.ReferenceKernel()) as kernel:
        yield kernel
