"""The step breakdown, memory and dropped points from real ranks (2 CPU ranks, gloo)."""

from __future__ import annotations

import sys

import pytest

import nbdist
from nbdist.dashboard.table import rank_rows
from nbdist.driver.sinks import ListSink
from nbdist.driver.status import format_status, rank_status
from nbdist.metrics.store import load_run

EPS = sys.float_info.epsilon

STEPS = """
from nbdist.metrics.log import data_timer
t = torch.ones(1000)
for step in range({start}, {start} + 12):
    with data_timer():
        if rank == 1:
            time.sleep(0.05)  # rank 1's slow data loader
    t.mul_(1.0001)
    if {collective}:
        dist.all_reduce(t)
    nbdist.log(step=step, loss=float(step))
"""


@pytest.fixture(scope="module")
def session(tmp_path_factory):
    history = str(tmp_path_factory.mktemp("history") / "runs.sqlite")
    with nbdist.DistSession(2, cpu=True, timeout=120, history=history) as s:
        s.run("import time", sink=ListSink())
        yield s


def _points(session, steps: range) -> dict[int, list[dict]]:
    rows = session.metrics.rows()
    return {r: [p for p in rows if p["rank"] == r and p["step"] in steps] for r in (0, 1)}


def test_breakdown_flags_the_rank_waiting_for_data(session):
    session.run(STEPS.format(start=0, collective=True), sink=ListSink())
    session.run(STEPS.format(start=100, collective=False), sink=ListSink())
    with_comm, without = _points(session, range(1, 12)), _points(session, range(101, 112))
    for rank in (0, 1):
        assert len(with_comm[rank]) == len(without[rank]) == 11
        for p in with_comm[rank] + without[rank]:
            # compute_s = step_time - comm_s - data_s on the rank: 3 float operations
            parts = p["compute_s"] + p["comm_s"] + p["data_s"]
            assert abs(parts - p["step_time"]) <= 4 * EPS * p["step_time"]
            assert p["memory_mib"] > 10 and p["memory_peak_mib"] > 0  # RSS on CPU
        assert all(p["comm_s"] > 0 for p in with_comm[rank])  # an all_reduce every step
        assert all(p["comm_s"] == 0.0 for p in without[rank])  # no collective at all
    assert all(p["data_s"] >= 0.05 for p in with_comm[1] + without[1])
    assert all(p["data_s"] < 0.05 for p in with_comm[0])
    # Rank 0 waited for rank 1 inside all_reduce: most of its step was communication.
    assert sum(p["comm_s"] for p in with_comm[0]) > sum(p["comm_s"] for p in with_comm[1])

    rows = {r.rank: r for r in rank_rows(session.metrics)}
    assert "data loading" in rows[1].straggler and "% of step, others" in rows[1].straggler
    assert rows[0].straggler == ""
    assert session.metrics.dropped == {}  # nothing lost normally


def test_ddp_gradients_bypass_the_wrapper_unless_a_comm_hook_is_registered(session):
    session.run(
        """
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
def train(model, first):
    x = torch.randn(32, 64)
    for step in range(first, first + 6):
        model(x).sum().backward()
        nbdist.log(step=step, loss=1.0)
plain = DDP(nn.Linear(64, 64))
train(plain, 200)
hooked = DDP(nn.Linear(64, 64))
hooked.register_comm_hook(None, allreduce_hook)
train(hooked, 300)
""",
        sink=ListSink(),
    )
    plain, hooked = _points(session, range(201, 206)), _points(session, range(301, 306))
    for rank in (0, 1):
        assert all(p["comm_s"] == 0.0 for p in plain[rank])  # the C++ reducer's all-reduces
        assert all(p["comm_s"] > 0 for p in hooked[rank])  # the hook's dist.all_reduce launches


def test_a_full_buffer_is_counted_in_the_kernel(session):
    session.run(
        """
import os
from nbdist.metrics.log import dropped
os.environ["NBDIST_LOG_BUFFER"] = "3"
nbdist.log(step=1000, loss=0.0)
nbdist.metrics.log.flush()  # the flush thread reads the buffer size at each flush
n = 0
while dropped() == 0 and n < 1_000_000:  # 3 points fill it between two flushes
    nbdist.log(step=1001 + n, loss=1.0)
    n += 1
del os.environ["NBDIST_LOG_BUFFER"]
mine = dropped()
""",
        sink=ListSink(),
    )
    mine = session.pull("mine")
    assert all(n > 0 for n in mine)
    assert session.metrics.dropped == {0: mine[0], 1: mine[1]}
    rows = rank_status(
        session.cluster, session.ranks, session.backend, dropped=session.metrics.dropped
    )
    assert [r["dropped"] for r in rows] == mine
    assert f"{sum(mine)} metrics points dropped" in format_status(rows)
    # The history keeps the count: a run read back later says what was lost too.
    assert load_run(session.metrics.id, path=session.history).dropped == {0: mine[0], 1: mine[1]}
