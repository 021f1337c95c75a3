"""Jupyter server: which ranks straggle, by the notebook dashboard's own rule.

The sidebar must flag the ranks the dashboard flags, for the same reason: this
module keeps, per rank, the recent points that rule reads (the latest step
times, ``(time, step)`` pairs and step-breakdown parts, as the server's run
reader takes them in) and hands them to the dashboard's functions
(:func:`nbdist.dashboard.table.find_stragglers`, :func:`~nbdist.dashboard.table.step_lags`,
:func:`nbdist.dashboard.breakdown.explain` and :func:`~nbdist.dashboard.breakdown.slow_parts`).
A dead rank is never flagged: it is dead (as on the dashboard).

Example::

    >>> recent = {0: RecentPoints(), 1: RecentPoints()}
    >>> for step in range(10):
    ...     recent[0].add(step, 100.0 + step, {"step_time": 0.1})
    ...     recent[1].add(step, 100.0 + step, {"step_time": 0.3})
    >>> flag(recent)
    {1: '3.0× step time'}
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping

from nbdist.dashboard.breakdown import PARTS, WINDOW, explain, slow_parts
from nbdist.dashboard.table import HISTORY, RECENT, find_stragglers, step_lags

__all__ = ["RecentPoints", "flag"]


class RecentPoints:
    """One rank's latest step times, ``(time, step)`` pairs and step-breakdown parts."""

    def __init__(self) -> None:
        """Empty; :meth:`add` takes each point in arrival order."""
        self.step_times: deque[float] = deque(maxlen=RECENT)
        self.history: deque[tuple[float, int]] = deque(maxlen=HISTORY)
        self.parts: dict[str, deque[float]] = {key: deque(maxlen=WINDOW) for key, _ in PARTS}

    def add(self, step: int, when: float, values: Mapping[str, object]) -> None:
        """Take in one logged point (its step, time and values)."""
        self.history.append((when, step))
        for key, target in [
            ("step_time", self.step_times),
            *((k, self.parts[k]) for k, _ in PARTS),
        ]:
            value = values.get(key)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                if math.isfinite(value):
                    target.append(float(value))


def flag(
    recent: Mapping[int, RecentPoints], dead: frozenset[int] | set[int] = frozenset()
) -> dict[int, str]:
    """rank -> why it is a straggler ("1.4× step time · data loading 41 % of step, others 5 %").

    The dashboard's rule (:mod:`nbdist.dashboard.table`): median step time above
    1.3× the others', or more than 5 steps behind; with the step breakdown, the
    part that differs says why, and a compute or data share 20 points above the
    others' flags a rank by itself. Ranks in ``dead`` are left out of the answer.
    """
    step_times = {r: list(p.step_times) for r, p in recent.items() if p.step_times}
    history = {r: list(p.history) for r, p in recent.items() if p.history}
    flagged = find_stragglers(step_times, step_lags(history))
    parts = {
        rank: {key: sum(v) / len(v) for key, v in p.parts.items() if v}
        for rank, p in recent.items()
        if any(p.parts.values())
    }
    if any("comm_s" in p for p in parts.values()):
        for rank, why in flagged.items():
            detail = explain(parts, rank)
            flagged[rank] = f"{why} · {detail}" if detail else why
        for rank, why in slow_parts(parts).items():
            flagged.setdefault(rank, why)
    return {rank: why for rank, why in flagged.items() if rank not in dead}
