"""Kernel side: a cell's per-rank output, read from what ipyparallel accumulates, within a limit.

ipyparallel keeps each rank's stdout, stderr and rich outputs of a request in that
request's metadata dict, accumulated as its IOPub messages come (on its IO thread).
:class:`RankStreams` reads what is new there into the cell's
:class:`~nbdist.driver.output.OutputMerger`: on each pass of the waiting loop only the
ranks an output message named since the last (the others at least once a second), and
each rank's stream only up to :func:`output_limit` characters a cell, the rest counted
and said, not shown.
"""

from __future__ import annotations

import os
import time
from collections import deque
from collections.abc import Sequence

__all__ = ["RankStreams", "output_limit"]

# The waiting loop reads every rank's output at least this often (else only the ranks an
# output message named since its last pass).
_FULL_DRAIN_S = 1.0
# Characters shown per rank and stream in one cell: beyond it a notebook (and
# the saved .ipynb) becomes unusable, so the rest is counted, not shown.
_DEFAULT_OUTPUT_LIMIT = 1 << 20


def output_limit() -> int:
    """Characters of one rank's stdout (or stderr) shown per cell; ``NBDIST_OUTPUT_LIMIT``, 0 = all."""
    value = os.environ.get("NBDIST_OUTPUT_LIMIT", "")
    try:
        return int(value) if value.strip() else _DEFAULT_OUTPUT_LIMIT
    except ValueError:
        return _DEFAULT_OUTPUT_LIMIT


def _mib(chars: int) -> str:
    return f"{chars / 2**20:.1f} MiB"


def stream_delta(old: str, new: str) -> str:
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


class RankStreams:
    """What each rank of one request has printed and displayed, fed to a merger as it comes."""

    def __init__(self, ranks: Sequence[int], metadata: list) -> None:
        """``metadata``: ipyparallel's per-rank metadata dicts of the request, in ``ranks``' order
        (filled in place on its IO thread)."""
        self.ranks = list(ranks)
        self._metadata = metadata
        self._consumed = [{"stdout": "", "stderr": "", "outputs": 0} for _ in self.ranks]
        self._limit = output_limit()
        self._shown: dict[tuple[int, str], int] = {}  # (rank, stream) -> characters fed
        self.truncated: dict[tuple[int, str], int] = {}  # (rank, stream) -> characters not shown
        # The ranks (by index) whose output came since the last read, appended on the IO
        # thread: a pass reads only theirs, and every rank's at least once a second.
        self._touched: deque[int] = deque()
        self._full_drain_at = 0.0

    def touched(self, index: int) -> None:
        """An output message of the rank at ``index`` came (any thread)."""
        if self._metadata:  # not after let_go: nothing drains it then
            self._touched.append(index)

    def drain(self, merger, *, touched_only: bool = False) -> None:
        """Feed ``merger`` what is new; ``touched_only``: only the ranks that printed since the
        last call, unless every rank's was last read a second ago or more."""
        indices = range(len(self.ranks))
        now = time.monotonic()
        if touched_only and now - self._full_drain_at < _FULL_DRAIN_S:
            indices = set()
            while self._touched:
                indices.add(self._touched.popleft())
        else:
            self._touched.clear()  # every rank is read below
            self._full_drain_at = now
        for i in sorted(indices):
            rank, md, seen = self.ranks[i], self._metadata[i], self._consumed[i]
            for stream in ("stdout", "stderr"):
                text = md[stream] or ""
                delta = stream_delta(seen[stream], text)
                if delta:
                    self._feed_limited(merger, rank, stream, delta)
                seen[stream] = text
            outputs = md["outputs"]
            while seen["outputs"] < len(outputs):
                out = outputs[seen["outputs"]]
                merger.feed_display(rank, out.get("data", {}), out.get("metadata", {}))
                seen["outputs"] += 1

    def finish(self, merger) -> None:
        """After the last :meth:`drain`: what the limit left out, then each rank's result (the
        cell's last expression), after its last line even if unterminated."""
        merger.end_lines()
        for (rank, stream), dropped in sorted(self.truncated.items()):
            merger.feed(rank, stream, f"nbdist: {_mib(dropped)} of {stream} not shown\n")
        for rank, md in zip(self.ranks, self._metadata):
            result = md.get("execute_result")
            if result:
                merger.feed_display(rank, result.get("data", {}), result.get("metadata", {}))

    def let_go(self) -> None:
        """Once the cell ended: drop the ranks' accumulated output (a finished run may stay
        referenced for the kernel's lifetime); :meth:`touched` is ignored from then on."""
        self._metadata, self._consumed = [], []
        self._touched.clear()

    def _feed_limited(self, merger, rank: int, stream: str, delta: str) -> None:
        key = (rank, stream)
        if key in self.truncated:
            self.truncated[key] += len(delta)
            return
        shown = self._shown.get(key, 0)
        if self._limit and shown + len(delta) > self._limit:
            room = max(0, self._limit - shown)
            cut = delta.rfind("\n", 0, room) + 1 or room  # end on a whole line when possible
            part = delta[:cut]
            self.truncated[key] = len(delta) - len(part)
            note = (
                f"nbdist: {stream} truncated after {_mib(self._limit)} in this cell; the rest "
                "is not shown (write large output to a file; NBDIST_OUTPUT_LIMIT=0 shows all)"
            )
            merger.feed(rank, stream, part + ("" if part.endswith("\n") else "\n") + note + "\n")
            return
        self._shown[key] = shown + len(delta)
        merger.feed(rank, stream, delta)
