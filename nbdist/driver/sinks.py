"""Kernel side: where merged rank output goes (a list, the terminal, or a Jupyter cell).

:class:`~nbdist.driver.output.OutputMerger` hands each decision to a *sink*
(see :class:`Sink`). :class:`ListSink` records events (tests, scripts),
:class:`StreamSink` writes to ``sys.stdout``/``sys.stderr`` and
:class:`KernelSink` adds in-place progress bars and rich displays inside a
Jupyter kernel. IPython is imported lazily, by the sinks that need it.

How several ranks' lines read (``OutputMerger``'s ``fold``): a Jupyter cell can
redraw, so :class:`KernelSink` shows the lines folded across ranks in one
display updated in place while the cell runs (the latest lines), and when the
cell ends replaces it with the complete fold, written as the cell's ordinary
stdout/stderr: each distinct line once, with its ranks, whatever the ranks'
timing. A terminal cannot take back what it printed: :class:`StreamSink`
writes each line once, as soon as the ranks that printed it alike are grouped
(a rank later than ``window`` gets its own copy), and does not repeat it
folded; :func:`nbdist.output` has each rank's whole output either way.
"""

from __future__ import annotations

import sys
from typing import Any, Protocol

from nbdist.driver.output import STREAMS
from nbdist.driver.progress_bars import live_bar_lines
from nbdist.driver.widget_text import widget_model_id
from nbdist.errors import format_ranks

__all__ = ["KernelSink", "ListSink", "Sink", "StreamSink", "bar_lines", "default_sink"]

# Erase the terminal line the cursor is on, so a live progress bar drawn with
# "\r" is replaced by the next line instead of leaving its tail behind.
_CLEAR_LINE = "\r\x1b[K"
# Live bars of several ranks: at most this many lines (groups of ranks), then a count.
BARS_SHOWN = 8


class Sink(Protocol):
    """What :class:`OutputMerger` writes to (``progress_done``, ``display_update``, ``lines``,
    ``wants_lines`` and ``fold`` are optional: :mod:`nbdist.driver.output` says what each is)."""

    def line(self, stream: str, label: str, text: str) -> None:
        """A complete line of ``stream``, labelled (``label``: 'rank 1', 'ranks 0-3')."""

    def progress(self, stream: str, label: str, text: str) -> None:
        """The visible state of a ``\\r`` progress line still being drawn."""

    def display(self, label: str, data: dict, metadata: dict) -> None:
        """A rich display (a mimebundle), labelled."""


class ListSink:
    """Record the merger's events in :attr:`events` (for tests and scripts).

    Events are ``("line", stream, label, text)``, ``("progress", stream, label,
    text)``, ``("progress_done", stream, label)``, ``("display", label,
    data, metadata)`` and ``("display_update", label, data, metadata)`` (a
    widget display's latest text form, e.g. a tqdm bar at 100 %). The final
    folds (what a notebook cell shows when it ends) go to :attr:`folds`, one
    list of ``(stream, label, text)`` per part of the output.
    """

    def __init__(self) -> None:
        """An empty record."""
        self.events: list[tuple] = []
        self.folds: list[list[tuple[str, str, str]]] = []

    def fold(self, lines: list[tuple[str, str, str]], final: bool) -> None:
        """Record a final fold (live ones are not kept)."""
        if final:
            self.folds.append(list(lines))

    def line(self, stream: str, label: str, text: str) -> None:
        """Record a complete line."""
        self.events.append(("line", stream, label, text))

    def progress(self, stream: str, label: str, text: str) -> None:
        """Record a progress line's visible state."""
        self.events.append(("progress", stream, label, text))

    def progress_done(self, stream: str, label: str) -> None:
        """Record that a progress line finished."""
        self.events.append(("progress_done", stream, label))

    def display(self, label: str, data: dict, metadata: dict) -> None:
        """Record a rich display."""
        self.events.append(("display", label, data, metadata))

    def display_update(self, label: str, data: dict, metadata: dict) -> None:
        """Record a widget display's latest state."""
        self.events.append(("display_update", label, data, metadata))


def _std_stream(stream: str) -> Any:
    if stream not in STREAMS:
        raise ValueError(f"stream must be 'stdout' or 'stderr', got {stream!r}")
    # Looked up on every write, not kept: IPython and pytest swap sys.stdout
    # per cell / per test, and output must go to whichever is current.
    return getattr(sys, stream)


def _write(out: Any, text: str) -> None:
    out.write(text)
    flush = getattr(out, "flush", None)
    if flush is not None:
        flush()


def _isatty(out: Any) -> bool:
    try:
        return bool(out.isatty())
    except (AttributeError, ValueError, OSError):
        return False


class StreamSink:
    """Write ``[label] text`` lines to ``sys.stdout`` / ``sys.stderr``.

    Progress updates are drawn in place (``\\r``) on a terminal and dropped
    otherwise, where only the final line is written. A display is written as
    its ``text/plain`` form; a widget (a rank's tqdm bar) once it is final,
    from ``display_update``.
    """

    def __init__(self) -> None:
        """A sink on ``sys.stdout``/``sys.stderr``, no progress line drawn yet."""
        # Stream whose current terminal line holds a progress bar, to erase it
        # before anything else is written there (both streams usually share
        # one terminal, so one marker covers both).
        self._bar_stream: str | None = None

    def line(self, stream: str, label: str, text: str) -> None:
        """Write ``[label] text`` to the stream (after erasing a live bar)."""
        self._erase_bar()
        _write(_std_stream(stream), f"[{label}] {text}\n")

    def lines(self, stream: str, pairs: list[tuple[str, str]]) -> None:
        """Write ``[label] text`` for each of ``pairs`` with one write: 256 ranks' lines
        at a time flushed one by one cost a system call each on a terminal."""
        self._erase_bar()
        _write(_std_stream(stream), "".join(f"[{label}] {text}\n" for label, text in pairs))

    def progress(self, stream: str, label: str, text: str) -> None:
        """Redraw the live bar in place on a terminal; elsewhere show nothing until it ends."""
        out = _std_stream(stream)
        if not _isatty(out):
            return
        if self._bar_stream != stream:
            self._erase_bar()
        _write(out, f"{_CLEAR_LINE}[{label}] {text}")
        self._bar_stream = stream

    def progress_done(self, stream: str, label: str) -> None:
        """Erase the live bar: its final text follows as a line."""
        # Nothing to do: the final line that follows erases the bar.
        pass

    def display(self, label: str, data: dict, metadata: dict) -> None:
        """Print the display's text/plain, labelled; a widget's waits for its final state."""
        if widget_model_id(data) is None:
            self._print_display(label, data)

    def display_update(self, label: str, data: dict, metadata: dict) -> None:
        """Print a widget display's final text/plain (a tqdm bar: 100 %, n/total)."""
        if data.get("text/plain") != "":  # "": a bar that erased itself (leave=False)
            self._print_display(label, data)

    def _print_display(self, label: str, data: dict) -> None:
        text = data.get("text/plain")
        if text is None:
            text = f"<display: {', '.join(sorted(data))}>"
        for line in text.splitlines() or [""]:
            self.line("stdout", label, line)

    def _erase_bar(self) -> None:
        if self._bar_stream is not None:
            stream, self._bar_stream = self._bar_stream, None
            _write(_std_stream(stream), _CLEAR_LINE)


class KernelSink(StreamSink):
    """Sink for a Jupyter kernel: lines folded across ranks, in-place progress bars, rich displays.

    With several ranks, lines are shown from the merger's fold: live in one
    display updated in place (the latest lines), then, when the cell ends (or
    a rich display follows), as ordinary stdout/stderr text in which each
    distinct line appears once with its ranks; the live display is blanked.
    One rank's lines are written as they come, like :class:`StreamSink`. A
    ``\r`` progress line (a text tqdm bar) is drawn in place: one rank's in a
    display of its own, several ranks' together in one display (ranks whose bar
    reads the same, or a tqdm loop's, on one line, :func:`bar_lines`), redrawn once per
    pass of the merger; a bar is taken out when its final line is written, and the
    display blanked once none is left.
    Displays are republished as they are, after a ``[label]`` line when there
    are several ranks.
    """

    def __init__(self, n_ranks: int = 1) -> None:
        """A sink for a cell of ``n_ranks`` ranks (labels are shown only for several)."""
        super().__init__()
        self._n_ranks = n_ranks
        self._bars: dict[tuple[str, str], Any] = {}
        # widget model id -> (display handle, text/plain published) of a widget display
        self._widgets: dict[str, tuple[Any, Any]] = {}
        self._live: Any = None  # the display handle of the live fold, while there is one
        # Several ranks: each live bar's text by (label, stream), all in one display.
        self._bar_texts: dict[tuple[str, str], str] = {}
        self._bars_live: Any = None
        self._bars_changed = False  # a bar moved, began or ended since the last flush

    @property
    def wants_lines(self) -> bool:
        """One rank: lines are written as they come; several: the fold shows them."""
        return self._n_ranks <= 1

    def line(self, stream: str, label: str, text: str) -> None:
        """One rank: write the line now; several: nothing, the fold shows it."""
        if self._n_ranks <= 1:
            super().line(stream, label, text)

    def lines(self, stream: str, pairs: list[tuple[str, str]]) -> None:
        """One rank: write the lines now; several: nothing, the fold shows them."""
        if self._n_ranks <= 1:
            super().lines(stream, pairs)

    def fold(self, lines: list[tuple[str, str, str]], final: bool) -> None:
        """Draw the live fold in place; a final one replaces it as the cell's stdout/stderr."""
        if self._n_ranks <= 1:
            return  # its lines were written as they came
        text = "".join(f"[{label}] {line}\n" for _stream, label, line in lines)
        if not final:
            self._show_live({"text/plain": text.rstrip("\n")})
            return
        if self._live is not None:
            # The final text follows as the cell's own output: the live copy would repeat it.
            self._live.update({"text/plain": ""}, raw=True)
            self._live = None
        self._erase_bar()
        run: list[str] = []  # consecutive lines of one stream, written at once
        for i, (stream, label, line) in enumerate(lines):
            run.append(f"[{label}] {line}\n")
            if i + 1 == len(lines) or lines[i + 1][0] != stream:
                _write(_std_stream(stream), "".join(run))
                run = []

    def _show_live(self, data: dict) -> None:
        from IPython.display import display

        if self._live is None:
            self._live = display(data, raw=True, display_id=True)
        else:
            self._live.update(data, raw=True)

    def progress(self, stream: str, label: str, text: str) -> None:
        """Draw the bar in place in the cell (a display updated by id).

        Several ranks' bars share one display, one line per loop (:func:`bar_lines`):
        a display can be blanked but not removed, and one per rank left as many empty
        outputs in the saved notebook (256 at 256 ranks) and as many live lines. That
        display is redrawn once per pass of the merger (:meth:`progress_flush`), not once
        per rank: 256 ranks' bars moving in one pass made 256 redraws of it.
        """
        from IPython.display import display

        if self._n_ranks > 1:
            self._bar_texts[(label, stream)] = text
            self._bars_changed = True
            return
        data = {"text/plain": f"[{label}] {text}"}
        handle = self._bars.get((label, stream))
        if handle is None:
            handle = display(data, raw=True, display_id=True)
            if handle is not None:
                self._bars[(label, stream)] = handle
        else:
            handle.update(data, raw=True)

    def progress_done(self, stream: str, label: str) -> None:
        """Clear the in-place bar: its final text follows as a line."""
        if self._bar_texts.pop((label, stream), None) is not None:
            self._bars_changed = True
            return
        handle = self._bars.pop((label, stream), None)
        if handle is not None:
            # The final text arrives as an ordinary (possibly grouped) line, so
            # the live bar would only duplicate it.
            handle.update({"text/plain": ""}, raw=True)

    def progress_flush(self) -> None:
        """Several ranks: redraw their bars' display if a bar changed since the last flush."""
        if self._bars_changed:
            self._bars_changed = False
            self._show_bars()

    def _show_bars(self) -> None:
        from IPython.display import display

        if not self._bar_texts:
            if self._bars_live is not None:
                # Their final text follows as ordinary (grouped) lines.
                self._bars_live.update({"text/plain": ""}, raw=True)
                self._bars_live = None
            return
        data = {"text/plain": bar_lines(self._bar_texts)}
        if self._bars_live is None:
            self._bars_live = display(data, raw=True, display_id=True)
        else:
            self._bars_live.update(data, raw=True)

    def display(self, label: str, data: dict, metadata: dict) -> None:
        """Publish the display in the cell, after its rank's label when several ranks run."""
        from IPython.display import publish_display_data

        text = data.get("text/plain")
        if set(data) == {"text/plain"} and isinstance(text, str) and "\n" not in text:
            # A plain value (a cell's last expression): one labelled line reads best.
            _write(sys.stdout, f"[{label}] {text}\n")
            return
        if self._n_ranks > 1:
            _write(sys.stdout, f"[{label}]\n")
        model_id = widget_model_id(data)
        if model_id is None:
            publish_display_data(data, metadata)
            return
        from IPython.display import display

        # With an id, so that its text/plain can follow the bar (display_update).
        handle = display(data, raw=True, metadata=metadata, display_id=True)
        if handle is not None:
            self._widgets[model_id] = (handle, text)

    def display_update(self, label: str, data: dict, metadata: dict) -> None:
        """Give a widget display its latest text/plain (what a saved notebook shows)."""
        model_id = widget_model_id(data)
        handle, shown = self._widgets.pop(model_id, (None, None))
        if handle is None or data.get("text/plain") == shown:
            return
        if data.get("text/plain") == "":
            # The widget was closed (tqdm leave=False): nothing stays, live or saved.
            handle.update({"text/plain": ""}, raw=True)
        else:
            # The same model: a notebook keeps showing the widget, live.
            handle.update(data, raw=True, metadata=metadata)


def bar_lines(bars: dict[tuple[str, str], str], shown: int = BARS_SHOWN) -> str:
    """Live progress bars as lines: one per loop, lowest rank first.

    ``bars``: text by (label, stream), a label being ``"rank N"``. The ranks' tqdm bars
    of one loop make one line at the slowest rank's count
    (:func:`~nbdist.driver.progress_bars.live_bar_lines`); other text groups the ranks
    whose bar reads the same. Past ``shown`` lines, a count of the ranks left out.

    >>> print(bar_lines({("rank 0", "stderr"): "50%", ("rank 1", "stderr"): "50%",
    ...                  ("rank 2", "stderr"): "25%"}))
    [ranks 0-1] 50%
    [rank 2] 25%
    """
    by_stream: dict[str, dict[int, str]] = {}
    others: list[tuple[str, str, str]] = []  # labels that name no single rank
    for (label, stream), text in bars.items():
        number = label.rpartition(" ")[2]
        if label.startswith("rank ") and number.isdigit():
            by_stream.setdefault(stream, {})[int(number)] = text
        else:
            others.append((label, stream, text))
    lines = [
        (ranks[0], format_ranks(ranks), text, len(ranks))
        for stream_bars in by_stream.values()
        for ranks, text in live_bar_lines(stream_bars)
    ]
    lines.sort(key=lambda line: line[0])
    lines += [(-1, label, text, 1) for label, _stream, text in others]
    out = [f"[{labels}] {text}" for _first, labels, text, _n in lines[:shown]]
    rest = sum(n for *_x, n in lines[shown:])
    if rest:
        out.append(f"... and {rest} more rank{'s' if rest > 1 else ''}' bars")
    return "\n".join(out)


def _in_ipython_kernel() -> bool:
    # A kernel has necessarily imported IPython already; checking first avoids
    # paying IPython's import time in plain scripts.
    if "IPython" not in sys.modules:
        return False
    from IPython import get_ipython

    shell = get_ipython()
    return shell is not None and getattr(shell, "kernel", None) is not None


def default_sink(n_ranks: int) -> StreamSink:
    """:class:`KernelSink` inside an IPython kernel, else :class:`StreamSink`."""
    if _in_ipython_kernel():
        return KernelSink(n_ranks)
    return StreamSink()
