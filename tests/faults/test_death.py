"""A rank dies in the middle of a cell: SIGKILL (also what the out-of-memory killer sends), a segfault."""

from __future__ import annotations

import os
import signal
import time

import psutil
import pytest

import nbdist
from nbdist.dashboard.table import rank_rows
from nbdist.driver.sinks import ListSink
from nbdist.driver.status import format_status
from nbdist.errors import NbdistError, RankError


@pytest.fixture(scope="module")
def session():
    with nbdist.DistSession(2, cpu=True, timeout=120, group_timeout=60, history=False) as s:
        yield s


def _reduce_works(session) -> None:
    session.run("t = torch.ones(1) * (rank + 1); dist.all_reduce(t)", sink=ListSink())
    assert [t.item() for t in session.pull("t")] == [3.0, 3.0]


def test_a_killed_rank_fails_the_cell_releases_the_other_and_restart_brings_it_back(session):
    session.run("nbdist.log(step=0, loss=1.0)", sink=ListSink())
    victim = session.ranks[1].pid
    with pytest.raises(RankError) as info:
        session.run(
            "import os, signal, time\n"
            "if rank == 1:\n"
            "    time.sleep(0.3)\n"
            "    os.kill(os.getpid(), signal.SIGKILL)\n"
            "dist.all_reduce(torch.ones(1))\n",
            sink=ListSink(),
        )
    err = info.value
    assert err.ranks == [1]
    assert err.failures[0].ename == "RankDied"
    assert f"pid {victim} killed by SIGKILL (signal 9)" in err.failures[0].evalue
    assert "rank 1 died; the others were released: rank 0 from all_reduce #1" in str(err)
    assert "%dist_restart (or restart()) brings every rank back" in str(err)

    rows = session.status()
    assert [row["state"] for row in rows] == ["idle", "dead"]
    assert "rank 1 died: pid" in format_status(rows)
    # The dashboard's table reads the same states.
    assert [row.state for row in rank_rows(session.metrics, session.rank_states)][1] == "dead"
    # The survivor is idle, not blocked; the next cell says what to do.
    with pytest.raises(NbdistError, match=r"rank 1 died: .*%dist_restart"):
        session.run("print(rank)", sink=ListSink())
    # Pull, push and apply say the same (ipyparallel's own answer was "KeyError: 3"), and
    # point to the live rank, whose values can still be pulled before the restart.
    for call in (
        lambda: session.pull("t"),
        lambda: session.push({"x": 1}),
        lambda: session.apply(abs, -1),
        lambda: session.pull("t", rank=1),
    ):
        with pytest.raises(
            NbdistError,
            match=r"^rank 1 died: pid \d+ killed by SIGKILL .*%dist_restart \(or restart\(\)\) "
            r"brings every rank back; what a live rank holds can be pulled first: "
            r"%dist_pull NAME --rank 0$",
        ):
            call()
    assert session.pull("rank", rank=0) == 0
    assert session.apply(abs, -1, ranks=[0]) == [1]

    session.restart()
    assert [row["state"] for row in session.status()] == ["idle", "idle"]
    assert session.ranks[1].pid != victim
    _reduce_works(session)


def _segfault_on(session, rank: int):
    """Run a cell whose ``rank`` segfaults in ctypes at the cell's line 3; its failure,
    checked to say so: the signal, and where in Python it was (faulthandler's record)."""
    with pytest.raises(RankError) as info:
        session.run(
            f"import ctypes\nif rank == {rank}:\n    ctypes.string_at(0)\ndist.barrier()\n",
            sink=ListSink(),
        )
    failure = info.value.failures[0]
    assert (failure.rank, failure.ename) == (rank, "RankDied")
    assert "segmentation fault (SIGSEGV, signal 11)" in failure.evalue
    assert "in native code - in string_at (ctypes/__init__.py:" in failure.evalue
    assert failure.evalue.endswith("from the cell, line 3"), failure.evalue
    return failure


def test_a_segfault_is_named(session):
    _segfault_on(session, 0)
    assert [row["state"] for row in session.status()] == ["dead", "idle"]


def test_a_segfault_on_a_spawned_rank_is_named_too():
    # Engines spawned (start_method="spawn": separate processes, nothing forked) open their
    # crash record as forked ones do.
    with nbdist.DistSession(
        2, cpu=True, timeout=120, group_timeout=60, history=False, start_method="spawn"
    ) as spawned:
        _segfault_on(spawned, 1)


def test_a_rank_whose_heart_is_silent_for_seconds_is_not_named_dead():
    """A loaded machine can hold every heart of a session back for seconds; a live rank of
    this machine is dead only when its PID says so. Here rank 1 is stopped (SIGSTOP) for 6 s,
    twice the silence that once made the controller drop such a rank."""
    with nbdist.DistSession(2, cpu=True, timeout=120, history=False) as session:
        _reduce_works(session)
        pid = session.ranks[1].pid
        os.kill(pid, signal.SIGSTOP)
        try:
            time.sleep(6)
        finally:
            os.kill(pid, signal.SIGCONT)
        assert session.dead_ranks() == {}
        _reduce_works(session)
        assert [row["state"] for row in session.status()] == ["idle", "idle"]


def test_ranks_outlive_half_a_minute_without_the_controllers_heartbeat():
    """With 256 ranks on 2 cores the controller's heart process can go unscheduled for many
    seconds while the ranks form their group; ipyparallel's engine ended itself after 27.5 s
    without a ping, and ranks died ("exited with code 1") while the controller was alive.
    Here the whole controller is stopped (SIGSTOP) for 31 s with the ranks idle."""
    with nbdist.DistSession(2, cpu=True, timeout=120, history=False) as session:
        _reduce_works(session)
        pids = [r.pid for r in session.ranks]
        controller = psutil.Process(session.cluster.cluster.controller.pid)
        tree = [controller, *controller.children(recursive=True)]
        for proc in tree:
            proc.send_signal(signal.SIGSTOP)
        try:
            time.sleep(31)
        finally:
            for proc in reversed(tree):
                proc.send_signal(signal.SIGCONT)
        assert session.dead_ranks() == {}
        _reduce_works(session)
        assert [r.pid for r in session.ranks] == pids
