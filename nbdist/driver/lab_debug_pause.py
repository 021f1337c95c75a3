"""Kernel side: JupyterLab's Pause button on the ranks (:class:`nbdist.driver.lab_debugger.LabDebugRouter`).

JupyterLab's Pause names thread 1 (its fallback) or the ranks' thread; while a
ranks cell runs, the kernel's own thread only waits for the ranks, so the router
asks every attached rank's debugpy to pause that rank's main thread (the one
that runs cells) instead. Only that thread: the rank's control thread must keep
serving (it carries an interrupt, ``%dist_where``, a relayed debugger). Each
rank then stops at the next line of the user's code it runs and reports it
(``stopped``, reason ``pause``), as at a breakpoint.
"""

from __future__ import annotations

import asyncio

from nbdist.errors import format_ranks

__all__ = ["main_thread", "pause_ranks"]

# The thread that runs a rank's cells (an ipyparallel engine's main thread).
_MAIN_THREAD = "MainThread"


async def pause_ranks(ask, targets: list[int], request: dict, *, state: str) -> dict:
    """Answer ``request`` (a DAP ``pause``) by pausing ``targets``, the running ranks not
    stopped; ``ask(rank, command, arguments)``: the router's request to a rank's debugpy.

    Fails (``success: false`` and why) when there is no rank to pause (``state``:
    "idle", no ranks cell runs, or "stopped", its ranks are stopped already) or none
    could be paused.
    """
    if not targets:
        if state == "stopped":
            return _reply(request, "the ranks of the running cell are stopped already")
        return _reply(request, "no ranks cell is running in the kernel: nothing to pause")
    results = await asyncio.gather(
        *(_pause_one(ask, rank) for rank in targets), return_exceptions=True
    )
    failed = {r: str(e) for r, e in zip(targets, results) if e is not None}
    if len(failed) == len(targets):
        return _reply(request, f"could not pause {format_ranks(targets)}: {failed[targets[0]]}")
    return _reply(request)


async def _pause_one(ask, rank: int) -> None:
    main = main_thread(await ask(rank, "threads"))
    if main is None:
        raise RuntimeError(f"rank {rank}'s debugpy lists no main thread")
    reply = await ask(rank, "pause", {"threadId": main})
    if not reply.get("success"):
        raise RuntimeError(reply.get("message") or "pause failed")


def main_thread(threads: dict) -> int | None:
    """The id of the rank's main thread in its debugpy's answer to ``threads``, or None."""
    listed = (threads.get("body") or {}).get("threads") or []
    return next((t["id"] for t in listed if t.get("name") == _MAIN_THREAD), None)


def _reply(request: dict, failure: str | None = None) -> dict:
    reply = {
        "seq": request.get("seq", 0),
        "type": "response",
        "request_seq": request.get("seq", 0),
        "command": request.get("command"),
        "success": failure is None,
        "body": {},
    }
    if failure is not None:
        reply["message"] = failure
    return reply
