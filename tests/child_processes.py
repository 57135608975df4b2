"""Child processes started by the tests, each with a deadline that ends every process it started.

A test that waits on a process fails at the deadline with what the process printed; it never holds up the suite.
Neither standard way is enough on its own:
- `subprocess.run(timeout=...)` kills only its direct child. `accelerate launch` starts its ranks through
  torch.distributed.elastic, which puts each rank in a session of its own, so the ranks outlive a killed launcher:
  they hold the CPUs and may wait on each other in a collective for the process group's timeout (30 minutes).
- `torch.multiprocessing.start_processes` joins its ranks with no deadline at all.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import subprocess
import tempfile
import textwrap
import time
from pathlib import Path

import pytest
import torch.multiprocessing as mp

TAIL = 4000  # characters of a killed process's output shown in the failure

# The start of a child script that must run where longattn cannot be imported (tests/test_hub.py and
# tests/test_sharing.py load saved folders there with trust_remote_code): a finder refuses longattn, the repository
# (the script's third argument) is taken off sys.path, and the script stops if longattn still imports (it would
# prove nothing). Imports json, sys and Path for the rest of the script.
WITHOUT_LONGATTN = textwrap.dedent(
    """
    import importlib.abc, json, sys
    from pathlib import Path

    class NoLongattn(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name == "longattn" or name.startswith("longattn."):
                raise ModuleNotFoundError(f"No module named {name!r}")

    sys.meta_path.insert(0, NoLongattn())
    repo = Path(sys.argv[3]).resolve()
    sys.path[:] = [p for p in sys.path if p and Path(p).resolve() != repo]
    try:
        import longattn  # noqa: F401
    except ModuleNotFoundError:
        pass
    else:
        raise SystemExit("longattn is importable: the test would prove nothing")
    """
)


def _children_by_parent() -> dict[int, list[int]]:
    """Every live process's pid under its parent's, read from /proc (empty where there is no /proc)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:  # ended while we read
            continue
        # Field 2, the command name, is in parentheses and may hold spaces: the fields after the last ")" are fixed,
        # state first, then the parent's pid.
        parent = int(text.rpartition(")")[2].split()[1])
        children.setdefault(parent, []).append(int(stat.parent.name))
    return children


def _tree(pid: int) -> list[int]:
    """`pid` and every process below it, whatever session each runs in."""
    children, found = _children_by_parent(), [pid]
    for process in found:  # grows while it is walked: breadth first
        found.extend(children.get(process, []))
    return found


def kill_tree(pid: int) -> None:
    """SIGKILL `pid` and every process below it. The tree is stopped first and read again: a process killed first
    would hand its children to init before they were found, and a stopped one cannot start another."""
    for sig in (signal.SIGSTOP, signal.SIGKILL):
        for process in _tree(pid):
            try:
                os.kill(process, sig)
            except ProcessLookupError:
                pass


def run(command: list[str], *, timeout: float, check: bool = False, **popen_kwargs) -> subprocess.CompletedProcess:
    """`subprocess.run(command, capture_output=True, text=True, timeout=timeout, check=check, **popen_kwargs)`,
    except that at the deadline every process the command started is killed and the test fails with its output."""
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **popen_kwargs) as child:
        try:
            stdout, stderr = child.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            kill_tree(child.pid)
            try:  # the pipes close once every process that held them is gone
                stdout, stderr = child.communicate(timeout=30)
            except subprocess.TimeoutExpired:
                stdout, stderr = "", "(a process outside the tree still holds the pipes)"
            pytest.fail(
                f"{' '.join(map(str, command[:4]))} ... ran past its {timeout:.0f} s: killed with every process it "
                f"started\n--- stdout\n{stdout[-TAIL:]}\n--- stderr\n{stderr[-TAIL:]}",
                pytrace=False,
            )
    done = subprocess.CompletedProcess(command, child.returncode, stdout, stderr)
    if check:
        done.check_returncode()
    return done


def _rank_with_stacks(rank: int, worker, stacks_dir: str, *args) -> None:
    """`worker(rank, *args)`, with every thread's Python stack written to `stacks_dir/rank<rank>.txt` on SIGUSR1
    (faulthandler's handler runs even while the rank waits in C, in a collective).

    A rank that returns leaves at once with `os._exit(0)`, as a forked child should: the interpreter's exit path
    (multiprocessing's finalizers, then flushing sys.stdout and sys.stderr) takes locks that another thread of the
    test process (pytest's, tqdm's monitor) may have held at the moment of the fork, and a lock copied held is held
    forever. The rank's results are in files it has already closed; a rank that raises goes through
    `start_processes`' own error path, which records the exception first."""
    stacks = open(Path(stacks_dir) / f"rank{rank}.txt", "w")  # noqa: SIM115 - open until the process ends
    faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)
    worker(rank, *args)
    os._exit(0)


def _stacks_of(ranks: list[tuple[int, mp.Process]], stacks_dir: Path) -> str:
    """The Python stacks of these (rank, process) pairs, each asked for them by SIGUSR1 (a few seconds at most)."""
    for _, process in ranks:
        try:
            os.kill(process.pid, signal.SIGUSR1)
        except ProcessLookupError:
            pass
    files = {rank: stacks_dir / f"rank{rank}.txt" for rank, _ in ranks}
    give_up = time.monotonic() + 5
    while time.monotonic() < give_up and not all(path.exists() and path.stat().st_size for path in files.values()):
        time.sleep(0.1)
    return "".join(
        # Most recent call first: the head is where the rank waits (the tail is the test process's stack, forked).
        f"\n--- rank {rank} (pid {process.pid})\n" + (files[rank].read_text()[:TAIL] or "(no stacks)")
        for rank, process in ranks
    )


def start_ranks(worker, args: tuple, nprocs: int, *, timeout: float = 300.0) -> None:
    """`torch.multiprocessing.start_processes(worker, args, nprocs, start_method="fork")` joined with a deadline: a
    rank that raises fails the test at once (the others are terminated, as `start_processes` does); ranks still
    running at the deadline are killed and the test fails with their Python stacks (every thread's, where each
    waited).

    Forked, not spawned: a spawned process imports torch, transformers and longattn again (about 5 s of CPU each,
    more than the ranks' own work); a forked one starts with them."""
    if "fork" not in mp.get_all_start_methods():
        pytest.skip("forks its processes")
    with tempfile.TemporaryDirectory(prefix="rank-stacks-") as stacks_dir:
        context = mp.start_processes(
            _rank_with_stacks, args=(worker, stacks_dir, *args), nprocs=nprocs, start_method="fork", join=False
        )
        deadline = time.monotonic() + timeout
        while not context.join(timeout=max(0.0, deadline - time.monotonic())):
            if time.monotonic() >= deadline:
                ranks = [(rank, process) for rank, process in enumerate(context.processes) if process.is_alive()]
                stacks = _stacks_of(ranks, Path(stacks_dir))
                for _, process in ranks:
                    kill_tree(process.pid)
                pytest.fail(
                    f"{len(ranks)} of {nprocs} ranks still ran after {timeout:.0f} s: killed. Their stacks:{stacks}",
                    pytrace=False,
                )
