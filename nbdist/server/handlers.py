"""Jupyter server: the REST handlers of nbdist's extension (every one requires a logged-in user).

Routes, under the server's base URL::

    GET  nbdist/api/clusters                      live clusters, their ranks and recent metrics
    POST nbdist/api/clusters/<id>/interrupt       SIGINT to the cluster's engine PIDs
    POST nbdist/api/clusters/<id>/restart         restart the ranks, through the cluster's kernel
    POST nbdist/api/clusters/<id>/stop            stop the cluster, through the cluster's kernel
    GET  nbdist/api/runs                          runs of the histories, and which still run
    GET  nbdist/api/runs/<run id>?history=<path>  one run's series, decimated for a chart
    GET  nbdist/api/palette                       the rank colours every view draws ranks in
    GET  nbdist/api/sessions                      named sessions (nbdist.server.named_session_handlers)
    POST nbdist/api/sessions/<name>/stop          end a named session, wherever it runs

The front end polls ``clusters`` about once a second while the sidebar is
visible and backs off when it is hidden (the dask-labextension/ipyparallel
pattern) rather than holding a websocket: each poll is one small read of the
registry and the history, it goes through the server's ordinary token/cookie
authentication and XSRF checks, survives proxies (JupyterHub) and server
restarts without reconnection logic, and costs nothing when nobody looks.

The histories are the default one and each live cluster's own (``DistSession(history=...)``).
Run ids count from 1 in every file, so a run is named by its id *and* its history: each
record of ``runs`` carries ``history`` (the file's path, which the client passes back as
``?history=``). ``runs/<id>`` reads only a history the server lists (any other is a 404,
never a file the client names); without ``history`` it takes the first history holding
the run, the default one first.

Example (with the server's token)::

    curl -H "Authorization: token $TOKEN" http://127.0.0.1:8888/nbdist/api/clusters
"""

from __future__ import annotations

import asyncio
import json
import os
import signal

import psutil
from jupyter_server.auth.decorator import authorized
from jupyter_server.base.handlers import APIHandler
from tornado import web

from nbdist.metrics import store
from nbdist.server import named_session_handlers
from nbdist.server.sidebar_state import LiveView

__all__ = ["ACTIONS", "API_PREFIX", "ROUTES", "handlers"]

API_PREFIX = "nbdist/api"
ACTIONS = ("interrupt", "restart", "stop")
_KERNEL_REPLY_TIMEOUT_S = 600.0  # a restart may wait behind a running cell, then start ranks


class _Base(APIHandler):
    auth_resource = "nbdist"

    @property
    def view(self) -> LiveView:
        return self.settings["nbdist_live_view"]

    def write_json(self, payload, status: int = 200) -> None:
        self.set_status(status)
        self.set_header("Content-Type", "application/json")
        self.finish(json.dumps(payload, allow_nan=False))


class ClustersHandler(_Base):
    @web.authenticated
    @authorized
    def get(self) -> None:
        self.write_json({"clusters": self.view.clusters()})


def _descends_from(pid: int, ancestor: int) -> bool:
    try:
        return any(parent.pid == ancestor for parent in psutil.Process(pid).parents())
    except psutil.Error:
        return False


class ClusterActionHandler(_Base):
    @web.authenticated
    @authorized
    async def post(self, cluster_id: str, action: str) -> None:
        entry = self.view.entry(cluster_id)
        if entry is None:
            raise web.HTTPError(
                404, f"no running nbdist cluster {cluster_id!r}: refresh the list of clusters"
            )
        if action == "interrupt":
            self.write_json(await self._interrupt(entry))
        else:
            self.write_json(self._through_kernel(entry, action), status=202)

    async def _interrupt(self, entry: dict) -> dict:
        here = all(info.get("pid_here", True) for info in entry["ranks"])
        if not entry.get("owned") or not here:
            # Attached engines, and a launcher's on other hosts (whose PIDs name other
            # processes here): the kernel forwards SIGINT to them.
            kernel = self._kernel(entry, "interrupt")
            await _maybe_await(kernel.interrupt_kernel())
            return {"action": "interrupt", "via": "kernel", "pids": []}
        sent = []
        # A named session's ranks are its keeper's, not the kernel's.
        kept = named_session_handlers.session_pids()
        for info in entry["ranks"]:
            pid = info["pid"]
            # Only PIDs the cluster's own kernel started (its descendants), or a named session
            # recorded (checked by start time): a PID reused by another process is left alone.
            if not (_descends_from(pid, entry["kernel_pid"]) or pid in kept):
                continue
            try:
                os.kill(pid, signal.SIGINT)
                sent.append(pid)
            except ProcessLookupError:
                pass
        return {"action": "interrupt", "via": "pid", "pids": sent}

    def _kernel(self, entry: dict, action: str):
        kernel_id = entry.get("kernel_id")
        try:
            return self.kernel_manager.get_kernel(kernel_id)
        except KeyError:
            raise web.HTTPError(
                409,
                f"cannot {action} cluster {entry['id']!r}: its kernel ({kernel_id}) is not a kernel "
                "of this Jupyter server; use %dist_restart / %dist_stop in the notebook that started it",
            ) from None

    def _through_kernel(self, entry: dict, action: str) -> dict:
        # The kernel owns the session (its engines, metrics, history run): it restarts or
        # stops it itself, after the cell it may be running. Nothing is killed from here.
        kernel = self._kernel(entry, action)
        code = (
            f"__import__('nbdist.driver.registry').driver.registry.act({entry['id']!r}, {action!r})"
        )
        from jupyter_client.session import Session

        # A session of its own: a client sharing the kernel manager's session would connect
        # with the same socket identity as other clients and steal their replies.
        session = Session(key=kernel.session.key, signature_scheme=kernel.session.signature_scheme)
        client = kernel.client(session=session)
        client.start_channels()
        msg_id = client.execute(code, silent=True, store_history=False, allow_stdin=False)
        task = asyncio.ensure_future(_close_after_reply(client, msg_id, self.log))
        self.settings.setdefault("nbdist_tasks", set()).add(task)
        task.add_done_callback(self.settings["nbdist_tasks"].discard)
        return {"action": action, "via": "kernel", "kernel_id": entry.get("kernel_id")}


async def _maybe_await(value):
    if asyncio.iscoroutine(value) or isinstance(value, asyncio.Future):
        return await value
    return value


async def _close_after_reply(client, msg_id: str, log) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + _KERNEL_REPLY_TIMEOUT_S
    try:
        while loop.time() < deadline:
            try:
                msg = await _maybe_await(client.get_shell_msg(timeout=1))
            except Exception:  # queue.Empty (no reply yet)
                continue
            if msg.get("parent_header", {}).get("msg_id") == msg_id:
                content = msg.get("content", {})
                if content.get("status") != "ok":
                    log.warning("nbdist: kernel action failed: %s", content.get("evalue"))
                return
    finally:
        client.stop_channels()


def _live_runs(view: LiveView) -> set[tuple[str, int]]:
    """(history file, run id) of the runs a live cluster still logs to."""
    return {
        (entry["history"], int(entry["run_id"]))
        for entry in view.entries()
        if entry.get("history") and entry.get("run_id") is not None
    }


def _history_paths(view: LiveView) -> list[str]:
    """The histories the server reads: the default one, then each live cluster's own.

    The only files ``GET runs/<id>?history=`` may name (compared as the exact text
    ``GET runs`` gave out, so no other spelling of a path reaches another file).
    """
    paths = [store.history_path()]
    for entry in view.entries():
        if entry.get("history") and entry["history"] not in paths:
            paths.append(entry["history"])
    return paths


class RunsHandler(_Base):
    @web.authenticated
    @authorized
    async def get(self) -> None:
        # A run is running while a live cluster logs to it. ``ended`` stays null for a run
        # whose kernel died or was killed before it could end the run: finished all the same.
        live, paths = _live_runs(self.view), _history_paths(self.view)

        def listed() -> list[dict]:
            # Each run's point count sums its batches: a long history takes a while, read
            # in a worker thread so the server answers every notebook's requests meanwhile.
            out = []
            for path in paths:
                for record in store.runs(path):
                    out.append(
                        dict(
                            id=record.id,
                            # Every history numbers its runs from 1: (history, id) names a run.
                            history=path,
                            started=record.started,
                            ended=record.ended,
                            world_size=record.world_size,
                            backend=record.backend,
                            label=record.label,
                            host=record.host,
                            points=record.points,
                            running=(path, record.id) in live,
                        )
                    )
            # Oldest first across every history (the sidebar shows the newest 50): listed
            # history by history, a large cluster history pushed the default one's runs out.
            out.sort(key=lambda record: (record["started"] or 0, record["id"]))
            return out

        self.write_json({"runs": await asyncio.to_thread(listed)})


class RunHandler(_Base):
    @web.authenticated
    @authorized
    async def get(self, run_id: str) -> None:
        # Reading a long run's every point takes seconds (a 256-rank multi-hour run:
        # millions of points): it happens in a worker thread, so the server's other
        # requests (every notebook's) are answered meanwhile, and a run opened again
        # unchanged comes from the cache (runview.PayloadCache) without reading its points.
        from nbdist.server.runview import PayloadCache

        cache = self.settings.setdefault("nbdist_run_payloads", PayloadCache())
        paths, live = _history_paths(self.view), _live_runs(self.view)
        history = self.get_query_argument("history", None, strip=False)  # exact text
        if history is not None:
            # Only a history the server lists (GET runs): never a file the client names.
            if history not in paths:
                raise web.HTTPError(
                    404,
                    f"history {history!r} is not one the server reads (the default history or "
                    "a running cluster's own; its cluster may have stopped): see GET nbdist/api/runs",
                )
            paths = [history]

        # No run id has more digits than SQLite's largest row id (19); int() of 4,300 or
        # more raises ValueError, which answered 500 "Unhandled error".
        number = int(run_id) if len(run_id) <= 19 else None

        def body() -> str | None:
            if number is None:
                return None
            found = cache.payload(number, paths)
            if found is None:
                return None
            path, payload = found
            running = (path, payload["id"]) in live
            return json.dumps({**payload, "history": path, "running": running}, allow_nan=False)

        text = await asyncio.to_thread(body)
        if text is None:
            where = "the history" if history is None else f"history {history!r}"
            raise web.HTTPError(404, f"run {run_id} is not in {where}: see GET nbdist/api/runs")
        self.set_header("Content-Type", "application/json")
        self.finish(text)


class PaletteHandler(_Base):
    @web.authenticated
    @authorized
    def get(self) -> None:
        # The dashboard's palette, read by name: one list of rank colours for every view.
        from nbdist.dashboard.palette import rank_colours

        self.write_json({"colours": rank_colours()})


ROUTES = [
    (r"clusters", ClustersHandler),
    (r"clusters/([\w.-]+)/(" + "|".join(ACTIONS) + ")", ClusterActionHandler),
    (r"runs", RunsHandler),
    (r"runs/(\d+)", RunHandler),
    (r"palette", PaletteHandler),
    *named_session_handlers.ROUTES,
]


def handlers(base_url: str) -> list[tuple[str, type]]:
    """(pattern, handler class) pairs for ``web_app.add_handlers``."""
    from jupyter_server.utils import url_path_join

    return [(url_path_join(base_url, API_PREFIX, pattern), cls) for pattern, cls in ROUTES]
