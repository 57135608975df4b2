"""`longattn.tuning`: the blocked executors' workspace budget follows the cache sizes the OS reports."""

import pytest

from longattn import executor_band, executor_chunks, tuning


@pytest.fixture
def fake_caches(tmp_path, monkeypatch):
    """A fake `/sys/devices/system/cpu/cpu0/cache`; returns a function that writes its levels."""
    monkeypatch.setattr(tuning, "_CACHE_DIR", tmp_path)
    monkeypatch.delenv(tuning.OVERRIDE_VARIABLE, raising=False)

    def write(*levels):
        for i, (level, kind, size, shared) in enumerate(levels):
            index = tmp_path / f"index{i}"
            index.mkdir()
            for name, value in (("level", level), ("type", kind), ("size", size), ("shared_cpu_list", shared)):
                (index / name).write_text(f"{value}\n")
        tuning.cache_sizes.cache_clear()
        tuning.workspace_elements.cache_clear()

    yield write
    tuning.cache_sizes.cache_clear()
    tuning.workspace_elements.cache_clear()


def test_budget_is_the_core_share_of_the_caches(fake_caches):
    # 2-core AMD EPYC: 32 MB of L3 for 2 CPUs, 512 KB of L2 -> 16.5 MB -> 2**22 floats, capped at 2**21.
    fake_caches((1, "Data", "32K", "0"), (1, "Instruction", "32K", "0"), (2, "Unified", "512K", "0"),
                (3, "Unified", "32768K", "0-1"))  # fmt: skip
    assert tuning.cache_sizes() == {"L1d": 32768, "L2": 524288, "L3": 2**25, "L3 per core": 2**24}
    assert tuning.workspace_elements() == 2**21


def test_small_cache_share_gives_smaller_chunks(fake_caches):
    # A server part with 1.375 MB of L3 per core (Skylake-SP style) and 1 MB of L2: 2.4 MB -> 2**19 floats.
    fake_caches((1, "Data", "32K", "0"), (2, "Unified", "1024K", "0"), (3, "Unified", "38912K", "0-27"))
    assert tuning.workspace_elements() == 2**19


def test_tiny_or_unknown_caches_stay_within_the_clamp(fake_caches, monkeypatch, tmp_path):
    fake_caches((2, "Unified", "256K", "0"))
    assert tuning.workspace_elements() == 2**18  # 64K floats, raised to the floor
    monkeypatch.setattr(tuning, "_CACHE_DIR", tmp_path / "absent")  # no sysfs: os.sysconf, else the cap
    monkeypatch.setattr(tuning.os, "sysconf", lambda name: -1)
    tuning.cache_sizes.cache_clear()
    tuning.workspace_elements.cache_clear()
    assert tuning.workspace_elements() == 2**21


def test_environment_overrides_the_rule(fake_caches, monkeypatch):
    fake_caches((3, "Unified", "32768K", "0-1"))
    monkeypatch.setenv(tuning.OVERRIDE_VARIABLE, "4096")
    tuning.workspace_elements.cache_clear()
    assert tuning.workspace_elements() == 4096


def test_cpu_lists_are_counted():
    assert tuning._cpu_count("0-3,8-11") == 8 and tuning._cpu_count("5") == 1 and tuning._cpu_count("") == 1


def test_executor_budgets_follow_the_rule():
    assert executor_chunks._WORKSPACE_ELEMENTS == tuning.workspace_elements()
    assert executor_chunks._CHUNK_ELEMENTS == executor_band._BAND_CHUNK_ELEMENTS == tuning.workspace_elements() // 2
