"""Kernel side: the dashboard's traces, what the browser holds of each and the aggregates across ranks.

:class:`Trace` keeps at most ``budget`` of a trace's points (min/max decimated);
:class:`Aligned` turns per-rank points into the mean over ranks at each step, or
the total throughput per time bin, once no rank will add to them.
"""

from __future__ import annotations

import math

from nbdist.dashboard.decimate import minmax_indices

__all__ = ["TOTAL_BIN_S", "Aligned", "Trace", "elapsed", "merge", "wire"]

TOTAL_BIN_S = 1.0  # total throughput: one point per second of the run


class Trace:
    """What the browser holds of one trace: at most ``budget`` of the logged points."""

    __slots__ = ("pos", "total", "xs", "ys")

    def __init__(self) -> None:
        """An empty trace."""
        self.xs: list = []
        self.ys: list[float] = []
        self.pos: list[int] = []  # each kept point's index among all points of this trace
        self.total = 0

    def extend(self, xs: list, ys: list[float], budget: int) -> bool:
        """Append; True when that went over budget and the trace was re-decimated (send it whole)."""
        self.xs += xs
        self.ys += ys
        self.pos += range(self.total, self.total + len(xs))
        self.total += len(xs)
        if len(self.xs) <= budget:
            return False
        keep = minmax_indices(self.ys, budget // 2, self.pos).tolist()
        self.xs = [self.xs[i] for i in keep]
        self.ys = [self.ys[i] for i in keep]
        self.pos = [self.pos[i] for i in keep]
        return True


class Aligned:
    """A trace across ranks, point by point once no rank will add to that point.

    Loss-like keys: the mean over ranks at each step (a rank's last value at
    that step counts). Throughput: the sum over ranks of each rank's mean rate
    in each ``TOTAL_BIN_S`` window of time, so ranks at different steps still
    add up. Vectorised (numpy): the history of 8 ranks x 100k steps takes ~0.2 s.
    """

    def __init__(self, total: bool) -> None:
        """``total``: sum rates per time bin (throughput); else the mean at each step."""
        self.total = total
        self.pending: dict[int, list[tuple]] = {}  # rank -> chunks of (keys, values)

    def add(self, rank: int, steps: list[int], xs: list, values: list[float]) -> None:
        """Take in new points of ``rank`` (``xs``: their times since the start, for totals)."""
        import numpy as np

        if self.total:  # key: the time bin
            keys = np.floor(np.asarray(xs, dtype=np.float64) / TOTAL_BIN_S).astype(np.int64)
        else:  # key: the step
            keys = np.asarray(steps, dtype=np.int64)
        self.pending.setdefault(rank, []).append((keys, np.asarray(values, dtype=np.float64)))

    def ready(self, frontier: float) -> tuple[list, list[float]]:
        """(xs, values) up to ``frontier`` (a step, or a time bin), in order, taken out of pending."""
        import numpy as np

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
            if self.total:  # the rank's mean rate in each bin
                own, group = np.unique(keys, return_inverse=True)
                parts.append((own, np.bincount(group, weights=values) / np.bincount(group)))
            else:  # the same step twice on a rank (a loop re-run): its last value counts
                _, back = np.unique(keys[::-1], return_index=True)
                last = len(keys) - 1 - back
                parts.append((keys[last], values[last]))
        if not parts:
            return [], []
        keys, group = np.unique(np.concatenate([p[0] for p in parts]), return_inverse=True)
        value = np.bincount(group, weights=np.concatenate([p[1] for p in parts]))
        if self.total:  # x: the end of the bin, seconds since the run started
            return np.round((keys + 1) * TOTAL_BIN_S, 3).tolist(), value.tolist()
        return keys.tolist(), (value / np.bincount(group)).tolist()


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
