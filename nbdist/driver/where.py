"""Kernel side: where is each rank? Stacks and last collectives, read without stopping them.

:func:`ask` sends a request on each engine's control channel (served by the
rank's control thread, see :mod:`nbdist.engine.control`), so it works while a
cell runs or hangs. :func:`diagnose` compares the ranks' last collectives and
names the ones the others wait for. ``%dist_where`` and a cell's ``--timeout``
show :func:`format_where`'s report.

Example::

    s = nbdist.current_session()
    print(nbdist.driver.where.format_where(s.where()))
    # rank 0: inside all_reduce #118 for 12.0 s
    #   File "<cell>", line 4, in <module>: dist.all_reduce(t)
    # rank 1: never entered all_reduce #118 (last: all_reduce #117, returned 12.1 s ago)
    #   File "<cell>", line 3, in <module>: time.sleep(60)
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from nbdist.driver.ipp_internals import send_control
from nbdist.engine.control import REQUEST

__all__ = [
    "RankWhere",
    "ask",
    "behind",
    "control_request",
    "diagnose",
    "format_flight",
    "format_where",
    "locate",
]

# How long an unanswered rank is waited for: a rank that holds the GIL in native code never answers.
_ANSWER_TIMEOUT_S = 3.0


@dataclass
class RankWhere:
    """What one rank is doing: its stack (innermost last) and last collective."""

    rank: int
    answered: bool
    busy: bool = False
    stack: list[dict] = field(default_factory=list)
    collective: dict | None = None
    note: str = ""
    # The process group's flight recorder: its last collectives, oldest first (None: not recorded).
    flight: list[dict] | None = None
    # The default group's last and newest open call there (the cell guard's look; None: not asked).
    flight_state: dict | None = None


def control_request(
    client, engine_ids: Sequence[int], action: str, timeout: float, **options
) -> list:
    """Send nbdist's control ``action`` (with ``options``) to the engines; replies (or None) in order."""
    futures = []
    for eid in engine_ids:
        try:
            futures.append(send_control(client, eid, REQUEST, {"action": action, **options}))
        except Exception:  # the engine left the cluster meanwhile (it died)
            futures.append(None)
    deadline = time.monotonic() + timeout
    replies = []
    for future in futures:
        if future is None:
            replies.append(None)
            continue
        try:
            msgs = future.result(timeout=max(0.0, deadline - time.monotonic()))
        except Exception:  # no answer in time, or the engine is gone
            replies.append(None)
            continue
        msg = msgs[0] if isinstance(msgs, list) else msgs
        content = msg["content"]
        replies.append(content if content.get("status") == "ok" else None)
    return replies


def ask(
    client,
    ranks: Sequence,
    *,
    timeout: float = _ANSWER_TIMEOUT_S,
    light: bool = False,
    flight: bool = False,
) -> list[RankWhere]:
    """Each rank's :class:`RankWhere` (``ranks``: RankInfo objects); nothing is interrupted.

    ``light``: only ``busy`` and ``collective`` (no stack, no flight recorder), for a
    look repeated while a cell runs; with ``flight``, also ``flight_state`` (the
    default group's last and newest open call in the flight recorder).
    """
    action = "collective" if light else "where"
    options = {"flight": True} if light and flight else {}
    replies = control_request(client, [r.engine_id for r in ranks], action, timeout, **options)
    found = []
    for info, reply in zip(ranks, replies):
        if reply is None:
            found.append(
                RankWhere(
                    info.rank,
                    answered=False,
                    note=f"no answer within {timeout:g} s (dead, or native code holding the GIL)",
                )
            )
            continue
        w = reply["where"]
        found.append(
            RankWhere(
                info.rank,
                True,
                busy=w["busy"],
                stack=w.get("stack", []),
                collective=w["collective"],
                flight=w.get("flight"),
                flight_state=w.get("flight_state"),
            )
        )
    return found


def locate(client, ranks: Sequence, dead: dict[int, str]) -> list[RankWhere]:
    """:func:`ask` the live ``ranks`` (RankInfo); ``dead`` ones ({rank: cause}) are reported as such."""
    found = {w.rank: w for w in ask(client, [r for r in ranks if r.rank not in dead])}
    for rank, cause in dead.items():
        found[rank] = RankWhere(rank, answered=False, note=f"dead: {cause}")
    return [found[r.rank] for r in ranks if r.rank in found]


def diagnose(found: Sequence[RankWhere]) -> dict[int, str]:
    """One line per rank: inside which collective, or which one it never entered.

    The collective the ranks wait in is the highest sequence number any rank is
    inside; a rank whose last collective is older "never entered" it.
    """
    waiting = [w.collective for w in found if w.collective and w.collective["inside"]]
    target = max(waiting, key=lambda c: c["seq"]) if waiting else None
    lines = {}
    for w in found:
        c = w.collective
        if not w.answered:
            lines[w.rank] = w.note
        elif c is not None and c["inside"]:
            lines[w.rank] = f"inside {c['op']} #{c['seq']} for {c['seconds']:.1f} s"
        elif target is not None and (c is None or c["seq"] < target["seq"]):
            last = "none yet" if c is None else _done(c)
            lines[w.rank] = f"never entered {target['op']} #{target['seq']} (last: {last})"
        elif c is not None:
            lines[w.rank] = f"last collective {_done(c)}" + ("" if w.busy else "; idle")
        else:
            lines[w.rank] = "no collective since the group formed" + ("" if w.busy else "; idle")
    return lines


def _done(c: dict) -> str:
    how = "raised" if c.get("raised") else "returned"
    return f"{c['op']} #{c['seq']}, {how} {c['seconds']:.1f} s ago"


def format_where(found: Sequence[RankWhere], *, frames: int = 6) -> str:
    """The report: per rank, its diagnosis and the innermost ``frames`` of its stack."""
    lines = diagnose(found)
    out = []
    for w in found:
        out.append(f"rank {w.rank}: {lines[w.rank]}")
        for f in w.stack[-frames:]:
            code = f": {f['code']}" if f["code"] else ""
            out.append(f'  File "{f["file"]}", line {f["line"]}, in {f["name"]}{code}')
    out.extend(format_flight(found))
    return "\n".join(out)


def behind(found: Sequence[RankWhere]) -> dict[int, tuple[int, int]]:
    """Ranks whose flight recorder is behind another's, per group: {rank: (its seq, the max)}.

    The sequence number counts a group's collectives on each rank, so a rank with a
    lower last number has not yet issued a collective the others are waiting in.
    """
    last: dict[str, dict[int, int]] = {}
    for w in found:
        for entry in w.flight or []:
            seqs = last.setdefault(entry["group"], {})
            seqs[w.rank] = max(seqs.get(w.rank, 0), entry["seq"])
    lagging: dict[int, tuple[int, int]] = {}
    for seqs in last.values():
        top = max(seqs.values())
        for rank, seq in seqs.items():
            if seq < top and rank not in lagging:
                lagging[rank] = (seq, top)
    return lagging


def format_flight(found: Sequence[RankWhere], *, entries: int = 3) -> list[str]:
    """The flight-recorder lines of the report (none when no rank recorded any)."""
    if not any(w.flight for w in found):
        return []
    out = ["flight recorder (the process group's last collectives, C++-issued ones included):"]
    for w in found:
        if not w.flight:
            continue
        shown = []
        for e in w.flight[-entries:]:
            size = "×".join(str(d) for d in e["sizes"][0]) if e["sizes"] and e["sizes"][0] else ""
            # gloo reports every entry as "scheduled": only NCCL's states say anything.
            state = f" {e['state']}" if e["state"] in ("started", "completed") else ""
            shown.append(f"#{e['seq']} {e['op']}" + (f" [{size}]" if size else "") + state)
        out.append(f"  rank {w.rank}: " + " · ".join(shown))
    for rank, (seq, top) in sorted(behind(found).items()):
        out.append(
            f"  rank {rank} is behind: its last collective is #{seq}, another rank's is #{top}"
        )
    return out
