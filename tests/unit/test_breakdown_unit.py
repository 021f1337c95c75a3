"""The step breakdown, memory per step and counted drops, on one real log channel (no engines).

``nbdist.log`` sends to a real collector over ZeroMQ in this process; the
breakdown's rules and the straggler's reason are checked on hand-made runs.
"""

from __future__ import annotations

import sys
import threading
import time
import warnings

import pytest
import torch

from nbdist.dashboard.breakdown import breakdown, breakdown_chart, explain, slow_parts
from nbdist.dashboard.model import DashboardModel
from nbdist.dashboard.table import rank_rows
from nbdist.dashboard.text import summary_text
from nbdist.metrics import log as metrics_log
from nbdist.metrics import steptime
from nbdist.metrics.collector import Collector
from nbdist.metrics.run import Run

KEY = b"test-key"
EPS = sys.float_info.epsilon


@pytest.fixture
def channel(monkeypatch):
    """A collector in this process and this process's ``nbdist.log`` sending to it."""

    def open_channel(**env):
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        run = Run(0, world_size=1)
        collector = Collector(KEY, run, None)
        metrics_log.configure(collector.url, KEY, 0)
        opened.append(collector)
        return run, collector

    opened: list[Collector] = []
    yield open_channel
    metrics_log.shutdown()
    for collector in opened:
        collector.stop()


def _settle(collector: Collector) -> int:
    total = metrics_log.end_of_cell()
    assert collector.wait_for_points({0: total}, timeout=30)
    return total


def sums_exactly(point: dict) -> bool:
    # compute_s = step_time - comm_s - data_s: three float operations, each within half an ulp.
    parts = point["compute_s"] + point["comm_s"] + point["data_s"]
    return abs(parts - point["step_time"]) <= 4 * EPS * point["step_time"]


class _Mark:
    """What ``fold_finished`` asks of a CUDA event: has the device passed it, and the ms between two.

    A stand-in: this machine has no GPU (tests/gpu runs the real events); the fold is
    bookkeeping over whatever ``query`` and ``elapsed_time`` answer.
    """

    def __init__(self, at_ms: float, passed: bool) -> None:
        self.at_ms, self.passed = at_ms, passed

    def query(self) -> bool:
        return self.passed

    def elapsed_time(self, end: _Mark) -> float:
        return end.at_ms - self.at_ms


def test_held_cuda_events_are_folded_oldest_first_up_to_the_first_unfinished(monkeypatch):
    timers = steptime.StepTimers()
    # Three finished collectives of 1, 2 and 4 ms, then one the device has not reached.
    pairs = [
        (_Mark(0.0, True), _Mark(1.0, True)),
        (_Mark(5.0, True), _Mark(7.0, True)),
        (_Mark(9.0, True), _Mark(13.0, True)),
        (_Mark(20.0, False), _Mark(30.0, False)),
        (_Mark(40.0, True), _Mark(41.0, True)),  # after an unfinished one: left for later
    ]
    timers.events = list(pairs)
    timers.comm = 0.5
    monkeypatch.setattr(steptime, "MAX_EVENT_PAIRS", 3)
    assert steptime.fold_finished(timers)  # 2 left of a limit of 3: room made
    assert timers.events == pairs[3:]
    assert timers.comm == 0.5 + 0.001 + 0.002 + 0.004
    monkeypatch.setattr(steptime, "MAX_EVENT_PAIRS", 2)
    assert not steptime.fold_finished(timers)  # nothing finished at the head: still full
    assert timers.events == pairs[3:]


class _NotRecorded(_Mark):
    """An end event another thread appended and has not recorded yet: CUDA says it has passed
    (a never-recorded event queries as done) but has no time for it."""

    def elapsed_time(self, end: _Mark) -> float:
        raise RuntimeError("Both events must be recorded before calculating elapsed time.")


def test_a_pair_not_recorded_yet_stops_the_fold_and_nothing_is_counted_twice(monkeypatch):
    timers = steptime.StepTimers()
    pending = (_NotRecorded(3.0, True), _Mark(0.0, True))
    timers.events = [(_Mark(0.0, True), _Mark(2.0, True)), pending]
    monkeypatch.setattr(steptime, "MAX_EVENT_PAIRS", 2)
    assert steptime.fold_finished(timers)
    assert timers.events == [pending] and timers.comm == 0.002
    steptime.fold_finished(timers)  # again: the pair is read once it is recorded, not before
    assert timers.events == [pending] and timers.comm == 0.002


def test_collectives_get_cuda_events_only_in_a_cell_that_logged(channel):
    channel()
    metrics_log.new_cell()
    assert not steptime.timers.armed  # a cell that never logs creates no CUDA events
    metrics_log.log(step=0, loss=1.0)
    assert steptime.timers.armed
    metrics_log.new_cell()
    assert not steptime.timers.armed


def test_split_is_exact_and_never_negative():
    for step, comm, data in [(0.3, 0.1, 0.05), (1e-3, 2e-3, 0.0), (0.2, 0.0, 5.0), (0.7, -1, -1)]:
        parts = steptime.split(step, comm, data)
        assert all(v >= 0 for v in parts.values())
        assert sums_exactly({**parts, "step_time": step})
    assert steptime.split(0.2, 0.0, 5.0)["data_s"] == 0.2  # logged data_time capped by the step


def test_log_records_data_time_breakdown_and_memory(channel):
    run, collector = channel()
    for step in range(6):
        with metrics_log.data_timer():
            time.sleep(0.02)  # the "data loader"
        sum(range(20_000))  # the "compute"
        metrics_log.log(step=step, loss=1.0 / (step + 1))
    time.sleep(0.01)
    metrics_log.log(step=6, loss=0.1, data_time=0.001)  # told: the timer's blocks do not count
    metrics_log.log(step=7, loss=0.1, data_time=60.0)  # more than the step: capped, kept as logged
    _settle(collector)
    rows = run.rows()
    assert len(rows) == 8
    assert "comm_s" not in rows[0]  # the first call has no step to split
    for row in rows[1:]:
        assert sums_exactly(row)
        assert row["comm_s"] == 0.0  # no collective was called
    for row in rows[1:6]:
        assert row["data_s"] >= 0.02  # the sleep inside the timer
    assert rows[6]["data_s"] == rows[6]["data_time"] == 0.001
    assert rows[7]["data_time"] == 60.0 and rows[7]["data_s"] == rows[7]["step_time"]
    assert rows[7]["compute_s"] == 0.0
    for row in rows:  # CPU: the resident set and its high-water mark, on every point
        assert row["memory_mib"] > 10 and row["memory_peak_mib"] >= row["memory_mib"] * 0.5
        assert "memory_reserved_mib" not in row


class _Gate(torch.Tensor):
    """A device tensor's stand-in: records what reads it, and can hold the flush thread
    inside ``cpu()`` (a CPU tensor, with nothing to wait for, is read by ``log`` itself)."""

    reads: list[str] = []
    hold = threading.Event()
    held = threading.Event()

    @property
    def is_cpu(self) -> bool:
        return False

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in ("item", "tolist", "cpu", "__float__", "numpy"):
            cls.reads.append(threading.current_thread().name)
            if name == "cpu" and cls.hold.is_set():
                cls.held.set()
                cls.hold.wait(30)  # a device sync that takes long
        return super().__torch_function__(func, types, args, kwargs or {})


def test_a_tensor_is_read_on_the_flush_thread_and_log_never_waits_for_it(channel):
    run, collector = channel()
    loss = torch.tensor(0.5).as_subclass(_Gate)
    metrics_log.log(step=0, loss=loss)
    assert _Gate.reads == []  # log() read nothing: no .item(), no sync
    _settle(collector)
    assert run.last(0)["loss"] == 0.5

    # The flush thread stuck inside a read: log() on the training thread still returns.
    _Gate.reads.clear()
    _Gate.hold.set()
    metrics_log.log(step=1, loss=torch.tensor(0.25).as_subclass(_Gate))
    assert _Gate.held.wait(30)
    assert set(_Gate.reads) == {"nbdist-log-flush"}  # read on the flush thread only
    done = threading.Event()

    def train():
        for step in range(2, 102):
            metrics_log.log(step=step, loss=float(step))
        done.set()

    trainer = threading.Thread(target=train)
    trainer.start()
    finished = done.wait(30)
    _Gate.hold.clear()  # let the flush go on
    _Gate.hold = threading.Event()
    trainer.join(30)
    assert finished  # 100 log calls while the flush thread was held in a tensor read
    assert _settle(collector) == 102
    assert run.last(0)["step"] == 101


def test_a_cpu_tensor_logs_the_value_it_had_at_the_call(channel):
    # Read at the call: changed in place afterwards (as an optimizer's step changes a
    # parameter), the point keeps the value logged, and no tensor waits in the buffer.
    run, collector = channel()
    metrics_log.log(step=0, loss=1.0)  # sent at once; the next flush waits its interval
    loss, scale = torch.tensor(0.5), torch.tensor([4.0], requires_grad=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning in the user's loop for a tensor in autograd
        metrics_log.log(step=1, loss=loss, scale=scale * 1)
    loss += 1.0
    with torch.no_grad():
        scale.mul_(2)
    _settle(collector)
    assert run.last(0)["loss"] == 0.5 and run.last(0)["scale"] == 4.0


def test_a_full_buffer_drops_points_and_counts_them(channel):
    run, collector = channel(NBDIST_LOG_BUFFER="3")
    logged = 0
    for _ in range(50):  # the flush thread sends at most 5 times a second: 3 points fill it
        for _ in range(500):
            metrics_log.log(loss=1.0)
            logged += 1
        sent = _settle(collector)
        if sent < logged:
            break
    assert 0 < sent < logged
    assert run.count(0) == sent
    assert run.dropped == {0: logged - sent}  # the kernel knows exactly how many
    assert "points dropped on the ranks (rank 0:" in summary_text(run)
    # The widget shows the same line (it has no error to name: a full buffer is none).
    model = DashboardModel(run, clock=lambda: 200.0)
    model.poll()
    assert model.table["lost"] == [
        f"{logged - sent} points dropped on the ranks (rank 0: {logged - sent})"
    ]


def test_nothing_dropped_normally(channel):
    run, collector = channel()
    for step in range(100):
        metrics_log.log(step=step, loss=1.0)
    assert _settle(collector) == 100
    assert run.dropped == {} and run.dropped_total() == 0


def _run_with(parts_by_rank: dict[int, tuple[float, float, float]], steps: int = 10) -> Run:
    run = Run(0, world_size=len(parts_by_rank))
    for rank, (compute, comm, data) in parts_by_rank.items():
        total = compute + comm + data
        run.add(
            rank,
            [
                (
                    i,
                    100.0 + i * total,
                    {
                        "loss": 1.0,
                        "step_time": total,
                        "compute_s": compute,
                        "comm_s": comm,
                        "data_s": data,
                        "memory_mib": 300.0,
                        "memory_peak_mib": 400.0,
                    },
                )
                for i in range(steps)
            ],
        )
    return run


def test_a_rank_waiting_for_data_is_flagged_with_the_reason():
    # Synchronous training: rank 1 loads slowly, ranks 0 and 2 wait for it in all_reduce,
    # so every step lasts 0.1 s on every rank and only the shares tell.
    run = _run_with({0: (0.050, 0.045, 0.005), 1: (0.050, 0.009, 0.041), 2: (0.050, 0.045, 0.005)})
    parts = breakdown(run)
    assert explain(parts, 1) == "data loading 41 % of step, others 5 %"
    assert slow_parts(parts) == {1: "data loading 41 % of step, others 5 %"}
    rows = {r.rank: r for r in rank_rows(run, now=200.0)}
    assert rows[1].straggler == "data loading 41 % of step, others 5 %"
    assert rows[0].straggler == rows[2].straggler == ""
    assert rows[0].cells(200.0)[5] == "300 MiB (peak 400 MiB)"
    bars = breakdown_chart(parts, 3)
    assert bars["ranks"] == ["rank 0", "rank 1", "rank 2"]
    assert bars["parts"]["data loading"] == [5.0, 41.0, 5.0]


def test_a_slow_rank_flagged_by_step_time_says_why():
    # No collective: rank 1's steps are longer, and the data share says why.
    run = _run_with({0: (0.05, 0.0, 0.005), 1: (0.05, 0.0, 0.045)})
    rows = {r.rank: r for r in rank_rows(run, now=200.0)}
    # 95 ms against 55 ms, and 45 of those 95 ms loading data
    assert rows[1].straggler == "1.7× step time · data loading 47 % of step, others 9 %"


def test_equal_ranks_are_not_flagged_and_the_dashboard_has_bars_and_memory():
    run = _run_with({0: (0.05, 0.02, 0.01), 1: (0.05, 0.02, 0.01)})
    assert slow_parts(breakdown(run)) == {}
    model = DashboardModel(run, clock=lambda: 200.0)
    model.poll()
    table = model.table
    assert table["breakdown"]["parts"]["communication"] == [20.0, 20.0]
    assert table["dropped"] == {} and table["lost"] == []
    assert "memory_mib" in model.figure_data()
    assert "loss" in model.figure_data()
    assert not any(r["flag"] for r in table["rows"])


def test_dist_status_shows_dropped_points():
    from nbdist.driver.status import format_status

    row = dict(
        rank=0,
        engine=0,
        host="h",
        pid=1,
        device="cpu",
        backend="gloo",
        state="idle",
        memory_mib=300.0,
        died=None,
        dropped=0,
    )
    text = format_status([row, {**row, "rank": 1, "dropped": 7}])
    assert text.splitlines()[0].split()[-1] == "dropped"
    assert text.splitlines()[1].split()[-1] == "0" and text.splitlines()[2].split()[-1] == "7"
    assert "7 metrics points dropped on the ranks" in text
    assert "dropped" not in format_status([{**row, "dropped": None}])
