"""``check_collectives`` on GPU ranks: torch's collective check wraps NCCL (or gloo with CUDA
tensors) and names a mismatch of CUDA tensors at once; matched calls still give exact sums.

(The CPU tests: tests/faults/test_collective_arguments.py.)
"""

from __future__ import annotations

import pytest

from nbdist.driver.sinks import ListSink
from nbdist.errors import RankError


def _sums(session) -> list[float]:
    """An all-reduce of CUDA tensors on every rank: small integers in float32, exact."""
    session.run(
        "t = torch.full((1024,), float(rank + 1), device=device)\n"
        "dist.all_reduce(t)\n"
        "total = t.sum().item()\n",
        sink=ListSink(),
    )
    return session.pull("total")


def test_two_gpu_ranks_name_cuda_tensors_of_different_sizes(start_session):
    """Two ranks as ``%dist_start 2`` gives them here (sharing GPU 0 on a one-GPU machine)."""
    s = start_session(2, check_collectives=True)
    with pytest.raises(RankError) as caught:
        s.run(
            "t = torch.ones(4 if rank == 0 else 1, device=device)\ndist.all_reduce(t)",
            sink=ListSink(),
        )
    text = str(caught.value)
    assert sorted(f.rank for f in caught.value.failures) == [0, 1], text
    assert "Detected mismatch between collectives on ranks" in text, text
    assert "Tensor shapes: 4vs 1" in text, text
    assert _sums(s) == [1024 * 3.0] * 2


def test_one_nccl_rank_runs_checked_collectives(start_session):
    s = start_session(1, backend="nccl", check_collectives=True)
    assert "each collective is compared across the ranks" in s.summary()
    assert _sums(s) == [1024.0]
