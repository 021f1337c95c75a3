"""Kernel side: what a rank prints after its cell ended, shown under that cell.

A thread a cell started on the ranks, a DataLoader worker that lives on, a
library's callback: each can print after the rank replied. What a rank prints
between requests, ipykernel on the rank sends with the header of the last request
it ran (the last cell, or a call of nbdist's; while a cell runs, its output is that
cell's, shown as usual), and ipyparallel's client has let that request go by then:
the text was lost, and kept in memory for as long as the rank printed.
:func:`late_output_of` taps the client
(:func:`~nbdist.driver.ipp_internals.tap_late_iopub`, which also drops what
ipyparallel kept); :class:`~nbdist.driver.runner.RankRun` names each request it
follows (:meth:`LateOutput.expect`), with the kernel's cell that sent it.

In a kernel, a cell's late lines are shown in one display published with the
header of the kernel's cell that sent the request, so JupyterLab shows it under
that cell (until the cell is run again): under the last cell run on the ranks, as
a thread's output between cells goes to the last cell in a kernel of its own. The display is redrawn as lines come (:data:`WINDOW_S` after
the first, then at most every :data:`REDRAW_S`), folded across ranks by content as a cell's own output is
(:class:`LateFold`: ``[ranks 0-255] tick 3`` whatever the ranks' timing), its
latest :data:`LATE_LINES` distinct lines, then each rank's line still being written (a
``\r`` progress bar's latest state, one line per tqdm loop, :func:`unfinished_lines`), as a kernel of its own
shows a partial line at once. Outside a kernel (a script), whole lines go
to ``sys.stdout``/``sys.stderr`` as they come, several ranks' identical lines
once when they arrive within :data:`WINDOW_S` (:class:`LateLines`), as a
terminal shows a cell's live output. Rich displays published late are named,
not shown.

The tap and the redraws run on ipyparallel's IO thread; :meth:`LateOutput.expect`
on the thread that sends the cell.
"""

from __future__ import annotations

import sys
import threading
import time
import uuid
import weakref
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from nbdist.driver.ipp_internals import io_call_later, tap_late_iopub
from nbdist.driver.output import STREAMS
from nbdist.driver.output_fold import fold_key
from nbdist.driver.progress_bars import is_bar_key, live_bar_lines, merge_bars
from nbdist.errors import format_ranks

__all__ = [
    "KEPT_CELLS",
    "LATE_LINES",
    "REDRAW_S",
    "WINDOW_S",
    "LateFold",
    "LateLines",
    "LateOutput",
    "late_output_of",
    "unfinished_lines",
]

# A cell's late output is shown at most this often: ranks printing "the same" line
# do so within milliseconds, and each redraw resends the display's whole text.
WINDOW_S = 0.25
# A kernel's display is redrawn at most this often after its first drawing: a thread
# that prints on and on would otherwise resend the whole fold four times a second.
REDRAW_S = 1.0
# Distinct late lines a cell's display keeps (its latest): a thread printing forever
# must not grow the notebook, or this kernel's memory, without end.
LATE_LINES = 1000
# Cells whose requests are remembered: a thread started earlier still prints unseen,
# and what it prints is still freed.
KEPT_CELLS = 200
# An unterminated line is kept up to this many characters (a \r progress bar redraws
# one line without end).
_TAIL_CHARS = 10_000
_HEADER = "nbdist: printed by the ranks after they finished this cell\n"


def split_lines(tails: dict, rank: int, stream: str, text: str) -> list[str]:
    """The lines ``text`` completes for (``rank``, ``stream``); its unterminated end kept in ``tails``.

    A line's visible text: what follows its last ``\\r`` (a progress bar's latest state).
    """
    *whole, tail = (tails.pop((rank, stream), "") + text).split("\n")
    if tail:
        tails[(rank, stream)] = tail[-_TAIL_CHARS:]
    return [line.rstrip("\r").rpartition("\r")[2] for line in whole]


def unfinished_lines(tails: dict) -> list[str]:
    """``[label] text`` of each line still being written, in ``tails`` ({(rank, stream):
    unterminated text}, as :func:`split_lines` keeps it): its visible text (after its last
    ``\r``), identical ones across ranks once, one line per tqdm loop
    (:func:`~nbdist.driver.progress_bars.live_bar_lines`), in rank order; a line erased
    with blanks (``\r   \r``, a closed bar) is left out."""
    by_stream: dict[str, dict[int, str]] = {}
    for (rank, stream), raw in sorted(tails.items()):
        text = raw.rstrip("\r").rpartition("\r")[2]
        if text.strip():
            by_stream.setdefault(stream, {})[rank] = text
    lines = [line for bars in by_stream.values() for line in live_bar_lines(bars)]
    lines.sort(key=lambda line: line[0][0])
    return [f"[{format_ranks(ranks)}] {text}" for ranks, text in lines]


class LateLines:
    """A script's late lines: several ranks' identical lines, fed since the last take, once.

    Pure bookkeeping (no thread, no clock).
    """

    def __init__(self) -> None:
        """Nothing fed yet."""
        self._pending: list[tuple[int, str, str]] = []  # (rank, stream, line)

    def add(self, rank: int, stream: str, line: str) -> None:
        """A whole line ``rank`` printed on ``stream``."""
        self._pending.append((rank, stream, line))

    def take(self) -> list[tuple[str, str]]:
        """``(stream, "[label] line\\n")`` in order; a line several ranks printed, once, where
        the first of them stood."""
        groups: dict[tuple[str, str], tuple[list[int], list[str]]] = {}
        for rank, stream, line in self._pending:
            ranks, lines = groups.setdefault((stream, fold_key(line)), ([], []))
            ranks.append(rank)
            lines.append(line)
        self._pending = []
        return [
            (stream, f"[{format_ranks(ranks)}] {_standing(key, lines)}\n")
            for (stream, key), (ranks, lines) in groups.items()
        ]


def _standing(key: str, lines: list[str]) -> str:
    """The text that stands for several ranks' ``lines`` of one fold ``key``: the first
    rank's; a tqdm bar's with the ranks' timings as ranges."""
    return merge_bars(lines) if len(lines) > 1 and is_bar_key(key) else lines[0]


class LateFold:
    """A cell's late lines folded across ranks by content, its latest ``limit`` distinct ones.

    The *n*-th occurrence of a line on one rank joins the *n*-th occurrence of the
    same line (:func:`~nbdist.driver.output_fold.fold_key`) on the others, whenever
    each comes; lines are kept in order of first appearance. Memory stays bounded
    however long the ranks print: the oldest lines are let go (and counted). A rank
    more than ``limit`` distinct lines behind the others meets its copies of lines let
    go already: they count as lines of their own, shown under that rank alone.
    Pure logic.
    """

    def __init__(self, limit: int = LATE_LINES) -> None:
        """Empty; at most ``limit`` distinct lines kept."""
        self._limit = limit
        # (stream, key, occurrence) -> (the ranks' texts, ranks), oldest first; a line
        # that is not a tqdm bar keeps its first rank's text only.
        self._lines: OrderedDict[tuple[str, str, int], tuple[list[str], list[int]]] = OrderedDict()
        self._seen: dict[tuple[int, str, str], int] = {}  # (rank, stream, key) -> occurrences
        self.dropped = 0  # distinct lines let go, the oldest

    def add(self, rank: int, stream: str, line: str) -> None:
        """A whole line ``rank`` printed on ``stream``."""
        key = fold_key(line)
        n = self._seen.get((rank, stream, key), 0)
        self._seen[(rank, stream, key)] = n + 1
        entry = self._lines.get((stream, key, n))
        if entry is None:
            self._lines[(stream, key, n)] = ([line], [rank])
        else:
            entry[1].append(rank)
            if is_bar_key(key):
                entry[0].append(line)
        while len(self._lines) > self._limit:
            (old_stream, old_key, old_n), (_text, ranks) = self._lines.popitem(last=False)
            self.dropped += 1
            for r in ranks:
                # A rank's count of a line let go restarts, unless it printed it since.
                if self._seen.get((r, old_stream, old_key)) == old_n + 1:
                    del self._seen[(r, old_stream, old_key)]

    def text(self) -> str:
        """The fold as a display shows it: a header, a note of lines let go, ``[label] line``."""
        parts = [_HEADER]
        if self.dropped:
            parts.append(
                f"… {self.dropped} earlier lines not shown (the latest {self._limit} are)\n"
            )
        parts.extend(
            f"[{format_ranks(ranks)}] {_standing(key, lines)}\n"
            for (_stream, key, _n), (lines, ranks) in self._lines.items()
        )
        return "".join(parts)


@dataclass
class _Cell:
    """One cell (one RankRun) whose ranks may print after it ended."""

    kernel: Any  # the IPython kernel the cell ran in, or None (a script)
    parent: dict | None  # the header of the kernel's request that ran the cell
    tails: dict = field(default_factory=dict)  # (rank, stream) -> unterminated line
    fold: LateFold = field(default_factory=LateFold)  # in a kernel
    lines: LateLines = field(default_factory=LateLines)  # in a script
    display_id: str | None = None  # once the kernel's display is published
    changed: bool = False  # lines came since the last redraw
    redraw_due: bool = False
    shown_at: float = float("-inf")  # time.monotonic() of the last drawing


class LateOutput:
    """The late output of one ipyparallel client's requests, shown where their cells were."""

    def __init__(self, client) -> None:
        """Tap ``client``'s IOPub stream (from the IO thread's next turn)."""
        # Weakly: this object is kept per client (late_output_of) and must not keep it.
        self._client = weakref.ref(client)
        self._lock = threading.Lock()
        self._cells: OrderedDict[int, _Cell] = OrderedDict()  # oldest first
        self._requests: dict[str, tuple[int, int]] = {}  # msg id -> (cell key, rank)
        self._cell_requests: dict[int, list[str]] = {}
        self._next_key = 0
        tap_late_iopub(client, self._on_message)

    def expect(self, requests: dict[str, int]) -> None:
        """Show what comes late for ``requests`` ({msg id: rank}) under the current cell.

        Called on the thread that sends the cell: in a kernel, its current parent
        header is the cell's.
        """
        kernel, parent = _current_cell()
        with self._lock:
            key = self._next_key
            self._next_key += 1
            self._cells[key] = _Cell(kernel, parent)
            self._cell_requests[key] = list(requests)
            for msg_id, rank in requests.items():
                self._requests[msg_id] = (key, rank)
            while len(self._cells) > KEPT_CELLS:
                old, _cell = self._cells.popitem(last=False)
                for msg_id in self._cell_requests.pop(old):
                    self._requests.pop(msg_id, None)

    def _on_message(self, msg: dict) -> None:
        # On the IO thread, for a request the client has let go.
        kind = msg["header"]["msg_type"]
        if kind not in ("stream", "display_data"):
            return
        with self._lock:
            found = self._requests.get(msg["parent_header"]["msg_id"])
            cell = None if found is None else self._cells.get(found[0])
        if cell is None:
            return  # a request of no cell, or of one forgotten: dropped (and freed)
        rank = found[1]
        content = msg["content"]
        if kind == "stream":
            stream = content.get("name", "stdout")
            stream = stream if stream in STREAMS else "stdout"
            lines = split_lines(cell.tails, rank, stream, content.get("text", ""))
        else:
            stream = "stdout"
            kinds = ", ".join(sorted(content.get("data", {}))) or "empty"
            lines = [f"<display: {kinds}> (published after the cell ended: not shown)"]
        # In a kernel a stream's unterminated end is drawn too (a progress bar's state):
        # a message that completed no line may still change the display.
        if not lines and (cell.kernel is None or kind != "stream"):
            return
        for line in lines:
            (cell.lines if cell.kernel is None else cell.fold).add(rank, stream, line)
        cell.changed = True
        client = self._client()
        if client is not None and not cell.redraw_due:
            cell.redraw_due = True
            delay = max(WINDOW_S, cell.shown_at + REDRAW_S - time.monotonic())
            io_call_later(client, delay, self._show, cell)

    def _show(self, cell: _Cell) -> None:
        # On the IO thread, WINDOW_S after the first line of a batch.
        cell.redraw_due = False
        if not cell.changed:
            return
        cell.changed = False
        cell.shown_at = time.monotonic()
        if cell.kernel is None:
            for stream, text in _joined(cell.lines.take()):
                out = sys.stdout if stream == "stdout" else sys.stderr
                out.write(text)
                out.flush()
            return
        kind = "display_data" if cell.display_id is None else "update_display_data"
        cell.display_id = cell.display_id or uuid.uuid4().hex
        # The kernel's iopub socket takes messages from any thread (ipyparallel relays
        # the ranks' widget messages the same way, from this same IO thread).
        cell.kernel.session.send(
            cell.kernel.iopub_socket,
            kind,
            {
                "data": {"text/plain": _kernel_text(cell)},
                "metadata": {},
                "transient": {"display_id": cell.display_id},
            },
            parent=cell.parent,
        )


def _kernel_text(cell: _Cell) -> str:
    """A kernel's display of ``cell``'s late output: its fold, then the lines being written."""
    return "\n".join([cell.fold.text().rstrip("\n"), *unfinished_lines(cell.tails)])


def _joined(items: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """Consecutive texts of one stream as one: one write per run."""
    out: list[tuple[str, str]] = []
    for stream, text in items:
        if out and out[-1][0] == stream:
            out[-1] = (stream, out[-1][1] + text)
        else:
            out.append((stream, text))
    return out


def _current_cell() -> tuple[Any, dict | None]:
    """The IPython kernel and the parent header of its request now running, or (None, None)."""
    if "IPython" not in sys.modules:
        return None, None
    from IPython import get_ipython

    shell = get_ipython()
    kernel = getattr(shell, "kernel", None)
    if kernel is None:
        return None, None
    return kernel, kernel.get_parent("shell")


_taps: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_taps_lock = threading.Lock()


def late_output_of(client) -> LateOutput:
    """The :class:`LateOutput` of ``client``, tapped on first use."""
    with _taps_lock:
        late = _taps.get(client)
        if late is None:
            late = _taps[client] = LateOutput(client)
        return late
