"""Start, stop, attach and cleanup with real processes: nothing is left behind, nothing listens beyond loopback."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import textwrap
import threading
import time

import psutil
import pytest

import nbdist
from nbdist.driver.sinks import ListSink
from nbdist.errors import NbdistError
from tests.conftest import wait_gone


def _all_pids(session) -> set[int]:
    return set(session.cluster.pids) | {r.pid for r in session.ranks}


def test_four_ranks_start_reduce_and_stop_without_leftovers(tmp_path):
    s = nbdist.DistSession(4, cpu=True, timeout=120).start()
    try:
        assert s.world_size == 4
        assert s.summary().startswith("nbdist: 4 ranks ready · backend gloo · device cpu")
        sink = ListSink()
        s.run("t = torch.tensor([float(rank)]); dist.all_reduce(t); print(t.item())", sink=sink)
        assert [e[1:] for e in sink.events if e[0] == "line"] == [("stdout", "ranks 0-3", "6.0")]
        # Threads per rank share the machine's cores (at least one each).
        expected = max(1, (os.cpu_count() or 1) // 4)
        s.run("threads = torch.get_num_threads()")
        assert s.pull("threads") == [expected] * 4
        pids = _all_pids(s)
        # controller + its schedulers, zygote, 4 engines
        assert len(pids) >= 6
        listening = [
            c
            for c in psutil.net_connections(kind="inet")
            if c.status == psutil.CONN_LISTEN and c.pid in pids
        ]
        assert listening, "expected the controller and rank 0's store to listen"
        beyond_loopback = [c for c in listening if not c.laddr.ip.startswith("127.")]
        assert beyond_loopback == [], f"sockets listening beyond loopback: {beyond_loopback}"
        security = os.path.join(s.cluster.profile_dir, "security")
        for name in os.listdir(security):
            mode = stat.S_IMODE(os.stat(os.path.join(security, name)).st_mode)
            assert mode == 0o600, f"{name} has mode {oct(mode)}"
        s.record_cell("print(rank)")
    finally:
        killed = s.stop()
    assert killed == [], f"had to SIGKILL {killed}"
    assert wait_gone(pids, timeout=10) == []
    assert not s.running
    # Exported after the stop: the script still runs as many processes as the cells had ranks.
    script = s.export(str(tmp_path / "after_stop.py"))
    assert "torchrun --nproc_per_node 4 after_stop.py" in open(script).read()


def test_a_restart_that_fails_leaves_no_ranks_named_and_no_process():
    import dataclasses

    s = nbdist.DistSession(2, cpu=True, timeout=120).start()
    pids = _all_pids(s)
    try:
        # Too short a limit for anything: the restart in place fails, then the full start.
        s.options = dataclasses.replace(s.options, timeout=0.001)
        with pytest.raises(NbdistError, match="did not all start within 0.001 s"):
            s.restart()
        assert not s.running
        assert (s.ranks, s.world_size) == ([], 0)  # were the two dead ranks of before
    finally:
        s.stop()
    assert wait_gone(pids, timeout=10) == []


def test_a_killed_driver_leaves_no_process(tmp_path):
    """The kernel dies with SIGKILL: controller, zygote and engines end by themselves."""
    script = tmp_path / "driver.py"
    script.write_text(
        textwrap.dedent(
            """
            import json, sys, time
            import nbdist
            s = nbdist.DistSession(2, cpu=True, timeout=120).start()
            pids = sorted(set(s.cluster.pids) | {r.pid for r in s.ranks})
            print(json.dumps(pids), flush=True)
            time.sleep(600)
            """
        )
    )
    driver = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        pids = json.loads(driver.stdout.readline())
        assert len(pids) >= 4
        assert all(psutil.pid_exists(p) for p in pids)
    finally:
        driver.send_signal(signal.SIGKILL)
        driver.wait()
    assert wait_gone(pids, timeout=15) == []


def test_connect_forms_the_group_and_leaves_the_engines_running(external_cluster):
    client_file, procs = external_cluster
    s = nbdist.DistSession(connect=str(client_file), cpu=True, timeout=60).start()
    try:
        assert s.world_size == 2
        assert {r.host for r in s.ranks} == {s.ranks[0].host}
        s.run("t = torch.ones(1) * (rank + 1); dist.all_reduce(t)")
        assert [t.item() for t in s.pull("t")] == [3.0, 3.0]
        s.run(
            "import os; env = (os.environ['MASTER_ADDR'], os.environ['RANK'], os.environ['WORLD_SIZE'])"
        )
        assert s.pull("env") == [("127.0.0.1", "0", "2"), ("127.0.0.1", "1", "2")]
        # Interrupt through ipyparallel's signal relay (engines started elsewhere).
        run = s.run("import time; time.sleep(60)", block=False, sink=ListSink())
        time.sleep(1)
        s.interrupt()
        with pytest.raises(nbdist.RankError, match="KeyboardInterrupt"):
            run.wait()
    finally:
        s.stop()
    # nbdist did not start these processes, so it must not have stopped them.
    assert all(p.poll() is None for p in procs)


def test_spawn_start_method_and_a_dead_rank_in_status():
    """Engines as separate processes (the fork fallback), then a rank killed from outside."""
    s = nbdist.DistSession(2, cpu=True, start_method="spawn", timeout=120).start()
    try:
        assert "engines spawned separately (spawn requested)" in s.summary()
        s.run("t = torch.ones(1); dist.all_reduce(t)")
        assert [t.item() for t in s.pull("t")] == [2.0, 2.0]
        pids = _all_pids(s)
        victim = s.ranks[1].pid
        os.kill(victim, signal.SIGKILL)
        assert wait_gone([victim], timeout=10) == []
        states = {row["rank"]: row["state"] for row in s.status()}
        assert states == {0: "idle", 1: "dead"}
    finally:
        s.stop()
    assert wait_gone(pids, timeout=10) == []


def test_ipyparallel_launcher_pass_through(monkeypatch):
    """--launcher hands engine start-up to ipyparallel; ranks are still numbered and grouped."""
    # Ranks a launcher started watch their controller: at 2 s, a healthy one must not be
    # taken for gone while a cell outlasts that (the cell below sleeps 5 s).
    monkeypatch.setenv("NBDIST_CONTROLLER_GONE_S", "2")
    s = nbdist.DistSession(2, cpu=True, launcher="local", timeout=120).start()
    try:
        assert s.world_size == 2
        from nbdist.engine.controller_watch import controller_address

        # The client's own record of where the controller registers engines: tcp://host:port.
        registration = s.client._config["registration"]  # noqa: SLF001
        host, port = registration.rpartition("//")[2].rsplit(":", 1)
        assert s.client[:].apply_sync(controller_address) == [(host, int(port))] * 2
        s.run("import time; time.sleep(5)")
        assert all(psutil.pid_exists(r.pid) for r in s.ranks)
        s.run(
            "import os; env = (os.environ['RANK'], os.environ['LOCAL_RANK'], os.environ['WORLD_SIZE'])"
        )
        assert s.pull("env") == [("0", "0", "2"), ("1", "1", "2")]
        s.run("t = torch.ones(1) * 5; dist.all_reduce(t)")
        assert s.pull("t", rank=1).item() == 10.0
        pids = _all_pids(s)
    finally:
        s.stop()
    assert wait_gone(pids, timeout=15) == []


def test_several_threads_per_rank_still_fork():
    """torch starts a native thread at import when OpenMP may use several: the zygote avoids it."""
    s = nbdist.DistSession(2, cpu=True, threads=2, timeout=120, history=False).start()
    try:
        assert "spawned" not in s.summary()
        # 2 ranks × 2 threads: more than the cores where there are fewer than 4 (CI has 2).
        noted = "nbdist: --threads 2: 2 ranks × 2 torch threads on the" in s.summary()
        assert noted == ((os.cpu_count() or 1) < 4), s.summary()
        assert s.cluster.start_method == "fork"
        s.run("import os; info = (torch.get_num_threads(), os.environ['OMP_NUM_THREADS'])")
        assert s.pull("info") == [(2, "2"), (2, "2")]
    finally:
        s.stop()


def test_a_session_started_again_after_a_stop_streams_into_a_new_run():
    # A stop closes the metrics hub (its socket, thread and store); the ranks of the next
    # start used to be given that closed port: their points were lost.
    s = nbdist.DistSession(2, cpu=True, timeout=120).start()
    try:
        s.run("nbdist.log(step=0, loss=1.0)")
        first = s.metrics
        s.stop()
        s.start()
        s.run("for i in range(3):\n    nbdist.log(step=i, loss=2.0)")
        second = s.metrics
        assert second.id != first.id
        assert [second.last(r)["loss"] for r in (0, 1)] == [2.0, 2.0]
        assert len(second.rows()) == 6
        assert len(first.rows()) == 2  # the first run is kept as it was
    finally:
        s.stop()


def test_a_named_profile_keeps_no_exit_or_crash_files_of_stopped_ranks(tmp_path, monkeypatch):
    # The zygote keeps each reaped engine's exit status next to its status file; a named
    # profile's log folder outlives the session, where they piled up at every stop and restart.
    from IPython.core.profiledir import ProfileDir

    monkeypatch.setenv("IPYTHONDIR", str(tmp_path))
    ProfileDir.create_profile_dir_by_name(str(tmp_path), "kept")
    s = nbdist.DistSession(2, cpu=True, profile="kept", timeout=120).start()
    log = tmp_path / "profile_kept" / "log"
    try:
        # Each forked rank's crash record (faulthandler's file) sits there too while it runs.
        assert len([p for p in log.iterdir() if ".crash." in p.name]) == 2
        s.restart()
        s.run("x = 1")
    finally:
        s.stop()
    assert log.is_dir()
    left = [p.name for p in log.iterdir() if ".exit." in p.name or ".crash." in p.name]
    assert sorted(left) == []


def test_a_driver_that_exits_without_stopping_is_cleaned_up_by_nbdist_alone(tmp_path):
    """A script (or kernel) ends with ranks running: nbdist's exit hook stops them.

    ipyparallel's own exit hook would run first and stop the cluster on its own, printing
    "Stopping cluster" on stderr; nbdist leaves that to its hook, which also ends what lay
    below the ranks.
    """
    script = tmp_path / "driver.py"
    script.write_text(
        textwrap.dedent(
            """
            import json
            import nbdist
            s = nbdist.DistSession(2, cpu=True, timeout=120).start()
            s.run("import subprocess; child = subprocess.Popen(['sleep', '600'])")
            below = s.pull("child.pid")
            pids = sorted(set(s.cluster.pids) | {r.pid for r in s.ranks} | set(below))
            print(json.dumps(pids), flush=True)
            """
        )
    )
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    pids = json.loads(done.stdout.splitlines()[-1])
    assert len(pids) >= 6
    assert wait_gone(pids, timeout=15) == []
    assert "Stopping cluster" not in done.stderr


def test_status_with_the_controller_killed_answers_and_the_stop_leaves_nothing():
    # ipyparallel's queue_status waits for the controller's reply without end: %dist_status
    # hung once the controller was gone.
    s = nbdist.DistSession(2, cpu=True, timeout=120, history=False).start()
    pids = _all_pids(s)
    try:
        # The controller, not its schedulers (forked from it, with its command line).
        watchdogs = [
            pid
            for pid in s.cluster.pids
            if "nbdist.launch.parent_watchdog" in " ".join(psutil.Process(pid).cmdline())
        ]
        [controller] = [pid for pid in watchdogs if psutil.Process(pid).ppid() not in watchdogs]
        os.kill(controller, signal.SIGKILL)
        rows: list = []
        asking = threading.Thread(target=lambda: rows.extend(s.status()), daemon=True)
        asking.start()
        asking.join(60)  # a guard against the hang, not a measure of speed
        assert not asking.is_alive(), "status() still waits for a controller that is gone"
        assert [row["state"] for row in rows] == ["dead", "dead"]
    finally:
        s.stop()
    assert wait_gone(pids, timeout=15) == []
