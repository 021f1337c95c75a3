"""The kernel's Run holds every point of a long session: a few bytes a value, same answers."""

from __future__ import annotations

import gc
import math
import random
import tracemalloc

import pandas as pd
import pytest

from nbdist.metrics import wire
from nbdist.metrics.run import Run

RANKS, POINTS, KEYS, BATCH = 4, 20_000, 11, 100

# What a point of 11 keys on every point costs, from the representation: its step (an
# array('q'), 8 B), its time (an array('d'), 8 B) and each key's value (an array('d'),
# 8 B; a key on every point is one run of points, no index) = 8 + 8 + 11 * 8 = 104 B; a
# key that misses a cell's first point starts a run of 16 B, 0.1 B a point over cells of
# 1000 points for each of 7 keys (an index per value would be 56 B more). An array grows
# by 1/16 of its size (+ 7 items) when full: at most 104 * 17/16 = 110.5 B. The Run, each
# rank's series and each key's column are a few hundred bytes apiece, < 0.1 B a point over
# 80,000 points. 120 B leaves room for the allocator; the per-point lists of before held
# a list slot and a 24 B float per value plus an index slot per key per point (~560 B).
BYTES_PER_POINT = 120


def _batch(start: int, n: int, rng: random.Random, cell: int) -> tuple[list, list, dict]:
    """A batch as wire.columns gives it: fresh float objects, each key on every point; with
    ``cell``, the first point of every ``cell`` points lacks 7 of the keys (a cell's first
    point has no step time, nor its breakdown and throughput)."""
    steps = list(range(start, start + n))
    times = [1.7e9 + 0.1 * s for s in steps]
    columns = {f"key{j}": (None, [rng.random() for _ in range(n)]) for j in range(KEYS)}
    if cell and start % cell == 0:
        for j in range(7):
            columns[f"key{j}"] = (list(range(1, n)), columns[f"key{j}"][1][1:])
    return steps, times, columns


@pytest.mark.parametrize("cell", [0, 1000], ids=["one cell", "cells of 1000 points"])
def test_a_point_of_11_keys_costs_the_kernel_about_8_bytes_a_value(cell):
    rng = random.Random(0)
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        run = Run(1, world_size=RANKS)
        # Each batch's floats are made while tracing, as decoding a message makes them: a
        # run that kept those objects is charged for them, one that copies the numbers is not.
        for start in range(0, POINTS, BATCH):
            for rank in range(RANKS):
                run.add_columns(rank, *_batch(start, BATCH, rng, cell))
        gc.collect()
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert run.count() == RANKS * POINTS
    per_point = held / (RANKS * POINTS)
    assert per_point < BYTES_PER_POINT, f"{per_point:.1f} bytes a point"
    # Still all there, every value as it was given.
    steps, values = run.series("key3", 2, start=-2)
    assert steps == [POINTS - 2, POINTS - 1]
    assert all(type(v) is float for v in values)


# -- the same answers as before: every reader, on points of every shape -----------------------

NAN = float("nan")


def _same(got, want) -> bool:
    """Equal, and of the same types all the way down (NaN equal to NaN)."""
    if type(got) is not type(want):
        return False
    if isinstance(want, float) and math.isnan(want):
        return math.isnan(got)
    if isinstance(want, (list, tuple)):
        return len(got) == len(want) and all(_same(g, w) for g, w in zip(got, want))
    if isinstance(want, dict):
        return list(got) == list(want) and all(_same(got[k], want[k]) for k in want)
    return got == want


def _run() -> Run:
    run = Run(3, world_size=2)
    # Rank 0, as the collector adds batches: ``loss`` on every point until it misses one
    # (point 5), ``step_time`` from the rank's second point on, ``gpu_util`` now and then,
    # ``flaky`` from point 3 until it misses point 5, ``samples`` as JSON integers (a
    # history's JSON list), and a NaN.
    run.add_columns(
        0,
        [0, 1, 2],
        [10.0, 11.0, 12.0],
        {
            "loss": (None, [1.0, 0.5, NAN]),
            "step_time": ([1, 2], [0.1, 0.2]),
            "gpu_util": ([2], [50.0]),
        },
    )
    run.add_columns(
        0,
        [3, 4],
        [13.0, 14.0],
        {
            "loss": (None, [0.25, 0.125]),
            "step_time": (None, [0.3, 0.4]),
            "gpu_util": ([1], [60.0]),
            "flaky": (None, [7.0, 8.0]),
        },
    )
    run.add_columns(
        0,
        [5, 6],
        [15.0, 16.0],
        {
            "loss": ([1], [0.0625]),
            "step_time": (None, [0.5, 0.6]),
            "flaky": ([1], [9.0]),
            "samples": (None, [64, 64]),
        },
    )
    # Rank 1, point by point (Run.add): an int count, an int epoch, step 1 logged twice.
    run.add(
        1,
        [
            (0, 20.0, {"loss": 2.0, "samples": 32}),
            (1, 21.0, {"loss": 1.5, "samples": 32, "epoch": 1}),
            (1, 22.0, {"loss": 1.25}),
        ],
    )
    return run


def test_every_reader_answers_as_before_for_dense_sparse_int_and_nan_values():
    run = _run()
    expect_series = {
        # (key, rank, start): (steps, values)
        ("loss", 0, 0): ([0, 1, 2, 3, 4, 6], [1.0, 0.5, NAN, 0.25, 0.125, 0.0625]),
        ("loss", 0, 2): ([2, 3, 4, 6], [NAN, 0.25, 0.125, 0.0625]),
        ("loss", 0, -2): ([4, 6], [0.125, 0.0625]),
        ("loss", 0, -100): ([0, 1, 2, 3, 4, 6], [1.0, 0.5, NAN, 0.25, 0.125, 0.0625]),
        ("loss", 0, 10): ([], []),
        ("step_time", 0, 0): ([1, 2, 3, 4, 5, 6], [0.1, 0.2, 0.3, 0.4, 0.5, 0.6]),
        ("step_time", 0, -3): ([4, 5, 6], [0.4, 0.5, 0.6]),
        ("gpu_util", 0, 0): ([2, 4], [50.0, 60.0]),
        ("gpu_util", 0, 1): ([4], [60.0]),
        ("flaky", 0, 0): ([3, 4, 6], [7.0, 8.0, 9.0]),
        ("flaky", 0, -1): ([6], [9.0]),
        ("samples", 0, 0): ([5, 6], [64, 64]),
        ("loss", 1, 0): ([0, 1, 1], [2.0, 1.5, 1.25]),
        ("samples", 1, 0): ([0, 1], [32, 32]),
        ("epoch", 1, 0): ([1], [1]),
        ("epoch", 0, 0): ([], []),
        ("loss", 5, 0): ([], []),
    }
    for (key, rank, start), want in expect_series.items():
        assert _same(run.series(key, rank, start), want), (key, rank, start)
    expect_timeline = {
        ("loss", 0, 0): (
            [10.0, 11.0, 12.0, 13.0, 14.0, 16.0],
            [1.0, 0.5, NAN, 0.25, 0.125, 0.0625],
        ),
        ("loss", 0, -2): ([14.0, 16.0], [0.125, 0.0625]),
        ("step_time", 0, 2): ([13.0, 14.0, 15.0, 16.0], [0.3, 0.4, 0.5, 0.6]),
        ("gpu_util", 0, 0): ([12.0, 14.0], [50.0, 60.0]),
        ("flaky", 0, 1): ([14.0, 16.0], [8.0, 9.0]),
        ("samples", 0, 0): ([15.0, 16.0], [64, 64]),
        ("loss", 1, 0): ([20.0, 21.0, 22.0], [2.0, 1.5, 1.25]),
        ("epoch", 1, 0): ([21.0], [1]),
        ("loss", 5, 0): ([], []),
    }
    for (key, rank, start), want in expect_timeline.items():
        assert _same(run.timeline(key, rank, start), want), (key, rank, start)

    assert _same(
        run.last(0),
        {
            "step": 6,
            "time": 16.0,
            "loss": 0.0625,
            "step_time": 0.6,
            "gpu_util": 60.0,
            "flaky": 9.0,
            "samples": 64,
        },
    )
    assert _same(run.last(1), {"step": 1, "time": 22.0, "loss": 1.25, "samples": 32, "epoch": 1})
    assert run.last(7) == {}
    assert run.count() == 10 and run.count(0) == 7 and run.count(1) == 3
    assert run.ranks == [0, 1]
    assert run.keys() == ["loss", "flaky", "samples", "epoch", "step_time", "gpu_util"]

    rows = [
        {"rank": 0, "step": 0, "time": 10.0, "loss": 1.0},
        {"rank": 0, "step": 1, "time": 11.0, "loss": 0.5, "step_time": 0.1},
        {"rank": 0, "step": 2, "time": 12.0, "loss": NAN, "step_time": 0.2, "gpu_util": 50.0},
        {"rank": 0, "step": 3, "time": 13.0, "loss": 0.25, "step_time": 0.3, "flaky": 7.0},
        {
            "rank": 0,
            "step": 4,
            "time": 14.0,
            "loss": 0.125,
            "step_time": 0.4,
            "gpu_util": 60.0,
            "flaky": 8.0,
        },
        {"rank": 0, "step": 5, "time": 15.0, "step_time": 0.5, "samples": 64},
        {
            "rank": 0,
            "step": 6,
            "time": 16.0,
            "loss": 0.0625,
            "step_time": 0.6,
            "flaky": 9.0,
            "samples": 64,
        },
        {"rank": 1, "step": 0, "time": 20.0, "loss": 2.0, "samples": 32},
        {"rank": 1, "step": 1, "time": 21.0, "loss": 1.5, "samples": 32, "epoch": 1},
        {"rank": 1, "step": 1, "time": 22.0, "loss": 1.25},
    ]
    assert _same(run.rows(), rows)

    # to_pandas: one row per (rank, step), the last value of each column (pandas' last
    # non-missing one: rank 1's step 1 keeps samples and epoch from its first point).
    na = pd.NA
    want = pd.DataFrame(
        {
            "rank": [0, 0, 0, 0, 0, 0, 0, 1, 1],
            "step": [0, 1, 2, 3, 4, 5, 6, 0, 1],
            "time": pd.to_datetime(
                [10.0, 11.0, 12.0, 13.0, 14.0, 15.0, 16.0, 20.0, 22.0], unit="s", utc=True
            ),
            "loss": [1.0, 0.5, NAN, 0.25, 0.125, NAN, 0.0625, 2.0, 1.25],
            "flaky": [NAN, NAN, NAN, 7.0, 8.0, NAN, 9.0, NAN, NAN],
            "samples": pd.array([na, na, na, na, na, 64, 64, 32, 32], dtype="Int64"),
            "epoch": pd.array([na] * 8 + [1], dtype="Int64"),
            "step_time": [NAN, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, NAN, NAN],
            "gpu_util": [NAN, NAN, 50.0, NAN, 60.0, NAN, NAN, NAN, NAN],
        }
    )
    pd.testing.assert_frame_equal(run.to_pandas(), want)


def test_a_batch_from_the_wire_reads_back_to_the_bit():
    """A real message (base64 float64s, a constant column, a column named as another's)."""
    import numpy as np

    loss = np.array([0.1, 1 / 3, math.pi, NAN, 1e-300])
    times = np.array([1.7e9 + 0.123456789 * i for i in range(5)])
    step_time = np.array([0.2, 0.25, 0.3, 0.35])
    columns = {
        "loss": (None, loss),
        "samples": (None, np.full(5, 64.0)),  # sent as one number
        "step_time": ([1, 2, 3, 4], step_time),
        "compute_s": ([1, 2, 3, 4], step_time.copy()),  # sent as {"same": "step_time"}
        "memory_mib": (None, 812.5),
    }
    message = wire.points_message(0, [7, 8, 9, 10, 11], times, columns, 5, 0)
    assert message["cols"]["compute_s"][1] == {"same": "step_time"}
    assert message["cols"]["samples"][1] == 64.0
    more = {
        "loss": (None, np.array([0.5])),
        "samples": (None, np.array([64.0])),
        "step_time": (None, np.array([0.4])),
        "compute_s": (None, np.array([0.4])),
        "memory_mib": (None, 812.5),
    }
    run = Run(1, world_size=1)
    run.add_columns(0, *wire.columns(message))
    run.add_columns(0, *wire.columns(wire.points_message(0, [12], [1.8e9], more, 6, 0)))
    steps, values = run.series("loss", 0)
    assert steps == [7, 8, 9, 10, 11, 12]
    assert values[:3] == [0.1, 1 / 3, math.pi] and math.isnan(values[3])
    assert values[4] == 1e-300 and values[5] == 0.5
    assert run.series("samples", 0) == ([7, 8, 9, 10, 11, 12], [64.0] * 6)
    assert run.series("step_time", 0) == ([8, 9, 10, 11, 12], [0.2, 0.25, 0.3, 0.35, 0.4])
    assert run.series("compute_s", 0) == run.series("step_time", 0)
    assert run.timeline("memory_mib", 0) == (times.tolist() + [1.8e9], [812.5] * 6)


def test_values_that_are_no_float_and_steps_that_are_no_int_read_back_as_given():
    """Kept as given, as the lists of before kept them: a bool, None, a numpy float, a
    step past 64 bits, a float time (the readers see what was added)."""
    import numpy as np

    run = Run(1, world_size=1)
    run.add(0, [(0, 1.0, {"a": 1.5, "flag": True, "n": np.float64(2.5)})])
    run.add(0, [(2**64, 2, {"a": None, "flag": False, "n": 3.5})])
    run.add(0, [(3, 3.0, {"a": 2.5, "flag": 1.0, "n": 4.5})])
    assert _same(run.series("a", 0), ([0, 2**64, 3], [1.5, None, 2.5]))
    assert _same(run.series("flag", 0), ([0, 2**64, 3], [True, False, 1.0]))
    got = run.series("n", 0)[1]
    assert type(got[0]) is np.float64 and got[1:] == [3.5, 4.5]
    assert _same(run.timeline("a", 0), ([1.0, 2, 3.0], [1.5, None, 2.5]))
    assert _same(run.last(0), {"step": 3, "time": 3.0, "a": 2.5, "flag": 1.0, "n": 4.5})


def test_a_key_keeps_runs_of_points_not_an_index_per_value():
    """The representation: a run per stretch of points one after another; an index per
    value only for a key on scattered points."""
    run = Run(1, world_size=1)
    for start in range(0, 300, 100):  # three cells of 100 points: each first one has no step time
        run.add_columns(
            0,
            list(range(start, start + 100)),
            [float(s) for s in range(start, start + 100)],
            {
                "loss": (None, [1.0] * 100),
                "step_time": (list(range(1, 100)), [0.5] * 99),
                "gpu_util": (list(range(0, 100, 10)), [50.0] * 10),  # once a second
            },
        )
    columns = run._ranks[0].columns
    loss, step_time, gpu = columns["loss"], columns["step_time"], columns["gpu_util"]
    assert loss.idx is None and list(loss.starts) == [0] and list(loss.firsts) == [0]
    assert step_time.idx is None and list(step_time.firsts) == [1, 101, 201]
    assert list(step_time.starts) == [0, 99, 198]
    assert gpu.idx is not None and list(gpu.idx) == list(range(0, 300, 10))
    assert run._ranks[0].steps.itemsize == 8 and loss.vals.itemsize == 8
    steps, values = run.series("step_time", 0, start=97)  # across the runs
    assert steps[:4] == [98, 99, 101, 102] and steps[-1] == 299 and len(steps) == 297 - 97
    assert values == [0.5] * 200
    assert run.timeline("gpu_util", 0, start=-2) == ([280.0, 290.0], [50.0, 50.0])
    # A key that misses a point in the middle of a batch: two runs.
    run.add_columns(0, [300, 301, 302], [300.0, 301.0, 302.0], {"loss": ([0, 2], [2.0, 3.0])})
    assert list(loss.firsts) == [0, 302] and list(loss.starts) == [0, 301]
    assert run.series("loss", 0, start=-3) == ([299, 300, 302], [1.0, 2.0, 3.0])
    # A read leaves nothing holding the arrays: the next batch still goes in.
    run.add_columns(0, [303], [303.0], {"loss": (None, [4.0]), "gpu_util": (None, [51.0])})
    assert run.timeline("loss", 0, start=-2) == ([302.0, 303.0], [3.0, 4.0])
    assert run.series("gpu_util", 0, start=-2) == ([290, 303], [50.0, 51.0])
