"""A day of %dist_start / %dist_stop leaves the kernel as it found it: threads and fds come back.

Measured in a real kernel (jupyter_client), from outside, as the soak does
(bench/soak.py): every ``%dist_stop`` + ``%dist_start`` used to leave one more
thread and three more descriptors in the kernel (ipyparallel's thread running
the cluster's ``*_sync`` calls, with its event loop), so a few hundred cycles
reached the kernel's fd limit.
"""

from __future__ import annotations

import os
import time

import psutil

from tests.conftest import wait_gone

CYCLES = 5
TOLERANCE = 2


def _sample(proc: psutil.Process, reference: dict | None = None) -> dict:
    # A stop's last waiting threads end within their poll interval: up to 5 s to settle.
    deadline = time.monotonic() + 5
    while True:
        with proc.oneshot():
            s = {"threads": proc.num_threads(), "fds": proc.num_fds()}
        close = reference is None or all(abs(s[k] - reference[k]) <= TOLERANCE for k in s)
        if close or time.monotonic() > deadline:
            return s
        time.sleep(0.2)


def _cycles(kernel, cycles: int) -> tuple[list[dict], list[dict]]:
    proc = psutil.Process(kernel.pid)
    started, stopped = [], []
    for _ in range(cycles):
        kernel.ok("%dist_start 2 --cpu", timeout=240)
        started.append(_sample(proc, started[0] if started else None))
        kernel.ok("%dist_stop")
        stopped.append(_sample(proc, stopped[0] if stopped else None))
    return started, stopped


def _drift(samples: list[dict]) -> dict:
    return {k: samples[-1][k] - samples[0][k] for k in samples[0]}


def test_start_stop_cycles_leave_no_thread_and_no_fd(kernels):
    kernel = kernels()
    kernel.ok("%load_ext nbdist")
    started, stopped = _cycles(kernel, CYCLES)
    for what, samples in (("running", started), ("stopped", stopped)):
        drift = _drift(samples)
        assert all(abs(v) <= TOLERANCE for v in drift.values()), (
            f"after {CYCLES} start/stop cycles, {what}: {samples[0]} -> {samples[-1]} ({drift})"
        )


def test_connect_to_a_cluster_file_cycles_leave_no_thread_and_no_fd(kernels, tmp_path):
    # A cluster file (cluster-*.json) is read into an ipyparallel Cluster, whose *_sync
    # calls run on a thread and event loop of its own: each connect used to leave both.
    import ipyparallel as ipp

    cluster = ipp.Cluster(
        n=2, profile_dir=str(tmp_path), cluster_id="shared", controller_ip="127.0.0.1"
    )
    cluster.start_cluster_sync()
    try:
        with cluster.connect_client_sync() as client:
            client.wait_for_engines(2, timeout=120, interactive=False)
        path = cluster.cluster_file
        kernel = kernels()
        kernel.ok("%load_ext nbdist")
        proc = psutil.Process(kernel.pid)
        samples = []
        # Each connect left 4 threads and 6 fds: 3 cycles show it well past the tolerance.
        for _ in range(3):
            kernel.ok(f"%dist_start --connect {path}", timeout=240)
            kernel.ok("%dist_stop")
            samples.append(_sample(proc, samples[0] if samples else None))
        drift = _drift(samples)
        assert all(abs(v) <= TOLERANCE for v in drift.values()), (
            f"after 3 connect/stop cycles: {samples[0]} -> {samples[-1]} ({drift})"
        )
    finally:
        cluster.stop_cluster_sync()


DASHBOARD_OF_A_FINISHED_RUN = """
import threading, time
from nbdist.dashboard import show_run
from nbdist.metrics.run import Run
run = Run({i}, world_size=2, backend="gloo")
run.add(0, [[1, time.time(), {{"loss": 1.0}}]])
dash = show_run(run, auto=True)
"""


def test_a_finished_runs_dashboard_lets_go_of_the_kernel(kernels):
    """Each session's last dashboard stayed registered after every cell, holding its run."""
    kernel = kernels()
    counts = []
    for i in range(4):
        kernel.ok(DASHBOARD_OF_A_FINISHED_RUN.format(i=i))
        kernel.ok("run.ended = time.time(); run.add(1, [[1, time.time(), {'loss': 1.0}]])")
        kernel.ok(
            "deadline = time.monotonic() + 10\nwhile dash.is_live() and time.monotonic() < deadline:\n    time.sleep(0.1)"
        )
        kernel.ok("pass")  # the cell after the run's end and its last refresh
        out = kernel.ok("print(len(get_ipython().events.callbacks['post_run_cell']))").stdout
        counts.append(int(out))
    assert counts[-1] == counts[0], f"post_run_cell callbacks after each finished run: {counts}"


NBDIST_THREADS = "import threading\nprint(sorted(t.name for t in threading.enumerate() if t.name.startswith('nbdist')))"
LOGGING_CELL = "%%on_all_ranks\nfor step in range(20):\n    nbdist.log(step=step, loss=1.0)\n"


def test_named_session_detach_attach_and_stop_leave_no_thread_behind(kernels, tmp_path):
    """A detached named session's dashboard refreshed on its own thread until the kernel exited."""
    kernel = kernels(env=dict(os.environ, JUPYTER_RUNTIME_DIR=str(tmp_path / "runtime")))
    kernel.ok("%load_ext nbdist\nimport nbdist")
    try:
        for i in range(2):
            kernel.ok(f"%dist_start 2 --cpu --name leak{i}", timeout=240)
            kernel.ok(LOGGING_CELL)
            kernel.ok("nbdist.current_session().detach()")
            assert kernel.ok(NBDIST_THREADS).stdout.strip() == "[]"
            kernel.ok(f"%dist_attach leak{i}", timeout=120)
            kernel.ok(LOGGING_CELL)
            kernel.ok(f"%dist_stop leak{i}", timeout=120)
            assert kernel.ok(NBDIST_THREADS).stdout.strip() == "[]"
    finally:  # named sessions outlive the kernel: end what a failure left
        kernel.execute(
            "from nbdist.driver.named_sessions import named_sessions, stop_named\n"
            "for row in named_sessions(): stop_named(row['name'])"
        )


CLOSED_VIEWS_FREE_THE_RUN = """
import gc, ipywidgets
del nbdist_runs
ipywidgets.Widget.close_all()  # every view of the dashboards closed (cleared outputs)
Out.clear()
gc.collect()
print('alive', [r() is not None for r in kept])
"""


def test_a_stopped_runs_points_go_once_its_dashboard_is_closed(kernels):
    """The registry of dashboards kept every run it had shown, points and all, for good."""
    kernel = kernels()
    kernel.ok("%load_ext nbdist\nimport nbdist\nnbdist_runs = []")
    for _ in range(2):
        kernel.ok("%dist_start 2 --cpu", timeout=240)
        kernel.ok(LOGGING_CELL)  # its dashboard appears under the cell
        kernel.ok("nbdist_runs.append(nbdist.current_session().metrics)")
        kernel.ok("%dist_stop")  # the frozen dashboard keeps its view, and so its run
    kernel.ok("import weakref\nkept = [weakref.ref(r) for r in nbdist_runs]")
    assert (
        "alive 2 of 2"
        in kernel.ok("print('alive', sum(r() is not None for r in kept), 'of 2')").stdout
    )
    out = kernel.ok(CLOSED_VIEWS_FREE_THE_RUN).stdout
    # The first run is gone; the last one is still the magics' stopped session's, whose
    # metrics stay readable until the next start.
    assert "alive [False, True]" in out, out


NOBLOCK_CELL = "%%on_all_ranks --noblock\nprint('noblock', rank)\n"
STOPPED_CLIENT = """
import gc, ipywidgets
ipywidgets.Widget.close_all()  # every dashboard's view closed, as the soak releases them
for key in [k for k, v in Out.items() if isinstance(v, ipywidgets.Widget)]:
    del Out[key]
gc.collect()
print('client alive', client_ref() is not None, 'run alive', run_ref() is not None)
"""


def test_a_noblock_cells_result_kept_in_out_lets_go_of_the_stopped_session(kernels):
    """``Out`` kept each --noblock cell's RankRun, and with it that session's client and points."""
    kernel = kernels()
    kernel.ok("%load_ext nbdist\nimport nbdist, weakref")
    # ipyparallel's %px magics keep the kernel's first client: the session under test is the second.
    kernel.ok("%dist_start 2 --cpu", timeout=240)
    kernel.ok("%dist_stop")
    kernel.ok("%dist_start 2 --cpu", timeout=240)
    kernel.ok(LOGGING_CELL)
    kernel.ok(NOBLOCK_CELL)  # its RankRun is the cell's result: Out keeps it
    kernel.ok("held = _")
    assert "noblock 1" in kernel.ok("held.wait()").stdout
    kernel.ok(
        "session = nbdist.current_session()\n"
        "client_ref = weakref.ref(session.client)\nrun_ref = weakref.ref(session.metrics)\n"
        "del session"
    )
    kernel.ok("%dist_stop")
    kernel.ok("%dist_start 2 --cpu", timeout=240)  # the magics now hold another session
    kernel.ok("%dist_stop")
    out = kernel.ok(STOPPED_CLIENT).stdout
    assert "client alive False run alive False" in out, out
    # What the user can still read of it: done, and the same results again.
    out = kernel.ok("print(held.done(), held.wait() == held.results, len(held.results))").stdout
    assert "True True 2" in out, out


PSUTIL_PROCESSES = """
import gc, psutil
gc.collect()
print('held', sum(isinstance(o, psutil.Process) for o in gc.get_objects()))
print('machine', len(psutil.pids()))
"""


def test_a_stop_keeps_no_table_of_the_machines_processes(kernels):
    """Each stop walked the process table through psutil, which kept a Process per process of the machine."""
    kernel = kernels()
    kernel.ok("%load_ext nbdist")
    kernel.ok("%dist_start 2 --cpu", timeout=240)
    kernel.ok("%dist_stop")
    out = kernel.ok(PSUTIL_PROCESSES).stdout
    held = int(out.split("held ")[1].split()[0])
    machine = int(out.split("machine ")[1].split()[0])
    # A few may be held by what the kernel still uses (its own process); not one per process.
    assert held < 10 < machine, out


def test_a_running_session_whose_variable_was_rebound_is_still_stopped(kernels):
    """``s = DistSession(2).start()`` run twice: the first session's processes must still end.

    A running session was held weakly: once its variable named another, Python collected
    it, and nothing stopped its 12 processes (not ``%unload_ext``, not the sidebar's Stop:
    "no running cluster"), until the parent watchdogs noticed the kernel gone.
    """
    kernel = kernels()
    kernel.ok("import gc, nbdist\nfrom nbdist.driver import registry")
    kernel.ok("s = nbdist.DistSession(2, cpu=True).start()", timeout=240)
    first = kernel.descendants()
    kernel.ok("s = nbdist.DistSession(2, cpu=True).start()\ngc.collect()", timeout=240)
    # The sidebar lists the first one and its Stop reaches it.
    out = kernel.ok("registry.act(registry.clusters()[0]['id'], 'stop')\nprint('stopped')").stdout
    assert "stopped" in out, out
    assert wait_gone(first) == [], "the first session's processes outlived its Stop"
    kernel.ok("s = None\ngc.collect()")
    running = kernel.descendants()
    assert running, "the second session should still run"
    kernel.ok("%load_ext nbdist")
    kernel.ok("%unload_ext nbdist")  # stops every session of the kernel, as its exit does
    assert wait_gone(running) == [], "a dropped running session outlived %unload_ext"
