"""Kernel side: the controller's heartbeat, its period and how many beats a rank may miss.

The controller (:mod:`nbdist.launch.cluster` starts it) pings every engine each period and
drops one whose heart stays silent too long (never, for the ranks the zygote forked: see
below); an engine counts as registered on the first beat after its ping reply, so the
period is also on a start's critical path. Engines never end themselves on missed pings
(:data:`nbdist.launch.batch_task_engine.NO_SELF_SHUTDOWN`).
"""

from __future__ import annotations

import os

__all__ = ["misses", "period_ms", "pidfds_work"]

# The controller takes an engine as registered on a heartbeat after its ping reply: the
# period is on the start-up's critical path. 100 ms -> 50 ms made a 2-rank start 0.2 s
# shorter (median of 5, 1.81 -> 1.60 s, 2 cores).
_HEARTBEAT_MS = 50
# Every beat is a ping to each engine, a reply from each engine's heart thread, and the
# controller's heart process reading each reply in Python. An idle session's CPU besides
# gloo's own threads, at 50 ms: 0.35 of 2 cores at 64 ranks (0.32 of it the beats), 1.09-1.25
# at 256 ranks, against 0.07-0.08 at 1.6 s (bench/RESULTS.md, 2026-12-01). Beyond
# _BEATS_FLAT_UP_TO ranks the period grows with the ranks, so the controller reads as
# many replies a second as for 8 ranks; an engine's registration waits for a beat, a
# second or two at most of a start that takes a minute at 256 ranks.
_BEATS_FLAT_UP_TO = 8
_HEARTBEAT_MAX_MS = 2000
# How long an engine's heart may stay silent before the controller drops it (the cell it
# runs then fails: "stopped answering the controller's heartbeat"). ipyparallel's 1 s, then
# 3 s, dropped live ranks on a loaded 2-core machine: while other sessions start beside them
# (torch imports, forks), every heart of a session answers late at once (4 idle-ish ranks
# beside the test suite's sessions: up to 0.5 s in a row, 2026-12-01), and a 3 s gap came
# now and then. A launcher's ranks (other hosts, other PID namespaces) have only the
# heartbeat: 10 s, so a death there is still named within seconds.
_LAUNCHED_SILENCE_S = 10
# Ranks the zygote forked are watched by their pidfds (driver/rank_deaths.py), which see a
# death at once, and a dead one is unregistered then (launch/engine_unregister.py): for them
# the heartbeat only ever spoke falsely. A live local engine's heart (a zmq thread that
# needs no GIL) goes silent only while its process is stopped - SIGSTOP, Ctrl-Z, a debugger
# such as gdb holding it - or the machine stalls, and 30 s of that dropped a rank a
# debugger held, which then worked on for nobody. They are never dropped (2**31 beats:
# years at any period); where this machine has no pidfds, 30 s.
_LOCAL_SILENCE_S = 30
_NEVER = 2**31 - 1


def pidfds_work() -> bool:
    """Whether deaths of local processes can be seen through pidfds here (Linux >= 5.3)."""
    try:
        fd = os.pidfd_open(os.getpid())
    except (AttributeError, OSError):
        return False
    os.close(fd)
    return True


def period_ms(n: int) -> int:
    """The controller's heartbeat period for ``n`` ranks, in milliseconds.

    Example::

        >>> period_ms(4), period_ms(64), period_ms(256), period_ms(1024)
        (50, 400, 1600, 2000)
    """
    grown = _HEARTBEAT_MS * n // _BEATS_FLAT_UP_TO
    return min(_HEARTBEAT_MAX_MS, max(_HEARTBEAT_MS, grown))


def misses(launcher, period: int) -> int:
    """Beats the controller lets an engine miss: ``launcher`` None is the zygote's ranks."""
    if launcher is None:
        return _NEVER if pidfds_work() else _LOCAL_SILENCE_S * 1000 // period
    return _LAUNCHED_SILENCE_S * 1000 // period
