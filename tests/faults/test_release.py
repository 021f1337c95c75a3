"""A rank fails, hangs or is interrupted while the others wait in a collective (2 real gloo ranks).

The group's own timeout is set to 60 s here: without nbdist releasing the
ranks, these cells would end with a gloo timeout after a minute (30 minutes
with torch's default) and the assertions on the release below would fail.
"""

from __future__ import annotations

import _thread
import os
import re
import threading
import time

import pytest
import torch

from nbdist.driver.runner import CellTimeout
from nbdist.driver.sinks import ListSink
from nbdist.driver.where import diagnose
from nbdist.errors import RankError, RanksInterrupted
from tests.faults.failing import failing_cell
from tests.faults.two_ranks import reduce_works, two_ranks


@pytest.fixture(scope="module")
def session():
    with two_ranks() as s:
        yield s


def _plain(text: str) -> str:
    return re.sub(r"\x1b\[[0-?]*[ -/]*[@-~]", "", text)


def _interrupt_once_ready(flags, settle: float = 0.5) -> threading.Thread:
    """Interrupt the main thread (as the kernel's Ctrl-C would) once every flag file exists.

    The cells create the files right before they block, so the interrupt lands where the
    test means it to, however slowly the machine runs (a fresh venv compiles on first import).
    """

    def wait_then_interrupt():
        deadline = time.monotonic() + 120
        while not all(os.path.exists(f) for f in flags) and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(settle)  # from "about to block" to blocked
        _thread.interrupt_main()

    thread = threading.Thread(target=wait_then_interrupt, daemon=True)
    thread.start()
    return thread


def test_a_failing_rank_releases_the_other_and_state_survives(session):
    session.run(
        "kept = rank * 10\ntorch.manual_seed(0)\nmodel = torch.nn.Linear(4, 2)\n"
        "w_before = model.weight.detach().clone()",
        sink=ListSink(),
    )
    pids = [r.pid for r in session.ranks]
    with pytest.raises(RankError) as info:
        session.run(
            "t = torch.ones(1)\n"
            "if rank == 1:\n"
            "    raise ValueError('bad batch on rank 1')\n"
            "dist.all_reduce(t)\n",
            sink=ListSink(),
        )
    err = info.value
    # The failing rank and its traceback; the released rank is named, not blamed.
    assert err.ranks == [1]
    assert err.failures[0].ename == "ValueError"
    assert "raise ValueError('bad batch on rank 1')" in _plain(err.failures[0].traceback)
    assert "rank 1 failed; the others were released: rank 0 from all_reduce #1" in str(err)
    assert "formed again; variables and models are kept" in str(err)
    # Same processes, same state, and the group works without a restart.
    assert [r.pid for r in session.ranks] == pids
    assert session.pull("kept") == [0, 10]
    session.run("same = bool((model.weight == w_before).all())", sink=ListSink())
    assert session.pull("same") == [True, True]
    reduce_works(session)


def test_a_ddp_model_wrapped_again_trains_after_a_release(session):
    session.run(
        "from torch.nn.parallel import DistributedDataParallel as DDP\n"
        "torch.manual_seed(0)\nddp = DDP(torch.nn.Linear(4, 1))\n"
        "opt = torch.optim.SGD(ddp.parameters(), lr=0.1)\n"
        "def step():\n"
        "    opt.zero_grad(); ddp(torch.ones(2, 4) * (rank + 1)).sum().backward(); opt.step()\n"
        "step()\n",
        sink=ListSink(),
    )
    with pytest.raises(RankError):
        session.run("if rank == 1:\n    raise ValueError('x')\nstep()", sink=ListSink())
    # The module (and its trained weights) stayed; the wrapper is bound to the old group.
    session.run(
        "ddp = DDP(ddp.module)\nopt = torch.optim.SGD(ddp.parameters(), lr=0.1)\nstep()\n"
        "w = ddp.module.weight.detach().clone()",
        sink=ListSink(),
    )
    w0, w1 = session.pull("w")
    assert torch.equal(w0, w1)  # gradients were averaged over both ranks again


def test_a_collective_of_a_subgroup_is_released_too_and_what_holds_the_old_group_is_named(
    session,
):
    session.run(
        "from torch.distributed.device_mesh import init_device_mesh\n"
        "from torch.distributed.fsdp import fully_shard\n"
        "from torch.distributed.tensor import Shard, distribute_tensor\n"
        "sub = dist.new_group([0, 1])\n"
        "mesh = init_device_mesh('cpu', (2,))\n"
        "dt = distribute_tensor(torch.ones(4, 2), mesh, [Shard(0)])\n"
        "sharded = fully_shard(torch.nn.Linear(4, 4), mesh=mesh)\n"
        "adam = torch.optim.Adam(sharded.parameters())\n"
        "import types\nholder = types.SimpleNamespace(group=sub)\n"
        "plain = torch.nn.Linear(2, 2)\n"
        "class Trainer:\n"
        "    def __init__(self):\n"
        "        self.model, self.opt, self.steps = sharded, adam, 0\n"
        "trainer = Trainer()\n"
        "shards = {'weight': sharded.weight, 'plain': plain.weight}\n"
        "tensors = list(sharded.parameters()) + [plain.weight]\n",
        sink=ListSink(),
    )
    with pytest.raises(RankError) as info:
        session.run(
            "if rank == 0:\n    raise KeyError('rank 0')\ndist.all_reduce(torch.ones(1), group=sub)",
            sink=ListSink(),
        )
    assert info.value.ranks == [0]
    message = str(info.value)
    assert "the others were released: rank 1 from all_reduce #" in message
    reduce_works(session)
    # The note names every variable bound to the old group (ddp: the test above), and
    # one level inside the others (a trainer's attributes, a dict's entries; a list
    # holding several is named once), and nothing else; the subgroup and the sharded
    # module then fail as it says.
    head = "but these were made with the old group: make them again before using them: "
    assert head in message, message
    named = message.split(head)[1].rstrip(".").split(", ")
    assert sorted(named) == [
        "adam (Adam over DTensor parameters)",
        "ddp (DistributedDataParallel)",
        "dt (DTensor)",
        "holder (SimpleNamespace)",
        "mesh (DeviceMesh)",
        "sharded (FSDPLinear with DTensor parameters)",
        "shards['weight'] (DTensor)",
        "sub (process group)",
        "tensors (list holding 2: DTensor)",
        "trainer.model (FSDPLinear with DTensor parameters)",
        "trainer.opt (Adam over DTensor parameters)",
    ], message
    for stale in ("dist.all_reduce(torch.ones(1), group=sub)", "sharded(torch.ones(1, 4))"):
        with pytest.raises(RankError, match="not initialized in the world group map"):
            session.run(stale, sink=ListSink())
    session.run(
        "del ddp, sub, mesh, dt, sharded, adam, holder, trainer, shards, tensors", sink=ListSink()
    )


def test_a_group_formed_again_before_a_cell_names_what_holds_the_old_group(session, capsys):
    # After a release whose re-formation failed, the group stays marked released (that is
    # all reform_group leaves) and the next cell forms it first: what holds the old group
    # is named there, since the failed cell's note could not name it.
    session.run("sub = dist.new_group([0, 1])\nkept = torch.ones(1)", sink=ListSink())
    session.group.released = True
    capsys.readouterr()
    session.run("after = 1", sink=ListSink())
    err = capsys.readouterr().err
    assert "the process group was formed again before this cell" in err, err
    assert err.rstrip().endswith("make them again before using them: sub (process group)"), err
    reduce_works(session)
    session.run("del sub, kept, after", sink=ListSink())


def test_a_rank_still_computing_is_interrupted_when_another_fails(session):
    # A collective that raised in an earlier cell (caught) is the ranks' last one: it must
    # not be taken for one this cell's rank 1 is failing out of (it was, and rank 1 slept on).
    session.run(
        "try:\n    dist.all_reduce(torch.ones(1), group='no such group')\n"
        "except Exception as exc:\n    caught = exc\n"
        "last = nbdist.engine.collectives.last()\n",
        sink=ListSink(),
    )
    assert all(c["raised"] and c["op"] == "all_reduce" for c in session.pull("last"))
    assert all(c["this_cell"] for c in session.pull("last"))
    # The next cell tells it from one of its own on the rank's clock: the kernel's, compared
    # with the call's age, took it for one rank 1 was failing out of under load (once in CI).
    session.run("later = nbdist.engine.collectives.last()", sink=ListSink())
    assert [c["this_cell"] for c in session.pull("later")] == [False, False]
    with pytest.raises(RankError) as info:
        session.run(
            "import time\n"
            "if rank == 0:\n"
            "    raise RuntimeError('rank 0 gives up')\n"
            "time.sleep(120)\n"
            "dist.all_reduce(torch.ones(1))\n",
            sink=ListSink(),
        )
    # Rank 1 computes on (no collective waits for rank 0 yet): it gets a few seconds to
    # finish or fail by itself, then it is interrupted.
    assert info.value.ranks == [0]
    assert "rank 1 from its running code (interrupted)" in str(info.value)
    reduce_works(session)


def _rank_1_holds_the_gil(session, sleep: str, then: str = "") -> str:
    """Run a cell where rank 0 fails at once and rank 1 sleeps in C holding the GIL (libc's
    ``sleep``, called through ``ctypes.PyDLL``: its control thread cannot answer), then runs
    ``then``; the cell's error text, rank 0 its one failure."""
    with pytest.raises(RankError) as info:
        session.run(
            "import ctypes, time\n"
            "if rank == 0:\n"
            "    raise RuntimeError('rank 0 gives up')\n"
            # A moment without the GIL first: the rank's "busy" (its beginning) gets out.
            "time.sleep(0.5)\n"
            f"ctypes.PyDLL(None).{sleep}\n{then}\n",
            sink=ListSink(),
        )
    assert info.value.ranks == [0]
    return str(info.value)


def test_a_rank_that_cannot_say_where_it_is_is_asked_again_once_the_cell_ended(session):
    # Rank 1 sleeps in C holding the GIL (a PyDLL call), so its control thread cannot answer
    # the release's question; the SIGINT ends its sleep. Once named "from its running code"
    # unasked (and so were 31 ranks waiting in an all_reduce on a machine too loaded to
    # answer within 1 s), then "interrupted where it was (no answer within 1 s)": asked again
    # once the cell ended, it says its last collective is not this cell's.
    text = _rank_1_holds_the_gil(session, "sleep(60)")
    assert "the others were released: rank 1 from its running code (interrupted)." in text, text
    assert "no answer" not in text, text
    reduce_works(session)


def test_a_rank_that_could_not_answer_inside_a_collective_is_named_by_it_once_the_cell_ended(
    session,
):
    # Rank 1 waits in all_reduce while another of its threads holds the GIL (a PyDLL call)
    # for 15 s, past the release and its SIGINT (about 10 s after rank 0's failure): its
    # control thread cannot answer. Before: "interrupted where it was (no answer within 1 s)",
    # as were 142 of 256 ranks waiting in one all_reduce on 2 cores (2026-12-07).
    with pytest.raises(RankError) as info:
        session.run(
            "import ctypes, threading, time\n"
            "if rank == 0:\n"
            "    raise RuntimeError('rank 0 gives up')\n"
            "def hold():\n"
            "    time.sleep(0.5)  # while the main thread enters the all_reduce\n"
            "    ctypes.PyDLL(None).usleep(15_000_000)\n"
            "threading.Thread(target=hold).start()\n"
            "dist.all_reduce(torch.ones(1))\n",
            sink=ListSink(),
        )
    text = _plain(str(info.value))
    assert info.value.ranks == [0]
    assert re.search(
        r"the others were released: rank 1 from all_reduce #\d+ \(interrupted\)\.", text
    ), text
    reduce_works(session)


def test_a_rank_that_could_not_answer_then_ended_by_itself_is_named_by_its_collective(session):
    # Rank 1 holds the GIL (a PyDLL call) for 7 s, past the release (5 s after rank 0's
    # failure, then 1 s asking): then it calls all_reduce, which the release ended. Before:
    # named "from its running code", its end not looked at (as were ranks inside an
    # all_reduce on a machine too loaded to answer within 1 s, once in a full run of the
    # tests), or SIGINTed when 0.3 s had passed. A rank that did not answer now gets 2 s,
    # and is asked again once it has ended.
    text = _plain(
        _rank_1_holds_the_gil(session, "usleep(6_500_000)", "dist.all_reduce(torch.ones(1))")
    )
    assert re.search(r"the others were released: rank 1 from all_reduce #\d+\.", text), text
    reduce_works(session)


def test_ranks_failing_the_same_way_seconds_apart_keep_the_group(session):
    # The same error reaches ranks seconds apart (at 96 ranks a NameError's cell reaches the
    # last ranks seconds after the first fail; here rank 1 computes 1.5 s longer). Neither
    # waits for the other in a collective, so each fails by itself and the group is kept:
    # before, the rank still computing was interrupted 0.5 s after rank 0 failed and the
    # group was formed again (slow at many ranks, and every subgroup made again by hand).
    session.run("sub = dist.new_group([0, 1])", sink=ListSink())
    with pytest.raises(RankError) as info:
        session.run(
            "import time\ntime.sleep(1.5 * rank)\nraise ValueError('the same on every rank')",
            sink=ListSink(),
        )
    assert info.value.ranks == [0, 1]
    assert "released" not in str(info.value), str(info.value)
    assert "formed again" not in str(info.value), str(info.value)
    session.run("t = torch.ones(1)\ndist.all_reduce(t, group=sub)", sink=ListSink())
    assert [t.item() for t in session.pull("t")] == [2.0, 2.0]
    session.run("del sub", sink=ListSink())


def test_interrupt_while_blocked_in_a_collective(session, tmp_path):
    # Rank 0 waits in all_reduce for rank 1, which sleeps: SIGINT alone would not
    # reach rank 0 before the group's timeout.
    flags = [str(tmp_path / f"ready-{r}") for r in range(2)]
    interrupter = _interrupt_once_ready(flags)
    with pytest.raises(RanksInterrupted) as info:
        session.run(
            f"import time\nopen({flags!r}[rank], 'w').close()\n"
            "if rank == 1:\n    time.sleep(120)\ndist.all_reduce(torch.ones(1))",
            sink=ListSink(),
        )
    interrupter.join()
    assert info.value.still_running == ()
    assert str(info.value) == "interrupted; every rank stopped"
    # Where they were when interrupted: rank 0 waiting for rank 1.
    assert re.search(r"rank 0: inside all_reduce #\d+ for ", info.value.where)
    assert "rank 1: never entered all_reduce #" in info.value.where
    assert "the others were released: rank 0 from all_reduce #" in info.value.note
    reduce_works(session)


def test_ranks_stopped_at_different_collectives_get_a_fresh_group(session, tmp_path):
    # Rank 0 posts a send (its collective count moves on) and both then sleep:
    # SIGINT stops both in Python, at different collective counts.
    flags = [str(tmp_path / f"ready-{r}") for r in range(2)]
    interrupter = _interrupt_once_ready(flags)
    with pytest.raises(RanksInterrupted):
        session.run(
            "import time\nif rank == 0:\n    dist.broadcast(torch.ones(1), 0, async_op=True)\n"
            f"open({flags!r}[rank], 'w').close()\ntime.sleep(120)",
            sink=ListSink(),
        )
    interrupter.join()
    session.run("from nbdist.engine import collectives\nlast = collectives.last()", sink=ListSink())
    assert session.pull("last") == [None, None]  # counting restarted with a new group
    reduce_works(session)


def test_where_shows_who_never_entered_the_collective_without_stopping_anything(session):
    run = session.run(
        "import time\n"
        "dist.barrier()\n"
        "if rank == 1:\n"
        "    time.sleep(120)  # rank 1 is late\n"
        "dist.all_reduce(torch.ones(1))\n",
        block=False,
        sink=ListSink(),
    )
    try:
        found = []
        deadline = time.monotonic() + 60
        # Until rank 0 is inside its all_reduce and rank 1 sleeps: rank 0 leaves the
        # barrier once rank 1 entered it, so rank 1 may still be returning from it. Rank 0's
        # record is read before its stack: once it says inside, the stack shows the call.
        while time.monotonic() < deadline:
            found = session.where()
            c = found[0].collective
            asleep = any("time.sleep(120)" in f["code"] for f in found[1].stack)
            calling = any("dist.all_reduce" in f["code"] for f in found[0].stack)
            if c and c["inside"] and c["op"] == "all_reduce" and asleep and calling:
                break
            time.sleep(0.02)
        seq = found[0].collective["seq"]
        lines = diagnose(found)
        assert lines[0].startswith(f"inside all_reduce #{seq} for ")
        assert lines[1].startswith(f"never entered all_reduce #{seq} (last: barrier #{seq - 1},")
        assert any("time.sleep(120)" in f["code"] for f in found[1].stack)
        assert any("dist.all_reduce" in f["code"] for f in found[0].stack)
        assert not run.done()  # asking stopped nothing
    finally:
        session.interrupt([1])
        # Bounded: if the release failed, fail here (CellTimeout) rather than hang the suite.
        run._timeout = time.monotonic() - run._started + 60
        with pytest.raises(RankError):
            run.wait()
    reduce_works(session)


def test_timeout_reports_where_each_rank_was(session):
    with pytest.raises(CellTimeout) as info:
        session.run(
            "import time\ndist.barrier()\nif rank == 0:\n    time.sleep(120)\n"
            "dist.all_reduce(torch.ones(1))",
            timeout=2,
            sink=ListSink(),
        )
    text = str(info.value)
    seq = int(re.search(r"rank 1: inside all_reduce #(\d+) for ", text).group(1))
    assert f"rank 0: never entered all_reduce #{seq} (last: barrier #{seq - 1}," in text
    assert "time.sleep(120)" in text
    assert "the cell was interrupted; the others were released: " in text
    assert f"rank 1 from all_reduce #{seq}. The process group was formed again" in text
    reduce_works(session)


def test_a_rank_that_makes_the_call_in_a_later_queued_cell_is_waited_for(session):
    # Rank 1 finishes cell A at once and makes the matching barrier in cell B, queued
    # behind it, 5 s later (beyond the guard's 3 s): it is busy, not gone, so rank 0's
    # wait in A is not cut.
    first = session.run("if rank == 0:\n    dist.barrier()\n", block=False, sink=ListSink())
    second = session.run(
        "import time\ntime.sleep(5)\ndist.barrier()\n", ranks=[1], block=False, sink=ListSink()
    )
    first.wait()
    second.wait()
    reduce_works(session)


def test_a_rank_that_begins_the_cell_late_is_not_interrupted_in_the_one_before(session):
    # Rank 1 still runs an earlier cell (sent without waiting) when rank 0 fails this one at
    # once. A rank's seconds after a failure count from when it begins the cell: rank 1 is
    # not interrupted in the earlier cell 5 s after rank 0 failed, and then fails the same
    # way by itself.
    earlier = session.run(
        "import time\ntime.sleep(7)\nslept = True", ranks=[1], block=False, sink=ListSink()
    )
    with pytest.raises(RankError) as info:
        session.run("raise ValueError('the same on every rank')", sink=ListSink())
    assert info.value.ranks == [0, 1]
    assert "released" not in str(info.value), str(info.value)
    earlier.wait()
    assert session.pull("slept", rank=1) is True
    reduce_works(session)


@pytest.mark.parametrize(
    "cell, rank0, rank1",
    [
        # Different collectives at once: gloo waits for the group's timeout (60 s here).
        (
            "t = torch.ones(4)\nif rank == 0:\n    dist.all_reduce(t)\nelse:\n    dist.broadcast(t, 0)\n",
            "waited in all_reduce #1 while rank 1 waited in broadcast #1",
            "waited in broadcast #1 while rank 0 waited in all_reduce #1",
        ),
        # Each rank waits to receive from the other: neither ever sends.
        (
            "got = torch.zeros(1)\ndist.recv(got, 1 - rank)\n",
            "waited in recv #1 while rank 1 waited in recv from it too",
            "waited in recv #1 while rank 0 waited in recv from it too",
        ),
        # Each rank waits on its isend's work: a send waits for the peer's receive (a
        # pipeline's schedules out of step, after an interrupt mid-step).
        (
            "dist.isend(torch.ones(4), 1 - rank).wait()\n",
            "waited in isend #1 while rank 1 waited in isend to it too",
            "waited in isend #1 while rank 0 waited in isend to it too",
        ),
    ],
    ids=["all_reduce-vs-broadcast", "recv-recv", "isend-isend-works"],
)
def test_ranks_waiting_in_collectives_that_cannot_match_are_released(session, cell, rank0, rank1):
    session.run("from nbdist.engine import collectives\ncollectives.reset()", sink=ListSink())
    err = failing_cell(session, cell, timeout=50)
    assert [(f.rank, f.ename, f.evalue) for f in err.failures] == [
        (0, "CollectiveMismatch", rank0),
        (1, "CollectiveMismatch", rank1),
    ]
    assert "the same collective calls in the same order" in str(err)
    reduce_works(session)


def test_a_group_broken_by_its_own_timeout_is_formed_again_for_the_next_cell():
    # torch's own functions, not the torch.distributed names nbdist records: nothing tells
    # nbdist where the ranks wait, so gloo's 5 s timeout ends the cell on both ranks.
    with two_ranks(group_timeout=5) as s:
        err = failing_cell(
            s,
            "from torch.distributed import distributed_c10d as c10d\nt = torch.ones(4)\n"
            "if rank == 0:\n    c10d.all_reduce(t)\nelse:\n    c10d.broadcast(t, 0)\n",
            timeout=60,
        )
        assert re.search(
            # Which of gloo's transport errors a rank meets first depends on timing: its own
            # timeout, or the peer's closed socket (closed, reset, a failed read or write).
            r"the process group broke \(rank \d: (Timed out waiting 5000ms|Connection (closed|reset)"
            r"|Read error|Write error|Application timeout).*\)\. The process group was formed again",
            str(err),
        ), str(err)
        # Before: every later collective failed at once with "Connection closed by peer".
        reduce_works(s)


def test_ddp_with_a_step_more_on_one_rank_is_released_naming_the_uneven_steps(session):
    # Rank 0 runs a third step: DDP's gradient all-reduce (issued from C++, which nbdist's
    # records do not see) waits for rank 1, which finished after two. The flight recorder
    # shows a call rank 1 never issued. Before: the group's timeout (60 s here; --timeout 50).
    err = failing_cell(
        session,
        "from torch.nn.parallel import DistributedDataParallel as DDP\n"
        "ddp = DDP(torch.nn.Linear(4, 4))\n"
        "for step in range(3 if rank == 0 else 2):\n"
        "    ddp(torch.randn(8, 4)).sum().backward()\n",
        timeout=50,
    )
    [failure] = err.failures
    assert (failure.rank, failure.ename) == (0, "CollectiveMismatch")
    assert re.fullmatch(
        r"waited in all_reduce #\d+ of the process group \(issued by torch itself, e\.g\. DDP's "
        r"gradient all-reduce\) for rank 1, which finished the cell without issuing it: did the "
        r"ranks run different numbers of steps\? .*",
        failure.evalue,
    ), failure.evalue
    # Its wait ends once the sockets close, or on the SIGINT that follows 0.3 s later.
    assert re.search(
        r"released: rank 0 from all_reduce #\d+( \(interrupted\))?\. The process group",
        str(err),
    ), str(err)
    reduce_works(session)
    # The released call stays open in the recorder, under the old group: a later cell in
    # which rank 0 works alone for longer than the guard's grace is not taken for a hang.
    session.run("import time\nif rank == 0:\n    time.sleep(5)\n", timeout=50, sink=ListSink())


def test_an_interrupt_from_outside_the_kernel_reads_as_an_interrupt_not_a_failure(session):
    """The sidebar's interrupt sends SIGINT to the ranks by PID (``DistSession.interrupt``),
    not through the kernel: rank 1 stops on it, rank 0 waits in a receive that no SIGINT
    ends, and is released. Before, the cell's error said "rank 1 failed" of a rank the user
    interrupted."""
    run = session.run(
        "t = torch.zeros(1)\nif rank == 0:\n    dist.recv(t, src=1)\n"
        "else:\n    import time\n    time.sleep(120)",
        block=False,
        timeout=60,
        sink=ListSink(),
    )
    deadline = time.monotonic() + 60
    while not (session.where([0])[0].collective or {}).get("inside"):
        assert time.monotonic() < deadline, "rank 0 never waited in its receive"
        time.sleep(0.05)
    session.interrupt()
    with pytest.raises(RankError) as info:
        run.wait()
    text = str(info.value)
    assert [(f.rank, f.ename) for f in info.value.failures] == [(1, "KeyboardInterrupt")], text
    assert "the cell was interrupted; the others were released: rank 0 from recv #" in text, text
    assert "rank 1 failed" not in text
    reduce_works(session)
