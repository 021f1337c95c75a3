"""Both sides: nbdist, a Jupyter notebook as the driver of a multi-GPU (or multi-CPU) PyTorch job.

In a notebook::

    %load_ext nbdist
    %dist_start 4            # one engine per GPU (or 2 CPU ranks), process group ready

    %%on_all_ranks
    t = torch.ones(2) * rank
    dist.all_reduce(t)
    print(rank, t)

From a script: :class:`DistSession`. On a rank: :func:`log`, :func:`print0`,
:func:`rank_zero_first`, :func:`seed_all`, :func:`profile`, :mod:`nbdist.checkpoint`,
and ``nbdist.rank()``, ``nbdist.device()`` (also injected as values on every rank).
FLOP helpers: :mod:`nbdist.metrics`; parallel strategies and planning:
:mod:`nbdist.strategies`.

Rank-side names import with torch alone; the session, IPython and ipyparallel
are imported only when used.
"""

from __future__ import annotations

import warnings

# Public as attributes (``nbdist.rank()``, ``nbdist.checkpoint.save``) but kept out of
# ``__all__`` (below): the redundant aliases say so to the linter.
from nbdist import checkpoint as checkpoint
from nbdist.engine.helpers import device as device
from nbdist.engine.helpers import local_rank as local_rank
from nbdist.engine.helpers import print0, rank_zero_first, seed_all
from nbdist.engine.helpers import rank as rank
from nbdist.engine.helpers import world_size as world_size
from nbdist.engine.profiling import profile
from nbdist.errors import ClusterNotRunning, NbdistError, PlacementError, RankError
from nbdist.metrics.log import data_timer, log
from nbdist.metrics.store import runs

__version__ = "0.1.0"

# What ``from nbdist import *`` brings. ``rank``, ``local_rank``, ``world_size`` and
# ``device`` are left out on purpose: every rank's namespace already holds them as
# values (ints and a torch.device), and a star import must not replace those with the
# functions of the same name; call them as ``nbdist.rank()`` etc. ``output`` (a rank's
# whole output of the latest cell, kernel side) is left out as well: notebooks often
# have an ``output`` variable of their own; call it as ``nbdist.output(rank=3)``.
# ``checkpoint`` is a module (``nbdist.checkpoint.save``), FLOP helpers live in
# :mod:`nbdist.metrics`, planning in :mod:`nbdist.strategies`.
__all__ = [
    "ClusterNotRunning",
    "DistSession",
    "NbdistError",
    "PlacementError",
    "RankError",
    "current_session",
    "data_timer",
    "diff",
    "load_ipython_extension",
    "log",
    "print0",
    "profile",
    "rank_zero_first",
    "runs",
    "seed_all",
    "unload_ipython_extension",
]

# Names that moved out of the top level, kept for one release with a DeprecationWarning:
# old name -> (module it lives in now, its name there).
_MOVED = {
    "autoplan": ("nbdist.strategies", "autoplan"),
    "device_peak": ("nbdist.metrics", "device_peak"),
    "flops_per_step": ("nbdist.metrics", "flops_per_step"),
    "set_peak": ("nbdist.metrics", "set_peak"),
    "transformer_flops": ("nbdist.metrics", "transformer_flops"),
}


def __getattr__(name: str):
    """``DistSession``, ``current_session``, ``diff`` and ``output``, imported when first used.

    The kernel-side API pulls in ipyparallel; ranks never need it. The names that
    moved (``nbdist.flops_per_step`` and the other FLOP helpers, ``nbdist.autoplan``)
    still resolve, with a DeprecationWarning that names their new home.
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
    if name == "output":
        from nbdist.driver.cell_output import output

        return output
    if name in _MOVED:
        import importlib

        home, attr = _MOVED[name]
        warnings.warn(
            f"nbdist.{name} moved to {home}.{attr}; nbdist.{name} goes away in the next "
            f"release (use `from {home} import {attr}`)",
            DeprecationWarning,
            stacklevel=2,
        )
        return getattr(importlib.import_module(home), attr)
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
