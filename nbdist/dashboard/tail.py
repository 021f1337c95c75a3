"""Kernel side: a run's new points of one key and rank, read from where the dashboard left off.

:func:`read_tail` asks the run for the points from the ``start``-th on when its
``series`` and ``timeline`` take ``start=`` (:class:`~nbdist.metrics.run.Run`
does), so a refresh copies only what is new; with another run-like object it
reads the whole series and slices it.
"""

from __future__ import annotations

import inspect

__all__ = ["read_tail"]


def read_tail(run, key: str, rank: int, start: int) -> tuple[list[int], list[float], list[float]]:
    """(steps, times, values) of ``key`` on ``rank`` from its ``start``-th point on."""
    if _incremental(type(run)):
        steps, values = run.series(key, rank, start=start)
        times, _ = run.timeline(key, rank, start=start)
    else:  # Run without start=: copies the whole series, O(points) per refresh
        steps, values = run.series(key, rank)
        times, _ = run.timeline(key, rank)
        if start:
            steps, times, values = steps[start:], times[start:], values[start:]
    n = min(len(steps), len(times))  # a point may land between the two reads
    return steps[:n], times[:n], values[:n]


_INCREMENTAL: dict[type, bool] = {}


def _incremental(cls: type) -> bool:
    if cls not in _INCREMENTAL:
        try:
            params = inspect.signature(cls.series).parameters
            params2 = inspect.signature(cls.timeline).parameters
            _INCREMENTAL[cls] = "start" in params and "start" in params2
        except (TypeError, ValueError, AttributeError):
            _INCREMENTAL[cls] = False
    return _INCREMENTAL[cls]
