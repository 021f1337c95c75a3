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

from nbdist.driver.runner import CellTimeout
from nbdist.driver.sinks import ListSink
from nbdist.driver.status import format_status
from nbdist.errors import NbdistError, RanksInterrupted
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
    os.kill(stopped_pid, signal.SIGCONT)
    _wait_for_state(stopped_pid, psutil.STATUS_SLEEPING)
    assert "kill -CONT" not in format_status(session.status())


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
