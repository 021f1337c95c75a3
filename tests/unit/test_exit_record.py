"""A dead rank's exit status survives its parent reaping it before the kernel looked.

The kernel reads a dead rank's wait status from its zombie; the zygote (the ranks'
parent) reaps zombies within 0.1 s, and when it won that race the kernel said "exit
status not available" instead of "killed by SIGKILL" (seen once in CI). The zygote
now records each engine's status; the kernel's monitor falls back to the record.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

from nbdist.driver.rank_deaths import RankMonitor, death_cause
from nbdist.launch.zygote import read_exit, record_exit


def test_a_reaped_rank_is_still_named_killed_by_its_signal(tmp_path):
    status_file = str(tmp_path / "engines.status.json")
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])

    class Info:  # what the monitor reads of a RankInfo
        rank, engine_id, pid, host, pid_here = 1, 7, child.pid, "localhost", True

    monitor = RankMonitor([Info()], exit_record=lambda pid: read_exit(status_file, pid))
    try:
        assert read_exit(status_file, child.pid) is None
        os.kill(child.pid, signal.SIGKILL)
        # Reaped at once by its parent (this process, as the zygote would), then recorded.
        _, status = os.waitpid(child.pid, 0)
        record_exit(status_file, child.pid, status)
        assert read_exit(status_file, child.pid) == status
        monitor._thread.join(timeout=5)
        assert monitor.dead[1].startswith(f"pid {child.pid} killed by SIGKILL (signal 9)")
    finally:
        monitor.stop()
    assert death_cause(None) == "exited (exit status not available)"


def test_a_rank_gone_before_its_watch_began_is_named_dead_and_reported(tmp_path):
    """A named session's rank that died while no kernel held it: its PID names nothing when
    the next kernel's watch begins. The controller never drops a local engine by itself, so
    the watch must name it (it skipped it, and the controller's drop named it 30 s later)."""
    status_file = str(tmp_path / "engines.status.json")
    child = subprocess.Popen([sys.executable, "-c", "import os; os._exit(3)"])
    _, status = os.waitpid(child.pid, 0)
    record_exit(status_file, child.pid, status)

    class Info:
        rank, engine_id, pid, host, pid_here = 1, 7, child.pid, "localhost", True

    told = []
    monitor = RankMonitor(
        [Info()], on_death=told.append, exit_record=lambda pid: read_exit(status_file, pid)
    )
    try:
        # Named before the monitor is returned: the next cell must not go to it.
        assert monitor.dead == {1: f"pid {child.pid} exited with code 3"}
        assert told == [1]
    finally:
        monitor.stop()
