"""Kernel side: attaching JupyterLab's debugger router to the ranks' debugpy, many ranks at once.

For each rank the Debug Adapter Protocol asks for the same steps: ``initialize``,
``attach``, wait for the ``initialized`` event, the breakpoints set so far and
``configurationDone``, then the answer to ``attach``. :func:`attach_ranks` takes the
ranks a window at a time and sends each step to every rank of the window before it
reads an answer: one rank after the other, 64 ranks took 15.7 s of the first stop's
48.9 s on 2 cores (3.7 s this way; bench/RESULTS.md). The window stays small (4,
or one per core) so that a loaded machine still answers each rank within the
timeouts. A rank that fails (refused, hung up, no answer) fails alone.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable

from nbdist.driver import rank_debugpy as dap
from nbdist.driver.rank_relay import RelayedRankConnection

__all__ = ["RankTarget", "attach_ranks"]

# A rank to attach to: rank, host, port, pid (or None), relay ((client, engine_id), or None).
RankTarget = tuple[int, str, int, int | None, tuple | None]


def attach_ranks(
    targets: list[RankTarget],
    on_event: Callable[[int, dict], None],
    configure: Callable[[int, dap.DapClient], list],
    attached: Callable[[int, dap.DapClient], None],
) -> dict[int, Exception]:
    """Attach to each target's debugpy; ``{rank: why}`` for the ranks it could not.

    ``relay``: ``(client, engine_id)`` for a rank on another machine, whose
    ``host:port`` is that machine's loopback: its messages then travel through the
    engine's control channel (:mod:`nbdist.driver.rank_relay`) instead of TCP.
    ``on_event(rank, message)``: each connection's events. ``configure(rank,
    connection)`` sends what the rank must know before ``configurationDone`` and
    that request too, returning the futures of their answers. ``attached(rank,
    connection)`` gets each rank as soon as it is attached.
    """
    failed: dict[int, Exception] = {}
    width = max(4, os.cpu_count() or 1)
    for start in range(0, len(targets), width):
        window = targets[start : start + width]
        failed.update(_attach_window(window, on_event, configure, attached))
    return failed


def _open(target: RankTarget, on_event) -> dap.DapClient:
    rank, host, port, pid, relay = target
    if relay is None:
        connection = dap.RankConnection(rank, host, port, on_event)
    else:
        client, engine_id = relay
        connection = RelayedRankConnection(rank, client, engine_id, (host, port), on_event)
    connection.pid = pid if pid is not None else connection.pid
    return connection


def _attach_window(targets, on_event, configure, attached) -> dict[int, Exception]:
    failed: dict[int, Exception] = {}
    opened: dict[int, dap.DapClient] = {}
    pending: dict[int, list] = {}  # each rank's requests sent, their answers not read

    @contextlib.contextmanager
    def step(rank):
        try:
            yield
        except Exception as exc:  # noqa: BLE001 - that rank's failure, told by the caller
            failed[rank] = exc
            connection = opened.pop(rank, None)
            if connection is not None:
                connection.close()

    try:
        for target in targets:
            rank = target[0]
            with step(rank):
                opened[rank] = connection = _open(target, on_event)
                pending[rank] = [connection.request("initialize", dap.INITIALIZE)]
        for rank, connection in list(opened.items()):
            with step(rank):
                dap.succeeded(pending[rank].pop())
                # debugpy answers the attach after configurationDone: read last.
                pending[rank].append(connection.request("attach", dap.ATTACH))
        for rank, connection in list(opened.items()):
            with step(rank):
                if not connection.initialized.wait(dap.CONNECT_TIMEOUT_S):
                    raise TimeoutError(f"rank {rank}'s debugpy did not start a debug session")
                pending[rank][:0] = configure(rank, connection)
        for rank in list(opened):
            with step(rank):
                for answer in pending[rank]:
                    dap.succeeded(answer)
                attached(rank, opened.pop(rank))
    finally:
        for connection in opened.values():  # interrupted before its rank was attached
            connection.close()
    return failed
