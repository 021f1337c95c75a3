"""Rank side: while a request runs, SIGINT raises KeyboardInterrupt in the user's code only.

ipykernel installs Python's own SIGINT handler for the whole of a request, so a
SIGINT raises KeyboardInterrupt wherever the rank's main thread is. Most of a
short request is not the user's code but the engine's: unpacking the request,
IPython's hooks around a cell, serialising and sending the reply. There a
KeyboardInterrupt is caught by ipykernel as "KeyboardInterrupt caught in kernel"
and the reply is never sent (the kernel waits for it until its grace runs out),
or, raised in ipykernel's own hooks around the handler, it ends the engine's
event loop: the rank exits with code 0. A Ctrl-C relayed to many ranks lands in
those places on the ranks that are beginning or ending a request at that moment.

:class:`RequestSigint`, installed for each request in place of Python's handler,
raises only when the user's code is on the stack (a frame run in the shell's
user namespace: a cell, or the function of an ``apply``), where IPython and
ipyparallel turn it into the request's error reply. Elsewhere the SIGINT is
held and delivered again every few milliseconds (:class:`Redelivery`) until the
user's code runs, or the request ends: then it was too late for this request,
and the rank notes it as a SIGINT that came between requests
(:mod:`nbdist.engine.late_interrupt` decides what that means for the next).
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable

__all__ = ["Redelivery", "RequestSigint", "runs_user_code"]

# How soon a held SIGINT is tried again: long enough for the engine to reach the user's
# code or the reply, short against a person's wait for Ctrl-C.
_RETRY_S = 0.01


def runs_user_code(frame, user_globals: dict | None) -> bool:
    """Whether ``frame`` or one that called it runs in ``user_globals`` (the shell's user
    namespace: a cell, or the call an ``apply`` request executes there)."""
    if user_globals is None:
        return True  # no shell to tell: raise, as Python's own handler would
    while frame is not None:
        if frame.f_globals is user_globals:
            return True
        frame = frame.f_back
    return False


class Redelivery:
    """A daemon thread that sends this process SIGINT again while ``wanted()`` says so.

    :meth:`soon` may be called from a signal handler: it only writes a byte to a pipe
    (no lock is taken there, so it cannot wait on one the interrupted code holds).
    """

    def __init__(self, wanted: Callable[[], bool]) -> None:
        """Start the thread; it sleeps until :meth:`soon`."""
        self._wanted = wanted
        self._read, self._write = os.pipe()
        os.set_blocking(self._write, False)
        self._thread = threading.Thread(
            target=self._loop, name="nbdist-sigint-redelivery", daemon=True
        )
        self._thread.start()

    def soon(self) -> None:
        """Try again in a few milliseconds (safe in a signal handler)."""
        try:
            os.write(self._write, b"!")
        except BlockingIOError:
            pass  # bytes already waiting: the thread is on its way

    def _loop(self) -> None:
        while True:
            os.read(self._read, 4096)
            while True:
                time.sleep(_RETRY_S)
                if not self._wanted():
                    break
                os.kill(os.getpid(), signal.SIGINT)


class RequestSigint:
    """SIGINT's handler while a request runs: KeyboardInterrupt in the user's code, held
    elsewhere (``held()`` records it, :class:`Redelivery` tries again). ``raised()`` is
    called before the KeyboardInterrupt: nothing is held any more."""

    def __init__(
        self,
        user_globals: dict | None,
        held: Callable[[], None],
        raised: Callable[[], None],
        redelivery: Redelivery,
    ) -> None:
        """``user_globals``: the shell's user namespace (None: raise anywhere)."""
        self.user_globals = user_globals
        self.held, self.raised = held, raised
        self.redelivery = redelivery

    def __call__(self, signum, frame) -> None:
        """Raise in the user's code; elsewhere hold the SIGINT for a moment."""
        if runs_user_code(frame, self.user_globals):
            self.raised()
            raise KeyboardInterrupt
        self.held()
        self.redelivery.soon()
