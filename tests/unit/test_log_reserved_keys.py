"""``time`` and ``rank`` are every point's own: nbdist.log leaves a value logged under either
out of the point and tells the user, as it does a value that is no number.

A real rank-side channel sends to a real collector in this process (as in
tests/unit/test_log_batching.py).
"""

from __future__ import annotations

from nbdist.dashboard.losses import loss_lines
from nbdist.metrics import log as metrics_log


def test_a_value_logged_as_time_or_rank_keeps_the_points_own_and_is_told(channel):
    run, collector = channel
    for step in range(3):
        metrics_log.log(step=step, loss=1.0, time=100.0 + step, rank=7)
    total = metrics_log.end_of_cell()
    assert collector.wait_for_points({0: total}, timeout=30)

    # The point's own time (when it was logged) and rank, not the values logged.
    own_times = run.timeline("loss", 0)[0]
    assert run.last(0)["time"] == own_times[-1] != 102.0
    assert [row["rank"] for row in run.rows()] == [0, 0, 0]
    assert [row["time"] for row in run.rows()] == own_times
    assert "time" not in run.keys() and "rank" not in run.keys()
    frame = run.to_pandas()  # raised "cannot assemble with duplicate keys"
    assert list(frame["step"]) == [0, 1, 2] and list(frame["rank"]) == [0, 0, 0]

    # Told once per key, with the name to log it under instead.
    assert set(run.left_out) == {"time", "rank"}
    rank, what = run.left_out["time"]
    assert rank == 0 and "102.0" not in what and "'time'" in what and "elapsed_s" in what
    lines = loss_lines(run)
    assert any(line.startswith("'time' left out") and "elapsed_s" in line for line in lines)
    assert any(line.startswith("'rank' left out") and "rank_id" in line for line in lines)
    assert not any("log a Python number" in line for line in lines)  # it was a number
    assert metrics_log.dropped() == 0


def test_a_value_logged_under_a_name_nbdist_works_out_is_left_out_on_every_point(channel):
    # step_time was replaced by nbdist's own where it had one and kept on a rank's first
    # point (no step time there): one column of two meanings.
    run, collector = channel
    for step in range(3):
        metrics_log.log(step=step, loss=1.0, step_time=99.0, samples=8, samples_per_s=-1.0)
    total = metrics_log.end_of_cell()
    assert collector.wait_for_points({0: total}, timeout=30)

    rows = run.rows()
    assert [row.get("step_time") for row in rows][0] is None  # the first point has none
    times = [row["time"] for row in rows]
    for before, row in zip(times, rows[1:]):
        assert row["step_time"] == row["time"] - before != 99.0
        assert row["samples_per_s"] == 8 / row["step_time"]
    assert set(run.left_out) == {"step_time", "samples_per_s"}
    lines = loss_lines(run)
    assert any(line.startswith("'step_time' left out") and "my_step_time" in line for line in lines)


def test_every_key_nbdist_works_out_is_refused_and_data_time_is_kept(channel):
    # The kernel shows DERIVED_KEYS as nbdist's own; each must be refused on the rank too,
    # or a user's value would stand in the column of nbdist's on some points.
    from nbdist.metrics.point_keys import DERIVED_KEYS

    run, collector = channel
    worked_out = [key for key in DERIVED_KEYS if key != "data_time"]
    logged = dict.fromkeys(worked_out, -3.0)
    for step in range(2):
        metrics_log.log(step=step, loss=1.0, data_time=0.0, **logged)
    total = metrics_log.end_of_cell()
    assert collector.wait_for_points({0: total}, timeout=30)

    assert set(run.left_out) == set(worked_out)
    assert all(row["data_time"] == 0.0 for row in run.rows())  # the user's own, kept
    assert not any(row.get(key) == -3.0 for row in run.rows() for key in worked_out)
