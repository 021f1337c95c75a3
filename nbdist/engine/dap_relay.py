"""Rank side: JupyterLab's debugger reaches this rank's debugpy through the engine's control channel.

A rank's debugpy listens on its own machine's loopback only
(:func:`nbdist.engine.debugpy_server.listen`): a kernel on another machine
cannot connect to it, and nbdist opens no debugger port beyond loopback. The
kernel (:mod:`nbdist.driver.rank_relay`) carries the Debug Adapter Protocol in
nbdist's requests on the engine's control channel instead, the channel
``%dist_where`` uses (:mod:`nbdist.engine.control`): HMAC-signed like every
ipyparallel message, served by ipykernel's control thread, also while the
rank's main thread is stopped at a breakpoint. This module does the rank's
part, on that control thread (no thread of its own):

``dap_open``
    connect to this rank's debugpy on loopback (the port :func:`listen`
    reported; no other); a former relay is closed. Returns a token that the
    other requests name.
``dap_send``
    write the given DAP messages to debugpy.
``dap_poll``
    the messages debugpy sent since the last poll (responses and events),
    waiting up to ``wait`` seconds for the first. It returns as soon as
    another control request arrives, so a send or a ``%dist_where`` is never
    held up behind a poll.
``dap_close``
    close the connection: debugpy then clears this client's breakpoints and
    lets a stopped rank run on.
``lab_paused``
    whether the rank's main thread is paused in debugpy now (its stack holds
    debugpy's wait loop): the kernel asks when a cell ends with ranks it had
    seen stop (a ``--noblock`` cell's stay paused; an interrupted cell's do
    not, and their debugpy does not always say so).
``lab_prepare``
    :func:`nbdist.engine.lab_debug.prepare`, for every rank (relayed or not):
    on the control thread, it is served while the rank still runs or is
    paused in an earlier cell, which a request on the shell channel would
    wait behind (the next cell's ``--timeout`` not yet counting).

The control thread is marked as one pydevd neither traces nor suspends
(``pydev_do_not_trace``, what debugpy marks its own threads with): were it
stopped with the main thread, nothing would carry the "continue".

A relay whose kernel stopped polling (the kernel died, or left the engines of
a cluster it had connected to) is closed before the rank's next cell
(:func:`drop_if_abandoned`), so its breakpoints do not stop cells run for
someone else.
"""

from __future__ import annotations

import socket
import sys
import threading
import time
import uuid

from nbdist.engine import debugpy_server, lab_debug
from nbdist.engine.dap_framing import Frames, frame
from nbdist.engine.netif import is_loopback

__all__ = [
    "ABANDONED_S",
    "ACTIONS",
    "MAX_WAIT_S",
    "drop_if_abandoned",
    "handle",
    "is_open",
    "main_thread_paused",
]

ACTIONS = ("dap_open", "dap_send", "dap_poll", "dap_close", "lab_prepare", "lab_paused")

# The longest a poll waits on the control thread (the kernel asks for less).
MAX_WAIT_S = 5.0
# A relay not polled for this long has lost its kernel.
ABANDONED_S = 30.0
_CHUNK = 1 << 16


class _Relay:
    """One connection from the control thread to this rank's debugpy."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.token = uuid.uuid4().hex
        self.frames = Frames()
        self.received: list = []  # whole messages from debugpy, not yet polled
        self.closed = False
        self.last_seen = time.monotonic()

    def write(self, messages: list) -> None:
        for message in messages:
            self.sock.sendall(frame(message))

    def _messages(self) -> list:
        found, self.received = self.received, []
        return found

    def _read_available(self) -> None:
        self.sock.setblocking(False)
        try:
            while True:
                data = self.sock.recv(_CHUNK)
                if not data:
                    self.closed = True
                    return
                self.received += self.frames.feed(data)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self.closed = True
        finally:
            if not self.closed:
                self.sock.setblocking(True)

    def poll(self, wait: float, control_socket) -> dict:
        deadline = time.monotonic() + max(0.0, min(wait, MAX_WAIT_S))
        self._read_available()
        messages = self._messages()
        while not messages and not self.closed:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            readable, other_request = _wait(self.sock, control_socket, remaining)
            if readable:
                self._read_available()
                messages = self._messages()
            elif other_request:
                break
        return {"messages": messages, "closed": self.closed}

    def close(self) -> None:
        self.closed = True
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()


def _wait(sock: socket.socket, control_socket, timeout: float) -> tuple[bool, bool]:
    """Wait until debugpy sent something (first) or another control request waits (second)."""
    import zmq  # an ipyparallel engine's; the rank side imports it only here

    poller = zmq.Poller()
    poller.register(sock.fileno(), zmq.POLLIN)
    if control_socket is not None:
        # This thread owns the control socket (ipykernel serves it here): a message
        # waiting in it is the next request, which this poll must not delay.
        poller.register(control_socket, zmq.POLLIN)
    events = dict(poller.poll(int(timeout * 1000) + 1))
    return sock.fileno() in events, control_socket is not None and control_socket in events


_lock = threading.Lock()
_relay: list[_Relay | None] = [None]


def is_open() -> bool:
    """Whether the kernel's debugger is relayed to this rank now."""
    current = _relay[0]
    return current is not None and not current.closed


def _open(port) -> dict:
    endpoint = debugpy_server.listening()
    if endpoint is None or endpoint.get("port") is None:
        raise RuntimeError("debugpy is not listening on this rank (the debugger prepares it)")
    # Only the port this rank's own debugpy listens on: the relay is no general proxy.
    if int(port) != endpoint["port"] or not is_loopback(endpoint["host"]):
        raise ValueError(f"port {port} is not this rank's debugpy")
    sock = socket.create_connection((debugpy_server.LOOPBACK, endpoint["port"]), timeout=10.0)
    sock.settimeout(None)
    _leave_this_thread_alone()
    relay = _Relay(sock)
    with _lock:
        old, _relay[0] = _relay[0], relay
    if old is not None:
        old.close()
    return {"token": relay.token, "pid": endpoint["pid"]}


def _leave_this_thread_alone() -> None:
    # This thread carries debugpy's client's messages: were it stopped with the
    # rank's main thread, nothing would carry the "continue". pydevd suspends no
    # thread marked as one of its own (pydev_do_not_trace) and traces it no more
    # once its trace function is gone, which only the thread itself can remove.
    threading.current_thread().pydev_do_not_trace = True
    try:
        import pydevd_tracing  # debugpy's own way: sys.settrace would warn on the rank

        pydevd_tracing.SetTrace(None)
    except (ImportError, RuntimeError):  # a debugpy on sys.monitoring (3.12+)
        pass


def handle(action: str, content: dict, control_socket=None) -> dict:
    """Answer one of the ``dap_*`` control requests (the module's docstring); ``control_socket``:
    the engine's control channel socket, watched while a poll waits."""
    if action == "dap_open":
        return _open(content.get("port"))
    if action == "lab_prepare":
        return _prepare(content)
    if action == "lab_paused":
        return {"paused": main_thread_paused()}
    relay = _relay[0]
    if relay is None or relay.token != content.get("token"):
        return {"messages": [], "closed": True}
    relay.last_seen = time.monotonic()
    if action == "dap_send":
        try:
            relay.write(list(content.get("messages") or ()))
        except OSError:
            relay.closed = True
        return {"messages": [], "closed": relay.closed}
    if action == "dap_poll":
        return relay.poll(float(content.get("wait", 0.0)), control_socket)
    if action == "dap_close":
        _drop(relay)
        return {"messages": [], "closed": True}
    raise ValueError(f"unknown {action!r}")


def _prepare(content: dict) -> dict:
    found = lab_debug.prepare(
        content.get("body"),
        content.get("path"),
        int(content.get("offset") or 0),
        content.get("source") or "",
    )
    # debugpy, started here, traces this thread too: see _leave_this_thread_alone.
    _leave_this_thread_alone()
    return found


def main_thread_paused() -> bool:
    """Whether the main thread waits in debugpy, paused (a breakpoint, a step, a pause)."""
    frame = sys._current_frames().get(threading.main_thread().ident)  # noqa: SLF001 - the only way
    while frame is not None:
        code = frame.f_code
        if code.co_name == "_do_wait_suspend" and code.co_filename.endswith("pydevd.py"):
            return True
        frame = frame.f_back
    return False


def _drop(relay: _Relay) -> None:
    with _lock:
        if _relay[0] is relay:
            _relay[0] = None
    relay.close()


def drop_if_abandoned(now: float | None = None) -> bool:
    """Close the relay if its kernel has not polled it for :data:`ABANDONED_S`; True if it did."""
    relay = _relay[0]
    now = time.monotonic() if now is None else now
    if relay is None or now - relay.last_seen < ABANDONED_S:
        return False
    _drop(relay)
    return True


# Relays abandoned by their kernel close before the rank's next cell.
lab_debug.on_abandoned_relay(drop_if_abandoned)
