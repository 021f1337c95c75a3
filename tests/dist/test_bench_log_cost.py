"""bench/log_cost.py on a real CPU rank: every part of nbdist.log switched on alone, measured.

The benchmark reaches into the rank's metrics channel to turn its memory reading off for
the ``log_bare`` windows; this runs it end to end (one rank, two short windows, the
profile) so a change to that channel breaks here, not on a GPU machine whose time is
scarce. Its figures are not judged: timing belongs to bench/RESULTS.md.
"""

from __future__ import annotations

import json

import pytest
from bench_script import assert_refused, run_bench


def _run(*args: str, timeout: float = 300):
    return run_bench("log_cost.py", *args, timeout=timeout)


@pytest.mark.timeout(360)
def test_every_variant_is_measured_and_profiled_and_nothing_is_left_running():
    # Windows of ~1 s on CPU: long enough for the flush thread (twice a second) to send.
    run = _run("--cpu", "--quick", "--windows", "2", "--steps", "400", "--slices", "2", "--profile")
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    summary = json.loads(run.stdout.strip().splitlines()[-1])
    rows = summary["rows"]
    assert list(rows) == [
        "none",
        "none_b",
        "detach",
        "keep",
        "copy",
        "log_number",
        "log_bare",
        "log_held",
        "log",
    ]
    for name, row in rows.items():
        assert row["steps_s"] > 0, (name, row)
        assert row["device_allocs"] is None  # CPU ranks: no CUDA allocator to read
        low, high = row["interval"]
        assert low <= row["ratio"] <= high, (name, row)
    assert rows["none"]["ratio"] == 1.0
    # The flush thread sent points during the logged windows, and none while held.
    assert sum(rows["log"]["sent_in_window"]) > 0, rows["log"]
    assert rows["log_held"]["sent_in_window"] == [0, 0], rows["log_held"]
    assert rows["none"]["sent_in_window"] == [0, 0]
    # Only the variants that log as train.py does flush their rest on the clock.
    assert rows["log"]["flush_ms"] > 0 and rows["log_number"]["flush_ms"] > 0
    assert rows["log_held"]["flush_ms"] == 0 and rows["keep"]["flush_ms"] == 0
    assert "the turns' flushes on the clock, ms a window (median): log_number " in run.stdout
    # Their share of the window: the flushes' seconds over the window's (400 steps).
    log = rows["log"]
    assert log["flush_share"] == pytest.approx(
        log["flush_ms"] / 1e3 / (400 / log["steps_s"]), rel=1e-3, abs=1e-5
    )
    assert 0 < log["flush_share"] < 1 and rows["keep"]["flush_share"] == 0
    assert f"log {log['flush_ms']:.2f} ({100 * log['flush_share']:.2f} % of it)" in run.stdout
    assert all(len(v) == 2 for v in summary["samples"].values())
    # Two turns of 200 steps a window for every variant.
    assert (
        summary["slices"] == 2 and "2 windows of 400 steps per variant in 2 turn(s)" in run.stdout
    )
    assert summary["profiled"] == ["log", "none"]
    profile = run.stdout.split("profile, one window of 400 steps each")[1]
    assert "aten::" in profile  # the model's own ops, from the rank's profile
    assert summary["leftover_pids"] == []


def test_a_window_count_below_one_is_refused_before_any_rank_starts():
    message = "--windows 0: give a whole number >= 1, e.g. --windows 8"
    assert_refused("log_cost.py", ("--cpu", "--windows", "0"), message, "window 1/")


def test_turns_that_do_not_divide_a_window_are_refused_by_name():
    run = _run("--cpu", "--steps", "400", "--slices", "3", timeout=60)
    assert run.returncode == 2
    assert "--slices 3 does not divide a window's 400 steps" in run.stderr
    assert "give --steps as a multiple of 3, or another --slices" in run.stderr
    assert "window 1/" not in run.stdout


@pytest.mark.timeout(300)
def test_the_goals_pair_and_its_control_alone_are_timed_when_named():
    run = _run("--cpu", "--quick", "--windows", "2", "--variants", "log,none_b,none")
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    summary = json.loads(run.stdout.strip().splitlines()[-1])
    assert list(summary["rows"]) == list(summary["samples"]) == ["none", "none_b", "log"]
    assert all(len(rates) == 2 for rates in summary["samples"].values())
    assert "variants none, none_b, log;" in run.stdout
    assert summary["leftover_pids"] == []


@pytest.mark.parametrize(
    "variants, message",
    [
        ("none,logg", "--variants: unknown variant 'logg'; choose from none, none_b, detach"),
        ("none,keep", "--variants none,keep: the goal compares log with none; add log"),
    ],
)
def test_variants_it_cannot_judge_the_goal_by_are_refused(variants, message):
    assert_refused("log_cost.py", ("--cpu", "--variants", variants), message, "log_cost:")
