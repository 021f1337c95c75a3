"""NCCL ranks released from a collective when one rank fails (communicators aborted, group formed again).

Skipped without at least 2 CUDA GPUs (NCCL before 2.30 refuses two ranks on one GPU).
"""

from __future__ import annotations

import pytest
import torch

import nbdist
from nbdist.driver.sinks import ListSink
from nbdist.errors import RankError

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs"
)


def test_a_failing_rank_releases_nccl_ranks_and_the_group_works_again():
    s = nbdist.DistSession(2, timeout=300, group_timeout=120, history=False).start()
    try:
        assert s.backend == "nccl"
        s.run("kept = torch.full((4,), float(rank), device=device)", sink=ListSink())
        with pytest.raises(RankError) as info:
            s.run(
                "t = torch.ones(4, device=device)\n"
                "if rank == 1:\n"
                "    raise ValueError('rank 1 broke')\n"
                "dist.all_reduce(t)\n"
                "torch.cuda.synchronize()\n",
                sink=ListSink(),
            )
        assert info.value.ranks == [1]
        assert "the others were released: rank 0 from" in str(info.value)
        s.run("t = kept.clone()\ndist.all_reduce(t)\ntotal = t.sum().item()", sink=ListSink())
        assert s.pull("total") == [4.0, 4.0]
    finally:
        s.stop()
