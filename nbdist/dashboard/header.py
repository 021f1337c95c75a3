"""Kernel side: the dashboard's header line: which run, how long, how far, the ranks' states, the GPUs.

The widget draws it above the plots and ticks the elapsed time itself (from
``started``, against the kernel's clock); a run that logs ``total_steps`` (the
number of steps the loop will take, e.g. ``nbdist.log(step=i, loss=l,
total_steps=n)``) gets a progress bar.

Example::

    >>> from nbdist.metrics.run import Run
    >>> run = Run(4, world_size=2, backend="gloo", started=100.0)
    >>> run.add(0, [(9, 101.0, {"loss": 1.0, "total_steps": 100})])
    1
    >>> h = header(run, [])
    >>> h["name"], h["step"], h["progress"]
    ('run 4', 9, 0.1)
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence

from nbdist.dashboard.table import (
    PER_RANK_UP_TO,
    PROGRESS_KEY,
    fmt_gpu_memory,
    fmt_gpu_util,
    plotted_keys,
    plural,
)
from nbdist.rank_states import DEAD, RANK_STATES

__all__ = ["header", "nonfinite"]


def header(run, rows: Sequence) -> dict:
    """The header's fields: ``name``, ``detail``, ``started``, ``ended``, ``last`` (newest
    point's time), ``step`` (the furthest rank's), ``steps`` ("min–max" over ranks),
    ``points``, ``progress`` (0..1, or None), ``total`` (``total_steps`` or None),
    ``states`` ("2 busy · 1 dead"), ``gpu`` (a line, or None without GPU readings) and
    ``nonfinite`` (:func:`nonfinite`: the ranks whose latest loss is NaN/inf, or None).

    ``rows``: the table's :class:`~nbdist.dashboard.table.RankRow` list.
    """
    lasts = [last for last in (run.last(r) for r in run.ranks) if last]
    steps = [int(last["step"]) for last in lasts]
    totals = [last[PROGRESS_KEY] for last in lasts if _finite(last.get(PROGRESS_KEY))]
    total = max(totals) if totals else None
    step = max(steps) if steps else None
    progress = None
    if total and total > 0 and step is not None:
        # Steps count from 0: step s of n done means s + 1 of n.
        progress = round(min(1.0, (step + 1) / total), 4)
    name = f"run {run.id}" + (f" · {run.label}" if run.label else "")
    detail = plural(run.world_size, "rank") + (f" · {run.backend}" if run.backend else "")
    counts = Counter(row.state for row in rows)
    states = " · ".join(f"{counts[s]} {s}" for s in RANK_STATES if counts[s])
    return {
        "name": name,
        "detail": detail,
        "started": run.started,
        "ended": run.ended,
        "last": max((last["time"] for last in lasts), default=None),
        "step": step,
        "steps": "" if not steps else f"{min(steps)}–{max(steps)}" if min(steps) != step else "",
        "points": run.count(),
        "progress": progress,
        "total": None if total is None else int(total),
        "states": states,
        "gpu": _gpu_line([(row.host, row.gpu) for row in rows if row.gpu and row.state != DEAD]),
        "nonfinite": nonfinite(run, rows),
    }


def nonfinite(run, rows: Sequence) -> str | None:
    """``"loss NaN/inf on 1 rank (3): left out of the median and band"``, or None when every
    rank's latest loss (the first chart's key) is finite.

    Above ``PER_RANK_UP_TO`` ranks the band cannot show such a value (there is no median
    of NaN), and at most a few ranks are drawn on their own: the count says how many
    the band left out. With fewer ranks each has its line; the ranks are named.
    """
    broken = [r.rank for r in rows if r.loss is not None and not _finite(r.loss)]
    if not broken:
        return None
    key = (plotted_keys(run.keys()) or ["loss"])[0]
    named = ", ".join(map(str, broken[:4])) + (", ..." if len(broken) > 4 else "")
    if len(rows) > PER_RANK_UP_TO:
        return f"{key} NaN/inf on {plural(len(broken), 'rank')} ({named}): left out of the band"
    return f"{key} NaN/inf on rank{'s' if len(broken) > 1 else ''} {named}"


def _gpu_line(readings: list[tuple[str, dict]]) -> str | None:
    """``readings``: ``(host, GPU reading)`` of each live rank that has one."""
    if not readings:
        return None
    # Ranks sharing a GPU report the same device: count each GPU once. NVML's gpu_index
    # numbers the GPUs of one host, so a GPU is its host and index (32 hosts of 8 GPUs
    # are 256 GPUs, not 8); host is "" on one host. A reading without an index counts alone.
    unique = {
        (host, g["gpu_index"]) if "gpu_index" in g else (host, None, i): g
        for i, (host, g) in enumerate(readings)
    }
    readings = list(unique.values())
    utils = [g["gpu_util"] for g in readings if _finite(g.get("gpu_util"))]
    used = [g["gpu_mem_mib"] for g in readings if _finite(g.get("gpu_mem_mib"))]
    total = [g["gpu_mem_total_mib"] for g in readings if _finite(g.get("gpu_mem_total_mib"))]
    util = fmt_gpu_util(sum(utils) / len(utils) if utils else None)
    memory = fmt_gpu_memory(sum(used) if used else None, sum(total) if total else None)
    n = len(readings)
    return f"{plural(n, 'GPU')}: utilisation {util} (mean) · memory {memory}"


def _finite(value) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)
