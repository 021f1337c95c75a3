"""Kernel side: the words a release adds to a cell's error — why, and from where.

When :class:`~nbdist.driver.faults.CellGuard` releases ranks (one failed, died or hung, or
ranks wait in a collective that cannot end), the cell's error ends with one line built here:
the reason (:data:`STRANDED` and :data:`PAIRED_BUT_DIFFERENT` are the long ones, with
their fix), where each rank was released from — ranks released from the same place named
together, so 256 ranks read as one part — and the ranks a collective still held and that
were ended. What the group became after (formed again, or the restart to do) closes it.
"""

from __future__ import annotations

from nbdist.errors import ranks_text

__all__ = [
    "NO_ANSWER",
    "PAIRED_BUT_DIFFERENT",
    "STOPPED_PROCESS",
    "STRANDED",
    "ended_parts",
    "released_parts",
]

# A released rank that did not say where it was (its name in released_from).
NO_ANSWER = "(no answer)"
# ...one whose process here is stopped (SIGSTOP, a tracer): not asked, its SIGINT pending.
STOPPED_PROCESS = "(stopped)"
# How a place reads for a rank the release had to interrupt there ("all_reduce #1 (interrupted)").
_INTERRUPTED = " (interrupted)"
# Ranks interrupted where others were released alone, named up to this many; above, counted.
_NAMED_INTERRUPTED = 4

# What a collective under ``if rank == 0:`` (a stranded one) is, and the fix.
STRANDED = (
    "a collective cannot end while ranks of its group skip it or wait in another one: "
    "every rank of a group must make the same collective calls in the same order (one under "
    "`if rank == 0:` waits for the others until the group's timeout; nbdist.checkpoint.save "
    "and load are collectives too: call them on every rank)"
)

# The same where the ranks made the same call with different arguments (the calls paired).
PAIRED_BUT_DIFFERENT = (
    "every rank made the collective, with different tensors: gloo pairs calls by order, not "
    "by size, so the ranks that returned may hold wrong values; give every rank tensors of "
    "the same size, dtype and shape. %dist_start --check-collectives (DistSession("
    "check_collectives=True)) compares each collective across the ranks before it runs and "
    "names what differs"
)


def released_parts(released_from: dict[int, str], *, ask_s: float) -> list[str]:
    """'rank 0 from all_reduce #3', 'ranks 4-9,12 from their running code': one per place.

    Ranks released from the same place are named together: at 256 ranks a part each
    filled the screen. ``ask_s``: how long the release waited for the ranks to say where
    they were (named for those that did not answer).
    """
    parts = []
    for what, ranks in _by_place(_interrupted_with_the_rest(released_from)).items():
        where = "they were" if len(ranks) > 1 else "it was"
        if what == NO_ANSWER:
            parts.append(
                f"{ranks_text(ranks)} interrupted where {where} (no answer within {ask_s:g} s)"
            )
            continue
        if what == STOPPED_PROCESS:
            whose = "their processes are" if len(ranks) > 1 else "its process is"
            parts.append(
                f"{ranks_text(ranks)} interrupted where {where} ({whose} stopped: the "
                "interrupt waits until continued)"
            )
            continue
        if len(ranks) > 1 and what.startswith("its "):
            what = "their " + what[4:]
        parts.append(f"{ranks_text(ranks)} from {what}")
    return parts


def _interrupted_with_the_rest(released_from: dict[int, str]) -> dict[int, str]:
    """``released_from`` with the ranks interrupted in a place ("all_reduce #1 (interrupted)")
    named with the others released from it, where there are both: "all_reduce #1 (ranks
    17-18,21 interrupted)", or "(142 of them interrupted)" above :data:`_NAMED_INTERRUPTED`
    (at 256 ranks on a few cores, which ranks the release freed in time and which it had to
    interrupt is chance: two lists of one collective's ranks read as two places)."""
    interrupted: dict[str, list[int]] = {}
    for rank, what in released_from.items():
        if what.endswith(_INTERRUPTED):
            interrupted.setdefault(what[: -len(_INTERRUPTED)], []).append(rank)
    places = set(released_from.values())
    merged = dict(released_from)
    for place, ranks in interrupted.items():
        if place not in places:
            continue  # every rank of it was interrupted: "(interrupted)" says it
        which = (
            f"{ranks_text(sorted(ranks))} interrupted"
            if len(ranks) <= _NAMED_INTERRUPTED
            else f"{len(ranks)} of them interrupted"
        )
        said = f"{place} ({which})"
        for rank, what in released_from.items():
            if what in (place, place + _INTERRUPTED):
                merged[rank] = said
    return merged


def ended_parts(ended: dict[int, str], *, held_s: float, group_timeout: float) -> list[str]:
    """'rank 0 was ended, still in send #2 10 s after its release (...)': one per place.

    ``ended``: {rank: the call that held it}, for ranks the guard ended; ``held_s``: how long
    after its release a rank still held was ended.
    """
    parts = []
    for what, ranks in _by_place(ended).items():
        one = len(ranks) == 1
        parts.append(
            f"{ranks_text(ranks)} {'was' if one else 'were'} ended, still in {what} "
            f"{held_s:g} s after {'its' if one else 'their'} release (the wait would last "
            f"until the group's timeout, {group_timeout:g} s)"
        )
    return parts


def _by_place(where: dict[int, str]) -> dict[str, list[int]]:
    """{place: its ranks, ascending}, places in the order of their lowest rank."""
    by_place: dict[str, list[int]] = {}
    for rank, place in sorted(where.items()):
        by_place.setdefault(place, []).append(rank)
    return by_place
