"""Jupyter server: the REST handlers for named sessions (those that outlive their kernel).

Routes, under the server's base URL (login required, as for every nbdist route)::

    GET  nbdist/api/sessions                 this user's named sessions: name, ranks, state...
    POST nbdist/api/sessions/<name>/stop     end one, wherever it runs (its keeper stops it)

Attaching is done in a notebook's kernel (``%dist_attach NAME``): the sidebar
runs that line in the active notebook, so the session becomes that notebook's.
The records are read with :mod:`nbdist.launch.named_session_records` (standard library
and psutil only): the server imports neither torch nor ipyparallel for them.
"""

from __future__ import annotations

import asyncio
import json

from jupyter_server.auth.decorator import authorized
from jupyter_server.base.handlers import APIHandler
from tornado import web

from nbdist.errors import NbdistError
from nbdist.launch import named_session_records, process_tree

__all__ = ["ROUTES", "session_pids"]


def session_pids() -> set[int]:
    """The PIDs of every running process a named session's keeper started (start time checked)."""
    return {
        entry["pid"]
        for record in named_session_records.records()
        for entry in record.get("pids", [])
        if process_tree.alive(entry) is not None
    }


class _NamedBase(APIHandler):
    auth_resource = "nbdist"

    def write_json(self, payload, status: int = 200) -> None:
        self.set_status(status)
        self.set_header("Content-Type", "application/json")
        self.finish(json.dumps(payload, allow_nan=False))


class SessionsHandler(_NamedBase):
    """``GET nbdist/api/sessions``: the rows ``%dist_sessions`` shows."""

    @web.authenticated
    @authorized
    def get(self) -> None:
        """This user's named sessions, oldest first (those whose keeper died: state 'gone')."""
        rows = [named_session_records.describe_session(r) for r in named_session_records.records()]
        self.write_json({"sessions": rows})


class SessionStopHandler(_NamedBase):
    """``POST nbdist/api/sessions/<name>/stop``: what ``%dist_stop NAME`` does."""

    @web.authenticated
    @authorized
    async def post(self, name: str) -> None:
        """Stop session ``name`` (its keeper ends its processes by PID); 404 if there is none."""
        if named_session_records.read(name) is None:
            raise web.HTTPError(
                404, f"no named session {name!r}: refresh the list of named sessions"
            )
        loop = asyncio.get_running_loop()
        try:
            # The keeper takes a few seconds to stop the ranks: not on the server's loop.
            killed = await loop.run_in_executor(None, named_session_records.stop, name)
        except NbdistError as exc:
            raise web.HTTPError(404, str(exc)) from None
        self.write_json({"action": "stop", "name": name, "killed": killed})


ROUTES = [
    (r"sessions", SessionsHandler),
    (r"sessions/([A-Za-z0-9][A-Za-z0-9_.-]{0,63})/stop", SessionStopHandler),
]
