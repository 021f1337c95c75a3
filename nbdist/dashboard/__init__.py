"""Kernel side: the metrics dashboard, live plots and a per-rank table of a run, or a text summary.

In a notebook::

    import nbdist.dashboard
    s = nbdist.current_session()
    nbdist.dashboard.show_run(s.metrics, states=s.rank_states)   # %dist_dashboard does this

Elsewhere (a script, terminal IPython) ``show_run`` prints :func:`summary_text`.
An autoplan's table of plans: ``nbdist.dashboard.plans_table(plan.table)``.
Importing this package is cheap: numpy, IPython, ipywidgets and anywidget are
imported when first used, and never on the ranks.
"""

from __future__ import annotations

import warnings
from importlib import import_module

__all__ = [
    "LiveDashboard",
    "cell_watcher",
    "close_all",
    "minmax_indices",
    "plans_table",
    "show_run",
    "summary_text",
]

_WHERE = {
    "LiveDashboard": "live",
    "cell_watcher": "live",
    "close_all": "live",
    "show_run": "live",
    "summary_text": "text",
    "minmax_indices": "decimate",
    "plans_table": "plan_comparison",
}
# Renamed modules whose names users were shown, and their new names (one release).
_MOVED = {"compare": "plan_comparison"}


def __getattr__(name: str):
    """The public names, each imported from its module when first used (importing is cheap).

    ``nbdist.dashboard.compare`` (now :mod:`nbdist.dashboard.plan_comparison`) still
    resolves, with a DeprecationWarning.
    """
    if name in _WHERE:
        return getattr(import_module(f"{__name__}.{_WHERE[name]}"), name)
    if name in _MOVED:
        new = f"{__name__}.{_MOVED[name]}"
        warnings.warn(
            f"{__name__}.{name} moved to {new} (e.g. nbdist.dashboard.plans_table(plan.table))",
            DeprecationWarning,
            stacklevel=2,
        )
        return import_module(new)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
