"""Kernel side: the dashboard's anywidget class, its browser half in ``widget.js`` and ``widget.css``.

The synced state stays a few KB: the per-rank ``table`` (with the header), the
rank colours (``_palette``, :mod:`nbdist.dashboard.palette`) and which plotly.js
to load; the plotted points travel as custom messages (:mod:`.live`).
"""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

__all__ = ["plotly_version", "widget_class"]

_WIDGET_CLASS = None


def plotly_version() -> str:
    """The installed plotly's version ("" without plotly): the widget asks for that plotly.js."""
    try:
        return importlib.metadata.version("plotly")
    except importlib.metadata.PackageNotFoundError:
        return ""


def widget_class():
    """The anywidget class of the dashboard (made once; imports anywidget and traitlets)."""
    # anywidget / ipywidgets / traitlets are imported here, when a widget is first made.
    global _WIDGET_CLASS
    if _WIDGET_CLASS is None:
        import anywidget
        import traitlets

        here = Path(__file__).parent

        class DashboardWidget(anywidget.AnyWidget):
            """The nbdist dashboard in the browser (see widget.js); plotly.js is not in its state."""

            _esm = (here / "widget.js").read_text(encoding="utf-8")
            _css = (here / "widget.css").read_text(encoding="utf-8")
            _uid = traitlets.Unicode("").tag(sync=True)
            _plotly_version = traitlets.Unicode("").tag(sync=True)
            _palette = traitlets.List(traitlets.Unicode()).tag(sync=True)  # rank colours
            table = traitlets.Dict().tag(sync=True)  # the per-rank table (widget.js draws it)

            def __init__(self, *, text=None, on_close=None, **kwargs):
                """``text``: returns the text/plain summary; ``on_close``: called once on close."""
                self._nbdist_text = text
                self.nbdist_on_close = on_close
                super().__init__(**kwargs)

            def _repr_mimebundle_(self, **kwargs):
                bundle = super()._repr_mimebundle_(**kwargs)
                if bundle is not None and self._nbdist_text is not None:
                    data, metadata = bundle
                    # Where no widget renders (nbconvert, a plain viewer) the summary shows instead.
                    data = {**data, "text/plain": self._nbdist_text()}
                    bundle = (data, metadata)
                return bundle

            def close(self):
                """Call ``nbdist_on_close`` (once: the dashboard stops updating), then close."""
                on_close, self.nbdist_on_close = self.nbdist_on_close, None
                if on_close is not None:
                    on_close()
                super().close()

        _WIDGET_CLASS = DashboardWidget
    return _WIDGET_CLASS
