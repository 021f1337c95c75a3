"""Kernel side: one rank's points kept compact, as a long session holds every point of every rank.

:class:`RankSeries` holds a rank's steps, times and each key's values in arrays (8 bytes a
value, no Python object per value), each key's points as runs of consecutive points, or an
index array for a key on scattered points (``_Column``). :class:`~nbdist.metrics.run.Run`
keeps one per rank, and reads them under its lock.
"""

from __future__ import annotations

from array import array
from bisect import bisect_right
from struct import Struct
from struct import error as StructError

__all__ = ["RankSeries", "as_list", "numpy_dtype"]


def _as_array(typecode: str, items: list, kind: type):
    """``items`` as an ``array(typecode)`` when every one is exactly ``kind`` (None otherwise:
    an int among floats, a bool among ints, None, an int past 64 bits keep their objects)."""
    if list(map(type, items)).count(kind) != len(items):
        return None
    out = array(typecode)
    try:
        out.fromlist(items)
    except OverflowError:  # an int past int64
        return None
    return out


def _extend(column, items: list, typecode: str, kind: type):
    """``column`` (an array, or a list once a value did not fit) with ``items`` appended:
    the same object while it can hold them, else a list of the values as they were given."""
    if type(column) is array:
        if list(map(type, items)).count(kind) == len(items):
            try:
                column.fromlist(items)
                return column
            except OverflowError:
                pass
        column = column.tolist()
    column.extend(items)
    return column


def as_list(column) -> list:
    """An array's values as a list (a list as it is: callers pass slices, copies already)."""
    return column if type(column) is list else column.tolist()


_PACK_FROM = 64  # points in a batch from which its floats are packed with struct


class _Column:
    """One key's values on one rank (``vals``) and the point each belongs to.

    In runs (``idx`` None): a run of values on points one after another is its first
    value's position in ``vals`` (``starts[r]``) and that value's point (``firsts[r]``). A
    key on every point from its first is one run; a gap starts another (a cell's first
    point has no step time, a key logged again after a pause). Once runs would be many
    (a key on some points only, as the GPU's readings once a second), ``idx`` holds each
    value's point instead. ``end``: the point after the last value while in runs with
    ``vals`` an array (a batch that starts there, the key on every point, is appended as
    it is), else -1.
    """

    __slots__ = ("end", "firsts", "idx", "starts", "vals")

    def __init__(self) -> None:
        self.vals = array("d")  # or a list, once a value was not a float
        self.starts = array("q")
        self.firsts = array("q")
        self.idx = None
        self.end = -1

    def spans(self, lo: int, m: int) -> list[tuple[int, int]]:
        """In runs: the points of values ``lo`` to ``m - 1``, as ``[(first, past), ...]``."""
        starts, firsts = self.starts, self.firsts
        out = []
        for r in range(max(bisect_right(starts, lo) - 1, 0), len(starts)):
            a = max(starts[r], lo)
            b = min(starts[r + 1] if r + 1 < len(starts) else m, m)
            if a < b:
                out.append((a + firsts[r] - starts[r], b + firsts[r] - starts[r]))
        return out

    def add(self, start: int, n: int, idx, vals: list) -> None:
        """Append a batch's values, any case: the batch's ``n`` points from point ``start``,
        ``idx`` the batch's points that carry the key (None: every one)."""
        if not vals:
            return
        k = len(self.vals)
        if self.idx is None:
            starts, firsts = self.starts, self.firsts
            for offset, point in _runs(start, idx):
                if not starts or point != firsts[-1] + k + offset - starts[-1]:
                    starts.append(k + offset)  # a gap: a run of its own
                    firsts.append(point)
            if len(starts) > 8 + (k + len(vals)) // 8:  # many runs: each value's point
                points = [p for a, b in self.spans(0, k + len(vals)) for p in range(a, b)]
                made = _as_array("q", points, int)
                self.idx = points if made is None else made
                self.starts = self.firsts = None
        else:
            points = list(range(start, start + n)) if idx is None else [start + i for i in idx]
            self.idx = _extend(self.idx, points, "q", int)
        self.vals = _extend(self.vals, vals, "d", float)
        if self.idx is None and type(self.vals) is array:
            self.end = self.firsts[-1] + len(self.vals) - self.starts[-1]
        else:
            self.end = -1


def _runs(start: int, idx) -> list[tuple[int, int]]:
    """A batch's values of a key as runs on points one after another: ``[(position of the
    run's first value among the batch's values, its point), ...]``."""
    if idx is None:
        return [(0, start)]
    if not idx:
        return []
    if idx[-1] - idx[0] == len(idx) - 1 and idx == list(range(idx[0], idx[-1] + 1)):
        return [(0, start + idx[0])]
    out = [(0, start + idx[0])]
    for k in range(1, len(idx)):
        if idx[k] != idx[k - 1] + 1:
            out.append((k, start + idx[k]))
    return out


class RankSeries:
    """Columns of one rank's points: ``steps[i]``/``times[i]`` and each key's values.

    Kept compact, as a long session holds every point of every rank: ``steps`` is an
    ``array('q')`` and ``times`` and each key's values are ``array('d')`` (8 bytes a
    value, no Python object per value), and a key's points are runs of points one after
    another (16 bytes a run; a key on every point is one run, a cell's first point
    without a step time starts another), or an ``array('q')`` of each value's point for
    a key on some points only (see ``_Column``). A value that is not exactly a float (an
    int, a bool, None...; a step that is not exactly an int, a time not a float) turns
    that one column into a plain list from then on, so every value reads back as the
    same object it was given. :attr:`values` gives the columns as lists, as they were kept
    before.
    """

    __slots__ = ("steps", "times", "columns")

    def __init__(self) -> None:
        """An empty series."""
        self.steps = array("q")  # or a list, once a step was not an int
        self.times = array("d")  # or a list, once a time was not a float
        self.columns: dict[str, _Column] = {}

    def extend(self, steps: list, times: list, columns: dict) -> None:
        """Append a batch given as columns: ``steps``, ``times`` and ``{key: (indices or None,
        values)}``, the indices (into this batch) of the points that carry the key, in order
        (None: every point)."""
        start, n = len(self.steps), len(steps)
        # The collector's hot path: every step an int, every time and value a float, each
        # key on every point. One type check for the whole batch, then each key's values
        # go straight into its array (a key that is new, misses points, or holds other
        # types takes _Column.add).
        every = [*steps, *times]
        for _, vals in columns.values():
            every += vals
        kinds = list(map(type, every))
        if (
            kinds.count(float) == len(kinds) - n
            and kinds[:n].count(int) == n
            and type(self.steps) is array
            and type(self.times) is array
            and type(steps) is list
            and type(times) is list
            and len(times) == n
            and _append(self.steps, steps)
        ):
            # A long batch's floats are packed in one call (struct's loop is cheaper than
            # fromlist's per item), a short one's appended (the Struct costs more).
            pack = Struct(f"{n}d").pack if n >= _PACK_FROM else None
            if pack is None:
                self.times.fromlist(times)
            else:
                self.times.frombytes(pack(*times))
            mine = self.columns
            end = start + n
            for key, (idx, vals) in columns.items():
                column = mine.get(key)
                if column is not None and column.end == start and idx is None:
                    try:
                        if pack is None:
                            column.vals.fromlist(vals)
                        else:
                            column.vals.frombytes(pack(*vals))
                    except (TypeError, StructError):  # not a list, or not n values
                        column.vals.fromlist(list(vals))
                    column.end = end
                else:
                    self._add(key, column, start, n, idx, vals)
            return
        self.steps = _extend(self.steps, steps, "q", int)
        self.times = _extend(self.times, times, "d", float)
        for key, (idx, vals) in columns.items():
            self._add(key, self.columns.get(key), start, n, idx, vals)

    def _add(self, key: str, column: _Column | None, start: int, n: int, idx, vals) -> None:
        """One key's values of a batch, any case (a new key, a gap, a value not a float)."""
        if column is None:
            column = self.columns[key] = _Column()
        column.add(start, n, idx, vals if type(vals) is list else list(vals))


def _append(column: array, ints: list) -> bool:
    """Append ``ints`` to an ``array('q')``; False (and nothing appended) if one is past 64 bits."""
    try:
        column.fromlist(ints)
    except OverflowError:
        return False
    return True


def numpy_dtype(column: array) -> str:
    """The numpy dtype of an ``array('q')`` or ``array('d')`` column (read without a copy)."""
    return {"q": "int64", "d": "float64"}[column.typecode]
