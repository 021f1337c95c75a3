"""Kernel side: the guard of the ranks' join (at a start, or re-forming the group after a
release), which ends it when one rank cannot join.

Forming the process group is one request per rank (``bootstrap.init_rank``) that returns
once the rank has joined. A rank that failed on its way in (an error before or in its join:
a GPU it cannot take, a rendezvous it cannot reach) or died (the out-of-memory killer while
torch imported) will never join, and the others wait for it inside torch's store until the
start's ``--timeout`` (120 s by default) - then the start said only that it timed out.
:class:`JoinGuard` ends the wait the moment that is known and the start fails with that
rank's own error. The ranks still joining are not interrupted: a SIGINT landing in an
import they are still doing (an attached engine imports torch at its first start) left
a half-imported ``torch`` behind, and the engine's every later start failed. A failed
start stops the ranks it started; an attached cluster's end their wait in torch's store
by themselves, at the same ``--timeout``, as do a session's ranks re-forming the group (the
next cell, which tries again, runs after it). Local ranks' deaths are seen at once through
their pidfds (:class:`nbdist.driver.rank_deaths.RankMonitor`); an attached cluster's,
once its controller drops the engine.

Example (a start's error, its first and last lines; 2 ranks, rank 1 failed)::

    rank 1: RuntimeError: CUDA error: invalid device ordinal
    the process group did not form: rank 0 waited for the rank(s) above to join
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import psutil

from nbdist.driver.call_guard import CallGuard
from nbdist.driver.process_state import (
    STOPPED_STATES,
    process_state_of,
    ranks_in_words,
    stopped_in_words,
)
from nbdist.driver.rank_deaths import RankMonitor
from nbdist.errors import format_ranks

__all__ = ["JoinGuard"]


class JoinGuard(CallGuard):
    """What the ranks' join consults: a rank that failed or died ends the wait at once."""

    def __init__(
        self,
        interrupt: Callable[[Sequence[int]], None],
        *,
        monitor: RankMonitor | None = None,
        lingers: str = "",
        processes: Mapping[int, psutil.Process] | None = None,
        processes_stay: bool = True,
    ) -> None:
        """``interrupt(ranks)``: SIGINT to those ranks (a Ctrl-C or the --timeout);
        ``monitor``: watches the local ranks' processes (None: deaths are seen as the
        controller drops an engine); ``lingers``: what the note says of the ranks still
        waiting in torch's store ('' where the failed start stops them); ``processes``:
        {rank: its process} of the ranks on this machine, whose states a timed-out join
        says; ``processes_stay``: whether they outlive a failed join (not where the failed
        start stops them)."""
        super().__init__(interrupt)
        self._monitor = monitor
        self._lingers = lingers
        self._processes = dict(processes or {})
        self._processes_stay = processes_stay
        # The ranks still joining when one failed or died: named in the note.
        self.waiting: list[int] = []
        self._ended = False

    def finished(self, run) -> bool:
        """Whether the join is over though ranks still run: a rank failed or died in it."""
        if self._ended:
            return True
        if self._interrupted_at is not None:  # a Ctrl-C or the --timeout: the usual settling
            return False
        states = run.child_states()
        out = {r for r, s in states.items() if s == "error"} | set(self.deaths())
        if not out:
            return False
        self.waiting = [r for r, s in states.items() if s == "running" and r not in out]
        self._ended = True
        return True

    def deaths(self) -> dict[int, str]:
        """{rank: how it died} of the local ranks that died while joining."""
        return dict(self._monitor.dead) if self._monitor is not None else {}

    def dead(self) -> dict[int, str]:
        """The ranks whose output will not complete: the dead, and once the join ended, those
        still in it (the run's output is not waited for beyond what came)."""
        return {**dict.fromkeys(self.waiting, "still joining"), **self.deaths()}

    def only_stopped_left(self, run) -> bool:
        """Whether every rank still running is a process here that is stopped (SIGSTOP, a
        tracer): after an interrupt, the settle need not wait for what cannot unwind."""
        running = [r for r, s in run.child_states().items() if s == "running"]
        return bool(running) and all(
            rank in self._processes and process_state_of(self._processes[rank]) in STOPPED_STATES
            for rank in running
        )

    def silent_states(self, ranks) -> str:
        """What the processes here of ``ranks`` (those that had not answered) are doing."""
        entries = self._states(ranks)
        return ranks_in_words(entries, stay=self._processes_stay) if entries else ""

    def stopped_ranks(self, ranks) -> tuple[list[int], str]:
        """Which of ``ranks`` are stopped processes here (SIGSTOP, a tracer), and in words."""
        return stopped_in_words(self._states(ranks), stay=self._processes_stay)

    def _states(self, ranks) -> list[tuple[int, int, str]]:
        return [
            (rank, self._processes[rank].pid, process_state_of(self._processes[rank]))
            for rank in ranks
            if rank in self._processes
        ]

    def note(self, failures=()) -> str:
        """Which ranks waited for the failed ones ('' if none did), and how long they may."""
        if not self.waiting:
            return ""
        words = (
            f"the process group did not form: {format_ranks(self.waiting)} waited for the "
            "rank(s) above to join"
        )
        return f"{words}; {self._lingers}" if self._lingers else words
