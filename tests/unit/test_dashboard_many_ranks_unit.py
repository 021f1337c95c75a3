"""The dashboard above 8 ranks: the median with a min-max band, and only the deviating ranks drawn."""

from __future__ import annotations

import numpy as np
import pytest

from nbdist.dashboard.model import DashboardModel
from nbdist.dashboard.table import SHOWN_RANKS
from nbdist.metrics.run import Run
from nbdist.rank_states import HeldState
from tests.unit.widget_store import WidgetStore

T0 = 1_700_000_000.0
RANKS = 64


def _loss(rank, step):
    return 1.0 / (step + 1) + 0.001 * rank + (5.0 if rank == 40 else 0.0)


def _fill(run, steps, *, slow=13):
    for rank in range(RANKS):
        dt = 0.2 if rank == slow else 0.1
        scalars = {"samples": 64.0, "step_time": dt, "samples_per_s": 64.0 / dt}
        points = [(s, T0 + 1 + s * dt, {"loss": _loss(rank, s), **scalars}) for s in steps]
        run.add(rank, points)


def test_many_ranks_draw_the_median_band_and_the_deviating_ranks_only():
    run = Run(1, world_size=RANKS, started=T0)
    _fill(run, range(40))
    model = DashboardModel(run, clock=lambda: T0 + 60)
    model.poll()
    figure = model.figure_data()
    loss = figure["loss"]
    # The straggler first, then the rank whose loss is far from the others'.
    assert list(loss) == ["median", "min", "max", "rank 13", "rank 40"]
    assert list(figure["samples_per_s"]) == ["rank 13", "rank 40", "total"]
    legend = {name for traces in figure.values() for name in traces}
    assert len(legend) <= 12, legend
    values = np.array([[_loss(r, s) for r in range(RANKS)] for s in range(40)])
    steps, median = loss["median"]
    assert steps == list(range(40))
    np.testing.assert_allclose(median, np.median(values, axis=1))
    np.testing.assert_allclose(loss["min"][1], values.min(axis=1))
    np.testing.assert_allclose(loss["max"][1], values.max(axis=1))
    assert loss["rank 40"][1] == pytest.approx([_loss(40, s) for s in range(40)])


def test_the_browser_follows_when_other_ranks_start_to_deviate():
    now = [T0 + 3.0]
    run = Run(1, world_size=RANKS, started=T0)
    _fill(run, range(20), slow=None)
    model = DashboardModel(run, clock=lambda: now[0])
    model.poll()
    browser = WidgetStore(model.snapshot())
    assert [n for n in browser.traces()["loss"] if n.startswith("rank")] == ["rank 40"]
    now[0] = T0 + 8.0
    _fill(run, range(20, 40), slow=13)  # rank 13 now takes twice as long a step
    delta, _ = model.poll()
    browser.receive(delta)
    assert "respec" in delta
    assert browser.traces() == {
        key: {name: (xs, [None if y != y else y for y in ys]) for name, (xs, ys) in traces.items()}
        for key, traces in model.figure_data().items()
    }
    assert "rank 13" in browser.traces()["loss"]
    assert len([n for n in browser.traces()["loss"] if n.startswith("rank")]) <= SHOWN_RANKS


def test_eight_ranks_keep_a_line_each():
    run = Run(1, world_size=8, started=T0)
    run.add(0, [(0, T0 + 1, {"loss": 1.0})])
    for rank in range(1, 8):
        run.add(rank, [(0, T0 + 1, {"loss": 1.0 + rank})])
    model = DashboardModel(run, clock=lambda: T0 + 60)
    model.poll()
    assert list(model.figure_data()["loss"]) == [f"rank {r}" for r in range(8)] + ["mean"]


@pytest.mark.parametrize("ranks", [4, RANKS])
def test_a_rank_slower_to_send_than_the_others_to_step_adds_no_second_point(ranks):
    """Ranks reaching the kernel up to 3 s late (32+ ranks on 2 cores): each step once."""
    rng = np.random.default_rng(1)
    lag = rng.uniform(0.0, 3.0, ranks)
    run = Run(1, world_size=ranks, started=T0)
    now = [T0]
    model = DashboardModel(run, clock=lambda: now[0])
    sent = [0] * ranks
    for tick in range(80):
        now[0] = T0 + 0.1 * tick
        for rank in range(ranks):
            points = []
            while sent[rank] < 60 and 0.05 + 0.02 * sent[rank] <= 0.1 * tick - lag[rank]:
                s = sent[rank]
                points.append((s, T0 + 0.05 + 0.02 * s, {"loss": 1.0 / (1 + s)}))
                sent[rank] += 1
            if points:
                run.add(rank, points)
        model.poll()
    aggregate = "median" if ranks > 8 else "mean"
    steps = model.figure_data()["loss"][aggregate][0]
    assert steps == sorted(set(steps)), "a step drawn twice: the line would turn back"


def test_the_table_lists_the_deviating_ranks_then_a_row_per_host():
    run = Run(1, world_size=RANKS, started=T0)
    run.hosts = {r: f"node{r // 32}" for r in range(RANKS)}
    _fill(run, range(40))
    model = DashboardModel(run, clock=lambda: T0 + 60, states=lambda: {50: "dead"})
    model.poll()
    rows = model.table["rows"]
    assert [r["cells"][0] for r in rows] == [
        "13 · node0",
        "50 · node1",
        "node0: 32 ranks",
        "node1: 32 ranks",
    ]
    assert rows[0]["flag"] and rows[1]["state"] == "dead"
    assert rows[2]["cells"][-2] == "32 idle" and rows[3]["cells"][-2] == "31 idle · 1 dead"


def test_a_rank_held_by_a_debugger_is_listed_and_drawn_on_its_own():
    # Held, rank 50 stops logging; until the others are steps past it, only its state says so.
    run = Run(1, world_size=RANKS, started=T0)
    run.hosts = {r: f"node{r // 32}" for r in range(RANKS)}
    _fill(run, range(40), slow=None)
    held = HeldState("busy", "held by a debugger")
    model = DashboardModel(run, clock=lambda: T0 + 5, states=lambda: {50: held})
    model.poll()
    rows = model.table["rows"]
    assert [r["cells"][0] for r in rows[:1]] == ["50 · node1"], rows
    assert rows[0]["cells"][-2] == "busy · held by a debugger"
    assert "rank 50" in model.figure_data()["loss"]
    # Its host's row counts it busy, as its own row does, and held beside that.
    hosts = {r["cells"][0]: r["cells"][-2] for r in rows if r["state"] == "host"}
    assert hosts == {
        "node0: 32 ranks": "32 busy",
        "node1: 32 ranks": "32 busy (1 held by a debugger)",
    }
