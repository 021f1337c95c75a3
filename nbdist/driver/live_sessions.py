"""Kernel side: the sessions running in this kernel, the current one, and stopping them all.

:meth:`nbdist.DistSession.start` and ``stop`` report here; ``nbdist.current_session()``
and ``%unload_ext nbdist`` read it, and so does the kernel's exit: a kernel that
shuts down or restarts stops every session's processes first, except a named
session's (``outlives_kernel``, :mod:`nbdist.driver.named_sessions`), which it only detaches from.
"""

from __future__ import annotations

import atexit
import weakref

from nbdist.errors import ClusterNotRunning

__all__ = ["current_session", "started", "stop_all", "stopped"]

_current: weakref.ReferenceType | None = None
# Held strongly from start to stop: a running session whose variable was rebound
# (``s = DistSession(2).start()`` run twice) is garbage to Python but not to the
# machine: its processes run on, and only a session found here is stopped at exit.
_live: set = set()


def started(session) -> None:
    """``session`` started: it is running, and the current session."""
    global _current
    _current = weakref.ref(session)
    _live.add(session)


def stopped(session) -> None:
    """``session`` stopped its ranks."""
    _live.discard(session)


def current_session():
    """The session started last in this process that is still running."""
    session = _current() if _current is not None else None
    if session is None or not session.running:
        raise ClusterNotRunning(
            "no nbdist cluster is running: start one with %dist_start (or DistSession().start())"
        )
    return session


@atexit.register
def stop_all() -> None:
    """Stop every running session of this process (kernel shutdown, ``%unload_ext nbdist``).

    Named sessions are detached from, not stopped: they outlive the kernel.
    """
    for session in list(_live):
        try:
            if getattr(session, "outlives_kernel", False):
                session.detach()
            else:
                session.stop()
        except Exception:
            pass
