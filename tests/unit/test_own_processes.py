"""What a launched rank's own code started ends with the rank (nbdist/engine/own_processes.py)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import psutil

from tests.conftest import wait_gone

# Stands in for a rank on another host: asks for its children to end at its exit, starts
# three processes as a cell might (one ignores SIGTERM, one is a grandchild), says their
# PIDs, then exits normally once told to, as an engine does when it is stopped.
_RANK = """
import subprocess, sys
from nbdist.engine import own_processes
own_processes.end_at_exit()
own_processes.end_at_exit()  # once is enough: a second call changes nothing
quiet = dict(stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # not holding our pipe open
plain = subprocess.Popen(["sleep", "120"], **quiet)
stubborn = subprocess.Popen(["sh", "-c", "trap '' TERM; sleep 120; true"], **quiet)
print(plain.pid, stubborn.pid, flush=True)
sys.stdin.readline()
"""


def test_a_rank_ends_what_it_started_when_it_exits_even_what_ignores_sigterm():
    rank = subprocess.Popen(
        [sys.executable, "-c", _RANK], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    pids: list[int] = []
    try:
        pids = [int(pid) for pid in rank.stdout.readline().split()]
        shell = psutil.Process(pids[1])
        deadline = time.monotonic() + 30
        while not shell.children() and time.monotonic() < deadline:
            time.sleep(0.05)
        pids += [p.pid for p in shell.children()]  # the shell's sleep ignores SIGTERM too
        assert len(pids) == 3
        rank.stdin.write("exit\n")
        rank.stdin.flush()
        assert rank.wait(timeout=30) == 0
        assert wait_gone(pids, timeout=15) == []
    finally:
        for pid in pids:  # after a failure: ended by PID, so nothing outlives the test
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if rank.poll() is None:
            rank.kill()
            rank.wait()


# A rank with multiprocessing's resource tracker (a spawn-context semaphore starts it)
# and a process of its own: only the latter is ended.
_WITH_TRACKER = """
import json, multiprocessing, subprocess
from nbdist.engine import own_processes
lock = multiprocessing.get_context("spawn").Semaphore()
from multiprocessing import resource_tracker
tracker = resource_tracker._resource_tracker._pid
child = subprocess.Popen(["sleep", "120"], stdout=subprocess.DEVNULL)
ended = own_processes.end_children()
print(json.dumps([tracker, child.pid, ended]))
"""


def test_the_helpers_that_end_with_the_rank_are_left_to_end_by_themselves():
    out = subprocess.run(
        [sys.executable, "-c", _WITH_TRACKER], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    tracker, child, ended = json.loads(out.stdout)
    assert tracker is not None
    assert ended == [child]
