"""Kernel side: which running ranks wait in a collective that cannot end, and for whom.

The cell guard (:class:`nbdist.driver.faults.CellGuard`) asks this while a cell runs. A
look asks the ranks still running (a control message each, answered on the rank's control
thread while its cell computes) and reads whether the others are idle from the kernel's own
ipyparallel book; only a wait the flight recorder alone shows makes it ask the idle ranks
too (their last call's number).

A wait counts only once it has lasted the caller's grace: in flight, a collective every
rank entered ends within it.
"""

from __future__ import annotations

from nbdist.driver.ipp_internals import awaiting_replies
from nbdist.driver.where import ask
from nbdist.errors import ranks_text

__all__ = ["idle_ranks", "stranded_waits", "waits_for_failed"]

# How long a look waits for the running ranks' answers (the waiting loop pauses meanwhile).
_ANSWER_S = 1.0


def idle_ranks(client, by_rank: dict, ranks) -> set[int]:
    """Those of ``ranks`` (finished this cell) that have no later cell queued.

    One this kernel sent a later cell (``--noblock``) may still make the call; read from
    the client's own book, so no rank is asked.
    """
    queued = awaiting_replies(client, [by_rank[r].engine_id for r in ranks])
    return {r for r in ranks if by_rank[r].engine_id not in queued}


# Point-to-point calls by the way their data goes: a send ends with its peer's receive.
_DIRECTION = {"send": "send", "isend": "send", "recv": "recv", "irecv": "recv"}


def _waiting(c: dict | None) -> bool:
    """Inside the call, or past it on the unfinished works it returned in this cell (how a
    pipeline stage waits on its isend/irecv)."""
    return bool(c) and bool(c["inside"] or (c.get("open_works") and c.get("this_cell")))


def waits_for_failed(
    client, by_rank: dict, running, failed: set[int], *, lasted_s: float, flight: bool = True
) -> dict[int, str]:
    """{rank: 'all_reduce #3'} of running ranks that wait in a call a failed rank never joins.

    ``failed``: ranks whose cell raised and that are idle. A running rank counts when it
    has waited at least ``lasted_s`` in a collective whose group holds a failed rank (or
    whose group it does not know) or on the works such a call returned, or, with
    ``flight``, in an open call of the default group's flight recorder (one torch issued
    from C++, DDP's gradient all-reduce). Ranks that compute, or that do not answer (a
    busy machine), are left to finish or fail by themselves.
    """
    found = ask(client, [by_rank[r] for r in running], timeout=_ANSWER_S, light=True, flight=flight)
    waits = {}
    for w in found:
        if not w.answered:
            continue
        c = w.collective
        if _waiting(c):
            members = set(c.get("ranks") or ())
            if c["seconds"] >= lasted_s and (not members or members & failed):
                waits[w.rank] = f"{c['op']} #{c['seq']}"
            continue
        call = w.flight_state["open"] if w.flight_state else None
        if call and call["seconds"] >= lasted_s:
            waits[w.rank] = f"{call['op']} #{call['seq']}"
    return waits


def _cannot_match(rank: int, c: dict, members: set[int], inside: dict[int, dict]) -> str:
    """Why ``rank``'s call ``c`` cannot end while each of ``members`` waits in its own call
    (``inside``): 'rank 1 waited in broadcast #1'; '' where it may.

    Two group collectives of different kinds never pair. A send and a receive between the
    same two ranks are one transfer in flight; two sends (or two receives) towards each
    other, or a point-to-point call while its peer waits in a group collective, never end.
    A ``batch_isend_irecv`` (sends and receives at once) is not judged.
    """
    mine = _DIRECTION.get(c["op"])
    if mine is not None:
        (peer,) = members
        theirs = inside[peer]
        if _DIRECTION.get(theirs["op"]) == mine and theirs.get("ranks") == [rank]:
            to = "to" if mine == "send" else "from"
            return f"rank {peer} waited in {theirs['op']} {to} it too"
        if _is_group_call(theirs["op"]):
            return f"rank {peer} waited in {theirs['op']} #{theirs['seq']}"
        return ""
    if not _is_group_call(c["op"]):
        return ""
    for m in sorted(members):
        theirs = inside[m]
        if _is_group_call(theirs["op"]) and theirs["op"] != c["op"]:
            return f"rank {m} waited in {theirs['op']} #{theirs['seq']}"
        if not _is_group_call(theirs["op"]) and rank in (theirs.get("ranks") or ()):
            # It waits for this rank, which waits in the collective for it.
            return f"rank {m} waited in {theirs['op']} #{theirs['seq']}"
    return ""


def _is_group_call(op: str) -> bool:
    return op not in _DIRECTION and op != "batch_isend_irecv"


def stranded_waits(
    client,
    by_rank: dict,
    running,
    done: set[int],
    untracked: dict[int, str],
    *,
    lasted_s: float,
    paired: set[int] | None = None,
) -> dict[int, str]:
    """{rank: what it waits in, and for whom} of running ranks whose collective cannot end.

    Four cases, each certain once it has lasted ``lasted_s``: the ranks it waits for
    finished the cell and are idle; they all wait in a collective too, but another one
    (``all_reduce`` against ``broadcast``, or a send while its peer is in a collective);
    two ranks each wait to receive from (or send to) the other (in the call, or on its
    works: a pipeline's isend/irecv); or, where nbdist does not see the call (DDP's
    gradient all-reduce, issued from C++), the process group's flight recorder holds an
    open call that idle finished ranks never issued. Such ranks, and those that wait on a
    call's works rather than in it, are also put in ``untracked`` ({rank: the call}): the
    release ends their wait, though no record shows them inside a call.

    Where the ranks it waits for made the same call (kind and number) in this cell and
    returned from it, the calls paired but did not match: gloo pairs calls by order, not by
    size, so a rank given fewer elements returns (with wrong values) while its peer waits for
    the rest. Such a rank is said so, and put in ``paired``.
    """
    idle = idle_ranks(client, by_rank, done)
    # With idle finished ranks, the running ones' flight recorders too: a call issued from
    # C++ (DDP's gradient buckets) that the finished ranks never issued waits for them.
    found = ask(
        client, [by_rank[r] for r in running], timeout=_ANSWER_S, light=True, flight=bool(idle)
    )
    inside = {w.rank: w.collective for w in found if w.answered and _waiting(w.collective)}
    stranded = {}
    gone_of: dict[int, list[int]] = {}
    for rank, c in inside.items():
        members = set(c.get("ranks") or ())
        what = f"waited in {c['op']} #{c['seq']}"
        gone = sorted(members & idle)
        if gone:
            gone_of[rank] = gone
            stranded[rank] = f"{what} {_skipped(gone)}"
            continue
        if not members or not members <= inside.keys():
            continue  # some rank it waits for is still computing: it may yet come
        why = _cannot_match(rank, c, members, inside)
        if why:
            stranded[rank] = f"{what} while {why}"
    lasted = [r for r in stranded if inside[r]["seconds"] >= lasted_s]
    opened = {
        w.rank: w.flight_state["open"]
        for w in found
        if w.rank not in inside and w.flight_state and w.flight_state["open"]
    }
    if opened and idle:
        stranded.update(_issued_alone(client, opened, idle, by_rank, untracked))
        lasted += [r for r in opened if r in stranded and opened[r]["seconds"] >= lasted_s]
    if not lasted:
        # One wait that lasted the grace makes the case: the others named with it may have
        # begun later (a rank slow to start the cell) but wait for the same ranks.
        return {}
    if gone_of:  # asked only now: the finished ranks are idle, and the verdict is made
        computing = set(running) - inside.keys()
        said, cleared = _paired_calls(client, by_rank, inside, gone_of, paired, computing)
        stranded.update(said)
        for rank in cleared:
            del stranded[rank]
        if not any(rank in stranded for rank in lasted):
            return {}
    for rank in stranded.keys() & inside.keys():
        if not inside[rank]["inside"]:
            # Past its call, on the works it returned (a pipeline's isend/irecv): the
            # release ends that wait too, so it is not a rank that computes.
            c = inside[rank]
            untracked[rank] = f"{c['op']} #{c['seq']}"
    return stranded


def _paired_calls(
    client,
    by_rank: dict,
    inside: dict[int, dict],
    gone_of: dict[int, list[int]],
    paired,
    computing: set[int],
) -> tuple[dict[int, str], set[int]]:
    """({rank: what it waits in} of waiting ranks whose peers, finished, made the same call,
    the ranks not stranded after all).

    A finished peer that made the call and returned is no mismatch while another member of
    it still computes (``computing``: running, not waiting in a call): in a rooted call the
    others return once their part is sent (``gather``'s senders, while the root waits for a
    slow one), so the waiting rank is then stranded only by peers that skipped the call.
    """
    idle = sorted({r for gone in gone_of.values() for r in gone})
    found = ask(client, [by_rank[r] for r in idle], timeout=2.0, light=True)
    last = {w.rank: w.collective for w in found if w.answered and w.collective}
    said, cleared = {}, set()
    for rank, gone in gone_of.items():
        c = inside[rank]
        made = [r for r in gone if _returned_from(last.get(r), c)]
        if not made:
            continue
        if set(c.get("ranks") or ()) & computing:
            skipped = [r for r in gone if r not in made]
            if skipped:
                said[rank] = f"waited in {c['op']} #{c['seq']} {_skipped(skipped)}"
            else:
                cleared.add(rank)
            continue
        if paired is not None:
            paired.add(rank)
        parts = [_paired_words(c, {r: last[r].get("tensor") for r in made})]
        skipped = [r for r in gone if r not in made]
        if skipped:
            parts.append(f"and {_skipped(skipped)}")
        said[rank] = "; ".join(parts)
    return said, cleared


def _skipped(ranks: list[int]) -> str:
    """'for ranks 2 and 3, which finished the cell without entering it'."""
    return f"for {ranks_text(ranks)}, which finished the cell without entering it"


def _paired_words(call: dict, theirs: dict[int, str | None]) -> str:
    """'waited in all_reduce #1 with float32 [4] for rank 1 with float32 [1], which made
    all_reduce #1 too and returned from it: the calls paired but their tensors differ'.

    ``call``: the waiting rank's record; ``theirs``: {finished rank: its call's first tensor,
    as dtype and shape} (None where not known: the words then only guess what differs).
    """
    name = f"{call['op']} #{call['seq']}"
    mine = call.get("tensor")
    if mine is None or any(t is None or t == mine for t in theirs.values()):
        return (
            f"waited in {name} for {ranks_text(sorted(theirs))}, which made {name} too and "
            "returned from it: the calls paired but differ (another size, dtype or shape on "
            "each rank?)"
        )
    by_tensor: dict[str, list[int]] = {}
    for rank, tensor in sorted(theirs.items()):
        by_tensor.setdefault(tensor, []).append(rank)
    made = ", ".join(f"{ranks_text(ranks)} with {tensor}" for tensor, ranks in by_tensor.items())
    return (
        f"waited in {name} with {mine} for {made}, which made {name} too and returned from "
        "it: the calls paired but their tensors differ"
    )


def _issued_alone(
    client, opened: dict[int, dict], idle: set[int], by_rank: dict, untracked: dict[int, str]
) -> dict[int, str]:
    """{rank: what it waits in} of ranks with a default-group call idle ranks never issued."""
    found = ask(client, [by_rank[r] for r in sorted(idle)], timeout=2.0, light=True, flight=True)
    last = {w.rank: w.flight_state["last"] for w in found if w.flight_state}
    alone = {}
    for rank, call in opened.items():
        behind = sorted(r for r, seq in last.items() if seq < call["seq"])
        if behind:
            untracked[rank] = f"{call['op']} #{call['seq']}"
            alone[rank] = (
                f"waited in {call['op']} #{call['seq']} of the process group (issued by torch "
                f"itself, e.g. DDP's gradient all-reduce) for {ranks_text(behind)}, which "
                "finished the cell without issuing it: did the ranks run different numbers "
                "of steps? (give every rank as many batches: DistributedSampler, "
                "drop_last=True)"
            )
    return alone


def _returned_from(theirs: dict | None, call: dict) -> bool:
    """Whether a finished rank's last call (``theirs``) is ``call``, made this cell and ended."""
    if not theirs or not theirs["this_cell"] or theirs["inside"]:
        return False
    return (theirs["op"], theirs["seq"]) == (call["op"], call["seq"])
