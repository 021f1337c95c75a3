"""A script's init_process_group against the group nbdist formed: what conflicts, what is served.

The function under test decides from the arguments and the group's (backend, world
size, rank); the rank-side path around it is exercised by tests/magics/test_own_code.py
(CPU) and tests/gpu/test_placement_gpu.py (a shared GPU).
"""

from __future__ import annotations

from nbdist.engine.user_group import check_conflict

SHARED = "ranks 0,1 share GPU 0 and this torch's NCCL (2.28.9) cannot put two ranks on one GPU (2.30 can)"


def test_nccl_is_served_by_gloo_only_where_gloo_stands_in_for_it():
    current = ("gloo", 2, 0)
    # A script asking for NCCL on a shared GPU: gloo stands in, no conflict.
    assert (
        check_conflict(
            backend="nccl", world_size=None, rank=None, current=current, gloo_for_nccl=SHARED
        )
        == ""
    )
    assert (
        check_conflict(
            backend="cpu:gloo,cuda:nccl",
            world_size=-1,
            rank=-1,
            current=current,
            gloo_for_nccl=SHARED,
        )
        == ""
    )
    # Where gloo was the user's choice (nothing stands in), NCCL is a conflict naming the fix.
    conflict = check_conflict(backend="nccl", world_size=None, rank=None, current=current)
    assert "backend='nccl', but nbdist's group uses 'gloo'" in conflict
    assert "%dist_start --backend nccl" in conflict
    # Standing in for NCCL does not excuse another world size.
    conflict = check_conflict(
        backend="nccl", world_size=4, rank=None, current=current, gloo_for_nccl=SHARED
    )
    assert "world_size=4, but nbdist started 2 ranks" in conflict


def test_other_backends_still_conflict_where_gloo_stands_in_for_nccl():
    conflict = check_conflict(
        backend="mpi", world_size=None, rank=None, current=("gloo", 2, 1), gloo_for_nccl=SHARED
    )
    assert "backend='mpi'" in conflict
