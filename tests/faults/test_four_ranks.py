"""4 ranks, where not every rank talks to the failing or dead one (gloo's ring all_reduce)."""

from __future__ import annotations

import re

import pytest
import torch

import nbdist
from nbdist.driver.sinks import ListSink
from nbdist.errors import RankError
from tests.faults.failing import failing_cell


def test_one_of_four_fails_and_all_three_others_are_released():
    s = nbdist.DistSession(4, cpu=True, timeout=120, group_timeout=60, history=False).start()
    try:
        s.run("kept = rank", sink=ListSink())
        with pytest.raises(RankError) as info:
            s.run(
                "t = torch.ones(1000)\n"
                "if rank == 2:\n"
                "    raise ValueError('rank 2 broke')\n"
                "dist.all_reduce(t)\n",
                sink=ListSink(),
            )
        err = info.value
        assert err.ranks == [2]
        # Ranks released from the same call are named together (at 256 ranks one part each
        # filled the screen).
        released = "; the others were released: ranks 0, 1 and 3 from all_reduce #1"
        assert f"rank 2 failed{released}." in str(err)
        s.run("t = torch.ones(1) * kept\ndist.all_reduce(t)", sink=ListSink())
        assert [t.item() for t in s.pull("t")] == [6.0] * 4

        # Rank 3 dies: its ring neighbours see the closed connection, rank 1 would not.
        with pytest.raises(RankError) as info:
            s.run(
                "import os, time\nif rank == 3:\n    time.sleep(0.3)\n    os._exit(7)\n"
                "dist.all_reduce(torch.ones(1000))\n",
                sink=ListSink(),
            )
        err = info.value
        assert [(f.rank, f.ename) for f in err.failures] == [(3, "RankDied")]
        assert "exited with code 7" in err.failures[0].evalue
        assert re.search(
            r"rank 3 died; the others were released: ranks? 0\b.* from all_reduce #", str(err)
        ), str(err)
        assert [row["state"] for row in s.status()] == ["idle", "idle", "idle", "dead"]
    finally:
        s.stop()


# Rank 3 closes its connections to rank 0 (as when its host goes down), then dies 0.3 s later.
_CLOSE_THEN_DIE = """
import os, socket, time, psutil
if rank == 3:
    theirs = {{c.laddr for c in psutil.Process({pid0}).net_connections("tcp")}}
    for c in psutil.Process().net_connections("tcp"):
        if c.raddr and c.raddr in theirs:
            socket.fromfd(c.fd, c.family, c.type).shutdown(socket.SHUT_RDWR)
    time.sleep(0.3)
    os._exit(7)
{collective}
"""


def test_a_neighbour_that_failed_before_the_death_was_known_is_released_not_failed():
    """Rank 0's all_reduce fails on the closed connection 0.3 s before rank 3 dies: its
    error reached the kernel first (it once did so when rank 3 just died, the closed
    connection and the death racing). It is the death's consequence, not rank 0's own."""
    s = nbdist.DistSession(4, cpu=True, timeout=120, group_timeout=60, history=False).start()
    try:
        s.run("import os\npid = os.getpid()\ndist.all_reduce(torch.ones(1000))", sink=ListSink())
        pid0 = s.pull("pid", rank=0)
        cell = _CLOSE_THEN_DIE.format(pid0=pid0, collective="dist.all_reduce(torch.ones(1000))")
        with pytest.raises(RankError) as info:
            s.run(cell, sink=ListSink())
        err = info.value
        assert [(f.rank, f.ename) for f in err.failures] == [(3, "RankDied")], str(err)
        assert re.search(
            r"rank 3 died; the others were released: ranks 0, 1 and 2 from all_reduce #2\.",
            str(err),
        ), str(err)
        assert [row["state"] for row in s.status()] == ["idle", "idle", "idle", "dead"]

        # DDP's all-reduce, issued from C++, is not nbdist's record: rank 0 failed in its
        # backward, and the note says so instead of naming an older collective.
        s.restart()
        s.run(
            "import os\npid = os.getpid()\n"
            "from torch.nn.parallel import DistributedDataParallel as DDP\n"
            "ddp = DDP(torch.nn.Linear(1000, 1000))\ndist.all_reduce(torch.ones(1))\n",
            sink=ListSink(),
        )
        pid0 = s.pull("pid", rank=0)
        cell = _CLOSE_THEN_DIE.format(
            pid0=pid0, collective="ddp(torch.ones(8, 1000)).sum().backward()"
        )
        with pytest.raises(RankError) as info:
            s.run(cell, sink=ListSink())
        err = info.value
        assert [(f.rank, f.ename) for f in err.failures] == [(3, "RankDied")], str(err)
        assert re.search(
            # "(ranks 1 and 2 interrupted)" where others of that place ended by themselves.
            r"rank 3 died; the others were released: (.*, )?(rank 0|ranks 0\b[^;.]*?) from (its|their) "
            r"running code( \([^)]*interrupted\))?[,.]",
            str(err),
        ), str(err)
        assert "#" not in str(err).rsplit("died;", 1)[1], str(err)
    finally:
        s.stop()


# Rank 1 is late by more than the guard's grace: a wait that ends by itself must not be cut.
_LATE_S = 5.0


def test_a_collective_some_ranks_skip_is_released_and_one_that_can_end_is_not():
    # group_timeout 600 and --timeout 120: without the release, the cell would time out
    # (CellTimeout) long before the group did.
    s = nbdist.DistSession(4, cpu=True, timeout=120, group_timeout=600, history=False).start()
    try:
        s.run("import time\nkept = rank", sink=ListSink())
        # Ranks 2 and 3 finish the cell; ranks 0 and 1 wait in a barrier of all four.
        err = failing_cell(s, "if rank < 2:\n    dist.barrier()\n")
        assert [(f.rank, f.ename) for f in err.failures] == [
            (0, "CollectiveMismatch"),
            (1, "CollectiveMismatch"),
        ]
        assert err.failures[0].evalue == (
            "waited in barrier #1 for ranks 2 and 3, which finished the cell without entering it"
        )
        assert "call them on every rank); released: ranks 0 and 1 from barrier #1." in str(err)
        assert "The process group was formed again" in str(err)
        s.run("t = torch.ones(1) * kept\ndist.all_reduce(t)", sink=ListSink())
        assert [t.item() for t in s.pull("t")] == [6.0] * 4

        # nbdist.checkpoint.save on rank 0 alone: the same, named by its collective.
        [failure] = failing_cell(
            s,
            "import tempfile\nmodel = torch.nn.Linear(2, 2)\nif rank == 0:\n"
            "    nbdist.checkpoint.save(tempfile.mkdtemp() + '/step_1', model=model)\n",
        ).failures
        assert (failure.rank, failure.ename) == (0, "CollectiveMismatch")
        assert failure.evalue.startswith("waited in all_gather_object #")
        assert "for ranks 1, 2 and 3, which finished the cell" in failure.evalue

        # A gather to rank 0 with rank 2 late, on the group formed again above: ranks 1 and
        # 3 send their parts, return and finish the cell while the root waits for rank 2
        # (it was released as a mismatch, "ranks 1 and 3 made gather #1 too and returned").
        s.run(
            f"if rank == 2:\n    time.sleep({_LATE_S})\n"
            "parts = [torch.zeros(1) for _ in range(4)] if rank == 0 else None\n"
            "dist.gather(torch.ones(1) * kept, parts, dst=0)\n",
            timeout=120,
            sink=ListSink(),
        )
        assert [t.item() for t in s.pull("parts", rank=0)] == [0.0, 1.0, 2.0, 3.0]
        # Waits that end by themselves, while ranks 2 and 3 have finished: an all_reduce
        # of the pair {0, 1} and a recv from rank 1, each with rank 1 late. (The pair is
        # made here: a group made before a release belongs to the group formed before it.)
        s.run("pair = dist.new_group([0, 1])", sink=ListSink())
        s.run(
            f"if rank < 2:\n    if rank == 1:\n        time.sleep({_LATE_S})\n"
            "    t = torch.ones(1) * kept\n    dist.all_reduce(t, group=pair)\n",
            timeout=120,
            sink=ListSink(),
        )
        assert [t.item() for t in s.pull("t")[:2]] == [1.0, 1.0]
        s.run(
            f"if rank == 1:\n    time.sleep({_LATE_S})\n    dist.send(torch.full((1,), 7.0), 0)\n"
            "elif rank == 0:\n    got = torch.zeros(1)\n    dist.recv(got, 1)\n",
            timeout=120,
            sink=ListSink(),
        )
        assert s.pull("got", rank=0).item() == 7.0
    finally:
        s.stop()


def test_a_tensor_parallel_model_made_again_after_a_release_runs_on_the_new_group():
    """DTensor caches an operation's output sharding under a key holding the mesh, and a mesh
    equals any other of the same shape whatever its process groups: after the group was formed
    again, a new model's first forward got the old mesh back and failed with "Could not resolve
    the process group registered under the name 13" (its tensor-parallel group, destroyed with
    the old group). Ten more groups before the first model give the old meshes' groups other
    names than the new ones (as a session that made other meshes before would)."""
    s = nbdist.DistSession(4, cpu=True, timeout=120, group_timeout=60, history=False).start()
    try:
        s.run(
            "from nbdist.strategies.parallel.tensor_parallel import apply_tp, device_mesh\n"
            "def forward():\n"
            "    torch.manual_seed(0)\n"
            "    model = torch.nn.Sequential(\n"
            "        torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 8))\n"
            "    apply_tp(model, device_mesh((2, 2), ('dp', 'tp'))['tp'], colwise=['0'],"
            " rowwise=['2'])\n"
            "    return model(torch.ones(4, 8)).detach()\n"
            "others = [dist.new_group([0, 1, 2, 3]) for _ in range(10)]\n"
            "before = forward()\n",
            sink=ListSink(),
        )
        failing_cell(s, "if rank == 0:\n    raise ValueError('bad batch')\ndist.barrier()")
        s.run("after = forward()", sink=ListSink())
        for before, after in zip(s.pull("before"), s.pull("after")):
            # The same arithmetic on the same ranks: the same float32 sums in the same order.
            assert torch.equal(before, after)
    finally:
        s.stop()


def test_ranks_that_keep_failing_the_same_way_past_the_wait_are_not_interrupted():
    # Rank r fails 3 r s into the cell: rank 3 computes 9 s after rank 0 failed, past the
    # guard's 5 s wait, but another rank ended at most 3 s before each pass. On a machine with
    # far fewer cores than ranks an error every rank meets arrives like this (256 ranks on
    # 2 cores: tracebacks formatted on a share of a core), and interrupting the last ranks
    # formed the group again for nothing (38 s instead of 5 for such a cell).
    s = nbdist.DistSession(4, cpu=True, timeout=120, group_timeout=60, history=False).start()
    try:
        with pytest.raises(RankError) as info:
            s.run(
                "import time\ntime.sleep(3 * rank)\nraise ValueError('the same on every rank')",
                sink=ListSink(),
            )
        assert info.value.ranks == [0, 1, 2, 3]
        assert "released" not in str(info.value), str(info.value)
        assert "formed again" not in str(info.value), str(info.value)
    finally:
        s.stop()
