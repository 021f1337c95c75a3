"""Both sides: ending given processes, SIGTERM first and SIGKILL after a grace period.

The kernel ends the ranks and the trees below them (:mod:`nbdist.launch.process_tree`),
and a launched rank ends what its own code started (:mod:`nbdist.engine.own_processes`);
both pick their processes by PID and end them here. Each is held as a
``psutil.Process``, which remembers the process's start time and refuses to signal a
PID that was reused by another process since.
"""

from __future__ import annotations

import signal
from collections.abc import Iterable

import psutil  # an ipyparallel dependency: every engine has it

__all__ = ["TERM_GRACE_S", "end", "running", "send"]

# Seconds a process gets between SIGTERM and SIGKILL.
TERM_GRACE_S = 3.0


def running(proc: psutil.Process) -> bool:
    """Still running and still the same process (a zombie has finished)."""
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def send(proc: psutil.Process, sig: int) -> bool:
    """Send ``sig`` to ``proc``; False if it is gone (or its PID now names another process)."""
    try:
        proc.send_signal(sig)  # psutil checks the start time first: no reused PID is hit
        return True
    except psutil.Error:
        return False


def end(procs: Iterable[psutil.Process], grace: float = TERM_GRACE_S) -> list[int]:
    """SIGTERM ``procs``, wait up to ``grace`` s, SIGKILL the rest; the PIDs that had to be killed.

    Returns within ``grace`` + 1 s (a process in uninterruptible sleep may
    take longer to disappear after SIGKILL; it is not waited for beyond that).
    """
    procs = [p for p in procs if running(p)]
    if not procs:
        return []
    for proc in procs:
        send(proc, signal.SIGTERM)
        send(proc, signal.SIGCONT)  # a stopped process acts on SIGTERM only once continued
    _, alive = psutil.wait_procs(procs, timeout=grace)
    alive = [p for p in alive if running(p)]
    killed = [p.pid for p in alive if send(p, signal.SIGKILL)]
    psutil.wait_procs(alive, timeout=1.0)
    return killed
