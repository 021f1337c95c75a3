"""Kernel side: the output of cells an earlier kernel sent, streamed into the kernel that attached.

When a kernel dies while a named session's ranks run one of its cells, the
ranks go on: the cell's execute requests stay queued on the controller
(:meth:`ipyparallel.Client.queue_status` lists them per engine), and the
controller's hub keeps each request's record, with everything the rank printed
so far (``stdout``/``stderr``), the cell's value and, once it is done, its reply
(of displays the hub keeps only the latest, so they are not replayed). A kernel that
attaches (:meth:`nbdist.driver.named_sessions.NamedSession.follow_unfinished`) finds
those requests and polls their records: it shows the output printed before it
attached, then the rest as it comes, merged by rank as any cell's, and fails
like the cell would have if a rank raised. The cell's metrics go on reaching
the session's keeper; once the cell ended, this waits until its points are in
the run, as after any cell.
"""

from __future__ import annotations

import ast
import time
from collections.abc import Callable, Sequence

from nbdist.driver.ipp_internals import queue_status
from nbdist.driver.output import OutputMerger
from nbdist.driver.sinks import default_sink
from nbdist.errors import NbdistError, RankError, RankFailure

__all__ = ["follow_unfinished", "unfinished_cells"]

_POLL_S = 0.1
# After a cell's replies: how long its last output may still be on its way to the hub
# (output and replies travel on different sockets), and how long interrupted ranks get.
_OUTPUT_GRACE_S = 2.0
_INTERRUPT_GRACE_S = 10.0
_QUIET_S = 0.3
# A live controller answers in well under a second; a gone one never (an attach then fails).
_CONTROLLER_ANSWERS_S = 10.0
_KEYS = ["msg_id", "stdout", "stderr", "completed", "result_content", "execute_result"]


def unfinished_cells(client, group) -> list[dict[int, str]]:
    """Cells the controller still has queued or running on the ranks: [{rank: msg_id}], oldest first."""
    try:
        status = queue_status(client, None, _CONTROLLER_ANSWERS_S, verbose=True)
    except TimeoutError as exc:
        raise NbdistError(
            f"the session's controller did not answer ({exc}): it may be gone; "
            "%dist_sessions shows the session's state"
        ) from None
    queues = {r.rank: list(status.get(r.engine_id, {}).get("queue", [])) for r in group.ranks}
    depth = max((len(q) for q in queues.values()), default=0)
    # The n-th request queued on each rank belongs to the n-th cell: nbdist sends a cell to
    # all its ranks at once, and each engine runs its requests in order.
    return [{rank: q[i] for rank, q in queues.items() if i < len(q)} for i in range(depth)]


def follow_unfinished(
    client, group, hub, interrupt: Callable[[Sequence[int]], None], sink=None
) -> list:
    """Stream every unfinished cell's output until it ends; the results of the last one.

    ``hub``: the session's metrics (waited on for the cell's points);
    ``interrupt(ranks)``: relays Ctrl-C to the ranks, as for a cell of this kernel.
    Raises :class:`~nbdist.errors.RankError` as soon as a followed cell failed on a rank.
    """
    results: list = []
    for cell in unfinished_cells(client, group):
        results = _follow(client, cell, hub, interrupt, sink)
    return results


def _follow(client, cell: dict[int, str], hub, interrupt, sink) -> list:
    ranks = sorted(cell)
    by_id = {msg_id: rank for rank, msg_id in cell.items()}
    merger = OutputMerger(ranks, sink or default_sink(len(ranks)))
    shown = {(rank, s): 0 for rank in ranks for s in ("stdout", "stderr")}
    records: dict[int, dict] = {}
    deadline = done_at = None  # set once everything replied (or after an interrupt)
    interrupted = False
    try:
        while True:
            try:
                changed = _poll(client, by_id, records, shown, merger)
                merger.poll()
                done = all((records.get(r) or {}).get("completed") for r in ranks)
                if done and deadline is None:
                    done_at, deadline = time.monotonic(), time.monotonic() + _OUTPUT_GRACE_S
                quiet = not changed and time.monotonic() - done_at > _QUIET_S if done else False
                if done and (quiet or time.monotonic() > deadline):
                    # Replies in, and no new output for a while: the output is complete.
                    # The cell's value last, as after any cell. (The hub keeps each rank's
                    # printed text whole but only its latest display: displays are not replayed.)
                    for rank in ranks:
                        value = records[rank].get("execute_result") or {}
                        if value.get("data"):
                            merger.feed_display(rank, value["data"], value.get("metadata", {}))
                    break
                if interrupted and deadline is not None and time.monotonic() > deadline:
                    break
                time.sleep(_POLL_S)
            except KeyboardInterrupt:
                if interrupted:
                    break  # a second Ctrl-C: stop waiting now
                interrupted = True
                interrupt(ranks)
                deadline = time.monotonic() + _INTERRUPT_GRACE_S
    finally:
        merger.close()
    if interrupted:
        raise KeyboardInterrupt
    replies = {rank: (records[rank].get("result_content") or {}) for rank in ranks}
    hub.settle({rank: _points_sent(reply) for rank, reply in replies.items()})
    failures = [
        RankFailure(
            rank=rank,
            ename=reply.get("ename", "Error"),
            evalue=reply.get("evalue", ""),
            traceback="\n".join(reply.get("traceback") or []),
        )
        for rank, reply in replies.items()
        if reply.get("status") == "error"
    ]
    if failures:
        raise RankError(failures, world_ranks=ranks)
    return [replies[rank] for rank in ranks]


def _poll(client, by_id, records, shown, merger) -> bool:
    """Read the cell's records from the hub, feed new output; True if there was any."""
    found = client.db_query({"msg_id": {"$in": list(by_id)}}, keys=_KEYS)
    changed = False
    for rec in found:
        rank = by_id.get(rec.get("msg_id"))
        if rank is None:
            continue
        records[rank] = rec
        for stream in ("stdout", "stderr"):
            text = rec.get(stream) or ""
            seen = shown[(rank, stream)]
            if len(text) > seen:
                merger.feed(rank, stream, text[seen:])
                shown[(rank, stream)] = len(text)
                changed = True
    return changed


def _points_sent(reply: dict) -> int | None:
    """The rank's running count of points sent, from its reply's user expression (see cells)."""
    try:
        answer = reply["user_expressions"]["nbdist"]
        if answer["status"] != "ok":
            return None
        total = int(ast.literal_eval(answer["data"]["text/plain"]).split(" ", 1)[0])
        return total if total >= 0 else None
    except (KeyError, TypeError, ValueError, SyntaxError):
        return None
