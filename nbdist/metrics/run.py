"""Kernel side: one run's metrics in memory, every logged point, per rank, in arrival order.

A run is what one ``%dist_start`` (one :class:`~nbdist.DistSession` start)
trains: steps continue across cells, so a run spans cells rather than being
one per cell. The collector thread adds points; dashboards and
``to_pandas()`` read them. Points also go to the run history on disk
(:mod:`nbdist.metrics.store`), so a finished run can be read back after the
kernel restarts (:func:`nbdist.metrics.store.load_run`).

Keys with a meaning, computed on the rank when the point is logged:
``step_time`` (seconds since the rank's previous ``log`` call in the same cell),
``samples_per_s`` / ``tokens_per_s`` (from ``samples`` / ``tokens`` and
``step_time``), ``tflops`` / ``mfu`` (from ``flops``, the FLOPs of the step:
``flops / step_time / 1e12``, and that over the device's peak TFLOP/s, a
fraction; see :mod:`nbdist.metrics.flops`), the step breakdown ``comm_s`` /
``data_s`` / ``compute_s`` (summing to ``step_time``) and the memory keys
``memory_mib`` / ``memory_peak_mib`` (and ``memory_reserved_mib`` on a GPU) on
every point; see :mod:`nbdist.metrics.steptime`. ``Run.dropped`` holds, per
rank, the points it could not send (normally none). On a rank that uses a
GPU, at most one point a second also carries ``gpu_util`` (%), ``gpu_mem_mib`` /
``gpu_mem_total_mib`` (the whole GPU's memory in use and in all, every process's),
``gpu_temp_c`` and ``gpu_index`` (NVML's number of that GPU); see
:mod:`nbdist.metrics.gpu`. Without a GPU these keys never appear.
"""

from __future__ import annotations

import threading
import time
from array import array
from collections.abc import Callable, Iterable

from nbdist.metrics.point_keys import DERIVED_KEYS
from nbdist.metrics.rank_series import RankSeries, as_list, numpy_dtype
from nbdist.metrics.wire import point_columns

__all__ = ["COUNT_KEYS", "EVENT_KEYS", "Run"]

# Points that mark an event rather than measure something (MetricsHub.mark_restart):
# kept in the run and the history, but no chart or table column of their own.
EVENT_KEYS = ("restart",)
# Keys that count things: integers in to_pandas() when every value logged is whole.
COUNT_KEYS = ("samples", "tokens", "epoch", "total_steps", "restart")


class Run:
    """Every point of one run, per rank; thread-safe to add to and read from."""

    def __init__(
        self,
        run_id: int,
        *,
        world_size: int,
        backend: str = "",
        started: float | None = None,
        label: str = "",
        ended: float | None = None,
    ):
        """``run_id``: its id in the history (0 when kept in memory only); ``world_size``: ranks.

        ``started`` / ``ended``: Unix times in seconds (``started`` defaults to now,
        ``ended`` is None while the run goes on); ``backend``: the process group's;
        ``label``: free text kept with the run in the history.
        """
        self.id = run_id
        self.world_size = world_size
        self.backend = backend
        self.started = time.time() if started is None else started
        self.ended = ended
        self.label = label
        # rank -> host, set by the session when the ranks span several hosts (the table shows it)
        self.hosts: dict[int, str] = {}
        # rank -> points the rank logged but could not send (its running count; normally 0)
        self.dropped: dict[int, int] = {}
        # key -> (rank, what it was): the first value of the key a rank left out of its point
        # as no number; key "": the first error that dropped whole points
        self.left_out: dict[str, tuple[int, str]] = {}
        # What the kernel itself lost (Collector): "unread" signed messages it could not
        # read, "unstored" batches the history could not take -> [count, the first error]
        self.kernel_losses: dict[str, list] = {}
        # rank -> the highest MFU of its latest batch, where above 1 (a step faster than the
        # peak it is divided by: a peak for another dtype, or flops= counting more than the
        # step did); a later batch within the peak (set_peak called) takes the rank out
        self._mfu_above: dict[int, float] = {}
        self._ranks: dict[int, RankSeries] = {}
        self._lock = threading.Lock()
        self._listeners: list[Callable[[Run], None]] = []
        self._point_listeners: list[Callable[[int, list], None]] = []
        self.listener_errors = 0  # listeners that raised (skipped, see _notify)
        self.version = 0  # bumped on every add; readers compare it to skip idle refreshes

    def __repr__(self) -> str:
        """``<Run ID: N ranks, M points>``."""
        return f"<Run {self.id}: {self.world_size} ranks, {self.count()} points>"

    # -- writing (collector thread) ----------------------------------------
    def set_dropped(self, rank: int, count: int) -> None:
        """Record that ``rank`` has dropped ``count`` points in all (a running count)."""
        with self._lock:
            if count > self.dropped.get(rank, 0):
                self.dropped[rank] = count
                self.version += 1

    def set_left_out(self, rank: int, told: dict) -> None:
        """Record what ``rank`` left out (``{key: what the value was}``), the first per key."""
        with self._lock:
            for key, what in told.items():
                if isinstance(key, str) and isinstance(what, str) and key not in self.left_out:
                    self.left_out[key] = (rank, what)
                    self.version += 1

    def note_kernel_loss(self, kind: str, error: BaseException) -> None:
        """Count one ``kind`` ("unread" or "unstored") loss in the kernel, keeping the first error."""
        with self._lock:
            entry = self.kernel_losses.setdefault(
                kind, [0, f"{type(error).__name__}: {error}"[:200]]
            )
            entry[0] += 1
            self.version += 1

    def record_losses(self, rank: int, message: dict) -> None:
        """What a points message of ``rank`` says it lost: its running ``dropped`` count and
        the values it ``left_out`` (live, from the history, or followed)."""
        dropped = message.get("dropped")
        if isinstance(dropped, int) and dropped:
            self.set_dropped(rank, dropped)
        left_out = message.get("left_out")
        if isinstance(left_out, dict):
            self.set_left_out(rank, left_out)

    def dropped_total(self) -> int:
        """Points dropped on all ranks together (0 when nothing was lost)."""
        with self._lock:
            return sum(self.dropped.values())

    def add(self, rank: int, points: Iterable[tuple[int, float, dict[str, float]]]) -> int:
        """Append ``(step, time, scalars)`` points of ``rank``; returns how many."""
        if self._point_listeners and not isinstance(points, list):
            points = list(points)  # iterated twice: here and by the listeners
        steps, times, columns = point_columns(points)
        n = len(steps)
        for key, (idx, vals) in columns.items():
            if len(idx) == n:  # on every point (a point names a key once)
                columns[key] = (None, vals)
        with self._lock:
            self._check_mfu(rank, columns)
            self._series(rank).extend(steps, times, columns)
            self.version += 1
            listeners = list(self._listeners)
            point_listeners = self._point_listeners
        self._notify(listeners, point_listeners, rank, points)
        return n

    def add_columns(self, rank: int, steps: list, times: list, columns: dict) -> int:
        """Append a batch of ``rank``'s points given as columns (as the wire carries them):
        ``steps[i]``, ``times[i]``, ``columns = {key: (indices or None, values)}`` with the
        indices of the points that carry the key (None: every point). Returns how many."""
        n = len(steps)
        with self._lock:
            self._check_mfu(rank, columns)
            self._series(rank).extend(steps, times, columns)
            self.version += 1
            listeners = list(self._listeners)
            point_listeners = self._point_listeners
        if point_listeners:  # points built only for those who asked for them
            points = [(step, when, {}) for step, when in zip(steps, times)]
            for key, (idx, vals) in columns.items():
                for i, value in zip(range(n) if idx is None else idx, vals):
                    points[i][2][key] = value
        else:
            points = []
        self._notify(listeners, point_listeners, rank, points)
        return n

    def _check_mfu(self, rank: int, columns: dict) -> None:
        # A batch's MFU values, compared once as they arrive (under the lock; a NaN compares
        # False), instead of a scan of the run at every dashboard refresh.
        column = columns.get("mfu")
        if column is None:
            return
        above = max((v for v in column[1] if isinstance(v, float) and v > 1.0), default=None)
        if above is None:
            self._mfu_above.pop(rank, None)
        else:
            self._mfu_above[rank] = float(above)

    @property
    def mfu_above_1(self) -> tuple[int, float] | None:
        """``(rank, MFU)`` of the lowest rank whose latest batch had an MFU above 1, or None."""
        with self._lock:
            if not self._mfu_above:
                return None
            rank = min(self._mfu_above)
            return rank, self._mfu_above[rank]

    def _series(self, rank: int) -> RankSeries:
        series = self._ranks.get(rank)
        if series is None:
            series = self._ranks[rank] = RankSeries()
        return series

    def _notify(self, listeners: list, point_listeners: list, rank: int, points: list) -> None:
        # A listener that raises (a dashboard's bug, a user's on_points callback) is counted
        # and skipped: the points are in already, and the collector that called add must go
        # on counting what arrived, or the cell would wait for points that came.
        for listener in point_listeners:
            try:
                listener(rank, points)
            except Exception:
                self.listener_errors += 1
        for listener in listeners:
            try:
                listener(self)
            except Exception:
                self.listener_errors += 1

    def subscribe(self, listener: Callable[[Run], None]) -> Callable[[], None]:
        """Call ``listener(run)`` after each add (from the adding thread); returns unsubscribe."""
        with self._lock:
            self._listeners.append(listener)

        def unsubscribe() -> None:
            with self._lock:
                if listener in self._listeners:
                    self._listeners.remove(listener)

        return unsubscribe

    def on_points(self, listener: Callable[[int, list], None]) -> Callable[[], None]:
        """Call ``listener(rank, points)`` with each batch added (from the adding thread);
        ``points`` are ``(step, time, {key: value})``, not to be changed. Returns unsubscribe."""
        with self._lock:
            self._point_listeners = [*self._point_listeners, listener]

        def unsubscribe() -> None:
            with self._lock:
                self._point_listeners = [f for f in self._point_listeners if f is not listener]

        return unsubscribe

    def forward(self, callback, *, ranks=None):
        """Hand every point that arrives from now on to ``callback(point)``, on a thread of
        its own (the ranks never wait for it); returns the :class:`~nbdist.metrics.forward.Forwarder`.

        ``point.rank``, ``.step``, ``.time``, ``.values`` (a dict of floats); ``ranks``: only
        these ranks' points. W&B: ``run.forward(lambda p: wandb.log(p.values, step=p.step),
        ranks=[0])``; MLflow: ``lambda p: mlflow.log_metrics(p.values, step=p.step)``.
        """
        from nbdist.metrics.forward import Forwarder

        return Forwarder(self, callback, ranks=ranks)

    # -- reading --------------------------------------------------------------
    @property
    def ranks(self) -> list[int]:
        """The ranks that logged at least one point, sorted."""
        with self._lock:
            return sorted(self._ranks)

    def count(self, rank: int | None = None) -> int:
        """Points logged (by one rank, or by all)."""
        with self._lock:
            if rank is not None:
                series = self._ranks.get(rank)
                return len(series.steps) if series else 0
            return sum(len(s.steps) for s in self._ranks.values())

    def keys(self) -> list[str]:
        """Metric names seen on any rank, user keys first (in order of appearance)."""
        seen: dict[str, None] = {}
        with self._lock:
            for series in self._ranks.values():
                seen.update(dict.fromkeys(series.columns))
        user = [k for k in seen if k not in DERIVED_KEYS and k not in EVENT_KEYS]
        return user + [k for k in DERIVED_KEYS if k in seen]

    def series(self, key: str, rank: int, start: int = 0) -> tuple[list[int], list[float]]:
        """(steps, values) of ``key`` on ``rank``, from that key's ``start``-th point; copies.

        ``start`` lets a reader that already has the first points fetch only new
        ones (a negative ``start`` takes the latest ``-start`` points, a live dashboard would otherwise copy the whole series each update).
        """
        return self._column(key, rank, start, by_time=False)

    def timeline(self, key: str, rank: int, start: int = 0) -> tuple[list[float], list[float]]:
        """(times, values) of ``key`` on ``rank``, from that key's ``start``-th point."""
        return self._column(key, rank, start, by_time=True)

    def _column(self, key: str, rank: int, start: int, *, by_time: bool) -> tuple[list, list]:
        with self._lock:
            series = self._ranks.get(rank)
            column = None if series is None else series.columns.get(key)
            if column is None:
                return [], []
            axis = series.times if by_time else series.steps
            vals = column.vals
            m = len(vals)
            # where ``vals[start:]`` starts
            if start >= 0:
                lo = start if start < m else m
            else:
                lo = m + start if m + start > 0 else 0
            starts = column.starts
            if column.idx is None:
                if starts and lo >= starts[-1]:  # in the last run (one run, or a tail)
                    off = column.firsts[-1] - starts[-1]
                    xs = axis[lo + off : m + off]
                else:
                    xs = axis[0:0]
                    for a, b in column.spans(lo, m):
                        xs += axis[a:b]
            elif type(axis) is array and type(column.idx) is array:
                import numpy as np

                # ``idx[lo:]`` is a copy and the view of ``axis`` lives for this line only:
                # an array cannot grow while viewed, and the collector appends once the
                # lock is free.
                picked = np.frombuffer(column.idx[lo:], dtype=np.int64)
                xs = np.frombuffer(axis, dtype=numpy_dtype(axis))[picked]
            else:
                xs = [axis[i] for i in column.idx[lo:]]
            vals = vals[lo:]
            return (
                xs if type(xs) is list else xs.tolist(),
                vals if type(vals) is list else vals.tolist(),
            )

    def last(self, rank: int) -> dict[str, float]:
        """The rank's latest ``step``, ``time`` and latest value of every key."""
        with self._lock:
            series = self._ranks.get(rank)
            if series is None or not series.steps:
                return {}
            out: dict[str, float] = {"step": series.steps[-1], "time": series.times[-1]}
            for key, column in series.columns.items():
                out[key] = column.vals[-1]
            return out

    def rows(self) -> list[dict]:
        """One dict per point: rank, step, time and its values (rank, then arrival order)."""
        with self._lock:
            out = []
            for rank in sorted(self._ranks):
                series = self._ranks[rank]
                per_point: list[dict] = [
                    {"rank": rank, "step": s, "time": t}
                    for s, t in zip(as_list(series.steps), as_list(series.times))
                ]
                for key, column in series.columns.items():
                    vals = as_list(column.vals)
                    if column.idx is None:
                        them = iter(vals)
                        for a, b in column.spans(0, len(vals)):
                            for row, v in zip(per_point[a:b], them):
                                row[key] = v
                    else:
                        for i, v in zip(column.idx, vals):
                            per_point[i][key] = v
                out.extend(per_point)
            return out

    def to_tensorboard(self, logdir, *, keys=None) -> list[str]:
        """Write every point as TensorBoard event files: ``logdir/rank0``, ``rank1``..., one
        tag per series (``tensorboard --logdir logdir`` draws one line per rank).

        ``keys``: the series to write (default all). Needs the ``tensorboard`` package;
        values are stored as TensorBoard's 32-bit floats. Returns the directories written.
        See :mod:`nbdist.metrics.tensorboard_export`.
        """
        from nbdist.metrics.tensorboard_export import to_tensorboard

        return to_tensorboard(self, logdir, keys=keys)

    def to_pandas(self):
        """A DataFrame with one row per (rank, step): ``rank``, ``step``, ``time`` and a column per metric.

        ``time`` is when the point was logged (a UTC datetime); counts (``samples``,
        ``tokens``, ``epoch``...) are integers when every value is whole.

        Several points logged with the same step on a rank are merged: the later point's
        values win (a NaN too), a key it lacks keeps the earlier value.
        That is also how a resumed run reads: training restarted from a checkpoint
        logs the steps after it again, and the later points replace the earlier
        ones, so each step appears once. The history itself keeps every point as
        it arrived (``series()`` too, in arrival order): nothing logged is lost.
        """
        import pandas as pd

        rows = self.rows()
        frame = pd.DataFrame(rows, columns=None)
        if frame.empty:
            return pd.DataFrame(columns=["rank", "step", "time", *self.keys()])
        again = frame.duplicated(["rank", "step"], keep=False).to_numpy()
        if again.any():
            # Merged as dicts, in arrival order: a key the later point has replaces the
            # earlier value, a NaN too (a resumed run that diverged); a key it lacks keeps
            # the earlier one. (A DataFrame's groupby().last() skips NaN: it showed the
            # value from before the resume.)
            merged: dict[tuple, dict] = {}
            for i in again.nonzero()[0]:
                row = rows[i]
                merged.setdefault((row["rank"], row["step"]), {}).update(row)
            frame = pd.concat([frame[~again], pd.DataFrame(list(merged.values()))])
        frame = frame.sort_values(["rank", "step"], kind="stable")
        ordered = ["rank", "step", "time", *[k for k in self.keys() if k in frame.columns]]
        frame = frame[ordered].reset_index(drop=True)
        # When each point was logged, as a date (UTC) rather than an epoch float.
        frame["time"] = pd.to_datetime(frame["time"], unit="s", utc=True)
        for key in COUNT_KEYS:
            # Counts travel as floats (JSON numbers); whole ones read back as integers,
            # with <NA> where a rank did not log them.
            if key in frame.columns:
                values = frame[key].dropna()
                if len(values) and bool((values == values.round()).all()):
                    frame[key] = frame[key].round().astype("Int64")
        return frame
