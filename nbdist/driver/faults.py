"""Kernel side: the cell guard, for ranks that fail, die or hang while others wait in a collective.

:class:`CellGuard`, consulted by the cell's waiting loop (:mod:`nbdist.driver.runner`).
When a rank failed and others wait for it in a collective (or still run ~5 s later),
or when a rank died (:mod:`nbdist.driver.rank_deaths` notices it), or when an
interrupt did not reach a rank's code (one whose code caught it runs its handling
code on, one reporting an error ends by itself: :mod:`nbdist.driver.caught_interrupts`),
or when ranks wait in a collective for ranks that finished the cell without it, it
*releases* the ranks (:mod:`nbdist.driver.release`): every live rank breaks out of
its collective (see :mod:`nbdist.engine.control`) and ranks still computing get
SIGINT. After the cell the group is formed again on the surviving processes (their
variables and models stay). The words this adds to the cell's error are written by
:mod:`nbdist.driver.release_note`.

Example (what a notebook user sees)::

    %%on_all_ranks
    if rank == 1:
        raise ValueError("bad batch")
    dist.all_reduce(t)          # rank 0 would wait here for 30 minutes
    # -> RankError: rank 1: ValueError: bad batch
    #    rank 0: released from all_reduce #3 (rank 1 failed); the process group was formed again
"""

from __future__ import annotations

import time

from nbdist.driver.caught_interrupts import interrupt_answers
from nbdist.driver.collective_waits import idle_ranks, stranded_waits, waits_for_failed
from nbdist.driver.oom import cuda_oom_note
from nbdist.driver.process_state import STOPPED_STATES
from nbdist.driver.release import ASK_S, raised_in_cell, release_ranks
from nbdist.driver.release_note import (
    NO_ANSWER,
    PAIRED_BUT_DIFFERENT,
    STRANDED,
    ended_parts,
    released_parts,
)
from nbdist.driver.stopped_ranks import StoppedRanks
from nbdist.engine.held_collective import HELD_S
from nbdist.errors import ranks_text

__all__ = ["CellGuard"]

# After one rank failed, the others are looked at FAILURE_GRACE_S later, then at doubling
# intervals: those waiting that long in a collective the failed rank never joins are
# released at once (the collective would last the group's 30-minute timeout). Ranks still
# computing may finish, or fail by themselves (a cell's error reaches ranks seconds apart at
# 256 ranks, or after uneven work), for FAILURE_WAIT_MAX_S, the ~5 s after which a user
# suspects a hang, with no rank ending meanwhile; then they are interrupted.
FAILURE_GRACE_S = 0.5
FAILURE_WAIT_MAX_S = 5.0
# After an interrupt, how long ranks get to stop on SIGINT alone.
INTERRUPT_GRACE_S = 0.5
# A rank that finished the cell enters no collective of it any more: a rank inside one that
# waits for it would wait until the group's timeout (30 min). A wait must last this long to
# count, and the first look comes after it: in flight, a collective a finished rank did
# enter completes within it, and a user suspects a hang after ~5 s.
STRANDED_GRACE_S = 3.0
# Looks come after STRANDED_GRACE_S, then at doubling intervals up to this: a look is a
# control message per running rank (and, while some ranks finished, a read of the flight
# recorder, ~20 ms), and a cell may run for hours, or rank 0 evaluate alone for minutes.
STRANDED_LOOK_MAX_S = 30.0
# A look that finds ranks stranded is made again this long after it (at least; a second per
# _ANSWERS_PER_S ranks running), and the ranks are released only if it finds the same.
STRANDED_CONFIRM_S = 1.0
# How many ranks' answers are waited for per second: after a release, those asked again (at
# least ASK_S); a stranded look's second look comes no sooner (at least STRANDED_CONFIRM_S).
_ANSWERS_PER_S = 50
# A release because ranks died: the words name every rank dead by the time they are read.
_DIED = object()


class CellGuard(StoppedRanks):
    """Watches one cell's ranks: releases the others when one fails, hangs or dies."""

    def __init__(self, session, ranks, background=None) -> None:
        """Guard one cell of ``session`` running on ``ranks`` (RankInfo, in run order).

        ``background``: the session's :class:`~nbdist.driver.background_runs.BackgroundRuns`
        (a rank still running a cell sent before this one without waiting has not begun it).
        """
        self.session = session
        self._background = background
        self._group = session.group  # a restart forms another: this cell's ranks are gone
        self.ranks = list(ranks)  # RankInfo of the cell's ranks, in run order
        self._by_rank = {r.rank: r for r in self.ranks}
        self._released_from: dict[int, str] = {}  # rank -> what it was released from
        self._release_reason = ""
        self.released = False
        self._first_failure: float | None = None
        self._next_failure_look = 0.0  # after a failure, the guard's next look at the others
        self._failure_looks = 0
        self._running_last_pass = len(self.ranks)  # ranks running at the last pass after a failure
        self._last_end = 0.0  # after a failure, when a rank last ended (the failure's own pass)
        self._interrupted_at: float | None = None
        # Once asked, INTERRUPT_GRACE_S after an interrupt: the running ranks whose code
        # caught its KeyboardInterrupt and runs on (not SIGINTed again, waited for).
        self.caught: set[int] | None = None
        # Then too: those whose request runs outside the user's code (not SIGINTed again).
        self._outside: set[int] = set()
        self._next_stranded_look: float | None = None  # the guard's next look at collectives
        self._stranded_interval = STRANDED_GRACE_S / 2  # doubled before each look
        # {rank: what it waited in, for whom}: ranks released from a collective that ranks
        # which finished the cell never entered.
        self.stranded: dict[int, str] = {}
        self._suspected: dict[int, str] = {}  # the last look's stranded ranks, to confirm
        # {rank: 'all_reduce #9'}: a wait found for failed or finished ranks that nbdist's
        # records do not show as inside a call (DDP's, from C++; a pipeline's on its works):
        # named by it, and given release.KNOWN_WAIT_UNWIND_S once released.
        self._untracked_wait: dict[int, str] = {}
        self.reformed = ""  # what happened to the group after a release
        # {rank: 'send #2'}: ranks ended because a collective held them after the release.
        self.ended: dict[int, str] = {}
        self._next_held_look: float | None = None
        self._held_interval = HELD_S
        self._started = time.monotonic()
        # {rank: its process here, or None}: looked up once, when an interrupt asks for it.
        self._processes: dict = {}
        self._released_at = 0.0  # when release() ran (monotonic)
        self._next_stopped_look = 0.0  # when stopped_waited() reads the processes again
        self._stopped_since: dict[int, float] = {}  # rank -> first of the looks seeing it stopped

    def _age(self) -> float:
        """Seconds since this cell was sent to the ranks."""
        return time.monotonic() - self._started

    @property
    def released_from(self) -> dict[int, str]:
        """{rank: what it was released from}, for ranks still alive.

        Ranks of a cancelled job or a lost host die a few milliseconds apart: one
        released while alive and dead a moment later is named among the dead.
        """
        dead = self.dead() if self._released_from else {}
        return {
            r: what for r, what in self._released_from.items() if r not in dead or r in self.ended
        }

    @property
    def release_reason(self) -> str:
        """Why the ranks were released ('' if they were not); deaths as known now."""
        if self._release_reason == _DIED:
            return f"{ranks_text(self.deaths())} died"
        return self._release_reason

    # -- what the waiting loop calls ----------------------------------------
    def dead(self) -> dict[int, str]:
        """{rank: cause} of this cell's ranks that died, or that the guard ended."""
        return self.session.dead_ranks({r.rank for r in self.ranks})

    def deaths(self) -> dict[int, str]:
        """{rank: cause} of this cell's ranks that died by themselves (not ended here)."""
        return {r: cause for r, cause in self.dead().items() if r not in self.ended}

    def watching(self) -> bool:
        """Whether :meth:`poll` may act now: while the cell's ranks run (a run sent without
        waiting may be asked ``done()`` after a stop or restart, whose ranks are gone)."""
        return self.session.running and self.session.group is self._group

    def poll(self, run) -> None:
        """Each pass of the waiting loop: release the ranks if the cell cannot finish."""
        if self.released:
            self._look_held(run)
            return
        dead = self.dead()
        if dead:
            self.release(run, _DIED)
            return
        states = run.child_states()
        failed = [r for r, s in states.items() if s == "error"]
        running = [r for r, s in states.items() if s == "running"]
        now = time.monotonic()
        if self._interrupted_at is None and self._background is not None:
            # Not begun: still in a cell sent before without waiting, whose guard watches it.
            behind = self._background.running_before(run)
            running = [r for r in running if r not in behind]
        if self._interrupted_at is not None:
            # Interrupted ranks fail with KeyboardInterrupt: that is no cause to name.
            if not running or now - self._interrupted_at < INTERRUPT_GRACE_S:
                return
            if self.caught is None:
                # A stopped process answers nothing until continued: not asked, it missed.
                stopped = self._stopped_now(run)
                answers = interrupt_answers(run, [r for r in running if r not in stopped])
                self.caught, self._outside = answers.caught, answers.outside
                if answers.missed(running):
                    self.release(run, "the cell was interrupted")
                    return
            # Every rank still running handles the interrupt in its own code (or reports an
            # error): it is released only from a collective that ranks which ended never enter.
            self._look_stranded(run, states, running, now)
        elif failed and running:
            if self._first_failure is None and set(failed) <= set(run.interrupted_ranks()):
                # Every failed rank stopped on a SIGINT the kernel did not send (the sidebar's
                # interrupt, `kill -INT`): the ranks were interrupted from elsewhere, and the
                # others' may land late on a loaded machine. Handled as the kernel's own: not
                # "rank 1 failed", and code that caught it runs its handling on.
                self.interrupted()
                return
            before, self._running_last_pass = self._running_last_pass, len(running)
            if self._first_failure is None:
                self._first_failure = self._last_end = now
                self._next_failure_look = now + FAILURE_GRACE_S
            elif len(running) < before:
                # Ranks still end (an error every rank meets reaches 256 ranks over
                # seconds): none is overdue yet, and a look would cost each running rank
                # CPU for nothing.
                self._last_end = now
                self._next_failure_look = now + FAILURE_GRACE_S
            elif self._overdue(run, running, now):
                self.release(run, f"{ranks_text(failed)} failed")
            elif now >= self._next_failure_look:
                self._failure_looks += 1
                if all(self._process_state(r) in STOPPED_STATES for r in running):
                    # Every rank still running is a stopped process: none can end by itself,
                    # nor answer where it waits, until it is continued.
                    self.release(run, f"{ranks_text(failed)} failed")
                    return
                waits = self._waits_for_failed(run, running, failed)
                if waits:
                    # Named by their call: a wait outside nbdist's record (on a work's
                    # wait(), DDP's) would read as "its running code".
                    self._untracked_wait.update(waits)
                    self.release(run, f"{ranks_text(failed)} failed")
                else:
                    # Each look costs every running rank a moment of CPU (at 256 ranks on a
                    # small machine, the CPU they are failing or finishing with).
                    interval = FAILURE_GRACE_S * 2**self._failure_looks
                    self._next_failure_look = time.monotonic() + interval
        elif running:
            self._look_stranded(run, states, running, now)

    def _look_stranded(self, run, states: dict[int, str], running: list[int], now: float) -> None:
        """Release the ranks if some wait in a collective that cannot end.

        (The words: :data:`~nbdist.driver.release_note.STRANDED`.)
        """
        if self._next_stranded_look is None:
            self._next_stranded_look = now + STRANDED_GRACE_S
        elif now >= self._next_stranded_look:
            self._stranded_interval = min(2 * self._stranded_interval, STRANDED_LOOK_MAX_S)
            self._next_stranded_look = now + self._stranded_interval
            done = {r for r, s in states.items() if s != "running"}
            paired: set[int] = set()
            untracked = dict(self._untracked_wait)
            stranded = stranded_waits(
                self.session.client,
                self._by_rank,
                running,
                done,
                untracked,
                lasted_s=STRANDED_GRACE_S,
                paired=paired,
            )
            # A verdict stands when the next look, soon after, finds the same: a collective
            # under way when a late rank came looks stranded for a moment (at 256 ranks on
            # 2 cores its ring takes seconds, and the ranks it has freed finish the cell
            # while the others still wait in it), and the ranks answer one after another.
            confirmed = {r: w for r, w in stranded.items() if self._suspected.get(r) == w}
            self._suspected = stranded
            if stranded and not confirmed:
                confirm_s = max(STRANDED_CONFIRM_S, len(running) / _ANSWERS_PER_S)
                self._next_stranded_look = min(self._next_stranded_look, now + confirm_s)
            elif confirmed:
                self._untracked_wait = untracked
                self.stranded = confirmed
                self.release(run, PAIRED_BUT_DIFFERENT if paired & confirmed.keys() else STRANDED)

    def _look_held(self, run) -> None:
        """After a release: end the ranks that a collective they were in then still holds.

        The ranks still running are asked :data:`HELD_S` after the release, then at doubling
        intervals up to :data:`STRANDED_LOOK_MAX_S`, or sooner where a rank held less long
        will have been held :data:`HELD_S` then; one held :data:`HELD_S` after its own
        release (:mod:`nbdist.engine.held_collective`: gloo leaves some waits to the group's
        timeout) ends itself.
        """
        from nbdist.driver.where import ask, control_request

        now = time.monotonic()
        if self._next_held_look is None:
            self._next_held_look = now + HELD_S
            return
        if now < self._next_held_look:
            return
        self._held_interval = min(2 * self._held_interval, STRANDED_LOOK_MAX_S)
        self._next_held_look = now + self._held_interval
        dead = self.dead()
        running = [
            self._by_rank[r]
            for r, state in run.child_states().items()
            if state == "running" and r not in dead and r not in self.ended
        ]
        if not running:
            return
        found = ask(self.session.client, running, light=True, timeout=ASK_S)
        seen = {w.rank: w.held for w in found if w.answered and w.held is not None}
        held = {rank: h["call"] for rank, h in seen.items() if h["s"] >= HELD_S}
        soonest = min((HELD_S - h["s"] for h in seen.values() if h["s"] < HELD_S), default=None)
        if soonest is not None:
            # A rank released late (its control thread answered the release late: stopped,
            # or one of hundreds on a loaded machine) is looked at again when it may count.
            self._next_held_look = min(self._next_held_look, now + soonest + 0.1)
        if not held:
            return
        # Each rank checks again before it ends (it may have left its collective since).
        control_request(
            self.session.client,
            [self._by_rank[r].engine_id for r in held],
            "end_if_held",
            timeout=2.0,
            min_s=HELD_S,
        )
        self.ended.update(held)
        for rank, what in held.items():
            self._released_from[rank] = what

    def _overdue(self, run, running: list[int], now: float) -> bool:
        """Some running rank has computed FAILURE_WAIT_MAX_S since a rank failed, and no
        rank has ended for as long.

        Counted from when the rank began the cell, if later: at 256 ranks some begin it
        seconds after the first failed, and fail the same way soon after. Ranks that have
        not begun are not counted; where no rank's beginning was seen (no "busy" status
        message), from the failure. While ranks still end, the others are not hung: on a
        machine with far fewer cores than ranks an error every rank meets takes seconds of
        wall time per rank (its traceback is formatted on a share of a core), and a
        release there cost more than the wait (the group formed again: 38 s, not 5, for
        such a cell at 256 ranks on 2 cores, 2026-12-02).
        """
        if now - self._last_end < FAILURE_WAIT_MAX_S:
            return False
        began = run.began
        if not began:
            return now - self._first_failure >= FAILURE_WAIT_MAX_S
        return any(
            now - max(began[r], self._first_failure) >= FAILURE_WAIT_MAX_S
            for r in running
            if r in began
        )

    def _waits_for_failed(self, run, running: list[int], failed: list[int]) -> dict[int, str]:
        """{rank: its call} of running ranks that wait in vain for the failed ones.

        Only ranks that began the cell are asked. The first look reads nbdist's own
        record of each rank's collective; later ones the flight recorder too (a call
        torch issued itself, DDP's), ~20 ms of a rank's CPU.
        """
        client = self.session.client
        gone = idle_ranks(client, self._by_rank, failed)
        asked = [r for r in running if r in run.began] if run.began else running
        if not gone or not asked:
            return {}
        return waits_for_failed(
            client,
            self._by_rank,
            asked,
            gone,
            lasted_s=FAILURE_GRACE_S,
            flight=self._failure_looks > 1,
        )

    def interrupted(self) -> None:
        """SIGINT went to the ranks; release them if it does not land soon (those whose code
        caught it are left to run their handling code)."""
        if self._interrupted_at is None:
            self._interrupted_at = time.monotonic()

    def finished(self, run) -> bool:
        """Every rank returned, died (a dead rank's reply may never come), or, released while
        its process was stopped before it began the cell, is stopped still: its reply comes
        only once it is continued (after the kernel's own interrupt or --timeout, the settle
        ends and says so instead)."""
        dead = self.dead()
        held = set() if run.told_to_stop else self.held_stopped(run)
        return all(
            state != "running" or rank in dead or rank in held
            for rank, state in run.child_states().items()
        )

    def release(self, run, reason: str) -> None:
        """Break every live rank out of its collective; SIGINT the ranks still computing."""
        self.released = True
        self._released_at = time.monotonic()
        self._release_reason = reason
        self._released_from.update(
            release_ranks(
                self.session,
                run,
                by_rank=self._by_rank,
                known_waits=self._untracked_wait,
                # Code that caught the interrupt runs its handling on (not SIGINTed, as a
                # second Ctrl-C would); a request outside the user's code ends by itself.
                spared=set(self.caught or ()) | self._outside,
                cell_age=self._age(),
                stopped=self._stopped_now(run),
            )
        )

    def where_report(self, *, only_if_waiting: bool = False) -> str:
        """The ranks' stacks and last collectives (a cell past its ``--timeout``, or interrupted).

        ``only_if_waiting``: "" unless some rank waits in a collective or does not answer.
        """
        from nbdist.driver.where import ask_unless_stopped, format_where

        live = [r for r in self.ranks if r.rank not in self.dead()]
        try:
            found = ask_unless_stopped(
                self.session.client, live, lambda info: self._process_state(info.rank), timeout=1.0
            )
        except Exception as exc:  # a diagnosis must never hide the timeout itself
            return f"(could not ask the ranks: {exc})"
        waiting = any(not w.answered or (w.collective or {}).get("inside") for w in found)
        if only_if_waiting and not waiting:
            return ""
        return format_where(found)

    def recover(self, run, *, interrupted: bool = False) -> None:
        """After the cell: form the group again if it was released or left inconsistent.

        Where ranks died, only what the death did to the others is settled (a full group
        needs every rank: %dist_restart).
        """
        from nbdist.driver.where import ask

        session = self.session
        if self.released and self.watching():
            # (Not after a stop, nor once a later cell formed another group: its ranks would
            # say where that cell left them.)
            self._ask_unanswered()
        if session.dead_ranks():
            self._blame_deaths(run)
            return
        if (interrupted or run.interrupted_ranks()) and not self.released:
            # Ranks that stopped at different collectives (one returned from #7,
            # another never entered it) would pair the wrong calls from now on. (Ranks
            # interrupted from elsewhere too: DistSession.interrupt while nothing waited.)
            found = ask(session.client, session.ranks, timeout=2.0)
            seqs = {w.collective["seq"] if w.collective else 0 for w in found}
            stuck = any(w.collective and w.collective["inside"] for w in found)
            if len(seqs) > 1 or stuck or not all(w.answered for w in found):
                self._release_after_cell("the ranks stopped at different collectives")
            elif any(w.collective and w.collective.get("unfinished") for w in found):
                # A send or receive posted and never finished (a pipeline step cut short)
                # would take the data of the next one between the same ranks: wrong values,
                # a receive waiting for ever, or gloo writing into a buffer since freed.
                self._release_after_cell("sends or receives were left unfinished")
        if not interrupted and not self.released and session.group is not None:
            broken = run.broken_group_error()
            if broken:
                # The group's own timeout (or a peer's) ended a collective: gloo's connections
                # are closed and every later collective would fail with "Connection closed".
                self._release_after_cell(f"the process group broke ({broken})")
        if session.group is not None and session.group.released:
            try:
                stale = session.reform_group()
                self.reformed = "the process group was formed again; variables and models are kept"
                if stale:
                    self.reformed += (
                        ", but these were made with the old group: make them again before "
                        "using them: " + ", ".join(stale)
                    )
                cut = session.group.cut_schedules_note()
                if cut:
                    self.reformed += f"; {cut}"
            except Exception as exc:
                # A rank's own error (RankError) is a line per failure and a note: one line.
                said = "; ".join(str(exc).splitlines())
                then = "" if "%dist_restart" in said else ": %dist_restart"
                self.reformed = f"forming the process group again failed ({said}){then}"
        elif self.released and session.group is not None:
            # A cell sent without waiting, waited for after a later cell formed the group again.
            self.reformed = (
                "the process group was formed again for a later cell; variables and models are kept"
            )

    def _ask_unanswered(self) -> None:
        """Ask again, now that the cell ended, where the ranks were that the release
        interrupted without an answer (hundreds of ranks on a few cores answer late; a rank
        holding the GIL does not answer at all): the collective of this cell that raised (the
        interrupt ended it), else their running code. Those that still do not answer stay
        named so."""
        from nbdist.driver.where import ask

        dead = self.dead()
        silent = [
            self._by_rank[rank]
            for rank, what in self._released_from.items()
            if what == NO_ANSWER and rank not in dead
        ]
        if not silent:
            return
        age = self._age()
        # Idle now, each answers once it gets a moment of CPU: at 256 ranks on 2 cores, 200
        # of them took longer than ASK_S (2026-12-07), so the wait grows with their number.
        timeout = max(ASK_S, len(silent) / _ANSWERS_PER_S)
        for w in ask(self.session.client, silent, timeout=timeout, light=True):
            if w.answered:
                c = w.collective
                where = f"{c['op']} #{c['seq']}" if raised_in_cell(c, age) else "its running code"
                self._released_from[w.rank] = f"{where} (interrupted)"

    def _blame_deaths(self, run) -> None:
        """Name the live ranks whose error says the group broke as released by the death.

        gloo tells a rank that its peer's connection closed before the kernel learns of the
        peer's death: at once on another host (the controller's heartbeat takes 10 s), or by
        a few milliseconds here. Such a rank failed out of its collective before the guard
        could release it; its error ("Connection closed by peer") is the death's, not its own.
        """
        from nbdist.driver.where import ask

        dead = self.deaths()
        broken = set(run.broken_group_errors()) - set(self.dead()) - set(self._released_from)
        if not dead or not broken:
            return
        found = {
            w.rank: w
            for w in ask(
                self.session.client,
                [self._by_rank[r] for r in sorted(broken)],
                timeout=ASK_S,
            )
        }
        for rank in sorted(broken):
            w = found.get(rank)
            c = w.collective if w is not None else None
            if w is None or not w.answered:
                self._released_from[rank] = NO_ANSWER
            elif raised_in_cell(c, self._age()):
                self._released_from[rank] = f"{c['op']} #{c['seq']}"
            else:  # a call nbdist's record does not see (DDP's, from C++)
                self._released_from[rank] = "its running code"
        failed_alone = [
            r
            for r, s in run.child_states().items()
            if s == "error" and r not in broken and r not in dead
        ]
        self.released = True
        if not failed_alone or not self._release_reason:
            # The failures that made the guard release the ranks were the death's too.
            self._release_reason = _DIED

    def _release_after_cell(self, reason: str) -> None:
        """Release every rank once the cell ended, so that the group is formed again."""
        from nbdist.driver.where import control_request

        session = self.session
        control_request(session.client, [r.engine_id for r in session.ranks], "release", 2.0)
        session.group.released = True
        self.released = True
        self._release_reason = reason

    def note(self, failures=()) -> str:
        """Lines added to the cell's error: the GPU a rank ran out of, which ranks were released."""
        oom = cuda_oom_note(failures, self.session.placement)
        released = self._released_note()
        return "\n".join(line for line in (oom, released) if line)

    def _released_note(self) -> str:
        if not self.released:
            return ""
        parts = released_parts(
            {r: what for r, what in self.released_from.items() if r not in self.ended},
            ask_s=ASK_S,
        )
        released = "released" if self.stranded else "the others were released"
        head = self.release_reason + (f"; {released}: {', '.join(parts)}" if parts else "")
        ended = {r: what for r, what in self.ended.items() if r in self.dead()}
        timeout = self.session.options.group_timeout
        ended_words = ended_parts(ended, held_s=HELD_S, group_timeout=timeout)
        head += "".join(f"; {part}" for part in ended_words)
        if self.session.dead_ranks():
            return head + f". {self.session.restart_hint()}."
        return head + (
            f". {self.reformed[0].upper()}{self.reformed[1:]}." if self.reformed else "."
        )
