"""Rank side: DTensor's caches forget the meshes of a process group that is formed again.

DTensor caches what it worked out for an operation (the output's sharding, a
redistribution plan) under keys that hold the input's ``DeviceMesh``, and a
``DeviceMesh`` compares equal to any other over the same ranks, shape and dimension
names: its process groups are not part of its identity. After nbdist forms the group
again (a release), a new mesh of the same shape is such an equal, so a cache hit hands
back the old mesh, whose groups were destroyed with the old group: the first
collective of a new tensor-parallel model then fails with "Could not resolve the
process group registered under the name 15", naming neither the cache nor the fix.
Forgetting what the caches hold when the group is formed again makes every new
mesh's operations worked out afresh, with its own groups. (Megatron-LM met the same
when it destroyed its groups, NVIDIA/Megatron-LM#7029.)

Only caches torch keeps today are touched; each is looked up and skipped where this
torch has none (the caches are private and change between versions).
"""

from __future__ import annotations

import sys
import threading

__all__ = ["forget_meshes"]


def forget_meshes() -> None:
    """Empty DTensor's caches that can hold a mesh; never raises (the group must form again).

    Nothing is imported: a rank that never loaded DTensor has nothing cached.
    """
    if "torch.distributed.tensor" not in sys.modules:
        return
    for forget in (_sharding_propagation, _native_sharding_propagation, _planners, _topology):
        try:
            forget()
        except Exception:  # an older or newer torch without this cache: nothing to forget
            pass


def _sharding_propagation() -> None:
    from torch.distributed.tensor import DTensor

    propagator = DTensor._op_dispatcher.sharding_propagator  # noqa: SLF001
    cached = propagator.propagate_op_sharding
    if isinstance(cached, threading.local):
        # One cache per thread (a GPU's autograd threads have their own): a new object
        # empties every thread's at once, where cache_clear() empties this one's.
        propagator.propagate_op_sharding = type(cached)(propagator.propagate_op_sharding_non_cached)
    else:
        cached.cache_clear()


def _native_sharding_propagation() -> None:
    # The C++ dispatch fast path's own copy of the sharding propagation cache.
    import torch

    torch._C._clear_DTensor_sharding_propagator_cache()  # noqa: SLF001


def _planners() -> None:
    # Keyed by a weak reference to the mesh, which compares as the mesh does.
    from torch.distributed.tensor import _redistribute

    _redistribute.clear_redistribute_planner_cache()


def _topology() -> None:
    from torch.distributed.tensor._collective_utils import MeshTopoInfo

    MeshTopoInfo.build_from_mesh.cache_clear()
