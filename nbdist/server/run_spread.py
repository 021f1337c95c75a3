"""Jupyter server: a past run of more than ``PER_RANK_UP_TO`` ranks, charted as the dashboard charts it.

A line per rank stops being readable long before 256 ranks, and a legend of 256
entries is none. Above ``PER_RANK_UP_TO`` ranks the past-run view draws what the
notebook dashboard draws: per chart, the median across the ranks with their
min-max band, and at most ``SHOWN_RANKS`` ranks on their own, the ones that
deviate by the dashboard's rules: stragglers first (its straggler rule on each
rank's latest steps, :func:`nbdist.server.stragglers.flag`), then the ranks whose
last value of the first chart lies far outside the others'
(:func:`nbdist.dashboard.table.pick_shown`). The band is worked out from every
point of every rank (:func:`nbdist.server.rank_summary.spread`), then decimated
like any trace. Unlike the live dashboard, which draws the ranks' total
throughput above 8 ranks and the GPU's figures rank by rank, every panel here
has the band: throughput per rank and the GPU's figures in bins of time.

Example::

    from nbdist.metrics import store
    run = store.load_run(3)                     # a 256-rank run
    shown_ranks(run, "loss")                    # [{"rank": 201, "why": "3.0× step time"}]
    band(run, "loss", by_time=False, budget=2000)["median"][:2]   # [[0.0, 2.31], [1.0, 2.29]]
"""

from __future__ import annotations

import math

import numpy as np

from nbdist.dashboard.breakdown import PARTS, WINDOW
from nbdist.dashboard.decimate import decimate
from nbdist.dashboard.table import HISTORY, pick_shown
from nbdist.dashboard.traces import TOTAL_BIN_S
from nbdist.server.rank_summary import spread
from nbdist.server.stragglers import RecentPoints, flag

__all__ = ["band", "shown_ranks"]


def _finite(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _recent(run, rank: int, first_key: str) -> RecentPoints:
    """The rank's latest points as the dashboard's straggler rule reads them: step times and
    ``(time, step)`` pairs from its step-time points (else the first chart's), and the
    latest parts of its step breakdown."""
    recent = RecentPoints()
    key = "step_time"
    steps, values = run.series(key, rank, -HISTORY)
    if not steps:
        key = first_key
        steps, values = run.series(key, rank, -HISTORY)
    times = run.timeline(key, rank, -HISTORY)[0]
    for step, when, value in zip(steps, times, values):
        recent.add(step, when, {"step_time": value} if key == "step_time" else {})
    for part, _ in PARTS:
        recent.parts[part].extend(v for v in run.series(part, rank, -WINDOW)[1] if _finite(v))
    return recent


def shown_ranks(run, first_key: str) -> list[dict]:
    """``[{"rank", "why"}]``: the ranks drawn on their own, by the dashboard's choice
    (:func:`nbdist.dashboard.table.pick_shown`): stragglers, then the ranks whose last
    ``first_key`` value is far from the others', at most ``SHOWN_RANKS``."""
    stragglers = flag({rank: _recent(run, rank, first_key) for rank in run.ranks})
    lasts = []
    for rank in run.ranks:
        values = run.series(first_key, rank, -1)[1]
        if values and _finite(values[-1]):
            lasts.append((values[-1], rank))
    far = f"last {first_key} far from the others'"
    picked = pick_shown(sorted(stragglers), [], lasts)
    return [{"rank": rank, "why": stragglers.get(rank, far)} for rank in picked]


def band(run, key: str, *, by_time: bool, budget: int) -> dict[str, list[list[float]]]:
    """``{"median", "min", "max"}``: ``[[x, y], ...]`` across every rank of ``run``, each
    decimated to ``budget`` points; x a step, or (``by_time``) seconds since the run
    started, in bins of at least ``TOTAL_BIN_S`` (ranks log at moments of their own)."""
    xs, ys = [], []
    for rank in run.ranks:
        if by_time:
            times, values = run.timeline(key, rank)
            xs.append(np.asarray(times, dtype=np.float64) - run.started)
        else:
            steps, values = run.series(key, rank)
            xs.append(steps)
        ys.append(values)
    width = None
    if by_time:
        filled = [x for x in xs if len(x)]
        span = max(x[-1] for x in filled) - min(x[0] for x in filled) if filled else 0.0
        width = max(TOTAL_BIN_S, span / budget)
    at, *lines = spread(xs, ys, bin_width=width)
    out = {}
    for name, values in zip(("median", "min", "max"), lines):
        dxs, dys = decimate(at.tolist(), values.tolist(), budget=budget)
        out[name] = [[round(x, 3) if by_time else int(x), float(y)] for x, y in zip(dxs, dys)]
    return out
