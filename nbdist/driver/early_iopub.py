"""Kernel side: a cell's IOPub messages from the moment its requests are sent.

ipyparallel hands each IOPub message of a request to the callbacks its message
future holds at the moment the message arrives, on the client's IO thread, and
keeps only the output ones (streams, displays, errors) for later. A rank can
publish something else right away: pdb's first prompt after ``%dist_debug``, an
``input()`` on the cell's first line, a progress bar's widget. If the callback
is attached after the request went out (once the kernel's thread has built the
cell's :class:`~nbdist.driver.runner.RankRun`), such a message can arrive first
and is lost: the rank then waits for an answer to a prompt no one was shown.

:class:`EarlyIopub` gives one callback per rank to attach to the message futures
*before* the requests are sent (ipyparallel's ``message_future_hook``); it keeps
what arrives until :meth:`EarlyIopub.attach` names the handler, hands that the
kept messages in their order, then passes each new one straight on.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from functools import partial

__all__ = ["EarlyIopub"]


class EarlyIopub:
    """IOPub callbacks attached before sending; messages kept until the handler is known."""

    def __init__(self) -> None:
        """No handler yet: messages are kept."""
        self._lock = threading.Lock()
        self._handler: Callable[[int, dict], None] | None = None
        self._kept: list[tuple[int, dict]] = []

    def callback(self, rank: int) -> Callable[[dict], None]:
        """The callback for ``rank``'s message future (called with each IOPub message)."""
        return partial(self._on_message, rank)

    def _on_message(self, rank: int, msg: dict) -> None:
        # Under the lock, so that a message cannot overtake the kept ones being handed over.
        with self._lock:
            if self._handler is None:
                self._kept.append((rank, msg))
            else:
                self._handler(rank, msg)

    def attach(self, handler: Callable[[int, dict], None]) -> None:
        """From now on ``handler(rank, msg)`` gets every message, the kept ones first."""
        with self._lock:
            for rank, msg in self._kept:
                handler(rank, msg)
            self._kept = []
            self._handler = handler
