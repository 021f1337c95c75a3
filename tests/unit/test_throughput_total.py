"""The dashboard's total throughput is the sum of the ranks' rates at each moment: flat for steady ranks."""

from __future__ import annotations

import random

import pytest

from nbdist.dashboard.model import DashboardModel
from nbdist.dashboard.traces import RateTotal
from nbdist.metrics.run import Run

T0 = 1_700_000_000.0


def _steady_run(n, *, step_s, rate, end_s, lag_s, seed=1):
    """Ranks stepping at ``rate`` samples/s, each sending with its own delay; the total's trace."""
    rng = random.Random(seed)
    run = Run(1, world_size=n, started=T0)
    now = [T0]
    model = DashboardModel(run, clock=lambda: now[0])
    phase = {r: rng.uniform(0, step_s) for r in range(n)}
    lag = {r: rng.uniform(0, lag_s) for r in range(n)}
    sent = dict.fromkeys(range(n), 0)
    t = 0.0
    while t < end_s + lag_s + 3:
        now[0] = T0 + t
        for r in range(n):
            points = []
            while True:
                when = 0.05 + phase[r] + sent[r] * step_s
                if when > end_s or when > t - lag[r]:
                    break
                scalars = {"samples": rate * step_s, "step_time": step_s, "samples_per_s": rate}
                points.append((sent[r], T0 + when, scalars))
                sent[r] += 1
            if points:
                run.add(r, points)
        model.poll()
        t += 0.25
    return model.figure_data()["samples_per_s"]["total"]


@pytest.mark.parametrize("lag_s", [0.5, 3.0])  # 3 s: some ranks send later than the others stop
def test_steady_ranks_give_a_flat_total_to_the_end(lag_s):
    xs, total = _steady_run(32, step_s=0.1, rate=640.0, end_s=10.0, lag_s=lag_s)
    assert xs == [float(s) for s in range(1, 11)], "one point per second, none twice"
    assert total == pytest.approx([32 * 640.0] * 10)


def test_steps_longer_than_a_bin_still_count_in_every_bin():
    xs, total = _steady_run(4, step_s=2.5, rate=100.0, end_s=20.0, lag_s=0.2)
    # Every second while all four ranks step (their first and last steps end 2.5 s apart).
    assert total[2:-2] == pytest.approx([400.0] * (len(total) - 4))


def test_a_rank_that_stops_early_leaves_the_total():
    total = RateTotal()
    for rank in range(4):
        stop = 5.0 if rank == 3 else 10.0
        xs = [0.05 + 0.1 * i for i in range(100) if 0.05 + 0.1 * i <= stop]
        total.add(rank, [], xs, [10.0] * len(xs))
    xs, values, whole = total.ready(float("inf"))
    assert not whole
    assert values[:4] == pytest.approx([40.0] * 4)
    assert values[5:] == pytest.approx([30.0] * (len(values) - 5))
