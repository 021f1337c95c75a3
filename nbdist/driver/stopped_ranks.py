"""Kernel side: a cell guard's ranks whose processes here are stopped (SIGSTOP, a debugger).

:class:`StoppedRanks` is the part of :class:`nbdist.driver.faults.CellGuard` that reads the
ranks' processes on this machine (psutil: ``/proc/<pid>/stat``) and decides what a stopped
one means for the cell: a stopped process takes no signal and answers nothing until it is
continued, so the guard neither asks it nor waits for it where waiting cannot help (one
released before it began the cell), waits for it where it must (one that had begun it may
hold one of its collectives once continued) and says so under it, and names it with what
lets it go on. It reads the guard's own state (its ranks, what it released them from,
when), so it is a base of ``CellGuard`` rather than a separate object.
"""

from __future__ import annotations

import time

from nbdist.driver.process_state import (
    STOPPED_STATES,
    process_here,
    process_state_of,
    states_in_words,
    stopped_in_words,
)
from nbdist.driver.release_note import STOPPED_PROCESS

__all__ = ["STOPPED_NOTE_AFTER_S", "StoppedRanks"]

# A rank still running whose process here has been stopped this long is said to be waited
# for, once, under it (the cell would wait in silence): the moment py-spy's dump or a
# debugger's step holds a process is far shorter.
STOPPED_NOTE_AFTER_S = 2.0
# Ranks whose process states stopped_waited() reads per second at most (~11 us each here).
_STATES_READ_PER_S = 100


class StoppedRanks:
    """What a :class:`~nbdist.driver.faults.CellGuard` reads and decides of stopped ranks."""

    def held_stopped(self, run) -> set[int]:
        """The ranks released while their processes were stopped, stopped still, that had not
        begun the cell. One that had may hold a collective of it once continued (a receive
        halfway through its data): the cell waits for it, to end it if it does."""
        return {
            rank
            for rank, what in self._released_from.items()
            if what == STOPPED_PROCESS
            # Where no rank's beginning was seen (no status message), none counts as not begun.
            and run.began
            and rank not in run.began
            and self._process_state(rank) in STOPPED_STATES
        }

    def stopped_waited(self, run) -> dict[int, str]:
        """{rank: its process in words, with what lets it go on} of the ranks still running
        whose processes here were stopped (SIGSTOP, a tracer) at every look for
        :data:`STOPPED_NOTE_AFTER_S`: the cell waits for them. Before a release the ranks
        that reach a collective with one wait for it there; after one, a rank that had
        begun the cell is waited for (:meth:`finished`), since once continued it takes its
        release. Read once a second, or once per :data:`_STATES_READ_PER_S` running ranks.
        """
        now = time.monotonic()
        if now < self._next_stopped_look:
            return {}
        skip = set(self.dead()) | set(self.ended) | self.held_stopped(run)
        running = [r for r, s in run.child_states().items() if s == "running" and r not in skip]
        # Read through every cell, however long it runs: at 256 ranks a read of all their
        # states costs ~3 ms of the kernel's CPU, which ranks on a small machine share.
        self._next_stopped_look = now + max(1.0, len(running) / _STATES_READ_PER_S)
        found = {}
        for rank in running:
            state = self._process_state(rank)
            if state not in STOPPED_STATES:
                self._stopped_since.pop(rank, None)
                continue
            # Seen stopped at every look since: py-spy's dump or a debugger's step holds a
            # process far shorter, and is seldom seen twice in a row.
            if now - self._stopped_since.setdefault(rank, now) >= STOPPED_NOTE_AFTER_S:
                found[rank] = states_in_words([(self._processes[rank].pid, state)])
        return found

    def only_stopped_left(self, run) -> bool:
        """Whether every rank still running is a stopped process here (SIGSTOP, a tracer) or
        dead: after an interrupt, no grace helps those until they are continued. Not before
        the guard's own look after the interrupt: a rank it missed is released from there
        (the group is formed again before the next cell, which a continued rank would
        otherwise run on from a cell the others left)."""
        if self.caught is None and not self.released:
            return False
        dead, stopped = None, False
        # Read on each pass of the settle: at the first rank that can still end, it answers.
        for rank, state in run.child_states().items():
            if state != "running":
                continue
            if self._process_state(rank) in STOPPED_STATES:
                stopped = True
                continue
            dead = self.dead() if dead is None else dead
            if rank not in dead:
                return False
        return stopped

    def stopped_ranks(self, ranks) -> tuple[list[int], str]:
        """Which of ``ranks`` are stopped processes here (SIGSTOP, a tracer), and in words
        with what lets them go on (they outlive the cell's error)."""
        entries = []
        for rank in ranks:
            state = self._process_state(rank)
            if state:
                entries.append((rank, self._processes[rank].pid, state))
        return stopped_in_words(entries)

    def _stopped_now(self, run) -> set[int]:
        """The running ranks whose processes here are stopped (SIGSTOP, a tracer)."""
        running = [r for r, s in run.child_states().items() if s == "running"]
        return {r for r in running if self._process_state(r) in STOPPED_STATES}

    def _process_state(self, rank: int) -> str:
        """The state of ``rank``'s process here ('' where its PID is not read here)."""
        if rank not in self._processes:
            info = self._by_rank.get(rank)
            found = process_here(info.pid) if info is not None and info.pid_here else []
            self._processes[rank] = found[0] if found else None
        proc = self._processes[rank]
        return process_state_of(proc) if proc is not None else ""
