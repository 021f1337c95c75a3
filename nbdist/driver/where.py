"""Kernel side: where is each rank? Stacks and last collectives, read without stopping them.

:func:`ask` sends a request on each engine's control channel (served by the
rank's control thread, see :mod:`nbdist.engine.control`), so it works while a
cell runs or hangs. :func:`diagnose` compares the ranks' last collectives and
names the ones the others wait for. ``%dist_where`` and a cell's ``--timeout``
show :func:`format_where`'s report.

The report names each group of ranks with the same diagnosis and the same stack
once (ranks as :func:`~nbdist.errors.format_ranks` writes them, seconds as a
range, each rank's own ``/tmp/ipykernel_<pid>/<hash>.py`` cell file compared as
one, see :func:`~nbdist.driver.output_fold.fold_key`), the smallest groups,
the odd ones out, first: at 256 ranks a hang reads in a few lines. A rank that
does not answer is said with what its process here is doing, as the process table
has it (stopped, asleep, running: :mod:`nbdist.driver.process_state`), in words the
same for every rank of that state, so that they group too.

Example::

    s = nbdist.current_session()
    print(nbdist.driver.where.format_where(s.where()))
    # rank 1: never entered all_reduce #118 (last: all_reduce #117, returned 12.1 s ago)
    #   File "<cell>", line 3, in <module>: time.sleep(60)
    # ranks 0,2-255: inside all_reduce #118 for 11.9-12.0 s
    #   File "<cell>", line 4, in <module>: dist.all_reduce(t)
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, wait
from dataclasses import dataclass, field

from nbdist.driver.ipp_internals import send_control
from nbdist.driver.output_fold import fold_key
from nbdist.driver.process_state import (
    STOPPED_STATES,
    process_here,
    process_state_of,
    state_phrase,
)
from nbdist.engine.control import REQUEST
from nbdist.engine.flight_recorder import DEFAULT_GROUP
from nbdist.errors import format_ranks

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
    # The call the rank was in when released that holds it still: {"s": seconds since the
    # release, "call": "send #2"} (None: none has).
    held: dict | None = None


def control_request(
    client,
    engine_ids: Sequence[int],
    action: str,
    timeout: float,
    *,
    while_answering: bool = False,
    **options,
) -> list:
    """Send nbdist's control ``action`` (with ``options``) to the engines; replies (or None) in order.

    ``while_answering``: each answer gives the ranks still silent ``timeout`` more (a rank
    holding the GIL in native code never answers, and the wait ends ``timeout`` after the
    last answer). 64 ranks formatting their tracebacks on 2 cores answered the same
    question in 0.6-1.5 s.
    """
    futures = []
    for eid in engine_ids:
        try:
            futures.append(send_control(client, eid, REQUEST, {"action": action, **options}))
        except Exception:  # the engine left the cluster meanwhile (it died)
            futures.append(None)
    pending = {future for future in futures if future is not None}
    deadline = time.monotonic() + timeout
    while pending:
        left = deadline - time.monotonic()
        if left <= 0:
            break
        answered, pending = wait(pending, timeout=left, return_when=FIRST_COMPLETED)
        if answered and while_answering:
            deadline = time.monotonic() + timeout
    replies = []
    for future in futures:
        if future is None or future in pending:
            replies.append(None)
            continue
        try:
            msgs = future.result(timeout=0)
        except Exception:  # the engine is gone
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
            found.append(RankWhere(info.rank, answered=False, note=_no_answer(info, timeout)))
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
                held=w.get("held"),
            )
        )
    return found


def _no_answer(info, timeout: float) -> str:
    # What a rank that did not answer is doing, where its process is on this machine (the
    # process table says stopped, asleep, running...); elsewhere, what it may be.
    said = f"no answer within {timeout:g} s"
    state = state_here(info)
    if not state:
        return f"{said} (dead, or native code holding the GIL)"
    return f"{said}; its process {state_phrase(state)}"


def ask_unless_stopped(
    client, ranks: Sequence, state_of: Callable, *, timeout: float = _ANSWER_TIMEOUT_S
) -> list[RankWhere]:
    """:func:`ask` ``ranks`` (RankInfo), in rank order, but those whose process here is
    stopped (SIGSTOP, a tracer; ``state_of(info)``: its state, '' where not read): such a
    process answers nothing until continued, so it is said, not waited for."""
    states = {info.rank: state_of(info) for info in ranks}
    stopped = [
        RankWhere(info.rank, answered=False, note=f"not asked: its process {state_phrase(state)}")
        for info in ranks
        if (state := states[info.rank]) in STOPPED_STATES
    ]
    asked = [info for info in ranks if states[info.rank] not in STOPPED_STATES]
    found = ask(client, asked, timeout=timeout) if asked else []
    return sorted([*found, *stopped], key=lambda w: w.rank)


def state_here(info) -> str:
    """The state of ``info``'s process on this machine ('' where its PID is not read here)."""
    procs = process_here(info.pid) if getattr(info, "pid_here", False) else []
    return process_state_of(procs[0]) if procs else ""


def locate(client, ranks: Sequence, dead: dict[int, str]) -> list[RankWhere]:
    """:func:`ask` the live ``ranks`` (RankInfo; a stopped one is not waited for); ``dead``
    ones ({rank: cause}) are reported as such."""
    live = [r for r in ranks if r.rank not in dead]
    found = {w.rank: w for w in ask_unless_stopped(client, live, state_here)}
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
    works = ", its works not completed" if c.get("open_works") else ""
    return f"{c['op']} #{c['seq']}, {how} {c['seconds']:.1f} s ago{works}"


def format_where(found: Sequence[RankWhere], *, frames: int = 6) -> str:
    """The report: each diagnosis with the innermost ``frames`` of the stack, once per group of ranks.

    Ranks with the same diagnosis (but for its seconds, shown as a range) and the
    same stack (but for their own cell file) are one group; smaller groups come
    first, and among equal ones those that never entered the collective or are
    behind in the flight recorder.
    """
    lines = diagnose(found)
    lagging = behind(found)
    groups: dict[tuple, list[tuple[RankWhere, list[str]]]] = {}
    for w in found:
        stack = [_frame(f) for f in w.stack[-frames:]]
        key = (_SECONDS.sub("<s>", lines[w.rank]), tuple(fold_key(line) for line in stack))
        groups.setdefault(key, []).append((w, stack))

    def order(members: list[tuple[RankWhere, list[str]]]) -> tuple[int, int, int]:
        w = members[0][0]
        odd = not w.answered or w.rank in lagging or lines[w.rank].startswith("never entered")
        return (len(members), 0 if odd else 1, min(m[0].rank for m in members))

    out = []
    for members in sorted(groups.values(), key=order):
        members.sort(key=lambda m: m[0].rank)
        texts = [lines[w.rank] for w, _ in members]
        out.append(f"{format_ranks(w.rank for w, _ in members)}: {_seconds_range(texts)}")
        out.extend(members[0][1])  # the lowest rank's own stack stands for the group
    out.extend(format_flight(found))
    return "\n".join(out)


# The seconds in a diagnosis ("for 6.1 s", "returned 12.1 s ago"): they differ a little by rank.
_SECONDS = re.compile(r"(\d+\.\d) s\b")


def _frame(f: dict) -> str:
    code = f": {f['code']}" if f["code"] else ""
    return f'  File "{f["file"]}", line {f["line"]}, in {f["name"]}{code}'


def _seconds_range(texts: list[str]) -> str:
    """``texts`` (the same but for their seconds) as one, each second as its range over them."""
    if len(texts) == 1:
        return texts[0]
    values = [[float(v) for v in _SECONDS.findall(t)] for t in texts]
    position = iter(range(len(values[0])))

    def span(_match: re.Match) -> str:
        i = next(position)
        low, high = min(v[i] for v in values), max(v[i] for v in values)
        return f"{low:.1f} s" if low == high else f"{low:.1f}-{high:.1f} s"

    return _SECONDS.sub(span, texts[0])


def behind(found: Sequence[RankWhere]) -> dict[int, tuple[int, int]]:
    """Ranks whose flight recorder is behind another's, per group: {rank: (its seq, the max)}.

    The sequence number counts a group's collectives on each rank, so a rank with a
    lower last number has not yet issued a collective the others are waiting in
    (0: none of the default group's yet).
    """
    last: dict[str, dict[int, int]] = {}
    for w in found:
        for entry in w.flight or []:
            seqs = last.setdefault(entry["group"], {})
            seqs[w.rank] = max(seqs.get(w.rank, 0), entry["seq"])
    # Every rank is in the default group: one that answered without an entry of it has
    # issued none of its calls yet (nbdist's own start-up calls are not listed).
    default = last.get(DEFAULT_GROUP)
    if default:
        for w in found:
            if w.answered:
                default.setdefault(w.rank, 0)
    lagging: dict[int, tuple[int, int]] = {}
    for seqs in last.values():
        top = max(seqs.values())
        for rank, seq in seqs.items():
            if seq < top and rank not in lagging:
                lagging[rank] = (seq, top)
    return lagging


def format_flight(found: Sequence[RankWhere], *, entries: int = 3) -> list[str]:
    """The flight-recorder lines of the report (none when no rank recorded any).

    Ranks whose last entries read the same are one line, the smallest groups first.
    """
    if not any(w.flight for w in found):
        return []
    out = ["flight recorder (the process group's last collectives, C++-issued ones included):"]
    same: dict[str, list[int]] = {}
    for w in found:
        if not w.flight:
            if w.answered:
                same.setdefault("none since the group formed", []).append(w.rank)
            continue
        shown = []
        for e in w.flight[-entries:]:
            size = "×".join(str(d) for d in e["sizes"][0]) if e["sizes"] and e["sizes"][0] else ""
            # gloo reports every entry as "scheduled": only NCCL's states say anything.
            state = f" {e['state']}" if e["state"] in ("started", "completed") else ""
            shown.append(f"#{e['seq']} {e['op']}" + (f" [{size}]" if size else "") + state)
        same.setdefault(" · ".join(shown), []).append(w.rank)
    for text, ranks in sorted(same.items(), key=lambda item: (len(item[1]), min(item[1]))):
        out.append(f"  {format_ranks(ranks)}: {text}")
    lagging: dict[tuple[int, int], list[int]] = {}
    for rank, seqs in behind(found).items():
        lagging.setdefault(seqs, []).append(rank)
    for (seq, top), ranks in sorted(lagging.items(), key=lambda item: min(item[1])):
        one = len(ranks) == 1
        what = f"{format_ranks(ranks)} {'is' if one else 'are'} behind:"
        if seq:
            what += f" {'its' if one else 'their'} last collective is #{seq}, another rank's is"
        else:
            what += " no collective yet, another rank's last is"
        out.append(f"  {what} #{top}")
    return out
