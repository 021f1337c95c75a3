"""The benchmarks' statistics: when a ratio counts as settled, and nccl.py's rounds (no ranks).

bench/ is scripts, not a package: its modules are loaded from their directory as the
scripts load each other.
"""

from __future__ import annotations

import doctest
import importlib
import math
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BENCH = os.path.join(ROOT, "bench")


@pytest.fixture(scope="module")
def bench_modules():
    sys.path.insert(0, BENCH)
    try:
        yield importlib.import_module("_common"), importlib.import_module("nccl")
    finally:
        sys.path.remove(BENCH)


@pytest.fixture(scope="module")
def step_noise():
    sys.path.insert(0, BENCH)
    try:
        yield importlib.import_module("step_noise")
    finally:
        sys.path.remove(BENCH)


def _rounds(nbdist_s: list[float], torchrun_s: list[float], sizes=(1 << 20, 4 << 20)) -> dict:
    # The same per-round times at every size: what nccl.py's measuring loop fills in.
    return {
        "nbdist": {s: [t * s for t in nbdist_s] for s in sizes},
        "torchrun": {s: [t * s for t in torchrun_s] for s in sizes},
    }


def test_the_examples_in_the_statistics_docstrings_hold(bench_modules, step_noise):
    common, nccl = bench_modules
    for module in (common, nccl, step_noise):
        failed, tried = doctest.testmod(module)
        assert tried > 0 and failed == 0, module.__name__


def test_a_rate_ratio_is_the_jobs_steps_over_their_seconds_not_their_medians(bench_modules):
    """Windows of 100 steps: a job's steps/s over them is its steps over the seconds they took
    together, whatever the median window was."""
    common, _ = bench_modules
    seconds_a, seconds_b = [1.0, 1.0, 4.0], [2.0, 2.0, 2.0]
    a, b = [100 / s for s in seconds_a], [100 / s for s in seconds_b]
    assert common.overall_rate(a) == pytest.approx(300 / 6.0)
    assert common.overall_rate(b) == pytest.approx(300 / 6.0)
    # Equal totals: 1.0x, where the medians (100 and 50 steps/s) would say 2.0x.
    assert common.rate_ratio(a, b) == pytest.approx(1.0)
    assert common.rate_ratio(a, b, [0, 1]) == pytest.approx(2.0)  # windows picked by index
    assert common.ratio_interval([10, 10, 10], [5, 5, 5]) == (2.0, 2.0)


def test_a_slow_patch_that_stretched_both_jobs_cancels_from_the_interval(bench_modules):
    """The machine's speed swings 3x over the run and hits both jobs' window i alike;
    nbdist 5 % slower (±0.5 % of its own): the 99 % interval stays within ±1 % of 0.95x and
    settles below 1.0x. Resampling the jobs' windows apart would spread it over the swing."""
    common, _ = bench_modules
    speed = [50 + 100 * ((7 * i) % 24) / 23 for i in range(24)]
    own = [1.0, 1.005, 0.995, 1.0] * 6
    torchrun = [600 * x for x in speed]
    nbdist = [0.95 * t * o for t, o in zip(torchrun, own)]
    low, high = common.ratio_interval(nbdist, torchrun, level=0.99)
    assert 0.94 < low <= common.rate_ratio(nbdist, torchrun) <= high < 0.96
    assert common.settled((low, high), 1.0, 0.01, len(speed))


def test_nccl_goal_interval_below_the_goal_settles_only_after_thirty_rounds(bench_modules):
    """nbdist 10 % slower in every round (some noise): the interval lies below 0.95 from the
    first rounds on, yet the run counts as settled only from its 30th round (a run's rounds
    drift more than a bootstrap of its first dozen sees)."""
    common, nccl = bench_modules
    noise = [1.00, 1.02, 0.99, 1.01, 0.98, 1.00, 1.03, 0.97, 1.01, 0.99] * 3
    times = _rounds([1.1 * x for x in noise], noise)
    sizes = [1 << 20, 4 << 20]
    assert nccl.SETTLE_MIN_ROUNDS == len(noise) == 30
    assert nccl.goal_ratio(times, sizes) == pytest.approx(1 / 1.1)
    low, high = nccl.goal_interval(times, sizes, level=0.99)
    assert high < nccl.GOAL
    assert common.settled((low, high), nccl.GOAL, 0.02, 30, at_least=nccl.SETTLE_MIN_ROUNDS)
    early = _rounds([1.1 * x for x in noise[:12]], noise[:12])
    interval = nccl.goal_interval(early, sizes, level=0.99)
    assert interval[1] < nccl.GOAL
    assert common.settled(interval, nccl.GOAL, 0.02, 12)  # train.py's windows would stop here
    assert not common.settled(interval, nccl.GOAL, 0.02, 12, at_least=nccl.SETTLE_MIN_ROUNDS)


def test_nccl_goal_interval_straddling_the_goal_is_not_settled(bench_modules):
    """Rounds that swing from 0.8x to 1.1x: the ratio's interval spans the goal, more than
    ±2 % wide, and more rounds are wanted."""
    common, nccl = bench_modules
    torchrun = [1.0] * 12
    nbdist = [1.25, 0.91, 1.2, 0.93, 1.1, 0.95, 1.3, 0.9, 1.05, 1.0, 1.15, 0.92]
    interval = nccl.goal_interval(_rounds(nbdist, torchrun), [1 << 20, 4 << 20], level=0.99)
    assert interval[0] < nccl.GOAL <= interval[1]
    assert not common.settled(interval, nccl.GOAL, 0.02, 12)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--settle", "0"], "--settle 0.0: give a half-width in percent > 0"),
        (["--settle", "1", "--max-minutes", "-2"], "--max-minutes -2.0: give minutes > 0"),
    ],
)
def test_nccl_refuses_a_settle_it_cannot_meet_before_starting_ranks(args, message):
    run = subprocess.run(
        [sys.executable, os.path.join(BENCH, "nccl.py"), *args],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 2, run.stdout + run.stderr
    assert message in run.stderr


def test_the_windows_a_spread_needs_grow_as_its_square_and_refuse_one_window(bench_modules):
    common, _ = bench_modules
    noisy = [1.1, 0.9, 1.0, 1.0] * 4
    base = [1.0] * len(noisy)
    one = common.windows_needed(noisy, base, 0.01)
    # Half the width asks for four times the windows; a 95 % interval for fewer than a 99 %.
    assert common.windows_needed(noisy, base, 0.005) in range(4 * one - 3, 4 * one + 4)
    assert common.windows_needed(noisy, base, 0.01, level=0.95) < one
    # Two jobs that moved together need no windows, however much both moved, and
    # whether or not one is slower.
    assert common.windows_needed([2.0, 1.0, 3.0], [2.0, 1.0, 3.0], 0.01) == 0
    assert common.windows_needed([1.0, 0.5, 2.0], [2.0, 1.0, 4.0], 0.01) == 0
    with pytest.raises(ValueError, match="need at least two windows of each job, got 1 and 1"):
        common.windows_needed([1.0], [1.0], 0.01)


def _stamps(durations: list[float]) -> list[float]:
    out = [0.0]
    for d in durations:
        out.append(out[-1] + d)
    return out


def test_turns_shorter_than_the_machines_slow_spells_compare_alike(step_noise):
    """bench/step_noise.py: steps 20 % slower in alternate spells of 500 steps. Turns of 10
    steps a few turns apart mostly lie in the same spell (a small spread); turns of 500
    lie in different spells at distances 1 and 3, in the same at 2."""
    noise = step_noise
    stamps = _stamps([1.0 if (k // 500) % 2 == 0 else 1.2 for k in range(20_000)])
    short, pairs = noise.turn_spread(stamps, 10, 4)
    long, _ = noise.turn_spread(stamps, 500, 4)
    assert pairs == 20_000 // 10 - 1
    # Of a turn's distances 1-3, spells cross in about 2 / 50 of the pairs at 10 steps.
    assert short == pytest.approx(math.log(1.2) * math.sqrt(2 / 50), rel=0.05)
    assert long == pytest.approx(math.log(1.2) * math.sqrt(2 / 3), rel=0.05)
    rows = noise.plan_rows(stamps, 4, 0.01, turn_cost_s=0.0)
    assert min(rows, key=lambda r: r["minutes"])["steps"] == 10
    # Too few turns for a spread: no row rather than a figure from a handful of pairs.
    assert noise.turn_spread(stamps[:201], 10, 4) is None


def test_white_noise_spread_shrinks_as_the_root_of_the_turn(step_noise):
    """Steps independent of each other: a turn of L steps varies as 1/sqrt(L), so turns of
    1000 steps spread ~10x less than turns of 10 (each sd from 99 pairs or more is off by
    about 1/sqrt(2 x 99) = 7 %: the ratio within ±30 %)."""
    import random

    noise = step_noise
    pick = random.Random(7)
    stamps = _stamps([pick.uniform(0.5, 1.5) for _ in range(100_000)])
    short, _ = noise.turn_spread(stamps, 10, 4)
    long, _ = noise.turn_spread(stamps, 1000, 4)
    assert 7 < short / long < 13
