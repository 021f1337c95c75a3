"""Kernel side: a session's metrics, its run, the collector feeding it, and the history it is written to."""

from __future__ import annotations

import time
import warnings

from nbdist.metrics.collector import Collector
from nbdist.metrics.run import EVENT_KEYS, Run
from nbdist.metrics.store import RunStore

__all__ = ["RESTART_KEY", "MetricsHub"]

# The key of the point :meth:`MetricsHub.mark_restart` adds on every rank: the
# run's restart count, at the rank's last logged step (an event, not a metric).
RESTART_KEY = EVENT_KEYS[0]

# After a cell, how long to wait for the ranks' last points before moving on.
_SETTLE_TIMEOUT_S = 2.0


class MetricsHub:
    """A session's metrics: its :class:`Run`, the collector feeding it, the history (or None)."""

    def __init__(self, run: Run, collector: Collector, store: RunStore | None):
        """Hold parts made already; :meth:`open` makes them for a session."""
        self.run = run
        self.collector = collector
        self.store = store
        self.closed = False
        self.restarts = 0  # how often the ranks were restarted within this run

    @classmethod
    def open(
        cls, key: bytes, *, world_size: int, backend: str, history, ip: str = "127.0.0.1"
    ) -> MetricsHub:
        """``history``: a path, None for the default location, or False for memory only."""
        store = None
        if history is not False:
            try:
                store = RunStore(history if isinstance(history, str) else None)
            except Exception as exc:  # an unwritable history must not stop training
                warnings.warn(f"nbdist: run history disabled ({exc})", stacklevel=3)
        if store is not None:
            run = store.new_run(world_size=world_size, backend=backend)
        else:
            run = Run(0, world_size=world_size, backend=backend)
        return cls(run, Collector(key, run, store, ip=ip), store)

    @property
    def url(self) -> str:
        """Where the ranks send their points (the collector's ``tcp://ip:port``)."""
        return self.collector.url

    def settle(self, points_sent: dict[int, int | None]) -> bool:
        """After a cell: wait until every rank's points of that cell have arrived.

        ``points_sent``: {rank: running count of points it had sent at the end of
        the cell}, from the execute replies (``nbdist.driver.cells``).
        """
        totals = {rank: total for rank, total in points_sent.items() if total}
        if not totals:  # 0 or None: these ranks never logged, nothing to wait for
            return True
        arrived = self.collector.wait_for_points(totals, timeout=_SETTLE_TIMEOUT_S)
        self.collector.commit()  # the cell's points are in the history when it returns
        return arrived

    def mark_restart(self, world_size: int) -> None:
        """Record that the ranks restarted: one ``restart`` point per rank, in the history too.

        Each point sits at the rank's last logged step (0 if it logged none) and
        the time of the restart; its value counts the run's restarts (1, 2, ...).
        The run goes on: the fresh ranks' points follow in the same run.
        """
        self.restarts += 1
        now = time.time()
        for rank in range(world_size):
            point = [
                int(self.run.last(rank).get("step", 0)),
                now,
                {RESTART_KEY: float(self.restarts)},
            ]
            self.run.add(rank, [point])
            if self.store is not None:
                try:
                    self.store.append(self.run.id, rank, [point])
                except Exception:  # a full disk must not stop the restart
                    pass
        if self.store is not None:
            self.collector.commit()

    def close(self) -> None:
        """Stop the collector, record the run's end in the history and close it; once only."""
        if self.closed:
            return
        self.closed = True
        self.collector.stop()
        if self.run.ended is None:  # the live views say "ended", as the history will
            self.run.ended = time.time()
        if self.store is not None:
            self.store.end_run(self.run.id)
            self.store.close()
