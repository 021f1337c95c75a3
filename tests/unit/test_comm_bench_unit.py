"""The arithmetic of %dist_bench comm and %dist_start --check, on given figures (no ranks)."""

from __future__ import annotations

import statistics

import pytest

from nbdist.driver.comm_check import link_report
from nbdist.driver.comm_table import (
    COLUMNS,
    SLOW_FACTOR,
    CommResult,
    bus_factor,
    collective_rows,
    default_sizes,
    format_size,
    pair_rows,
    parse_ops,
    parse_sizes,
    slow_links,
)
from nbdist.engine.comm_bench import OPS, elements
from nbdist.errors import PlacementError


@pytest.mark.parametrize(
    "text, sizes",
    [
        ("1K,1M,64M", [1 << 10, 1 << 20, 64 << 20]),
        ("512", [512]),
        ("1k, 2KiB ,3kb,1G", [1 << 10, 2 << 10, 3 << 10, 1 << 30]),
        ("4M,1K,4M", [1 << 10, 4 << 20]),  # sorted, once each
    ],
)
def test_sizes_parse(text, sizes):
    assert parse_sizes(text) == sizes


@pytest.mark.parametrize(
    "text, bad", [("1K,lots", "'lots'"), ("0", "'0'"), ("1T", "'1T'"), ("", "''")]
)
def test_bad_sizes_name_the_value_and_the_format(text, bad):
    with pytest.raises(PlacementError, match=rf"{bad} in .* is not a size; give .*1K,1M,64M"):
        parse_sizes(text)


@pytest.mark.parametrize("text, fix", [("3", "give 4"), ("1000,1001", "give 1000 or 1004")])
def test_a_size_of_no_whole_float32_count_is_refused(text, fix):
    # Before: 1001 B was measured as 1000 B, a second "1000 B" row beside the first, and
    # 3 B as 4 B (all_gather 8 B), with nothing said.
    with pytest.raises(PlacementError, match=rf"is not a whole number of float32 .*{fix}$"):
        parse_sizes(text)


def test_ops_parse_in_a_fixed_order_and_bad_ones_are_named():
    assert parse_ops("broadcast,all_reduce") == ["all_reduce", "broadcast"]
    assert parse_ops(list(OPS)) == list(OPS)
    with pytest.raises(PlacementError, match="'allreduce' is not one of all_reduce,all_gather"):
        parse_ops("allreduce,broadcast")


def test_format_size():
    assert [format_size(n) for n in (1000, 1024, 1536, 4 << 20, 1 << 30)] == [
        "1000 B",
        "1 KiB",
        "1.5 KiB",
        "4 MiB",
        "1 GiB",
    ]


def test_default_ladder_grows_4x_to_64M_on_cpu_1G_on_gpu_capped_by_memory():
    plenty = 1 << 40
    cpu = default_sizes("cpu", plenty, 2)
    assert cpu[0] == 1 << 10 and cpu[-1] == 64 << 20
    assert all(b == 4 * a for a, b in zip(cpu, cpu[1:]))
    assert default_sizes("cuda", plenty, 8)[-1] == 1 << 30
    # 100 MiB free: the largest buffer plus its shard within a quarter of it.
    capped = default_sizes("cuda", 100 << 20, 2)
    assert capped[-1] == 16 << 20 and capped[-1] * 1.5 <= (100 << 20) / 4


def test_bus_factors_are_nccl_tests():
    for n in (2, 3, 4, 8):
        assert bus_factor("all_reduce", n) == 2 * (n - 1) / n
        assert bus_factor("all_gather", n) == bus_factor("reduce_scatter", n) == (n - 1) / n
        assert bus_factor("broadcast", n) == bus_factor("sendrecv", n) == 1.0
    with pytest.raises(ValueError):
        bus_factor("all_to_all", 2)


def test_shards_divide_the_buffer():
    assert elements("all_reduce", 1000, 3) == 250
    assert elements("all_gather", 1000, 3) == 249 and elements("reduce_scatter", 1000, 3) == 249
    assert elements("all_gather", 4, 8) == 8  # at least one element per rank
    assert elements("broadcast", 1, 4) == 1


def _rank_result(times):
    return {"device": "cpu", "backend": "gloo", "world": 2, "times": times, "skipped": {}}


def test_rows_take_the_slowest_rank_per_iteration_then_the_median():
    # Rank 0 / rank 1 seconds per iteration; the slowest of each: 2, 5, 3 ms -> median 3 ms.
    r0 = _rank_result([("all_reduce", 3_000_000, [0.002, 0.001, 0.003])])
    r1 = _rank_result([("all_reduce", 3_000_000, [0.001, 0.005, 0.002])])
    (row,) = collective_rows([r0, r1])
    assert tuple(row) == COLUMNS
    assert row["time_us"] == pytest.approx(3000.0)
    assert row["algbw_gbs"] == pytest.approx(1.0)  # 3 MB in 3 ms
    assert row["busbw_gbs"] == row["algbw_gbs"] * 2 * (2 - 1) / 2
    assert (row["op"], row["ranks"], row["size"], row["bytes"]) == (
        "all_reduce",
        "0-1",
        "2.9 MiB",
        3_000_000,
    )


def test_rows_come_by_op_then_size():
    times = [(op, size, [0.001]) for size in (4096, 1024) for op in ("broadcast", "all_reduce")]
    rows = collective_rows([_rank_result(times), _rank_result(times)])
    assert [(r["op"], r["bytes"]) for r in rows] == [
        ("all_reduce", 1024),
        ("all_reduce", 4096),
        ("broadcast", 1024),
        ("broadcast", 4096),
    ]


def test_pair_rows_use_rank_0_and_the_peer():
    r0 = {"bytes": 4000, "times": {1: [0.001, 0.001], 2: [0.004, 0.004]}, "skipped": {}}
    r1 = {"bytes": 4000, "times": {1: [0.002, 0.002]}, "skipped": {}}
    r2 = {"bytes": 4000, "times": {2: [0.001, 0.001]}, "skipped": {}}
    rows = pair_rows([r0, r1, r2])
    assert [r["ranks"] for r in rows] == ["0↔1", "0↔2"]
    assert [r["algbw_gbs"] for r in rows] == pytest.approx([0.002, 0.001])
    assert all(r["busbw_gbs"] == r["algbw_gbs"] and r["op"] == "sendrecv" for r in rows)


def test_the_slow_link_is_flagged_with_its_ratio_to_the_others_median():
    (slow,) = slow_links({1: 4.9, 2: 5.1, 3: 0.8, 4: 4.7})
    assert (slow.rank, slow.gbs, slow.median) == (3, 0.8, 4.9)
    assert slow.warning() == (
        "nbdist: rank 3's link is 6.1x slower than the median of the others "
        "(0.80 vs 4.90 GB/s): check its NIC or PCIe path"
    )


def test_links_within_the_factor_are_not_flagged():
    # A healthy machine's spread (cross-socket PCIe, a loaded host) stays below SLOW_FACTOR.
    assert slow_links({1: 4.9, 2: 5.1, 3: 2.0, 4: 4.7}) == []
    assert slow_links({1: 1.0, 2: 1.0 * SLOW_FACTOR * 0.99}) == []
    assert [s.rank for s in slow_links({1: 1.0, 2: 1.0 * SLOW_FACTOR})] == [1]


def test_one_link_has_nothing_to_compare_with():
    assert slow_links({1: 0.001}) == []
    assert slow_links({}) == []


def test_with_two_links_the_slow_one_is_not_its_own_yardstick():
    # A plain median of both would be 5.5 and the slow one only 5.5x below it.
    assert [(s.rank, s.median) for s in slow_links({1: 10.0, 2: 1.0})] == [(2, 10.0)]


def test_check_report_lines():
    assert link_report({1: 3.21}, "4 MiB both ways") == [
        "nbdist: check: link 0↔1 3.21 GB/s each way (4 MiB both ways); one link, nothing to compare it with"
    ]
    line, warning = link_report({1: 4.9, 2: 5.1, 3: 0.8}, "4 MiB")
    assert line == (
        "nbdist: check: links 0↔1-3 median 4.90 GB/s each way, slowest 0↔3 0.80 GB/s (4 MiB); "
        "1 far below the others"
    )
    assert warning.startswith("nbdist: rank 3's link is 6.2x slower")
    assert link_report({1: 4.9, 2: 5.1, 3: 4.0}, "4 MiB")[0].endswith(
        f"none {SLOW_FACTOR:g}x below the others"
    )


def test_table_lines_align():
    r = _rank_result([("all_reduce", 1 << 20, [0.001]), ("broadcast", 1 << 10, [0.0001])])
    result = CommResult(2, "gloo", ["cpu", "cpu"], collective_rows([r, r]), {}, "note")
    lines = result.report().splitlines()
    assert lines[0] == "nbdist: comm bench · 2 ranks · backend gloo · device cpu · note"
    assert lines[1].split() == ["op", "ranks", "size", "µs", "algBW", "GB/s", "busBW", "GB/s"]
    assert lines[2].split() == ["all_reduce", "0-1", "1", "MiB", "1000.0", "1.05", "1.05"]
    assert lines[3].split() == ["broadcast", "0-1", "1", "KiB", "100.0", "0.01", "0.01"]
    assert len({len(x) for x in lines[1:]}) == 1


def _pairs(times: dict[int, float], nbytes: int = 4 << 20) -> list[dict]:
    """``comm_bench.time_pairs`` results of rank 0 and each peer, each exchange ``times[peer]`` s."""
    zero = {"bytes": nbytes, "times": {p: [t, t] for p, t in times.items()}, "skipped": {}}
    peers = [{"bytes": nbytes, "times": {p: [t, t]}, "skipped": {}} for p, t in times.items()]
    return pair_rows([zero, *peers])


def test_past_8_links_the_report_shows_their_median_and_the_far_slower_ones():
    """255 links of 256 ranks made a 255-row table; now their median and rank 70's slow link."""
    times = {peer: 0.001 + peer * 1e-6 for peer in range(1, 256)}
    times[70] = 0.004  # 4x the others' time: far slower
    r = _rank_result([("all_reduce", 1 << 20, [0.001])])
    rows = collective_rows([r, r]) + _pairs(times)
    result = CommResult(256, "gloo", ["cpu"] * 256, rows, {}, "note")
    lines = result.report().splitlines()
    assert [line.split()[:2] for line in lines[2:5]] == [
        ["all_reduce", "0-1"],
        ["sendrecv", "0↔1-255"],
        ["sendrecv", "0↔70"],
    ]
    assert lines[3].split()[2] == "(median)"
    assert float(lines[3].split()[5]) == pytest.approx(
        statistics.median(times.values()) * 1e6, abs=0.1
    )
    assert lines[5] == (
        "sendrecv: 255 links with rank 0, their median; 1 3x or more slower than the median of "
        "the others, shown (nbdist.driver.comm_table.bench_comm() lists every link)"
    )
    assert len(lines) == 6
    assert len(result.rows) == 1 + 255  # the table (a DataFrame) keeps every link


def test_up_to_8_links_each_has_its_row():
    rows = _pairs({peer: 0.001 for peer in range(1, 9)})
    lines = CommResult(9, "gloo", ["cpu"] * 9, rows, {}, "note").report().splitlines()
    assert [line.split()[1] for line in lines[2:]] == [f"0↔{peer}" for peer in range(1, 9)]
