"""Kernel side: the dashboard's state, per trace what the browser holds, and the deltas to send.

Per trace the kernel keeps what the browser holds (at most ``budget`` points, a
min/max-decimated subset of the logged ones). :meth:`DashboardModel.poll`
reads the points added since the previous poll (:func:`read_tail`, from where it
left off) and returns them as one ``delta`` message that ``widget.js`` appends
with ``Plotly.extendTraces``. When
a trace goes over budget it is re-decimated to half the budget and re-sent
whole (``reset``), so bytes per update stay proportional to the points added
(twice that, amortised). No widgets, no threads here: :mod:`.live` adds them.
GPU readings (:mod:`nbdist.metrics.gpu`) get two panels over time, a trace per
rank and no mean; a run without them has no GPU panel and no GPU column. TFLOP/s
and MFU get a panel each against step, like loss, when ``flops`` was logged.
Memory (``memory_mib``, :mod:`nbdist.metrics.steptime`) gets a panel against step,
a trace per rank, when logged on every point (with ``memory_peak_mib``, which the
table shows). The step breakdown
(:mod:`.breakdown`) travels with the table (``breakdown``: stacked bars of each
rank's latest steps), as do ``dropped`` (points each rank could not send) and
``header`` (:mod:`.header`: run, elapsed time, steps, progress, states, GPUs).
Each panel's spec carries its title, unit, axis titles and default scale
(:mod:`.labels`). Rank states (:mod:`nbdist.rank_states`) come from the
``states`` callable (dead; busy while read less than ``STATES_FRESH_S`` ago)
and from logging recency.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping

from nbdist.dashboard.breakdown import breakdown, breakdown_chart
from nbdist.dashboard.header import header
from nbdist.dashboard.heatmap import StepHeat
from nbdist.dashboard.labels import describe_key
from nbdist.dashboard.losses import loss_lines
from nbdist.dashboard.notes import note_lines
from nbdist.dashboard.table import (
    HISTORY,
    IDLE_AFTER_S,
    PER_RANK_UP_TO,
    RECENT,
    build_rows,
    call_states,
    deviating_rows,
    has_gpu,
    headers,
    host_row,
    pick_shown,
    plotted_keys,
    seen_column,
    throughput_key,
)
from nbdist.dashboard.traces import (
    TOTAL_BIN_S,
    Aligned,
    RateTotal,
    Spread,
    Trace,
    elapsed,
    merge,
    wire,
)
from nbdist.rank_states import DEAD

__all__ = ["DEFAULT_BUDGET", "GPU_PANELS", "DashboardModel", "read_tail"]

DEFAULT_BUDGET = 2000  # points per trace, kernel side and browser side
# Above PER_RANK_UP_TO ranks: the ranks drawn on their own are chosen again at most this often.
CHOOSE_EVERY_S = 2.0
HEAT_EVERY_S = 2.0  # the step-time heatmap (above PER_RANK_UP_TO ranks) goes at most this often
# A "busy" from the states callable counts this long; during a cell it is read every second.
STATES_FRESH_S = 3.0
# GPU panels (over time, a trace per rank, no aggregate): key -> title.
GPU_PANELS = {key: describe_key(key, by_time=True)["title"] for key in ("gpu_util", "gpu_mem_mib")}


class _Panel:
    """One chart: a trace per rank and the mean (total), or, above ``PER_RANK_UP_TO`` ranks
    (``summary``), the median with a min-max band (total) and only the chosen ranks."""

    def __init__(
        self,
        key: str,
        index: int,
        ranks: int,
        *,
        by_time: bool,
        aggregate: bool = True,
        summary: bool = False,
    ) -> None:
        self.key, self.index, self.by_time, self.aggregate = key, index, by_time, aggregate
        self.summary = summary
        self.aligned = RateTotal() if by_time else Aligned()
        if not summary:
            self.names = [f"rank {r}" for r in range(ranks)] + ["total" if by_time else "mean"]
            del self.names[ranks + aggregate :]  # ranks, then the mean / total if the panel has one
            self.traces = [Trace() for _ in self.names]
            return
        # Every rank's trace is kept here; the browser gets the band and the chosen ones.
        self.rank_traces = [Trace() for _ in range(ranks)]
        self.spread = None if by_time else Spread()
        self.band = [] if by_time else [Trace(), Trace(), Trace()]  # median, min, max
        self.total = Trace() if by_time and aggregate else None
        self.chosen: list[int] = []
        self._arrange()

    def _drawn(self) -> list[int]:
        # A chart with neither band nor total (a GPU reading over time) draws rank 0 when no
        # rank deviates, rather than nothing.
        if self.chosen or self.band or self.total is not None:
            return self.chosen
        return [0]

    def _arrange(self) -> None:
        """Names and traces in the order the browser holds them: band, chosen ranks, total."""
        drawn = self._drawn()
        self.names = (["median", "min", "max"] if self.band else []) + [f"rank {r}" for r in drawn]
        self.traces = [*self.band, *(self.rank_traces[r] for r in drawn)]
        if self.total is not None:
            self.names.append("total")
            self.traces.append(self.total)

    def choose(self, ranks: list[int], *, force: bool = False) -> bool:
        """Draw ``ranks`` individually from now on; True when that changed what is drawn."""
        if not self.summary or (ranks == self.chosen and not force):
            return False
        self.chosen = list(ranks)
        self._arrange()
        return True

    def position(self, rank: int) -> int | None:
        """Where ``rank``'s trace is among the browser's traces (None: not drawn)."""
        if not self.summary:
            return rank
        drawn = self._drawn()
        if rank not in drawn:
            return None
        return len(self.band) + drawn.index(rank)

    def spec(self) -> dict:
        return {
            "id": self.key,
            "index": self.index,
            **describe_key(self.key, by_time=self.by_time),  # title, unit, axis titles, log scale
            "names": self.names,
            "aggregate": self.aggregate,
            "summary": self.summary,
            "ranks": len(self.rank_traces) if self.summary else len(self.traces) - self.aggregate,
            "data": [[list(t.xs), wire(t.ys)] for t in self.traces],  # copies: the mirror moves on
        }


class DashboardModel:
    """What the dashboard of one :class:`~nbdist.metrics.run.Run` shows, kept up to date by polling.

    :meth:`poll` takes in what was logged since the previous poll (the first
    one: the whole history) and returns the delta message and the table when
    they changed; :meth:`snapshot` is the message a new view starts from.
    ``states``: a callable returning ``{rank: state}`` (``"dead"`` is shown),
    called by :meth:`refresh_states` on the caller's thread.
    """

    def __init__(
        self,
        run,
        *,
        states: Callable[[], Mapping[int, str]] | None = None,
        budget: int = DEFAULT_BUDGET,
        clock: Callable[[], float] = time.time,
    ) -> None:
        """``budget``: points kept per trace (at least 8); ``clock``: the time now, in seconds.

        ``clock`` is the ranks' clock (``time.time``, what their points carry); tests pass theirs.
        """
        if budget < 8:
            raise ValueError(f"budget must be at least 8 points per trace, got {budget}")
        self.run = run
        self.budget = budget
        self._clock = clock
        self._states_fn = states
        self._states = call_states(states)
        self._states_at = clock()  # when they were read: "busy" holds only while fresh
        self._lock = threading.RLock()
        self._nranks = max([run.world_size, *(r + 1 for r in run.ranks)])
        self._panels: list[_Panel] = []
        self._rate_key: str | None = None
        self._cursor: dict[tuple[str, int], int] = {}
        self._step_times: dict[int, deque] = {}
        self._history: dict[int, list[tuple[float, int]]] = {}
        self._first_seen: float | None = None
        self._newest: float | None = None  # the newest point time at the previous aggregation
        self._resumed_at = -math.inf  # the newest point time just after every rank was quiet
        self._version: int | None = None
        self._seq = 0
        self._table: dict = {}
        self._rows: list = []
        self._chosen: list[int] = []  # ranks drawn on their own above PER_RANK_UP_TO ranks
        self._chosen_at = -math.inf
        # Above PER_RANK_UP_TO ranks: step time per rank and step bin (sent at most every
        # HEAT_EVERY_S: the whole grid goes each time).
        self._heat = StepHeat(self._nranks) if self._nranks > PER_RANK_UP_TO else None
        self._heat_sent = 0
        self._heat_at = -math.inf

    # -- state in the kernel ----------------------------------------------------------
    def snapshot(self) -> dict:
        """Every panel with the traces the browser should hold now (the message a view starts from)."""
        with self._lock:
            heat = self._heat.message() if self._heat is not None else None
            return {
                "t": "snapshot",
                "seq": self._seq,
                "now": self._clock(),
                "panels": [p.spec() for p in self._panels],
                **({"heatmap": heat} if heat is not None else {}),
            }

    def heatmap(self, *, force: bool = False) -> dict | None:
        """The step-time heatmap message when it changed (at most every ``HEAT_EVERY_S``), else None."""
        with self._lock:
            heat = self._heat
            if heat is None or heat.version == self._heat_sent:
                return None
            now = self._clock()
            if not force and now - self._heat_at < HEAT_EVERY_S:
                return None
            self._heat_sent, self._heat_at = heat.version, now
            return heat.message()

    def figure_data(self) -> dict[str, dict[str, tuple[list, list]]]:
        """{key: {trace name: (xs, ys)}}: the (decimated) points the widget holds."""
        with self._lock:
            return {
                p.key: {n: (list(t.xs), list(t.ys)) for n, t in zip(p.names, p.traces)}
                for p in self._panels
            }

    @property
    def rows(self) -> list:
        """The table's :class:`~nbdist.dashboard.table.RankRow` list as of the latest poll."""
        with self._lock:
            return list(self._rows)

    @property
    def table(self) -> dict:
        """The table as the widget gets it: headers, rows of text cells, ``seen`` times, ``now``."""
        with self._lock:
            return dict(self._table)

    def refresh_states(self) -> None:
        """Call the ``states`` callable now (on this thread) and let the next refresh show it."""
        self._states = call_states(self._states_fn)
        self._states_at = self._clock()

    def poll(self) -> tuple[dict | None, dict | None]:
        """Take in what was logged since the last poll: ``(delta message or None, table or None)``.

        The delta holds exactly the new points of each trace (``extend``), whole
        traces that were re-decimated (``reset``) and panels for new keys
        (``panels``). The table is returned only when it changed.
        """
        with self._lock:
            now = self._clock()
            first_new = len(self._panels)
            extend: dict[tuple[int, int], list] = {}
            version = self.run.version  # read before the points: a later add is seen next time
            if version != self._version:
                self._version = version
                self._ingest(extend)
            lasts = {r: self.run.last(r) for r in range(self._nranks)}
            self._aggregate(now, lasts, extend)
            table = self._update_table(now)
            respec = self._choose(now)
            msg: dict = {}
            if first_new < len(self._panels):
                msg["panels"] = [p.spec() for p in self._panels[first_new:]]
            respec = sorted(p for p in respec if p < first_new)
            if respec:  # other ranks drawn on their own: those panels go again, whole
                msg["respec"] = [self._panels[p].spec() for p in respec]
            ext, reset = [], []
            for (p, i), compacted in extend.items():
                if p >= first_new or p in respec:
                    continue  # a new (re-arranged) panel comes whole in "panels" ("respec")
                trace = self._panels[p].traces[i]
                if compacted[0]:
                    reset.append([p, i, list(trace.xs), wire(trace.ys)])
                else:
                    ext.append([p, i, compacted[1], wire(compacted[2])])
            if ext:
                msg["extend"] = ext
            if reset:
                msg["reset"] = reset
            if not msg:
                return None, table
            self._seq += 1
            return {"t": "delta", "seq": self._seq, "now": now, **msg}, table

    def _panel(self, key: str, *, by_time: bool, aggregate: bool = True) -> None:
        if all(p.key != key for p in self._panels):
            panel = _Panel(
                key,
                len(self._panels),
                self._nranks,
                by_time=by_time,
                aggregate=aggregate,
                summary=self._nranks > PER_RANK_UP_TO,
            )
            panel.choose(self._chosen)
            self._panels.append(panel)

    def _ingest(self, extend: dict) -> None:
        keys = self.run.keys()
        for key in plotted_keys(keys) + [k for k in ("tflops", "mfu") if k in keys]:
            self._panel(key, by_time=False)
        if self._rate_key is None and throughput_key(keys):
            self._rate_key = throughput_key(keys)
            self._panel(self._rate_key, by_time=True)
        for key in GPU_PANELS:
            if key in keys:
                self._panel(key, by_time=True, aggregate=False)
        if "memory_peak_mib" in keys:  # memory on every point (older runs sampled it per flush)
            self._panel("memory_mib", by_time=False, aggregate=False)
        started = self.run.started
        for rank in self.run.ranks:
            if rank >= self._nranks:
                continue  # not a rank of this run's world; nothing to draw it in
            for panel in self._panels:
                steps, times, values = self._tail(panel.key, rank)
                if not steps:
                    continue
                xs = elapsed(times, started) if panel.by_time else steps
                if panel.summary and not panel.by_time:
                    panel.spread.add(rank, steps, xs, values)
                elif panel.aggregate:
                    panel.aligned.add(rank, steps, xs, values)
                own = panel.rank_traces[rank] if panel.summary else panel.traces[rank]
                if panel.by_time:  # idle time between cells (over _HOLD_S) is a gap
                    compacted, xs, values = own.extend_times(xs, values, self.budget)
                else:  # a step going back (a loop run again) starts a new segment
                    compacted, xs, values = own.extend_steps(xs, values, self.budget)
                where = panel.position(rank)
                if where is not None:
                    merge(extend, (panel.index, where), compacted, xs, values)
            steps, times, values = self._tail("step_time", rank)
            if steps and self._heat is not None:
                self._heat.add(rank, steps, values)
            if steps:
                self._step_times.setdefault(rank, deque(maxlen=RECENT)).extend(values[-RECENT:])
                history = self._history.setdefault(rank, [])
                history += zip(times[-HISTORY:], steps[-HISTORY:])
                if len(history) > 2 * HISTORY:
                    del history[:-HISTORY]

    def _aggregate(self, now: float, lasts: dict, extend: dict) -> None:
        # A step's mean (a time bin's total) is final once every running rank logged a later step
        # (a later time): points arrive in order per rank. Ranks that are dead, or quiet for
        # IDLE_AFTER_S while others log, do not hold it back; when all are quiet, all is final.
        seen = {r: last for r, last in lasts.items() if last}
        if not seen:
            return
        newest = max(last["time"] for last in seen.values())
        if self._first_seen is None:
            self._first_seen = now
        if self._newest is not None and newest - self._newest >= IDLE_AFTER_S:
            # No rank logged for a while (a cell waiting on input, a new cell), and logging has
            # resumed: quiet time counts from here, so a rank resuming a moment after the others
            # still holds the mean back instead of being taken for idle (which would put its
            # point at that step into a second, duplicate mean point). Polls are woken by new
            # points, so a jump of the newest time is such a pause even if no poll saw it.
            self._resumed_at = newest
        self._newest = newest
        dead = {r for r, s in self._states.items() if s == DEAD}
        running = [
            last
            for r, last in seen.items()
            if r not in dead and newest - max(last["time"], self._resumed_at) < IDLE_AFTER_S
        ]
        waiting = len(seen) < self._nranks and now - self._first_seen < IDLE_AFTER_S
        if now - newest >= IDLE_AFTER_S or self.run.ended is not None or not running:
            by_step = by_bin = math.inf
        elif waiting:
            return  # some rank has not logged yet: give it a moment before going on without it
        else:
            by_step = min(last["step"] for last in running)
            earliest = min(last["time"] for last in running) - self.run.started
            by_bin = math.floor(earliest / TOTAL_BIN_S) - 1
        for panel in self._panels:
            if panel.summary:
                self._summarise(panel, by_bin, by_step, extend)
                continue
            if not panel.aggregate:
                continue
            xs, values, whole = panel.aligned.ready(by_bin if panel.by_time else by_step)
            if whole:  # a point already drawn changed: the trace goes again, whole
                panel.traces[-1] = Trace()
            if xs or whole:
                if panel.by_time:
                    compacted, xs, values = panel.traces[-1].extend_times(xs, values, self.budget)
                    compacted = compacted or whole
                else:  # the steps start over (a loop run again): a new segment
                    compacted, xs, values = panel.traces[-1].extend_steps(xs, values, self.budget)
                merge(extend, (panel.index, self._nranks), compacted, xs, values)

    def _summarise(self, panel: _Panel, by_bin: float, by_step: float, extend: dict) -> None:
        """A many-rank panel's aggregates: the median and min-max band per step, or the total."""
        if panel.spread is not None:
            steps, *lines = panel.spread.spread(by_step)
            if steps:
                for i, ys in enumerate(lines):
                    compacted, xs, ys = panel.band[i].extend_steps(steps, ys, self.budget)
                    merge(extend, (panel.index, i), compacted, xs, ys)
        elif panel.total is not None:
            xs, values, whole = panel.aligned.ready(by_bin)
            if whole:  # a point already drawn changed: the trace goes again, whole
                panel.total = Trace()
                panel.choose(list(panel.chosen), force=True)
            if xs or whole:
                compacted, xs, values = panel.total.extend_times(xs, values, self.budget)
                compacted = compacted or whole
                merge(extend, (panel.index, len(panel.traces) - 1), compacted, xs, values)

    def _choose(self, now: float) -> set[int]:
        """Pick the ranks drawn on their own above ``PER_RANK_UP_TO`` ranks; the panels that changed.

        Stragglers first, then dead ranks, then ranks whose latest value of the
        first chart is NaN or infinite (the band leaves it out), then those whose value
        lies far outside the others' (beyond 1.5 interquartile ranges),
        at most ``SHOWN_RANKS``; looked at every ``CHOOSE_EVERY_S`` so lines do not flicker.
        """
        if self._nranks <= PER_RANK_UP_TO or now - self._chosen_at < CHOOSE_EVERY_S:
            return set()
        self._chosen_at = now
        rows = self._rows
        lasts = [(r.loss, r.rank) for r in rows if r.loss is not None]
        stragglers = [r.rank for r in rows if r.straggler]
        # A held rank (stopped, or by a debugger) falls behind as a dead one does: shown with it.
        gone = [r.rank for r in rows if r.state == DEAD or r.held]
        chosen = sorted(pick_shown(stragglers, gone, lasts))
        if chosen == self._chosen:
            return set()
        self._chosen = chosen
        return {p.index for p in self._panels if p.choose(chosen)}

    def _update_table(self, now: float) -> dict | None:
        states = self._states
        if now - self._states_at > STATES_FRESH_S:
            # "busy" or "idle" read a while ago (a --noblock cell may have started or ended
            # since) no longer says anything: logging recency decides; "dead" stays dead.
            states = {r: s for r, s in states.items() if s == DEAD}
        rows = build_rows(self.run, self._step_times, self._history, states, now=now)
        self._rows = rows
        keys = self.run.keys()
        seen_col, gpu, flops = seen_column(keys), has_gpu(keys), "tflops" in keys
        shown = rows
        if len(rows) > PER_RANK_UP_TO:  # the deviating ranks, then a row per host
            shown = deviating_rows(rows)
        table_rows = [
            {
                "cells": [
                    "" if i == seen_col and row.seen is not None else c
                    for i, c in enumerate(row.cells(now, gpu=gpu, flops=flops))
                ],
                "seen": row.seen,
                "state": row.state,
                "flag": row.straggler,
            }
            for row in shown
        ]
        if shown is not rows:
            hosts: dict[str, list] = {}
            for row in rows:
                hosts.setdefault(row.host or "all ranks", []).append(row)
            for host, members in hosts.items():
                cells = host_row(host, members, now, gpu=gpu, flops=flops)
                seen = max((r.seen for r in members if r.seen is not None), default=None)
                if seen is not None:
                    cells[seen_col] = ""
                table_rows.append({"cells": cells, "seen": seen, "state": "host", "flag": ""})
        table = {
            "headers": headers(keys),
            "seen_col": seen_col,
            "rows": table_rows,
            "breakdown": breakdown_chart(breakdown(self.run), self._nranks)
            if "comm_s" in keys
            else None,
            "dropped": {str(r): n for r, n in sorted(getattr(self.run, "dropped", {}).items())},
            # Every line under the table: what was lost, then figures that cannot be right.
            "lost": loss_lines(self.run) + note_lines(self.run),
            "header": header(self.run, rows),
        }
        if {k: self._table.get(k) for k in table} == table:
            return None
        self._table = {**table, "now": now}
        return self._table

    def _tail(self, key: str, rank: int) -> tuple[list[int], list[float], list[float]]:
        # Where the previous poll left off, so a refresh copies only what is new.
        start = self._cursor.get((key, rank), 0)
        steps, times, values = read_tail(self.run, key, rank, start)
        self._cursor[(key, rank)] = start + len(steps)
        return steps, times, values


def read_tail(run, key: str, rank: int, start: int) -> tuple[list[int], list[float], list[float]]:
    """(steps, times, values) of ``key`` on ``rank`` from its ``start``-th point on.

    ``run``'s ``series`` and ``timeline`` take ``start=`` (:class:`~nbdist.metrics.run.Run`),
    so a refresh copies only the points added since the previous one.
    """
    steps, values = run.series(key, rank, start=start)
    times, _ = run.timeline(key, rank, start=start)
    n = min(len(steps), len(times))  # a point may land between the two reads
    return steps[:n], times[:n], values[:n]
