"""The dashboard's throughput-over-time chart draws no line across the idle time between two
cells: a silence over ``_HOLD_S`` (which :class:`RateTotal` already counts as a pause) is a
gap, a null the browser gets, in each rank's line and in the total, kept through decimation.

What a user sees: the traces widget.js holds (snapshot and deltas through JSON).
"""

from __future__ import annotations

import pytest

from nbdist.dashboard.model import DashboardModel
from nbdist.dashboard.traces import _HOLD_S
from nbdist.metrics.run import Run
from tests.unit.widget_store import WidgetStore, segments

T0 = 1_700_000_000.0
IDLE_S = 60.0


def lines(xs, ys):
    """The x values of each line Plotly draws of one trace."""
    return [[x for x, _ in line] for line in segments(xs, ys)]


def _two_cells(world: int, budget: int = 2000, cells: int = 2):
    """``world`` ranks each running ``cells`` cells of 20 steps (0.5 s each) with
    ``IDLE_S`` idle between them; the browser's view after polling along."""
    run = Run(1, world_size=world, started=T0)
    now = [T0]
    model = DashboardModel(run, budget=budget, clock=lambda: now[0])
    browser = WidgetStore(model.snapshot())
    for cell in range(cells):
        start = cell * (10.0 + IDLE_S)
        for i in range(20):
            step = cell * 20 + i
            t = start + 0.5 * (i + 1)
            for rank in range(world):
                run.add(rank, [(step, T0 + t, {"samples_per_s": 100.0, "step_time": 0.5})])
            now[0] = T0 + t
            browser.receive(model.poll()[0])
        now[0] = T0 + start + 10.0 + IDLE_S / 2  # the ranks idle: everything is final
        browser.receive(model.poll()[0])
    return browser.traces("samples_per_s")


@pytest.mark.parametrize("world", [2, 12])  # a line per rank and the total; the total above 8
def test_no_line_is_drawn_across_the_idle_time_between_cells(world):
    traces = _two_cells(world)
    assert "total" in traces
    for name, (xs, ys) in traces.items():
        drawn = lines(xs, ys)
        assert len(drawn) == 2, f"{name}: {len(drawn)} lines"
        first, second = drawn
        assert first[-1] <= 10.0 + 1 and second[0] >= 10.0 + IDLE_S, name
        # Within a cell the points are at most a step (or a bin) apart: no gap there.
        assert all(b - a <= _HOLD_S for line in drawn for a, b in zip(line, line[1:])), name


def test_the_idle_gaps_survive_decimation():
    traces = _two_cells(2, budget=16, cells=4)
    for name, (xs, ys) in traces.items():
        assert len(xs) <= 16, name
        drawn = lines(xs, ys)
        assert len(drawn) >= 2, name
        # Each line lies within one cell: none crosses the idle time between two.
        cells = {int(x // (10.0 + IDLE_S)) for line in drawn for x in (line[0], line[-1])}
        assert all(line[0] // (10.0 + IDLE_S) == line[-1] // (10.0 + IDLE_S) for line in drawn), (
            name
        )
        assert len(cells) >= 2, name
