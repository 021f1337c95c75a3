"""A launched rank's watch on its controller: it ends the process once the address stops answering."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time

import psutil

from nbdist.engine import controller_watch
from tests.conftest import wait_gone

# Stands in for a rank: watches the address it is given (every 0.2 s, gone after 1 s),
# starts two processes of its own as a user's cell might (one ignores SIGTERM), says when
# it watches and their PIDs, then sleeps as a long cell would.
_RANK = """
import subprocess, sys, time
from nbdist.engine import controller_watch
assert controller_watch.start(1.0, period_s=0.2, address=("127.0.0.1", int(sys.argv[1])))
quiet = dict(stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # not holding our pipe open
plain = subprocess.Popen(["sleep", "120"], **quiet)
stubborn = subprocess.Popen(["sh", "-c", "trap '' TERM; sleep 120; true"], **quiet)
print("watching", plain.pid, stubborn.pid, flush=True)
time.sleep(120)
"""


def test_the_process_ends_once_its_controller_stops_answering_and_not_before():
    controller = socket.create_server(("127.0.0.1", 0))
    port = controller.getsockname()[1]
    rank = subprocess.Popen(
        [sys.executable, "-c", _RANK, str(port)], stdout=subprocess.PIPE, text=True
    )
    children: list[psutil.Process] = []
    try:
        word, *pids = rank.stdout.readline().split()
        assert word == "watching"
        children = [psutil.Process(int(pid)) for pid in pids]
        deadline = time.monotonic() + 30
        while not children[1].children() and time.monotonic() < deadline:
            time.sleep(0.05)
        children += children[1].children()  # the shell's sleep, which ignores SIGTERM too
        assert len(children) == 3
        time.sleep(2.5)  # over twice the limit: the controller answers, so the rank stays
        assert rank.poll() is None
        controller.close()
        assert rank.wait(timeout=30) == -signal.SIGTERM
        assert "has not answered for 1 s (its kernel is gone)" in rank.stdout.read()
        # What the rank started went with it, the processes that ignore SIGTERM included
        # (once orphaned they would have run on under init).
        assert wait_gone([child.pid for child in children], timeout=15) == []
    finally:
        for child in children:
            if child.is_running():
                child.kill()
        controller.close()
        if rank.poll() is None:
            rank.kill()
            rank.wait()


def test_outside_an_engine_there_is_nothing_to_watch():
    assert controller_watch.controller_address() is None
    assert controller_watch.start(1.0) is False
