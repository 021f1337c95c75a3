"""Kernel side: JupyterLab's debugger on the ranks, by routing the kernel's debug requests.

JupyterLab's debugger talks to the kernel with ``debug_request`` messages on the
control channel (the Debug Adapter Protocol inside); ipykernel answers them with
its own debugger, which sees only the kernel's process. :func:`install` puts a
router in front of it (the kernel's ``do_debug_request``; ipykernel itself is not
changed):

- every request still reaches the kernel's debugger, which keeps debugging
  cells that run in the kernel exactly as before;
- breakpoints (``setBreakpoints``) and "pause on exceptions"
  (``setExceptionBreakpoints``) are also set on every rank whose debugpy this
  router is connected to, and on ranks that connect later;
- a ``%%on_all_ranks``/``%%on_rank`` cell run while the debugger is on calls
  :func:`prepare_cell` first: it starts debugpy on the ranks the first time
  (loopback, one connection per rank from the kernel) and tells each rank the
  notebook cell's path (what ``dumpCell`` returned for it) and the line its body
  starts on, so a breakpoint in the cell's gutter stops the ranks there
  (:mod:`nbdist.engine.lab_debug`);
- stopped ranks appear as one more thread, "ranks", whose stack lists every
  stopped rank's frames, each named ``rank R · function``. JupyterLab's
  Callstack panel shows one thread's frames, so all the ranks' frames go into
  that one. Frame and variable ids are renumbered (from :data:`FIRST_ID` up) and
  mapped back to their rank, so Variables, scopes and evaluate act on the
  selected frame's rank;
- ``next``, ``stepIn`` and ``stepOut`` act on the rank whose frame was selected
  last; ``continue`` continues every stopped rank (a rank left paused holds the
  others at their next collective, until the process group's timeout);
- ``disconnect`` (the debugger switched off) disconnects from the ranks too,
  which clears their breakpoints and lets paused ranks run on.

Ranks on another host are not reached yet: their debugpy listens on their own
loopback and the router connects only to this machine's.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import json
import socket
import threading

__all__ = ["FIRST_ID", "RANKS_THREAD", "LabDebugRouter", "install", "prepare_cell", "router"]

# The thread id under which every stopped rank appears (debugpy numbers the kernel's
# own threads from 1).
RANKS_THREAD = 1_000_000
# Frame and variable ids handed to JupyterLab for ranks' objects start here; the
# kernel's own debugpy hands out small ones.
FIRST_ID = 1 << 40
_CONNECT_TIMEOUT_S = 10.0
_REPLY_TIMEOUT_S = 30.0
# Frames of the machinery that runs a cell on a rank: a rank's stack is shown down to
# the first of them (the cell's frame and what it called).
_MACHINERY = (
    "/IPython/",
    "/ipykernel/",
    "/ipyparallel/",
    "/tornado/",
    "/zmq/",
    "/asyncio/",
    "/nbdist/engine/",
    "/nbdist/launch/",
    "/traitlets/",
    "/debugpy/",
    "<frozen ",
    "/runpy.py",
    "/threading.py",
)
_BY_FRAME = ("scopes", "evaluate", "richInspectVariables", "completions", "stepInTargets")
_BY_VARIABLES = ("variables", "setVariable")
_STEPS = ("next", "stepIn", "stepOut")


class _RankConnection:
    """A Debug Adapter Protocol client connected to one rank's debugpy."""

    def __init__(self, rank: int, host: str, port: int, on_event):
        self.rank = rank
        self._on_event = on_event
        self._sock = socket.create_connection((host, port), timeout=_CONNECT_TIMEOUT_S)
        self._sock.settimeout(None)
        self._seq = itertools.count(1)
        self._lock = threading.Lock()
        self._pending: dict[int, concurrent.futures.Future] = {}
        self.initialized = threading.Event()
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


def _response(request: dict, body: dict | None = None, *, success=True, message="") -> dict:
    reply = {
        "seq": request.get("seq", 0),
        "type": "response",
        "request_seq": request.get("seq", 0),
        "command": request.get("command"),
        "success": success,
        "body": body or {},
    }
    if message:
        reply["message"] = message
    return reply


class LabDebugRouter:
    """Routes one kernel's debug requests between its own debugger and the ranks' debugpy."""

    def __init__(self, kernel):
        """In front of ``kernel``'s (an ipykernel kernel) debug request handling."""
        self.kernel = kernel
        self._inner = kernel.do_debug_request
        self._lock = threading.RLock()
        self._ranks: dict[int, _RankConnection] = {}
        self._breakpoints: dict[str, dict] = {}  # path -> setBreakpoints arguments
        self._exceptions: dict | None = None  # setExceptionBreakpoints arguments
        self._stopped: dict[int, int] = {}  # rank -> its stopped thread
        self._ids: dict[int, tuple[int, int]] = {}  # id given to JupyterLab -> (rank, rank's id)
        self._next_id = FIRST_ID
        self._selected: int | None = None
        self.active = False

    def adopt(self, debugger) -> None:
        """Take over what ``debugger`` (ipykernel's) was told before this router stood in front
        of it: the debugger switched on before ``%load_ext nbdist``, and its breakpoints."""
        self.active = bool(getattr(debugger, "is_started", False))
        # ipykernel keeps each source's breakpoint lines (their conditions are not kept).
        for path, breakpoints in dict(getattr(debugger, "breakpoint_list", None) or {}).items():
            self._breakpoints[path] = {"source": {"path": path}, "breakpoints": list(breakpoints)}

    # -- the kernel's end ---------------------------------------------------
    async def handle(self, request: dict) -> dict:
        """Answer one debug request (what ``do_debug_request`` returns)."""
        command = request.get("command")
        if command in ("initialize", "attach"):
            self.active = True
        args = request.get("arguments") or {}
        if command in ("stackTrace", "continue", *_STEPS, "pause") and (
            args.get("threadId") == RANKS_THREAD
        ):
            return await self._on_ranks_thread(request)
        if command == "continue" and self._stopped and not self._kernel_stopped():
            # JupyterLab forgets the stopped thread before it sends "continue", and then
            # names thread 1 (its fallback): with only ranks stopped, it means them. Not
            # passed on: a "continue" for a kernel that is not stopped hangs ipykernel's debugger.
            return await self._on_ranks_thread(dict(request, arguments={"threadId": RANKS_THREAD}))
        if command in _BY_FRAME and self._is_ranks(args.get("frameId")):
            return await self._forward_by_id(request, "frameId")
        if command in _BY_VARIABLES and self._is_ranks(args.get("variablesReference")):
            return await self._forward_by_id(request, "variablesReference")
        reply = await self._inner(request)
        if command == "setBreakpoints":
            path = (args.get("source") or {}).get("path")
            if path:
                self._breakpoints[path] = args
                await self._to_all_ranks("setBreakpoints", args)
        elif command == "setExceptionBreakpoints":
            self._exceptions = args
            await self._to_all_ranks("setExceptionBreakpoints", args)
        elif command == "threads" and self._stopped and isinstance(reply, dict):
            threads = reply.setdefault("body", {}).setdefault("threads", [])
            threads.append({"id": RANKS_THREAD, "name": self._thread_name()})
        elif command == "debugInfo" and self._stopped and isinstance(reply, dict):
            reply.setdefault("body", {}).setdefault("stoppedThreads", []).append(RANKS_THREAD)
        elif command == "disconnect":
            self.disconnect()
        return reply

    def _kernel_stopped(self) -> bool:
        return bool(getattr(getattr(self.kernel, "debugger", None), "stopped_threads", None))

    def _thread_name(self) -> str:
        return "ranks " + ",".join(str(r) for r in sorted(self._stopped))

    def _is_ranks(self, value) -> bool:
        return isinstance(value, int) and value >= FIRST_ID

    def _give_id(self, rank: int, rank_id: int) -> int:
        if not rank_id:
            return 0  # 0: no children, in every DAP message
        with self._lock:
            given = self._next_id
            self._next_id += 1
            self._ids[given] = (rank, rank_id)
        return given

    async def _ask(self, rank: int, command: str, arguments: dict | None = None) -> dict:
        connection = self._ranks.get(rank)
        if connection is None:
            raise ConnectionError(f"rank {rank} has no debugger connection")
        future = connection.request(command, arguments)
        return await asyncio.wait_for(asyncio.wrap_future(future), _REPLY_TIMEOUT_S)

    async def _to_all_ranks(self, command: str, arguments: dict) -> None:
        ranks = list(self._ranks)
        await asyncio.gather(
            *(self._ask(r, command, arguments) for r in ranks), return_exceptions=True
        )

    async def _on_ranks_thread(self, request: dict) -> dict:
        command = request["command"]
        stopped = dict(self._stopped)
        if command == "stackTrace":
            frames = []
            for rank in sorted(stopped):
                try:
                    reply = await self._ask(rank, "stackTrace", {"threadId": stopped[rank]})
                except (ConnectionError, asyncio.TimeoutError):
                    continue
                for frame in (reply.get("body") or {}).get("stackFrames", []):
                    path = (frame.get("source") or {}).get("path") or ""
                    if any(part in path for part in _MACHINERY):
                        break
                    frame = dict(frame, id=self._give_id(rank, frame["id"]))
                    frame["name"] = f"rank {rank} · {frame.get('name', '?')}"
                    frames.append(frame)
            if frames and self._selected not in stopped:
                self._selected = self._ids[frames[0]["id"]][0]
            return _response(request, {"stackFrames": frames, "totalFrames": len(frames)})
        if command == "continue":
            await self._resume(stopped, "continue")
            self._event("continued", {"threadId": RANKS_THREAD, "allThreadsContinued": False})
            return _response(request, {"allThreadsContinued": False})
        if command == "pause":
            return _response(request)
        rank = self._selected if self._selected in stopped else min(stopped, default=None)
        if rank is None:
            return _response(request, success=False, message="no rank is stopped")
        await self._resume({rank: stopped[rank]}, command)
        return _response(request)

    async def _resume(self, threads: dict[int, int], command: str) -> None:
        with self._lock:
            for rank in threads:
                self._stopped.pop(rank, None)
        arguments = {rank: {"threadId": t, "singleThread": True} for rank, t in threads.items()}
        await asyncio.gather(
            *(self._ask(rank, command, arguments[rank]) for rank in threads),
            return_exceptions=True,
        )

    async def _forward_by_id(self, request: dict, key: str) -> dict:
        args = dict(request.get("arguments") or {})
        rank, rank_id = self._ids.get(args[key], (None, None))
        if rank is None:
            return _response(request, success=False, message="that frame or variable is gone")
        if key == "frameId":
            self._selected = rank
        args[key] = rank_id
        command = request["command"]
        if command == "richInspectVariables":
            # ipykernel's own request (not debugpy's): the value's repr as plain text.
            command, args = (
                "evaluate",
                {
                    "expression": args.get("variableName", ""),
                    "frameId": rank_id,
                    "context": "repl",
                },
            )
        try:
            reply = await self._ask(rank, command, args)
        except (ConnectionError, asyncio.TimeoutError) as exc:
            return _response(request, success=False, message=str(exc))
        body = reply.get("body") or {}
        if request["command"] == "richInspectVariables":
            body = {"data": {"text/plain": body.get("result", "")}, "metadata": {}}
        for item in body.get("scopes", []) + body.get("variables", []) + [body]:
            if isinstance(item.get("variablesReference"), int):
                item["variablesReference"] = self._give_id(rank, item["variablesReference"])
        return dict(reply, seq=request.get("seq", 0), request_seq=request.get("seq", 0), body=body)

    # -- the ranks' end -----------------------------------------------------
    def _event(self, name: str, body: dict) -> None:
        # What ipykernel's debugger sends for its own events (from any thread: the
        # kernel's iopub socket forwards to its own thread).
        kernel = self.kernel
        kernel.session.send(
            kernel.iopub_socket,
            "debug_event",
            {"seq": 0, "type": "event", "event": name, "body": body},
            parent=kernel.get_parent("control"),
            ident=f"kernel.{kernel.ident}.debug_event".encode(),
        )

    def _on_rank_event(self, rank: int, message: dict) -> None:
        name = message.get("event")
        body = message.get("body") or {}
        if name == "stopped":
            with self._lock:
                self._stopped[rank] = body.get("threadId")
            self._event(
                "stopped",
                {
                    "reason": body.get("reason", "breakpoint"),
                    "threadId": RANKS_THREAD,
                    "allThreadsStopped": False,
                    "description": f"rank {rank}",
                },
            )
        elif name in ("continued", "nbdist_closed", "terminated", "exited"):
            if name == "continued" and body.get("threadId") not in (None, self._stopped.get(rank)):
                return
            with self._lock:
                was = self._stopped.pop(rank, None)
                if name != "continued":
                    self._ranks.pop(rank, None)
            if was is not None and not self._stopped:
                self._event("continued", {"threadId": RANKS_THREAD, "allThreadsContinued": False})
        elif name == "output":
            return  # the rank's output already reaches the cell through the session

    def connect(self, rank: int, host: str, port: int) -> None:
        """Attach to rank ``rank``'s debugpy at ``host:port`` and give it the breakpoints set so far."""
        connection = _RankConnection(rank, host, port, self._on_rank_event)
        try:
            _wait(connection.request("initialize", _INITIALIZE))
            attached = connection.request("attach", _ATTACH)
            if not connection.initialized.wait(_CONNECT_TIMEOUT_S):
                raise TimeoutError(f"rank {rank}'s debugpy did not start a debug session")
            for arguments in list(self._breakpoints.values()):
                _wait(connection.request("setBreakpoints", arguments))
            if self._exceptions is not None:
                _wait(connection.request("setExceptionBreakpoints", self._exceptions))
            _wait(connection.request("configurationDone"))
            _wait(attached)
        except BaseException:
            connection.close()
            raise
        with self._lock:
            self._ranks[rank] = connection

    def cell_ended(self, ranks) -> None:
        """The kernel's cell that ran on ``ranks`` returned (finished, failed or interrupted):
        none of them is paused in it any more."""
        with self._lock:
            cleared = [r for r in ranks if self._stopped.pop(r, None) is not None]
            still = bool(self._stopped)
        if cleared and not still:
            self._event("continued", {"threadId": RANKS_THREAD, "allThreadsContinued": False})

    def connected(self) -> list[int]:
        """The ranks this router is attached to."""
        return sorted(self._ranks)

    def disconnect(self) -> None:
        """Leave every rank (the debugger was switched off): their breakpoints go, paused ranks run on."""
        with self._lock:
            connections, self._ranks = list(self._ranks.values()), {}
            self._stopped.clear()
            self._ids.clear()
            self._breakpoints.clear()
            self._exceptions = None
            self.active = False
        for connection in connections:
            try:
                _wait(connection.request("disconnect", {"terminateDebuggee": False}), 5.0)
            except Exception:  # noqa: BLE001 - leaving anyway
                pass
            connection.close()


_INITIALIZE = {
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
_ATTACH = {
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


def _wait(future: concurrent.futures.Future, timeout: float = _REPLY_TIMEOUT_S) -> dict:
    reply = future.result(timeout)
    if not reply.get("success", False):
        raise RuntimeError(f"{reply.get('command')}: {reply.get('message', 'failed')}")
    return reply


_router: list[LabDebugRouter | None] = [None]


def router() -> LabDebugRouter | None:
    """This kernel's router, once :func:`install` put it in place."""
    return _router[0]


def install(ipython) -> LabDebugRouter | None:
    """Route ``ipython``'s kernel's debug requests through a :class:`LabDebugRouter` (once).

    None when there is no ipykernel kernel with a debugger (a terminal IPython).
    """
    kernel = getattr(ipython, "kernel", None)
    if kernel is None or getattr(kernel, "debugger", None) is None:
        return None
    if _router[0] is not None and _router[0].kernel is kernel:
        return _router[0]
    found = LabDebugRouter(kernel)
    found.adopt(kernel.debugger)
    if not found.active:
        _no_debugpy_in_children()
    kernel.do_debug_request = found.handle
    _router[0] = found
    return found


def _no_debugpy_in_children() -> None:
    # ipykernel's debugger starts debugpy in the kernel with debugpy's defaults, which
    # make every Python process the kernel starts from then on a debuggee too: the
    # ranks, controller and launcher of a %dist_start run with the debugger on then
    # start too slowly to register. Set before that start, it keeps them out.
    try:
        import debugpy

        debugpy.configure(subProcess=False)
    except (ImportError, RuntimeError):  # debugpy already started here: too late to say
        pass


def prepare_cell(session, ranks, body: str) -> None:
    """Before a ``%%on_all_ranks``/``%%on_rank`` cell: when JupyterLab's debugger is on, make its
    breakpoints stop the ranks in this cell.

    ``body``: what the magic runs on ``ranks``. Does nothing while the debugger
    is off. A cell whose notebook text is not the magic line then ``body`` (a
    call from a script, a cell IPython transformed) runs without breakpoints.
    """
    found = router()
    if found is None or not found.active:
        return
    from ipykernel.compiler import get_file_name

    from nbdist.engine import lab_debug

    source = ((found.kernel.get_parent("shell") or {}).get("content") or {}).get("code", "")
    # IPython ends the cell it hands a cell magic with a newline the notebook's text may lack.
    text, code = source.rstrip("\n"), body.rstrip("\n")
    if not text or not code or not text.endswith(code):
        return
    offset = text[: len(text) - len(code)].count("\n")
    path = get_file_name(source)
    events = found.kernel.shell.events

    def ended(*_):
        events.unregister("post_execute", ended)
        found.cell_ended(ranks)

    # An interrupt or a failure ends the cell with ranks still marked paused: unmark them.
    events.register("post_execute", ended)
    endpoints = session.apply(lab_debug.prepare, body, path, offset, source, ranks=ranks)
    for rank, endpoint in zip(ranks, endpoints):
        if rank in found.connected() or endpoint.get("port") is None:
            continue
        if endpoint.get("hostname") != socket.gethostname():
            continue  # its debugpy listens on its own host's loopback: not reached yet
        found.connect(rank, endpoint["host"], endpoint["port"])
