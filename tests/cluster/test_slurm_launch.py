"""--launcher slurm on a real one-node Slurm cluster: one job, its tasks the ranks.

Each test starts 2 ranks (the local cluster has as many CPUs as the machine,
and CI's has 2), and checks that the job has left ``squeue`` afterwards.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import signal
import subprocess
import threading
import time

import pytest
from IPython.core.interactiveshell import InteractiveShell

import nbdist
from nbdist.driver.sinks import ListSink
from nbdist.errors import NbdistError, PlacementError, RankError
from tests.cluster.conftest import SEGFAULT_CELL, gone, squeue

pytestmark = pytest.mark.slow

# Far longer than anything here takes: a cell that sleeps this long and ends
# early ended because its ranks died, not because it finished.
LONG_S = 600


def _session(**options) -> nbdist.DistSession:
    return nbdist.DistSession(
        2,
        cpu=True,
        timeout=180,
        group_timeout=60,
        history=False,
        launcher="slurm",
        launch_options=options or None,
    )


def _job_id(session) -> str:
    match = re.search(r"Slurm job (\d+)", session.summary())
    assert match, session.summary()
    return match.group(1)


def test_magics_start_a_job_whose_tasks_are_the_ranks_and_stop_ends_it(slurm, capsys):
    shell = InteractiveShell.instance()
    shell.run_line_magic("load_ext", "nbdist")
    shell.run_line_magic("dist_start", "2 --cpu --launcher slurm --time 10 --timeout 180")
    magics = shell.magics_manager.registry["DistMagics"]
    session = magics.session
    try:
        start_line = capsys.readouterr().out
        job = re.search(r"2 ranks ready .*; Slurm job (\d+)", start_line)
        assert job, start_line
        job = job.group(1)
        assert [(j[0], j[2]) for j in squeue()] == [(job, "RUNNING")]
        session.run(
            "import os\n"
            "t = torch.ones(1) * (rank + 1)\n"
            "dist.all_reduce(t)\n"
            "seen = (rank, local_rank, world_size, int(os.environ['SLURM_PROCID']),\n"
            "        int(os.environ['SLURM_LOCALID']), os.environ['SLURM_JOB_ID'],\n"
            "        int(os.environ['RANK']), int(os.environ['LOCAL_RANK']), t.item())",
            sink=ListSink(),
        )
        # rank == SLURM_PROCID, LOCAL_RANK == SLURM_LOCALID, both ranks in this job;
        # 1 + 2 summed over the group: exact in float32.
        assert session.pull("seen") == [
            (0, 0, 2, 0, 0, job, 0, 0, 3.0),
            (1, 1, 2, 1, 1, job, 1, 1, 3.0),
        ]
        pids = [r.pid for r in session.ranks]
    finally:
        shell.run_line_magic("dist_stop", "")
    assert "stopped 2 ranks" in capsys.readouterr().out
    assert squeue() == []
    assert gone(pids) == []


def test_scancel_of_the_job_names_the_dead_ranks_in_the_cell(slurm, tmp_path):
    with _session() as session:
        job = _job_id(session)
        ready = tmp_path / "ready"
        ready.mkdir()
        cancelled_at = []

        cell_over = threading.Event()

        def cancel_once_both_ranks_sleep():
            while len(os.listdir(ready)) < 2:
                if cell_over.wait(0.05):
                    return
            cancelled_at.append(time.monotonic())
            subprocess.run(["scancel", job], check=True)

        canceller = threading.Thread(target=cancel_once_both_ranks_sleep)
        canceller.start()
        try:
            with pytest.raises((RankError, NbdistError)) as info:
                session.run(
                    f"import pathlib, time\n"
                    f"pathlib.Path({str(ready)!r}, str(rank)).touch()\n"
                    f"time.sleep({LONG_S})",
                    sink=ListSink(),
                )
        finally:
            cell_over.set()
            canceller.join()
        took = time.monotonic() - cancelled_at[0]
        print(f"scancel -> cell ended in {took:.1f} s")
        assert took < LONG_S / 10  # it ended because the ranks died, not by itself
        assert sorted(session.dead_ranks()) == [0, 1]
        assert re.search(r"rank 0.*died|ranks 0 and 1 died", str(info.value)), str(info.value)
    assert squeue() == []


def test_kill_of_one_task_names_that_rank_and_stop_cancels_the_job(slurm):
    with _session() as session:
        victim = session.ranks[1].pid
        with pytest.raises(RankError) as info:
            session.run(
                "import os, signal\n"
                "if rank == 1:\n"
                "    os.kill(os.getpid(), signal.SIGKILL)\n"
                "dist.all_reduce(torch.ones(1))\n",
                sink=ListSink(),
            )
        assert info.value.ranks == [1]
        assert f"pid {victim}" in info.value.failures[0].evalue
        assert "rank 1 died" in str(info.value)
        survivor = session.ranks[0].pid
    assert squeue() == []
    assert gone([survivor]) == []


def test_a_task_that_segfaults_names_the_cells_line_and_stop_removes_the_records(slurm):
    with _session() as session:
        records = [r.crash_record for r in session.ranks]
        victim = session.ranks[1].pid
        assert all(os.path.isfile(path) for path in records), records
        with pytest.raises(RankError) as info:
            session.run(SEGFAULT_CELL, sink=ListSink())
        assert info.value.ranks == [1]
        cause = info.value.failures[0].evalue
        # Slurm's step daemon reaps the rank at once: where the kernel read the exit status
        # first, the signal is named ("crashed: segmentation fault (SIGSEGV, ...) - in ..."),
        # else the record says it ("crashed: Segmentation fault, in ...").
        assert re.match(rf"pid {victim} crashed: segmentation fault[ ,(]", cause, re.I), cause
        assert "in string_at (ctypes/__init__.py:" in cause, cause
        assert cause.endswith("from the cell, line 3"), cause
    assert squeue() == []
    assert [path for path in records if os.path.exists(path)] == []


class _Watched(io.TextIOBase):
    """stdout that a thread can wait on."""

    def __init__(self) -> None:
        self.text = ""
        self.changed = threading.Condition()

    def write(self, s: str) -> int:
        with self.changed:
            self.text += s
            self.changed.notify_all()
        return len(s)

    def wait_for(self, pattern: str, done: threading.Event) -> re.Match | None:
        """The first match of ``pattern`` in what was written; None once ``done`` is set."""
        with self.changed:
            self.changed.wait_for(lambda: re.search(pattern, self.text) or done.is_set())
            return re.search(pattern, self.text)

    def finish(self, done: threading.Event) -> None:
        with self.changed:
            done.set()
            self.changed.notify_all()


def test_a_pending_job_says_why_and_ctrl_c_cancels_it(slurm):
    cpus = subprocess.run(
        ["sinfo", "-h", "-o", "%C"], capture_output=True, text=True, check=True
    ).stdout.split("/")[-1]  # allocated/idle/other/total
    blocker = subprocess.run(
        [
            "sbatch",
            "--parsable",
            "-n",
            cpus.strip(),
            "-o",
            "/dev/null",
            "--wrap",
            f"sleep {LONG_S}",
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    out = _Watched()
    try:
        while [j[2] for j in squeue() if j[0] == blocker] != ["RUNNING"]:
            time.sleep(0.1)
        session = _session()

        done = threading.Event()

        def interrupt_once_waiting():
            if out.wait_for(r"waiting for Slurm: job \d+ PENDING \(Resources\)", done):
                os.kill(os.getpid(), signal.SIGINT)  # the kernel's Ctrl-C

        interrupter = threading.Thread(target=interrupt_once_waiting)
        interrupter.start()
        try:
            with contextlib.redirect_stdout(out), pytest.raises(KeyboardInterrupt):
                try:
                    session.start()
                except NbdistError as exc:  # what nbdist printed meanwhile says why no Ctrl-C came
                    raise AssertionError(f"{exc}\nprinted while waiting:\n{out.text}") from None
        finally:
            out.finish(done)  # start() returned: nothing more to wait for
            interrupter.join()
        line = re.search(r"waiting for Slurm: job (\d+) PENDING \(Resources\) · \d+ s", out.text)
        assert line, out.text
        assert line.group(1) != blocker
        assert [j[0] for j in squeue()] == [blocker]  # ours was cancelled, nothing else
        assert not session.running
    finally:
        subprocess.run(["scancel", blocker], check=True)
        while squeue():
            time.sleep(0.1)


@pytest.mark.parametrize(
    "options, slurm_says",
    [
        ({"partition": "no-such-partition"}, "invalid partition specified: no-such-partition"),
        ({"account": "no-such-account"}, "Invalid account"),
    ],
)
def test_what_slurm_refuses_is_its_error_and_nothing_is_queued(slurm, options, slurm_says):
    session = _session(**options)
    with pytest.raises(PlacementError, match=re.escape(slurm_says)) as info:
        session.start()
    assert "Nothing was submitted" in str(info.value)
    assert not session.running
    assert squeue() == []
