"""Kernel side: the dashboard as plain text, for terminals, scripts and notebooks viewed without widgets.

Example::

    >>> print(summary_text(run))                                        # doctest: +SKIP
    run 3 · 4 ranks · gloo · 4,000 points
    rank  step    loss  samples/s  step time   memory  last seen  state
       0   999  0.1031      6,400   100.0 ms  512 MiB  0.3 s ago  busy
       ...
    series          last      mean       min       max
    loss          0.1024    0.3421   0.09876     2.301
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping

from nbdist.dashboard.breakdown import PARTS, breakdown, shares
from nbdist.dashboard.table import fmt_value, has_flops, has_gpu, headers, rank_rows
from nbdist.text_table import format_table

__all__ = ["summary_text"]


def summary_text(
    run,
    states: Mapping[int, str] | Callable[[], Mapping[int, str]] | None = None,
    *,
    now: float | None = None,
) -> str:
    """A fixed-width table per rank, then one line per series: last / mean / min / max.

    ``last`` is the mean over ranks of each rank's latest value; mean, min and
    max are over every point of every rank (NaN and inf left out).
    ``states``: {rank: state} or a callable returning it (``"dead"`` is shown).
    """
    now = time.time() if now is None else now
    keys = run.keys()
    lines = [_title(run)]
    rows = rank_rows(run, states, now=now)
    header = headers(keys)
    cells = [row.cells(now, gpu=has_gpu(keys), flops=has_flops(keys)) for row in rows]
    # Numbers align right; the state and the straggler flag (the last two columns), left.
    lines.append(format_table(header, cells, right=range(len(header) - 2)))
    if "comm_s" in keys:
        lines.append("step breakdown (latest steps):")
        for rank, frac in shares(breakdown(run)).items():
            parts = " · ".join(f"{name} {100 * frac[key]:.0f} %" for key, name in PARTS)
            lines.append(f"  rank {rank}: {parts}")
    dropped = {r: n for r, n in sorted(getattr(run, "dropped", {}).items()) if n}
    if dropped:
        each = ", ".join(f"rank {r}: {n}" for r, n in dropped.items())
        lines.append(f"{sum(dropped.values())} points dropped on the ranks ({each})")
    if keys:
        series = [
            [key, *(fmt_value(v) for v in _stats(run, key))]
            for key in keys
            if key != "gpu_index"  # a GPU's number, not a figure to average
        ]
        lines.append("")
        lines.append(
            format_table(["series", "last", "mean", "min", "max"], series, right={1, 2, 3, 4})
        )
    return "\n".join(lines)


def _title(run) -> str:
    parts = [f"run {run.id}", f"{run.world_size} ranks"]
    if run.backend:
        parts.append(run.backend)
    if run.label:
        parts.append(run.label)
    count = run.count()
    parts.append(f"{count:,} points" if count else "no points yet")
    if getattr(run, "ended", None) is not None:
        parts.append("finished")  # the sidebar's word for a run whose session stopped
    return " · ".join(parts)


def _stats(run, key: str) -> tuple[float | None, ...]:
    import numpy as np

    lasts: list[float] = []
    chunks = []
    for rank in run.ranks:
        _, values = run.series(key, rank)
        y = np.asarray(values, dtype=np.float64)  # None (not carried by the wire) -> NaN
        y = y[np.isfinite(y)]
        if y.size:
            lasts.append(float(y[-1]))
            chunks.append(y)
    if not chunks:
        return (None, None, None, None)
    every = np.concatenate(chunks)
    return (sum(lasts) / len(lasts), float(every.mean()), float(every.min()), float(every.max()))
