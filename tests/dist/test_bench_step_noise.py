"""bench/step_noise.py on a real CPU rank: a steady stream of steps, cut into turns.

It runs train.py's model on one rank of a real session, stamps every step and plans
train.py's turns from the stream; this runs it end to end (a 4-second stream) so a change
to train.py's model or to the session breaks here, not on a GPU machine whose time is
scarce. Its figures are not judged: timing belongs to bench/RESULTS.md.
"""

from __future__ import annotations

import json

import pytest
from bench_script import assert_refused, run_bench


@pytest.mark.timeout(240)
def test_a_stream_of_steps_is_cut_into_turns_and_planned_and_nothing_is_left_running():
    # One rank, 4 seconds, and however loaded the machine, at least the 21 turns of 10 steps
    # the first row needs (the stream goes on until it has them).
    run = run_bench("step_noise.py", "--cpu", "--quick", "--n", "1", timeout=200)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    summary = json.loads(run.stdout.strip().splitlines()[-1])
    assert summary["bench"] == "step_noise" and summary["jobs"] == 4 and summary["n"] == 1
    assert summary["steps"] > 0 and summary["turn_cost_ms"] > 0
    rows = summary["rows"]
    assert rows and rows[0]["steps"] == 10, rows
    for row in rows:
        # Every turn of the stream is compared with the next: one pair fewer than turns.
        assert row["pairs"] == summary["steps"] // row["steps"] - 1 >= 20, row
        assert row["spread"] > 0  # real steps never take exactly the same time
        # Turn pairs for ±1 % at 99 % (z = 2.576), from the spread (rounded in the JSON).
        exact = (2.5758293035489004 * row["spread"] / 0.01) ** 2
        assert abs(row["pairs_needed"] - exact) <= 0.01 * exact + 1, row
    soonest = min(rows, key=lambda r: r["minutes"])
    assert summary["soonest"] == soonest
    assert f"soonest: turns of {soonest['steps']} steps" in run.stdout
    assert summary["leftover_pids"] == []


@pytest.mark.parametrize(
    "args, message",
    [
        (("--n", "0"), "--n 0: give 1 rank or more, e.g. --n 2"),
        (("--jobs", "1"), "--jobs 1: a ratio compares at least 2 jobs; give 2 or more"),
        (("--seconds", "0"), "--seconds 0.0: give seconds > 0, e.g. --seconds 60"),
        (("--within", "-1"), "--within -1.0: give a half-width in percent > 0"),
    ],
)
def test_a_plan_it_cannot_make_is_refused_before_any_rank_starts(args, message):
    assert_refused("step_noise.py", ("--cpu", *args), message, "step_noise:")
