"""The join guard reads the joining ranks' processes: what a timed-out join says of them, and
whether the settle after its interrupt still has a rank that can unwind. Real processes,
stopped and continued; the run is the one thing the guard asks (each rank's reply so far)."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import psutil
import pytest

from nbdist.driver.join_guard import JoinGuard


class _Replies:
    """What a RankRun tells its guard: each rank's reply so far."""

    def __init__(self, states: dict[int, str]):
        self.states = states

    def child_states(self) -> dict[int, str]:
        return dict(self.states)


@pytest.fixture
def rank_process():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        yield child
    finally:
        child.send_signal(signal.SIGCONT)
        child.kill()
        child.wait()


def _until(check, timeout: float = 10.0) -> bool:
    # A signal's effect shows in the process table a moment after kill() returns.
    deadline = time.monotonic() + timeout
    while not check() and time.monotonic() < deadline:
        time.sleep(0.02)
    return check()


def test_the_settle_stops_waiting_only_once_every_running_rank_is_stopped(rank_process):
    guard = JoinGuard(lambda ranks: None, processes={1: psutil.Process(rank_process.pid)})
    run = _Replies({0: "ok", 1: "running"})
    assert not guard.only_stopped_left(run)  # asleep: a SIGINT reaches it
    rank_process.send_signal(signal.SIGSTOP)
    assert _until(lambda: guard.only_stopped_left(run))
    # A second rank still running whose process is not read here may yet unwind.
    assert not guard.only_stopped_left(_Replies({0: "running", 1: "running"}))
    rank_process.send_signal(signal.SIGCONT)
    assert _until(lambda: not guard.only_stopped_left(run))
    assert not guard.only_stopped_left(_Replies({0: "ok", 1: "ok"}))  # none left: not this


def test_a_timed_out_join_names_the_silent_ranks_processes_and_no_command_if_they_go(
    rank_process,
):
    pid = rank_process.pid
    rank_process.send_signal(signal.SIGSTOP)
    stays = JoinGuard(lambda ranks: None, processes={3: psutil.Process(pid)})
    assert _until(lambda: "is stopped" in stays.silent_states([3]))
    assert stays.silent_states([3]) == (
        f"the process here of rank 3 (pid {pid}) is stopped (SIGSTOP, or Ctrl-Z in its "
        f"terminal): `kill -CONT {pid}` lets it go on"
    )
    goes = JoinGuard(lambda ranks: None, processes={3: psutil.Process(pid)}, processes_stay=False)
    assert goes.silent_states([3]) == (
        f"the process here of rank 3 (pid {pid}) is stopped (SIGSTOP, or Ctrl-Z in its terminal)"
    )
    assert stays.silent_states([0, 1]) == ""  # ranks on other hosts: nothing read
