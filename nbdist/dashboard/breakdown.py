"""Kernel side: where each rank's recent steps went (compute, communication, data) and why a rank is slow.

Reads the step breakdown the ranks log with every point (``compute_s``,
``comm_s``, ``data_s``; :mod:`nbdist.metrics.steptime`) over each rank's latest
``window`` points: the dashboard's stacked bars, and the reason a straggler is
flagged. In synchronous training the slow rank does not have the longest steps:
the others wait for it inside their collectives, so every rank's step time is
the same and the difference shows in the shares. A rank is flagged when the
share of compute or data loading in its steps is ``margin`` (20 percentage
points) above the median of the other ranks' shares; a rank already flagged by
step time gets the component that differs most from the others' as its reason.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping

__all__ = ["PARTS", "WINDOW", "breakdown", "breakdown_chart", "explain", "shares", "slow_parts"]

# (key, what the flag and the chart call it); comm last: a rank waiting there is not the cause.
PARTS = (("data_s", "data loading"), ("compute_s", "compute"), ("comm_s", "communication"))
WINDOW = 20


def breakdown(run, window: int = WINDOW) -> dict[int, dict[str, float]]:
    """rank -> mean seconds per step of each part over its latest ``window`` points with one."""
    out: dict[int, dict[str, float]] = {}
    for rank in run.ranks:
        parts = {}
        for key, _ in PARTS:
            _, values = run.series(key, rank, -window)  # the latest ``window`` (a slice)
            values = [v for v in values if v == v]  # NaN (an unreadable CUDA event) left out
            if values:
                parts[key] = sum(values) / len(values)
        if parts:
            out[rank] = parts
    return out


def shares(parts: Mapping[int, Mapping[str, float]]) -> dict[int, dict[str, float]]:
    """rank -> each part as a fraction of the rank's (mean) step."""
    out = {}
    for rank, p in parts.items():
        total = sum(p.values())
        if total > 0:
            out[rank] = {key: p.get(key, 0.0) / total for key, _ in PARTS}
    return out


def explain(parts: Mapping[int, Mapping[str, float]], rank: int, *, only_slow: bool = False) -> str:
    """Why ``rank`` differs: ``"data loading 41 % of step, others 5 %"``; "" when it cannot tell.

    The part whose share of ``rank``'s step is furthest above the median of the
    other ranks' shares of it: where the extra time went. (A share below the
    others', such as the communication of the rank everyone waits for, is the
    consequence, not the reason.) With ``only_slow``, compute or data loading only.
    """
    frac = shares(parts)
    if rank not in frac or len(frac) < 2:
        return ""
    best, best_diff = "", 0.0
    for key, name in PARTS[:2] if only_slow else PARTS:
        others = statistics.median(f[key] for r, f in frac.items() if r != rank)
        diff = frac[rank][key] - others
        if diff > best_diff:
            best_diff = diff
            best = f"{name} {100 * frac[rank][key]:.0f} % of step, others {100 * others:.0f} %"
    return best


def slow_parts(parts: Mapping[int, Mapping[str, float]], *, margin: float = 0.2) -> dict[int, str]:
    """rank -> reason, for ranks whose compute or data share is ``margin`` above the others'."""
    frac = shares(parts)
    flagged: dict[int, str] = {}
    if len(frac) < 2:
        return flagged
    for rank in frac:
        for key, _ in PARTS[:2]:
            others = statistics.median(f[key] for r, f in frac.items() if r != rank)
            if frac[rank][key] - others > margin:
                flagged[rank] = explain(parts, rank, only_slow=True)
                break
    return flagged


def breakdown_chart(parts: Mapping[int, Mapping[str, float]], nranks: int) -> dict | None:
    """The stacked bars' data: ``{"ranks": [...], "parts": {name: [ms per rank]}}``; None if empty."""
    if not parts:
        return None
    ranks = sorted(set(range(nranks)) | set(parts))
    return {
        "ranks": [f"rank {r}" for r in ranks],
        "parts": {
            name: [round(1000 * parts.get(r, {}).get(key, 0.0), 3) for r in ranks]
            for key, name in PARTS
        },
    }
