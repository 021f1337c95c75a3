"""Kernel side: what a rank's reply to a request says: its failure, a request it dropped, a broken group.

The words :class:`~nbdist.driver.runner.RankRun` puts in a cell's
:class:`~nbdist.errors.RankError`: a rank's exception as a :class:`RankFailure`, an
"aborted" reply (a request the rank dropped unrun) said plainly, whether a rank's
error says that the process group itself broke, which ranks a run's error names
(:func:`run_failures`: the dead, and the cause rather than the ranks released for it), and
which ranks had answered when a wait of nbdist's own timed out (:func:`answers_at_timeout`).

Example::

    >>> broken_group_words("RuntimeError: [../gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:27337")
    'Connection closed by peer [127.0.0.1]:27337'
"""

from __future__ import annotations

import re

from nbdist.errors import RankFailure

__all__ = [
    "answers_at_timeout",
    "broken_group_words",
    "child_result",
    "rank_failure",
    "run_failures",
]

# What a rank's error says when the group's connections are gone (gloo's transport, which
# names its own source file) or aborted (NCCL); a user's own "Connection reset" is not it.
# gloo's own words end at its first sentence: "Connection closed by peer [127.0.0.1]:27337",
# "Read error [127.0.0.1]:27337: Connection reset by peer" (the advice that follows is gloo's).
_BROKEN_GROUP = re.compile(
    r"gloo/transport/[\w/.]+:\d+\] ([^\n]+?)(?:\. |\.?(?:\n|$))|Application timeout caused pair closure|"
    r"NCCL communicator was aborted|Watchdog caught collective operation timeout"
)


def broken_group_words(text: str) -> str:
    """What in a rank's error says that the process group broke ('' if nothing does).

    gloo's own first sentence without its file name, else NCCL's or gloo's known words.
    """
    found = _BROKEN_GROUP.search(text)
    return (found.group(1) or found.group(0)).strip() if found else ""


def rank_failure(rank: int, res: BaseException, *, stopped: bool = False) -> RankFailure:
    """``rank``'s error reply ``res`` as a failure; ``stopped``: the ranks were interrupted."""
    from ipyparallel.error import TaskAborted

    if isinstance(res, TaskAborted):  # an "aborted" reply; its words: the request's id
        if stopped:
            return RankFailure(rank, "KeyboardInterrupt", _DROPPED_STOPPED, "")
        return RankFailure(rank, "NotRun", _DROPPED, "")
    return RankFailure(
        rank=rank,
        ename=getattr(res, "ename", None) or type(res).__name__,
        evalue=str(getattr(res, "evalue", res)),
        traceback=getattr(res, "traceback", None) or "",
    )


def answers_at_timeout(ranks, children) -> str:
    """Which ranks had answered one of nbdist's own requests when its wait timed out, and how.

    Said with the timeout, read before the interrupt: a start that timed out forming the
    group then names the rank the others waited for (one that had not answered) apart
    from those that had failed or dropped the request (``ranks`` and ``children`` in run
    order; a child is a rank's future).

    >>> from concurrent.futures import Future
    >>> answered, waiting, failed = Future(), Future(), Future()
    >>> answered.set_result({}); failed.set_exception(ValueError("x"))
    >>> answers_at_timeout([0, 1, 2], [answered, waiting, failed])
    'rank 1 had not answered; rank 0 had answered; rank 2 had failed (ValueError)'
    """
    from ipyparallel.error import TaskAborted

    from nbdist.errors import format_ranks

    by_kind: dict[str, list[int]] = {}
    for rank, child in zip(ranks, children):
        res = child_result(child)  # None while the rank still runs it
        if not child.done():
            kind = "had not answered"
        elif isinstance(res, TaskAborted):
            kind = "had dropped it unrun (aborted)"
        elif isinstance(res, BaseException):
            kind = f"had failed ({getattr(res, 'ename', None) or type(res).__name__})"
        else:
            kind = "had answered"
        by_kind.setdefault(kind, []).append(rank)
    # The ranks still at it first: they are what the wait was waiting for.
    order = sorted(by_kind, key=lambda kind: kind != "had not answered")
    return "; ".join(f"{format_ranks(by_kind[kind])} {kind}" for kind in order)


_DROPPED_STOPPED = "stopped before this rank began it: none of it ran here"
_DROPPED = (
    "this rank dropped it unrun: a cell before it failed there, and a rank drops what was "
    "queued behind a failed cell; run it again"
)


def child_result(child):
    """A child future's result or exception; None while it runs."""
    if not child.done():
        return None
    exc = child.exception()
    return exc if exc is not None else child.result()


def run_failures(ranks, results, guard, *, stopped: bool = False) -> list[RankFailure]:
    """The failures a run's :class:`~nbdist.errors.RankError` names, from each rank's result.

    ``ranks`` and ``results`` in run order; ``guard``: the run's cell guard (its dead,
    ended, released and stranded ranks); ``stopped``: the ranks were interrupted.
    """
    # A rank the guard ended (a collective held it after the release) is named in the note.
    dead = guard.deaths()
    failures = [
        RankFailure(rank=rank, ename="RankDied", evalue=cause, traceback="")
        for rank, cause in sorted(dead.items())
        if rank in ranks
    ]
    failures += [
        rank_failure(rank, res, stopped=stopped)
        for rank, res in zip(ranks, results)
        if isinstance(res, BaseException) and rank not in dead and rank not in guard.ended
    ]
    released = guard.released_from
    genuine = [f for f in failures if f.rank not in released]
    if genuine:
        # A released rank's error ("Connection closed by peer") is the release
        # itself; the note names those ranks, the failures are the cause.
        return genuine
    if guard.stranded:
        # No rank failed: the released ranks' own error is the fault, said plainly.
        stranded = guard.stranded
        return [
            RankFailure(f.rank, "CollectiveMismatch", stranded[f.rank], f.traceback)
            if f.rank in stranded
            else f
            for f in failures
        ]
    return failures
