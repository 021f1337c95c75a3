"""Kernel side: a Debug Adapter Protocol client connected to one rank's debugpy (on loopback).

:class:`RankConnection` speaks DAP (``Content-Length`` framed JSON) to the debugpy
a rank listens with (:func:`nbdist.engine.debugpy_server.listen`): requests
return futures of their responses, events go to a callback from a reader
thread. :data:`INITIALIZE` and :data:`ATTACH` are what the kernel's router
(:mod:`nbdist.driver.lab_debugger`) attaches with.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import json
import socket
import threading

__all__ = [
    "ATTACH",
    "CONNECT_TIMEOUT_S",
    "INITIALIZE",
    "REPLY_TIMEOUT_S",
    "RankConnection",
    "succeeded",
]

CONNECT_TIMEOUT_S = 10.0
REPLY_TIMEOUT_S = 30.0


class RankConnection:
    """A Debug Adapter Protocol client connected to one rank's debugpy."""

    def __init__(self, rank: int, host: str, port: int, on_event):
        """Connect to ``host:port``; ``on_event(rank, message)`` gets each DAP event, then
        ``{"event": "nbdist_closed"}`` once the connection is gone."""
        self.rank = rank
        self._on_event = on_event
        self.endpoint = (host, port)
        self.pid: int | None = None
        self._sock = socket.create_connection((host, port), timeout=CONNECT_TIMEOUT_S)
        self._sock.settimeout(None)
        self._seq = itertools.count(1)
        self._lock = threading.Lock()
        self._pending: dict[int, concurrent.futures.Future] = {}
        self.initialized = threading.Event()
        self.closed = False  # its debugpy went away (the rank ended or restarted)
        self._reader = threading.Thread(
            target=self._read, name=f"nbdist-lab-debugger-rank{rank}", daemon=True
        )
        self._reader.start()

    def request(self, command: str, arguments: dict | None = None) -> concurrent.futures.Future:
        """Send a request; a future of its response message."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            seq = next(self._seq)
            self._pending[seq] = future
            message = {"seq": seq, "type": "request", "command": command}
            if arguments is not None:
                message["arguments"] = arguments
            body = json.dumps(message).encode()
            try:
                self._sock.sendall(b"Content-Length: %d\r\n\r\n" % len(body) + body)
            except OSError as exc:
                self._pending.pop(seq, None)
                future.set_exception(ConnectionError(f"rank {self.rank}'s debugpy: {exc}"))
        return future

    def _read(self) -> None:
        stream = self._sock.makefile("rb")
        try:
            while True:
                length = None
                while True:
                    line = stream.readline()
                    if not line:
                        return
                    line = line.strip()
                    if not line:
                        break
                    name, _, value = line.partition(b":")
                    if name.strip().lower() == b"content-length":
                        length = int(value)
                if length is None:
                    continue
                message = json.loads(stream.read(length))
                if message.get("type") == "response":
                    with self._lock:
                        future = self._pending.pop(message.get("request_seq"), None)
                    if future is not None and not future.done():
                        future.set_result(message)
                elif message.get("type") == "event":
                    if message.get("event") == "initialized":
                        self.initialized.set()
                    self._on_event(self.rank, message)
        except (OSError, ValueError):
            return
        finally:
            self.closed = True
            with self._lock:
                pending, self._pending = list(self._pending.values()), {}
            for future in pending:
                if not future.done():
                    future.set_exception(ConnectionError(f"rank {self.rank}'s debugpy went away"))
            self._on_event(self.rank, {"type": "event", "event": "nbdist_closed"})

    def close(self) -> None:
        """Close the connection (debugpy then lets the rank run on, breakpoints cleared)."""
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()


INITIALIZE = {
    "clientID": "nbdist",
    "clientName": "nbdist (JupyterLab's debugger on the ranks)",
    "adapterID": "debugpy",
    "pathFormat": "path",
    "linesStartAt1": True,
    "columnsStartAt1": True,
    "supportsVariableType": True,
    "supportsRunInTerminalRequest": False,
}
# Only the thread that reaches a breakpoint stops: the rank's other threads (its
# kernel's control and output threads) keep serving, so the kernel can still
# interrupt it and its output still arrives.
# Library code (the standard library, site-packages) and the machinery that runs a
# cell on a rank are stepped over: a step off a cell's statement (IPython runs each
# one as code of its own) lands on the next statement.
ATTACH = {
    "justMyCode": True,
    "stopAllThreadsOnSuspend": False,
    "steppingResumesAllThreads": False,
    "subProcess": False,
    "rules": [
        {"module": name, "include": False}
        for name in (
            "IPython",
            "ipykernel",
            "ipyparallel",
            "jupyter_client",
            "tornado",
            "zmq",
            "asyncio",
            "traitlets",
            "threading",
            "runpy",
            "nbdist.engine",
            "nbdist.launch",
        )
    ],
}


def succeeded(future: concurrent.futures.Future, timeout: float = REPLY_TIMEOUT_S) -> dict:
    """The response ``future`` (from :meth:`RankConnection.request`) brings; raises unless it succeeded."""
    reply = future.result(timeout)
    if not reply.get("success", False):
        raise RuntimeError(f"{reply.get('command')}: {reply.get('message', 'failed')}")
    return reply
