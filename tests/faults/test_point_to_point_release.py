"""A pipeline stage fails while its peer waits on point-to-point works (2 real gloo ranks).

torch's pipeline schedules post a batch of sends (or of receives) through ``dist.isend`` /
``dist.irecv`` one by one, mixed ones through ``batch_isend_irecv``, then wait on the works
in C++. Such a wait is now seen as one for the failed rank: the peer is released once it has
waited 0.5 s, named by its call, instead of 5 s later as a rank that computes ("from its
running code"). The group's own timeout is 60 s (``two_ranks``).
"""

from __future__ import annotations

import re
import time

import pytest

from nbdist.driver.sinks import ListSink
from nbdist.driver.where import diagnose
from nbdist.errors import RankError
from tests.faults.failing import failing_cell
from tests.faults.two_ranks import reduce_works, two_ranks

# Two stages of a GPipe schedule over 4 micro-batches; `fail` makes a stage's forward raise.
_PIPELINE = """
import torch.nn as nn
from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

class Stage(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 16)
        self.fail = False

    def forward(self, x):
        if self.fail:
            raise ValueError(f"bad stage on rank {rank}")
        return self.lin(x)

torch.manual_seed(0)
stage_module = Stage()
stage = PipelineStage(stage_module, rank, 2, torch.device("cpu"))
schedule = ScheduleGPipe(stage, n_microbatches=4, loss_fn=lambda out, y: ((out - y) ** 2).mean())
x, y = torch.randn(8, 16), torch.randn(8, 16)

def pipeline_step():
    if rank == 0:
        schedule.step(x)
    else:
        schedule.step(target=y, losses=[])

pipeline_step()
"""


@pytest.fixture(scope="module")
def session():
    with two_ranks() as s:
        yield s


def _released_by_its_call(err: RankError, call: str, ename: str = "ValueError") -> None:
    # The failing stage alone, with its own error; its peer released from the call it waits on.
    assert [(f.rank, f.ename) for f in err.failures] == [(1, ename)], str(err)
    assert re.search(
        rf"rank 1 failed; the others were released: rank 0 from {call} #\d+\.", str(err)
    ), str(err)


def test_a_pipeline_stage_waiting_on_a_failed_stage_is_released_from_its_point_to_point_call(
    session,
):
    session.run(_PIPELINE, sink=ListSink())  # one step that works: the stages are set up
    err = failing_cell(session, "if rank == 1:\n    stage_module.fail = True\npipeline_step()")
    # Before: "rank 0 from its running code", released as a rank that computes 5 s on.
    # (The schedule raises its own RuntimeError from the stage's ValueError.)
    _released_by_its_call(err, "i(?:send|recv)", "RuntimeError")
    assert "bad stage on rank 1" in err.failures[0].traceback
    reduce_works(session)
    session.run("stage_module.fail = False", sink=ListSink())


def test_a_released_stage_runs_its_own_error_handling_to_the_end(session):
    # Rank 0's wait ends with the release; its `except` block then takes 1 s (saving state,
    # say). Before: SIGINTed 0.3 s after the release, named "isend #N (interrupted)", its
    # handling cut short by a KeyboardInterrupt (also what a loaded machine did to a stage
    # whose error merely crossed the schedule slowly).
    session.run(_PIPELINE, sink=ListSink())
    err = failing_cell(
        session,
        "import time\n"
        "handled = False\n"
        "if rank == 1:\n"
        "    stage_module.fail = True\n"
        "try:\n"
        "    pipeline_step()\n"
        "except Exception:\n"
        "    if rank == 0:\n"
        "        time.sleep(1)\n"
        "        handled = True\n"
        "    raise\n",
    )
    _released_by_its_call(err, "i(?:send|recv)", "RuntimeError")
    assert "(interrupted)" not in str(err)
    assert session.pull("handled", rank=0) is True
    reduce_works(session)
    session.run("stage_module.fail = False", sink=ListSink())


def test_a_stage_waiting_on_a_finished_peer_runs_its_own_error_handling_to_the_end(session):
    # Rank 1 finishes the cell without sending: rank 0's receive cannot end and is released
    # (the stranded look, 3 s on). Its `except` block then takes 1 s. Before: SIGINTed 0.3 s
    # after the release, as a rank that computes, named "irecv #N (interrupted)".
    err = failing_cell(
        session,
        "import time\n"
        "handled = False\n"
        "if rank == 0:\n"
        "    try:\n"
        "        dist.irecv(torch.zeros(4), 1).wait()\n"
        "    except Exception:\n"
        "        time.sleep(1)\n"
        "        handled = True\n"
        "        raise\n",
    )
    assert [f.rank for f in err.failures] == [0], str(err)
    assert re.search(r"rank 0 from irecv #\d+\.", str(err)), str(err)
    assert "(interrupted)" not in str(err)
    assert session.pull("handled", rank=0) is True
    reduce_works(session)


def test_a_rank_waiting_on_a_batch_isend_irecv_of_a_failed_peer_is_released_from_it(session):
    err = failing_cell(
        session,
        "import time\n"
        "buf = torch.zeros(4)\n"
        "if rank == 1:\n"
        "    time.sleep(1)\n"
        "    raise ValueError('bad stage')\n"
        "ops = [dist.P2POp(dist.isend, torch.ones(4), 1), dist.P2POp(dist.irecv, buf, 1)]\n"
        "for work in dist.batch_isend_irecv(ops):\n"
        "    work.wait()\n",
    )
    _released_by_its_call(err, "batch_isend_irecv")
    reduce_works(session)


def test_where_says_a_rank_waits_on_the_works_of_its_last_call(session):
    # Rank 1 sleeps before its send: rank 0 waits on its irecv's work, past the call.
    run = session.run(
        "import time\n"
        "buf = torch.zeros(4)\n"
        "if rank == 1:\n"
        "    time.sleep(4)\n"
        "    dist.send(torch.ones(4), 0)\n"
        "else:\n"
        "    dist.irecv(buf, 1).wait()\n",
        block=False,
        sink=ListSink(),
    )
    try:
        deadline = time.monotonic() + 60
        lines: dict[int, str] = {}
        while time.monotonic() < deadline:
            lines = diagnose(session.where())
            if "its works not completed" in lines[0]:
                break
            time.sleep(0.1)
        assert re.fullmatch(
            r"last collective irecv #\d+, returned \d+\.\d s ago, its works not completed", lines[0]
        ), lines
    finally:
        run.wait()
    assert session.pull("buf", rank=0).tolist() == [1.0] * 4


def test_receives_an_interrupt_left_unfinished_do_not_take_a_later_cells_data(session):
    # Each rank posts a receive from the other and is interrupted before it finishes: the
    # ranks stopped at the same call (irecv #1), nothing inside a collective.
    run = session.run(
        "buf = torch.zeros(4)\nwork = dist.irecv(buf, src=1 - rank)\nimport time\ntime.sleep(60)",
        block=False,
        sink=ListSink(),
    )
    while not all(w.collective and w.collective["op"] == "irecv" for w in session.where()):
        time.sleep(0.1)
    session.interrupt()
    # Both ranks' KeyboardInterrupts are in before the cell is waited for (its guard acts
    # while it is): on a loaded machine rank 0's came over 0.5 s after rank 1's, and the
    # guard, rank 1 having failed, released rank 0 from its receive (the group formed again
    # all the same; "rank 1 failed; the others were released: rank 0 from irecv #3").
    deadline = time.monotonic() + 30
    while "running" in run.child_states().values():
        assert time.monotonic() < deadline, run.child_states()
        time.sleep(0.05)
    with pytest.raises(RankError) as info:
        run.wait()
    assert {f.ename for f in info.value.failures} == {"KeyboardInterrupt"}, str(info.value)
    assert (
        "sends or receives were left unfinished. The process group was formed again; "
        "variables and models are kept"
    ) in str(info.value)
    # Left in the old group, rank 0's receive took rank 1's next send: the cell's own
    # receive then waited for a rank that had finished (released after 3 s, nothing received).
    session.run(
        "t = torch.zeros(4)\n"
        "if rank == 1:\n"
        "    dist.send(torch.full((4,), 7.0), dst=0)\n"
        "else:\n"
        "    dist.recv(t, src=1)",
        sink=ListSink(),
        timeout=50,
    )
    assert session.pull("t", 0).tolist() == [7.0] * 4
    assert session.pull("buf", 0).tolist() == [0.0] * 4
    reduce_works(session)


def test_finished_works_are_not_kept(session):
    # A pipeline loop posts works for hours: those that finished are dropped as it goes.
    session.run(
        "from nbdist.engine import collectives as nbdist_collectives\n"
        "for i in range(1000):\n"
        "    t = torch.ones(1)\n"
        "    (dist.isend(t, 1) if rank == 0 else dist.irecv(t, 0)).wait()\n"
        "kept = len(nbdist_collectives._unfinished)",
        sink=ListSink(),
    )
    assert all(kept <= 256 for kept in session.pull("kept")), session.pull("kept")
    assert [w.collective["unfinished"] for w in session.where()] == [0, 0]


_CUT_NOTE = (
    "a pipeline step was cut short and its schedule keeps that step's losses, so its next "
    "step fails: make the stages and the schedule again: schedule (ScheduleGPipe)"
)


@pytest.mark.parametrize("then", ["wait", "next cell"])
def test_an_interrupted_pipeline_step_names_the_schedule_to_make_again(session, capsys, then):
    session.run(_PIPELINE, sink=ListSink())
    # The last stage's loss of the second micro-batch takes a minute: the step is interrupted
    # there, the first micro-batch's loss kept in the schedule.
    session.run(
        "import time\n"
        "calls, slow = [], False\n"
        "def slow_loss(out, y):\n"
        "    calls.append(1)\n"
        "    if slow and len(calls) == 2:\n"
        "        time.sleep(60)\n"
        "    return ((out - y) ** 2).mean()\n"
        "schedule = ScheduleGPipe(stage, n_microbatches=4, loss_fn=slow_loss)\n"
        "pipeline_step()  # a schedule's first step also infers the shapes (and calls the loss)\n"
        "calls, slow = [], True",
        sink=ListSink(),
    )
    run = session.run("pipeline_step()", block=False, sink=ListSink())
    while not any(f["name"] == "slow_loss" for f in session.where(1)[0].stack):
        time.sleep(0.1)
    session.interrupt()
    while run.child_states()[1] != "error":  # (a cell sent sooner is queued behind it)
        time.sleep(0.01)
    if then == "wait":
        with pytest.raises(RankError) as info:
            run.wait()
        assert _CUT_NOTE in str(info.value), str(info.value)
    # As it says: the same schedule's next step fails on the last stage, with torch's own
    # error ("Expecting 4 losses but got 5" here; "Failed to run stage backward" where the
    # step was cut in its backward).
    err = failing_cell(session, "pipeline_step()")
    if then == "next cell":
        # The group was formed again before that cell, which says so.
        assert f"nbdist: {_CUT_NOTE}" in capsys.readouterr().err, str(err)
        with pytest.raises(RankError):
            run.wait()
    assert [(f.rank, f.ename) for f in err.failures] == [(1, "RuntimeError")], str(err)
    assert "losses" in err.failures[0].evalue, str(err)
    # Stages and schedule made again, the step runs.
    session.run(_PIPELINE, sink=ListSink())
    reduce_works(session)
