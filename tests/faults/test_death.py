"""A rank dies in the middle of a cell: SIGKILL (also what the out-of-memory killer sends), a segfault."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time

import psutil
import pytest

import nbdist
from nbdist.dashboard.table import rank_rows
from nbdist.driver.crash_stack import ABORTED_IN_COLLECTIVE
from nbdist.driver.sinks import ListSink
from nbdist.driver.status import format_status
from nbdist.errors import NbdistError, RankError
from tests.faults.two_ranks import reduce_works, two_ranks


@pytest.fixture(scope="module")
def session():
    with two_ranks() as s:
        yield s


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

    # The controller drops the dead engine at once, as if it had left (it never drops a
    # local engine for a silent heart; before, it dropped this one after 30 s of silence).
    engine = session.ranks[1].engine_id
    deadline = time.monotonic() + 20
    while engine in session.client.ids and time.monotonic() < deadline:
        time.sleep(0.05)
    assert engine not in session.client.ids

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
    reduce_works(session)


def test_exit_in_a_cell_fails_it_and_the_rank_keeps_its_state_and_the_group(session):
    """exit() (or quit()) on a rank ended its process and the group with it; now it is the
    cell's error and nothing is lost. sys.exit(n) fails the cell without IPython's advice to
    use exit() instead."""
    pids = [r.pid for r in session.ranks]
    session.run("kept = rank * 10", sink=ListSink())
    for cell, ranks in (
        ("if rank == 1:\n    exit()\nafter = rank", [1]),
        ("if rank == 1:\n    quit()\nafter = rank", [1]),
        ("exit", [0, 1]),  # a cell of the name alone: IPython calls it (autocall)
    ):
        with pytest.raises(RankError) as info:
            session.run(cell, sink=ListSink())
        assert info.value.ranks == ranks, cell
        for failure in info.value.failures:
            assert failure.ename == "ExitOnRank"
            assert "would end this rank's process" in failure.evalue
            assert "%dist_stop" in failure.evalue
    sink = ListSink()
    with pytest.raises(RankError) as info:
        session.run("import sys\nif rank == 0:\n    sys.exit(3)", sink=sink)
    assert [(f.rank, f.ename, f.evalue) for f in info.value.failures] == [(0, "SystemExit", "3")]
    assert not [e for e in sink.events if "To exit: use" in str(e)], sink.events
    assert session.dead_ranks() == {}
    assert [r.pid for r in session.ranks] == pids
    assert session.pull("kept") == [0, 10]
    assert session.pull("after", rank=0) == 0  # rank 0 ran on past the line rank 1 failed at
    reduce_works(session)


def test_a_rank_ended_by_sigterm_from_outside_says_so(session):
    """A kill (SIGTERM) from outside nbdist: the engine handles the signal, ends itself
    once the cell ran, and exits with code 1, which alone says nothing; its last log line
    says what happened. (Whether that cell's reply left first is a race of the engine's.)"""
    victim = session.ranks[1].pid
    with contextlib.suppress(RankError):
        session.run(
            "import os, signal\nif rank == 1:\n    os.kill(os.getpid(), signal.SIGTERM)\n",
            sink=ListSink(),
        )
    deadline = time.monotonic() + 30
    while 1 not in session.dead_ranks() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert session.dead_ranks() == {
        1: f"pid {victim} exited with code 1 - its engine logged: received signal 15, stopping"
    }
    with pytest.raises(NbdistError, match=r"rank 1 died: .* received signal 15, stopping"):
        session.run("print(rank)", sink=ListSink())
    session.restart()
    reduce_works(session)


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


def test_a_rank_gloo_aborted_over_a_peers_dtype_says_what_aborts_a_rank_there():
    """gloo's receiving thread ends the process when a peer sends more bytes than its tensor
    holds: here rank 0 (float32, the right dtype) dies of SIGABRT for rank 1's float64. The
    death's line says what does that, and the check that names the tensor that differs."""
    with two_ranks() as s:
        with pytest.raises(RankError) as info:
            s.run(
                "t = torch.ones(2, dtype=torch.float64 if rank == 1 else torch.float32)\n"
                "dist.all_reduce(t)\n",
                sink=ListSink(),
            )
        died = [f for f in info.value.failures if f.ename == "RankDied"]
        assert [f.rank for f in died] == [0], str(info.value)
        words = died[0].evalue
        assert "killed by SIGABRT (signal 6)" in words, words
        assert "while the cell's thread was in all_reduce" in words, words
        assert words.endswith(f"from the cell, line 2: {ABORTED_IN_COLLECTIVE}"), words


def test_half_a_minute_of_silence_either_way_loses_no_rank():
    """A silent heart, both ways, in the same half minute (paid once: two sessions side by side).

    The controller silent to the ranks: with 256 ranks on 2 cores the controller's heart
    process can go unscheduled for many seconds while the ranks form their group;
    ipyparallel's engine ended itself after 27.5 s without a ping, and ranks died ("exited
    with code 1") while the controller was alive. Here the whole controller of a session of
    its own is stopped (SIGSTOP) for 31 s with the ranks idle.

    A rank silent to the controller: a debugger holding it (gdb stops the process while
    attached), or Ctrl-Z. The controller dropped such a rank after 30 s: its cell failed with
    "rank 1 died: its engine stopped answering the controller's heartbeat" while the process
    lived on, answering no one, and only %dist_restart helped. Here rank 1 of another session
    is stopped for 33 s in the middle of a cell of all-reduces: continued, it goes on where it
    was and the cell ends as it would have."""
    with two_ranks(group_timeout=1800) as other, two_ranks() as session:
        reduce_works(other)
        other_pids = [r.pid for r in other.ranks]
        controller = psutil.Process(other.cluster.cluster.controller.pid)
        tree = [controller, *controller.children(recursive=True)]
        reduce_works(session)
        pid = session.ranks[1].pid
        began = threading.Event()

        def hold_both():
            began.wait(60)
            for proc in tree:
                proc.send_signal(signal.SIGSTOP)
            os.kill(pid, signal.SIGSTOP)
            try:
                time.sleep(33)
            finally:
                os.kill(pid, signal.SIGCONT)
                for proc in reversed(tree):
                    proc.send_signal(signal.SIGCONT)

        holder = threading.Thread(target=hold_both, daemon=True)
        holder.start()
        session.run("t = torch.zeros(1)", sink=ListSink())
        # The cell's steps each all-reduce; rank 1 is stopped between two of them.
        steps = (
            "import time\n"
            "for step in range(30):\n"
            "    s = torch.ones(1)\n"
            "    dist.all_reduce(s)\n"
            "    t += s\n"
            "    time.sleep(0.05)\n"
        )
        threading.Timer(0.5, began.set).start()
        session.run(steps, sink=ListSink())
        holder.join(60)
        assert not holder.is_alive()
        assert [x.item() for x in session.pull("t")] == [60.0, 60.0]  # 30 steps of 1 + 1
        assert session.dead_ranks() == {}
        assert [row["state"] for row in session.status()] == ["idle", "idle"]
        assert session.ranks[1].pid == pid
        reduce_works(session)

        assert other.dead_ranks() == {}
        reduce_works(other)
        assert [r.pid for r in other.ranks] == other_pids
