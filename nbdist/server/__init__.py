"""Jupyter server: nbdist's extension, plotly.js for the dashboard widget and REST for the sidebar.

The JupyterLab sidebar's REST API (clusters, rank states, live metrics,
interrupt/restart/stop, past runs, the rank palette) is in :mod:`nbdist.server.handlers`.
Loading the extension also keeps JupyterLab's kernel indicators Busy while a cell
that opens widgets runs (:mod:`nbdist.server.busy`).

``GET {base_url}nbdist/static/plotly.min.js`` (logged-in users only) returns the
``plotly.min.js`` of the installed plotly package, cached by the browser for a
year when asked with ``?v=<plotly version>`` (the widget does), so the widget
state never carries plotly.js (~5 MB) and a saved notebook stays small.

Enabled by ``etc/jupyter/jupyter_server_config.d/nbdist.json``, which
``pip install nbdist`` puts in place (from ``jupyter-config/``); in a source
checkout: ``jupyter server extension enable nbdist.server``. The JupyterLab
extension builds on this module; keep it free of heavy imports
(jupyter_server is imported only when the server loads the extension).
"""

from __future__ import annotations

import importlib.util
import os

__all__ = ["CACHE_SECONDS", "STATIC_ROUTE", "plotly_js_dir"]

STATIC_ROUTE = r"nbdist/static/(plotly\.min\.js)"  # the only file served: nothing else is reachable
CACHE_SECONDS = 365 * 24 * 3600


def _jupyter_server_extension_points() -> list[dict]:
    return [{"module": "nbdist.server"}]


def plotly_js_dir() -> str | None:
    """The folder holding the installed plotly package's ``plotly.min.js`` (plotly is not imported)."""
    spec = importlib.util.find_spec("plotly")
    if spec is None or not spec.submodule_search_locations:
        return None
    folder = os.path.join(list(spec.submodule_search_locations)[0], "package_data")
    return folder if os.path.isfile(os.path.join(folder, "plotly.min.js")) else None


def _load_jupyter_server_extension(serverapp) -> None:
    from jupyter_server.utils import url_path_join

    from nbdist.server.busy import untrack_subshell_messages
    from nbdist.server.handlers import handlers
    from nbdist.server.sidebar_state import LiveView

    web_app = serverapp.web_app
    untrack_subshell_messages(serverapp)
    # One view per server: it remembers how far it read each run's history.
    web_app.settings["nbdist_live_view"] = LiveView()
    web_app.add_handlers(".*$", handlers(web_app.settings["base_url"]))
    folder = plotly_js_dir()
    if folder is None:
        serverapp.log.warning("nbdist: plotly is not installed; dashboards will show tables only")
        return
    route = url_path_join(web_app.settings["base_url"], STATIC_ROUTE)
    web_app.add_handlers(".*$", [(route, _handler_class(), {"path": folder})])
    serverapp.log.info("nbdist: serving plotly.js at %s", route)


def _handler_class():
    from jupyter_server.base.handlers import AuthenticatedFileHandler
    from tornado import web

    class PlotlyJSHandler(AuthenticatedFileHandler):
        """plotly.min.js for logged-in users, with long cache headers."""

        def get_cache_time(self, path, modified, mime_type) -> int:
            # ?v=<plotly version> (what the widget asks for) names one exact file: cache it a year.
            return CACHE_SECONDS if "v" in self.request.arguments else 24 * 3600

        def set_headers(self) -> None:
            # Tornado's static headers (ETag, Last-Modified, max-age from get_cache_time), without
            # AuthenticatedFileHandler's "no-cache" for URLs without ?v=.
            web.StaticFileHandler.set_headers(self)
            self.set_header(
                "Cache-Control", f"private, max-age={self.get_cache_time('', None, '')}"
            )

    return PlotlyJSHandler
