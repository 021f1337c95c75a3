"""Run code on ranks: stream each rank's output as it arrives, fail on any rank's error.

The waiting loop runs in the caller's thread (the notebook cell), so output is
written where the cell's output goes. ipyparallel's IO thread only sets an
event when a message for this cell arrives; the loop then reads the new part
of each rank's accumulated stdout/stderr/displays. Reading the accumulated
metadata (instead of the messages) cannot lose or duplicate output, however
callbacks and the loop interleave.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence

from .errors import NbdistError, RankError, RankFailure, RanksInterrupted
from .output import OutputMerger, default_sink

__all__ = ["CellTimeout", "RankRun", "submit"]

# How long interrupted ranks get to unwind before the cell gives up on them.
_INTERRUPT_GRACE_S = 10.0
_POLL_S = 0.05


class CellTimeout(NbdistError, TimeoutError):
    """A cell ran past its ``--timeout``; the ranks were interrupted."""


def _stream_delta(old: str, new: str) -> str:
    """What to feed the merger so that it sees ``new`` after having seen ``old``.

    ipyparallel collapses carriage returns in the text it accumulates (a
    progress bar's trailing line is rewritten, not appended to), so ``new``
    does not always extend ``old``. Complete lines never change; a rewritten
    last line is fed as a ``\\r`` update of the line in progress.
    """
    if new is old:
        return ""
    if new.startswith(old):
        return new[len(old) :]
    stable = old.rfind("\n") + 1
    if new.startswith(old[:stable]):
        return "\r" + new[stable:]
    return "\r" + new


class RankRun:
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
    ):
        self._ar = async_result
        self._watch = watch  # called on the waiting thread each pass (e.g. shows a dashboard)
        self.ranks = list(ranks)
        self._interrupt = interrupt
        self._sink = sink
        self._timeout = timeout
        self._started = time.monotonic()
        self._wake = threading.Event()
        self._consumed = [{"stdout": "", "stderr": "", "outputs": 0} for _ in self.ranks]
        self._merger: OutputMerger | None = None
        self._finished = False
        self._results: list | None = None
        # Wake the waiting loop on every message for this cell and on completion.
        for child in async_result._children:
            child.iopub_callbacks.append(lambda _msg: self._wake.set())
        async_result.add_done_callback(lambda _f: self._wake.set())

    def __repr__(self) -> str:
        from .output import format_ranks

        state = "done" if self.done() else "running"
        return f"<RankRun {format_ranks(self.ranks)}: {state}>"

    def done(self) -> bool:
        return self._ar.ready()

    # -- output -----------------------------------------------------------
    def _drain(self) -> None:
        merger = self._merger
        # ipyparallel keeps each rank's output accumulated in its metadata dict.
        for i, (rank, md) in enumerate(zip(self.ranks, self._ar._metadata)):
            seen = self._consumed[i]
            for stream in ("stdout", "stderr"):
                text = md[stream] or ""
                delta = _stream_delta(seen[stream], text)
                if delta:
                    merger.feed(rank, stream, delta)
                seen[stream] = text
            outputs = md["outputs"]
            while seen["outputs"] < len(outputs):
                out = outputs[seen["outputs"]]
                merger.feed_display(rank, out.get("data", {}), out.get("metadata", {}))
                seen["outputs"] += 1

    def _finish_output(self) -> None:
        # The result can arrive before the last output message; wait briefly for it.
        self._ar.wait_for_output(timeout=5)
        self._drain()
        for rank, md in zip(self.ranks, self._ar._metadata):
            result = md.get("execute_result")
            if result:
                self._merger.feed_display(rank, result.get("data", {}), result.get("metadata", {}))
        self._merger.close()

    # -- waiting ----------------------------------------------------------
    def _loop(self, deadline: float | None) -> bool:
        """Stream until done; False if the deadline passed first."""
        while True:
            finished = self._ar.ready()
            self._drain()
            self._merger.poll()
            if self._watch is not None:
                self._watch()
            if finished:
                return True
            if deadline is not None and time.monotonic() > deadline:
                return False
            self._wake.wait(_POLL_S)
            self._wake.clear()

    def wait(self) -> list:
        """Block until every rank finished; stream output; raise :class:`RankError` on failure.

        A KeyboardInterrupt (kernel interrupt) is relayed to every rank as SIGINT;
        the ranks get a few seconds to unwind, then KeyboardInterrupt is raised here.
        """
        if self._finished:
            return self._result_or_raise()
        if self._merger is None:
            self._merger = OutputMerger(self.ranks, self._sink or default_sink(len(self.ranks)))
        deadline = None if self._timeout is None else self._started + self._timeout
        try:
            completed = self._loop(deadline)
        except KeyboardInterrupt:
            self._interrupt(self.ranks)
            self._settle()
            raise self._interrupted() from None
        if not completed:
            self._interrupt(self.ranks)
            self._settle()
            raise CellTimeout(
                f"the cell ran longer than --timeout {self._timeout:g} s on "
                f"{len(self.ranks)} rank(s) and was interrupted; raise --timeout or leave it "
                "out (no limit by default)"
            )
        self._finished = True
        self._finish_output()
        return self._result_or_raise()

    def _settle(self) -> None:
        """After an interrupt: let ranks unwind, show what they printed, stop waiting."""
        try:
            self._loop(time.monotonic() + _INTERRUPT_GRACE_S)
        except KeyboardInterrupt:
            pass  # a second Ctrl-C: stop waiting now
        self._finished = self._ar.ready()
        if self._finished:
            self._finish_output()
        else:
            self._drain()
            self._merger.close()

    def _interrupted(self) -> RanksInterrupted:
        if not self._finished:
            done = [r for r, f in zip(self.ranks, self._ar._children) if f.done()]
            return RanksInterrupted(None, [r for r in self.ranks if r not in done])
        try:
            self._result_or_raise()
        except RankError as stopped:
            return RanksInterrupted(stopped)
        return RanksInterrupted(None)

    def _result_or_raise(self) -> list:
        if self._results is None:
            self._results = self._ar.get(return_exceptions=True)
        failures = [
            RankFailure(
                rank=rank,
                ename=getattr(res, "ename", None) or type(res).__name__,
                evalue=str(getattr(res, "evalue", res)),
                traceback=getattr(res, "traceback", None) or "",
            )
            for rank, res in zip(self.ranks, self._results)
            if isinstance(res, BaseException)
        ]
        if failures:
            raise RankError(failures, world_ranks=self.ranks)
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
) -> RankRun:
    """Send ``code`` to the engines of ``ranks`` (same order) without waiting."""
    view = client[list(engine_ids)]  # a list, even for one rank: per-rank results stay lists
    ar = view.execute(code, silent=False, block=False)
    return RankRun(ar, ranks, interrupt=interrupt, sink=sink, timeout=timeout, watch=watch)
