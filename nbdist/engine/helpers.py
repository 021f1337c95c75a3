"""Rank side: helpers for code running on a rank (who am I, which device, print once).

They work inside ``%%on_all_ranks`` cells and in scripts under ``torchrun``
(they fall back to the RANK/LOCAL_RANK/WORLD_SIZE environment variables), and
import with torch alone.

Example::

    import nbdist
    nbdist.seed_all(0)                    # seed + rank on every rank
    with nbdist.rank_zero_first():
        data = load_or_download()         # rank 0 fills the cache, then the others read it
    nbdist.print0("world size", nbdist.world_size())
"""

from __future__ import annotations

import builtins
import operator
import os
import random
from contextlib import contextmanager

from nbdist.engine.devices import local_device

__all__ = [
    "device",
    "is_rank",
    "local_rank",
    "print0",
    "remember_identity",
    "rank",
    "rank_zero_first",
    "seed_all",
    "world_size",
]

# Filled in by nbdist when it forms the process group (remember_identity).
_state: dict = {}


def remember_identity(*, rank: int, local_rank: int, world_size: int, device: str) -> None:
    """Record who this process is in the group nbdist formed; the helpers below read it.

    Called on each rank by :mod:`nbdist.engine.bootstrap` (notebook ranks) and
    :mod:`nbdist.engine.standalone` (exported scripts), never by user code.
    """
    _state.update(rank=rank, local_rank=local_rank, world_size=world_size, device=device)


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    return int(value) if value not in (None, "") else default


def is_rank() -> bool:
    """Whether nbdist made this process a rank (of a notebook's session, or an exported
    script's under torchrun); False in a notebook's kernel."""
    return "rank" in _state


def rank() -> int:
    """This process's global rank (0 outside a distributed job)."""
    if "rank" in _state:
        return _state["rank"]
    return _env_int("RANK", 0)


def local_rank() -> int:
    """This process's rank among the ranks of its host."""
    if "local_rank" in _state:
        return _state["local_rank"]
    return _env_int("LOCAL_RANK", 0)


def world_size() -> int:
    """Number of ranks in the job (1 outside a distributed job)."""
    if "world_size" in _state:
        return _state["world_size"]
    return _env_int("WORLD_SIZE", 1)


def device():
    """This rank's ``torch.device`` (``cpu`` on CPU ranks)."""
    import torch

    if "device" in _state:
        return torch.device(_state["device"])
    if "LOCAL_RANK" in os.environ:  # a launcher such as torchrun started this process
        return torch.device(local_device(local_rank()))
    return torch.device("cpu")


def print0(*args, **kwargs) -> None:
    """``print`` on rank 0 only."""
    if rank() == 0:
        builtins.print(*args, **kwargs)


def _barrier() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()


@contextmanager
def rank_zero_first():
    """Rank 0 runs the block first, then every other rank (e.g. a one-time download).

    Every rank must enter it: it synchronises with two barriers.
    """
    if rank() != 0:
        _barrier()
    try:
        yield
    finally:
        if rank() == 0:
            _barrier()


def seed_all(seed: int) -> int:
    """Seed Python, NumPy and torch with ``seed + rank``; returns the seed used.

    ``seed``: a whole number (an int, or its text as read from the environment).

    Different seeds per rank give different dropout masks and data shuffles;
    seed model initialisation separately (or broadcast parameters, as DDP does)
    when all ranks must start from the same weights.
    """
    import torch

    value = _whole_seed(seed) + rank()
    if not -(2**63) <= value < 2**64:  # what torch.manual_seed takes
        raise ValueError(f"seed_all: seed={seed!r} is out of range: give a seed below 2**63")
    random.seed(value)
    torch.manual_seed(value)
    try:
        import numpy as np

        np.random.seed(value % 2**32)
    except ImportError:
        pass
    return value


def _whole_seed(seed) -> int:
    """``seed`` as an int (``7``, ``np.int64(7)``, ``"7"`` from the environment), or refused."""
    try:
        if isinstance(seed, str):
            return int(seed.strip())
        if isinstance(seed, float) and seed.is_integer():
            return int(seed)
        return operator.index(seed)
    except (TypeError, ValueError):
        raise TypeError(
            f"seed_all: seed={seed!r} is not a whole number: give an int, e.g. seed_all(0)"
        ) from None
