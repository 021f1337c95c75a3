"""Kernel side: JupyterLab's debugger on the ranks, by routing the kernel's debug requests.

JupyterLab's debugger talks to the kernel with ``debug_request`` messages on the
control channel (the Debug Adapter Protocol inside); ipykernel answers them with
its own debugger, which sees only the kernel's process.
:func:`nbdist.driver.lab_debugger_cells.install` puts a router in front of it
(the kernel's ``do_debug_request``; ipykernel itself is not changed):

- every request still reaches the kernel's debugger, which keeps debugging
  cells that run in the kernel exactly as before;
- breakpoints (``setBreakpoints``) and "pause on exceptions"
  (``setExceptionBreakpoints``) are also set on every rank whose debugpy this
  router is connected to, and on ranks that connect later;
- a ``%%on_all_ranks``/``%%on_rank`` cell (or ``%dist_run``) run while the debugger
  is on calls :func:`~nbdist.driver.lab_debugger_cells.prepare_cell` first: it starts
  debugpy on the ranks the first time (loopback, one connection per rank from the
  kernel, made a window of ranks at a time: :mod:`nbdist.driver.lab_debug_attach`)
  and tells each rank the notebook cell's path (what ``dumpCell`` returned for it)
  and the line its body starts on, so a breakpoint in the cell's gutter stops the
  ranks there (:mod:`nbdist.engine.lab_debug`);
- stopped ranks appear as one more thread, "ranks", whose stack lists every
  stopped rank's frames, each named ``rank R · function``, under a first
  summary frame, ``all stopped (ranks 0-1) · function``. JupyterLab's Callstack
  panel shows one thread's frames, so all the ranks' frames go into that one.
  Frame and variable ids are renumbered (from :data:`FIRST_ID` up, kept per object:
  :mod:`nbdist.driver.lab_debug_ids`) and mapped
  back to their rank, so Variables, scopes and evaluate act on the selected
  frame's rank; an evaluate on the summary frame runs on every stopped rank;
- ``continue``, ``next``, ``stepIn`` and ``stepOut`` act on the rank whose frame
  is selected, the others staying paused (the Callstack is then shown again with
  the ranks still stopped); with the summary frame selected, which JupyterLab
  selects when ranks stop after a Continue, they act on every stopped rank. A rank left paused
  holds the others at their next collective, until the process group's timeout;
- ``pause`` on the ranks' thread, or on any thread while a ranks cell runs (the
  kernel's own thread only waits for the ranks then), pauses each attached rank
  that runs (:mod:`nbdist.driver.lab_debug_pause`);
- ``disconnect`` (the debugger switched off) disconnects from the ranks too,
  which clears their breakpoints and lets paused ranks run on.

A rank on another machine (or network namespace) listens on its own machine's
loopback, which the kernel does not reach, and nbdist opens no debugger port
beyond loopback: the router reaches its debugpy through the engine's control
channel instead (:mod:`nbdist.driver.rank_relay`), and it is debugged as a
rank on the kernel's machine is. ``prepare_cell`` chooses, per rank.

A rank that runs a machine's copy of a synced file (``%dist_sync``) has it at
another path: breakpoints set in the file go to that rank at its copy's path,
and its frames name the file's own path (:mod:`nbdist.driver.lab_debug_paths`).
"""

from __future__ import annotations

import asyncio
import sys
import threading
import time

from nbdist.driver import rank_debugpy as dap
from nbdist.driver.lab_debug_attach import RankTarget, attach_ranks
from nbdist.driver.lab_debug_ids import FIRST_ID, RankIds
from nbdist.driver.lab_debug_paths import RankPaths
from nbdist.driver.lab_debug_pause import pause_ranks
from nbdist.driver.rank_relay import RelayedRankConnection
from nbdist.errors import format_ranks

__all__ = [
    "ALL_RANKS",
    "FIRST_ID",
    "RANKS_THREAD",
    "SUMMARY_PREFIX",
    "LabDebugRouter",
]

# The thread id under which every stopped rank appears (debugpy numbers the kernel's
# own threads from 1).
RANKS_THREAD = 1_000_000
# The rank of the Callstack's summary frame ("every stopped rank").
ALL_RANKS = -1
# How the summary frame's name begins.
SUMMARY_PREFIX = "all stopped"
# Frames of the machinery that runs a cell on a rank: a rank's stack is shown down to
# the first of them (the cell's frame and what it called).
_MACHINERY = (
    "/IPython/",
    "/ipykernel/",
    "/ipyparallel/",
    "/tornado/",
    "/zmq/",
    "/asyncio/",
    # All of nbdist (an editable install's too, outside site-packages): a step off a
    # cell's last line runs nbdist's end-of-cell code, which is not the user's.
    "/nbdist/",
    "/traitlets/",
    "/debugpy/",
    "<frozen ",
    "/runpy.py",
    "/threading.py",
)
# How long leaving the ranks waits for their debugpy to confirm.
_LEAVE_TIMEOUT_S = 5.0
_BY_FRAME = ("scopes", "evaluate", "richInspectVariables", "completions", "stepInTargets")
_BY_VARIABLES = ("variables", "setVariable")
_STEPS = ("next", "stepIn", "stepOut")


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
        self._ranks: dict[int, dap.DapClient] = {}
        self._breakpoints: dict[str, dict] = {}  # path -> setBreakpoints arguments
        self._exceptions: dict | None = None  # setExceptionBreakpoints arguments
        self._stopped: dict[int, int] = {}  # rank -> its stopped thread
        self._ids = RankIds()  # ids given to JupyterLab <-> (rank, rank's id)
        self._paths = RankPaths()  # files each rank runs from a %dist_sync copy
        # The rank whose frame JupyterLab has selected (None: the summary frame, every
        # stopped rank), and that frame's id: JupyterLab keeps a selected frame across a
        # Callstack refresh when its id is still listed, else selects the first frame.
        self._selected: int | None = None
        self._selected_frame: int | None = None
        self._told: set[tuple[int, int | None]] = set()  # (rank, pid) told not attached
        self._running: set[int] = set()  # the ranks of the kernel's ranks cell running now
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
        if command == "pause" and self._running and args.get("threadId") != RANKS_THREAD:
            # JupyterLab's Pause names thread 1 (its fallback) while a ranks cell runs: the
            # kernel's own thread only waits for the ranks there, so pausing it would freeze
            # the kernel while the ranks run on. The ranks are what the user means.
            return await self._pause(request)
        if command in ("stackTrace", "continue", *_STEPS, "pause") and (
            args.get("threadId") == RANKS_THREAD
        ):
            return await self._on_ranks_thread(request)
        if command == "continue" and self._stopped and not self._kernel_stopped():
            # JupyterLab forgets the stopped thread before it sends "continue", and then
            # names thread 1 (its fallback): with only ranks stopped, it means them. Not
            # passed on: a "continue" for a kernel that is not stopped hangs ipykernel's debugger.
            return await self._on_ranks_thread(dict(request, arguments={"threadId": RANKS_THREAD}))
        if command in _BY_FRAME and self._ids.is_ours(args.get("frameId")):
            return await self._forward_by_id(request, "frameId")
        if command in _BY_VARIABLES and self._ids.is_ours(args.get("variablesReference")):
            return await self._forward_by_id(request, "variablesReference")
        reply = await self._inner(request)
        if command == "setBreakpoints":
            path = (args.get("source") or {}).get("path")
            if path:
                with self._lock:
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

    async def _ask(self, rank: int, command: str, arguments: dict | None = None) -> dict:
        connection = self._ranks.get(rank)
        if connection is None:
            raise ConnectionError(f"rank {rank} has no debugger connection")
        future = connection.request(command, arguments)
        return await asyncio.wait_for(asyncio.wrap_future(future), dap.REPLY_TIMEOUT_S)

    async def _to_all_ranks(self, command: str, arguments: dict) -> None:
        with self._lock:  # translated as use_copies last left the ranks' copies
            asks = [(r, a) for r in self._ranks for a in self._paths.to_rank(r, arguments)]
        await asyncio.gather(*(self._ask(r, command, a) for r, a in asks), return_exceptions=True)

    async def _on_ranks_thread(self, request: dict) -> dict:
        command = request["command"]
        stopped = dict(self._stopped)
        if command == "stackTrace":
            return _response(request, await self._stack(stopped))
        if command == "pause":
            return await self._pause(request)
        # The selected rank's frame, or every stopped rank when the summary frame is
        # selected (JupyterLab selects the top frame, the summary, when ranks stop after
        # a Continue).
        if self._selected in stopped:
            targets = {self._selected: stopped[self._selected]}
        else:
            targets = stopped
        if not targets:
            return _response(request, success=False, message="no rank is stopped")
        await self._resume(targets, command)
        if command != "continue":
            return _response(request)
        # JupyterLab cleared its Callstack when it sent "continue": whatever it lists next,
        # it selects the first frame, the summary.
        self._selected = self._selected_frame = None
        left = sorted(set(self._stopped) - set(targets))
        if left:
            # Show JupyterLab the ranks still stopped.
            self._event(
                "stopped",
                {
                    "reason": "pause",
                    "threadId": RANKS_THREAD,
                    "allThreadsStopped": False,
                    "description": f"{format_ranks(left)} still stopped",
                },
            )
        else:
            self._event("continued", {"threadId": RANKS_THREAD, "allThreadsContinued": False})
        return _response(request, {"allThreadsContinued": False})

    async def _pause(self, request: dict) -> dict:
        with self._lock:
            # Only while a ranks cell runs: an idle rank's debugpy would pause at the
            # first line of whatever cell it runs next, maybe much later.
            targets = sorted(
                r for r in self._running if r in self._ranks and r not in self._stopped
            )
            state = "stopped" if self._running and self._stopped else "idle"
        return await pause_ranks(self._ask, targets, request, state=state)

    async def _stack(self, stopped: dict[int, int]) -> dict:
        ranks = sorted(stopped)
        replies = await asyncio.gather(
            *(self._ask(r, "stackTrace", {"threadId": stopped[r]}) for r in ranks),
            return_exceptions=True,
        )
        frames = []
        for rank, reply in zip(ranks, replies):
            if isinstance(reply, BaseException):
                continue
            for frame in (reply.get("body") or {}).get("stackFrames", []):
                frame = self._paths.from_rank(rank, frame)  # named as JupyterLab knows the file
                path = (frame.get("source") or {}).get("path") or ""
                if any(part in path for part in _MACHINERY):
                    break
                frame = dict(frame, id=self._ids.give(rank, frame["id"]))
                frame["name"] = f"rank {rank} · {frame.get('name', '?')}"
                frames.append(frame)
        if frames:
            # The summary frame, first: where the lowest rank is; selecting it makes
            # Continue and the steps act on every stopped rank, Evaluate on each.
            top = frames[0]
            summary = dict(top, id=self._ids.give(ALL_RANKS, 1))
            names = {self._ids.find(f["id"])[0] for f in frames}
            summary["name"] = f"{SUMMARY_PREFIX} ({format_ranks(names)}) · {_function(top)}"
            frames.insert(0, summary)
        # Each rank's stop makes JupyterLab list the frames again; a refresh that comes
        # after the user selected a rank's frame keeps that frame selected (its id is
        # stable), so the selection stands. Else JupyterLab selects the summary frame.
        if self._selected_frame not in {f["id"] for f in frames}:
            self._selected = self._selected_frame = None
        return {"stackFrames": frames, "totalFrames": len(frames)}

    async def _resume(self, threads: dict[int, int], command: str) -> None:
        with self._lock:
            for rank in threads:
                self._stopped.pop(rank, None)
        arguments = {rank: {"threadId": t, "singleThread": True} for rank, t in threads.items()}
        await asyncio.gather(
            *(self._ask(rank, command, arguments[rank]) for rank in threads),
            return_exceptions=True,
        )

    async def _on_summary_frame(self, request: dict) -> dict:
        # The summary frame has no variables of its own; an evaluate there runs on
        # every stopped rank's top frame, identical results folded.
        command = request["command"]
        if command == "scopes":
            return _response(request, {"scopes": []})
        if command != "evaluate":
            return _response(request, success=False, message="select a rank's frame first")
        args = request.get("arguments") or {}
        stopped = dict(self._stopped)
        ranks = sorted(stopped)
        tops = await asyncio.gather(
            *(self._ask(r, "stackTrace", {"threadId": stopped[r], "levels": 1}) for r in ranks),
            return_exceptions=True,
        )
        asks = []
        for rank, top in zip(ranks, tops):
            frames = [] if isinstance(top, BaseException) else top["body"]["stackFrames"]
            arguments = dict(args, frameId=frames[0]["id"]) if frames else None
            asks.append(self._ask(rank, "evaluate", arguments) if frames else _gone(rank))
        replies = await asyncio.gather(*asks, return_exceptions=True)
        by_value: dict[str, list[int]] = {}
        for rank, reply in zip(ranks, replies):
            if isinstance(reply, BaseException):
                text = f"<{reply}>"
            elif reply.get("success"):
                text = (reply.get("body") or {}).get("result", "")
            else:
                text = f"<{reply.get('message', 'failed')}>"
            by_value.setdefault(text, []).append(rank)
        result = "\n".join(f"{format_ranks(r)}: {text}" for text, r in by_value.items())
        return _response(request, {"result": result, "variablesReference": 0})

    async def _forward_by_id(self, request: dict, key: str) -> dict:
        args = dict(request.get("arguments") or {})
        rank, rank_id = self._ids.find(args[key]) or (None, None)
        if rank is None:
            return _response(request, success=False, message="that frame or variable is gone")
        if key == "frameId":
            self._selected = None if rank == ALL_RANKS else rank
            self._selected_frame = args[key]
        if rank == ALL_RANKS:
            return await self._on_summary_frame(request)
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
                item["variablesReference"] = self._ids.give(rank, item["variablesReference"])
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
                current = self._ranks.get(rank)
                # Only a connection that went away: a restarted rank's new one stays.
                if name != "continued" and current is not None and current.closed:
                    self._ranks.pop(rank, None)
            if was is not None and not self._stopped:
                self._event("continued", {"threadId": RANKS_THREAD, "allThreadsContinued": False})
        elif name == "output":
            return  # the rank's output already reaches the cell through the session

    def attached(self, rank: int, endpoint: dict) -> bool:
        """Whether this router is attached to ``rank``'s debugpy at ``endpoint`` (a restarted
        rank has a new one)."""
        connection = self._ranks.get(rank)
        return (
            connection is not None
            and not connection.closed
            and connection.endpoint == (endpoint.get("host"), endpoint.get("port"))
            and connection.pid in (None, endpoint.get("pid"))
        )

    def tell(self, ranks: list[int], endpoints: list[dict], text: str) -> None:
        """Print ``text`` in the cell's output (stderr), once per rank process it concerns."""
        keys = {(r, e.get("pid")) for r, e in zip(ranks, endpoints)}
        if keys <= self._told:
            return
        self._told |= keys
        print(text, file=sys.stderr)

    def connect(self, targets: list[RankTarget]) -> dict[int, Exception]:
        """Attach to each target rank's debugpy (:func:`~nbdist.driver.lab_debug_attach.attach_ranks`)
        and give it the breakpoints set so far; ``{rank: why}`` for the ranks it could not.

        ``targets``: (rank, host, port, pid, relay) each; ``pid``: the rank's process id,
        when known (a restarted rank is a new process). A connection to a rank's former
        debugpy is closed.
        """
        for rank, *_ in targets:
            old = self._ranks.get(rank)
            if old is not None:
                old.close()
        return attach_ranks(targets, self._on_rank_event, self._configure, self._attached)

    def _attached(self, rank: int, connection: dap.DapClient) -> None:
        with self._lock:
            self._ranks[rank] = connection

    def _configure(self, rank: int, connection: dap.DapClient) -> list:
        """Send ``rank`` the breakpoints and exception filters set so far, then
        ``configurationDone``; the futures of their answers."""
        sent = [
            connection.request("setBreakpoints", moved)
            for arguments in list(self._breakpoints.values())
            for moved in self._paths.to_rank(rank, arguments)
        ]
        if self._exceptions is not None:
            sent.append(connection.request("setExceptionBreakpoints", self._exceptions))
        sent.append(connection.request("configurationDone"))
        return sent

    def cell_started(self, ranks) -> None:
        """The kernel's cell runs on ``ranks`` (a Pause while it runs is theirs)."""
        self._running = set(ranks)

    def unreported(self, ranks) -> list[int]:
        """Those of ``ranks`` that run the kernel's cell, attached and not shown stopped."""
        with self._lock:
            return sorted(
                r
                for r in ranks
                if r in self._running and r in self._ranks and r not in self._stopped
            )

    def ask_now(self, rank: int, command: str, arguments: dict | None = None) -> dict:
        """``rank``'s debugpy's response to ``command``, waited for (from a thread of its own)."""
        connection = self._ranks.get(rank)
        if connection is None:
            raise ConnectionError(f"rank {rank} has no debugger connection")
        return connection.request(command, arguments).result(dap.REPLY_TIMEOUT_S)

    def show_stopped(self, rank: int, thread: int) -> None:
        """Show ``rank`` stopped in ``thread`` (:mod:`nbdist.driver.lab_debug_watch`), unless shown."""
        with self._lock:
            if rank in self._stopped or rank not in self._running:
                return
        self._on_rank_event(
            rank, {"event": "stopped", "body": {"reason": "pause", "threadId": thread}}
        )

    def stopped_among(self, ranks) -> list[int]:
        """Those of ``ranks`` shown stopped now."""
        with self._lock:
            return sorted(r for r in ranks if r in self._stopped)

    def cell_ended(self, ranks, still_paused=frozenset()) -> None:
        """The kernel's cell returned (finished, failed, interrupted, or a ``--noblock`` cell
        that left its ranks running): those of ``ranks`` (the ranks asked) not
        ``still_paused`` (as each rank said) are no longer shown stopped."""
        self._running = set()
        with self._lock:
            cleared = [
                r for r in ranks if r not in still_paused and self._stopped.pop(r, None) is not None
            ]
            still = bool(self._stopped)
        if cleared and not still:
            self._event("continued", {"threadId": RANKS_THREAD, "allThreadsContinued": False})

    def leave_relayed(self, client) -> None:
        """Close the relayed connections that go through ``client`` (its session is stopping):
        the ranks' relays close their debugpy connections while the client can still say so."""
        with self._lock:
            gone = [
                c
                for c in self._ranks.values()
                if isinstance(c, RelayedRankConnection) and c.through(client)
            ]
        _leave(gone)

    def use_copies(self, copies: dict[int, dict[str, str]]) -> None:
        """Where ``copies``' ranks run ``%dist_sync``'s copies now, as each reported it.

        Breakpoints are set again at the copies' paths, answered before the cell starts
        (it could pass them first). A rank that does not answer is left and told; the
        next cell attaches it again, breakpoints and all.
        """
        with self._lock:
            changed = self._paths.update(copies)
            asks = [
                (rank, connection, connection.request("setBreakpoints", moved))
                for rank in changed
                if (connection := self._ranks.get(rank)) is not None
                for arguments in list(self._breakpoints.values())
                for moved in self._paths.to_rank(rank, arguments)[1:]
            ]
        deadline = time.monotonic() + dap.REPLY_TIMEOUT_S
        failed: dict[int, tuple] = {}
        for rank, connection, future in asks:
            try:
                dap.succeeded(future, max(0.0, deadline - time.monotonic()))
            except Exception as exc:  # noqa: BLE001 - that rank is left, the others go on
                failed.setdefault(rank, (connection, exc))
        for rank, (connection, exc) in failed.items():
            with self._lock:
                if self._ranks.get(rank) is connection:
                    del self._ranks[rank]
            connection.close()
            print(
                f"nbdist: JupyterLab's debugger lost rank {rank} ({exc}); the next cell "
                "attaches it again",
                file=sys.stderr,
            )

    def connected(self) -> list[int]:
        """The ranks this router is attached to."""
        return sorted(self._ranks)

    def disconnect(self) -> None:
        """Leave every rank (the debugger was switched off): their breakpoints go, paused ranks run on."""
        with self._lock:
            connections, self._ranks = list(self._ranks.values()), {}
            self._stopped.clear()
            self._ids.clear()
            self._selected = self._selected_frame = None
            self._breakpoints.clear()
            self._exceptions = None
            self.active = False
        _leave(connections)


def _leave(connections: list[dap.DapClient]) -> None:
    # A client that closes without "disconnect" would leave paused ranks paused. All
    # at once: a rank that does not answer costs the wait once, not once per rank.
    asked = [c.request("disconnect", {"terminateDebuggee": False}) for c in connections]
    deadline = time.monotonic() + _LEAVE_TIMEOUT_S
    for future in asked:
        try:
            dap.succeeded(future, max(0.0, deadline - time.monotonic()))
        except Exception:  # noqa: BLE001 - leaving anyway
            pass
    for connection in connections:
        connection.close()
    for connection in connections:
        connection.wait_closed(dap.CONNECT_TIMEOUT_S)


def _function(frame: dict) -> str:
    return frame.get("name", "?").partition(" · ")[2] or "?"


async def _gone(rank: int) -> dict:
    return {"success": False, "message": f"rank {rank} has no frame"}
