"""Kernel side: stopping a run that was interrupted (Ctrl-C or ``--timeout``), and what it says then.

:class:`RunInterrupts` is the part of :class:`nbdist.driver.runner.RankRun` that runs once
the kernel interrupts a cell: SIGINT to the ranks, the ranks that SIGINT missed reached
again, a grace for the ranks to unwind (renewed while code that caught the interrupt
runs), the group formed again, and the :class:`~nbdist.errors.RanksInterrupted` that says
which ranks stopped, which ran to the end and which caught the interrupt. It reads the
run's own state (its guard, futures, merger and waiting loop), so it is a base of
``RankRun`` rather than a separate object.
"""

from __future__ import annotations

import time

from nbdist.driver.caught_interrupts import ending_by_themselves
from nbdist.driver.cells import caught_in_reply
from nbdist.driver.missed_interrupt import MissedInterrupt
from nbdist.errors import RankError, RanksInterrupted

__all__ = ["RunInterrupts"]

# How long interrupted ranks get to unwind before the cell gives up on them (renewed while
# ranks whose code caught the KeyboardInterrupt run their handling code).
_INTERRUPT_GRACE_S = 10.0
# Graces more while ranks still end or report their errors (64 ranks released from a
# collective formatted tracebacks through torch.distributed's 6,900-line module for over
# 10 s on 2 cores and were said not to have stopped); bounded, whatever the ranks say.
_OUTSIDE_RENEWALS = 5
# Said once under each rank whose code caught the interrupt (nbdist.driver.caught_interrupts).
_CAUGHT_NOTE = (
    "nbdist: this rank's code caught the KeyboardInterrupt and runs on (an except or finally "
    "block); the cell waits for it: interrupt again to stop it\n"
)
# The same after a --timeout, whose limit holds: the cell ends after one grace all the same.
_CAUGHT_AT_TIMEOUT_NOTE = (
    "nbdist: this rank's code caught the KeyboardInterrupt and runs on (an except or finally "
    f"block); past --timeout, the cell waits for it {_INTERRUPT_GRACE_S:g} s at most\n"
)


class RunInterrupts:
    """How a :class:`~nbdist.driver.runner.RankRun` stops its ranks and reports an interrupt."""

    def _stop_ranks(self, *, wait_for_caught: bool) -> None:
        """SIGINT to the ranks; release those that do not stop; form the group again.

        ``wait_for_caught``: wait for ranks whose code caught the interrupt for as long as
        they run (a Ctrl-C), not just one grace (a ``--timeout``)."""
        if self._prompts is not None:
            self._prompts.cancel()  # ranks at a prompt stop too; no one is asked again
        since = time.monotonic()
        self._interrupt(self.ranks)
        self._reach_missed(since)
        self._stopped = True
        self._wait_for_caught = wait_for_caught
        self._guard.interrupted()
        self._settle()
        if self._finished:
            self._guard.recover(self, interrupted=True)

    def _reach_missed(self, since: float) -> None:
        """Ranks the SIGINTs sent from ``since`` on missed drop the request or stop it now.

        An idle engine ignores SIGINT: a rank it reached before the request (a loaded
        kernel interrupts while the request is in flight; at many ranks the last begin
        seconds after the first), or in an earlier request it then ended, would run the
        whole request after it (:mod:`nbdist.driver.missed_interrupt`).
        """
        dead = self._guard.dead()
        running = [
            i
            for i, (rank, child) in enumerate(zip(self.ranks, self._children))
            if rank not in dead and not child.done()
        ]
        if running:
            self._missed = MissedInterrupt(self._ar, running, since)
            self._missed.poll()  # asked at once

    def _note_caught(self) -> None:
        """Once the guard knows them: say under each rank whose code caught the interrupt
        that the cell waits for it."""
        caught = self._guard.caught
        if caught is None:
            return
        self._caught_noted = True
        note = _CAUGHT_NOTE if self._wait_for_caught else _CAUGHT_AT_TIMEOUT_NOTE
        for rank in sorted(caught):
            self._merger.feed(rank, "stderr", note)

    def _running_count(self) -> int:
        return sum(1 for s in self.child_states().values() if s == "running")

    def _still_caught(self) -> list[int]:
        """The ranks still running whose code caught the interrupt."""
        caught = self._guard.caught or set()
        return [r for r, s in self.child_states().items() if s == "running" and r in caught]

    def _settle(self) -> None:
        """After an interrupt: let ranks unwind, show what they printed, stop waiting.

        Ranks whose code caught the KeyboardInterrupt run their handling code to its end,
        waited for as a kernel of their own would wait (after a Ctrl-C, the grace renews
        while they run); so, a few times (:data:`_OUTSIDE_RENEWALS`), do ranks still
        ending or outside the user's code, after a second Ctrl-C too.
        A second Ctrl-C while they run SIGINTs every rank still running once more and waits
        one more grace; otherwise (or a third) it stops waiting now. Once every rank still
        running is a stopped process (SIGSTOP, a tracer; where the guard reads the ranks'
        processes), it stops waiting too: none can unwind until it is continued.
        """
        deadline = time.monotonic() + _INTERRUPT_GRACE_S
        again = False
        renewed, running = 0, self._running_count()
        while True:
            try:
                if self._loop(deadline) or self._left_to_stopped:
                    break
            except KeyboardInterrupt:
                if self._latch is not None:
                    self._latch.take()  # this Ctrl-C is handled here; the next one is another
                if again or not self._still_caught():
                    break  # stop waiting now
                again = True
                self._interrupt([r for r, s in self.child_states().items() if s == "running"])
                deadline = time.monotonic() + _INTERRUPT_GRACE_S
                continue
            if not again and self._wait_for_caught and self._still_caught():
                deadline = time.monotonic() + _INTERRUPT_GRACE_S
                continue
            # Still ending: the last reply came in this grace's second half.
            recent = deadline - _INTERRUPT_GRACE_S / 2
            if renewed < _OUTSIDE_RENEWALS and ending_by_themselves(
                self, running, still_ending_since=recent
            ):
                renewed += 1
                running = self._running_count()
                deadline = time.monotonic() + _INTERRUPT_GRACE_S
                continue
            break
        self._finished = self._all_done()
        if self._finished:
            self._finish_output()
        else:
            self._drain()
            self._merger.close()

    def _interrupted(self) -> RanksInterrupted:
        if not self._finished:
            context = self._interrupted_context(self._guard.caught or set())
            running = [r for r, s in self.child_states().items() if s == "running"]
            return RanksInterrupted(None, running, **context)
        try:
            self._result_or_raise()
        except RankError as stopped:
            stopped.note = ""  # said once, below the tracebacks
            caught = self._caught()
            finished = self._ran_to_the_end(caught)
            return RanksInterrupted(stopped, finished=finished, **self._interrupted_context(caught))
        caught = self._caught()
        finished = [r for r in self.ranks if r not in caught]
        return RanksInterrupted(None, finished=finished, **self._interrupted_context(caught))

    def _interrupted_context(self, caught: set[int]) -> dict:
        suspended, words = self._left_stopped()
        return dict(
            where=self.where_report,
            note=self._guard.note(),
            caught=sorted(caught),
            suspended=suspended,
            suspended_words=words,
        )

    def _left_stopped(self) -> tuple[list[int], str]:
        """The ranks still running whose processes here are stopped (SIGSTOP, a tracer), and
        those processes in words (where the guard reads the ranks' processes)."""
        running = [r for r, s in self.child_states().items() if s == "running"]
        return self._guard.stopped_ranks(running) if running else ([], "")

    def _caught(self) -> set[int]:
        """Once every rank replied: the ranks whose code caught the interrupt, those the guard
        found handling it and those whose cell's reply says its code caught it and ended well
        (a handler done before the guard asked)."""
        said = {
            rank
            for rank, res in zip(self.ranks, self._results or [])
            if not isinstance(res, BaseException) and caught_in_reply(res)
        }
        return set(self._guard.caught or ()) | said

    def _ran_to_the_end(self, caught: set[int]) -> list[int]:
        """The ranks whose reply says they ran the whole request (no error, not dropped),
        but for those whose code caught the interrupt and ended it by itself."""
        dead = self._guard.dead()
        return [
            rank
            for rank, res in zip(self.ranks, self._results or [])
            if not isinstance(res, BaseException) and rank not in dead and rank not in caught
        ]
