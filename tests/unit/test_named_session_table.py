"""``%dist_sessions``' table: one line per named session under a header, columns aligned."""

from __future__ import annotations

from nbdist.magics.named_sessions import format_sessions


def test_sessions_table_aligns_columns_and_shows_what_is_missing_as_a_dash():
    rows = [
        {
            "name": "train1",
            "ranks": 4,
            "launcher": "local",
            "started": None,
            "state": "running",
            "last_step": 1200,
            "error": "",
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
    assert format_sessions(rows).splitlines() == [
        "name    ranks  launcher  started  state            last step",
        "train1  4      local     -        running          1200",
        "b       -      slurm     -        failed (no GPU)  -",
    ]


def test_no_sessions_says_how_to_start_one():
    assert "%dist_start N --name NAME" in format_sessions([])
