"""Kernel side: the crash records of ranks a launcher started (Slurm, MPI, SSH): read, removed.

Each such rank has faulthandler write its Python stacks to a record on its own
machine (:mod:`nbdist.engine.crash_record`). When one dies, its death's line
says where in Python it was if the record holds a fatal error: read here where
the rank ran on the kernel's machine, else by a live rank of the same host
(a control request, answered while that rank runs a cell). No rank of that
host left alive: the line says where the record is. ``%dist_stop`` removes the
records: the live ranks their own, the dead ones' from here or through a live
rank of their host (the rest the next rank there to start prunes).
"""

from __future__ import annotations

import socket
from collections.abc import Sequence

from nbdist.driver import crash_stack
from nbdist.driver.where import control_request
from nbdist.engine import crash_record

__all__ = ["CrashRecords"]

# A live rank of the dead one's host reads the record from its control thread: quick.
_ASK_TIMEOUT_S = 2.0


def _on_this_machine(info) -> bool:
    # The record's name carries the rank's own host name (``host`` may be the placement's alias).
    return info.pid_here or crash_record.record_host(info.crash_record) == socket.gethostname()


def _peers(info, ranks: Sequence, alive_ids: set[int]) -> list:
    return [
        r for r in ranks if r.host == info.host and r.rank != info.rank and r.engine_id in alive_ids
    ]


def _read(client, info, ranks: Sequence, alive_ids: set[int]) -> str | None:
    if _on_this_machine(info):
        found = crash_record.read_record(info.crash_record)
        if found is not None:
            return found
    answered = False
    for peer in _peers(info, ranks, alive_ids):
        (reply,) = control_request(
            client, [peer.engine_id], "crash_record", _ASK_TIMEOUT_S, path=info.crash_record
        )
        if reply is not None and reply.get("record") is not None:
            return reply["record"]
        # A peer that sees no such file may sit in another container of the same host: ask on.
        answered = answered or reply is not None
    return "" if answered else None


class CrashRecords:
    """The records of a group's launcher-started ranks; each dead rank's read once."""

    def __init__(self, ranks: Sequence) -> None:
        """``ranks``: the group's RankInfo; those without a record (the zygote's) are left out."""
        self._ranks = list(ranks)
        self._by_pid = {r.pid: r for r in ranks if r.crash_record and r.pid_here}
        self._words: dict[int, str] = {}

    def __bool__(self) -> bool:
        """Whether any rank has a record."""
        return any(r.crash_record for r in self._ranks)

    def read_here(self, pid: int) -> str:
        """The record of the rank with ``pid`` on this machine ('' if none): for the rank monitor."""
        info = self._by_pid.get(pid)
        return (crash_record.read_record(info.crash_record) or "") if info is not None else ""

    def words(self, rank: int, client) -> str:
        """How rank ``rank`` (dead, its engine gone) crashed, with where ('' if its record says
        nothing); asked of its host once."""
        if rank in self._words:
            return self._words[rank]
        info = next((r for r in self._ranks if r.rank == rank and r.crash_record), None)
        words = ""
        if info is not None:
            found = _read(client, info, self._ranks, set(client.ids))
            if found is None and not _on_this_machine(info):  # no rank of its host answered
                words = f"its crash record, if it crashed, is on {info.host}: {info.crash_record}"
            else:
                words = crash_stack.crash_words(found or "")
        self._words[rank] = words
        return words

    def remove(self, client, dead=()) -> None:
        """At the stop: the live ranks remove their own records, the dead ones' (``dead``: the
        ranks known dead) go from here or through a live rank of their host."""
        ranks = self._ranks
        alive_ids = set(client.ids)
        with_records = [r for r in ranks if r.crash_record]
        if not with_records:  # the zygote's ranks: nothing to ask
            return
        asked = [r for r in with_records if r.engine_id in alive_ids and r.rank not in dead]
        replies = control_request(
            client, [r.engine_id for r in asked], "crash_record", _ASK_TIMEOUT_S, remove_own=True
        )
        # A rank that did not answer died (the controller may not know yet).
        removed = {r.rank for r, reply in zip(asked, replies) if reply is not None}
        alive_ids -= {r.engine_id for r in ranks if r.rank in dead}
        alive_ids -= {r.engine_id for r in asked if r.rank not in removed}
        for info in with_records:
            if info.rank in removed:
                continue
            if _on_this_machine(info) and crash_record.remove_record(info.crash_record):
                continue
            for peer in _peers(info, ranks, alive_ids)[:1]:
                control_request(
                    client,
                    [peer.engine_id],
                    "crash_record",
                    _ASK_TIMEOUT_S,
                    path=info.crash_record,
                    remove=True,
                )
