"""``wire.concat`` joins one rank's stored batches for ``load_run`` and a followed run: a key
on every point of every batch stays "on every point" (the run's fast path takes its values
whole), and the joined run reads exactly as the batches added one by one."""

from __future__ import annotations

from nbdist.metrics import wire
from nbdist.metrics.run import Run


def _batches():
    # Three flushes of one rank: loss on every point; step_time not on the rank's first
    # point; grad_norm only in the last flush; a constant column in the second alone.
    return [
        (
            [0, 1, 2],
            [1.0, 1.1, 1.2],
            {"loss": (None, [3.0, 2.9, 2.8]), "step_time": ([1, 2], [0.1, 0.1])},
        ),
        (
            [3, 4],
            [1.3, 1.4],
            {"loss": (None, [2.7, 2.6]), "step_time": (None, [0.1, 0.1]), "lr": (None, [0.5, 0.5])},
        ),
        (
            [5, 6],
            [1.5, 1.6],
            {
                "loss": (None, [2.5, 2.4]),
                "step_time": (None, [0.1, 0.1]),
                "grad_norm": ([1], [9.0]),
            },
        ),
    ]


def test_a_key_on_every_point_stays_so_and_the_others_get_their_points():
    steps, times, cols = wire.concat(_batches())
    assert steps == list(range(7)) and times == [1.0, 1.1, 1.2, 1.3, 1.4, 1.5, 1.6]
    assert cols["loss"] == (None, [3.0, 2.9, 2.8, 2.7, 2.6, 2.5, 2.4])
    assert cols["step_time"] == ([1, 2, 3, 4, 5, 6], [0.1] * 6)
    assert cols["lr"] == ([3, 4], [0.5, 0.5])
    assert cols["grad_norm"] == ([6], [9.0])


def test_a_joined_run_reads_as_its_batches_added_one_by_one():
    joined, one_by_one = Run(1, world_size=1), Run(2, world_size=1)
    joined.add_columns(0, *wire.concat(_batches()))
    for batch in _batches():
        one_by_one.add_columns(0, *batch)
    for key in ("loss", "step_time", "lr", "grad_norm"):
        assert joined.series(key, 0) == one_by_one.series(key, 0)
    assert joined.rows() == one_by_one.rows()


def test_a_key_gone_from_a_later_batch_keeps_its_points_on_a_run_that_goes_on():
    # A followed run (an attached named session's dashboard) adds one poll's batches onto
    # the points it has: lr on every point of the first polled batch, absent from the next.
    first = ([0], [0.9], {"lr": (None, [0.1])})
    polled = [
        ([1, 2], [1.0, 1.1], {"lr": (None, [0.2, 0.3]), "loss": (None, [2.0, 1.9])}),
        ([3, 4], [1.2, 1.3], {"loss": (None, [1.8, 1.7])}),
    ]
    last = ([5], [1.4], {"lr": (None, [0.6])})
    joined, one_by_one = Run(1, world_size=1), Run(2, world_size=1)
    joined.add_columns(0, *first)
    joined.add_columns(0, *wire.concat(polled))
    joined.add_columns(0, *last)
    for batch in (first, *polled, last):
        one_by_one.add_columns(0, *batch)
    assert (
        joined.series("lr", 0) == one_by_one.series("lr", 0) == ([0, 1, 2, 5], [0.1, 0.2, 0.3, 0.6])
    )
    assert joined.rows() == one_by_one.rows()
