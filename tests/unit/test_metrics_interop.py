"""A run's points leave nbdist for other trackers: TensorBoard event files, and a callback."""

from __future__ import annotations

import math
import threading
import time

import numpy as np
import pytest

from nbdist.metrics.run import Run


def _run() -> Run:
    run = Run(7, world_size=2)
    for rank in (0, 1):
        run.add(
            rank,
            [
                (
                    step,
                    1000.0 + step,
                    {"loss": 1.0 / (step + 1 + rank), "samples_per_s": 64.0 * step},
                )
                for step in range(200)
            ],
        )
    run.add(1, [(200, 1300.0, {"loss": math.nan})])
    return run


def test_to_tensorboard_writes_one_tag_per_series_and_rank_read_back_by_tensorboard(tmp_path):
    pytest.importorskip("tensorboard", reason="pip install tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = _run()
    written = run.to_tensorboard(tmp_path / "tb")
    assert written == [str(tmp_path / "tb" / "rank0"), str(tmp_path / "tb" / "rank1")]
    for rank in (0, 1):
        events = EventAccumulator(written[rank], size_guidance={"scalars": 0})
        events.Reload()
        assert sorted(events.Tags()["scalars"]) == ["loss", "samples_per_s"]
        for key in ("loss", "samples_per_s"):
            steps, values = run.series(key, rank)
            times = run.timeline(key, rank)[0]
            read = events.Scalars(key)
            assert [e.step for e in read] == steps
            assert [e.wall_time for e in read] == times
            # TensorBoard keeps scalars as 32-bit floats: exact at that precision, NaN kept.
            np.testing.assert_array_equal(
                np.array([e.value for e in read], dtype=np.float32),
                np.array(values, dtype=np.float32),
            )
    assert math.isnan(EventAccumulator(written[1]).Reload().Scalars("loss")[-1].value)


def test_to_tensorboard_with_chosen_keys_and_a_clear_error_for_a_bad_one(tmp_path):
    pytest.importorskip("tensorboard", reason="pip install tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    written = _run().to_tensorboard(tmp_path, keys=["loss"])
    events = EventAccumulator(written[0])
    events.Reload()
    assert events.Tags()["scalars"] == ["loss"]
    with pytest.raises(TypeError, match=r"keys must be series names.*\[3\]"):
        _run().to_tensorboard(tmp_path / "x", keys=["loss", 3])


def test_forward_hands_every_point_to_the_callback_without_holding_up_the_adder():
    run = Run(1, world_size=2)
    got, release = [], threading.Event()

    def tracker(point):  # a slow tracker: waits until released
        release.wait()
        got.append(point)

    forwarder = run.forward(tracker, ranks=[1])
    started = time.monotonic()
    for rank in (0, 1):
        run.add(rank, [[s, 10.0 + s, {"loss": float(s)}] for s in range(500)])
    # The collector's thread only queued the points: it was not held up by the tracker.
    assert time.monotonic() - started < 5
    assert got == []
    release.set()
    assert forwarder.wait(timeout=30)
    assert [(p.rank, p.step, p.time, p.values) for p in got] == [
        (1, s, 10.0 + s, {"loss": float(s)}) for s in range(500)
    ]
    forwarder.close()
    run.add(1, [[999, 0.0, {"loss": 0.0}]])
    assert len(got) == 500  # closed: no more points


def test_a_callback_that_raises_is_counted_and_forwarding_goes_on():
    run = Run(1, world_size=1)
    seen = []

    def flaky(point):
        if point.step == 1:
            raise ValueError("tracker offline")
        seen.append(point.step)

    with pytest.warns(UserWarning, match="tracker offline"):
        with run.forward(flaky) as forwarder:
            run.add(0, [[s, 0.0, {"loss": 1.0}] for s in range(3)])
            assert forwarder.wait(timeout=30)
    assert seen == [0, 2]
    assert forwarder.errors == 1 and isinstance(forwarder.error, ValueError)
    with pytest.raises(TypeError, match="callback must be callable"):
        run.forward("wandb")
