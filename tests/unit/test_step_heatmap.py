"""The rank x step heatmap of step time (above 8 ranks), and the sidebar's many-ranks summary."""

from __future__ import annotations

import json

import numpy as np

from nbdist.dashboard.heatmap import COLUMNS, StepHeat
from nbdist.dashboard.model import DashboardModel
from nbdist.metrics.run import Run
from nbdist.server.rank_summary import median_series, summarise

T0 = 1_700_000_000.0


def test_a_slow_rank_is_a_bright_row_and_each_cell_is_the_mean_of_its_bin():
    heat = StepHeat(ranks=4, columns=4)  # bins of one step until step 8
    for rank in range(4):
        heat.add(rank, range(8), [0.2 if rank == 2 else 0.1] * 8)
    msg = heat.message()
    assert msg["x"] == list(range(8)) and msg["y"] == [0, 1, 2, 3] and msg["width"] == 1
    assert msg["z"][2] == [200.0] * 8 and msg["z"][0] == [100.0] * 8
    heat.add(0, [8, 9], [0.3, 0.5])  # past 2 * columns bins: pairs merge, each spans 2 steps
    msg = heat.message()
    assert msg["width"] == 2 and msg["x"] == [0, 2, 4, 6, 8]
    assert msg["z"][0] == [100.0] * 4 + [400.0]  # (0.3 + 0.5) / 2
    assert msg["z"][1][4] is None  # rank 1 has no point there


def test_256_ranks_by_100k_steps_stay_a_readable_grid():
    heat = StepHeat(ranks=256)
    steps = np.arange(100_000)
    for rank in range(256):
        heat.add(rank, steps[::50], np.full(2000, 0.9 if rank == 201 else 0.1))
    msg = heat.message()
    assert len(msg["z"]) == 256 and COLUMNS <= len(msg["x"]) <= 2 * COLUMNS
    assert all(len(row) == len(msg["x"]) for row in msg["z"])
    slowest = max(range(256), key=lambda r: np.nanmean(np.array(msg["z"][r], dtype=float)))
    assert slowest == 201
    assert len(json.dumps(msg)) < 300_000  # sent whole every ~2 s at most


def test_the_dashboard_sends_the_heatmap_above_8_ranks_only():
    for ranks, has in ((8, False), (16, True)):
        run = Run(1, world_size=ranks, started=T0)
        for rank in range(ranks):
            dt = 0.3 if rank == 5 else 0.1
            run.add(rank, [(s, T0 + s * dt, {"loss": 1.0, "step_time": dt}) for s in range(20)])
        model = DashboardModel(run, clock=lambda: T0 + 10)
        model.poll()
        msg = model.heatmap()
        assert (msg is not None) == has
        if has:
            assert msg["z"][5][-1] == 300.0 and msg["z"][4][-1] == 100.0
            assert model.heatmap() is None  # unchanged: not sent again
            assert model.snapshot()["heatmap"]["z"] == msg["z"]  # a new view starts with it


def _row(rank, state="busy", straggler="", host="a", step=10, rate=100.0, seen=T0):
    return {
        "rank": rank,
        "host": host,
        "state": state,
        "straggler": straggler,
        "step": step,
        "samples_per_s": rate,
        "last_seen": seen,
        "loss_series": [[s, 1.0 + rank] for s in range(3)],
    }


def test_the_sidebar_summary_counts_by_host_and_lists_dead_stragglers_and_the_odd_state_out():
    rows = [_row(r, host="a" if r < 8 else "b") for r in range(16)]
    rows[3] = _row(3, state="dead", host="a")
    rows[11] = _row(11, straggler="2.0× step time", host="b", step=7)
    rows[12] = _row(12, state="idle", host="b", seen=T0 - 60)
    summary = summarise(rows, now=T0 + 1)
    assert summary["states"] == {"busy": 14, "idle": 1, "dead": 1}
    assert [(h["host"], h["ranks"], h["states"]) for h in summary["hosts"]] == [
        ("a", 8, {"busy": 7, "dead": 1}),
        ("b", 8, {"busy": 7, "idle": 1}),
    ]
    assert summary["hosts"][1]["step_min"] == 7 and summary["hosts"][1]["step_max"] == 10
    assert summary["hosts"][1]["samples_per_s"] == 700.0  # the idle rank's old rate left out
    assert [(d["rank"], d["why"]) for d in summary["deviating"]] == [
        (3, "dead"),
        (11, "straggler: 2.0× step time"),
        (12, "idle while the others are busy"),
    ]


def test_the_median_line_waits_for_most_ranks_at_a_step():
    series = [[[0, 1.0], [1, 1.0]], [[0, 3.0], [1, 5.0]], [[0, 2.0]], [[0, 9.0]]]
    assert median_series(series) == [[0.0, 2.5], [1.0, 3.0]]
    assert median_series([[[0, 1.0]], [[0, 2.0]], [[0, 3.0]], [[0, 4.0], [1, 7.0]]]) == [[0.0, 2.5]]
