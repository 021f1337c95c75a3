"""Kernel side: a rank that ended frees its PID; a later interrupt or stop signals nothing that has it now.

A crashed rank is reaped by the zygote at once, and on a busy machine its PID soon
names some other process (the user's, another job's). nbdist notes each process it
started with its start time, and signals a PID only while it still names that process.
The other process is made here with the dead rank's very PID (Linux's
``/proc/sys/kernel/ns_last_pid``, which needs CAP_SYS_ADMIN in the PID namespace).
"""

from __future__ import annotations

import os
import signal
import subprocess
import time

import psutil
import pytest

import nbdist
from tests.conftest import wait_gone

_LAST_PID = "/proc/sys/kernel/ns_last_pid"


def _process_with_pid(pid: int) -> subprocess.Popen | None:
    """A ``sleep`` whose PID is ``pid`` (None if other processes kept taking it for 60 s)."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if psutil.pid_exists(pid):  # a fork elsewhere took it first: wait until it is free
            time.sleep(0.05)
            continue
        with open(_LAST_PID, "w") as f:
            f.write(str(pid - 1))
        proc = subprocess.Popen(["sleep", "600"])
        if proc.pid == pid:
            return proc
        proc.kill()
        proc.wait()
    return None


def _can_choose_pids() -> bool:
    try:
        with open(_LAST_PID, "w") as f:
            f.write(open(_LAST_PID).read().strip())
        return True
    except OSError:
        return False


@pytest.mark.skipif(
    not _can_choose_pids(), reason=f"{_LAST_PID} is not writable here (needs CAP_SYS_ADMIN)"
)
def test_a_dead_ranks_pid_taken_by_another_process_is_neither_interrupted_nor_stopped():
    s = nbdist.DistSession(2, cpu=True, timeout=120).start()
    other = None
    try:
        pid = s.ranks[1].pid
        os.kill(pid, signal.SIGKILL)
        assert wait_gone([pid]) == []
        other = _process_with_pid(pid)
        assert other is not None, f"no process could be given PID {pid}"
        s.interrupt([1])
        # A SIGINT ends a sleep: given a second to, it must still be there.
        with pytest.raises(subprocess.TimeoutExpired):
            other.wait(timeout=1)
        s.stop()
        with pytest.raises(subprocess.TimeoutExpired):
            other.wait(timeout=1)
    finally:
        s.stop()
        if other is not None:
            other.kill()
            other.wait()
