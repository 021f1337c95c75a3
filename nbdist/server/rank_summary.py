"""Jupyter server: the sidebar's summary of a cluster above ``PER_RANK_UP_TO`` ranks.

The same summary as the notebook dashboard's table (:func:`nbdist.dashboard.table.deviating_rows`):
counts by state, one entry per host (its ranks counted by state, its step range and total
rate), then the ranks that deviate: dead, stragglers, and ranks in a state few of the
living share (busy while the others are idle, or idle while they are busy). Only those
ranks keep their recent points for the sidebar's charts; the others' are summed up in
a median line per chart, so a poll of 256 ranks stays a few tens of KB. :func:`spread`
(the median and min-max band across ranks) also draws a past run of many ranks
(:mod:`nbdist.server.run_spread`).

Example::

    from nbdist.server.rank_summary import summarise

    summary = summarise(rows)   # rows: LiveView.rank_rows(entry)
    summary["states"]           # {"busy": 255, "idle": 0, "dead": 1}
    summary["held"]             # {"busy": {"stopped": 1}}: counted in "busy" above
    summary["deviating"]        # [{"rank": 17, "why": "dead"}, ...]
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from nbdist.dashboard.table import PER_RANK_UP_TO
from nbdist.dashboard.traces import across_ranks, last_per_step
from nbdist.rank_states import BUSY, DEAD, IDLE, held_counts

__all__ = ["MAX_DEVIATING", "RECENT_RATE_S", "is_many", "median_series", "spread", "summarise"]

RECENT_RATE_S = 5.0
MAX_DEVIATING = 12  # ranks listed one by one at most (dead first, then stragglers)


def is_many(ranks: Sequence[dict]) -> bool:
    """True above ``PER_RANK_UP_TO`` ranks: the sidebar shows the summary, not a card per rank."""
    return len(ranks) > PER_RANK_UP_TO


def _why(row: dict, minority: set[str]) -> str:
    if row["state"] == DEAD:
        return "dead"
    if row.get("process"):  # stopped, or held by a debugger: its cell waits for it
        return row["process"]
    if row.get("straggler"):
        return f"straggler: {row['straggler']}"
    if row["state"] in minority:
        other = IDLE if row["state"] == BUSY else BUSY
        return f"{row['state']} while the others are {other}"
    return ""


def summarise(ranks: Sequence[dict], now: float) -> dict:
    """``{"states", "held", "hosts", "deviating", "more"}`` for the sidebar, from
    :meth:`LiveView.rank_rows`.

    ``held``: ``{state: {"stopped" or "held by a debugger": n}}`` of the ranks counted in
    ``states`` whose processes are held;
    ``hosts``: ``{"host", "ranks", "states", "held", "step_min", "step_max", "samples_per_s"}``
    in the order their first rank comes (the rate: the total of the ranks that logged in
    the last ``RECENT_RATE_S`` seconds at ``now``, None once none did); ``deviating``: ``{"rank", "host", "why"}``,
    dead first, then stopped or held by a debugger, then stragglers, then the odd state out
    (at most ``MAX_DEVIATING``;
    ``more`` says how many were left out).
    """
    living = [r for r in ranks if r["state"] != DEAD]
    counts = {s: sum(1 for r in ranks if r["state"] == s) for s in (BUSY, IDLE, DEAD)}
    alive = {s: sum(1 for r in living if r["state"] == s) for s in (BUSY, IDLE)}
    common = max(alive.values(), default=0)
    minority = {s for s, n in alive.items() if 0 < n < common}
    hosts: dict[str, list[dict]] = {}
    for row in ranks:
        hosts.setdefault(row.get("host") or "?", []).append(row)
    host_entries = []
    for host, rows in hosts.items():
        steps = [r["step"] for r in rows if r["step"] is not None]
        rates = [r["samples_per_s"] for r in rows if _rate_now(r, now)]
        host_entries.append(
            {
                "host": host,
                "ranks": len(rows),
                "states": {s: n for s in (BUSY, IDLE, DEAD) if (n := _count(rows, s))},
                "held": _held_counts(rows),
                "step_min": min(steps) if steps else None,
                "step_max": max(steps) if steps else None,
                "samples_per_s": sum(rates) if rates else None,
            }
        )
    order = {"dead": 0, "stopped": 1, "held by a debugger": 1, "straggler": 2}
    deviating = [
        {"rank": r["rank"], "host": r.get("host") or "?", "why": why}
        for r in ranks
        if (why := _why(r, minority))
    ]
    deviating.sort(key=lambda d: (order.get(d["why"].split(":")[0], 3), d["rank"]))
    return {
        "states": counts,
        "held": _held_counts(ranks),
        "hosts": host_entries,
        "deviating": deviating[:MAX_DEVIATING],
        "more": max(0, len(deviating) - MAX_DEVIATING),
    }


def _rate_now(row: dict, now: float) -> bool:
    # An idle rank's last rate is not a rate now (the sidebar's total follows the same rule).
    seen = row["last_seen"]
    return row["samples_per_s"] is not None and seen is not None and now - seen < RECENT_RATE_S


def _count(rows: Sequence[dict], state: str) -> int:
    return sum(1 for r in rows if r["state"] == state)


def _held_counts(rows: Sequence[dict]) -> dict[str, dict[str, int]]:
    # Counted in their state as everywhere, and said beside it by the sidebar
    # ("12 busy (1 stopped)"), as the notebook dashboard's host rows do.
    return held_counts((r["state"], r.get("process") or "") for r in rows)


def spread(
    xs: Sequence[Sequence[float]], ys: Sequence[Sequence[float]], *, bin_width: float | None = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``(x, median, min, max)`` across ranks at each x of their series (``xs[i]``, ``ys[i]``:
    one rank's), as arrays; NaN and infinite values left out.

    x a step (shared by the ranks): a step a rank logged twice (a loop run again) counts
    its last value, as on the dashboard, and a step fewer than half as many ranks reached
    as the most did (one only a few got to so far) is left out: it is no median of them
    all. With ``bin_width``, x is a time (each rank logs at moments of its own): taken to
    the middle of its bin, a bin's figures are over every point in it.
    """
    keys, values = [], []
    for x, y in zip(xs, ys):
        x, y = np.asarray(x), np.asarray(y, dtype=np.float64)
        if not x.size:
            continue
        if bin_width:
            x = (np.floor(x / bin_width) + 0.5) * bin_width
        else:
            x, y = last_per_step(x, y)
        keys.append(x)
        values.append(y)
    if not keys:
        empty = np.empty(0)
        return empty, empty, empty, empty
    at, median, low, high, count = across_ranks(np.concatenate(keys), np.concatenate(values))
    if not bin_width:
        full = count >= max(1, count.max(initial=0) // 2)
        at, median, low, high = at[full], median[full], low[full], high[full]
    return at, median, low, high


def median_series(series: Sequence[Sequence[Sequence[float]]]) -> list[list[float]]:
    """The median across ranks at each x of their ``[[x, y], ...]`` lists (``x`` shared: the step)."""
    at, median, _, _ = spread(
        [[p[0] for p in points] for points in series], [[p[1] for p in points] for points in series]
    )
    return [[float(x), float(y)] for x, y in zip(at, median)]
