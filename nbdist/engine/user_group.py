"""Rank side: a script's own ``init_process_group`` / ``destroy_process_group`` meet nbdist's group.

Code written for torchrun forms the default process group itself and destroys
it at the end. On a rank, nbdist formed it already, and the next cell needs it:

- ``init_process_group(...)`` while nbdist's group is up returns at once and
  the group serves, when the call asks for nothing else (same backend, world
  size and rank, or none given); a call that asks for something else fails
  with :class:`GroupConflict`, naming the argument and the fix. Without a
  group up (a plain process), the call goes to torch. One exception: where
  nbdist's group is gloo only because ranks share a GPU that this torch's NCCL
  cannot share (< 2.30), a script's ``init_process_group("nccl")`` is served by
  it (the script's collectives run on its CUDA tensors over gloo) and says so
  once: a torchrun script written for one GPU per rank then runs unchanged.
- ``destroy_process_group()`` of the default group leaves nbdist's group up
  (the next cell needs it; ``%dist_stop`` ends it) and says so once. Other
  groups (``new_group`` subgroups) are destroyed as asked.

nbdist's own calls use the originals (``nbdist_original`` on each wrapper).
"""

from __future__ import annotations

import sys

__all__ = ["GroupConflict", "install", "original"]

_said: set[str] = set()
# Why gloo stands in for NCCL on this rank's group ('' where it does not): set by install().
_gloo_for_nccl = ""


class GroupConflict(RuntimeError):
    """A script's ``init_process_group`` asked for a different group than the one nbdist formed."""


def original(name: str):
    """torch.distributed's own ``init_process_group`` or ``destroy_process_group``."""
    import torch.distributed as dist

    fn = getattr(dist, name)
    return getattr(fn, "nbdist_original", fn)


def _say_once(key: str, text: str) -> None:
    if key not in _said:
        _said.add(key)
        print(f"nbdist: {text}", file=sys.stderr, flush=True)


def _backend_matches(asked: str, current: str) -> bool:
    # "gloo", "nccl", or a device map such as "cpu:gloo,cuda:nccl".
    wanted = {part.split(":")[-1].strip().lower() for part in asked.split(",") if part.strip()}
    return current.lower() in wanted or not wanted


def _asks_nccl(backend) -> bool:
    return backend is not None and "nccl" in str(backend).lower()


def check_conflict(
    *, backend, world_size, rank, current: tuple[str, int, int], gloo_for_nccl: str = ""
) -> str:
    """What of a script's init arguments conflicts with the group up now ('' if nothing).

    ``gloo_for_nccl``: why a gloo group stands in for NCCL here; an NCCL request is then
    no conflict.
    """
    have_backend, have_world, have_rank = current
    stands_in = bool(gloo_for_nccl) and have_backend == "gloo" and _asks_nccl(backend)
    if backend is not None and not stands_in and not _backend_matches(str(backend), have_backend):
        return (
            f"backend={backend!r}, but nbdist's group uses {have_backend!r}: drop the argument "
            f"(or pass {have_backend!r}), or %dist_stop and %dist_start --backend {backend}"
        )
    if world_size not in (None, -1) and int(world_size) != have_world:
        return (
            f"world_size={world_size}, but nbdist started {have_world} ranks: drop the argument, "
            f"or %dist_stop and %dist_start {world_size}"
        )
    if rank not in (None, -1) and int(rank) != have_rank:
        return f"rank={rank}, but this is rank {have_rank}: drop the argument (RANK is set)"
    return ""


def _init_process_group(
    backend=None, init_method=None, timeout=None, world_size=-1, rank=-1, *args, **kwargs
):
    import torch.distributed as dist

    if not dist.is_initialized():
        return original("init_process_group")(
            backend, init_method, timeout, world_size, rank, *args, **kwargs
        )
    current = (str(dist.get_backend()), dist.get_world_size(), dist.get_rank())
    conflict = check_conflict(
        backend=backend,
        world_size=world_size,
        rank=rank,
        current=current,
        gloo_for_nccl=_gloo_for_nccl,
    )
    if conflict:
        raise GroupConflict(f"init_process_group: nbdist's process group is already up; {conflict}")
    if _gloo_for_nccl and current[0] == "gloo" and _asks_nccl(backend):
        _say_once(
            "init-nccl",
            f"init_process_group(backend={backend!r}): nbdist's group is gloo with CUDA tensors "
            f"here ({_gloo_for_nccl}); it serves this script",
        )
        return None
    _say_once("init", "init_process_group: nbdist's process group is already up and serves this")
    return None


def _destroy_process_group(group=None):
    import torch.distributed as dist

    if group is None or group is dist.group.WORLD:
        _say_once(
            "destroy",
            "destroy_process_group() leaves nbdist's process group up for the next cell "
            "(%dist_stop ends it; in a script %dist_export wrote, the script's end)",
        )
        return None
    return original("destroy_process_group")(group)


def install(*, gloo_for_nccl: str = "") -> None:
    """Wrap both functions in ``torch.distributed`` and its ``distributed_c10d`` (idempotent).

    ``gloo_for_nccl``: why this group is gloo where NCCL would be, if it is (every
    group formation sets it again).
    """
    global _gloo_for_nccl
    _gloo_for_nccl = gloo_for_nccl
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    for name, wrapper in (
        ("init_process_group", _init_process_group),
        ("destroy_process_group", _destroy_process_group),
    ):
        fn = getattr(dist, name)
        if getattr(fn, "nbdist_original", None) is not None:
            continue
        wrapper.nbdist_original = fn
        wrapper.__doc__ = fn.__doc__
        setattr(dist, name, wrapper)
        setattr(c10d, name, wrapper)
