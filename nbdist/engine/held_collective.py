"""Rank side: a collective that outlives this rank's release, measured and ended.

A release (:func:`nbdist.engine.control.release`) shuts the gloo group's sockets so
that every wait fails at once. Two waits it cannot end. A send that gloo queued (its
socket full, or its write met the closed connection, EPIPE or ECONNRESET, before
gloo's own loop thread saw it close): when the connection's error comes, gloo tells
the queued sends of its old, bound buffers, not those of the unbound buffers that
torch's collectives and point-to-point calls use. And a receive halfway through its
data, which gloo holds apart from the receives it tells (gloo's ``pair.cc``,
``signalException``). Either waits for the group's timeout, 30 minutes by default.
At 256 ranks on 2 cores, where a loop thread runs seconds behind, one rank in about
four cells with a death stayed so; at 3 ranks, a rank stopped halfway through a large
transfer does it every time (tests/faults/test_held_after_release.py).

Nothing in the process can wake that wait, and no later collective of the group can
run. The kernel asks each rank still in a collective after the release how long it
has stayed (:func:`held_s`); one held :data:`HELD_S` after its own release ends
itself on the kernel's request (:func:`end_if_held`): its processes are ended as at
a stop, and it exits with :data:`EXIT_CODE`, which the kernel's death words name.
"""

from __future__ import annotations

import os
import sys
import time

from nbdist.engine import collectives, crash_record, own_processes

__all__ = ["EXIT_CODE", "HELD_S", "end_if_held", "held_s", "mark_released", "forget_release"]

# A released rank leaves its collective within seconds: at 256 ranks on 2 cores, 1.6 s
# after its release at the median and 2.5 s at most (a cell where one rank died,
# 2026-12-05). One still inside four times as long after its own release is held by gloo.
HELD_S = 10.0
# The exit status of a rank that ended itself here (EX_TEMPFAIL: the job itself is fine).
EXIT_CODE = 75

_released_at: float | None = None  # time.monotonic() of this rank's last release


def mark_released() -> None:
    """The release ran now (called by :func:`nbdist.engine.control.release`)."""
    global _released_at
    _released_at = time.monotonic()


def forget_release() -> None:
    """The group formed again: no release is pending."""
    global _released_at
    _released_at = None


def held_s() -> float | None:
    """Seconds this rank has stayed, since its release, in a collective it entered before it.

    None where it was not released, is in no collective, or entered this one after the
    release (a call on the released group fails at once: it is not held).
    """
    released_at = _released_at
    last = collectives.last()
    if released_at is None or not last or not last["inside"]:
        return None
    now = time.monotonic()
    if now - last["seconds"] > released_at:
        return None
    return now - released_at


def end_if_held(min_s: float) -> bool:
    """End this process if it has been held at least ``min_s`` (it left meanwhile: False).

    Runs on the control thread while the main thread waits in gloo: the output the
    cell printed so far goes out first, then the processes the rank's code started end
    (as at a stop), then the process exits without running Python's exit handlers,
    which would wait for the held main thread.
    """
    held = held_s()
    if held is None or held < min_s:
        return False
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # a closed or replaced stream: nothing more to send
            pass
    time.sleep(0.2)  # the flushed output leaves through the engine's IO thread
    own_processes.end_children()
    crash_record.remove_own_record()  # it did not crash: no record to read
    os._exit(EXIT_CODE)
