"""Kernel side: fold one cell's lines across ranks, each distinct line once with its ranks.

Ranks print at their own pace, so a line every rank prints reaches the kernel
spread over time; grouping by arrival splits it into several labelled copies
(``[ranks 22,25] epoch 1 done`` ... ``[ranks 0-21,23-24,...] epoch 1 done``).
:class:`LineFold` groups by content instead: the *n*-th occurrence of a text on
one rank joins the *n*-th occurrence of the same text on every other rank,
whenever each arrives, so ``for e in range(3): print('epoch', e, 'done')`` on
256 ranks folds to three lines, ``[ranks 0-255] epoch 1 done``. Lines that
differ only in a library's timestamp or process prefix fold too
(:func:`fold_key`: the rank's own ``/tmp/ipykernel_<pid>/<hash>.py`` cell file in a
warning or traceback, torch's c10d/glog ``[W1128 08:32:42.606441197 socket.cpp:207]``,
NCCL's ``host:pid:tid [0] NCCL``, gloo's ``[Gloo] Rank 3``, torch's ``[rank3]:``,
logging timestamps); the lowest rank's text stands for its group. A tqdm bar's
final line folds with the other ranks' bars at the same count whatever their
timings, which the folded line shows as ranges
(:mod:`nbdist.driver.progress_bars`: ``[ranks 0-255] epoch: 100%|██████████| 30/30
[00:00–00:01<00:00, 15.92–48.30it/s]``).

:meth:`LineFold.render` orders the distinct lines so that every rank's own
lines keep their order, and keeps at most ``per_rank`` lines of each rank (its
latest), saying how many earlier lines were left out and how to read them
(:func:`nbdist.output`). :meth:`LineFold.tail` is the cheap live form: the
latest distinct lines in order of first appearance. Pure logic, standard
library only.
"""

from __future__ import annotations

import heapq
import os
import re

from nbdist.driver.progress_bars import bar_key, is_bar_key, merge_bars
from nbdist.errors import format_ranks

__all__ = ["DEFAULT_LINES_PER_RANK", "LineFold", "fold_key", "lines_per_rank"]

# Lines of one rank kept in a cell's folded output (its latest); NBDIST_OUTPUT_LINES.
DEFAULT_LINES_PER_RANK = 1000

# (pattern, replacement) applied in order to the start of a line: what a library
# puts in front of its message that differs from rank to rank but says nothing
# about the message (when, which process). Anchored, so a line costs one failed
# match per pattern when it has none of them.
_PREFIXES = [
    # torch's rank prefix on its own warnings: "[rank3]:[W1128 ...] ..."
    (re.compile(r"^\[rank\d+\]:"), ""),
    # torch (c10d, ProcessGroupNCCL...): "[W1128 08:32:42.606441197 socket.cpp:207]",
    # sometimes with a thread id before the file.
    (re.compile(r"^\[([IWEF])\d{4} \d\d:\d\d:\d\d\.\d+(?: \d+)? "), r"[\1 "),
    # glog itself: "W1128 08:32:42.606441 12345 file.cc:123] "
    (re.compile(r"^([IWEF])\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ "), r"\1 "),
    # NCCL: "node1:12345:12367 [0] NCCL INFO ..."
    (re.compile(r"^[^\s:]+:\d+:\d+ \[\d+\] NCCL "), "NCCL "),
    # gloo: "[Gloo] Rank 3 is connected to 255 peer ranks. ..."
    (re.compile(r"^\[Gloo\] Rank \d+ "), "[Gloo] Rank * "),
    # logging: "2026-11-28 08:32:42,606 ...", "[2026-11-28 08:32:42.606] ...", "11/28/2026 08:32:42 - ..."
    (
        re.compile(r"^\[?(?:\d{4}-\d\d-\d\d[ T]|\d\d/\d\d/\d{4} )\d\d:\d\d:\d\d(?:[.,]\d+)?\]?"),
        "<time>",
    ),
]

# One look for any of them: a line that starts with a digit or "[" (a number, a list, a
# rank's own "[step 3]") usually has none, and six failed substitutions cost more than
# one failed match.
_ANY_PREFIX = re.compile("|".join(f"(?:{pattern.pattern})" for pattern, _ in _PREFIXES))
_PREFIX_STARTS = frozenset("[IWEF0123456789")
# Anywhere in a line: the file ipykernel compiles a cell to, "/tmp/ipykernel_14322/276219731.py"
# (a warning's "<file>:2: UserWarning: ...", a traceback's 'File "<file>", line 2'). The
# folder names the rank's process and the file a hash of the cell: both differ across ranks.
_CELL_FILE = re.compile(r"(?:[^\s\"':]*[/\\])?ipykernel_\d+[/\\]\d+\.py")
_CELL_FILE_MASK = "<ipykernel cell>.py"
# Recent lines' keys: the same line from many ranks is looked at once.
_keys: dict[str, str] = {}
_KEYS_KEPT = 4096


def fold_key(text: str) -> str:
    """What ``text`` is compared by: a library's timestamp/process prefix and cell file masked.

    The cell file is the path ipykernel compiles a rank's cell to
    (``/tmp/ipykernel_<pid>/<hash>.py``), named in warnings and tracebacks.

    >>> fold_key("[W1128 08:32:42.606441197 socket.cpp:207] [c10d] The hostname ...")
    '[W socket.cpp:207] [c10d] The hostname ...'
    >>> fold_key("/tmp/ipykernel_14322/276219731.py:2: UserWarning: careful now")
    '<ipykernel cell>.py:2: UserWarning: careful now'
    >>> fold_key("epoch 1 done")
    'epoch 1 done'

    A tqdm bar's timing is masked (:func:`~nbdist.driver.progress_bars.bar_key`).
    """
    key = _keys.get(text)
    if key is None:
        key = text
        # Every prefix starts with "[", a digit, a glog level letter, or is NCCL's:
        # most lines skip the patterns after one look at their first character.
        if (text[:1] in _PREFIX_STARTS or " NCCL " in text) and _ANY_PREFIX.match(text):
            for pattern, replacement in _PREFIXES:
                key = pattern.sub(replacement, key, count=1)
        if "ipykernel_" in key:
            key = _CELL_FILE.sub(_CELL_FILE_MASK, key)
        if key.endswith("]"):
            key = bar_key(key) or key
        if len(_keys) >= _KEYS_KEPT:
            _keys.clear()
        _keys[text] = key
    return key


def lines_per_rank() -> int:
    """Lines of one rank a cell's folded output keeps (``NBDIST_OUTPUT_LINES``; 0 = all)."""
    value = os.environ.get("NBDIST_OUTPUT_LINES", "").strip()
    if not value:
        return DEFAULT_LINES_PER_RANK
    try:
        number = int(value)
    except ValueError:
        raise ValueError(
            f"NBDIST_OUTPUT_LINES must be a whole number of lines (0: all), got {value!r}"
        ) from None
    if number < 0:
        raise ValueError(f"NBDIST_OUTPUT_LINES must be 0 (all) or more, got {number}")
    return number


class _Entry:
    """One distinct line: the ranks that printed it and where it first appeared."""

    __slots__ = ("bars", "index", "label", "low", "merged", "ranks", "seq", "stream", "text")

    def __init__(self, stream: str, text: str, seq: int, index: int) -> None:
        self.stream = stream
        self.text = text  # the lowest rank's text stands for the group
        self.seq = seq  # order of first appearance
        self.index = index  # the lowest position among its ranks' own lines
        self.ranks: list[int] = []
        self.low = -1  # the lowest of ranks (none yet)
        self.label: str | None = None  # format_ranks(ranks), cached until a rank joins
        # A tqdm bar's: every rank's text (their timings differ), and their merge, cached.
        self.bars: list[str] | None = None
        self.merged: str | None = None

    def shown(self) -> str:
        """The text that stands for the group: a bar's with its ranks' timings as ranges."""
        if self.bars is None:
            return self.text
        if self.merged is None:
            self.merged = merge_bars(self.bars)
        return self.merged

    def labelled(self) -> str:
        if self.label is None:
            self.label = format_ranks(self.ranks)
        return self.label

    def sort_key(self) -> tuple[int, int, int]:
        return (self.index, self.low, self.seq)


class LineFold:
    """The lines of one cell (or one part of it) folded across ranks.

    Feed whole lines with :meth:`add` in each rank's own order; read the folded
    view with :meth:`tail` (live) or :meth:`render` (when the cell ends).
    """

    def __init__(self) -> None:
        """An empty fold."""
        self._entries: list[_Entry] = []
        self._by_key: dict[tuple[str, str, int], _Entry] = {}
        self._seen: dict[tuple[int, str, str], int] = {}  # (rank, stream, key) -> occurrences
        self._per_rank: dict[int, list[tuple[_Entry, str]]] = {}  # rank -> (entry, own text)
        self.version = 0  # grows with every line added

    def __len__(self) -> int:
        """Distinct lines so far."""
        return len(self._entries)

    def add(self, rank: int, stream: str, text: str, key: str | None = None) -> None:
        """Take ``rank``'s next whole line of ``stream`` (``key``: its :func:`fold_key`, if known)."""
        if key is None:
            key = fold_key(text)
        count_key = (rank, stream, key)
        occurrence = self._seen.get(count_key, 0)
        self._seen[count_key] = occurrence + 1
        own = self._per_rank.setdefault(rank, [])
        entry = self._by_key.get((stream, key, occurrence))
        if entry is None:
            entry = _Entry(stream, text, len(self._entries), len(own))
            if is_bar_key(key):
                entry.bars = [text]
            self._entries.append(entry)
            self._by_key[(stream, key, occurrence)] = entry
        else:
            if entry.bars is not None:
                entry.bars.append(text)
                entry.merged = None
            entry.index = min(entry.index, len(own))
            entry.label = None
            if text == entry.text:
                text = entry.text  # one string object for identical lines
            elif rank < entry.low:
                entry.text = text  # the lowest rank's, whatever the order they came in
        entry.ranks.append(rank)
        if entry.low < 0 or rank < entry.low:
            entry.low = rank
        own.append((entry, text))
        self.version += 1

    def rank_lines(self, rank: int, stream: str | None = None) -> list[str]:
        """``rank``'s own lines as it printed them (of ``stream``, or both in arrival order)."""
        return [
            text
            for entry, text in self._per_rank.get(rank, ())
            if stream is None or entry.stream == stream
        ]

    def tail(self, limit: int) -> list[tuple[str, str, str]]:
        """The latest ``limit`` distinct lines as ``(stream, label, text)``, in order of first appearance.

        Costs O(``limit``), not O(lines): the live view calls it while the cell runs.
        When lines were left out, a first line says how many.
        """
        shown = self._entries[-limit:] if limit else []
        lines = [(e.stream, e.labelled(), e.shown()) for e in shown]
        hidden = len(self._entries) - len(shown)
        if hidden:
            note = f"… {hidden:,} earlier lines, all shown when the cell ends"
            lines.insert(0, ("stdout", format_ranks(self._per_rank), note))
        return lines

    def render(self, per_rank: int = 0) -> list[tuple[str, str, str]]:
        """Every distinct line once as ``(stream, label, text)``, each rank's own lines in order.

        ``per_rank``: keep at most this many lines of each rank, its latest (0: all);
        a rank's earlier lines left out are counted in a first line per group of
        ranks with the same count, which names :func:`nbdist.output`.
        """
        order = self._ordered()
        if not per_rank:
            return [(e.stream, e.labelled(), e.shown()) for e in order]
        kept: set[int] = set()
        for own in self._per_rank.values():
            kept.update(id(entry) for entry, _ in own[-per_rank:])
        shown = [e for e in order if id(e) in kept]
        hidden_of: dict[int, list[int]] = {}
        for rank, own in self._per_rank.items():
            hidden = sum(1 for entry, _ in own if id(entry) not in kept)
            if hidden:
                hidden_of.setdefault(hidden, []).append(rank)
        notes = [
            (
                "stdout",
                format_ranks(ranks),
                f"… {hidden:,} earlier lines not shown (the last {per_rank:,} of each rank are); "
                f"nbdist.output(rank={min(ranks)}) has all of a rank's output",
            )
            for hidden, ranks in sorted(hidden_of.items(), key=lambda item: min(item[1]))
        ]
        return notes + [(e.stream, e.labelled(), e.shown()) for e in shown]

    def _ordered(self) -> list[_Entry]:
        """The entries in an order that keeps every rank's own order (a topological sort).

        Among lines free to go next, the one at the lowest position of its ranks'
        output goes first (then lowest rank, then first seen), so lines the ranks
        printed at the same place are grouped in rank order. Ranks that printed
        two lines in opposite orders make a cycle; it is broken the same way.
        """
        entries = self._entries
        successors: dict[int, set[int]] = {}
        indegree = [0] * len(entries)
        for own in self._per_rank.values():
            for (before, _), (after, _) in zip(own, own[1:]):
                following = successors.setdefault(before.seq, set())
                if after.seq not in following:
                    following.add(after.seq)
                    indegree[after.seq] += 1
        heap = [(e.sort_key(), e.seq) for e in entries if indegree[e.seq] == 0]
        heapq.heapify(heap)
        by_rest = sorted(entries, key=_Entry.sort_key)  # cycle breaking, in key order
        rest = 0
        done = [False] * len(entries)
        order: list[_Entry] = []
        while len(order) < len(entries):
            if not heap:
                while done[by_rest[rest].seq]:
                    rest += 1
                heap.append((by_rest[rest].sort_key(), by_rest[rest].seq))
            _, seq = heapq.heappop(heap)
            if done[seq]:
                continue
            done[seq] = True
            order.append(entries[seq])
            for nxt in successors.get(seq, ()):
                indegree[nxt] -= 1
                if indegree[nxt] == 0 and not done[nxt]:
                    heapq.heappush(heap, (entries[nxt].sort_key(), nxt))
        return order
