"""Merging per-rank Chrome traces and summarising them (nbdist.driver.trace_merge, trace_summary): pure logic."""

from __future__ import annotations

import os

import pytest

from nbdist.driver.trace_merge import merge_traces, trace_base_ns
from nbdist.driver.trace_summary import RankSummary, format_summary, is_comm, summarize


def rank_trace(pid: int, events: list[tuple], base_ns: int | None = 1_000_000_000) -> dict:
    """A kineto-like trace: metadata rows, then ``(name, cat, tid, ts, dur)`` complete events."""
    meta = [
        {
            "ph": "M",
            "name": "process_name",
            "pid": pid,
            "tid": 0,
            "ts": 0,
            "args": {"name": "python"},
        },
        {
            "ph": "M",
            "name": "process_labels",
            "pid": pid,
            "tid": 0,
            "ts": 0,
            "args": {"labels": "CPU"},
        },
        {
            "ph": "M",
            "name": "thread_name",
            "pid": pid,
            "tid": pid,
            "ts": 0,
            "args": {"name": "main"},
        },
    ]
    body = [
        {"ph": "X", "name": n, "cat": c, "pid": pid, "tid": t, "ts": ts, "dur": d}
        for n, c, t, ts, d in events
    ]
    trace = {"traceEvents": meta + body}
    if base_ns is not None:
        trace["baseTimeNanoseconds"] = base_ns
    return trace


# One step of 100 µs: compute 10-40 (nested ops), allreduce 40-50 on the main thread,
# gloo transfer 45-70 on gloo's thread (overlapping compute 60-80), idle elsewhere.
STEP = [
    ("ProfilerStep#1", "user_annotation", 7, 0.0, 100.0),
    ("aten::linear", "cpu_op", 7, 10.0, 30.0),
    ("aten::addmm", "cpu_op", 7, 12.0, 20.0),
    ("c10d::allreduce_", "cpu_op", 7, 40.0, 10.0),
    ("gloo:all_reduce", "user_annotation", 9, 45.0, 25.0),
    ("aten::mul", "cpu_op", 7, 60.0, 20.0),
]


def test_every_event_moves_to_its_rank_row_with_names():
    merged = merge_traces({0: rank_trace(111, STEP), 1: rank_trace(222, STEP)}, {0: 0, 1: 0})
    events = merged["traceEvents"]
    assert {e["pid"] for e in events} == {0, 1}
    names = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert names == {0: "rank 0", 1: "rank 1"}
    # kineto's own process rows are replaced; thread names stay.
    assert not any(e["name"] == "process_labels" for e in events)
    assert sum(1 for e in events if e["name"] == "thread_name") == 2
    assert sum(1 for e in events if e.get("ph") == "X") == 2 * len(STEP)


def test_times_shift_by_base_and_clock_offset():
    # Rank 1's trace zero is 5 ms later on its clock, whose clock runs 2 ms ahead of
    # the kernel's: on the kernel's timeline its events start 3 ms after rank 0's.
    traces = {0: rank_trace(1, STEP), 1: rank_trace(2, STEP)}
    bases = {0: 10**18, 1: 10**18 + 5_000_000}
    merged = merge_traces(traces, bases, {0: 0, 1: 2_000_000})
    first = {e["pid"]: e["ts"] for e in merged["traceEvents"] if e.get("name") == "ProfilerStep#1"}
    assert first == {0: 0.0, 1: 3000.0}
    assert merged["baseTimeNanoseconds"] == 10**18


def test_flow_ids_stay_unique_across_ranks_and_gpu_streams_are_named():
    def with_gpu(pid):
        t = rank_trace(pid, STEP)
        t["traceEvents"] += [
            {"ph": "M", "name": "process_name", "pid": 0, "tid": 0, "args": {"name": "GPU 0"}},
            {"ph": "M", "name": "thread_name", "pid": 0, "tid": 77, "args": {"name": "stream 7"}},
            {"ph": "s", "id": 5, "pid": pid, "tid": pid, "ts": 1.0, "name": "ac2g", "cat": "ac2g"},
            {"ph": "f", "id": 5, "pid": 0, "tid": 77, "ts": 2.0, "name": "ac2g", "cat": "ac2g"},
        ]
        return t

    merged = merge_traces({0: with_gpu(10), 1: with_gpu(20)}, {0: 0, 1: 0})
    flows = [(e["pid"], e["id"]) for e in merged["traceEvents"] if e.get("ph") in ("s", "f")]
    assert len({i for _, i in flows}) == 2 and {p for p, _ in flows} == {0, 1}
    streams = [
        e["args"]["name"]
        for e in merged["traceEvents"]
        if e["name"] == "thread_name" and e["tid"] == 77
    ]
    assert streams == ["GPU 0 stream 7", "GPU 0 stream 7"]


def test_base_from_anchors_when_the_trace_has_none():
    trace = rank_trace(1, STEP + [("ProfilerStep#2", "user_annotation", 7, 100.0, 100.0)], None)
    # anchors are taken just after each step began: 30 µs and 12 µs late here.
    anchors = [(1, 5_000_000_000 + 30_000), (2, 5_000_000_000 + 100_000 + 12_000)]
    assert trace_base_ns(trace, anchors) == 5_000_000_000 + 12_000
    assert trace_base_ns(rank_trace(1, STEP, 77), anchors) == 77


def test_summary_shares_from_known_intervals():
    (row,) = summarize(merge_traces({0: rank_trace(1, STEP)}, {0: 0}))
    # window 0-100; compute = ops 10-40 and 60-80 = 50; comm = 40-50 ∪ 45-70 = 40-70 = 30;
    # compute not under comm = 10-40 and 70-80 = 40; idle = 100 - 40 - 30 = 30.
    assert (row.rank, row.steps, row.mode) == (0, 1, "cpu")
    assert row.window_ms == pytest.approx(0.1)
    assert (row.compute, row.communication, row.idle) == pytest.approx((0.4, 0.3, 0.3))
    assert row.overlap == pytest.approx(10 / 30)  # compute 60-70 runs under comm 40-70
    # self time: linear 30 - addmm 20 = 10; addmm 20; mul 20; allreduce 10.
    top = {name: ms for name, ms, _ in row.top_ops}
    assert top == pytest.approx(
        {"aten::addmm": 0.02, "aten::mul": 0.02, "aten::linear": 0.01, "c10d::allreduce_": 0.01}
    )
    text = format_summary([row])
    assert "40.0 %" in text and "aten::addmm" in text


def test_gpu_mode_counts_kernels_not_launches():
    events = [
        ("ProfilerStep#1", "user_annotation", 7, 0.0, 100.0),
        ("aten::mm", "cpu_op", 7, 0.0, 90.0),  # launches: not GPU compute
        ("sm80_gemm", "kernel", 70, 20.0, 30.0),
        ("ncclDevKernel_AllReduce_Sum_f32", "kernel", 71, 40.0, 40.0),
    ]
    (row,) = summarize(merge_traces({0: rank_trace(1, events)}, {0: 0}))
    assert row.mode == "gpu"
    # gemm 20-50, NCCL 40-80: compute not under comm 20-40, comm 40, idle 0-20 and 80-100.
    assert (row.compute, row.communication, row.idle) == pytest.approx((0.2, 0.4, 0.4))
    assert row.overlap == pytest.approx(0.25)


def test_no_communication_gives_no_overlap():
    (row,) = summarize(merge_traces({0: rank_trace(1, STEP[:3])}, {0: 0}))
    assert row.communication == 0 and row.overlap is None
    assert row.compute + row.idle == pytest.approx(1.0)


@pytest.mark.parametrize(
    ("name", "comm"),
    [
        ("c10d::allreduce_", True),
        ("gloo:all_reduce", True),
        ("nccl:all_reduce", True),
        ("ncclDevKernel_AllGather_RING_LL", True),
        ("record_param_comms", True),
        ("aten::addmm", False),
        ("Optimizer.step#SGD.step", False),
    ],
)
def test_what_counts_as_communication(name, comm):
    assert is_comm(name) is comm


def test_profiles_without_history_go_to_a_private_folder_per_session():
    from types import SimpleNamespace

    from nbdist.driver.trace_merge import profiles_dir

    def no_history_session():
        return SimpleNamespace(metrics_hub=SimpleNamespace(store=None, run=SimpleNamespace(id=0)))

    one, two = no_history_session(), no_history_session()
    first, second = profiles_dir(one), profiles_dir(two)
    try:
        assert first != second  # two sessions (even started the same second) never share
        assert profiles_dir(one) == first  # one session keeps its folder
        for folder in (first, second):
            assert os.stat(folder).st_mode & 0o777 == 0o700
            assert os.stat(folder).st_uid == os.getuid()
            assert "run-0" not in folder
    finally:
        os.rmdir(first)
        os.rmdir(second)


def _rank_row(rank: int, compute: float, comm: float, top_ms: float = 1.0) -> RankSummary:
    return RankSummary(
        rank=rank,
        window_ms=100.0,
        steps=3,
        compute=compute,
        communication=comm,
        idle=1.0 - compute - comm,
        overlap=0.5,
        mode="cpu",
        top_ops=[("aten::mm", top_ms, 30), ("c10d::allreduce_", top_ms / 2, 3)],
    )


def test_past_8_ranks_the_summary_is_their_median_and_the_ranks_that_stand_out():
    """256 ranks: one row per rank and one top-operators line per rank made 512 lines; now the
    median, the ranks whose shares are 10 points or more from it, and the operators' mean."""
    rows = [_rank_row(rank, 0.60 + (rank % 3) * 0.01, 0.30) for rank in range(256)]
    rows[17] = _rank_row(17, 0.85, 0.10, top_ms=4.0)  # a straggler: computes, others wait
    rows[200] = _rank_row(200, 0.45, 0.30)  # 15 points idler than the median
    lines = format_summary(rows).splitlines()
    assert lines[1].split() == [
        "0-255",
        "(median)",
        "100.0",
        "ms",
        "3",
        "61.0",
        "%",
        "30.0",
        "%",
        "9.0",
        "%",
        "50.0",
        "%",
    ]  # one row: each column's median
    assert [line.split()[0] for line in lines[2:4]] == ["17", "200"]
    assert lines[4] == (
        "2 ranks with a compute, comm or idle share 10 points or more from the median listed; "
        "MergedProfile.to_pandas() has every rank"
    )
    mean = (254 * 1.0 + 4.0 + 1.0) / 256
    assert lines[5] == (
        f"ranks 0-255 (mean) top by self time: aten::mm {mean:.2f} ms, "
        f"c10d::allreduce_ {mean / 2:.2f} ms"
    )
    assert lines[6].startswith("rank 17 top by self time: aten::mm 4.00 ms")
    assert len(lines) == 8


def test_past_8_ranks_alike_no_rank_is_listed():
    lines = format_summary([_rank_row(rank, 0.6, 0.3) for rank in range(9)]).splitlines()
    assert lines[1].split()[:2] == ["0-8", "(median)"]
    assert lines[2] == "no rank's compute, comm or idle share is 10 points or more from the median"
    assert len(lines) == 4


def test_up_to_8_ranks_each_has_its_row():
    lines = format_summary([_rank_row(rank, 0.6, 0.3) for rank in range(8)]).splitlines()
    assert [line.split()[0] for line in lines[1:9]] == [str(rank) for rank in range(8)]
