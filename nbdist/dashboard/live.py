"""Kernel side: the live dashboard widget, plots per logged metric (a trace per rank and their
mean), throughput per rank and in total, and the per-rank table with states and stragglers.

:class:`LiveDashboard` adds to :class:`~.model.DashboardModel` an anywidget
(``widget.js``) and a refresh thread: woken by :meth:`Run.subscribe`, at most
``max_hz`` times a second (and at most ~20 % of a core), it sends each delta as
a custom message and the table as the synced ``table`` trait.

The widget is re-displayed (``display_handle.update``, which makes the browser
build a new view of it) only when the text summary it carries for viewers
without widgets would change: after a cell that logged, or once a rank died;
never after cells that did neither. While a cell runs, the ranks' states are
re-read every second on the cell's waiting thread, so a rank that dies mid-cell
is shown dead at once.

Example::

    dash = LiveDashboard(run, states=lambda: {0: "idle", 1: "dead"})
    display(dash.start())      # the widget; dash.close() stops the updates
"""

from __future__ import annotations

import logging
import sys
import threading
import time
import uuid
import weakref
from collections.abc import Callable, Mapping

from nbdist.dashboard.model import DEFAULT_BUDGET, DashboardModel
from nbdist.dashboard.palette import rank_colours
from nbdist.dashboard.table import rank_state
from nbdist.dashboard.text import summary_text
from nbdist.dashboard.widget import plotly_version, widget_class
from nbdist.rank_states import BUSY, DEAD

__all__ = ["LiveDashboard", "cell_watcher", "close_all", "freeze_views", "show_run"]

_log = logging.getLogger("nbdist.dashboard")
# While a cell runs, the live dashboards of its run re-read the ranks' states this often (on the
# cell's waiting thread, the one that may talk to the controller): a rank that dies mid-cell
# shows as dead within a second, as in %dist_status and the sidebar.
STATES_EVERY_S = 1.0
_LIVE: set[LiveDashboard] = set()


class LiveDashboard(DashboardModel):
    """Plots and table of one :class:`~nbdist.metrics.run.Run`, updated while it grows.

    ``states`` is called by :meth:`refresh_states` (``show`` does so after
    every cell), never on the refresh thread: a session's status talks to the
    ipyparallel client, which is not thread-safe.
    """

    def __init__(
        self,
        run,
        *,
        states: Callable[[], Mapping[int, str]] | None = None,
        budget: int = DEFAULT_BUDGET,
        max_hz: float = 5.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        """``run``, ``states``, ``budget`` and ``clock`` as for :class:`~.model.DashboardModel`.

        ``max_hz``: at most this many refreshes a second. Nothing is sent until :meth:`start`.
        """
        super().__init__(run, states=states, budget=budget, clock=clock)
        self.interval = 1.0 / max_hz
        self.widget = None
        self.last_cost = 0.0  # CPU seconds of the latest refresh
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._unsubscribe: Callable[[], None] | None = None
        self._shell = None
        self._published: tuple | None = None  # what the displayed text summary was made from
        self._first_cell_end = False  # True from display until the end of its cell

    def __repr__(self) -> str:
        """``<LiveDashboard of run ID: N ranks, live>`` (or ``not live``)."""
        live = "live" if self._thread is not None and not self._stop.is_set() else "not live"
        return f"<LiveDashboard of run {self.run.id}: {self._nranks} ranks, {live}>"

    def refresh_states(self) -> None:
        """Call the ``states`` callable now (on this thread); the next refresh shows the result.

        A session that stopped reports no states ({}): its dead ranks stay dead (the
        final summary, drawn after ``%dist_stop``, still shows the death), the others
        fall back to their points' age (idle once the run ended).
        """
        known = self._states
        super().refresh_states()
        if not self._states and known:
            self._states = {rank: state for rank, state in known.items() if state == DEAD}
        self._wake.set()

    def start(self, *, refresh_thread: bool = True):
        """Make the widget (once), send it the snapshot and start the refresh thread; returns the widget.

        Without the thread, :meth:`refresh` sends updates when called.
        """
        with self._lock:
            if self.widget is None:
                self.widget = widget_class()(
                    _uid=uuid.uuid4().hex,
                    _plotly_version=plotly_version(),
                    _palette=rank_colours(),
                    table=self._table,
                    text=lambda: summary_text(self.run, self._states),
                    on_close=self.close,
                )
                self.widget.on_msg(self._on_message)
                self.widget.send(self.snapshot())
        if refresh_thread and self._thread is None:
            # The thread's first pass takes in the history (a second for 8 ranks x 100k points),
            # so showing the widget does not wait for it.
            self._wake.set()
            self._unsubscribe = self.run.subscribe(lambda run: self._wake.set())
            self._thread = threading.Thread(
                target=self._loop, name=f"nbdist-dashboard-{self.run.id}", daemon=True
            )
            _LIVE.add(self)
            self._thread.start()
        return self.widget

    def refresh(self, *, final: bool = False) -> None:
        """One update now: send the new points and the table if they changed.

        ``final``: the last update (a freeze): the step-time heatmap goes too, however
        recently it went.
        """
        with self._lock:  # one lock for poll and send: messages leave in seq order
            delta, table = self.poll()
            widget = self.widget
            if widget is None:
                return
            if delta is not None:
                widget.send(delta)
            heat = self.heatmap(force=final or self.run.ended is not None)
            if heat is not None:
                widget.send(heat)
            if table is not None:
                widget.table = table

    def _on_message(self, widget, content, buffers) -> None:
        if isinstance(content, dict) and content.get("t") == "hello":  # a new view after a reload
            with self._lock:
                widget.send(self.snapshot())

    def _loop(self) -> None:
        failures = 0
        while not self._stop.is_set():
            self._wake.wait(1.0)  # a new point, or the tick that turns "busy" into "idle"
            self._wake.clear()
            if self._stop.is_set():
                return
            began, cpu = time.monotonic(), time.thread_time()
            try:
                self.refresh()
            except Exception:
                failures += 1
                if failures == 1:
                    _log.exception("nbdist dashboard: refresh failed (further failures not logged)")
            self.last_cost = time.thread_time() - cpu
            over = self.run.ended is not None and self.run.version == self._version
            if over and all(row.state != BUSY for row in self.rows):
                return  # the run is over and shown in full, its ranks shown idle or dead
            # At most max_hz, and at most ~20 % of a core however big the run is.
            pause = max(self.interval, 4 * self.last_cost) - (time.monotonic() - began)
            self._stop.wait(max(pause, 0.0))

    def watch_cells(self, shell) -> None:
        """Refresh the states after every cell of ``shell`` (an IPython shell), on its thread."""
        self._shell = shell
        shell.events.register("post_run_cell", self._after_cell)

    def displayed(self, handle) -> None:
        """Remember the display (``display(..., display_id=True)``'s handle) that shows the widget.

        A widget shown again (the run's dashboard under a later cell, or ``%dist_dashboard``)
        has one model for all its displays: every view of it stays live. The saved text
        summary of the earlier display (what a viewer without widgets shows) is rewritten
        once, as a snapshot that says so and where the live view went.
        """
        previous = getattr(self, "display_handle", None)
        self.display_handle = handle
        self._published = self._shown()
        self._first_cell_end = True  # the end of the cell under which it was shown is next
        if previous is not None and self.widget is not None:
            self._mark_snapshot(previous)

    def _mark_snapshot(self, handle) -> None:
        try:
            bundle = self.widget._repr_mimebundle_()
            if bundle is None:
                return
            data, metadata = bundle
            steps = [self.run.last(r).get("step") for r in self.run.ranks]
            step = max((s for s in steps if s is not None), default=None)
            at = f"snapshot at step {step}" if step is not None else "snapshot"
            data = {
                **data,
                "text/plain": f"{data.get('text/plain', '')}\n({at}: the live view of this run "
                "is in a later cell)",
            }
            handle.update(data, metadata=metadata, raw=True)
        except Exception:
            _log.exception("nbdist dashboard: could not mark an earlier view as a snapshot")

    def _shown(self) -> tuple:
        # What the text summary depends on, bar the "last seen" ages: the points, the dead
        # ranks, the run's end; and whether it shows a rank busy.
        dead = sorted(r for r, s in self._states.items() if s == DEAD)
        now = time.time()
        ranks = set(range(self.run.world_size)) | set(self.run.ranks) | set(self._states)
        busy = any(rank_state(self.run, r, self._states, now=now) == BUSY for r in ranks)
        return (self.run.version, dead, self.run.ended is not None), busy

    def _after_cell(self, result=None) -> None:
        try:
            self._publish_after_cell()
        finally:
            thread = self._thread
            if self.run.ended is not None and thread is not None and not thread.is_alive():
                # The run is over and drawn in full: no later cell changes it. Registered
                # for good, every stopped session's dashboard (its widget and run) stayed in
                # the kernel, and each cell called them all.
                self._stop_updating()

    def _publish_after_cell(self) -> None:
        self.refresh_states()
        handle = getattr(self, "display_handle", None)
        if handle is None or self.widget is None or self._stop.is_set():
            return
        shown = self._shown()
        (facts, busy), (published, published_busy) = shown, self._published
        first, self._first_cell_end = self._first_cell_end, False
        if facts == published and not (first and published_busy and not busy):
            # Nothing the summary shows changed (a cell that did not log, a rank busy or idle
            # in a later cell): no update. Each update makes the browser build the widget's
            # view anew. One exception, at the end of the cell it was shown under: a short
            # cell's points can all arrive before its dashboard is first shown, ranks still
            # busy; that cell ending turns them idle, and the saved summary should say so.
            return
        self._published = shown
        # Re-publish the same widget so the saved text/plain (what nbconvert and
        # other viewers without widgets show) is the summary as of this cell's end.
        try:
            handle.update(self.widget)
        except Exception:
            _log.exception("nbdist dashboard: could not update the text summary")

    def is_live(self) -> bool:
        """Still refreshing (not frozen, closed, or finished with its run)."""
        return self._thread is not None and self._thread.is_alive() and not self._stop.is_set()

    def freeze(self, *, summary: bool = False) -> None:
        """Stop updating but keep the widget and its views, as last drawn.

        ``summary=True`` (the run itself is over: its session stopped or let go of it)
        also brings the saved text summary up to date; a view merely superseded by a
        newer one of the same run is left as drawn, since each update redraws it.
        """
        self.refresh_states()
        try:
            self.refresh(final=True)  # last points first, so the frozen view is complete
            self._mark_final()
        except Exception:
            _log.exception("nbdist dashboard: final refresh failed")
        if summary:
            # The post-cell hook goes with the updates, so the saved text summary (what a
            # notebook viewed without widgets shows) is brought up to date here: it says
            # where the run ended ("finished" once the session stopped).
            self._publish_after_cell()
        self._stop_updating()

    def _mark_final(self) -> None:
        # Every view (and the saved widget state) says it no longer updates, and why: a
        # frozen view must not look live.
        widget = self.widget
        if widget is None:
            return
        table = dict(widget.table or {})
        head = dict(table.get("header") or {})
        step = head.get("step")
        why = (
            "the run has finished"
            if self.run.ended is not None
            else "this kernel no longer follows the run"
        )
        at = f" at step {step}" if step is not None else ""
        head["snapshot"] = f"final snapshot{at}: {why}; this view no longer updates"
        table["header"] = head
        widget.table = table

    def close(self) -> None:
        """Stop updating; close the widget (its views disappear)."""
        self._stop_updating()
        widget, self.widget = self.widget, None
        if widget is not None:
            widget.nbdist_on_close = None
            widget.close()

    def _stop_updating(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._unsubscribe is not None:
            self._unsubscribe()
            self._unsubscribe = None
        if self._shell is not None:
            try:
                self._shell.events.unregister("post_run_cell", self._after_cell)
            except ValueError:
                pass
            self._shell = None
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=2.0)
        _LIVE.discard(self)


def close_all() -> None:
    """Close every live dashboard of this process (stops their refresh threads)."""
    for dash in list(_LIVE):
        dash.close()


def freeze_views(run) -> None:
    """Stop refreshing ``run``'s dashboards (their views stay, as last drawn): no more points come.

    A session calls it when it lets go of its run: at a stop, and when a kernel
    detaches from a named session, whose run goes on elsewhere (unended here, its
    dashboard would refresh, on a thread of its own, until the kernel exits).
    """
    views = _VIEWS.get(run)
    if views is None:
        return
    if views.dash is not None and views.dash.is_live():
        views.dash.freeze(summary=True)


class _RunViews:
    """The live dashboard of one run (every display of it shows its one widget) and how it came."""

    def __init__(self) -> None:
        self._dash: weakref.ref | None = None
        self.pinned = False  # %dist_dashboard showed it: a logging cell adds no view of its own

    @property
    def dash(self) -> LiveDashboard | None:
        """The run's dashboard while something holds it: its refresh thread or its widget."""
        return self._dash() if self._dash is not None else None

    @dash.setter
    def dash(self, dash: LiveDashboard | None) -> None:
        # Weak: the dashboard holds the run, and a value holding its key would keep the
        # entry, the run's points and its dashboard, for as long as the kernel lives, even
        # once every view of it was closed.
        self._dash = weakref.ref(dash) if dash is not None else None

    def live(self) -> LiveDashboard | None:
        dash = self.dash
        return dash if dash is not None and dash.is_live() else None


# Run -> its views; weak, so a finished run's entry goes with it (once its views are closed).
_VIEWS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def show_run(
    run,
    *,
    states: Callable[[], Mapping[int, str]] | None = None,
    auto: bool = False,
    budget: int = DEFAULT_BUDGET,
    max_hz: float = 5.0,
) -> LiveDashboard | None:
    """Show ``run``'s dashboard: the live widget in a Jupyter kernel, else print the text summary.

    The one way every view is shown: ``%dist_dashboard`` (a session's run or a
    past run from the history), and the dashboard that appears under a cell
    whose ranks log (``auto=True``). ``states``: a callable giving each rank's
    state (:mod:`nbdist.rank_states`; a session's ``rank_states``), read now and
    after every cell. A run has one live dashboard: showing it again (under a later
    logging cell, or ``%dist_dashboard``) shows the same widget again, so every view
    of it stays live; no automatic view is added while one the user asked for is
    live: they chose where to look. Returns the
    :class:`LiveDashboard` (``.close()`` stops it), or None where nothing live
    was shown.

    Example::

        s = nbdist.current_session()
        nbdist.dashboard.show_run(s.metrics, states=s.rank_states)
        nbdist.dashboard.show_run(nbdist.runs()[-1].load())     # a past run
    """
    shell = _kernel_shell()
    views = _VIEWS.setdefault(run, _RunViews())
    if auto:
        if shell is None:
            return None  # scripts, terminal IPython: %dist_dashboard prints a summary
        if views.pinned and views.live() is not None:
            return None
    if shell is None:
        print(summary_text(run, states))
        return None
    try:
        import anywidget  # noqa: F401
    except ImportError:
        if auto:  # the first points just came: the summary goes after the cell's output
            _summary_after_cell(shell, run, states)
        else:
            print(summary_text(run, states))
            print("(pip install anywidget for the live dashboard)")
        return None
    from IPython.display import display

    dash = views.live()
    if dash is None:
        dash = LiveDashboard(run, states=states, budget=budget, max_hz=max_hz)
        dash.start()
        dash.watch_cells(shell)
        views.dash, views.pinned = dash, False
    # A run shown again is the same widget shown again: one model, one refresh thread, and
    # every view of it live (a second model would leave one of them stale or doubling the work).
    dash.displayed(display(dash.widget, display_id=True))
    views.pinned = views.pinned or not auto
    return dash


def cell_watcher(run, states: Callable[[], Mapping[int, str]] | None = None) -> Callable[[], None]:
    """A callable for a cell's waiting loop: shows the automatic dashboard once this cell logs.

    In a Jupyter kernel the live dashboard appears under the cell whose ranks log
    (the first points of the cell trigger it), through :func:`show_run`.
    """
    version = run.version
    checked = time.monotonic()

    def watch() -> None:
        nonlocal version, checked
        now = time.monotonic()
        if now - checked >= STATES_EVERY_S:
            checked = now
            views = _VIEWS.get(run)
            dash = views.live() if views is not None else None
            if dash is not None:
                dash.refresh_states()
        if version is None or run.version == version:
            return
        version = None  # once per cell
        try:
            show_run(run, states=states, auto=True)
        except Exception as exc:  # a dashboard problem must not fail the training cell
            import warnings

            warnings.warn(f"nbdist: could not show the dashboard ({exc})", stacklevel=2)

    return watch


def _summary_after_cell(shell, run, states) -> None:
    # The text dashboard of a kernel without anywidget: printed once the cell is over, after
    # the rank lines it sums up, and with every point of the cell.
    def after(result=None) -> None:
        shell.events.unregister("post_run_cell", after)
        print(summary_text(run, states))
        print("(pip install anywidget for the live dashboard)")

    shell.events.register("post_run_cell", after)


def _kernel_shell():
    # The IPython shell when running in a Jupyter kernel; None in a script or terminal IPython.
    if "IPython" not in sys.modules:
        return None
    from IPython import get_ipython

    shell = get_ipython()
    return shell if shell is not None and getattr(shell, "kernel", None) is not None else None
