"""A rank killed by the kernel's out-of-memory killer: a real OOM kill in a memory cgroup.

A driver process (the "kernel") moves itself into a fresh memory cgroup, starts
2 ranks (which inherit it), caps the cgroup's memory a little above what the
session uses, and runs a cell in which rank 1 allocates until the kernel's OOM
killer ends it. This is how a container's or a batch job's memory limit kills a
rank. Needs root and a writable memory cgroup (v1 or v2); skipped otherwise.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import pytest

from nbdist.driver.oom import _candidates

_DRIVER = textwrap.dedent(
    """
    import os, sys
    cgroup = sys.argv[1]
    with open(os.path.join(cgroup, "cgroup.procs"), "w") as f:
        f.write(str(os.getpid()))  # the ranks, controller and zygote start in it too
    import nbdist
    from nbdist.errors import RankError
    from nbdist.driver.status import format_status

    with nbdist.DistSession(2, cpu=True, timeout=120, group_timeout=60, history=False) as s:
        v2 = os.path.exists(os.path.join(cgroup, "memory.max"))
        used = int(open(os.path.join(cgroup, "memory.current" if v2 else "memory.usage_in_bytes")).read())
        with open(os.path.join(cgroup, "memory.max" if v2 else "memory.limit_in_bytes"), "w") as f:
            f.write(str(used + (300 << 20)))
        try:
            s.run(
                "if rank == 1:\\n"
                "    open('/proc/self/oom_score_adj', 'w').write('1000')  # the one to go\\n"
                "    hog = []\\n"
                "    while True:\\n"
                "        hog.append(b'x' * (20 << 20))\\n"
                "dist.barrier()\\n"
            )
        except RankError as err:
            print("ERROR:", err.ranks, err.failures[0].evalue)
        print("STATUS:", format_status(s.status()))
    """
)


def _memory_cgroup_parent() -> str | None:
    if os.geteuid() != 0:
        return None
    for directory, _ in _candidates(os.getpid()):
        if os.path.isdir(directory) and os.access(directory, os.W_OK):
            return directory
    return None


@pytest.fixture
def memory_cgroup():
    parent = _memory_cgroup_parent()
    if parent is None:
        pytest.skip("needs root and a writable memory cgroup to produce a real OOM kill")
    path = os.path.join(parent, f"nbdist-oom-test-{os.getpid()}")
    try:
        os.mkdir(path)
    except OSError as exc:
        pytest.skip(f"cannot create a memory cgroup under {parent}: {exc}")
    v2 = os.path.exists(os.path.join(path, "memory.max"))
    if not v2 and not os.path.exists(os.path.join(path, "memory.limit_in_bytes")):
        os.rmdir(path)
        pytest.skip(f"{path} has no memory controller")
    try:
        yield path
    finally:
        deadline = time.monotonic() + 15  # its processes are gone once the driver stopped them
        while True:
            try:
                os.rmdir(path)
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)


def test_an_oom_killed_rank_is_named_as_such_with_its_cgroup_and_limit(memory_cgroup):
    out = subprocess.run(
        [sys.executable, "-c", _DRIVER, memory_cgroup],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    error = next(line for line in out.stdout.splitlines() if line.startswith("ERROR:"))
    assert error.startswith("ERROR: [1] pid ")
    assert "killed by the kernel's out-of-memory killer (SIGKILL)" in error
    assert memory_cgroup in error and "ran out of memory (limit " in error
    # %dist_status says the same about rank 1.
    status = out.stdout[out.stdout.index("STATUS:") :]
    assert "dead" in status and "out-of-memory killer" in status
