"""Named sessions under --launcher slurm, mpi and ssh, as tests/cluster/test_named_sessions.py tests the local one.

Each launcher, in real kernels (jupyter_client): a kernel starts the session
by name and runs a cell, then shuts down (it detaches); a second kernel
attaches, finds the ranks' state, starts a logging cell and is SIGKILLed in the
middle of it; a third attaches, sees that cell's output to its end and every
point it logged, runs a cell, and stops the session: no process, record, Slurm
job or remote directory is left. Skipped, saying why, where Slurm, Open MPI or
sshd is missing (.ci/run installs and starts them).
"""

from __future__ import annotations

import os
import shutil
import signal
import sys

import psutil
import pytest

from nbdist.launch import named_session_records
from tests.cluster.conftest import squeue
from tests.cluster.test_named_sessions import (
    LOGGING_CELL,
    START_TIMEOUT,
    STEPS,
    _Kernel,
    _session_pids,
)
from tests.conftest import wait_gone

pytestmark = pytest.mark.slow  # three kernels and a launcher's ranks: 30-60 s each on 2 cores

# Open MPI refuses to start as root unless told; CI runs as root.
AS_ROOT = "--allow-run-as-root " if os.geteuid() == 0 else ""


def _remote_dirs() -> set[str]:
    return {name for name in os.listdir("/tmp") if name.startswith("nbdist-ssh-")}


@pytest.fixture(params=["slurm", "mpi", "ssh"])
def launcher(request):
    """The ``%dist_start`` options of one launcher (its fixture started or checked first)."""
    if request.param == "slurm":
        request.getfixturevalue("slurm")
        return "2 --cpu --launcher slurm --time 10"
    if request.param == "mpi":
        if shutil.which("mpiexec") is None:
            pytest.skip("no mpiexec: apt-get install openmpi-bin")
        return f'2 --cpu --launcher mpi --launch-opt "mpi_args={AS_ROOT}--oversubscribe"'
    sshd = request.getfixturevalue("sshd")
    return (
        f'--cpu --launcher ssh --hosts nbdist-ssh-test:2 --launch-opt "ssh_args=-F {sshd.config}"'
        f" --launch-opt python={sys.executable}"
    )


def test_a_named_session_outlives_its_kernels_under_each_launcher(launcher, tmp_path, monkeypatch):
    name = "kept-" + launcher.split("--launcher ")[1].split()[0]
    runtime = str(tmp_path / "runtime")
    env = dict(
        os.environ, NBDIST_HISTORY=str(tmp_path / "history.sqlite"), JUPYTER_RUNTIME_DIR=runtime
    )
    monkeypatch.setenv("JUPYTER_RUNTIME_DIR", runtime)  # the records this process reads
    gate = str(tmp_path / "gate")
    remote_before = _remote_dirs()
    pids: list[int] = []
    try:
        first = _Kernel(env)
        try:
            first.ok("%load_ext nbdist")
            out = first.ok(
                f"%dist_start {launcher} --name {name} --timeout 180",
                timeout=START_TIMEOUT + 120,
            )
            assert "2 ranks ready" in out and "outlives this kernel" in out, out
            first.ok("%%on_all_ranks\nstate = rank + 100")
            # The launcher named did start the ranks: its own marks on them.
            where = first.ok(
                "%%on_all_ranks\nimport os\n"
                "print('job', os.environ.get('SLURM_JOB_ID'), 'mpi', "
                "os.environ.get('OMPI_COMM_WORLD_RANK'))"
            )
            if "slurm" in launcher:
                assert "job None" not in where and "mpi None" in where, where
            elif "mpi" in launcher:
                assert "mpi 0" in where and "mpi 1" in where, where
            else:
                assert len(_remote_dirs() - remote_before) == 1  # the engines' copy "there"
            pids = _session_pids(name) + [
                r["pid"] for r in named_session_records.read_group(name)["ranks"]
            ]
        finally:
            first.shutdown()  # a kernel's shutdown detaches: the session runs on
        assert [p for p in pids if not psutil.pid_exists(p)] == []

        second = _Kernel(env)
        try:
            second.ok("%load_ext nbdist")
            assert f"attached to session '{name}'" in second.ok(f"%dist_attach {name}")
            state = second.ok("%%on_all_ranks\nprint(state)")
            assert "100" in state and "101" in state, state
            running = second.kc.execute(LOGGING_CELL.format(steps=STEPS, gate=gate))
            assert "step 5" in second.collect(running, until=lambda text: "step 5\n" in text)
            os.kill(second.pid, signal.SIGKILL)  # mid-cell
            assert wait_gone([second.pid]) == []
        finally:
            second.shutdown()
        assert [p for p in pids if not psutil.pid_exists(p)] == []

        third = _Kernel(env)
        try:
            third.ok("%load_ext nbdist")
            attaching = third.kc.execute(f"%dist_attach {name}")
            attached = third.collect(attaching, until=lambda text: "attached to session" in text)
            assert "cell done" not in attached  # the ranks wait at the gate
            open(gate, "w").close()
            attached += third.collect(attaching)
            assert f"step {STEPS - 1}" in attached and "cell done" in attached, attached
            metrics = third.ok(
                "import nbdist\nrun = nbdist.current_session().metrics\n"
                "for r in range(2):\n"
                "    steps, losses = run.series('loss', r)\n"
                f"    print(r, steps == list(range({STEPS})), losses == [s * 0.5 + r for s in steps])"
            )
            assert "0 True True" in metrics and "1 True True" in metrics, metrics
            state = third.ok("%%on_all_ranks\nprint(state + 1)")
            assert "101" in state and "102" in state, state
            assert f"stopped session '{name}'" in third.ok(f"%dist_stop {name}")
        finally:
            third.shutdown()
        assert wait_gone(pids) == []
        assert named_session_records.read(name) is None
        if "slurm" in launcher:
            assert squeue() == []
        assert _remote_dirs() == remote_before
    finally:
        if named_session_records.read(name) is not None:
            named_session_records.stop(name)
