"""bench/train.py on real CPU ranks and torchrun jobs, its windows cut into turns.

``--slices K`` makes every job take K turns a window; this runs the benchmark end to end
(two ranks, three short windows in three turns each) so a change to how turns add up
breaks here, not on a GPU machine whose time is scarce. Its figures are not judged:
timing belongs to bench/RESULTS.md.
"""

from __future__ import annotations

import json
import re

import pytest
from bench_script import assert_refused, run_bench


def _run(*args: str, timeout: float = 240):
    return run_bench("train.py", *args, timeout=timeout)


@pytest.mark.timeout(300)
def test_windows_in_turns_run_every_step_of_every_job_and_leave_nothing_running():
    run = _run("--cpu", "--quick", "--slices", "3")
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    summary = json.loads(run.stdout.strip().splitlines()[-1])
    assert summary["slices"] == 3 and summary["windows"] == 3 and summary["steps"] == 30
    # Every job's turn starts alike: a pause, then a tenth of the turn untimed (by default).
    assert summary["turn_pause_ms"] == 20 and summary["turn_warmup"] == 1
    header = (
        "3 windows of 30 steps per job in 3 turn(s) each (a turn starts with a 20 ms pause "
        "and 1 untimed step(s)), after 5 warm-up steps"
    )
    assert header in run.stdout
    for job, rates in summary["samples"].items():
        assert len(rates) == 3 and all(r > 0 for r in rates), (job, rates)
    # Every job ran the warm-up and each window's turns, each turn's untimed step included:
    # 5 + 3 x 3 x (1 + 10) steps, the same computation (the same final loss), the logged
    # one included.
    assert {f["steps"] for f in summary["final"].values()} == {104}
    assert summary["same_final_loss"] is True
    assert set(summary["final"]) == {"nbdist", "nbdist_log", "torchrun"}
    low, high = summary["ratio_interval"]
    assert low <= summary["ratio"] <= high
    # What the spread of these windows asks for, said in words and in the JSON.
    assert summary["windows_needed"] >= 1
    needed = f"within ±1 % needs about {summary['windows_needed']} windows"
    assert needed in run.stdout
    # The logged job's turn-end flushes (9 here: 3 windows of 3 turns) were timed on its
    # rank, and their share of its time printed: what bounds the turns' part of the cost.
    assert summary["log_flush_ms"] > 0 and 0 < summary["log_flush_share"] < 1
    line = re.search(
        r"its turn-end flushes on the clock: ([\d.]+) ms a window, ([\d.]+) %", run.stdout
    )
    assert line, run.stdout[-3000:]
    assert float(line[1]) == pytest.approx(summary["log_flush_ms"], abs=0.006)
    assert float(line[2]) == pytest.approx(100 * summary["log_flush_share"], abs=0.006)
    assert summary["leftover_pids"] == []


@pytest.mark.parametrize(
    "args, message",
    [
        (("--slices", "7"), "--slices 7 does not divide a window's 30 steps"),
        (("--slices", "0"), "--slices 0: a window has at least one turn; give 1 or more"),
        (("--turn-warmup", "-1"), "--turn-warmup -1: give 0 or more untimed steps a turn"),
        (("--turn-pause", "-5"), "--turn-pause -5: give 0 or more milliseconds"),
    ],
)
def test_bad_turn_settings_are_refused_before_any_rank_starts(args, message):
    assert_refused("train.py", ("--cpu", "--quick", *args), message, "train:")


@pytest.mark.timeout(300)
def test_without_the_logged_job_only_the_ratio_is_measured():
    run = _run("--cpu", "--quick", "--no-log")
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    summary = json.loads(run.stdout.strip().splitlines()[-1])
    assert set(summary["final"]) == set(summary["samples"]) == {"nbdist", "torchrun"}
    assert summary["logged"] is False and "log_cost" not in summary
    assert "log_flush_share" not in summary and "turn-end flushes" not in run.stdout
    assert summary["same_final_loss"] is True
    # Whole windows: a turn starts with neither pause nor untimed steps, as before turns.
    assert summary["turn_pause_ms"] == 0 and summary["turn_warmup"] == 0
    assert "logged job: False" in run.stdout
    assert "cost of nbdist.log" not in run.stdout and "logging every step" not in run.stdout
    low, high = summary["ratio_interval"]
    assert low <= summary["ratio"] <= high
    assert summary["leftover_pids"] == []
