"""Jupyter server: a past run of more than ``PER_RANK_UP_TO`` ranks, charted as the dashboard charts it.

A line per rank stops being readable long before 256 ranks, and a legend of 256
entries is none. Above ``PER_RANK_UP_TO`` ranks the past-run view draws what the
notebook dashboard draws: per chart, the median across the ranks with their
min-max band, and at most ``SHOWN_RANKS`` ranks on their own, the ones that
deviate by the dashboard's rules: stragglers first (its straggler rule on each
rank's latest steps, :func:`nbdist.server.stragglers.flag`), then the ranks whose
last value of the first chart lies far outside the others'
(:func:`nbdist.dashboard.table.outlying_ranks`). The band is worked out from
every point of every rank, then decimated like any trace.

Example::

    from nbdist.metrics import store
    run = store.load_run(3)                     # a 256-rank run
    shown_ranks(run, "loss")                    # [{"rank": 201, "why": "3.0× step time"}]
    band(run, "loss", by_time=False, budget=2000)["median"][:2]   # [[0.0, 2.31], [1.0, 2.29]]
"""

from __future__ import annotations

import math

import numpy as np

from nbdist.dashboard.breakdown import PARTS
from nbdist.dashboard.decimate import decimate
from nbdist.dashboard.table import HISTORY, SHOWN_RANKS, outlying_ranks
from nbdist.dashboard.traces import TOTAL_BIN_S
from nbdist.server.rank_summary import spread
from nbdist.server.stragglers import RecentPoints, flag

__all__ = ["band", "shown_ranks"]


def _recent(run, rank: int, first_key: str) -> RecentPoints:
    """The rank's latest points as the straggler rule reads them: step times, (time, step)
    pairs and the step breakdown's parts."""
    recent = RecentPoints()
    steps = run.series(first_key, rank, -HISTORY)[0]
    times = run.timeline(first_key, rank, -HISTORY)[0]
    by_key = {}
    for key in ("step_time", *(k for k, _ in PARTS)):
        at, values = run.series(key, rank, -HISTORY)
        if at:
            by_key[key] = dict(zip(at, values))
    for step, when in zip(steps, times):
        recent.add(step, when, {k: m[step] for k, m in by_key.items() if step in m})
    return recent


def shown_ranks(run, first_key: str) -> list[dict]:
    """``[{"rank", "why"}]``: the ranks drawn on their own, stragglers first, then the ranks
    whose last ``first_key`` value is far from the others', at most ``SHOWN_RANKS``."""
    recent = {rank: _recent(run, rank, first_key) for rank in run.ranks}
    picked = dict(sorted(flag(recent).items()))
    lasts = []
    for rank in run.ranks:
        values = run.series(first_key, rank, -1)[1]
        if values and math.isfinite(values[-1]):
            lasts.append((values[-1], rank))
    for rank in outlying_ranks(lasts):
        picked.setdefault(rank, f"last {first_key} far from the others'")
    return [{"rank": rank, "why": why} for rank, why in list(picked.items())[:SHOWN_RANKS]]


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
