"""Kernel side: a stop runs to its end when Ctrl-C comes midway; the interrupt follows it.

Stopping takes seconds (the ranks' grace before SIGKILL, more at many ranks), and the
kernel's interrupt raises ``KeyboardInterrupt`` wherever the main thread is. Raised in
the middle of a stop, it skipped the rest: the sweep of what the ranks started, the
removal of the private profile (which holds the cluster key) and the closing of the
metrics socket, while the session had already let go of its ranks, so a second
``%dist_stop`` found nothing to stop. :func:`sigint_deferred` notes a SIGINT instead
and raises ``KeyboardInterrupt`` once the stop is done.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["sigint_deferred"]


@contextmanager
def sigint_deferred() -> Iterator[None]:
    """Hold SIGINT while the body runs; ``KeyboardInterrupt`` after it if one came.

    Only in the main thread and where Python's default handler is in place (as in an
    ipykernel cell); elsewhere SIGINT is handled as before. An exception the body
    raised is not replaced by the interrupt.
    """
    if (
        threading.current_thread() is not threading.main_thread()
        or signal.getsignal(signal.SIGINT) is not signal.default_int_handler
    ):
        yield
        return
    came: list[int] = []
    signal.signal(signal.SIGINT, lambda signum, frame: came.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if came:
        raise KeyboardInterrupt
