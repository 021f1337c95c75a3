"""Kernel side: the metrics dashboard, live plots and a per-rank table of a run, or a text summary.

In a notebook::

    import nbdist.dashboard
    s = nbdist.current_session()
    nbdist.dashboard.show_run(s.metrics, states=s.rank_states)   # %dist_dashboard does this

Elsewhere (a script, terminal IPython) ``show_run`` prints :func:`summary_text`.
Importing this package is cheap: numpy, IPython, ipywidgets and anywidget are
imported when first used, and never on the ranks.
"""

from __future__ import annotations

__all__ = [
    "LiveDashboard",
    "cell_watcher",
    "close_all",
    "minmax_indices",
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
}


def __getattr__(name: str):
    """The public names, each imported from its module when first used (importing is cheap)."""
    if name in _WHERE:
        from importlib import import_module

        return getattr(import_module(f"{__name__}.{_WHERE[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
