"""%dist_bench comm, bench_comm and %dist_start --check against real engines (2 CPU ranks, gloo)."""

from __future__ import annotations

import contextlib
import io
import re

import pytest
from IPython.core.error import UsageError
from IPython.core.interactiveshell import InteractiveShell

from nbdist.driver.comm_table import COLUMNS, bench_comm, bus_factor, measure_comm
from nbdist.engine.comm_bench import OPS
from nbdist.errors import PlacementError

SIZES = "1K,64K"


@pytest.fixture(scope="module")
def started():
    """A shell whose ranks came from ``%dist_start 2 --cpu --check``, and what that printed."""
    sh = InteractiveShell.instance()
    sh.run_line_magic("load_ext", "nbdist")
    magics = sh.magics_manager.registry["DistMagics"]
    before, magics.session = magics.session, None
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            sh.run_line_magic("dist_start", "2 --cpu --check --timeout 120")
        yield sh, magics.session, out.getvalue()
    finally:
        sh.run_line_magic("dist_stop", "")
        magics.session = before


def test_dist_start_check_prints_the_check_line_and_no_warning(started):
    _, _, printed = started
    lines = printed.splitlines()
    assert lines[0].startswith("nbdist: 2 ranks ready")
    # Two ranks have one link: the line gives its figure; a warning needs links to compare.
    assert re.fullmatch(
        r"nbdist: check: link 0↔1 \d\S* GB/s each way \(4 MiB both ways, median of 7; "
        r"\d+\.\d s\); one link, nothing to compare it with",
        lines[1],
    ), lines[1]
    assert len(lines) == 2 and "slower than" not in printed


def test_table_has_every_op_and_size_with_positive_bandwidth(started):
    _, session, _ = started
    table = bench_comm(sizes=SIZES, iters=3, session=session)
    assert list(table.columns) == list(COLUMNS)
    rows = table.to_dict("records")
    expected = [(op, size) for op in OPS for size in ("1 KiB", "64 KiB")] + [("sendrecv", "4 MiB")]
    assert [(r["op"], r["size"]) for r in rows] == expected
    for r in rows:
        assert r["time_us"] > 0 and r["algbw_gbs"] > 0 and r["busbw_gbs"] > 0, r
        assert r["algbw_gbs"] == pytest.approx(r["bytes"] / r["time_us"] / 1e3)  # bytes/s / 1e9
    assert {r["ranks"] for r in rows} == {"0-1", "0↔1"}


def test_bus_bandwidth_is_alg_bandwidth_times_the_factor_for_n_ranks(started):
    _, session, _ = started
    n = session.world_size
    factors = {
        "all_reduce": 2 * (n - 1) / n,
        "all_gather": (n - 1) / n,
        "reduce_scatter": (n - 1) / n,
        "broadcast": 1,
    }
    result = measure_comm(session, sizes=[4096], iters=2, pairs=False)
    assert sorted(r["op"] for r in result.rows) == sorted(factors)
    for r in result.rows:
        assert r["busbw_gbs"] == r["algbw_gbs"] * factors[r["op"]], r
        assert bus_factor(r["op"], n) == factors[r["op"]]


def test_magic_prints_the_table(started, capsys):
    sh, _, _ = started
    sh.run_line_magic(
        "dist_bench", "comm --sizes 1K --ops all_reduce,broadcast --iters 2 --no-pairs"
    )
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith(
        "nbdist: comm bench · 2 ranks · backend gloo · device cpu · median of 2"
    )
    assert lines[1].split() == ["op", "ranks", "size", "µs", "algBW", "GB/s", "busBW", "GB/s"]
    assert [line.split()[:4] for line in lines[2:]] == [
        ["all_reduce", "0-1", "1", "KiB"],
        ["broadcast", "0-1", "1", "KiB"],
    ]


@pytest.mark.parametrize(
    "line, message",
    [
        ("comm --sizes 1K,huge", r"'huge' in '1K,huge' is not a size; give .*1K,1M,64M"),
        ("comm --sizes 64X", r"'64X' in '64X' is not a size"),
        ("comm --sizes 1000G", r"1000 GiB does not fit: a rank has .* free"),
        ("comm --ops all_reduce,alltoall", r"'alltoall' is not one of all_reduce"),
        ("comm --iters 0", r"--iters '0': give a whole number >= 1"),
        ("memory", r"only 'comm' is measured"),
    ],
)
def test_bad_input_is_a_usage_error(started, line, message):
    sh, _, _ = started
    with pytest.raises(UsageError, match=message):
        sh.run_line_magic("dist_bench", line)


def test_bad_sizes_from_python_are_placement_errors(started):
    _, session, _ = started
    with pytest.raises(PlacementError, match="give positive byte counts"):
        bench_comm(sizes=[0], session=session)


def test_without_a_session_the_magic_names_dist_start(started):
    sh, session, _ = started
    magics = sh.magics_manager.registry["DistMagics"]
    magics.session = None
    try:
        with pytest.raises(UsageError, match="start one with %dist_start"):
            sh.run_line_magic("dist_bench", "comm")
    finally:
        magics.session = session
