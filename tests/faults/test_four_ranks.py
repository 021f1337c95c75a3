"""4 ranks, where not every rank talks to the failing or dead one (gloo's ring all_reduce)."""

from __future__ import annotations

import pytest

import nbdist
from nbdist.driver.sinks import ListSink
from nbdist.errors import RankError


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
        released = "; the others were released: rank 0 from all_reduce #1, rank 1 from all_reduce #1, rank 3 from all_reduce #1"
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
        assert "rank 3 died; the others were released: rank 0 from all_reduce #" in str(err)
        assert [row["state"] for row in s.status()] == ["idle", "idle", "idle", "dead"]
    finally:
        s.stop()
