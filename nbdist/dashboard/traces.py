"""Kernel side: the dashboard's traces, what the browser holds of each and the aggregates across ranks.

:class:`Trace` keeps at most ``budget`` of a trace's points (min/max decimated);
:class:`Aligned` turns per-rank points into the mean over ranks at each step once
no rank will add to them (:class:`Spread`: the median, min and max); :class:`RateTotal` sums the ranks' throughput at each
moment (per ``TOTAL_BIN_S`` of time).
"""

from __future__ import annotations

import math

from nbdist.dashboard.decimate import minmax_indices

__all__ = [
    "TOTAL_BIN_S",
    "Aligned",
    "RateTotal",
    "Spread",
    "Trace",
    "across_ranks",
    "last_per_step",
    "elapsed",
    "merge",
    "wire",
]

TOTAL_BIN_S = 1.0  # total throughput: one point per second of the run
# A rank's step longer than a bin leaves bins without a point of it: its rate then
# holds across them, up to this long; a longer silence is a pause, not a step.
_HOLD_S = 10.0


class Trace:
    """What the browser holds of one trace: at most ``budget`` of the logged points.

    A trace against step whose step goes back (a loop run again, training resumed
    from a checkpoint) starts a new segment (:meth:`extend_steps`): a gap, a NaN the
    browser gets as null, goes before the earlier step, so no line is drawn back to
    it; a trace against time gets one across a silence over ``_HOLD_S``
    (:meth:`extend_times`: the idle time between cells). Decimation keeps the gaps
    (up to ``budget // 4`` of them, the latest).
    """

    __slots__ = ("gaps", "pos", "total", "xs", "ys")

    def __init__(self) -> None:
        """An empty trace."""
        self.xs: list = []
        self.ys: list[float] = []
        self.pos: list[int] = []  # each kept point's index among all points of this trace
        self.total = 0
        self.gaps: list[int] = []  # the positions of the gaps before a step going back

    def extend(self, xs: list, ys: list[float], budget: int) -> bool:
        """Append; True when that went over budget and the trace was re-decimated (send it whole)."""
        self.xs += xs
        self.ys += ys
        self.pos += range(self.total, self.total + len(xs))
        self.total += len(xs)
        if len(self.xs) <= budget:
            return False
        keep = minmax_indices(self.ys, budget // 2, self.pos).tolist()
        if self.gaps:
            # NaN is never a bucket's min or max: without this a gap would go and the line
            # from the last step back to the earlier one come back.
            del self.gaps[: -max(1, budget // 4)]
            gaps = set(self.gaps)
            keep = sorted({*keep, *(i for i, p in enumerate(self.pos) if p in gaps)})
        self.xs = [self.xs[i] for i in keep]
        self.ys = [self.ys[i] for i in keep]
        self.pos = [self.pos[i] for i in keep]
        return True

    def extend_steps(self, xs: list, ys: list[float], budget: int) -> tuple[bool, list, list]:
        """:meth:`extend` for a trace against step: ``(re-decimated?, xs, ys)`` as appended,
        with a gap (x, NaN) before each step lower than the one before it."""
        return self._extend_split(xs, ys, budget)

    def extend_times(self, xs: list, ys: list[float], budget: int) -> tuple[bool, list, list]:
        """:meth:`extend` for a trace against time: ``(re-decimated?, xs, ys)`` as appended,
        with a gap (x, NaN) before each point more than ``_HOLD_S`` after the one before it
        (the idle time between cells, a pause): no line is drawn across it."""
        return self._extend_split(xs, ys, budget, hold=_HOLD_S)

    def _extend_split(self, xs: list, ys: list[float], budget: int, hold: float | None = None):
        # A gap goes before each step lower than the one before it (hold None), or each
        # time more than `hold` after the one before it.
        import numpy as np

        if not xs:
            return self.extend(xs, ys, budget), xs, ys
        at = np.fromiter(xs, dtype=np.float64, count=len(xs))  # vectorised: a first read is long
        if hold is None:
            back = (np.flatnonzero(at[1:] < at[:-1]) + 1).tolist()
            first = bool(self.xs) and xs[0] < self.xs[-1]
        else:
            back = (np.flatnonzero(at[1:] - at[:-1] > hold) + 1).tolist()
            first = bool(self.xs) and xs[0] - self.xs[-1] > hold
        if first:
            back.insert(0, 0)
        if back:
            xs, ys = list(xs), list(ys)
            for shift, i in enumerate(back):  # each gap moves the later points one on
                xs.insert(i + shift, xs[i + shift])
                ys.insert(i + shift, math.nan)
                self.gaps.append(self.total + i + shift)
        return self.extend(xs, ys, budget), xs, ys


class RateTotal:
    """The total throughput: at each ``TOTAL_BIN_S`` of time, the sum of every rank's rate then.

    A rank's rate in a bin is the mean of its points there; a bin its step
    spans without a point (a step longer than the bin) takes the rate of the
    step that covers it, the rank's next point. A bin goes out once every
    running rank has logged past it (:meth:`ready`'s ``frontier``); a rank's
    point that comes later still (a rank slower to send than the others were to
    step) is added to its bin and the whole trace is sent again, never a second
    point at the same time. Ranks steady at their rates give a flat total,
    their last bin included: a last bin fewer ranks reached than the one before
    (ranks stop a fraction of a second apart) is left out, not drawn as a fall.
    """

    def __init__(self) -> None:
        """No points yet."""
        self._sums: dict[int, float] = {}  # bin -> sum of the ranks' rates finished in it
        self._counts: dict[int, int] = {}  # bin -> ranks that added to it
        # rank -> [bin, sum, n, time, rate counted while all seemed quiet or None] of its latest bin
        self._open: dict[int, list] = {}
        self._sent = -1  # the last bin given out
        self._stale = False  # a bin given out has changed: send the trace whole

    def add(self, rank: int, steps: list[int], xs: list, values: list[float]) -> None:
        """Take in new points of ``rank`` in its order (``xs``: seconds since the run started)."""
        for x, value in zip(xs, values):
            if value is None or not math.isfinite(value):
                continue
            current = math.floor(x / TOTAL_BIN_S)
            open_ = self._open.get(rank)
            if open_ is not None and current == open_[0]:
                if open_[4] is not None:
                    # Counted when every rank seemed quiet, and the bin goes on: take it back.
                    self._finish(int(open_[0]), -open_[4], -1)
                    open_[4] = None
                open_[1] += value
                open_[2] += 1
                open_[3] = x
                continue
            if open_ is not None:
                if open_[4] is None:  # else it was counted as it is, when all seemed quiet
                    self._finish(int(open_[0]), open_[1] / open_[2])
                if x - open_[3] <= _HOLD_S:  # one step spanned the bins between
                    for gap in range(int(open_[0]) + 1, current):
                        self._finish(gap, value)
            self._open[rank] = [current, value, 1, x, None]

    def _finish(self, bin_: int, rate: float, ranks: int = 1) -> None:
        self._sums[bin_] = self._sums.get(bin_, 0.0) + rate
        self._counts[bin_] = self._counts.get(bin_, 0) + ranks
        if bin_ <= self._sent:
            self._stale = True

    def ready(self, frontier: float) -> tuple[list, list[float], bool]:
        """(xs, totals, whole) of the bins up to ``frontier`` (inf: every bin, the ranks are quiet).

        ``whole``: the lists are the whole trace (a bin given out before has
        changed), else only the bins new since the previous call.
        """
        if math.isinf(frontier):
            for open_ in self._open.values():
                if open_[4] is None:  # counted for now; a later point of that bin takes it back
                    open_[4] = open_[1] / open_[2]
                    self._finish(int(open_[0]), open_[4])
        last = max(self._sums, default=-1)
        if math.isinf(frontier) and last > self._sent and last - 1 in self._counts:
            if self._counts[last] < self._counts[last - 1]:
                # A last bin only some ranks reached before they all stopped.
                del self._sums[last], self._counts[last]
                for rank in [r for r, o in self._open.items() if o[0] == last]:
                    del self._open[rank]
                last -= 1
        top = last if math.isinf(frontier) else min(int(frontier), last)
        whole = self._stale
        start = -1 if whole else self._sent
        bins = [b for b in sorted(self._sums) if start < b <= top]
        self._stale = False
        self._sent = max(self._sent, top)
        xs = [round((b + 1) * TOTAL_BIN_S, 3) for b in bins]
        return xs, [self._sums[b] for b in bins], whole


class Aligned:
    """A trace across ranks, point by point once no rank will add to that point.

    The mean over ranks at each step (a rank's last value at that step counts).
    Vectorised (numpy): the history of 8 ranks x 100k steps takes ~0.2 s.
    """

    def __init__(self) -> None:
        """No points yet."""
        self.pending: dict[int, list[tuple]] = {}  # rank -> chunks of (steps, values)
        self._done = -math.inf  # the last step given out
        self._last: dict[int, int] = {}  # rank -> its last step taken in
        self._again = False  # a rank went back to an earlier step: the steps come again

    def add(self, rank: int, steps: list[int], xs: list, values: list[float]) -> None:
        """Take in new points of ``rank`` (``xs`` is not used: the mean is per step).

        A point at a step already given out while its rank moves forward came too
        late (the rank was slower to send than the others to step): it is left
        out, not given out a second time. A rank going back to an earlier step
        (a loop run again) starts the steps over.
        """
        import numpy as np

        keys = np.asarray(steps, dtype=np.int64)
        vals = np.asarray(values, dtype=np.float64)
        if not keys.size:
            return
        last = self._last.get(rank)
        if (last is not None and keys[0] <= last) or bool(np.any(np.diff(keys) <= 0)):
            self._again = True
        elif not self._again:
            keep = keys > self._done
            keys, vals = keys[keep], vals[keep]
        self._last[rank] = int(steps[-1])
        if keys.size:
            self.pending.setdefault(rank, []).append((keys, vals))

    def ready(self, frontier: float) -> tuple[list, list[float], bool]:
        """(steps, means, False) up to step ``frontier``, in order, taken out of pending."""
        import numpy as np

        keys, values = self._take(frontier)
        if not keys.size:
            return [], [], False
        keys, group = np.unique(keys, return_inverse=True)
        value = np.bincount(group, weights=values)
        return keys.tolist(), (value / np.bincount(group)).tolist(), False

    def _take(self, frontier: float):
        """Every rank's (step, value) up to ``frontier``, one per step and rank, out of pending."""
        import numpy as np

        if self._again:
            self._done = -math.inf
            self._again = False
        parts = []
        for rank, chunks in self.pending.items():
            if not chunks:
                continue
            keys = np.concatenate([c[0] for c in chunks])
            values = np.concatenate([c[1] for c in chunks])
            take = keys <= frontier
            rest = ~take
            self.pending[rank] = [(keys[rest], values[rest])] if rest.any() else []
            if not take.any():
                continue
            keys, values = keys[take], values[take]
            parts.append(last_per_step(keys, values))
        if not parts:
            return np.zeros(0, dtype=np.int64), np.zeros(0)
        keys = np.concatenate([p[0] for p in parts])
        self._done = max(self._done, int(keys.max()))
        return keys, np.concatenate([p[1] for p in parts])


class Spread(Aligned):
    """Median, min and max over ranks at each step, once no rank will add to that step."""

    def spread(self, frontier: float) -> tuple[list, list[float], list[float], list[float]]:
        """(steps, medians, minima, maxima) up to step ``frontier``, taken out of pending."""
        steps, median, low, high, _ = across_ranks(*self._take(frontier))
        return steps.tolist(), median.tolist(), low.tolist(), high.tolist()


def last_per_step(keys, values):
    """One rank's ``(keys, values)`` arrays with each step once, sorted: a step logged twice
    (a loop run again, a restart) keeps its last value."""
    import numpy as np

    _, back = np.unique(keys[::-1], return_index=True)
    last = len(keys) - 1 - back
    return keys[last], values[last]


def across_ranks(keys, values):
    """``(x, median, min, max, count)`` arrays at each distinct x of the ``(keys[i], values[i])``
    pairs (the ranks' values at a step or in a time bin); NaN and infinite values left out."""
    import numpy as np

    keys, values = np.asarray(keys), np.asarray(values, dtype=np.float64)  # steps stay integers
    finite = np.isfinite(values)
    keys, values = keys[finite], values[finite]
    order = np.lexsort((values, keys))  # by x, then value
    keys, values = keys[order], values[order]
    at, start, count = np.unique(keys, return_index=True, return_counts=True)
    median = (values[start + (count - 1) // 2] + values[start + count // 2]) / 2
    return at, median, values[start], values[start + count - 1], count


def merge(extend: dict, where: tuple[int, int], compacted: bool, xs: list, ys: list) -> None:
    """Add one trace's new points to a poll's ``extend`` map (see :meth:`Trace.extend`)."""
    # extend[(panel, trace)] = [re-decimated?, new xs, new ys] for one poll
    # (xs and ys are not modified afterwards: kept by reference, no copy of a large first read)
    entry = extend.get(where)
    if entry is None:
        extend[where] = [compacted, xs, ys]
    else:
        entry[0] = entry[0] or compacted
        entry[1] = entry[1] + xs
        entry[2] = entry[2] + ys


def elapsed(times: list[float], started: float) -> list[float]:
    """Seconds since ``started``, to the millisecond."""
    import numpy as np

    return np.round(np.asarray(times, dtype=np.float64) - started, 3).tolist()


def wire(values: list[float]) -> list:
    """The values as JSON can carry them: NaN and inf become null."""
    # JSON has no NaN/inf (a browser's JSON.parse rejects them): they travel as null, a gap in the line.
    return [v if v is not None and math.isfinite(v) else None for v in values]
