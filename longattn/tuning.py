"""Chunk sizes of the blocked executors, chosen per machine from the cache sizes the OS reports.

The blocked executors (`executor_gathered`, `executor_block_sets`, `executor_band`; their budget is read in
`executor_chunks`) cut their work into chunks of query blocks and reuse one set of workspaces per chunk; a chunk's
workspaces should stay within the cache a core can call its own, or every chunk streams them from memory. The rule
(evidence in docs/benchmarks.md, "Chunk sizes per machine"):

    workspace elements = the largest power of two whose float32 bytes fit in the last-level cache share of one core
    (the L3 size over the CPUs sharing it, plus the core's own L2), clamped to [2**18, 2**21].

Everything is read once per process from `/sys/devices/system/cpu/cpu0/cache` (Linux), else `os.sysconf`; where
neither says anything, the clamp's top, 2**21 (the constant this rule replaces). The environment variable
`LONGATTN_WORKSPACE_ELEMENTS` overrides the rule (a power of two or not; for measurements).
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

__all__ = ["cache_sizes", "workspace_elements"]

_CACHE_DIR = Path("/sys/devices/system/cpu/cpu0/cache")
_SMALLEST, _LARGEST = 2**18, 2**21
OVERRIDE_VARIABLE = "LONGATTN_WORKSPACE_ELEMENTS"


def _cpu_count(cpu_list: str) -> int:
    """CPUs in a sysfs list such as "0-3,8-11"."""
    count = 0
    for part in cpu_list.strip().split(","):
        if not part:
            continue
        first, _, last = part.partition("-")
        count += int(last or first) - int(first) + 1
    return max(1, count)


def _size_bytes(text: str) -> int:
    text = text.strip().upper()
    units = {"K": 2**10, "M": 2**20, "G": 2**30}
    return int(text[:-1]) * units[text[-1]] if text and text[-1] in units else int(text or 0)


@functools.cache
def cache_sizes() -> dict[str, int]:
    """Bytes of each data cache level per instance, as the OS reports them: {"L1d": ..., "L2": ..., "L3": ...}
    (levels it does not report are left out), plus "L3 per core": the last-level cache over the CPUs sharing it."""
    sizes: dict[str, int] = {}
    try:
        for index in sorted(_CACHE_DIR.glob("index*")):
            kind = (index / "type").read_text().strip()
            if kind == "Instruction":
                continue
            level = int((index / "level").read_text())
            size = _size_bytes((index / "size").read_text())
            name = "L1d" if level == 1 else f"L{level}"
            sizes[name] = size
            if level >= 3:
                shared = _cpu_count((index / "shared_cpu_list").read_text())
                sizes[f"L{level} per core"] = size // shared
    except (OSError, ValueError):
        sizes = {}
    if not sizes:
        for name, key in (("L1d", "SC_LEVEL1_DCACHE_SIZE"), ("L2", "SC_LEVEL2_CACHE_SIZE")):
            try:
                value = os.sysconf(key)
            except (ValueError, OSError):
                continue
            if value and value > 0:
                sizes[name] = value
    return sizes


@functools.cache
def workspace_elements() -> int:
    """Elements (all workspaces of one chunk together) of the blocked executors' chunks on this machine: the rule of
    the module docstring, or `LONGATTN_WORKSPACE_ELEMENTS`."""
    override = os.environ.get(OVERRIDE_VARIABLE)
    if override:
        return max(1, int(override))
    sizes = cache_sizes()
    per_core = sizes.get("L3 per core", 0) + sizes.get("L2", 0)
    if per_core <= 0:
        return _LARGEST
    elements = per_core // 4  # float32
    power = 1 << (elements.bit_length() - 1)
    return max(_SMALLEST, min(_LARGEST, power))
