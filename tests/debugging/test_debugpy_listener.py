"""nbdist.engine.debugpy_server.listen in a real process: debugpy inside the rank, no adapter process.

A plain Python process stands for a rank (what ``listen`` does does not depend on
ipyparallel); the kernel's own client (:mod:`nbdist.driver.rank_debugpy`) attaches.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from nbdist.driver.rank_debugpy import ATTACH, INITIALIZE, RankConnection, succeeded

pytest.importorskip("debugpy")

ROOT = Path(__file__).resolve().parents[2]

# The "rank": listens, prints its port, then runs a loop the tests break into.
_RANK = """
import sys, time
from nbdist.engine import debugpy_server
print(debugpy_server.listen()["port"], flush=True)
def step(i):
    x = i * 2
    return x
for i in range(2000):
    step(i)
    time.sleep(0.01)
"""
_LINE = 5  # x = i * 2


@pytest.fixture
def rank(tmp_path):
    def start(**env):
        script = tmp_path / "rank.py"
        script.write_text(_RANK.lstrip())
        proc = subprocess.Popen(
            [sys.executable, str(script)],
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, "PYTHONPATH": str(ROOT), **env},
        )
        started.append(proc)
        return proc, str(script), int(proc.stdout.readline())

    started: list[subprocess.Popen] = []
    yield start
    for proc in started:
        proc.kill()
        proc.wait(timeout=30)


def _attach_and_stop(port: int, script: str) -> int:
    """Attach, stop at the breakpoint, read ``i`` there, disconnect; the ``i`` read."""
    events: list[dict] = []
    client = RankConnection(0, "127.0.0.1", port, lambda r, m: events.append(m))
    try:
        succeeded(client.request("initialize", INITIALIZE))
        succeeded(client.request("attach", ATTACH))
        breakpoints = {"source": {"path": script}, "breakpoints": [{"line": _LINE}]}
        succeeded(client.request("setBreakpoints", breakpoints))
        succeeded(client.request("configurationDone"))
        deadline = time.monotonic() + 60
        while not any(e.get("event") == "stopped" for e in events):
            assert time.monotonic() < deadline, events
            time.sleep(0.02)
        thread = next(e for e in events if e.get("event") == "stopped")["body"]["threadId"]
        frame = succeeded(client.request("stackTrace", {"threadId": thread}))["body"]
        value = succeeded(
            client.request(
                "evaluate", {"expression": "i", "frameId": frame["stackFrames"][0]["id"]}
            )
        )["body"]["result"]
        breakpoints["breakpoints"] = []
        succeeded(client.request("setBreakpoints", breakpoints))
        succeeded(client.request("disconnect", {"terminateDebuggee": False}))
        return int(value)
    finally:
        client.close()
        client.wait_closed(10)


def test_the_rank_starts_no_adapter_process_and_can_be_attached_again(rank):
    """debugpy runs inside the rank (no adapter process per rank: 256 of them cost a
    machine's cores when the debugger came on); a debugger that detaches can attach
    again, and the rank ran on in between."""
    proc, script, port = rank()
    assert psutil.Process(proc.pid).children(recursive=True) == []
    first = _attach_and_stop(port, script)
    time.sleep(0.2)
    second = _attach_and_stop(port, script)
    assert second > first
    assert proc.poll() is None, "the rank ended when the debugger detached"
    assert psutil.Process(proc.pid).children(recursive=True) == []


def test_a_debugpy_log_directory_still_gets_debugpys_whole_log(rank, tmp_path):
    """listen() spares the ranks debugpy's description of the environment only when no
    log would keep it: with DEBUGPY_LOG_DIR set it is logged as debugpy always did."""
    logs = tmp_path / "logs"
    proc, _, _ = rank(DEBUGPY_LOG_DIR=str(logs))
    server_log = logs / f"debugpy.server-{proc.pid}.log"
    assert server_log.exists(), sorted(p.name for p in logs.iterdir())
    text = server_log.read_text()
    assert "Initial environment:" in text and "Installed packages:" in text, text[:2000]
