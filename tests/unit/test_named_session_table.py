"""``%dist_sessions``' table: one line per named session under a header, columns aligned."""

from __future__ import annotations

import pytest

from nbdist.errors import PlacementError
from nbdist.launch.values import parse_duration
from nbdist.magics.named_sessions import format_sessions

ROWS = [
    {
        "name": "train1",
        "ranks": 4,
        "launcher": "local",
        "started": None,
        "state": "running",
        "last_step": 1200,
        "error": "",
        "idle_s": 12600,
        "idle_timeout": 14400,
        "memory": 2.1 * 2**30,
        "gpus": [],
    },
    {
        "name": "b",
        "ranks": None,
        "launcher": "slurm",
        "started": None,
        "state": "failed",
        "last_step": None,
        "error": "no GPU",
    },
]


def test_sessions_table_aligns_columns_and_shows_what_is_missing_as_a_dash():
    assert format_sessions(ROWS).splitlines() == [
        "name    ranks  launcher  started  state            idle           memory    last step",
        "train1  4      local     -        running          3.5 h / 4.0 h  2.10 GiB  1200",
        "b       -      slurm     -        failed (no GPU)  -              -         -",
    ]


def test_the_gpus_a_session_holds_get_a_column_when_any_holds_one():
    rows = [dict(ROWS[0], gpus=[0, 1]), ROWS[1]]
    lines = format_sessions(rows).splitlines()
    assert lines[0].split()[-3:] == ["gpus", "last", "step"]
    assert lines[1].split()[-2:] == ["0,1", "1200"]


def test_no_sessions_says_how_to_start_one():
    assert "%dist_start N --name NAME" in format_sessions([])


@pytest.mark.parametrize(
    "text, seconds",
    [("90", 90.0), ("90s", 90.0), ("30m", 1800.0), ("2h", 7200.0), ("1.5d", 129600.0)],
)
def test_durations_take_a_unit(text, seconds):
    assert parse_duration(text, "--idle-timeout") == seconds


@pytest.mark.parametrize("text", ["0", "x", "2w", "", "-1h"])
def test_a_bad_duration_names_the_value_and_the_fix(text):
    with pytest.raises(PlacementError, match=rf"--idle-timeout {text!r}.*(30m|more than 0)"):
        parse_duration(text, "--idle-timeout")
