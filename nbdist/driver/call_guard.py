"""Kernel side: the guard of a call on the ranks that is not a cell (apply, push, pull).

A cell's waiting loop consults its :class:`nbdist.driver.faults.CellGuard`, which
releases the ranks when one fails, dies or hangs, and SIGINTs again those an interrupt
did not stop. A call that is not a cell (``apply``, ``push``, ``pull``, nbdist's own
calls) has :class:`CallGuard`: it watches nothing and releases nothing, but SIGINTs
once more, :data:`INTERRUPT_AGAIN_S` after an interrupt, the ranks still running that
it did not reach: in the user's code, which did not catch it
(:mod:`nbdist.driver.caught_interrupts`). In CI (2026-12-02) an
interrupted ``apply`` ran on on one rank for the whole 10 s grace, where cells, whose
guard interrupts again, stopped.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from nbdist.driver.caught_interrupts import interrupt_answers

__all__ = ["INTERRUPT_AGAIN_S", "CallGuard"]

# After an interrupt, when the ranks still running are SIGINTed once more (a cell's
# guard does it after 0.5 s, releasing their collectives too).
INTERRUPT_AGAIN_S = 1.0


class CallGuard:
    """What a :class:`nbdist.driver.runner.RankRun` of a call consults in place of a cell's guard."""

    stranded: dict[int, str] = {}
    ended: dict[int, str] = {}  # nothing is released, so nothing is held after a release

    def __init__(self, interrupt: Callable[[Sequence[int]], None]) -> None:
        """``interrupt(ranks)``: SIGINT to those ranks (the session's)."""
        self._interrupt = interrupt
        self._interrupted_at: float | None = None
        # Set once the ranks were SIGINTed again: asked whether the first SIGINT missed
        # the request after that, a rank would be interrupted a third time.
        self.released = False
        # Then: the running ranks whose code caught the interrupt (waited for, not SIGINTed).
        self.caught: set[int] | None = None

    @property
    def released_from(self) -> dict[int, str]:
        """Nothing is released from a collective here: {}."""
        return {}

    def watching(self) -> bool:
        """Whether :meth:`poll` may act now: always (it only SIGINTs the ranks again)."""
        return True

    def poll(self, run) -> None:
        """Each pass of the waiting loop: SIGINT again the ranks an interrupt did not reach."""
        if self._interrupted_at is None or self.released:
            return
        if time.monotonic() - self._interrupted_at < INTERRUPT_AGAIN_S:
            return
        self.released = True
        running = [r for r, s in run.child_states().items() if s == "running"]
        answers = interrupt_answers(run, running)
        self.caught = answers.caught
        missed = answers.missed(running)
        if missed:
            self._interrupt(missed)

    def finished(self, run) -> bool:
        """Whether the run is over though ranks still run: never decided here."""
        return False

    def dead(self) -> dict[int, str]:
        """Dead ranks are not watched here: {}."""
        return {}

    def deaths(self) -> dict[int, str]:
        """Dead ranks are not watched here: {}."""
        return {}

    def interrupted(self) -> None:
        """SIGINT went to the ranks (the first time)."""
        if self._interrupted_at is None:
            self._interrupted_at = time.monotonic()

    def only_stopped_left(self, run) -> bool:
        """Whether every rank still running is a stopped process: not read here, False."""
        return False

    def silent_states(self, ranks) -> str:
        """What the processes of ``ranks`` are doing is not read here: ''."""
        return ""

    def held_stopped(self, run) -> set[int]:
        """Ranks released while stopped: nothing is released here, none."""
        return set()

    def stopped_waited(self, run) -> dict[int, str]:
        """Ranks waited for though stopped after a release: nothing is released here, {}."""
        return {}

    def stopped_ranks(self, ranks) -> tuple[list[int], str]:
        """Which of ``ranks`` are stopped processes, and in words: not read here, none."""
        return [], ""

    def where_report(self, *, only_if_waiting: bool = False) -> str:
        """Where the ranks are is not asked here: ''."""
        return ""

    def recover(self, run, *, interrupted: bool = False) -> None:
        """Nothing was released, so nothing is formed again."""

    def note(self, failures=()) -> str:
        """No note below the failures: ''."""
        return ""
