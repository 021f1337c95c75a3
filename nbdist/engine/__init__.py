"""Rank side: what runs on each rank (an ipyparallel engine, or a ``torchrun`` process).

Joining and re-joining the group (``bootstrap``), answering control requests
while busy (``control``), the collectives wrapper, network interfaces, the
helpers user code calls (``helpers``: ``rank()``, ``device()``...), devices,
``standalone`` for exported scripts, and every patch nbdist makes to torch and
the standard library on a rank (``patches`` lists them). Imports torch and the
standard library only: nothing from :mod:`nbdist.driver` or :mod:`nbdist.launch`,
and never IPython.
"""

from __future__ import annotations

import importlib
import warnings

__all__: list[str] = []

# Renamed modules whose names users were shown, and their new names (one release).
_MOVED = {"launch_guard": "launcher_refusal"}


def __getattr__(name: str):
    """``nbdist.engine.launch_guard``: the former name of :mod:`nbdist.engine.launcher_refusal`."""
    if name in _MOVED:
        new = f"{__name__}.{_MOVED[name]}"
        warnings.warn(
            f"{__name__}.{name} moved to {new} (e.g. {new}.allow_launchers())",
            DeprecationWarning,
            stacklevel=2,
        )
        return importlib.import_module(new)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
