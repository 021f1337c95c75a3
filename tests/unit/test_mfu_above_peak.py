"""An MFU above 1 (a step faster than the peak it is divided by: mixed precision measured
against the float32 peak, or flops= counting too much) is told under the dashboard with
the fix, once; an MFU within the peak says nothing.

A real rank-side channel sends to a real collector in this process (as in
tests/unit/test_log_batching.py); the figures are nbdist's own, worked out from flops=.
"""

from __future__ import annotations

import time

from nbdist.dashboard.model import DashboardModel
from nbdist.dashboard.text import summary_text
from nbdist.metrics import log as metrics_log
from nbdist.metrics.store import RunStore, load_run

FLOPS = 1e12  # a step's FLOPs as the user counted them


def _steps(channel, peak_tflops: float) -> None:
    run, collector = channel
    for step in range(4):
        metrics_log.log(step=step, loss=1.0, flops=FLOPS, peak_tflops=peak_tflops)
        time.sleep(0.01)  # a step time of about 10 ms: about 100 TFLOP/s
    total = metrics_log.end_of_cell()
    assert collector.wait_for_points({0: total}, timeout=30)


def test_an_mfu_above_1_is_told_with_the_fix_in_both_dashboards(channel):
    run, _ = channel
    _steps(channel, peak_tflops=1.0)  # a peak far below the ~100 TFLOP/s the steps show
    mfu = run.series("mfu", 0)[1]
    assert len(mfu) == 3 and min(mfu) > 1  # the first point has no step time
    (line,) = [x for x in summary_text(run).splitlines() if x.startswith("mfu above 1")]
    # The highest of the rank's latest batch (the steps may have gone in one flush or two).
    assert any(f"({v:.3g} on rank 0, latest steps)" in line for v in mfu), line
    assert "set_peak(dtype=torch.bfloat16)" in line and "flops=" in line
    model = DashboardModel(run)
    model.poll()
    assert line in model.table["lost"]  # the widget's lines under its table


def test_an_mfu_above_1_in_the_history_is_told_when_the_run_is_read_back(channel, tmp_path):
    run, _ = channel
    _steps(channel, peak_tflops=1.0)
    store = RunStore(str(tmp_path / "h.sqlite"))
    stored = store.new_run(world_size=1)
    store.append(
        stored.id, 0, [[row["step"], row["time"], {"mfu": row["mfu"]}] for row in run.rows()[1:]]
    )
    store.close()
    loaded = load_run(stored.id, path=store.path)
    assert loaded.mfu_above_1 == run.mfu_above_1
    assert any(x.startswith("mfu above 1") for x in summary_text(loaded).splitlines())


def test_an_mfu_within_the_peak_says_nothing(channel):
    run, _ = channel
    _steps(channel, peak_tflops=1e9)
    assert 0 < max(run.series("mfu", 0)[1]) < 1
    assert not any("mfu above" in x for x in summary_text(run).splitlines())


def test_the_note_goes_once_the_latest_steps_are_within_the_peak(channel):
    # The user read the note and set the right peak: the next steps' MFU is below 1.
    run, _ = channel
    _steps(channel, peak_tflops=1.0)
    assert run.mfu_above_1 is not None
    _steps(channel, peak_tflops=1e9)
    assert run.mfu_above_1 is None
    assert not any("mfu above" in x for x in summary_text(run).splitlines())


def test_a_point_whose_mfu_is_no_number_is_kept_without_a_note():
    from nbdist.metrics.run import Run

    run = Run(1, world_size=1)
    assert run.add(0, [(0, 1.0, {"mfu": None}), (1, 2.0, {"mfu": float("nan")})]) == 2
    assert run.mfu_above_1 is None
