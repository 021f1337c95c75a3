"""A collective that outlives its rank's release is ended, not waited for (3 real gloo ranks).

gloo does not wake a send queued behind a full socket, nor a receive halfway through its
data, when the connection closes: after a release such a rank would stay in its call
until the group's timeout (600 s here; the cell's --timeout of 120 s would end the test
with a CellTimeout first). Rank 2 stops rank 1 (SIGSTOP), so that rank 0's 128 MiB
transfer fills the socket and rank 1's receive stops halfway, then fails; rank 1 runs on
8 s later, after the release. Once in a call nbdist records (``dist.send``), once in a
wait it does not see (an ``async_op`` work's ``wait()``, as DDP's backward waits for its
gradient all-reduce in C++), once in a wait on ``batch_isend_irecv``'s works and once on a
bare ``isend``/``irecv``'s (a pipeline schedule's), which gloo's flight recorder does not
record.
"""

from __future__ import annotations

import psutil

import nbdist
from nbdist.driver.sinks import ListSink
from tests.faults.failing import failing_cell

# Rank 1 begins its transfer at once; rank 2 stops it 0.5 s later, so that rank 0's side,
# begun 1 s in, fills the socket and rank 1's receive stops halfway; rank 2 fails.
_HELD = """
import os, signal, threading, time
if rank == 1:
    {rank1}
elif rank == 2:
    time.sleep(0.5)
    os.kill({{pid1}}, signal.SIGSTOP)
    threading.Timer(8.0, os.kill, ({{pid1}}, signal.SIGCONT)).start()
    time.sleep(0.2)
    raise ValueError("bad batch")
else:
    time.sleep(1.0)
    {rank0}
"""


def _ended_by_the_cell(setup: str, cell: str, ended: list[int]) -> str:
    """Run ``setup``, then ``cell`` (rank 1's PID in it) on 3 ranks; the cell's error text.

    Asserts that rank 2's ValueError is the one failure, that the ranks in ``ended`` (and
    only they) are gone with nbdist's words for it, and that a restart brings every rank
    back to a working group.
    """
    s = nbdist.DistSession(3, cpu=True, timeout=120, group_timeout=600, history=False).start()
    try:
        s.run("import os\npid = os.getpid()\nbig = torch.ones(2**25)\n" + setup, sink=ListSink())
        pids = s.pull("pid")
        err = failing_cell(s, cell.format(pid1=pids[1]))
        assert [(f.rank, f.ename) for f in err.failures] == [(2, "ValueError")], str(err)
        assert str(err).endswith("%dist_restart (or restart()) brings every rank back.")
        rows = s.status()
        assert [row["state"] == "dead" for row in rows] == [r in ended for r in range(3)]
        for rank in ended:
            assert not psutil.pid_exists(pids[rank])
            words = str(s.dead_ranks()[rank])
            assert "nbdist ended it, held in a collective after a release" in words

        s.restart()
        s.run("t = torch.ones(1)\ndist.all_reduce(t)", sink=ListSink())
        assert [t.item() for t in s.pull("t")] == [3.0] * 3
        return str(err)
    finally:
        s.stop()


def test_ranks_a_collective_holds_after_the_release_are_ended_and_named():
    cell = _HELD.format(rank1="dist.recv(big, src=0)", rank0="dist.send(big, dst=1)")
    text = _ended_by_the_cell("dist.all_reduce(big)", cell, ended=[0, 1])
    assert (
        "rank 2 failed; rank 0 was ended, still in send #2 10 s after its release (the "
        "wait would last until the group's timeout, 600 s); rank 1 was ended, still in "
        "recv #2 10 s after its release"
    ) in text


def test_a_rank_a_wait_in_cpp_holds_after_the_release_is_ended_and_named():
    # The wait is in C++ (Work.wait), outside nbdist's record: the rank is seen held by its
    # main thread asleep since the release and the flight recorder's unfinished all_reduce.
    setup = "pair = dist.new_group([0, 1])\nif rank < 2:\n    dist.all_reduce(big, group=pair)"
    wait = "dist.all_reduce(big, group=pair, async_op=True).wait()"
    text = _ended_by_the_cell(setup, _HELD.format(rank1=wait, rank0=wait), ended=[1])
    assert (
        "rank 1 was ended, still in all_reduce #2 (waited for in C++: DDP's backward, or "
        "a work's wait()) 10 s after its release (the wait would last until the group's "
        "timeout, 600 s)"
    ) in text


def test_a_rank_a_point_to_point_wait_holds_after_the_release_is_ended_and_named():
    # A pipeline schedule's wait: batch_isend_irecv's works, waited for in C++; gloo's
    # flight recorder has no point-to-point calls, nbdist's record keeps the works.
    p2p = "[w.wait() for w in dist.batch_isend_irecv([dist.P2POp(dist.{}, big, {})])]"
    cell = _HELD.format(rank1=p2p.format("irecv", 0), rank0=p2p.format("isend", 1))
    text = _ended_by_the_cell("dist.all_reduce(big)", cell, ended=[0, 1])
    assert (
        "rank 2 failed; ranks 0 and 1 were ended, still in batch_isend_irecv #2 (waited for "
        "in C++: a work's wait()) 10 s after their release (the wait would last until the "
        "group's timeout, 600 s)."
    ) in text


def test_a_rank_a_bare_isend_or_irecv_wait_holds_after_the_release_is_ended_and_named():
    # torch's pipeline schedules post a batch of sends (or of receives) one by one through
    # dist.isend / dist.irecv and wait on the works: those calls are in nbdist's record too.
    cell = _HELD.format(rank1="dist.irecv(big, 0).wait()", rank0="dist.isend(big, 1).wait()")
    text = _ended_by_the_cell("dist.all_reduce(big)", cell, ended=[0, 1])
    for rank, call in ((0, "isend #2"), (1, "irecv #2")):
        assert (
            f"rank {rank} was ended, still in {call} (waited for in C++: a work's wait()) 10 s "
            "after its release"
        ) in text, text
