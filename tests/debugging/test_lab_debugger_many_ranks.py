"""JupyterLab's debugger on more ranks than the kernel attaches to at once: a real kernel, 9 CPU ranks.

The kernel attaches to the ranks' debuggers a window at a time (at least 4, at most one
per core), each step's requests sent to every rank of the window before any answer is
read. With 9 ranks there are at least three windows on a machine with up to 4 cores,
two up to 8: every rank must be attached with the breakpoints, stop, show its own
values and run on, whichever window it was in.
"""

from __future__ import annotations

import pytest

from nbdist.driver.lab_debugger import RANKS_THREAD
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
