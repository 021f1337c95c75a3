"""A rank whose process is stopped (SIGSTOP, Ctrl-Z in its terminal, a scheduler's suspend)
while a cell runs: 2 real gloo ranks, rank 1 stopped by the test.

A stopped process takes no signal and answers nothing until it is continued, so waiting for
it is waiting for nothing: the cell ends once the others are released, says which process
is stopped and the command that lets it go on, and the next cell (which must form the group
again after the release) is refused at once, where it waited until the controller dropped
the silent engine (30 s) and then named the rank dead. Continued, the rank takes its
interrupt and the group forms again.
"""

from __future__ import annotations

import _thread
import os
import signal
import threading
import time

import psutil
import pytest

from nbdist.dashboard.text import summary_text
from nbdist.driver.runner import CellTimeout
from nbdist.driver.sinks import ListSink
from nbdist.driver.status import format_status
from nbdist.errors import NbdistError, RankError, RanksInterrupted
from tests.faults.failing import failing_cell
from tests.faults.two_ranks import reduce_works, two_ranks

# Every rank reduces until interrupted: rank 0 waits in all_reduce for the stopped rank 1.
_REDUCING = "t = torch.ones(1)\nwhile True:\n    dist.all_reduce(t)"


@pytest.fixture(scope="module")
def session():
    with two_ranks() as s:
        s.run("import os\npid = os.getpid()", sink=ListSink())
        yield s


@pytest.fixture
def stopped_pid(session):
    """Rank 1's PID, its process stopped; continued after the test whatever happens."""
    pid = session.pull("pid")[1]
    os.kill(pid, signal.SIGSTOP)
    _wait_for_state(pid, psutil.STATUS_STOPPED)
    try:
        yield pid
    finally:
        os.kill(pid, signal.SIGCONT)


def _wait_for_state(pid: int, state: str, limit: float = 10.0) -> None:
    deadline = time.monotonic() + limit
    while psutil.Process(pid).status() != state:
        assert time.monotonic() < deadline, f"pid {pid} is {psutil.Process(pid).status()}"
        time.sleep(0.01)


def _continue_once_said(pid: int, sink: ListSink, said: list) -> None:
    """In the background: once the cell said something under rank 1 (kept in ``said``), or
    after 20 s, continue rank 1's process ``pid``: the cell ends either way."""

    def watch():
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and not said:
            said.extend(e for e in list(sink.events) if e[:3] == ("line", "stderr", "rank 1"))
            time.sleep(0.1)
        os.kill(pid, signal.SIGCONT)

    threading.Thread(target=watch, daemon=True).start()


def _next_cell_refused_then_continued(session, pid: int) -> None:
    """The next cell is refused while rank 1 is stopped; continued, the group works again."""
    with pytest.raises(NbdistError) as refused:
        session.run("x = 1", sink=ListSink())
    words = str(refused.value)
    assert "the process group must be formed again after the release" in words, words
    assert f"rank 1 cannot join it until continued: the process here of rank 1 (pid {pid})" in words
    assert f"`kill -CONT {pid}` lets it go on" in words, words
    assert psutil.Process(pid).status() == psutil.STATUS_STOPPED  # nothing was sent to it
    os.kill(pid, signal.SIGCONT)
    reduce_works(session)
    assert session.pull("pid")[1] == pid  # the same process, its namespace kept


def test_a_cell_past_its_timeout_names_the_stopped_rank_and_the_command_that_continues_it(
    session, stopped_pid
):
    with pytest.raises(CellTimeout) as timed_out:
        session.run(_REDUCING, timeout=3, sink=ListSink())
    words = str(timed_out.value)
    # The where report says it without waiting for an answer that cannot come...
    assert "rank 1: not asked: its process is stopped (SIGSTOP, or Ctrl-Z in its terminal)" in words
    assert "rank 0: inside all_reduce #" in words, words
    # ...and the error, what lets it go on.
    assert (
        f"rank 1 cannot take the interrupt until continued: the process here of rank 1 "
        f"(pid {stopped_pid}) is stopped (SIGSTOP, or Ctrl-Z in its terminal): "
        f"`kill -CONT {stopped_pid}` lets it go on; %dist_restart starts fresh ranks"
    ) in words
    assert "rank 1 interrupted where it was (its process is stopped" in words, words
    assert psutil.Process(stopped_pid).status() == psutil.STATUS_STOPPED
    _next_cell_refused_then_continued(session, stopped_pid)


def test_an_interrupt_with_a_rank_stopped_names_it_instead_of_a_blocked_collective(
    session, stopped_pid
):
    rank0_inside = threading.Event()

    def interrupt_once_rank0_waits():
        # Rank 0 waits in its all-reduce for the stopped rank: interrupted there.
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            where = session.where([0])
            if where and (where[0].collective or {}).get("inside"):
                rank0_inside.set()
                break
            time.sleep(0.1)
        _thread.interrupt_main()  # SIGINT's handler, as the kernel's interrupt runs it

    threading.Thread(target=interrupt_once_rank0_waits, daemon=True).start()
    with pytest.raises(RanksInterrupted) as interrupted:
        session.run(_REDUCING, sink=ListSink())
    assert rank0_inside.is_set()
    error = interrupted.value
    assert error.still_running == (1,) and error.suspended == (1,)
    assert str(error) == (
        f"rank 1 cannot take the interrupt until continued: the process here of rank 1 "
        f"(pid {stopped_pid}) is stopped (SIGSTOP, or Ctrl-Z in its terminal): "
        f"`kill -CONT {stopped_pid}` lets it go on; or %dist_restart"
    )
    assert "blocked in a collective" not in "\n".join(error._render_traceback_())
    _next_cell_refused_then_continued(session, stopped_pid)


def test_status_names_the_stopped_rank_which_the_controller_still_counts_as_idle(
    session, stopped_pid
):
    rows = session.status()
    assert [row["state"] for row in rows] == ["idle", "idle"]  # the controller's word
    assert [row.get("process") for row in rows] == [None, "stopped"]
    words = (
        f"the process here of rank 1 (pid {stopped_pid}) is stopped (SIGSTOP, or Ctrl-Z in its "
        f"terminal): `kill -CONT {stopped_pid}` lets it go on"
    )
    assert words in format_status(rows).splitlines()
    # The dashboard's table (its text form here) says it beside the state.
    states = session.rank_states()
    assert states == {0: "idle", 1: "idle"} and getattr(states[1], "held", "") == "stopped"
    table = summary_text(session.metrics, session.rank_states)
    assert [line.split("  ")[-1] for line in table.splitlines()[2:4]] == [
        "idle",
        "idle · stopped",
    ], table
    os.kill(stopped_pid, signal.SIGCONT)
    _wait_for_state(stopped_pid, psutil.STATUS_SLEEPING)
    assert "kill -CONT" not in format_status(session.status())
    assert "stopped" not in summary_text(session.metrics, session.rank_states)


def test_a_rank_failing_while_another_is_stopped_ends_the_cell_naming_both(session, stopped_pid):
    # Rank 0 fails; rank 1, stopped, never begins the cell. Before, the cell waited until the
    # controller dropped the stopped rank's silent engine (30 s), then named it dead; here
    # the cell's --timeout (25 s) would end it first.
    err = failing_cell(
        session,
        "if rank == 0:\n    raise ValueError('bad batch')\nt = torch.ones(1)\ndist.all_reduce(t)",
        timeout=25,
    )
    text = str(err)
    assert [(f.rank, f.ename) for f in err.failures] == [(0, "ValueError")], text
    assert (
        "rank 0 failed; the others were released: rank 1 interrupted where it was (its process "
        "is stopped: the interrupt waits until continued)"
    ) in text
    # Forming the group again after the cell cannot wait for it either.
    assert "Forming the process group again failed (the process group must be formed" in text
    assert f"`kill -CONT {stopped_pid}` lets it go on" in text, text
    assert psutil.Process(stopped_pid).status() == psutil.STATUS_STOPPED
    _next_cell_refused_then_continued(session, stopped_pid)


def test_a_rank_stopped_inside_the_cell_after_another_failed_is_waited_for_and_said_so(session):
    # Rank 1 begins the cell (its all-reduce waits for rank 0), then rank 0 stops it and
    # fails. Once continued, rank 1 may still be in a collective of the cell: the cell waits
    # for it. Before, it waited in silence for as long as the rank stayed stopped.
    pid = session.pull("pid")[1]
    cell = (
        "import os, signal, time\n"
        "t = torch.ones(1)\n"
        "if rank == 0:\n"
        "    time.sleep(0.5)\n"
        f"    os.kill({pid}, signal.SIGSTOP)\n"
        "    time.sleep(0.2)\n"
        "    raise ValueError('bad batch')\n"
        "dist.all_reduce(t)"
    )
    sink, said = ListSink(), []
    _continue_once_said(pid, sink, said)
    with pytest.raises(RankError) as info:
        session.run(cell, timeout=60, sink=sink)
    assert [(f.rank, f.ename) for f in info.value.failures] == [(0, "ValueError")]
    assert [e[3] for e in said] == [
        "nbdist: the ranks were released; the cell waits for this one, which had begun it: "
        f"its process here (pid {pid}) is stopped (SIGSTOP, or Ctrl-Z in its terminal): "
        f"`kill -CONT {pid}` lets it go on; once it goes on, it is released too; interrupt the "
        "cell to stop waiting"
    ]
    reduce_works(session)
    assert session.pull("pid")[1] == pid


def test_a_cell_waiting_for_a_stopped_rank_says_so_under_it_and_ends_once_continued(
    session, stopped_pid
):
    # No rank fails: rank 0 waits in its all-reduce for rank 1, which cannot begin the cell.
    # Before, the cell waited in silence for as long as the rank stayed stopped.
    sink, said = ListSink(), []
    _continue_once_said(stopped_pid, sink, said)
    session.run("t = torch.ones(1)\ndist.all_reduce(t)\nx = t.item()", timeout=60, sink=sink)
    assert session.pull("x") == [2.0, 2.0]  # continued, rank 1 ran the cell: nothing lost
    assert [e[3] for e in said] == [
        f"nbdist: the cell waits for this rank: its process here (pid {stopped_pid}) is "
        f"stopped (SIGSTOP, or Ctrl-Z in its terminal): `kill -CONT {stopped_pid}` lets it go "
        "on; ranks that reach a collective with it wait there until it goes on; interrupt the "
        "cell to stop waiting"
    ]
    reduce_works(session)


def test_a_rank_stopped_for_a_moment_inside_a_cell_is_not_said_to_be_waited_for(session):
    # A debugger's step or py-spy's dump holds a process for a moment: no note for that.
    pid = session.pull("pid")[1]
    cell = (
        "import os, signal, time\n"
        "if rank == 0:\n"
        f"    os.kill({pid}, signal.SIGSTOP)\n"
        "    time.sleep(0.5)\n"
        f"    os.kill({pid}, signal.SIGCONT)\n"
        "time.sleep(3)\n"
        "t = torch.ones(1)\n"
        "dist.all_reduce(t)\n"
        "x = t.item()"
    )
    sink = ListSink()
    try:
        session.run(cell, timeout=60, sink=sink)
        assert session.pull("x") == [2.0, 2.0]
    finally:
        os.kill(pid, signal.SIGCONT)
    assert [e for e in sink.events if e[:2] == ("line", "stderr")] == []
