"""Both sides: nbdist, a Jupyter notebook as the driver of a multi-GPU (or multi-CPU) PyTorch job.

In a notebook::

    %load_ext nbdist
    %dist_start 4            # one engine per GPU (or 2 CPU ranks), process group ready

    %%on_all_ranks
    t = torch.ones(2) * rank
    dist.all_reduce(t)
    print(rank, t)

From a script: :class:`DistSession`. On a rank: :func:`rank`, :func:`device`,
:func:`print0`, :func:`rank_zero_first`, :func:`seed_all`.

Rank-side names import with torch alone; the session, IPython and ipyparallel
are imported only when used.
"""

from __future__ import annotations

from nbdist import checkpoint
from nbdist.engine.helpers import (
    device,
    local_rank,
    print0,
    rank,
    rank_zero_first,
    seed_all,
    world_size,
)
from nbdist.engine.profiling import profile
from nbdist.errors import ClusterNotRunning, NbdistError, PlacementError, RankError
from nbdist.metrics.flops import device_peak, flops_per_step, set_peak, transformer_flops
from nbdist.metrics.log import data_timer, log
from nbdist.metrics.store import runs

__version__ = "0.1.0"

__all__ = [
    "ClusterNotRunning",
    "DistSession",
    "NbdistError",
    "PlacementError",
    "RankError",
    "autoplan",
    "checkpoint",
    "current_session",
    "data_timer",
    "device",
    "device_peak",
    "diff",
    "flops_per_step",
    "load_ipython_extension",
    "local_rank",
    "log",
    "print0",
    "profile",
    "rank",
    "rank_zero_first",
    "runs",
    "seed_all",
    "set_peak",
    "transformer_flops",
    "unload_ipython_extension",
    "world_size",
]


def __getattr__(name: str):
    """``DistSession``, ``current_session``, ``diff`` and ``autoplan``, imported when first used.

    The kernel-side API pulls in ipyparallel; ranks never need it. ``autoplan`` (rank
    side) builds on most strategies: a rank that never plans does not import them.
    """
    if name == "DistSession":
        from nbdist.driver.session import DistSession

        return DistSession
    if name == "current_session":
        from nbdist.driver.live_sessions import current_session

        return current_session
    if name == "diff":
        from nbdist.driver.diff import diff

        return diff
    if name == "autoplan":
        from nbdist.strategies.autoplan import autoplan

        return autoplan
    raise AttributeError(f"module 'nbdist' has no attribute {name!r}")


def _jupyter_labextension_paths() -> list[dict]:
    """Where the built JupyterLab extension lies, for ``jupyter labextension develop .``."""
    return [{"src": "labextension", "dest": "nbdist"}]


def load_ipython_extension(ipython) -> None:
    """``%load_ext nbdist``: register the magics."""
    from nbdist.magics import register

    register(ipython)


def unload_ipython_extension(ipython) -> None:
    """``%unload_ext nbdist``: stop this kernel's cluster (the magics stay until restart)."""
    from nbdist.driver.live_sessions import stop_all

    stop_all()
