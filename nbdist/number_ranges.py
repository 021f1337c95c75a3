"""Both sides (standard library only): texts alike but for their numbers, written once with ranges.

An error raised on 256 ranks that names its rank, or ``%dist_diff`` finding that every
rank's weights differ from rank 0's by a different amount, gives texts that differ only
in their numbers. Written once, each number as the range the texts span, they stay
readable whatever the number of ranks:

>>> number_shape("bad batch on rank 3: loss=4.5")
'bad batch on rank #: loss=#'
>>> with_ranges(["bad batch on rank 3: loss=4.5", "bad batch on rank 10: loss=15.0"])
'bad batch on rank 3–10: loss=4.5–15.0'
"""

from __future__ import annotations

import re
from collections.abc import Sequence

__all__ = ["fold_texts", "number_shape", "with_ranges"]

# A number: "3", "4.5", "127.0.0.1", "1e-05", "6.0e-01", "0x7f3a2c". A sign is text: texts
# whose numbers differ in sign are not alike ("-1.5" against "2.5").
_NUMBER = re.compile(r"0x[0-9a-fA-F]+|\d+(?:\.\d+)*(?:[eE][-+]?\d+)?")


def number_shape(text: str) -> str:
    """``text`` with each number replaced by ``#``: texts alike but for their numbers share it."""
    return _NUMBER.sub("#", text)


def _magnitude(token: str) -> tuple:
    """Sort key of a number: by value; dotted forms (addresses) part by part."""
    try:
        return (0, float(int(token, 16)) if token[:2].lower() == "0x" else float(token))
    except ValueError:
        return (1, tuple(int(part) for part in token.split(".")))


def with_ranges(texts: Sequence[str]) -> str:
    """One text for ``texts`` of one :func:`number_shape`: each number as ``low–high`` by value
    (one value where they agree)."""
    pieces = _NUMBER.split(texts[0])
    tokens = [_NUMBER.findall(text) for text in texts]
    if any(len(row) != len(tokens[0]) for row in tokens):
        raise ValueError(f"texts not alike but for their numbers: {texts[:2]!r}")
    out = []
    for index, text in enumerate(pieces):
        out.append(text)
        if index < len(tokens[0]):
            values = sorted({row[index] for row in tokens}, key=_magnitude)
            out.append(values[0] if len(values) == 1 else f"{values[0]}–{values[-1]}")
    return "".join(out)


def _split_by_few_valued_numbers(texts: Sequence[str], listed: int) -> list[list[int]]:
    """Indices of ``texts`` (alike but for their numbers) in groups by the numbers that take
    at most ``listed`` values, where those make at most ``listed`` groups; else one group.

    torch's collective check at 256 ranks gives "Rank N is running ... TensorShape=[4] ...
    but Rank 3 ... [1]" on 255 ranks and the mirror on rank 3: ranged whole, that reads
    "Rank 0–255 ... TensorShape=[1–4]" and no longer says which rank had which shape. The
    numbers a rank number or a loss spans (many values) are ranged; a shape that one rank
    alone differs in (two values) keeps a line of its own.
    """
    tokens = [_NUMBER.findall(text) for text in texts]
    few = [
        position
        for position in range(len(tokens[0]))
        if len({row[position] for row in tokens}) <= listed
    ]
    groups: dict[tuple[str, ...], list[int]] = {}
    for index, row in enumerate(tokens):
        groups.setdefault(tuple(row[position] for position in few), []).append(index)
    if len(groups) > listed:
        return [list(range(len(texts)))]
    return list(groups.values())


def fold_texts(texts: dict[int, str], listed: int = 3) -> list[tuple[list[int], str]]:
    """(ranks, text) for each rank's text, ordered by lowest rank: identical texts once with
    their ranks; more than ``listed`` texts alike but for their numbers once with ranges,
    or a few times where some numbers take a few values only (one line per such value).

    >>> fold_texts({3: "pid 901 killed", 10: "pid 923 killed", 17: "pid 993 killed",
    ...             24: "pid 1053 killed", 5: "exit code 1"})
    [([3, 10, 17, 24], 'pid 901–1053 killed'), ([5], 'exit code 1')]
    >>> fold_texts({rank: f"rank {rank} has shape [{1 if rank == 3 else 4}]" for rank in range(6)})
    [([0, 1, 2, 4, 5], 'rank 0–5 has shape [4]'), ([3], 'rank 3 has shape [1]')]
    """
    exact: dict[str, list[int]] = {}
    for rank in sorted(texts):
        exact.setdefault(texts[rank], []).append(rank)
    families: dict[str, list[tuple[str, list[int]]]] = {}
    for text, ranks in exact.items():
        families.setdefault(number_shape(text), []).append((text, ranks))
    out = []
    for members in families.values():
        if len(members) <= listed:
            out += [(ranks, text) for text, ranks in members]
            continue
        for group in _split_by_few_valued_numbers([text for text, _ in members], listed):
            ranks = sorted(rank for index in group for rank in members[index][1])
            out.append((ranks, with_ranges([members[index][0] for index in group])))
    return sorted(out, key=lambda item: item[0][0])
