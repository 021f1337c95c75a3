"""--launcher ssh to an sshd on loopback (keys made for the test): a collective, and each failure."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import psutil
import pytest

import nbdist
from nbdist.driver.file_sync import sync_files
from nbdist.driver.sinks import ListSink
from nbdist.errors import PlacementError, RankError
from tests.cluster.conftest import (
    SEGFAULT_CELL,
    gone,
    own_pid_namespace_unavailable,
    python,
    python_in_own_pid_namespace,
)

pytestmark = pytest.mark.slow


def _session(hosts: str, config: str, **options) -> nbdist.DistSession:
    options = {"hosts": hosts, "ssh_args": f"-F {config}", "python": python(), **options}
    return nbdist.DistSession(
        None, cpu=True, timeout=180, history=False, launcher="ssh", launch_options=options
    )


def _remote_dirs(pid: int | None = None) -> set[str]:
    """The engines' profile directories "there" (this loopback host's /tmp) of the sessions
    process ``pid`` (default: this one) started: a cluster's id begins with its creator's
    PID, and other tests' SSH sessions may run beside these (tests/server)."""
    prefix = f"nbdist-ssh-nbdist-{os.getpid() if pid is None else pid}-"
    return {name for name in os.listdir("/tmp") if name.startswith(prefix)}


def test_engines_over_ssh_form_the_group_and_stop_leaves_nothing(sshd, tmp_path, capfd):
    before = _remote_dirs()
    # The ssh config's alias points at 127.0.0.1: engines on this machine, the
    # controller stays on loopback.
    with _session("nbdist-ssh-test:2", sshd.config) as session:
        assert session.world_size == 2
        # What a kernel would show in the cell: not IPython's profile creation over SSH
        # ("[ProfileCreate] Generating default config file ...", twice per engine).
        shown = capfd.readouterr()
        assert "ProfileCreate" not in shown.err + shown.out, shown.err
        session.run("t = torch.ones(1) * (rank + 1)\ndist.all_reduce(t)", sink=ListSink())
        assert [t.item() for t in session.pull("t")] == [3.0, 3.0]  # 1 + 2, exact in float32
        pids = [r.pid for r in session.ranks]
        assert len(_remote_dirs() - before) == 1  # the engines' profile directory "there"
        # A rank's PID is a PID on its host: nbdist never signals it here, where it would
        # name another process (on this test's loopback host it happens to be the rank).
        assert not set(pids) & session._handle.pids  # noqa: SLF001
        # What a cell starts on the ranks' hosts (a subprocess, a data server) is the
        # ranks' to end: nothing else on those hosts knows it came from this session.
        session.run(
            "import subprocess\n"
            "child = subprocess.Popen(['sleep', '600'], stdout=subprocess.DEVNULL)\n"
            "child_pid = child.pid",
            sink=ListSink(),
        )
        pids += session.pull("child_pid")
        # %dist_sync --copy: the copy a machine without the notebook's files gets, there.
        (tmp_path / "model.py").write_text("VALUE = 7\n")
        copy = sync_files(session, [tmp_path], copy=True).used[0][str(tmp_path)]
        session.run("import model", sink=ListSink())
        assert session.pull("model.__file__") == [os.path.join(copy, "model.py")] * 2
    left = gone(pids)
    for pid in left:  # after a failure: ended by PID, so nothing outlives the test
        os.kill(pid, signal.SIGKILL)
    assert left == []
    assert _remote_dirs() == before
    assert not os.path.exists(os.path.dirname(copy)), "the stop removed the copies there"


def test_ranks_whose_pids_name_other_processes_here_are_neither_read_nor_signalled(sshd, tmp_path):
    # Each rank in a PID namespace of its own, as on another machine or in a container:
    # its PID is 1 there, and 1 here is this machine's init.
    why = own_pid_namespace_unavailable()
    if why:
        pytest.skip(f"needs a PID namespace of its own (root): {why}")
    wrapper = python_in_own_pid_namespace(tmp_path)
    before = _remote_dirs()
    began = time.time() - 1
    with _session("nbdist-ssh-test:2", sshd.config, python=wrapper) as session:
        assert [r.pid for r in session.ranks] == [1, 1]
        assert not any(r.pid_here for r in session.ranks)
        # %dist_status: alive and idle (from the controller), no memory read from this
        # machine's PID 1.
        rows = session.status()
        assert [(row["state"], row["memory_mib"]) for row in rows] == [("idle", None)] * 2, rows
        # The sidebar's view of the same ranks: nothing read from PID 1 either.
        from nbdist.server.sidebar_state import LiveView

        view = LiveView()
        (entry,) = [e for e in view.entries() if e["kernel_pid"] == os.getpid()]
        sidebar = view.rank_rows(entry)
        assert [(row["state"], row["memory_mib"]) for row in sidebar] == [("idle", None)] * 2
        # Nothing recorded to signal here names the ranks' PID (this machine's init).
        assert 1 not in session._handle.pids  # noqa: SLF001
        # Each rank's mount namespace is its own, as in a container: for %dist_sync two
        # machines, each checked (and, without the files, written) by its own rank.
        report = sync_files(session, [tmp_path])
        assert (report.machines, report.in_place) == (2, 2), str(report)
        # With --copy each writes its own copy (one folder per machine, even in a shared /tmp).
        report = sync_files(session, [tmp_path], copy=True)
        assert (report.machines, report.in_place) == (2, 0), str(report)
        copies = [report.used[r][str(tmp_path)] for r in (0, 1)]
        assert copies[0] != copies[1] and all(os.path.isdir(c) for c in copies), copies
        session.run(
            "import subprocess\n"
            "child = subprocess.Popen(['sleep', '600'], stdout=subprocess.DEVNULL)",
            sink=ListSink(),
        )
        # The `sleep`s, seen from here (outside their namespace): below the ranks' `unshare`s
        # (started detached by ipyparallel's SSH helper, so below no process of the test).
        sleeps = [
            p.pid
            for u in psutil.process_iter(["name", "cmdline", "create_time"])
            if u.info["name"] == "unshare"
            and u.info["create_time"] >= began
            and "ipyparallel.engine" in " ".join(u.info["cmdline"] or ())
            for p in u.children(recursive=True)
            if p.name() == "sleep"
        ]
        assert len(sleeps) == 2
    left = gone(sleeps)
    for pid in left:  # after a failure: ended by PID, so nothing outlives the test
        os.kill(pid, signal.SIGKILL)
    assert left == []
    assert _remote_dirs() == before
    assert not any(os.path.exists(os.path.dirname(c)) for c in copies), "each machine's removed"


def test_a_rank_in_its_own_pid_namespace_that_segfaults_names_the_cells_line(sshd, tmp_path):
    # Its PID names nothing here: the kernel learns of the death from the controller's
    # heartbeat and reads the rank's crash record from the machine's temp dir.
    why = own_pid_namespace_unavailable()
    if why:
        pytest.skip(f"needs a PID namespace of its own (root): {why}")
    wrapper = python_in_own_pid_namespace(tmp_path)
    with _session("nbdist-ssh-test:2", sshd.config, python=wrapper) as session:
        records = [r.crash_record for r in session.ranks]
        assert len(set(records)) == 2 and all(os.path.isfile(p) for p in records), records
        with pytest.raises(RankError) as info:
            session.run(SEGFAULT_CELL, sink=ListSink())
        # Rank 0 fails first, its gloo connection to the dead rank reset, 10 s before the
        # heartbeat says rank 1 died: the death's error, not one of its own.
        assert info.value.ranks == [1], str(info.value)
        assert "rank 1 died; the others were released: rank 0 from all_reduce #" in str(
            info.value
        ), str(info.value)
        cause = next(f.evalue for f in info.value.failures if f.rank == 1)
        assert cause.startswith("its engine stopped answering the controller's heartbeat"), cause
        assert "crashed: Segmentation fault, in string_at" in cause, cause
        assert cause.endswith("from the cell, line 3"), cause
    assert [p for p in records if os.path.exists(p)] == []


@pytest.mark.parametrize(
    "case, words",
    [
        ("refused", "SSH refused the login"),
        ("unreachable", "cannot be reached over SSH (ssh: connect to host 127.0.0.1 port"),
        ("no python", "has no Python at '/nonexistent/bin/python'"),
    ],
)
def test_each_failure_is_named_before_anything_starts(sshd, case, words):
    before = _remote_dirs()
    if case == "refused":  # a key the server never authorized
        session = _session("stranger:1", sshd.client_config("stranger", sshd.other_key))
    elif case == "unreachable":  # a loopback port nothing listens on (ours, closed again)
        from tests.cluster.conftest import free_port

        config = sshd.client_config("nowhere", sshd.key, port=free_port())
        session = _session("nowhere:1", config)
    else:
        session = _session("nbdist-ssh-test:1", sshd.config, python="/nonexistent/bin/python")
    with pytest.raises(PlacementError, match="Nothing was started") as info:
        session.start()
    assert words in str(info.value)
    assert not session.running
    assert _remote_dirs() == before


# A driver of its own (a kernel, for what matters here): it starts the ranks over SSH, sets
# them sleeping in a cell that started a process of its own, prints their PIDs, and waits
# to be killed.
_DRIVER = """
import json, sys, time
import nbdist
options = {{"hosts": "nbdist-ssh-test:2", "ssh_args": "-F {config}", "python": sys.executable}}
session = nbdist.DistSession(
    None, cpu=True, timeout=180, history=False, launcher="ssh", launch_options=options
)
session.start()
session.run(
    "import subprocess, time\\n"
    "child = subprocess.Popen(['sleep', '600'], stdout=subprocess.DEVNULL)\\n"
    "print('busy', flush=True)\\ntime.sleep(600)",
    block=False,
)
time.sleep(3)
print(json.dumps([r.pid for r in session.ranks]), flush=True)
time.sleep(600)
"""


def test_ranks_in_a_long_cell_end_themselves_when_their_kernel_is_killed(sshd):
    env = dict(os.environ, NBDIST_CONTROLLER_GONE_S="4")
    driver = subprocess.Popen(
        [sys.executable, "-c", _DRIVER.format(config=sshd.config)],
        env=env,
        stdout=subprocess.PIPE,
        text=True,
    )
    started: list[int] = []
    try:
        ranks = json.loads(driver.stdout.readline())
        # The SSH clients below the driver; below each rank, its cell's own `sleep 600`.
        below = [psutil.Process(pid).children(recursive=True) for pid in [driver.pid, *ranks]]
        started = ranks + [p.pid for procs in below for p in procs]
        assert len(ranks) == 2 and all(psutil.pid_exists(p) for p in ranks)
        assert all("sleep" in [p.name() for p in procs] for procs in below[1:]), below
        driver.kill()  # as the out-of-memory killer would: nothing of the driver runs on
        driver.wait()
        # Without the watch they would sleep out their 600 s cell (ipyparallel's own
        # heartbeat check waits for the cell to end); with it, 4 s after the controller
        # went (itself ended with its kernel within ~6 s), checked every 4 s.
        assert gone(ranks, timeout=60) == [], "ranks in a cell outlived their kernel"
        # Their nannies, the processes their cell started and the launcher's SSH clients
        # follow them, and the host's copy of the connection file goes with them.
        assert gone(started, timeout=15) == []
        assert _remote_dirs(driver.pid) == set()
    finally:
        if driver.poll() is None:
            driver.kill()
            driver.wait()
        # What is left (after a failure): ended by PID, so nothing outlives the test.
        for pid in gone(started, timeout=15):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        # What is left of each host's copy of the connection file (after a failure).
        for name in _remote_dirs(driver.pid):
            shutil.rmtree(os.path.join("/tmp", name), ignore_errors=True)
