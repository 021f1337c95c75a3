"""Kernel side: the cells sent without waiting that still run, watched while the kernel waits.

A cell's :class:`~nbdist.driver.faults.CellGuard` (a rank failed and the others wait for it in
a collective; a rank died) acts only when something drives it: the cell's waiting loop. A cell
sent without waiting (``%%on_all_ranks --noblock``, ``run(block=False)``) has no loop until
``.wait()``: when one of its ranks failed, the others waited in their collective until the
group's timeout (30 minutes by default), and a cell queued behind it was blamed for that wait.

So the session keeps its runs sent without waiting here (weakly: a run nobody holds is not kept
alive), and each pass of any other wait of the same session (a cell, ``push``, ``pull``,
``apply``) drives their guards, as ``RankRun.done()`` does: the failed cell's ranks are
released by its own guard, named in its own error (``.wait()`` raises it), and the cell queued
behind it begins once they are. While the kernel is idle nothing else waits: the kernel's
own event loop drives them every :data:`IDLE_POLL_S` until none runs. That loop is the main
thread's, the thread of every cell, so a look never overlaps a cell's use of the client or of
the runs; a run sent from another thread (a kernel subshell's) is driven by waits and
``done()`` alone.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import threading
import time
import weakref

from nbdist.errors import ranks_text

__all__ = ["IDLE_POLL_S", "BackgroundRuns"]

# How often the kernel's idle loop drives the guards: a failed rank's peers are first looked
# at 0.5 s after it failed (faults.FAILURE_GRACE_S), and a pass reads the runs' states alone
# until a guard has something to look at.
IDLE_POLL_S = 0.2

# How often settle() drives the guards (a cell's waiting loop passes as often).
_SETTLE_POLL_S = 0.05

_log = logging.getLogger(__name__)


class BackgroundRuns:
    """A session's runs sent without waiting that have not been waited for to the end."""

    def __init__(self) -> None:
        """Empty: the session adds each run it sends without waiting."""
        self._runs: list[weakref.ref] = []
        # Those that ended with a rank's error, not yet waited for, and when that was seen: a
        # cell queued behind one was dropped where it failed, and its error says where to look.
        self._failed: list[tuple[weakref.ref, float]] = []
        self._idle_timer: asyncio.TimerHandle | None = None

    def add(self, run) -> None:
        """Watch ``run`` (a :class:`~nbdist.driver.runner.RankRun`) until it is done."""
        self._runs.append(weakref.ref(run))
        self._drive_while_idle()

    def _drive_while_idle(self) -> None:
        """Have the main thread's running event loop (a kernel's) :meth:`poll` while idle."""
        if (
            self._idle_timer is not None
            or threading.current_thread() is not threading.main_thread()
        ):
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # a script: nothing runs between its own calls
            return
        self._idle_timer = loop.call_later(IDLE_POLL_S, _idle_poll, weakref.ref(self))

    def _idle_pass(self) -> None:
        self._idle_timer = None
        try:
            self.poll()
        except Exception:  # the run's own wait meets it again and raises it to the user
            _log.warning("nbdist: watching the --noblock cells while idle failed", exc_info=True)
            return
        if self._runs:
            self._drive_while_idle()

    def poll(self, current=None) -> None:
        """Drive the guard of each run still running, ``current`` (the run being waited for) aside.

        A run that is done (every rank replied, or it cannot finish) is let go: its
        ``.wait()`` reports it.
        """
        kept = []
        for ref in self._runs:
            run = ref()
            if run is None:
                continue
            if run is current or not run.done():  # done() drives the run's guard
                kept.append(ref)
            elif "error" in run.child_states().values():
                self._failed.append((ref, time.monotonic()))
        self._runs = kept

    def settle(self) -> None:
        """Drive the guards until no watched run has a rank that failed while others still run it.

        Called before the session sends the ranks anything: a failed rank is idle and would
        begin the request at once, and a collective in it would pair with the one the others
        still wait in (gloo pairs by order, not by size: an all-reduce of 1 element against
        one of 4 gave both ranks wrong values, and the request ran on the failed rank alone).
        Released, the others end that cell and all begin the request together. The guard
        releases within about FAILURE_WAIT_MAX_S (ranks still computing are interrupted then);
        the request starting seconds late, the user is told why, once, on stderr.
        """
        said = False
        while True:
            self.poll()
            failing = [run for run in (ref() for ref in self._runs) if _failing(run)]
            if not failing:
                return
            if not said:  # the request starts seconds late: why, once
                said = True
                print(_settling_line(failing[0]), file=sys.stderr)
            time.sleep(_SETTLE_POLL_S)

    def running_before(self, run) -> set[int]:
        """The ranks still running a watched run sent before ``run``: they have not begun it.

        (A rank's later request is queued behind the one it runs; its guard would take a
        rank waiting in the earlier cell's collective for one waiting in its own.)
        """
        busy: set[int] = set()
        for ref in self._runs:
            other = ref()
            if other is not None and other is not run and other.sent_before(run):
                busy.update(r for r, s in other.child_states().items() if s == "running")
        return busy

    def failed_note(self, run) -> str:
        """'rank 1 failed the --noblock cell sent before this one: ...' for the runs sent
        before ``run`` that ended with a rank's error after it was sent, not waited for ('' if
        none). One seen ended before it was sent is no cause of its drop: each wait and the
        kernel's idle loop look often, and :meth:`settle` looks just before a request is sent."""
        self._failed = [(ref, seen) for ref, seen in self._failed if _unwaited(ref())]
        lines = []
        for ref, seen in self._failed:
            other = ref()
            if other is None or seen < run.sent_at or not other.sent_before(run):
                continue
            failed = other.failed_ranks()
            if failed:
                lines.append(
                    f"{ranks_text(failed)} failed the --noblock cell sent before this one: its "
                    "run's .wait() (the value that cell returned) shows the error"
                )
        return "\n".join(lines)

    def clear(self) -> None:
        """The ranks are stopped or replaced: no run of theirs can finish any more."""
        self._runs = []
        self._failed = []
        if self._idle_timer is not None:
            self._idle_timer.cancel()
            self._idle_timer = None


def _unwaited(run) -> bool:
    """``run`` is kept by someone and its ``.wait()`` has not reported it yet."""
    return run is not None and run.results is None


def _failing(run) -> bool:
    """One of ``run``'s ranks failed while others still run it (None: a run let go)."""
    states = run.child_states().values() if run is not None else ()
    return "error" in states and "running" in states


def _settling_line(run) -> str:
    """What :meth:`BackgroundRuns.settle` waits for, said before it waits."""
    states = run.child_states()
    failed = [r for r, s in states.items() if s == "error"]
    running = [r for r, s in states.items() if s == "running"]
    still, one = ranks_text(running), len(running) == 1
    return (
        f"nbdist: {ranks_text(failed)} failed a --noblock cell that {still} still "
        f"{'runs' if one else 'run'} (waiting for it in a collective, or computing): this "
        f"begins on the ranks once {still} {'is' if one else 'are'} released (a few seconds); "
        "that cell's .wait() shows the error"
    )


def _idle_poll(ref: weakref.ref) -> None:
    """The idle loop's pass (the loop holds the session's runs weakly, as the session does)."""
    runs = ref()
    if runs is not None:
        runs._idle_pass()  # noqa: SLF001
