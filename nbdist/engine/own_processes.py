"""Rank side: the processes a rank's own code started on its host, ended with the rank.

A rank that nbdist's zygote forked has the zygote below the kernel: a stop ends the
whole tree under it. A rank that a launcher started (``--launcher ssh``, ``slurm``,
``mpi``, ``local``) may run on another host, where the kernel can neither see nor
signal its processes, and where a PID the kernel knows names some other process. What
the rank's cells started there (a ``subprocess``, a data server, DataLoader workers
that outlive it) would run on under init after the rank ended. So such a rank ends
them itself: when it exits (``%dist_stop``, a restart: :func:`end_at_exit`) and when
it ends itself because its controller is gone (:mod:`nbdist.engine.controller_watch`).
"""

from __future__ import annotations

import atexit

from nbdist.engine import process_ending

__all__ = ["end_at_exit", "end_children"]

# Helpers that end by themselves once the rank has gone, and must outlive it for that
# moment: ipyparallel's nanny (it tells the controller how the engine ended) and
# multiprocessing's resource tracker (it removes what a crashed process leaked; it
# ignores SIGTERM, so ending it would also cost the whole grace at every exit).
_HELPERS = ("ipyparallel.engine.nanny", "multiprocessing.resource_tracker")
_registered: list[bool] = []


def _is_helper(proc) -> bool:
    try:
        command = " ".join(proc.cmdline())
    except Exception:  # gone, or not ours to read: not a helper to keep
        return False
    return any(helper in command for helper in _HELPERS)


def end_children(grace: float = process_ending.TERM_GRACE_S) -> list[int]:
    """End every process below this one but the helpers that end with it; their PIDs.

    Taken while they are still this process's descendants: once it has ended they
    belong to init, and nothing tells them from any other process of the host.
    SIGTERM first, SIGKILL to what is left after ``grace`` seconds.
    """
    import psutil

    try:
        children = psutil.Process().children(recursive=True)
    except psutil.Error:
        return []
    children = [child for child in children if not _is_helper(child)]
    process_ending.end(children, grace)
    return [child.pid for child in children]


def end_at_exit() -> None:
    """End this rank's child processes when it exits normally (once per process)."""
    if not _registered:
        atexit.register(end_children)
        _registered.append(True)
