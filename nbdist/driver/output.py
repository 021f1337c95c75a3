"""Kernel side: merge the output of several ranks into one live, rank-labelled view.

When a cell runs on several ranks, every rank's stdout/stderr arrives in
arbitrary chunks (partial lines, many lines at once, ``\\r`` progress updates).
:class:`OutputMerger` turns those chunks into whole lines, labels each with the
rank that printed it and shows a line that every rank printed identically only
once (``[ranks 0-3] loss 0.25``). It is pure logic driven by a polling loop: it
owns no thread and never sleeps; time comes from an injectable clock.

Grouping by arrival depends on timing: a rank that prints a moment later than
the others gets a line of its own. So every line also goes into a
:class:`~nbdist.driver.output_fold.LineFold`, which groups by content whatever
the timing; a sink that can redraw (a Jupyter cell) shows that fold live and
replaces it with the complete fold when the cell ends (``fold``, below). A
rich display ends a fold's part (the lines before it are final), so text and
displays keep their order.

What the merger decides is handed to a *sink*, a duck-typed object with:

``line(stream, label, text)``
    A complete line of ``stream`` ("stdout" or "stderr").
``progress(stream, label, text)``
    The visible state of a ``\\r`` progress line (a tqdm bar) still being drawn.
``display(label, data, metadata)``
    A rich display (a mimebundle).
``progress_done(stream, label)``, optional
    The progress line last shown for ``label`` is finished; its final text
    follows as an ordinary ``line``. Sinks that draw progress in place use it
    to clear the live bar.
``progress_flush()``, optional
    The ``progress`` and ``progress_done`` calls of one pass of the merger are all
    made: a sink that draws several ranks' bars in one display redraws it here, once.
``display_update(label, data, metadata)``, optional
    A widget display shown before (same ``model_id``), with the ``text/plain``
    of its latest state: a rank's ``tqdm.auto`` bar as tqdm would print it
    (``ep: 100%|██████████| 5/5 [...]``), rebuilt from the widget's comm
    messages (:meth:`OutputMerger.feed_comm`, :mod:`nbdist.driver.widget_text`).
    Sent once per widget display: when the bar closes, else when the cell ends.
``lines(stream, pairs)``, optional
    Several complete lines of ``stream`` at once, ``pairs`` of ``(label, text)`` in
    order: what one pass of the merger emits, so a sink that writes to a stream writes
    (and flushes) once per pass, not once per line. Without it, ``line`` for each.
``wants_lines``, optional
    False when the sink shows only the fold (``line`` would drop every line): the
    merger then skips grouping each line by arrival. Read once, when the merger is made.
``fold(lines, final)``, optional
    The lines so far folded across ranks (:mod:`nbdist.driver.output_fold`),
    as ``(stream, label, text)``: while the cell runs (``final=False``, at most
    every ``LIVE_FOLD_S`` once the part is ``LIVE_FOLD_AFTER_S`` old, the latest
    lines only) and once per part of the
    cell's output (``final=True``: complete, at most
    :func:`~nbdist.driver.output_fold.lines_per_rank` lines of each rank), when
    the cell ends or before a rich display. A sink that shows it draws its
    lines from it and may ignore ``line``.

:class:`ListSink` records events (tests, scripts), :class:`StreamSink` writes to
``sys.stdout``/``sys.stderr`` and :class:`KernelSink` adds in-place progress
bars and rich displays inside a Jupyter kernel; they live in
:mod:`nbdist.driver.sinks`. This module needs only the standard library.
"""

from __future__ import annotations

import re
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

from nbdist.driver.output_fold import LineFold, fold_key, lines_per_rank
from nbdist.driver.progress_bars import is_bar_key, merge_bars
from nbdist.driver.widget_text import WidgetTexts, widget_model_id
from nbdist.errors import format_ranks

__all__ = ["LIVE_FOLD_AFTER_S", "LIVE_FOLD_LINES", "LIVE_FOLD_S", "STREAMS", "OutputMerger"]

STREAMS = ("stdout", "stderr")
_DISPLAY = "display"
_CHANNELS = (*STREAMS, _DISPLAY)
# The live fold: redrawn at most this often, with at most this many lines (each
# redraw resends its whole text to the browser, so both bound the cost); first drawn
# once a part of the output is this old, so a short cell shows only its final fold.
LIVE_FOLD_S = 0.25
LIVE_FOLD_LINES = 200
LIVE_FOLD_AFTER_S = 1.0
# torch.profiler (kineto) prints these two on stderr at every start and stop of a
# profile (torch >= 2.13), nbdist.profile's included: noise in the cell, left out.
_TORCH_PROFILER_NOISE = re.compile(
    r"^USDT:\S+ \S+ \d+:\d+ SyncActivityProfilerHandler\.cpp:\d+\] profiler_(?:start|stop)$"
)


def _visible_text(raw: str) -> str:
    """The text a terminal would show for a line containing ``\\r``.

    ``\\r`` returns the cursor to column 0 and later text overwrites the line,
    so the last non-empty ``\\r`` segment is what stays visible (progress bars
    pad their updates, so overwritten leftovers are not a concern). A trailing
    ``\\r``, such as the CR of a CRLF ending, overwrites nothing.
    """
    return raw.rstrip("\r").rpartition("\r")[2]


def _compact_tail(tail: str) -> str:
    """Shrink an unterminated line to what still matters for its visible text.

    A tqdm bar redraws the same line thousands of times without a newline;
    keeping only the visible segment (plus the "\\r" markers that affect how
    the next chunk combines with it) keeps memory flat.
    """
    if "\r" not in tail:
        return tail
    return "\r" + _visible_text(tail) + ("\r" if tail.endswith("\r") else "")


def _rank_label(rank: int) -> str:
    return format_ranks([rank])


class _LineState:
    """The unterminated line of one (rank, stream) and its progress display."""

    __slots__ = ("tail", "progress_shown")

    def __init__(self) -> None:
        self.tail = ""
        # Visible text last sent to sink.progress for the current line, or None
        # when no progress was shown for it.
        self.progress_shown: str | None = None


class OutputMerger:
    """Merge chunked per-rank output into labelled lines, grouping identical ones.

    Lines wait (at most ``window`` seconds) until every rank has a line at the
    same position of a stream; the heads are then grouped by identical text and
    each group is emitted once, labelled with its ranks, groups in order of
    their lowest rank. A line older than ``window`` is emitted without waiting
    for ranks that have printed nothing, so a silent rank never stalls live
    output. Lines of one rank's stream are never reordered.

    Call :meth:`feed`/:meth:`feed_display` as output arrives, :meth:`poll`
    periodically (every ~50 ms) and :meth:`close` once the cell has finished.
    """

    def __init__(
        self,
        ranks: Sequence[int],
        sink: Any,
        *,
        window: float = 0.15,
        clock: Callable[[], float] = time.monotonic,
        per_rank: int | None = None,
    ) -> None:
        """Merge the output of ``ranks`` into ``sink``; ``window``: seconds a line waits for the other ranks' lines.

        ``per_rank``: lines of one rank a final fold keeps (None:
        :func:`~nbdist.driver.output_fold.lines_per_rank`, 0: all).
        """
        self._ranks = tuple(sorted(set(ranks)))
        if not self._ranks:
            raise ValueError("OutputMerger needs at least one rank")
        if window < 0:
            raise ValueError(f"window must be >= 0, got {window!r}")
        self._sink = sink
        self._window = window
        self._clock = clock
        self._lines = {(rank, stream): _LineState() for rank in self._ranks for stream in STREAMS}
        # channel -> rank -> queue of (time the item became complete, item)
        self._queues: dict[str, dict[int, deque[tuple[float, Any]]]] = {
            channel: {rank: deque() for rank in self._ranks} for channel in _CHANNELS
        }
        # (rank, stream) whose progress line changed since the last poll; only
        # these are looked at, so polling costs nothing when no bar is running.
        self._progress_pending: set[tuple[int, str]] = set()
        self._widgets = {rank: WidgetTexts() for rank in self._ranks}
        # (rank, model id) -> (label, data, metadata) of a widget display shown
        # and not yet given its text form (display_update).
        self._widget_displays: dict[tuple[int, str], tuple[str, dict, dict]] = {}
        # Per channel: how many ranks have something queued, and the time of the
        # oldest queued item (None: not known since the last emission). With them a
        # line fed costs O(1), not a look at every rank's queue: at 256 ranks that
        # look was most of the kernel's time per line.
        self._filled = dict.fromkeys(_CHANNELS, 0)
        self._oldest: dict[str, float | None] = dict.fromkeys(_CHANNELS)
        self._per_rank = lines_per_rank() if per_rank is None else per_rank
        # The cell's lines folded by content: one LineFold per part (a rich display
        # starts a new one); the last is the part still being written.
        self._folds = [LineFold()]
        self._wants_lines = getattr(sink, "wants_lines", True)
        self._sink_lines = getattr(sink, "lines", None)
        self._labels = {rank: _rank_label(rank) for rank in self._ranks}
        self._fold_shown = (0, -1.0)  # (version, time) of the last live fold sent
        self._fold_started: float | None = None  # when the current part's first line came

    @property
    def ranks(self) -> tuple[int, ...]:
        """The ranks whose output is merged, sorted."""
        return self._ranks

    def rank_output(self, rank: int, stream: str | None = None) -> str:
        """``rank``'s whole lines so far, as it printed them (``stream``: one of them, None: both)."""
        self._check_rank(rank)
        lines = [line for fold in self._folds for line in fold.rank_lines(rank, stream)]
        return "".join(line + "\n" for line in lines)

    def feed(self, rank: int, stream: str, text: str) -> None:
        """Take a raw chunk of ``rank``'s ``stream`` ("stdout" or "stderr")."""
        state = self._line_state(rank, stream)
        if not text:
            return
        now = self._clock()
        *complete, tail = (state.tail + text).split("\n")
        state.tail = _compact_tail(tail)
        if complete:
            for raw in complete:
                # Every rank's every line passes here: the regex only for lines it can match.
                if (
                    stream == "stderr"
                    and raw.startswith("USDT:")
                    and _TORCH_PROFILER_NOISE.match(raw.rstrip("\r"))
                ):
                    continue
                self._enqueue(stream, rank, (now, _visible_text(raw) if "\r" in raw else raw))
            self._progress_pending.discard((rank, stream))
            self._end_progress(rank, stream, state)
        if "\r" in state.tail:
            self._progress_pending.add((rank, stream))
        self._drain(stream, now)

    def feed_display(self, rank: int, data: dict, metadata: dict | None = None) -> None:
        """Take a rich display (a mimebundle) published by ``rank``."""
        self._check_rank(rank)
        now = self._clock()
        item = (data, metadata if metadata is not None else {})
        self._enqueue(_DISPLAY, rank, (now, item))
        self._drain(_DISPLAY, now)

    def feed_comm(self, rank: int, msg_type: str, content: dict) -> None:
        """Take a comm message (a widget's state) published by ``rank``."""
        self._check_rank(rank)
        self._widgets[rank].feed(msg_type, content)

    def poll(self) -> None:
        """Emit what is due: progress updates and lines that waited long enough."""
        now = self._clock()
        self._show_progress()
        for channel in _CHANNELS:
            self._drain(channel, now)
        self._update_widgets(final=False)
        self._show_live_fold(now)

    def close(self) -> None:
        """Flush everything still pending, unterminated last lines included.

        Queued items are grouped position by position among the ranks that
        still have some; the lines so far go to the sink folded (``fold``, final).
        The merger is empty afterwards and may be reused (:meth:`rank_output`
        still has every line).
        """
        now = self._clock()
        self.end_lines()
        for channel in _CHANNELS:
            self._drain(channel, now, final=True)
        self._end_fold()
        self._update_widgets(final=True)

    def end_lines(self) -> None:
        """Once every rank has ended: emit every line, unterminated last lines (a progress
        bar's) included, and those still waiting for other ranks to fold them (a line only
        some ranks printed), grouped among the ranks that have them. What comes next, the
        cell's value, goes after them, as in a kernel of its own.

        (Not at a display mid-cell: a rank's lines and displays are read per stream, so
        lines it printed after a display may be here before it.)"""
        now = self._clock()
        self._progress_pending.clear()
        for (rank, stream), state in self._lines.items():
            self._end_progress(rank, stream, state)
            if not state.tail:
                continue
            text = _visible_text(state.tail)
            # A bar erased with "\r   \r" (tqdm leave=False) leaves only blanks:
            # nothing was meant to stay on screen.
            if text and ("\r" not in state.tail or text.strip()):
                self._enqueue(stream, rank, (now, text))
            state.tail = ""
        self._flush_progress()
        for stream in STREAMS:
            self._drain(stream, now, final=True)

    # -- internals -------------------------------------------------------------

    def _check_rank(self, rank: int) -> None:
        if rank not in self._queues[_DISPLAY]:
            raise ValueError(f"rank {rank!r} is not merged here ({format_ranks(self._ranks)})")

    def _line_state(self, rank: int, stream: str) -> _LineState:
        if stream not in STREAMS:
            raise ValueError(f"stream must be 'stdout' or 'stderr', got {stream!r}")
        self._check_rank(rank)
        return self._lines[(rank, stream)]

    def _show_progress(self) -> None:
        for rank, stream in sorted(self._progress_pending):
            state = self._lines[(rank, stream)]
            text = _visible_text(state.tail)
            if text != (state.progress_shown or ""):
                self._sink.progress(stream, self._labels[rank], text)
                state.progress_shown = text
        self._progress_pending.clear()
        self._flush_progress()

    def _flush_progress(self) -> None:
        flush = getattr(self._sink, "progress_flush", None)
        if flush is not None:
            flush()

    def _show_live_fold(self, now: float) -> None:
        fold = self._folds[-1]
        version, shown_at = self._fold_shown
        if not fold.version or fold.version == version or now - shown_at < LIVE_FOLD_S:
            return
        if self._fold_started is None or now - self._fold_started < LIVE_FOLD_AFTER_S:
            return
        show = getattr(self._sink, "fold", None)
        if show is not None:
            show(fold.tail(LIVE_FOLD_LINES), final=False)
        self._fold_shown = (fold.version, now)

    def _end_fold(self) -> None:
        """The current part's lines are final: hand them over folded, start a new part."""
        fold = self._folds[-1]
        if not len(fold):
            return
        show = getattr(self._sink, "fold", None)
        if show is not None:
            show(fold.render(self._per_rank), final=True)
        self._folds.append(LineFold())
        self._fold_shown = (0, -1.0)
        self._fold_started = None

    def _end_progress(self, rank: int, stream: str, state: _LineState) -> None:
        if state.progress_shown is None:
            return
        state.progress_shown = None
        progress_done = getattr(self._sink, "progress_done", None)
        if progress_done is not None:
            progress_done(stream, self._labels[rank])

    def _update_widgets(self, *, final: bool) -> None:
        """Give each widget display whose bar closed (all of them if final) its text form."""
        if not self._widget_displays:
            return
        update = getattr(self._sink, "display_update", None)
        for (rank, model_id), (label, data, metadata) in list(self._widget_displays.items()):
            texts = self._widgets[rank]
            if not final and not texts.finished(model_id):
                continue
            del self._widget_displays[(rank, model_id)]
            text = texts.text(model_id)
            if update is not None:
                update(label, data if text is None else {**data, "text/plain": text}, metadata)

    def _emit_lines(self, stream: str, pairs: list[tuple[str, str]]) -> None:
        if self._sink_lines is not None:
            self._sink_lines(stream, pairs)
            return
        for label, text in pairs:
            self._sink.line(stream, label, text)

    def _enqueue(self, channel: str, rank: int, item: tuple[float, Any]) -> None:
        queue = self._queues[channel][rank]
        if not queue:
            self._filled[channel] += 1
        queue.append(item)

    def _drain(self, channel: str, now: float, *, final: bool = False) -> None:
        """Emit every group of ``channel`` that is ready (all of them if final)."""
        queues = self._queues[channel]
        while True:
            if not self._filled[channel]:
                return
            if self._filled[channel] == len(self._ranks):
                ready = self._ranks
            elif final:
                ready = tuple(rank for rank in self._ranks if queues[rank])
            else:
                oldest = self._oldest[channel]
                if oldest is None:
                    oldest = min(queues[rank][0][0] for rank in self._ranks if queues[rank])
                    self._oldest[channel] = oldest
                if now - oldest < self._window:
                    return
                ready = tuple(
                    rank
                    for rank in self._ranks
                    if queues[rank] and now - queues[rank][0][0] >= self._window
                )
            heads = [(rank, queues[rank].popleft()[1]) for rank in ready]
            self._filled[channel] -= sum(1 for rank in ready if not queues[rank])
            self._oldest[channel] = None
            if channel == _DISPLAY:
                self._end_fold()  # the lines before a display stay before it
                for group, (data, metadata) in _group_displays(heads):
                    label = format_ranks(group)
                    self._sink.display(label, data, metadata)
                    model_id = widget_model_id(data)
                    if model_id is not None:
                        for rank in group:
                            self._widget_displays[(rank, model_id)] = (label, data, metadata)
            else:
                fold = self._folds[-1]
                if self._fold_started is None:
                    self._fold_started = now
                # Every rank's every line passes here: its key is made once, for both uses.
                keyed = [(rank, text, fold_key(text)) for rank, text in heads]
                add = fold.add
                for rank, text, key in keyed:
                    add(rank, channel, text, key)
                if self._wants_lines:
                    labels = self._labels
                    pairs = [
                        (labels[group[0]] if len(group) == 1 else format_ranks(group), text)
                        for group, text in _group_lines(keyed)
                    ]
                    self._emit_lines(channel, pairs)


def _group_lines(heads: list[tuple[int, str, str]]) -> list[tuple[list[int], str]]:
    """Group (rank, text, key) triples by key: text, a library's prefix aside (:func:`fold_key`).

    ``heads`` is in rank order; the lowest rank's text stands for its group, and a tqdm
    bar's group reads with its ranks' timings as ranges (:func:`merge_bars`).
    """
    groups: dict[str, tuple[list[int], list[str]]] = {}
    for rank, text, key in heads:
        ranks, texts = groups.setdefault(key, ([], []))
        ranks.append(rank)
        texts.append(text)
    return [
        (ranks, merge_bars(texts) if len(ranks) > 1 and is_bar_key(key) else texts[0])
        for key, (ranks, texts) in groups.items()
    ]


def _group_displays(heads: list[tuple[int, tuple[dict, dict]]]) -> list[tuple[list[int], Any]]:
    """Group (rank, (data, metadata)) pairs by equal ``data``.

    Mimebundles are unhashable dicts, hence the linear scan; the first (lowest)
    rank's metadata represents its group.
    """
    groups: list[tuple[list[int], tuple[dict, dict]]] = []
    for rank, item in heads:
        for ranks, first in groups:
            if first[0] == item[0]:
                ranks.append(rank)
                break
        else:
            groups.append(([rank], item))
    return groups
