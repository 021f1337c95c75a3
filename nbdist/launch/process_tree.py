"""Separate process and kernel side: the processes below the ones nbdist started, ended by PID.

Code on a rank may start processes of its own: a forked child, a
``multiprocessing.Process``, ``subprocess.Popen``, DataLoader workers, a
daemon that forked twice and whose parent exited. None of them may outlive
``%dist_stop`` or the kernel. Two pieces make that hold on Linux:

- The engine zygote is a *child subreaper* (:func:`become_subreaper`,
  ``prctl(PR_SET_CHILD_SUBREAPER)``, Linux >= 3.4): an orphan anywhere below it
  is re-parented to the zygote instead of PID 1, so every process the ranks
  started stays a descendant of the zygote, found by walking the process tree
  (:func:`descendants`), however it daemonised. The attribute is not inherited
  across ``fork``, so only the zygote has it; the engines reap their own
  children as before.
- Ending goes by PID, SIGTERM first and SIGKILL after a grace period
  (:func:`nbdist.engine.process_ending.end`, :class:`TreeStop`). Each process is held as a
  ``psutil.Process``, which remembers the process's start time and refuses to
  signal a PID that was reused by another process since.

Nothing here is found by name, and nothing outside the given roots' trees is
touched.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import time
from collections.abc import Iterable

import psutil

from nbdist.engine.process_ending import TERM_GRACE_S
from nbdist.engine.process_ending import running as _running
from nbdist.engine.process_ending import send as _send

__all__ = ["TreeStop", "alive", "become_subreaper", "descendants", "pid_entry"]

_PR_SET_CHILD_SUBREAPER = 36


def become_subreaper() -> bool:
    """Make this process the reaper of orphans below it (Linux); False where unsupported."""
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    return libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0


def descendants(roots: Iterable[int]) -> list[psutil.Process]:
    """Every live process below ``roots`` (the roots themselves left out), as ``psutil.Process``.

    One pass over the process table, then a walk down it: asking each root
    for its children re-reads every process's parent from /proc per root,
    which at 256 ranks (a root each) took seconds of each ``%dist_stop``.
    """
    roots = set(roots)
    procs: dict[int, psutil.Process] = {}
    children_of: dict[int, list[int]] = {}
    try:
        for proc in psutil.process_iter(["ppid"]):
            ppid = proc.info.get("ppid")
            if ppid is not None:
                procs[proc.pid] = proc
                children_of.setdefault(ppid, []).append(proc.pid)
    finally:
        # psutil keeps a Process for every process of the machine between calls (~600
        # here, ~340 KiB, more as the machine runs more): a kernel stops ranks now and
        # then, and has no use for that table in between.
        clear = getattr(psutil.process_iter, "cache_clear", None)  # psutil >= 6
        if clear is not None:
            clear()
    found: dict[int, psutil.Process] = {}
    todo = [(pid, _started(procs.get(pid) or pid)) for pid in roots]
    while todo:
        parent, parent_started = todo.pop()
        for pid in children_of.get(parent, ()):
            child = procs[pid]
            started = _started(child)
            # A child younger than its parent: a PID reused since the parent's own
            # child exited is not below it (psutil's children() checks the same).
            if started is None or (parent_started is not None and started < parent_started):
                continue
            if pid not in roots and pid not in found:
                found[pid] = child
                todo.append((pid, started))
    return list(found.values())


def pid_entry(pid: int) -> dict | None:
    """``{"pid", "created"}`` of a running process (its start time tells it from a reused PID).

    What a file that outlives its writer keeps to find the process again (:func:`alive`).
    """
    try:
        return {"pid": pid, "created": psutil.Process(pid).create_time()}
    except psutil.Error:
        return None


def alive(entry: dict | None) -> psutil.Process | None:
    """The process of a :func:`pid_entry` if it still runs (same PID, same start time), else None.

    An entry without a start time (``"created"`` missing or None) matches any running
    process with its PID.
    """
    if not isinstance(entry, dict) or not entry.get("pid"):
        return None
    try:
        proc = psutil.Process(int(entry["pid"]))
        if proc.status() == psutil.STATUS_ZOMBIE:
            return None
        created = entry.get("created")
        if created is not None and abs(proc.create_time() - float(created)) >= 1.0:
            return None  # the PID now names another process
        return proc
    except (psutil.Error, TypeError, ValueError):
        return None


def _started(proc) -> float | None:
    """A process's start time (``proc``: a ``psutil.Process`` or a PID), None once gone."""
    try:
        return (proc if isinstance(proc, psutil.Process) else psutil.Process(proc)).create_time()
    except psutil.Error:
        return None


class TreeStop:
    """Ending every process below this one, a step at a time (the zygote's loop drives it).

    Each :meth:`step` looks at the tree again, so processes started or
    re-parented during the stop are ended too: SIGTERM once to each, and after
    ``grace`` seconds SIGKILL to whatever is still there.
    """

    def __init__(self, grace: float = TERM_GRACE_S) -> None:
        """Start the clock: SIGKILL follows ``grace`` seconds from now."""
        self.kill_at = time.monotonic() + grace
        self._termed: set[tuple[int, float]] = set()

    def step(self) -> bool:
        """Signal what is below this process; False once nothing is left running there."""
        kill = time.monotonic() >= self.kill_at
        left = False
        for proc in descendants([os.getpid()]):
            if not _running(proc):
                continue  # a zombie: its parent (or this process) reaps it
            left = True
            try:
                key = (proc.pid, proc.create_time())
            except psutil.Error:
                continue
            if kill:
                _send(proc, signal.SIGKILL)
            elif key not in self._termed:
                self._termed.add(key)
                _send(proc, signal.SIGTERM)
                _send(proc, signal.SIGCONT)
        return left
