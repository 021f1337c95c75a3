"""Kernel side: a release — every live rank broken out of its collective, and where each was.

:class:`~nbdist.driver.faults.CellGuard` decides *when* (a rank failed or died, an interrupt
missed, a collective that cannot end); this module does it: the running ranks are asked
where they are, every live rank is told to release (:mod:`nbdist.engine.control` aborts its
collective), ranks that compute get a moment to end by themselves, then SIGINT. What comes
back is where each rank was released from, the words :mod:`nbdist.driver.release_note`
puts together.
"""

from __future__ import annotations

import time

from nbdist.driver.release_note import NO_ANSWER, STOPPED_PROCESS

__all__ = ["ASK_S", "raised_in_cell", "release_ranks"]

# How long a release waits for the running ranks to say where they are.
ASK_S = 1.0
# Once released, how long a rank outside any collective may take to finish by itself.
UNWIND_GRACE_S = 0.3
# ... and one seen waiting on a send's or receive's work (a wait nbdist does not record as
# inside a collective), or one that did not answer: the release ends that wait, and its error
# then crosses the schedule's code and the engine's reply, 0.1-0.3 s on an idle 2-core
# machine (2026-12-06), longer under load (ranks inside an all_reduce the release ended
# answered after 1 s); a SIGINT meanwhile would only cut its traceback short.
KNOWN_WAIT_UNWIND_S = 2.0


def raised_in_cell(c: dict | None, cell_age: float) -> bool:
    """Whether ``c``, the last collective a rank reported, raised during this cell.

    A call that raised in an earlier cell (a stale group's, caught by the user) is still the
    rank's last one: only this cell's counts. ``cell_age``: seconds since the cell was sent.
    """
    return bool(
        c is not None
        and c.get("raised")
        # The rank's own answer; by the kernel's clock where it has none.
        and c.get("this_cell", c["seconds"] < cell_age)
    )


def release_ranks(
    session,
    run,
    *,
    by_rank: dict,
    known_waits: dict[int, str],
    spared: set[int],
    cell_age: float,
    stopped: set[int] = frozenset(),
) -> dict[int, str]:
    """Release every live rank of ``session``; {rank: where it was released from}.

    ``known_waits``: {rank: 'isend #18'} of ranks found waiting where nbdist's records do not
    show them inside a call (they get :data:`KNOWN_WAIT_UNWIND_S`). ``spared``: ranks not to
    SIGINT (code that caught the interrupt runs its handling on, as after a second Ctrl-C it
    would not; a request outside the user's code ends by itself). ``stopped``: ranks whose
    processes here are stopped (SIGSTOP, a tracer): told, but neither asked nor waited for
    (no answer comes until they are continued), and SIGINTed at once (it waits for them).
    """
    from nbdist.driver.where import ask, control_request

    dead = session.dead_ranks()
    live = [r for r in session.ranks if r.rank not in dead]
    running = set(r for r, s in run.child_states().items() if s == "running") - set(dead)
    client = session.client
    asked = [r for r in live if r.rank in running and r.rank not in stopped]
    found = {w.rank: w for w in ask(client, asked, timeout=ASK_S)}
    # The stopped ones read their release once continued; no wait for their answers.
    control_request(client, [r.engine_id for r in live if r.rank in stopped], "release", 0)
    control_request(
        client, [r.engine_id for r in live if r.rank not in stopped], "release", timeout=2.0
    )
    session.group.released = True
    released_from: dict[int, str] = {}
    computing: set[int] = set()
    for rank in sorted(running):
        w = found.get(rank)
        c = w.collective if w is not None else None
        if c is not None and (c["inside"] or raised_in_cell(c, cell_age)):
            # Inside, or already failing out of it (gloo noticed a dead peer):
            # the release ends it; SIGINT would only cut its traceback short.
            released_from[rank] = f"{c['op']} #{c['seq']}"
        elif rank not in spared:
            computing.add(rank)
    # A rank may be unwinding already (gloo noticed a dead peer itself):
    # give it a moment before interrupting code that is about to end anyway.
    answered = {r for r, w in found.items() if w.answered}
    start = time.monotonic()
    deadline = {
        r: start
        + (
            0.0
            if r in stopped
            else KNOWN_WAIT_UNWIND_S
            if r in known_waits or r not in answered
            else UNWIND_GRACE_S
        )
        for r in computing
    }
    ended_alone: list[int] = []
    while computing:
        states = run.child_states()
        for rank in [r for r in computing if states.get(r) != "running"]:
            computing.discard(rank)
            if rank in known_waits:
                released_from[rank] = known_waits[rank]
            else:
                ended_alone.append(rank)
        now = time.monotonic()
        # Each rank is interrupted once its own grace is over, not the longest one.
        overdue = sorted(r for r in computing if now >= deadline[r])
        if overdue:
            computing.difference_update(overdue)
            released_from.update(_interrupted(overdue, answered, known_waits, stopped))
            session.interrupt(overdue)
        if computing:
            time.sleep(0.02)
    if ended_alone:
        released_from.update(_ended_alone(client, [by_rank[r] for r in ended_alone], cell_age))
    return released_from


def _interrupted(
    ranks: list[int], answered: set[int], known_waits: dict[int, str], stopped: set[int]
) -> dict:
    """Where released ``ranks``, about to be SIGINTed as they did not end by themselves, were."""
    said = {}
    for rank in ranks:
        if rank in stopped:
            said[rank] = STOPPED_PROCESS
        elif rank not in answered and rank not in known_waits:
            # Computing in native code that holds the GIL, or a machine so loaded that
            # the answer came late: where it was is not known, so it is not named.
            said[rank] = NO_ANSWER
        else:
            said[rank] = f"{known_waits.get(rank) or 'its running code'} (interrupted)"
    return said


def _ended_alone(client, ranks: list, cell_age: float) -> dict[int, str]:
    """Where released ``ranks`` (RankInfo objects), which ended by themselves, were released from.

    Asked again now that they are idle: when asked during the release they were neither
    inside a collective nor failing out of one, or did not answer in time (a loaded
    machine). A collective of this cell that raised is what the release ended; else their
    last call (often an earlier cell's) is not, and their running code is named.
    """
    from nbdist.driver.where import ask

    said = {}
    for w in ask(client, ranks, timeout=ASK_S, light=True):
        c = w.collective if w.answered else None
        said[w.rank] = (
            f"{c['op']} #{c['seq']}" if raised_in_cell(c, cell_age) else "its running code"
        )
    return said
