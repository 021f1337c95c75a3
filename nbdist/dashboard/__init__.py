"""The metrics dashboard: live plots and a per-rank table of a run, or a text summary.

In a notebook::

    import nbdist.dashboard
    nbdist.dashboard.show(session.metrics, session=session)   # %dist_dashboard does this

Elsewhere (a script, terminal IPython) ``show`` prints :func:`summary_text`.
Importing this package is cheap: numpy, IPython, ipywidgets and anywidget are
imported when first used, and never on the ranks.
"""

from __future__ import annotations

__all__ = ["LiveDashboard", "close_all", "minmax_indices", "show", "summary_text"]

_WHERE = {
    "LiveDashboard": "live",
    "close_all": "live",
    "show": "live",
    "summary_text": "text",
    "minmax_indices": "decimate",
}


def __getattr__(name: str):
    if name in _WHERE:
        from importlib import import_module

        return getattr(import_module(f"{__name__}.{_WHERE[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
