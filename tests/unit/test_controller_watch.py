"""A launched rank's watch on its controller: it ends the process once the address stops answering."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time

from nbdist.engine import controller_watch

# Stands in for a rank: watches the address it is given (every 0.2 s, gone after 1 s),
# says when it watches, then sleeps as a long cell would.
_RANK = """
import sys, time
from nbdist.engine import controller_watch
assert controller_watch.start(1.0, period_s=0.2, address=("127.0.0.1", int(sys.argv[1])))
print("watching", flush=True)
time.sleep(120)
"""


def test_the_process_ends_once_its_controller_stops_answering_and_not_before():
    controller = socket.create_server(("127.0.0.1", 0))
    port = controller.getsockname()[1]
    rank = subprocess.Popen(
        [sys.executable, "-c", _RANK, str(port)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert rank.stdout.readline().strip() == "watching"
        time.sleep(2.5)  # over twice the limit: the controller answers, so the rank stays
        assert rank.poll() is None
        controller.close()
        assert rank.wait(timeout=30) == -signal.SIGTERM
        assert "has not answered for 1 s (its kernel is gone)" in rank.stdout.read()
    finally:
        controller.close()
        if rank.poll() is None:
            rank.kill()
            rank.wait()


def test_outside_an_engine_there_is_nothing_to_watch():
    assert controller_watch.controller_address() is None
    assert controller_watch.start(1.0) is False
