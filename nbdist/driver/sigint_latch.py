"""Kernel side: a Ctrl-C that other code in the kernel swallowed still stops the waiting cell.

While a cell waits for its ranks, the kernel's main thread also runs code that is
not nbdist's: a sink writing the ranks' output, display libraries, finalizers
(``__del__``) the garbage collector calls. The kernel's interrupt (SIGINT) raises
``KeyboardInterrupt`` wherever the main thread is at that moment; raised inside a
finalizer, Python prints "Exception ignored" and drops it, and code that catches
``KeyboardInterrupt`` drops it too. The cell would then run to its end as if the
user had never pressed Interrupt.

:class:`SigintLatch` stands in for Python's default SIGINT handler while the cell
waits: it raises ``KeyboardInterrupt`` just as that handler does, and also notes
that the signal came, so the waiting loop, on its next pass, raises it again if it
never reached the loop. It is installed only in the main thread and only where
the default handler is in place (as in an ipykernel cell); elsewhere it does
nothing and SIGINT is handled as before.

It is installed *holding* before the cell is sent (``DistSession.run``, and its
``apply``/``push``/``pull``): between
sending the cell and waiting for it, a ``KeyboardInterrupt`` would end the kernel's
cell while the ranks, never told, ran on with it (and every later cell queued
behind it). Holding, the latch only notes the signal; the waiting loop takes it on
its first pass and interrupts the ranks as for any Ctrl-C.
"""

from __future__ import annotations

import signal
import threading

__all__ = ["SigintLatch"]


class SigintLatch:
    """Context manager: SIGINT raises ``KeyboardInterrupt`` and is remembered until taken.

    ``holding``: SIGINT is only remembered, not raised, until :attr:`holding` is set
    False (the waiting loop then raises it).
    """

    def __init__(self, *, holding: bool = False) -> None:
        """Not installed until entered."""
        self._pending = False
        self._previous = None
        self.holding = holding

    def __enter__(self) -> SigintLatch:
        """Stand in for the default SIGINT handler (main thread, default handler only)."""
        if (
            threading.current_thread() is threading.main_thread()
            and signal.getsignal(signal.SIGINT) is signal.default_int_handler
        ):
            self._previous = signal.signal(signal.SIGINT, self._on_sigint)
        return self

    def __exit__(self, *exc) -> None:
        """Put the handler that was there back."""
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)
            self._previous = None

    def _on_sigint(self, signum, frame) -> None:
        self._pending = True
        if not self.holding:
            raise KeyboardInterrupt

    @property
    def pending(self) -> bool:
        """Whether a SIGINT came that was not taken yet (it stays pending)."""
        return self._pending

    def take(self) -> bool:
        """Whether a SIGINT came since the last call (the waiting loop then stops as for Ctrl-C)."""
        pending, self._pending = self._pending, False
        return pending
