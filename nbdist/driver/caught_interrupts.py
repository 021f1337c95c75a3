"""Kernel side: what interrupted ranks did with the KeyboardInterrupt: caught it, report, or missed it.

A Ctrl-C relays SIGINT to the ranks. Where it raised KeyboardInterrupt in the user's
code and that code caught it, an ``except KeyboardInterrupt`` or ``finally`` block
runs (a checkpoint saved on Ctrl-C, Lightning's or a DataLoader's shutdown): the
rank is still busy with the request half a second later, as one the SIGINT did not
reach is, and as one still reporting its error is (IPython formats and highlights the
traceback: seconds per rank at 64 ranks on 2 cores). The guards SIGINT again only the
ranks the SIGINT missed; a rank that caught it runs its handling code to the end and
the cell waits for it, as a kernel of its own would, until a second Ctrl-C
(:mod:`nbdist.driver.run_interrupts`); a rank outside the user's code (reporting, sending its
reply) ends by itself and is named as neither, as is one whose request ended meanwhile
(its reply on its way: 1 of 64 ranks in one of four interrupts on 2 cores, which then
cost a release and the group formed again).

Each rank says so itself, on its control channel
(:func:`nbdist.engine.late_interrupt.interrupt_answer`): a rank paused in debugpy
does not count (debugpy swallows the KeyboardInterrupt), nor does one that does not
answer. It answers for the request it runs, which may be one queued before the one
the kernel waits for (a ``--noblock`` cell): the SIGINT landed there, and the waited-for
request is dropped unrun (:mod:`nbdist.driver.missed_interrupt`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from nbdist.driver.where import control_request

__all__ = ["ASK_S", "InterruptAnswers", "ending_by_themselves", "interrupt_answers"]

# How long the ranks' answers are waited for, and more after each answer while some still come
# (the control thread answers at once unless native code holds the GIL, when the rank is not
# running Python code that caught anything, or the machine is loaded: 64 ranks formatting
# their tracebacks on 2 cores answered in 0.6-1.5 s).
ASK_S = 1.0


class InterruptAnswers(NamedTuple):
    """What the running ranks asked did with the interrupt's KeyboardInterrupt."""

    caught: set[int]  # their code caught it and runs on: waited for, named
    outside: set[int]  # their request runs outside the user's code (reporting): ends by itself
    idle: set[int]  # they run no request: its reply is on its way (or it is dropped)

    def missed(self, running) -> list[int]:
        """Those of ``running`` that said none of those (or nothing): the SIGINT did not
        reach their code."""
        done = self.caught | self.outside | self.idle
        return [r for r in running if r not in done]


def interrupt_answers(run, ranks: Sequence[int], timeout: float = ASK_S) -> InterruptAnswers:
    """Those of ``ranks`` (of ``run``, a :class:`~nbdist.driver.runner.RankRun`) that run code
    which caught the interrupt's KeyboardInterrupt (this request's, or that of one before
    it the SIGINT reached instead: this one, queued behind, is dropped meanwhile), those
    whose request runs outside the user's code, and those that run no request any more."""
    engines = run.engine_ids(ranks)
    if not engines:
        return InterruptAnswers(set(), set(), set())
    asked = sorted(engines)
    replies = control_request(
        run.client, [engines[r] for r in asked], "caught", timeout, while_answering=True
    )
    said = {rank: (reply or {}).get("answer") for rank, reply in zip(asked, replies)}
    return InterruptAnswers(
        *({rank for rank, answer in said.items() if answer == kind} for kind in _KINDS)
    )


_KINDS = ("caught", "outside", "idle")


def ending_by_themselves(run, before: int, *, still_ending_since: float) -> bool:
    """Whether the ranks of ``run`` still running at the end of the kernel's grace end
    without another SIGINT, so the cell waits for them rather than say they did not stop:
    some ended since ``before`` ranks ran, the last at ``still_ending_since`` or later (at
    256 ranks on 2 cores, reporting a released collective's error took each a share of
    35 s, and the question below went unanswered meanwhile), or some say they run outside
    the user's code (reporting an error, sending the reply) or no request any more.

    A rank that ended at once, beside one that cannot answer (stopped, hung in native
    code), is not ranks still ending: the grace was renewed for it, and a start that
    timed out forming the group waited 10 s more for a rank that never came.
    """
    running = [r for r, s in run.child_states().items() if s == "running"]
    if not running:
        return False
    if len(running) < before and run.last_reply_at >= still_ending_since:
        return True
    answers = interrupt_answers(run, running)
    return bool(answers.outside or answers.idle)
