"""Fixtures shared by the test files (helpers that are plain functions live in attention_checks.py, kind_configs.py
and script_loading.py, which the test files import)."""

from __future__ import annotations

import os

# Triton reads this when its kernels are defined (on import of `longattn.executor_triton`): set before any import
# of triton, its kernels run on CPU through its interpreter (tests/test_triton_band.py). Nothing else in the suite
# uses Triton: torch's CPU compiler generates C++, and the xformers tests use its bias objects only.
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402


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
