"""Kernel side: several ranks' tqdm bars read as one line, their timings as ranges.

Every rank draws its own bar, and no two ranks' bars read the same: the elapsed time,
the time left and the rate differ in the last digit. Folded as ordinary lines, a loop
under ``tqdm`` ended as one line per rank (256 at 256 ranks), and the live bars as one
group per rank. Here a bar is read as tqdm writes it (``tqdm.format_meter``)::

    epoch:  90%|█████████ | 27/30 [00:01<00:00, 15.88it/s, loss=0.5]
    epoch: 27it [00:01, 15.88it/s]

:func:`bar_key` is what finished bars fold by: the text with its timing masked, so bars
at the same count with the same description and postfix are one line;
:func:`merge_bars` writes that line with each timing as the range the ranks' bars span
(``[00:00–00:01<00:00, 15.92–48.30it/s]``). :func:`live_bar_lines` groups the bars still
being drawn by description and total: one line per loop, drawn at the slowest rank's
count, the counts as a range, and which ranks are slowest. Text that is not a tqdm bar
is left as it is. Pure logic, standard library only.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from nbdist.errors import format_ranks

__all__ = ["BAR_TIMING", "bar_key", "is_bar_key", "live_bar_lines", "merge_bars"]

# Stands for a bar's timing in its fold key: no text a rank prints contains it.
BAR_TIMING = "\x00timing\x00"
# Slowest ranks named one by one up to this many; more are counted.
_SLOWEST_NAMED = 8
_TIME = r"(?:\d+:)?\d+:\d\d"
_COUNT = r"\d+(?:\.\d+)?[kMGTPEZY]?"
# tqdm's r_bar: "| 27/30 [00:01<00:00, 15.88it/s, loss=0.5]", or without a total
# "27it [00:01, 15.88it/s]". The head holds the description, percentage and bar.
_BAR = re.compile(
    rf"^(?P<head>.*?)(?P<n>{_COUNT})(?:/(?P<total>{_COUNT})|(?P<unit>[^\s\[\]/|]*)) "
    rf"\[(?P<elapsed>{_TIME})(?:<(?P<remaining>\?|{_TIME}))?, *"
    r"(?P<rate>[^,\]]*?)(?P<postfix>,[^\]]*)?\]$"
)
# A known total's head: "epoch:  90%|█████████ | " (the description may be empty).
_HEAD = re.compile(r"^(?P<desc>.*?) ?\s*\d+%\|[^|]*\| $")
_RATE_PER_S = re.compile(rf"^(?P<n>{_COUNT})\S*/s$")
_RATE_S_PER = re.compile(rf"^(?P<n>{_COUNT})s/\S+$")
# tqdm's unit_scale prefixes ("3.00k/30.0k", "1.2MB/s").
_SCALE = {"": 1.0, **{prefix: 1000.0**i for i, prefix in enumerate("kMGTPEZY", start=1)}}
_NUMBER_THEN = re.compile(r"^(\d+(?:\.\d+)?)(.*)$")


@dataclass(frozen=True)
class _Bar:
    head: str
    n: str
    total: str | None
    unit: str
    elapsed: str
    remaining: str | None
    rate: str
    postfix: str

    @property
    def count(self) -> str:
        return f"{self.n}/{self.total}" if self.total is not None else f"{self.n}{self.unit}"

    @property
    def loop(self) -> tuple[str, str | None, str]:
        """What tells one loop's bar from another's: description, total, unit."""
        if self.total is None:
            return (self.head, None, self.unit)
        head = _HEAD.match(self.head)
        return (head.group("desc") if head else self.head, self.total, "")


def _parse(text: str) -> _Bar | None:
    # Most lines are not bars: a look at the last bracket before the regex (tqdm's timing
    # starts with the elapsed time's digits).
    start = text.rfind(" [")
    if not text.endswith("]") or start < 0 or not text[start + 2 : start + 3].isdigit():
        return None
    match = _BAR.match(text)
    if match is None:
        return None
    return _Bar(
        head=match.group("head"),
        n=match.group("n"),
        total=match.group("total"),
        unit=match.group("unit") or "",
        elapsed=match.group("elapsed"),
        remaining=match.group("remaining"),
        rate=match.group("rate").strip(),
        postfix=match.group("postfix") or "",
    )


def bar_key(text: str) -> str | None:
    """``text`` with its timing masked if it is a tqdm bar, else None.

    >>> bar_key("ep: 100%|██████████| 5/5 [00:00<00:00, 39.89it/s]") == (
    ...     bar_key("ep: 100%|██████████| 5/5 [00:01<00:00, 4.90it/s]"))
    True
    >>> bar_key("epoch 3 done") is None
    True
    """
    bar = _parse(text)
    if bar is None:
        return None
    return f"{bar.head}{bar.count} [{BAR_TIMING}{bar.postfix}]"


def is_bar_key(key: str) -> bool:
    """Whether ``key`` (a fold key) is a bar's, whose ranks' texts :func:`merge_bars` joins."""
    return BAR_TIMING in key


def _number(text: str) -> float:
    return float(text[:-1]) * _SCALE[text[-1]] if text[-1:] in _SCALE else float(text)


def _seconds(text: str | None) -> float | None:
    if text is None or text == "?":
        return None
    seconds = 0.0
    for part in text.split(":"):
        seconds = seconds * 60 + int(part)
    return seconds


def _speed(rate: str) -> float | None:
    """Units per second of tqdm's rate text ("15.88it/s", "1.67s/it", "3.2kB/s"); None if unknown."""
    match = _RATE_PER_S.match(rate)
    if match:
        return _number(match.group("n"))
    match = _RATE_S_PER.match(rate)
    if match:
        value = _number(match.group("n"))
        return 1 / value if value else None
    return None


def _span(texts: list[str | None], value, *, unit: bool = False) -> str | None:
    """``lo–hi`` of ``texts`` ordered by ``value`` (texts it cannot read left out); one text if
    all agree. ``unit``: the texts are a number then a unit, written once where both ends share it."""
    known = sorted({t for t in texts if t is not None and value(t) is not None}, key=value)
    if not known:
        return next((t for t in texts if t is not None), None)
    low, high = known[0], known[-1]
    if value(low) == value(high):
        return low
    if not unit:
        return f"{low}–{high}"
    # "4.90–39.89it/s", not "4.90it/s–39.89it/s".
    low_parts, high_parts = _NUMBER_THEN.match(low), _NUMBER_THEN.match(high)
    if low_parts and high_parts and low_parts.group(2) == high_parts.group(2):
        return f"{low_parts.group(1)}–{high}"
    return f"{low}–{high}"


def _timing(bars: list[_Bar], postfix: str) -> str:
    elapsed = _span([b.elapsed for b in bars], _seconds)
    remaining = _span([b.remaining for b in bars], _seconds)
    rate = _span([b.rate for b in bars], _speed, unit=True)
    return f"[{elapsed}{'' if remaining is None else '<' + remaining}, {rate}{postfix}]"


def merge_bars(texts: list[str]) -> str:
    """One line for several ranks' bars with the same :func:`bar_key`: each timing as a range.

    >>> merge_bars(["ep: 100%|██████████| 5/5 [00:00<00:00, 39.89it/s]",
    ...             "ep: 100%|██████████| 5/5 [00:01<00:00,  4.90it/s]"])
    'ep: 100%|██████████| 5/5 [00:00–00:01<00:00, 4.90–39.89it/s]'
    """
    bars = [bar for bar in map(_parse, texts) if bar is not None]
    if not bars:
        return texts[0]
    first = bars[0]
    return f"{first.head}{first.count} {_timing(bars, first.postfix)}"


def live_bar_lines(bars: dict[int, str]) -> list[tuple[list[int], str]]:
    """The bars still being drawn, one line per loop: ``(ranks, text)`` in order of lowest rank.

    ``bars``: each rank's bar as it reads now. Bars of one loop (same description and
    total) make one line, drawn at the slowest rank's count, the ranks' counts as a
    range and the slowest ranks named; text that is not a tqdm bar groups with
    identical text only.

    >>> live_bar_lines({0: "ep:  80%|████████  | 4/5 [00:01<00:00, 3.90it/s]",
    ...                 1: "ep:  40%|████      | 2/5 [00:01<00:01, 1.95it/s]"})
    [([0, 1], 'ep:  40%|████      | 2–4/5 [00:01<00:00–00:01, 1.95–3.90it/s] · slowest: rank 1')]
    """
    groups: dict[tuple, list[tuple[int, str, _Bar | None]]] = {}
    for rank, text in bars.items():
        bar = _parse(text)
        key = ("bar", *bar.loop) if bar is not None else ("text", text)
        groups.setdefault(key, []).append((rank, text, bar))
    lines = []
    for members in groups.values():
        members.sort(key=lambda member: member[0])
        ranks = [rank for rank, _text, _bar in members]
        alike = len({text for _rank, text, _bar in members}) == 1
        if alike or members[0][2] is None:  # one text, or not a bar: as it reads
            lines.append((ranks, members[0][1]))
        else:
            lines.append((ranks, _loop_line(members)))
    lines.sort(key=lambda line: line[0][0])
    return lines


def _loop_line(members: list[tuple[int, str, _Bar]]) -> str:
    """One loop's bars (each rank's, in rank order) as one line at the slowest rank's count."""
    by_rank = {rank: bar for rank, _text, bar in members}
    counts = {rank: _number(bar.n) for rank, bar in by_rank.items()}
    low, high = min(counts.values()), max(counts.values())
    slowest = [rank for rank, count in counts.items() if count == low]
    base = by_rank[slowest[0]]
    bars = list(by_rank.values())
    if low == high:
        return f"{base.head}{base.count} {_timing(bars, base.postfix)}"
    n_high = next(by_rank[rank].n for rank, count in counts.items() if count == high)
    count = f"{base.n}–{n_high}" + (f"/{base.total}" if base.total is not None else base.unit)
    who = format_ranks(slowest) if len(slowest) <= _SLOWEST_NAMED else f"{len(slowest)} ranks"
    return f"{base.head}{count} {_timing(bars, base.postfix)} · slowest: {who}"
