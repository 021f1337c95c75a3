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
has stayed (:func:`held`); one held :data:`HELD_S` after its own release ends itself
on the kernel's request (:func:`end_if_held`): its processes are ended as at a stop,
and it exits with :data:`EXIT_CODE`, which the kernel's death words name.

Two kinds of wait are seen. A call made through ``torch.distributed`` is in nbdist's
own record (:mod:`nbdist.engine.collectives`), entered before the release and not
returned. A wait in C++ is not: DDP's gradient all-reduce in ``backward()``, or an
``async_op`` work's ``wait()``. Such a rank counts as held when all of these hold: its
main thread runs a cell and has run no bytecode since the release (a pending call
CPython would run there at its next bytecode has not run: the SIGINT that follows a
release would have raised wherever bytecode ran), it sleeps (the kernel's thread
state, and no CPU time across a short look: a C++ computation, a matrix product,
runs), and the group's flight recorder (:mod:`nbdist.engine.flight_recorder`) holds a
call created before the release that never finished, or the last call nbdist recorded
before the release returned works not finished (a pipeline schedule's
``batch_isend_irecv``: gloo's recorder has no point-to-point calls).
"""

from __future__ import annotations

import ctypes
import os
import sys
import threading
import time

from nbdist.engine import collectives, crash_record, flight_recorder, own_processes

__all__ = [
    "EXIT_CODE",
    "HELD_S",
    "asleep_since_release",
    "end_if_held",
    "forget_release",
    "held",
    "mark_released",
]

# A released rank leaves its collective within seconds: at 256 ranks on 2 cores, 1.6 s
# after its release at the median and 2.5 s at most (a cell where one rank died,
# 2026-12-05). One still inside four times as long after its own release is held by gloo.
HELD_S = 10.0
# The exit status of a rank that ended itself here (EX_TEMPFAIL: the job itself is fine).
EXIT_CODE = 75
# How long the main thread is watched for a C++ wait, and how much its CPU clock may
# advance meanwhile: a sleeping thread's does not move. A computing one's state reads R
# (running, or waiting for a core: on a machine with far more ranks than cores its clock
# may move little), and its clock moves where it gets a core.
_SLEEP_LOOK_S = 0.05
_SLEEP_CPU_S = 0.001

_released_at: float | None = None  # time.monotonic() of this rank's last release
_released_ns = 0  # the same moment on the flight recorder's clock (time.time_ns())
# Whether the main thread ran bytecode since the release: a pending call, which CPython
# runs on the main thread at its next bytecode, sets it. (Its frame cannot tell: a loop
# back to the same sleep is the same frame at the same instruction.)
_ran_since_release = True


def _note_bytecode(_arg) -> int:
    global _ran_since_release
    _ran_since_release = True
    return 0


# Kept for the process's life: CPython calls it later, from the main thread.
_NOTE_BYTECODE = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p)(_note_bytecode)


def mark_released() -> None:
    """The release runs now (called by :func:`nbdist.engine.control.release`)."""
    global _released_at, _released_ns, _ran_since_release
    _ran_since_release = False
    if ctypes.pythonapi.Py_AddPendingCall(_NOTE_BYTECODE, None) != 0:
        _ran_since_release = True  # CPython's queue is full: nothing can count as asleep
    _released_ns = time.time_ns()
    _released_at = time.monotonic()


def forget_release() -> None:
    """The group formed again: no release is pending."""
    global _released_at
    _released_at = None


def held(busy: bool) -> dict | None:
    """``{"s": seconds, "call": "send #2"}``: the call this rank has stayed in since its release.

    ``busy``: whether the main thread runs a cell (or an apply) now. None where the rank
    was not released, is in no call, or entered this one after the release (a call on
    the released group fails at once: it is not held).
    """
    released_at = _released_at
    if released_at is None or not busy:
        return None
    now = time.monotonic()
    last = collectives.last()
    if last and last["inside"]:
        if now - last["seconds"] > released_at:
            return None
        return {"s": now - released_at, "call": f"{last['op']} #{last['seq']}"}
    call = _native_wait()
    return None if call is None else {"s": time.monotonic() - released_at, "call": call}


def _native_wait() -> str | None:
    """The unfinished call a main thread asleep in C++ since the release waits for, if any."""
    if not asleep_since_release():
        return None
    opened = flight_recorder.open_before(_released_ns)
    if opened is not None:
        return f"{opened['op']} #{opened['seq']} (waited for in C++: DDP's backward, or a work's wait())"
    # gloo's recorder has no point-to-point calls: a pipeline schedule's batch_isend_irecv
    # works are in nbdist's own record.
    call = collectives.open_work_since(_released_at)
    return None if call is None else f"{call} (waited for in C++: a work's wait())"


def asleep_since_release() -> bool:
    """Whether the main thread has slept in one native call since the release (Linux only).

    No bytecode ran (a pending call CPython would have run on the main thread at its next
    bytecode has not run), the kernel says it sleeps, and its CPU clock stays still across
    :data:`_SLEEP_LOOK_S`: a C++ computation that began before the release (a matrix
    product) runs, and does not count.
    """
    if _released_at is None or _ran_since_release:
        return False
    try:
        clock = time.pthread_getcpuclockid(threading.main_thread().ident)
        before = time.clock_gettime(clock)
        asleep = _main_thread_state() == "S"
        time.sleep(_SLEEP_LOOK_S)
        asleep = asleep and _main_thread_state() == "S"
        moved = time.clock_gettime(clock) - before
    except (AttributeError, OSError):  # not Linux: a C++ wait cannot be told from work
        return False
    return asleep and moved <= _SLEEP_CPU_S and not _ran_since_release


def _main_thread_state() -> str:
    """The Linux state letter of the main thread (``S``: asleep, ``R``: runs).

    The process's own ``stat`` holds its main thread's state: a rank in a PID namespace
    of its own sees ``/proc`` with other thread numbers than ``threading`` gives.
    """
    with open("/proc/self/stat") as f:
        # "pid (comm) S ...": the name may hold spaces and parentheses, the state follows its last ')'.
        return f.read().rsplit(")", 1)[1].split()[0]


def end_if_held(min_s: float, busy: bool) -> bool:
    """End this process if it has been held at least ``min_s`` (it left meanwhile: False).

    Runs on the control thread while the main thread waits in gloo: the output the
    cell printed so far goes out first, then the processes the rank's code started end
    (as at a stop), then the process exits without running Python's exit handlers,
    which would wait for the held main thread.
    """
    found = held(busy)
    if found is None or found["s"] < min_s:
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
