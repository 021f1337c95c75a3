"""Kernel side: the rank x step heatmap of step time the dashboard draws above ``PER_RANK_UP_TO`` ranks.

One row per rank, one column per bin of steps, each cell the mean step time of that
rank's points in that bin: a straggler is a bright row, a slow moment for everyone a
bright column. Points are summed into bins as they arrive (numpy, per rank), so memory
stays ``ranks x 2 * COLUMNS`` however long the run; when the steps outgrow the bins,
pairs of bins merge (each bin then spans twice the steps). The browser gets between
``COLUMNS`` and ``2 * COLUMNS`` columns: 256 ranks x 120 bins stay readable and ~150 KB.

Example::

    heat = StepHeat(ranks=256)
    heat.add(17, steps=[0, 1, 2], values=[0.05, 0.05, 0.06])
    msg = heat.message()   # {"t": "heatmap", "x": [...], "y": [...], "z": [[ms, ...], ...], ...}
"""

from __future__ import annotations

import numpy as np

__all__ = ["COLUMNS", "StepHeat"]

COLUMNS = 60  # the fewest step bins shown once the steps fill them; at most twice this


class StepHeat:
    """Mean step time per rank and step bin, kept summed; :meth:`message` is what the widget draws."""

    def __init__(self, ranks: int, columns: int = COLUMNS) -> None:
        """``ranks`` rows; bins of one step each until the steps reach ``2 * columns``."""
        self.ranks = ranks
        self.cap = 2 * columns
        self.width = 1  # steps per bin
        self.sums = np.zeros((ranks, self.cap))
        self.counts = np.zeros((ranks, self.cap), dtype=np.int64)
        self.version = 0  # bumped by every add that changed a bin

    def add(self, rank: int, steps, values) -> None:
        """Take in ``rank``'s points (step, step time in seconds); NaN and negative steps skipped."""
        s = np.asarray(steps, dtype=np.int64)
        v = np.asarray(values, dtype=np.float64)
        keep = np.isfinite(v) & (s >= 0)
        s, v = s[keep], v[keep]
        if not s.size or not 0 <= rank < self.ranks:
            return
        while int(s.max()) // self.width >= self.cap:
            self._coarsen()
        bins = s // self.width
        np.add.at(self.sums[rank], bins, v)
        np.add.at(self.counts[rank], bins, 1)
        self.version += 1

    def _coarsen(self) -> None:
        # Pairs of bins merge: each now spans twice the steps, and the upper half is free.
        half = self.cap // 2
        for grid in (self.sums, self.counts):
            merged = grid.reshape(self.ranks, half, 2).sum(axis=2)
            grid[:, :half] = merged
            grid[:, half:] = 0
        self.width *= 2

    def message(self) -> dict | None:
        """The heatmap as the widget draws it, or None before any point.

        ``x``: each bin's first step; ``y``: rank numbers; ``z``: per rank, the mean
        step time of each bin in ms (null: no point of that rank there); ``width``:
        steps per bin.
        """
        filled = np.flatnonzero(self.counts.any(axis=0))
        if not filled.size:
            return None
        used = int(filled[-1]) + 1
        with np.errstate(invalid="ignore", divide="ignore"):
            ms = 1000.0 * self.sums[:, :used] / self.counts[:, :used]
        ms = np.round(ms, 2)
        z = [[None if np.isnan(v) else float(v) for v in row] for row in ms]
        return {
            "t": "heatmap",
            "x": [i * self.width for i in range(used)],
            "y": list(range(self.ranks)),
            "z": z,
            "width": self.width,
        }
