"""The deadlines of tests/child_processes.py: a process tree that outlives its deadline is killed whole, the
session-leaving grandchildren included, and the test fails instead of waiting."""

from __future__ import annotations

import os
import sys
import time

import pytest
from child_processes import run, start_ranks

# A child that starts a grandchild in a session of its own (as torch.distributed.elastic starts each rank), which
# holds the pipes and sleeps; the grandchild's pid goes to the file named by argv[1].
LAUNCHER = """
import subprocess, sys, time
grandchild = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
open(sys.argv[1], "w").write(str(grandchild.pid))
time.sleep(600)
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A killed process that its (dead) parent never reaped lingers as a zombie until init reaps it.
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rpartition(")")[2].split()[0] != "Z"
    except FileNotFoundError:  # reaped meanwhile
        return False


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads the process tree from /proc")
def test_run_kills_the_whole_tree_at_the_deadline(tmp_path):
    pid_file = tmp_path / "grandchild"
    start = time.monotonic()
    # 8 s: time for the child to start its grandchild even on a loaded machine.
    with pytest.raises(pytest.fail.Exception, match="ran past its 8 s: killed with every process it started"):
        run([sys.executable, "-c", LAUNCHER, str(pid_file)], timeout=8)
    assert time.monotonic() - start < 60  # not the grandchild's 600 s
    grandchild = int(pid_file.read_text())
    deadline = time.monotonic() + 10
    while _alive(grandchild) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(grandchild)


def test_run_returns_what_subprocess_run_returns():
    code = "import sys; print('out'); print('err', file=sys.stderr); sys.exit(3)"
    done = run([sys.executable, "-c", code], timeout=60)
    assert (done.returncode, done.stdout, done.stderr) == (3, "out\n", "err\n")
    with pytest.raises(Exception, match="returned non-zero exit status 3"):
        run([sys.executable, "-c", "raise SystemExit(3)"], timeout=60, check=True)


def _sleeping_rank(rank: int) -> None:
    if rank == 1:
        time.sleep(600)


def _failing_rank(rank: int) -> None:
    if rank == 1:
        raise RuntimeError("rank 1 broke")
    time.sleep(600)


def test_start_ranks_kills_ranks_past_the_deadline():
    start = time.monotonic()
    # Rank 0 returns at once, rank 1 sleeps (on a loaded machine rank 0 may not have ended yet either).
    with pytest.raises(pytest.fail.Exception, match="[12] of 2 ranks still ran after 3 s: killed") as failed:
        start_ranks(_sleeping_rank, args=(), nprocs=2, timeout=3)
    # The failure shows where the ranks that ran on waited: rank 1 in its sleep.
    assert "--- rank 1 (pid " in str(failed.value) and "in _sleeping_rank" in str(failed.value)
    assert time.monotonic() - start < 30


def test_start_ranks_fails_at_once_when_a_rank_raises():
    start = time.monotonic()
    with pytest.raises(Exception, match="rank 1 broke"):
        start_ranks(_failing_rank, args=(), nprocs=2, timeout=300)
    assert time.monotonic() - start < 30  # the sleeping rank was terminated, not waited for
