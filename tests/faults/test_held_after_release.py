"""A collective that outlives its rank's release is ended, not waited for (3 real gloo ranks).

gloo does not wake a send queued behind a full socket, nor a receive halfway through its
data, when the connection closes: after a release such a rank would stay in its call
until the group's timeout (600 s here; the cell's --timeout of 120 s would end the test
with a CellTimeout first). Rank 2 stops rank 1 (SIGSTOP), so that rank 0's 128 MiB send
fills the socket and rank 1's receive stops halfway, then fails; rank 1 runs on 8 s later,
after the release.
"""

from __future__ import annotations

import psutil

import nbdist
from nbdist.driver.sinks import ListSink
from tests.faults.failing import failing_cell

_HELD = """
import os, signal, threading, time
if rank == 1:
    dist.recv(big, src=0)
elif rank == 2:
    time.sleep(0.5)  # rank 1's receive is posted: rank 0's send goes out at once
    os.kill({pid1}, signal.SIGSTOP)
    threading.Timer(8.0, os.kill, ({pid1}, signal.SIGCONT)).start()
    time.sleep(0.2)
    raise ValueError("bad batch")
else:
    time.sleep(1.0)
    dist.send(big, dst=1)
"""


def test_ranks_a_collective_holds_after_the_release_are_ended_and_named():
    s = nbdist.DistSession(3, cpu=True, timeout=120, group_timeout=600, history=False).start()
    try:
        s.run(
            "import os\npid = os.getpid()\nbig = torch.ones(2**25)\ndist.all_reduce(big)",
            sink=ListSink(),
        )
        pids = s.pull("pid")
        err = failing_cell(s, _HELD.format(pid1=pids[1]))
        assert [(f.rank, f.ename) for f in err.failures] == [(2, "ValueError")], str(err)
        assert (
            "rank 2 failed; rank 0 was ended, still in send #2 10 s after its release (the "
            "wait would last until the group's timeout, 600 s); rank 1 was ended, still in "
            "recv #2 10 s after its release"
        ) in str(err)
        assert str(err).endswith("%dist_restart (or restart()) brings every rank back.")
        rows = s.status()
        assert [row["state"] for row in rows] == ["dead", "dead", "idle"]
        assert not psutil.pid_exists(pids[0]) and not psutil.pid_exists(pids[1])
        assert "nbdist ended it, held in a collective after a release" in str(s.dead_ranks()[0])

        s.restart()
        s.run("t = torch.ones(1)\ndist.all_reduce(t)", sink=ListSink())
        assert [t.item() for t in s.pull("t")] == [3.0] * 3
    finally:
        s.stop()
