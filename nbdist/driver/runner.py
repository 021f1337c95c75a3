"""Kernel side: run code on ranks, stream each rank's output as it arrives, fail on any rank's error.

The waiting loop runs in the caller's thread (the notebook cell), so output is
written where the cell's output goes. ipyparallel's IO thread only notes which
rank's output or reply for this cell arrived and sets an event (the loop also
wakes every 50 ms to check for dead or hung ranks); the loop then reads the new
part of those ranks' accumulated stdout/stderr/displays (of every rank once a
second and at the end), and asks only those futures how they ended: at 256 ranks
a pass over every rank was most of a cell's kernel CPU. Reading the accumulated
metadata (instead of the messages) cannot lose or duplicate output, however
callbacks and the loop interleave.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from functools import partial

from nbdist.driver.call_guard import CallGuard
from nbdist.driver.cell_output import remember
from nbdist.driver.cells import cell_channel
from nbdist.driver.early_iopub import EarlyIopub
from nbdist.driver.ipp_internals import (
    per_engine_futures,
    per_engine_ids,
    per_engine_metadata,
    result_client,
)
from nbdist.driver.late_output import late_output_of
from nbdist.driver.missed_interrupt import MissedInterrupt
from nbdist.driver.output import OutputMerger
from nbdist.driver.prompts import PromptServer
from nbdist.driver.rank_replies import (
    answers_at_timeout,
    broken_group_words,
    child_result,
    run_failures,
)
from nbdist.driver.rank_streams import RankStreams
from nbdist.driver.run_interrupts import RunInterrupts
from nbdist.driver.sigint_latch import SigintLatch
from nbdist.driver.sinks import default_sink
from nbdist.errors import NbdistError, RankError, format_ranks, suspended_words

__all__ = ["CellTimeout", "RankRun", "submit"]

_POLL_S = 0.05
# iopub messages that change what a cell shows (ipyparallel accumulates them per rank).
_OUTPUT_MESSAGES = frozenset({"stream", "display_data", "execute_result", "error"})
# A widget's state (a rank's tqdm.auto bar): kept for the text form of its display.
_COMM_MESSAGES = frozenset({"comm_open", "comm_msg", "comm_close"})
# Said once under a rank the cell waits for though its process is stopped
# (CellGuard.stopped_waited): without it the cell waits in silence for as long as it stays so,
# and ranks that reach a collective with it hang there with no cause shown.
_STOPPED_RUNNING_NOTE = (
    "nbdist: the cell waits for this rank: {words}; ranks that reach a collective with it "
    "wait there until it goes on; interrupt the cell to stop waiting\n"
)
# The same after a release (another rank failed): it may hold one of the cell's collectives.
_STOPPED_WAITED_NOTE = (
    "nbdist: the ranks were released; the cell waits for this one, which had begun it: "
    "{words}; once it goes on, it is released too; interrupt the cell to stop waiting\n"
)


class CellTimeout(NbdistError, TimeoutError):
    """A cell ran past its ``--timeout``; the ranks were interrupted."""


class RankRun(RunInterrupts):
    """Code submitted to some ranks; :meth:`wait` streams output and returns per-rank results."""

    def __init__(
        self,
        async_result,
        ranks: Sequence[int],
        *,
        interrupt: Callable[[Sequence[int]], None],
        sink=None,
        timeout: float | None = None,
        watch: Callable[[], None] | None = None,
        guard=None,
        waiting_for: str = "",
        prompts: PromptServer | None = None,
        iopub: EarlyIopub | None = None,
        background=None,
    ):
        """Follow ``async_result`` (one child per rank of ``ranks``, same order).

        ``interrupt(ranks)`` relays Ctrl-C; ``sink`` receives the merged output
        (default: the cell's output); ``timeout`` in seconds (None: no limit),
        for a cell's --timeout unless ``waiting_for`` names what nbdist itself waits for;
        ``watch`` is called on each pass of the waiting loop; ``guard`` is the
        cell's :class:`~nbdist.driver.faults.CellGuard` (None: a call's
        :class:`~nbdist.driver.call_guard.CallGuard`, which only interrupts again);
        ``prompts`` answers the ranks' pdb and ``input()`` prompts (``timeout``
        pauses while the user is asked); ``iopub`` holds the messages that came
        before this object existed (its callbacks were attached when the requests
        were sent), else callbacks are attached here; ``background``: the session's
        :class:`~nbdist.driver.background_runs.BackgroundRuns`, whose guards each pass
        drives too (its cells sent without waiting)."""
        self._ar = async_result
        self._watch = watch  # called on the waiting thread each pass (e.g. shows a dashboard)
        self._background = background
        # nbdist.driver.faults.CellGuard: releases the ranks when one fails, dies or hangs.
        self._guard = guard if guard is not None else CallGuard(interrupt)
        self.where_report = ""  # what the ranks were doing when --timeout expired
        self.ranks = list(ranks)
        self._interrupt = interrupt
        self._sink = sink
        self._timeout = timeout
        self._waiting_for = waiting_for
        self._prompts = prompts
        self._started = time.monotonic()
        self._wake = threading.Event()
        self._latch: SigintLatch | None = None  # while waiting: a Ctrl-C swallowed elsewhere
        self._stopped = False  # the ranks were told to stop (Ctrl-C or --timeout)
        # Then: every rank still running is a stopped process (the guard read it), which no
        # grace helps until it is continued; the settle stops waiting.
        self._left_to_stopped = False
        self._caught_noted = False  # _CAUGHT_NOTE was fed (or there was none to feed)
        # (rank, released) of the notes fed: _STOPPED_RUNNING_NOTE, _STOPPED_WAITED_NOTE.
        self._stopped_noted: set[tuple[int, bool]] = set()
        self._wait_for_caught = True  # after a Ctrl-C, not after a --timeout
        self._missed: MissedInterrupt | None = None  # then: ranks the SIGINT may have missed
        self._merger: OutputMerger | None = None
        self._finished = False
        self._results: list | None = None
        # Once waited for to the end: the outcome is kept, the machinery let go (_conclude).
        self._concluded = False
        self._error: RankError | None = None
        self._states: dict[int, str] = {}
        # Wake the waiting loop on output and on each rank's reply (a rank that fails
        # while the others wait is noticed at once), not on status messages: on a
        # 2-core machine every needless wake-up is CPU the ranks are waiting for.
        self._children = per_engine_futures(async_result)
        # The dicts ipyparallel fills with each rank's output, in place: read on every pass.
        self._metadata = per_engine_metadata(async_result)
        self._comms: deque[tuple[int, str, dict]] = deque()  # filled on ipyparallel's IO thread
        # Each rank's state as of the last child_states(), and the children whose reply came
        # since (their indices, appended on the IO thread): the loop asks for the states on
        # every pass, and asking each of 256 futures (a lock each) every pass was most of
        # the kernel's CPU in a no-op cell beyond a raw execute's (profiled at 64 ranks).
        self._state_of = dict.fromkeys(self.ranks, "running")
        self._replied: deque[int] = deque()
        # When the last reply came (monotonic; set on the IO thread): ranks still ending after
        # an interrupt are told apart from one that ended at once beside one that never will.
        self.last_reply_at = 0.0
        # Likewise the ranks whose output came since the loop's last pass (by iopub
        # message; ipyparallel fills the metadata first): a pass reads only theirs, and
        # every rank's at least once a second and at the end.
        self._index = {rank: i for i, rank in enumerate(self.ranks)}
        self._streams = RankStreams(self.ranks, self._metadata)
        # {rank: when (monotonic) its engine began the cell}: at many ranks the last ones begin
        # seconds after the first fail, and the guard counts a rank's time from its beginning.
        self.began: dict[int, float] = {}
        for i, (rank, child) in enumerate(zip(self.ranks, self._children)):
            if iopub is None:
                child.iopub_callbacks.append(partial(self._on_iopub, rank))
            child.add_done_callback(partial(self._on_reply, i))
        if iopub is not None:
            iopub.attach(self._on_iopub)
        # What a rank prints once it replied (a thread the cell started) is shown there.
        late_output_of(result_client(async_result)).expect(
            {child.msg_id: rank for rank, child in zip(self.ranks, self._children)}
        )
        async_result.add_done_callback(lambda _f: self._wake.set())

    def _on_reply(self, index: int, _future) -> None:
        # On ipyparallel's IO thread (or here, for a reply that had come already).
        self.last_reply_at = time.monotonic()
        self._replied.append(index)
        self._wake.set()

    def _on_iopub(self, rank: int, msg: dict) -> None:
        kind = msg["header"]["msg_type"]
        if kind == "status":
            # "busy" comes for every request; execute_input not for a silent one.
            if msg["content"].get("execution_state") == "busy":
                self.began.setdefault(rank, time.monotonic())
        elif kind in _OUTPUT_MESSAGES:
            self._streams.touched(self._index[rank])
            self._wake.set()
        elif kind in _COMM_MESSAGES:
            self._comms.append((rank, kind, msg["content"]))
        elif self._prompts is not None and self._prompts.offer(rank, msg):
            self._wake.set()

    def __repr__(self) -> str:
        """``<RankRun ranks 0-3: running>``."""
        state = "done" if self.done() else "running"
        return f"<RankRun {format_ranks(self.ranks)}: {state}>"

    def done(self) -> bool:
        """Every rank replied, or the run cannot finish (a rank died).

        A run nobody waits for is watched here too: a rank failed while others wait for it
        in a collective, or a rank died, releases the others as the waiting loop would
        (:class:`~nbdist.driver.faults.CellGuard`), so a run sent without waiting and
        polled with ``done()`` ends; :meth:`wait` then raises its error.
        """
        if self._concluded:
            return True
        if self._latch is None and not self._finished and self._guard.watching():
            self._guard.poll(self)
        return self._ar.ready() or self._guard.finished(self)

    def failed_ranks(self) -> list[int]:
        """The ranks whose reply is an error of their own, not one a release caused."""
        released = self._guard.released_from if self._guard is not None else {}
        return [r for r, s in self.child_states().items() if s == "error" and r not in released]

    def sent_before(self, other: RankRun) -> bool:
        """Whether this run was sent before ``other`` (a rank runs its requests in order)."""
        return self._started < other._started

    @property
    def sent_at(self) -> float:
        """When the requests were sent (``time.monotonic()``, taken just after)."""
        return self._started

    @property
    def results(self) -> list | None:
        """Per-rank results (exceptions included) once :meth:`wait` got them, else None."""
        return self._results

    @property
    def client(self):
        """The ipyparallel client the requests went through."""
        return result_client(self._ar)

    def engine_ids(self, ranks: Sequence[int]) -> dict[int, int]:
        """{rank: its engine id} of those of ``ranks`` in this run."""
        engines = per_engine_ids(self._ar)
        if engines is None:
            return {}
        return {rank: engines[self._index[rank]] for rank in ranks if rank in self._index}

    @property
    def told_to_stop(self) -> bool:
        """Whether the kernel told the ranks to stop (a Ctrl-C or the --timeout)."""
        return self._stopped

    def child_states(self) -> dict[int, str]:
        """{rank: 'running' | 'ok' | 'error'} from each rank's own reply."""
        if self._concluded:
            return dict(self._states)
        while self._replied:
            i = self._replied.popleft()
            child = self._children[i]
            failed = child.exception() is not None or isinstance(child.result(), BaseException)
            self._state_of[self.ranks[i]] = "error" if failed else "ok"
        return dict(self._state_of)

    def broken_group_errors(self) -> dict[int, str]:
        """{rank: its words} of the ranks whose error says the process group itself broke.

        gloo's transport errors (a collective that timed out, a peer's closed
        connection) and NCCL's aborted communicator leave the group unusable.
        """
        found = {}
        for rank, child in zip(self.ranks, self._children):
            error = child_result(child)
            if isinstance(error, BaseException):
                words = broken_group_words(str(getattr(error, "evalue", error)))
                if words:
                    found[rank] = words
        return found

    def interrupted_ranks(self) -> list[int]:
        """The ranks whose reply is a KeyboardInterrupt (SIGINT, from the kernel or elsewhere)."""
        errors = (child_result(child) for child in self._children)
        return [
            r for r, e in zip(self.ranks, errors) if getattr(e, "ename", "") == "KeyboardInterrupt"
        ]

    def broken_group_error(self) -> str:
        """The first rank error that says the process group itself broke ('' if none does)."""
        for rank, words in self.broken_group_errors().items():
            return f"rank {rank}: {words}"
        return ""

    def _all_done(self) -> bool:
        if self._ar.ready():
            return True
        return self._guard.finished(self)

    # -- output -----------------------------------------------------------
    def _drain(self, *, touched_only: bool = False) -> None:
        merger = self._merger
        while self._comms:
            merger.feed_comm(*self._comms.popleft())
        self._streams.drain(merger, touched_only=touched_only)

    def _finish_output(self) -> None:
        # The result can arrive before the last output message; wait briefly for it.
        # A dead rank's output never completes, nor a stopped one's: do not wait for it.
        gone = self._guard.dead() or self._guard.held_stopped(self)
        self._ar.wait_for_output(timeout=0.5 if gone else 5)
        self._drain()
        self._streams.finish(self._merger)
        self._merger.close()

    # -- waiting ----------------------------------------------------------
    def _loop(self, deadline: float | None) -> bool:
        """Stream until done; False if the deadline passed first."""
        while True:
            if self._latch is not None and self._latch.take():
                raise KeyboardInterrupt  # it was raised elsewhere and swallowed there
            # The cells sent before this one without waiting first: a rank still in one of
            # them has not begun this cell, and that cell's guard knows why it waits.
            if self._background is not None and not self._stopped:
                self._background.poll(self)
            self._guard.poll(self)
            # Once the guard released the ranks it has SIGINTed those still computing:
            # a rank asked after that would be interrupted twice.
            if self._missed is not None and not self._guard.released:
                self._missed.poll()
            if self._stopped and not self._caught_noted:
                self._note_caught()
            if not self._stopped:
                self._note_stopped_waited()
            finished = self._all_done()
            self._drain(touched_only=not finished)
            self._merger.poll()
            if self._watch is not None:
                self._watch()
            if finished:
                return True
            if self._stopped and self._guard.only_stopped_left(self):
                self._left_to_stopped = True
                return False
            if self._prompts is not None and self._prompts.pending():
                # One prompt at a time; the user's time moves --timeout's deadline.
                deadline = self._prompts.serve(deadline, self._drain, self._merger.close)
                continue
            if deadline is not None and time.monotonic() > deadline:
                return False
            self._wake.wait(_POLL_S)
            self._wake.clear()

    def _note_stopped_waited(self) -> None:
        """Under each rank the cell waits for though its process is stopped
        (:meth:`CellGuard.stopped_waited`), say so once, with what lets it go on; once more
        after a release, which changes what it is waited for."""
        released = self._guard.released
        note = _STOPPED_WAITED_NOTE if released else _STOPPED_RUNNING_NOTE
        for rank, words in self._guard.stopped_waited(self).items():
            if (rank, released) not in self._stopped_noted:
                self._stopped_noted.add((rank, released))
                self._merger.feed(rank, "stderr", note.format(words=words))

    def wait(self, latch: SigintLatch | None = None) -> list:
        """Block until every rank finished; stream output; raise :class:`RankError` on failure.

        A KeyboardInterrupt (kernel interrupt) is relayed to every rank as SIGINT;
        the ranks get a few seconds to unwind, then KeyboardInterrupt is raised here.
        ``latch``: the caller's :class:`SigintLatch`, entered (holding) before the cell
        was sent; a Ctrl-C it held interrupts the ranks at once. Without one, the wait
        installs its own.
        """
        if self._concluded:
            if self._error is not None:
                raise self._error
            return list(self._results)
        if self._finished:
            return self._result_or_raise()
        if self._merger is None:
            self._merger = OutputMerger(self.ranks, self._sink or default_sink(len(self.ranks)))
            remember(self._merger)  # nbdist.output(rank=...) reads it
        deadline = None if self._timeout is None else self._started + self._timeout
        if latch is None:
            with SigintLatch() as own:
                return self._wait_with(own, deadline)
        return self._wait_with(latch, deadline)

    def _wait_with(self, latch: SigintLatch, deadline: float | None) -> list:
        self._latch = latch
        try:
            return self._wait(deadline)
        finally:
            self._latch = None

    def _wait(self, deadline: float | None) -> list:
        try:
            # From here a Ctrl-C raises where it lands, inside this try (one held is taken by
            # the loop). Let go before it, a Ctrl-C landing on the call itself escaped as the
            # kernel's own KeyboardInterrupt, the ranks never told (seen under load in CI).
            self._latch.holding = False
            completed = self._loop(deadline)
        except KeyboardInterrupt:
            self._latch.take()  # this Ctrl-C is handled here; a second one stops the settling
            # A rank waiting in a collective explains a hang: keep where they were.
            self.where_report = self._guard.where_report(only_if_waiting=True)
            self._stop_ranks(wait_for_caught=True)
            raise self._interrupted() from None
        if not completed:
            # Before anything is interrupted: where every rank is, and in which collective.
            self.where_report = self._guard.where_report()
            # nbdist's own waits say which ranks had answered, read before the interrupt.
            answers = answers_at_timeout(self.ranks, self._children) if self._waiting_for else ""
            # ...and what the processes here of those that had not are doing (stopped, asleep).
            states = (
                self._guard.silent_states(
                    [r for r, child in zip(self.ranks, self._children) if not child.done()]
                )
                if self._waiting_for
                else ""
            )
            # The limit holds: code that caught the interrupt gets one grace, not more.
            self._stop_ranks(wait_for_caught=False)
            where = f"\nwhere the ranks were:\n{self.where_report}" if self.where_report else ""
            note = self._guard.note()
            if self._waiting_for:  # nbdist's own wait, not a cell the user limited
                raise CellTimeout(
                    f"{self._waiting_for} took longer than {self._timeout:g} s on "
                    f"{len(self.ranks)} rank(s) and was interrupted ({answers})"
                    + (f"; {states}" if states else "")
                    + where
                )
            still = self._still_caught()
            if still:
                note = (
                    f"{format_ranks(still)} still run code that caught the KeyboardInterrupt "
                    "(the next cell runs there after it; interrupt it to stop that code)"
                    + (f"\n{note}" if note else "")
                )
            suspended, words = self._left_stopped()
            if suspended:
                # No grace helps them, and the next cell would wait for them in turn.
                note = f"{suspended_words(suspended, words)}; %dist_restart starts fresh ranks" + (
                    f"\n{note}" if note else ""
                )
            raise CellTimeout(
                f"the cell ran longer than --timeout {self._timeout:g} s on "
                f"{len(self.ranks)} rank(s) and was interrupted; raise --timeout or leave it "
                f"out (no limit by default){where}" + (f"\n{note}" if note else "")
            )
        self._finished = True
        self._finish_output()
        self._guard.recover(self)
        return self._conclude()

    def _conclude(self) -> list:
        """The results (or the :class:`RankError`), kept; the session's machinery let go.

        A finished run can stay referenced for the kernel's lifetime (IPython's ``Out``
        keeps what each ``--noblock`` cell returned): its AsyncResult, guard, sink and
        callbacks would keep a stopped session's ipyparallel client, its run and every
        point of it, one more per such cell.
        """
        try:
            self._result_or_raise()
        except RankError as exc:
            self._error = exc
        self._states = self.child_states()
        self._concluded = True
        self._ar = self._guard = self._watch = self._interrupt = self._missed = None
        self._sink = self._prompts = self._merger = None
        self._children, self._metadata = [], []
        self._streams.let_go()
        self._comms.clear()
        if self._error is not None:
            raise self._error
        return list(self._results)

    def _result_or_raise(self) -> list:
        if self._results is None:
            if self._ar.ready():
                self._results = self._ar.get(return_exceptions=True)
            else:  # a dead rank's reply may never come: each live rank's own
                self._results = [child_result(child) for child in self._children]
        failures = run_failures(self.ranks, self._results, self._guard, stopped=self._stopped)
        if failures:
            note = self._guard.note(failures)
            if self._background is not None and any(f.ename == "NotRun" for f in failures):
                # Dropped behind a --noblock cell that failed: whose error is in its run.
                note = "\n".join(x for x in (note, self._background.failed_note(self)) if x)
            raise RankError(failures, world_ranks=self.ranks, note=note)
        return list(self._results)


def submit(
    client,
    engine_ids: Sequence[int],
    ranks: Sequence[int],
    code: str,
    *,
    interrupt: Callable[[Sequence[int]], None],
    sink=None,
    timeout: float | None = None,
    watch: Callable[[], None] | None = None,
    guard=None,
    silent_if_possible: bool = False,
    background=None,
) -> RankRun:
    """Send ``code`` to the engines of ``ranks`` (same order) without waiting.

    ``silent_if_possible``: the caller waits for this cell before sending another
    (see :meth:`nbdist.driver.cells.CellChannel.execute`).
    """
    # A rank's first prompt can come back before RankRun exists: kept until it does.
    early = EarlyIopub()
    ar = cell_channel(client).execute(
        engine_ids,
        code,
        silent_if_possible=silent_if_possible,
        iopub_callbacks=[early.callback(rank) for rank in ranks],
    )
    return RankRun(
        ar,
        ranks,
        interrupt=interrupt,
        sink=sink,
        timeout=timeout,
        watch=watch,
        guard=guard,
        prompts=PromptServer(client, engine_ids, ranks),
        iopub=early,
        background=background,
    )
