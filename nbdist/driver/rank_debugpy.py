"""Kernel side: a Debug Adapter Protocol client of one rank's debugpy (which listens on loopback).

:class:`RankConnection` speaks DAP (``Content-Length`` framed JSON) over TCP to
the debugpy a rank on this machine listens with
(:func:`nbdist.engine.debugpy_server.listen`): requests return futures of their
responses, events go to a callback from a reader thread. :class:`DapClient` is
what it shares with the connection to a rank on another machine
(:mod:`nbdist.driver.rank_relay`). :data:`INITIALIZE` and :data:`ATTACH` are what the kernel's router
(:mod:`nbdist.driver.lab_debugger`) attaches with.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import socket
import threading

from nbdist.engine.dap_framing import Frames, frame

__all__ = [
    "ATTACH",
    "CONNECT_TIMEOUT_S",
    "INITIALIZE",
    "DapClient",
    "debugger_thread",
    "REPLY_TIMEOUT_S",
    "RankConnection",
    "succeeded",
]

CONNECT_TIMEOUT_S = 10.0
REPLY_TIMEOUT_S = 30.0


def debugger_thread(target, name: str) -> threading.Thread:
    """A daemon thread, not started, that the kernel's own debugpy neither traces, stops nor lists.

    With JupyterLab's debugger on, the kernel runs debugpy too: a thread that carries
    the ranks' messages must not stop in it (at a caught exception with "pause on
    raised exceptions", or with the kernel's threads) nor show in its threads. pydevd
    leaves alone the threads marked as its own, with these two attributes.
    """
    thread = threading.Thread(target=target, name=name, daemon=True)
    thread.pydev_do_not_trace = True
    thread.is_pydev_daemon_thread = True
    return thread


class DapClient:
    """A Debug Adapter Protocol client of one rank's debugpy, whatever carries its messages.

    Requests return futures of their responses; events go to ``on_event(rank,
    message)``, then ``{"event": "nbdist_closed"}`` once the connection is gone.
    :class:`RankConnection` carries the messages over TCP (a rank on this
    machine); :class:`nbdist.driver.rank_relay.RelayedRankConnection` through
    the engine's control channel (a rank on another machine).
    """

    def __init__(self, rank: int, on_event):
        """For rank ``rank``; ``on_event(rank, message)`` gets each DAP event."""
        self.rank = rank
        self._on_event = on_event
        self.endpoint: tuple[str, int] | None = None  # the rank's debugpy, on its own machine
        self.pid: int | None = None
        self._seq = itertools.count(1)
        self._lock = threading.Lock()
        self._pending: dict[int, concurrent.futures.Future] = {}
        self.initialized = threading.Event()
        self.closed = False  # its debugpy went away (the rank ended or restarted)

    def request(self, command: str, arguments: dict | None = None) -> concurrent.futures.Future:
        """Send a request; a future of its response message."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            seq = next(self._seq)
            self._pending[seq] = future
            if self.closed:
                # It went away before this request (a debugpy that hung up at once): a send
                # to a socket the peer closed may still succeed, and no answer would come.
                self._fail(seq, ConnectionError("the connection is closed"))
                return future
            message = {"seq": seq, "type": "request", "command": command}
            if arguments is not None:
                message["arguments"] = arguments
            try:
                # Under the lock: messages leave in the order of their numbers.
                self._send(message)
            except (OSError, ConnectionError) as exc:
                self._fail(seq, exc)
        return future

    def _send(self, message: dict) -> None:
        raise NotImplementedError

    def _fail(self, seq: int, exc: BaseException) -> None:
        future = self._pending.pop(seq, None)
        if future is not None and not future.done():
            future.set_exception(ConnectionError(f"rank {self.rank}'s debugpy: {exc}"))

    def _received(self, message: dict) -> None:
        """One message from the rank's debugpy (called in the order they came)."""
        if message.get("type") == "response":
            with self._lock:
                future = self._pending.pop(message.get("request_seq"), None)
            if future is not None and not future.done():
                future.set_result(message)
        elif message.get("type") == "event":
            if message.get("event") == "initialized":
                self.initialized.set()
            self._on_event(self.rank, message)

    def _gone(self) -> None:
        """The connection ended: pending requests fail, the callback hears ``nbdist_closed``."""
        self.closed = True  # before the pending requests are taken: request() fails later ones
        with self._lock:
            pending, self._pending = list(self._pending.values()), {}
        for future in pending:
            if not future.done():
                future.set_exception(ConnectionError(f"rank {self.rank}'s debugpy went away"))
        self._on_event(self.rank, {"type": "event", "event": "nbdist_closed"})

    def close(self) -> None:
        """Close the connection (debugpy then lets the rank run on, breakpoints cleared)."""
        raise NotImplementedError

    def wait_closed(self, timeout: float) -> None:
        """After :meth:`close`: wait up to ``timeout`` seconds for its thread to end."""
        raise NotImplementedError


class RankConnection(DapClient):
    """A Debug Adapter Protocol client connected over TCP to one rank's debugpy (on this machine)."""

    def __init__(self, rank: int, host: str, port: int, on_event):
        """Connect to ``host:port``; ``on_event`` as :class:`DapClient`'s."""
        super().__init__(rank, on_event)
        self.endpoint = (host, port)
        self._sock = socket.create_connection((host, port), timeout=CONNECT_TIMEOUT_S)
        self._sock.settimeout(None)
        self._reader = debugger_thread(self._read, f"nbdist-lab-debugger-rank{rank}")
        self._reader.start()

    def _send(self, message: dict) -> None:
        self._sock.sendall(frame(message))

    def _read(self) -> None:
        frames = Frames()
        try:
            while True:
                data = self._sock.recv(1 << 16)
                if not data:
                    return
                for message in frames.feed(data):
                    self._received(message)
        except (OSError, ValueError):
            return
        finally:
            self._gone()

    def close(self) -> None:
        """Close the connection (debugpy then lets the rank run on, breakpoints cleared)."""
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()

    def wait_closed(self, timeout: float) -> None:
        """After :meth:`close`: wait up to ``timeout`` seconds for the reader thread to end."""
        if threading.current_thread() is not self._reader:
            self._reader.join(timeout)


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
            # All of nbdist (a step off a cell's last line runs its end-of-cell code).
            "nbdist",
        )
    ],
}


def succeeded(future: concurrent.futures.Future, timeout: float = REPLY_TIMEOUT_S) -> dict:
    """The response ``future`` (from :meth:`RankConnection.request`) brings; raises unless it succeeded."""
    reply = future.result(timeout)
    if not reply.get("success", False):
        raise RuntimeError(f"{reply.get('command')}: {reply.get('message', 'failed')}")
    return reply
