"""A fast restart: fresh ranks forked by the zygote that is already running, the controller kept.

After a rank is killed, or on request, ``restart()`` ends the old ranks and
what they started, forks new ones from the same zygote, drops the old engines
from the controller and forms the group again; the run goes on with a
``restart`` point per rank. Where nothing of ours can be forked (``--spawn``)
the restart is a full one and says so. Real engines, real signals; times are
the benchmark's business (bench/startup.py), not these tests'.
"""

from __future__ import annotations

import os
import signal
import time

import psutil
import pytest

import nbdist
from nbdist.driver.sinks import ListSink
from nbdist.errors import RankError
from nbdist.metrics.hub import RESTART_KEY
from tests.conftest import wait_gone

GONE = "fresh processes: names defined in cells are gone"


def _reduce(session) -> list[float]:
    session.run("t = torch.ones(1) * (rank + 1); dist.all_reduce(t)", sink=ListSink())
    return [t.item() for t in session.pull("t")]


def _zygote(session) -> int:
    return session.cluster.engine_launcher().pid


def _controller(session) -> int:
    return session.cluster.cluster.controller.pid


def _wait_dead(session, rank: int) -> None:
    deadline = time.monotonic() + 10
    while rank not in session.dead_ranks() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert rank in session.dead_ranks()


@pytest.fixture(scope="module")
def session():
    with nbdist.DistSession(2, cpu=True, timeout=120, group_timeout=60, history=False) as s:
        yield s


def test_after_a_sigkill_the_zygote_forks_fresh_ranks_and_the_group_works(session):
    session.run("nbdist.log(step=7, loss=1.0); x = 42", sink=ListSink())
    old_pids = [r.pid for r in session.ranks]
    old_ids = [r.engine_id for r in session.ranks]
    zygote, controller = _zygote(session), _controller(session)
    run_id = session.metrics.id
    os.kill(old_pids[1], signal.SIGKILL)
    _wait_dead(session, 1)

    session.restart()

    new_pids = [r.pid for r in session.ranks]
    assert set(new_pids).isdisjoint(old_pids)
    assert wait_gone(old_pids, timeout=5) == []
    # The same zygote forked them (torch imported once), under the same controller.
    assert _zygote(session) == zygote and _controller(session) == controller
    assert all(psutil.Process(p).ppid() == zygote for p in new_pids)
    # New engines, and the old ones no longer in the controller.
    assert set(session.client.ids) == {r.engine_id for r in session.ranks}
    assert set(session.client.ids).isdisjoint(old_ids)
    assert session.dead_ranks() == {}
    assert [row["state"] for row in session.status()] == ["idle", "idle"]
    assert _reduce(session) == [3.0, 3.0]
    # Fresh processes: what a cell defined is gone, and the line says so.
    assert session.pull("rank") == [0, 1]
    with pytest.raises(RankError, match="NameError"):
        session.run("x", sink=ListSink())
    line = session.summary()
    assert line.startswith("nbdist: restarted 2 ranks in ")
    assert GONE in line and "full restart" not in line
    assert session.restarted.note == ""
    # The run goes on, with a restart point per rank at its last step.
    assert session.metrics.id == run_id
    marks = [r for r in session.metrics.rows() if RESTART_KEY in r]
    assert [(m["rank"], m["step"], m[RESTART_KEY]) for m in marks] == [(0, 7, 1.0), (1, 7, 1.0)]


def test_restart_on_request_ends_what_the_ranks_started(session):
    session.run(
        "import subprocess, sys\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
        "started = child.pid",
        sink=ListSink(),
    )
    children = session.pull("started")
    old_pids = [r.pid for r in session.ranks]
    zygote = _zygote(session)
    # The module's session may have restarted before (or not, run on its own).
    before = max((r[RESTART_KEY] for r in session.metrics.rows() if RESTART_KEY in r), default=0.0)

    session.restart()

    assert wait_gone(children + old_pids, timeout=1) == []
    assert _zygote(session) == zygote
    assert set(r.pid for r in session.ranks).isdisjoint(old_pids)
    assert _reduce(session) == [3.0, 3.0]
    marks = [r[RESTART_KEY] for r in session.metrics.rows() if RESTART_KEY in r]
    assert max(marks) == before + 1, marks


def test_every_rank_killed_then_restart_and_nothing_is_left_after_stop():
    s = nbdist.DistSession(2, cpu=True, timeout=120, history=False).start()
    seen: set[int] = set()
    try:
        zygote = _zygote(s)
        for rank in s.ranks:
            seen.add(rank.pid)
            os.kill(rank.pid, signal.SIGKILL)
        _wait_dead(s, 0)
        _wait_dead(s, 1)
        assert psutil.Process(zygote).is_running()  # it waits for a restart
        s.restart()
        assert _zygote(s) == zygote
        assert _reduce(s) == [3.0, 3.0]
        seen |= set(s.cluster.pids) | {r.pid for r in s.ranks}
    finally:
        killed = s.stop()
    assert killed == []
    assert wait_gone(seen, timeout=10) == []


def test_spawned_engines_get_a_full_restart_that_says_so():
    s = nbdist.DistSession(2, cpu=True, timeout=180, history=False, start_method="spawn").start()
    seen: set[int] = set()
    try:
        zygote = _zygote(s)
        seen |= set(s.cluster.pids)
        s.restart()
        assert _zygote(s) != zygote
        assert "full restart: engines were spawned" in s.summary()
        assert _reduce(s) == [3.0, 3.0]
        seen |= set(s.cluster.pids)
    finally:
        s.stop()
    assert wait_gone(seen, timeout=10) == []


def test_an_attached_cluster_is_attached_again_and_keeps_its_processes(external_cluster):
    client_file, procs = external_cluster
    s = nbdist.DistSession(connect=str(client_file), cpu=True, timeout=60, history=False).start()
    try:
        s.run("kept = rank", sink=ListSink())
        pids = [r.pid for r in s.ranks]
        s.restart()
        assert [r.pid for r in s.ranks] == pids  # not nbdist's to end: the same engines
        line = s.summary()
        assert "attached cluster" in line and "names defined in cells are kept" in line
        assert s.pull("kept") == [0, 1]
        assert _reduce(s) == [3.0, 3.0]
    finally:
        s.stop()
    assert all(p.poll() is None for p in procs)
