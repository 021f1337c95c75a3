"""JupyterLab's debugger on more ranks than the kernel attaches to at once: a real kernel, 9 CPU ranks.

The kernel attaches to the ranks' debuggers a window at a time (at least 4, at most one
per core), each step's requests sent to every rank of the window before any answer is
read. With 9 ranks there are at least three windows on a machine with up to 4 cores,
two up to 8: every rank must be attached with the breakpoints, stop, show its own
values and run on, whichever window it was in.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
import types

import pytest

from nbdist.driver.lab_debugger import RANKS_THREAD, LabDebugRouter
from tests.debugging.test_lab_debugger import (
    LabDebugClient,
    _debugger_on,
    _select_all,
    _stack,
)
from tests.notebooks.conftest import Kernel

RANKS = 9
CELL = "%%on_all_ranks\nx = rank * 10\ny = x + 1\nprint('done', rank, y)"


@pytest.fixture(scope="module")
def many():
    kernel = Kernel()
    try:
        kernel.start_dist(RANKS)
        yield kernel, LabDebugClient(kernel)
    finally:
        kernel.shutdown()


def test_every_rank_stops_at_the_breakpoint_and_runs_on(many):
    kernel, dbg = many
    path = _debugger_on(dbg, CELL, [{"line": 3}])
    msg_id = kernel.submit(CELL)
    dbg.wait_event("stopped", threadId=RANKS_THREAD, count=RANKS, timeout=240)

    tops = _stack(dbg)
    assert sorted(tops) == list(range(RANKS)), tops
    for rank, frame in tops.items():
        assert frame["source"]["path"] == path and frame["line"] == 3, frame
        # Each frame is its own rank's: an evaluate there sees that rank's values.
        value = dbg.request("evaluate", expression="x + rank", frameId=frame["id"], context="repl")
        assert value["body"]["result"] == str(11 * rank), (rank, value)

    _select_all(dbg)
    assert dbg.request("continue", threadId=1)["success"]
    text = dbg.cell_output(msg_id, timeout=240)
    assert kernel.reply(msg_id)["status"] == "ok"
    for rank in range(RANKS):
        assert f"done {rank} {10 * rank + 1}" in text, text
    # No rank's attach failed: the cell says nothing of one it could not attach to.
    assert "could not attach" not in text, text


# A process with debugpy listening on loopback, as a rank's is: prints its port, then waits.
_DEBUGGEE = (
    "import debugpy, sys, time\n"
    "print(debugpy.listen(('127.0.0.1', 0))[1], flush=True)\n"
    "sys.stdin.read()\n"
)


def test_ranks_it_cannot_attach_to_are_named_and_the_others_are_attached():
    """In windows, a rank whose debugpy refuses or hangs up fails alone: the ranks around it,
    in its window and the next, are attached to their (real) debugpy."""
    debuggees = [
        subprocess.Popen(
            [sys.executable, "-c", _DEBUGGEE],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    refused_port = closed.getsockname()[1]
    closed.close()
    hangs_up = socket.socket()
    hangs_up.bind(("127.0.0.1", 0))
    hangs_up.listen(8)

    def hang_up():
        while True:
            try:
                conn, _ = hangs_up.accept()
            except OSError:
                return
            conn.close()

    threading.Thread(target=hang_up, daemon=True).start()
    router = LabDebugRouter(types.SimpleNamespace(do_debug_request=None))
    try:
        ports = [int(d.stdout.readline()) for d in debuggees]
        good = {2: ports[0], 7: ports[1]}  # one in the first window of 4, one in the second
        targets = [
            (
                rank,
                "127.0.0.1",
                good.get(rank, refused_port if rank % 2 else hangs_up.getsockname()[1]),
                None,
                None,
            )
            for rank in range(9)
        ]
        failed = router.connect(targets)
        assert router.connected() == [2, 7]
        assert sorted(failed) == [0, 1, 3, 4, 5, 6, 8]
        assert isinstance(failed[1], ConnectionRefusedError), failed[1]
        assert isinstance(failed[0], ConnectionError), failed[0]  # it hung up
    finally:
        router.disconnect()
        hangs_up.close()
        for debuggee in debuggees:
            debuggee.stdin.close()  # it returns from its read and exits
            debuggee.wait(timeout=30)


# Run in the kernel: the odd ranks lose debugpy (an environment without it), through the
# Python API, which starts no debugger on the ranks as a cell magic would.
_BREAK_ODD_RANKS = """
import nbdist

def _without_debugpy():
    import os, sys
    if int(os.environ["RANK"]) % 2:
        sys.modules["debugpy"] = None  # import debugpy raises ImportError from now on

nbdist.current_session().apply(_without_debugpy)
"""


def test_ranks_the_debugger_cannot_start_on_are_one_line_and_the_others_stop(many):
    """Fresh ranks, the odd ones without debugpy: the cell says once which ranks its
    breakpoints do not stop and why (with the rank numbers in the reason as a range),
    not once per rank; the even ranks stop and the cell ends."""
    kernel, dbg = many
    kernel.ok("%dist_restart")
    kernel.ok(_BREAK_ODD_RANKS)
    dbg.events.clear()
    _debugger_on(dbg, CELL, [{"line": 3}])
    msg_id = kernel.submit(CELL)
    evens = list(range(0, RANKS, 2))
    dbg.wait_event("stopped", threadId=RANKS_THREAD, count=len(evens), timeout=240)
    assert sorted(_stack(dbg)) == evens
    _select_all(dbg)
    assert dbg.request("continue", threadId=1)["success"]
    text = dbg.cell_output(msg_id, timeout=240)
    assert kernel.reply(msg_id)["status"] == "ok"
    said = [line for line in text.splitlines() if "could not" in line]
    assert said == [
        "nbdist: JupyterLab's debugger could not prepare ranks 1,3,5,7 (ImportError: "
        "debugpy is not installed on rank 1–7: pip install debugpy); breakpoints do not "
        "stop them in this cell"
    ], text
    for rank in range(RANKS):
        assert f"done {rank} {10 * rank + 1}" in text, text
