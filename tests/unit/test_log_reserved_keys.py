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
