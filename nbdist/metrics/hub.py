"""A session's metrics: its run, the collector feeding it, and the history it is written to."""

from __future__ import annotations

import warnings

from .collector import Collector
from .run import Run
from .store import RunStore

__all__ = ["MetricsHub"]

# After a cell, how long to wait for the ranks' last points before moving on.
_SETTLE_TIMEOUT_S = 2.0


class MetricsHub:
    def __init__(self, run: Run, collector: Collector, store: RunStore | None):
        self.run = run
        self.collector = collector
        self.store = store
        self.closed = False
        self.live = None  # the automatic dashboard that refreshes, if any
        self.pinned = None  # the latest one shown by %dist_dashboard
        self.states = None  # () -> {rank: state}, set by the session

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
        return self.collector.url

    def settle(self, points_sent: dict[int, int | None]) -> bool:
        """After a cell: wait until every rank's points of that cell have arrived.

        ``points_sent``: {rank: running count of points it had sent at the end of
        the cell}, from the execute replies (``nbdist._cells``).
        """
        totals = {rank: total for rank, total in points_sent.items() if total}
        if not totals:  # 0 or None: these ranks never logged, nothing to wait for
            return True
        arrived = self.collector.wait_for_points(totals, timeout=_SETTLE_TIMEOUT_S)
        self.collector.commit()  # the cell's points are in the history when it returns
        return arrived

    def cell_watcher(self):
        """A callable for the cell's waiting loop: shows the dashboard once this cell logs.

        In a Jupyter kernel the live dashboard appears under the cell whose
        ranks log (the first points of the cell trigger it). The dashboard of an
        earlier cell stops updating (it keeps its last view), so one live
        dashboard refreshes at a time.
        """
        version = self.run.version

        def watch() -> None:
            nonlocal version
            if version is None or self.run.version == version:
                return
            version = None  # once per cell
            try:
                self.show_dashboard()
            except Exception as exc:  # a dashboard problem must not fail the training cell
                warnings.warn(f"nbdist: could not show the dashboard ({exc})", stacklevel=2)

        return watch

    def show_dashboard(self, *, auto: bool = True):
        """Display the run's live dashboard here (``auto``: because the cell logs).

        An automatic dashboard replaces the previous automatic one as the one
        that refreshes (the old view stays, frozen). None is added while one the
        user asked for (``%dist_dashboard``) is still live: they chose where to look.
        """
        from ..dashboard.live import _kernel_shell, show

        if auto:
            if _kernel_shell() is None:
                return None  # scripts, terminal IPython: %dist_dashboard prints a summary
            if self.pinned is not None and self.pinned.is_live():
                return None
            if self.live is not None:
                self.live.freeze()
        dash = show(self.run, states=self.states)
        if auto:
            self.live = dash
        else:
            self.pinned = dash
        return dash

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.collector.stop()
        if self.store is not None:
            self.store.end_run(self.run.id)
            self.store.close()
