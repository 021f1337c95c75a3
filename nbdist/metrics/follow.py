"""Kernel side: a named session's metrics, followed in the run history its keeper writes.

A named session's collector lives in its keeper process
(:mod:`nbdist.launch.named_session_keeper`), not in a kernel: the ranks' points reach the
history whether or not a kernel is attached, and none is lost when a kernel
dies. A kernel attached to the session reads the run from the history: first
everything stored so far, then, on a thread, each batch as the keeper commits
it (it commits after 100 ms without a message, or every second under a steady
stream). :class:`FollowHub` offers what a session needs of a
:class:`~nbdist.metrics.hub.MetricsHub`: ``run`` (which dashboards watch),
``url`` (where ranks send points), ``store.path``, ``settle`` and ``close``.
"""

from __future__ import annotations

import json
import os
import sqlite3
import threading
import time
from dataclasses import dataclass

from nbdist.metrics.run import Run
from nbdist.metrics.wire import batch_columns, concat

__all__ = ["FollowHub"]

# How often the history is read for new batches: the dashboard refreshes at most 5 times a second.
_POLL_S = 0.2
# After a cell, how long to wait for its points: the keeper's commit delay and this poll on top of
# the 2 s a kernel's own collector gets.
_SETTLE_TIMEOUT_S = 4.0


@dataclass(frozen=True)
class _History:
    path: str


class FollowHub:
    """A run followed in the history at ``path`` (run ``run_id``), fed by a collector elsewhere."""

    def __init__(
        self,
        path: str,
        run_id: int,
        *,
        url: str,
        world_size: int,
        backend: str = "",
        started: float | None = None,
    ):
        """Read what run ``run_id`` holds so far, then follow it on a thread until :meth:`close`.

        ``url``: the collector the ranks send to (the keeper's).
        """
        if not os.path.exists(path):
            raise FileNotFoundError(f"the run history {path!r} is gone")
        self.run = Run(run_id, world_size=world_size, backend=backend, started=started)
        self.store = _History(path)
        self.url = url
        self.closed = False
        self._conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True, check_same_thread=False)
        self._last_row = 0
        self._totals: dict[int, int] = {}  # rank -> the running count of points seen
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self.read()
        self._thread = threading.Thread(target=self._loop, name="nbdist-follow", daemon=True)
        self._thread.start()

    def read(self) -> int:
        """Take the batches committed since the last read; how many."""
        rows = self._conn.execute(
            "SELECT rowid, rank, points FROM batches WHERE run=? AND rowid>? ORDER BY rowid",
            (self.run.id, self._last_row),
        ).fetchall()
        self._conn.commit()  # ends the read transaction: the next read sees newer commits
        by_rank: dict[int, list] = {}
        totals: dict[int, int] = {}
        for rowid, rank, text in rows:
            self._last_row = rowid
            try:
                message, batch = batch_columns(json.loads(text))
            except (ValueError, TypeError, KeyError):
                continue
            self.run.record_losses(rank, message)
            if isinstance(message.get("total"), int):
                totals[rank] = max(totals.get(rank, 0), message["total"])
            by_rank.setdefault(rank, []).append(batch)
        for rank, batches in sorted(by_rank.items()):
            steps, times, cols = concat(batches)
            if steps:
                self.run.add_columns(rank, steps, times, cols)
        if totals:
            with self._cond:
                for rank, total in totals.items():
                    self._totals[rank] = max(self._totals.get(rank, 0), total)
                self._cond.notify_all()
        return len(rows)

    def _loop(self) -> None:
        while not self._stop.wait(_POLL_S):
            try:
                self.read()
            except sqlite3.Error:  # a busy or vanished file: the next poll tries again
                pass

    def settle(self, points_sent: dict[int, int | None]) -> bool:
        """After a cell: wait until every rank's points of the cell are in the run.

        ``points_sent``: {rank: running count of points it had sent at the end of the cell}.
        """
        wanted = {rank: total for rank, total in points_sent.items() if total}
        deadline = time.monotonic() + _SETTLE_TIMEOUT_S
        with self._cond:
            while any(self._totals.get(rank, 0) < total for rank, total in wanted.items()):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._cond.wait(remaining)
        return True

    def mark_restart(self, world_size: int) -> None:
        """Named sessions do not restart (see :mod:`nbdist.driver.named_sessions`)."""
        raise NotImplementedError("a named session's ranks are not restarted from a kernel")

    def close(self) -> None:
        """Stop following (the run goes on in the keeper); once only."""
        if self.closed:
            return
        self.closed = True
        self._stop.set()
        self._thread.join(timeout=2)
        try:
            self.read()  # what was committed up to now stays readable in ``run``
        except sqlite3.Error:
            pass
        self._conn.close()
