"""The dashboard when a rank's loss turns NaN/inf, a rank never logs, or the steps go back.

What a user sees: the lines the browser draws (snapshot and deltas through JSON, as
widget.js gets them), the table's rows, the header, and the text summary.
"""

from __future__ import annotations

import math

import pytest

from nbdist.dashboard.header import header
from nbdist.dashboard.model import DashboardModel
from nbdist.dashboard.table import host_row, pick_shown, rank_rows
from nbdist.dashboard.text import summary_text
from nbdist.metrics.run import Run
from tests.unit.widget_store import WidgetStore, segments

T0 = 1_700_000_000.0
NOW = T0 + 200.0  # every rank quiet: all is final


def _diverged(world=16, *, broken=3, silent=9, slow=None):
    """``world`` ranks logging 30 steps; ``broken``'s loss NaN from step 10 on, ``silent``
    never logs, ``slow`` takes 3x as long per step."""
    run = Run(1, world_size=world, started=T0)
    for k in range(world):
        if k == silent:
            continue
        dt = 3.0 if k == slow else 1.0
        run.add(
            k,
            [
                (
                    s,
                    T0 + s * dt,
                    {
                        "loss": math.nan if k == broken and s >= 10 else 1.0 / (s + 1),
                        "step_time": dt,
                    },
                )
                for s in range(30)
            ],
        )
    return run


# -- 1. a diverged rank and a silent rank above 8 ranks ------------------------------------------


def test_a_rank_whose_loss_went_nan_is_drawn_on_its_own_among_16_ranks():
    model = DashboardModel(_diverged(), clock=lambda: NOW)
    browser = WidgetStore(model.snapshot())
    browser.receive(model.poll()[0])
    loss = browser.traces()["loss"]
    # The band leaves NaN out, so without its own line the diverged rank would not show at all.
    assert list(loss) == ["median", "min", "max", "rank 3"]
    xs, ys = loss["rank 3"]
    assert xs == list(range(30)) and ys[:10] == [1.0 / (s + 1) for s in range(10)]
    assert ys[10:] == [None] * 20  # where it went NaN


def test_a_diverged_rank_comes_after_stragglers_and_before_far_values():
    lasts = [(1.0 + 0.01 * r, r) for r in range(12)] + [(50.0, 12), (math.inf, 13), (math.nan, 14)]
    assert pick_shown([7], [2], lasts) == [7, 2, 13, 14]
    assert pick_shown([], [], lasts) == [13, 14, 12]
    # When most ranks diverged, the few finite ones are not made outliers by it: no rank is.
    assert pick_shown([], [], [(math.nan, r) for r in range(10)] + [(1.0, 10), (1.0, 11)]) == []


def test_the_table_lists_the_diverged_and_the_silent_rank_and_why():
    model = DashboardModel(_diverged(), clock=lambda: NOW)
    _, table = model.poll()
    odd = {row["cells"][0]: row["cells"][-1] for row in table["rows"] if row["state"] != "host"}
    assert odd == {"3": "⚠ loss nan", "9": "⚠ no points logged"}
    # The header says how many the band left out.
    assert table["header"]["nonfinite"] == "loss NaN/inf on 1 rank (3): left out of the band"


def test_the_text_summary_of_16_ranks_names_the_diverged_and_silent_ranks():
    text = summary_text(_diverged(), now=NOW)
    assert "2 ranks deviating (dead, stopped or held, straggling, busy while " in text
    rows = {line.split()[0]: line for line in text.splitlines() if line.startswith("   ")}
    assert rows["3"].endswith("⚠ loss nan")
    assert rows["9"].endswith("⚠ no points logged")
    series = {line.split()[0]: line.split()[1:] for line in text.splitlines()[-4:]}
    assert series["loss"][0] == "nan"  # rank 3's latest loss is NaN: the mean of the latest is
    assert text.splitlines()[-1] == (
        "loss: latest value NaN/inf on 1 of 15 ranks (rank 3); mean, min and max leave NaN/inf out"
    )


def test_a_straggler_still_comes_first_and_the_diverged_rank_next():
    model = DashboardModel(_diverged(slow=5, silent=None), clock=lambda: NOW)
    model.poll()
    assert list(model.figure_data()["loss"]) == ["median", "min", "max", "rank 3", "rank 5"]
    # Drawn in rank order; chosen straggler first: with one slot left the NaN rank still shows.
    assert pick_shown([5, 6, 7], [], [(math.nan, 3)] + [(1.0, r) for r in range(8, 16)]) == [
        5,
        6,
        7,
        3,
    ]


def test_a_rank_not_logged_yet_while_the_others_start_is_not_flagged():
    run = Run(1, world_size=12, started=T0)
    for k in range(11):  # rank 11 starts a moment later: others have 3 points, not a lag yet
        run.add(k, [(s, T0 + s, {"loss": 1.0}) for s in range(3)])
    assert [row.note for row in rank_rows(run, now=T0 + 3)] == [""] * 12


# -- 2. the text summary's "last" after every rank diverged ---------------------------------------


def test_the_summary_last_loss_is_nan_when_every_rank_diverged():
    run = Run(2, world_size=2, started=T0)
    for k in range(2):
        run.add(
            k, [(s, T0 + s, {"loss": 1.0 / (s + 1) if s < 20 else math.nan}) for s in range(30)]
        )
    lines = summary_text(run, now=NOW).splitlines()
    assert lines[-2].split() == ["loss", "nan", "0.1799", "0.05", "1"]
    assert lines[-1] == (
        "loss: latest value NaN/inf on 2 of 2 ranks (ranks 0, 1); mean, min and max leave NaN/inf out"
    )
    # Both diverged: neither is an outlier of the other, so neither row is flagged.
    assert [row.note for row in rank_rows(run, now=NOW)] == ["", ""]


def test_the_summary_last_is_inf_when_a_rank_is_and_a_finite_run_has_no_such_line():
    run = Run(3, world_size=2, started=T0)
    run.add(0, [(0, T0, {"loss": 1.0}), (1, T0 + 1, {"loss": math.inf})])
    run.add(1, [(0, T0, {"loss": 1.0}), (1, T0 + 1, {"loss": 0.5})])
    lines = summary_text(run, now=NOW).splitlines()
    assert lines[-2].split() == ["loss", "inf", "0.8333", "0.5", "1"]
    assert lines[-1].startswith("loss: latest value NaN/inf on 1 of 2 ranks (rank 0)")
    run.add(0, [(2, T0 + 2, {"loss": 0.25})])
    assert "NaN/inf" not in summary_text(run, now=NOW)


# -- 3. a loop run again: no line drawn from the last step back to the first -------------------


def _no_line_back(xs, ys):
    """Every line Plotly draws of this trace goes forward in step."""
    for line in segments(xs, ys):
        steps = [x for x, _ in line]
        assert steps == sorted(steps), line


@pytest.mark.parametrize("world", [2, 12], ids=["per rank", "many ranks (band)"])
def test_a_loop_run_again_starts_a_new_line_instead_of_one_drawn_back(world):
    clock = [T0]
    run = Run(1, world_size=world, started=T0)
    model = DashboardModel(run, clock=lambda: clock[0])
    browser = WidgetStore(model.snapshot())
    for k in range(world):
        run.add(k, [(s, T0 + s, {"loss": 10.0 + s + (40.0 if k == 1 else 0.0)}) for s in range(5)])
    clock[0] = T0 + 20
    browser.receive(model.poll()[0])
    for k in range(world):  # the same loop again, other values
        run.add(
            k, [(s, T0 + 30 + s, {"loss": 1.0 + s + (40.0 if k == 1 else 0.0)}) for s in range(5)]
        )
    clock[0] = T0 + 60
    browser.receive(model.poll()[0])
    loss = browser.traces()["loss"]
    aggregate = ["mean"] if world == 2 else ["median", "min", "max"]
    assert set(aggregate) | {"rank 1"} <= set(loss)
    for name in [*aggregate, "rank 1"]:
        _no_line_back(*loss[name])
    # Both passes are there, each its own line.
    assert [[x for x, _ in line] for line in segments(*loss["rank 1"])] == [list(range(5))] * 2
    assert [y for _, y in segments(*loss["rank 1"])[1]] == [41.0 + s for s in range(5)]
    # The kernel's figure says the same as the browser holds.
    assert model.figure_data()["loss"]["rank 1"][0] == list(loss["rank 1"][0])


def test_a_long_history_run_again_keeps_its_gaps_through_decimation():
    run = Run(1, world_size=1, started=T0)
    model = DashboardModel(run, budget=16, clock=lambda: NOW)
    browser = WidgetStore(model.snapshot())
    for rerun in range(3):
        run.add(0, [(s, T0 + 100 * rerun + s, {"loss": float(s % 7) + rerun}) for s in range(40)])
        browser.receive(model.poll()[0])
    xs, ys = browser.traces()["loss"]["rank 0"]
    assert len(xs) <= 16
    lines = segments(xs, ys)
    assert len(lines) == 3
    _no_line_back(xs, ys)


# -- 4. counts in words ----------------------------------------------------------------------


def test_one_rank_and_one_point_are_not_plural():
    run = Run(4, world_size=1, started=T0)
    run.add(0, [(0, T0, {"loss": 0.7})])
    assert summary_text(run, now=NOW).splitlines()[0] == "run 4 · 1 rank · 1 point"
    model = DashboardModel(run, clock=lambda: NOW)
    _, table = model.poll()
    assert table["header"]["detail"] == "1 rank"
    assert header(run, model.rows)["points"] == 1
    rows = rank_rows(run, now=NOW)
    assert host_row("node-b", rows, NOW, gpu=False, flops=False)[0] == "node-b: 1 rank"
    run.add(0, [(1, T0 + 1, {"loss": 0.6})])
    assert summary_text(run, now=NOW).splitlines()[0] == "run 4 · 1 rank · 2 points"
