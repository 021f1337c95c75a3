"""The sidebar's rank rows say when a rank's process is stopped or held by a debugger.

Real processes stand for the ranks (the server reads only their PIDs here): one stopped with
SIGSTOP, one with gdb attached. Each reads idle by its CPU, which alone would hide why its
cell does not move; the row says what holds it, and the summary above 8 ranks lists it
among the deviating ranks, after the dead and before the stragglers.
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
import time

import psutil
import pytest

from nbdist.server.rank_summary import summarise
from nbdist.server.sidebar_state import LiveView


def _entry(pids: list[int]) -> dict:
    """A registry entry of a cluster this kernel started (its ranks' PIDs are read here)."""
    ranks = [
        {"rank": i, "pid": pid, "host": "localhost", "device": "cpu", "pid_here": True}
        for i, pid in enumerate(pids)
    ]
    return {"id": "c", "owned": True, "ranks": ranks}


def _sleeper() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])


def _process_rows(view: LiveView, entry: dict, want: list, limit: float = 60.0) -> list:
    deadline = time.monotonic() + limit
    while True:
        got = [row.get("process") for row in view.rank_rows(entry)]
        if got == want or time.monotonic() > deadline:
            return got
        time.sleep(0.1)


def test_a_stopped_rank_says_so_and_stops_saying_it_once_continued():
    procs = [_sleeper(), _sleeper()]
    try:
        view, entry = LiveView(), _entry([p.pid for p in procs])
        assert _process_rows(view, entry, [None, None]) == [None, None]
        procs[1].send_signal(signal.SIGSTOP)
        assert _process_rows(view, entry, [None, "stopped"]) == [None, "stopped"]
        rows = view.rank_rows(entry)
        assert [row["state"] for row in rows] == ["idle", "idle"]  # by CPU: nothing to tell
        procs[1].send_signal(signal.SIGCONT)
        assert _process_rows(view, entry, [None, None]) == [None, None]
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


def test_above_8_ranks_a_stopped_rank_is_listed_after_the_dead_and_before_the_stragglers():
    rows = [
        {
            "rank": r,
            "host": "a",
            "state": "busy",
            "step": 5,
            "samples_per_s": None,
            "last_seen": None,
        }
        for r in range(12)
    ]
    rows[3]["straggler"] = "step time 3.0x the median"
    rows[7]["process"] = "held by a debugger"
    rows[9]["state"] = "dead"
    rows[10]["process"] = "stopped"
    rows[11]["host"] = "b"
    summary = summarise(rows, time.time())
    assert [(d["rank"], d["why"]) for d in summary["deviating"]] == [
        (9, "dead"),
        (7, "held by a debugger"),
        (10, "stopped"),
        (3, "straggler: step time 3.0x the median"),
    ]
    # Counted busy, as the controller says, and held beside it: overall and in their host's row.
    assert summary["states"] == {"busy": 11, "idle": 0, "dead": 1}
    assert summary["held"] == {"busy": {"held by a debugger": 1, "stopped": 1}}
    assert [(h["host"], h["held"]) for h in summary["hosts"]] == [
        ("a", {"busy": {"held by a debugger": 1, "stopped": 1}}),
        ("b", {}),
    ]


@pytest.mark.skipif(shutil.which("gdb") is None, reason="gdb is not installed (apt install gdb)")
def test_a_rank_a_debugger_holds_says_so_until_detached():
    proc = _sleeper()
    try:
        psutil.Process(proc.pid).status()  # started
        view, entry = LiveView(), _entry([proc.pid])
        # gdb waits on its stdin while attached (the process held); closing it detaches.
        gdb = subprocess.Popen(
            ["gdb", "-q", "-nx", "-p", str(proc.pid)],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            held = ["held by a debugger"]
            assert _process_rows(view, entry, held) == held
        finally:
            gdb.communicate(b"detach\nquit\n", timeout=60)
        assert _process_rows(view, entry, [None]) == [None]
        assert proc.poll() is None  # detached, it runs on
    finally:
        proc.kill()
        proc.wait()
