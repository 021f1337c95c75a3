"""Kernel side: ``%dist_diff EXPR`` and ``nbdist.diff``: which ranks' values of EXPR differ, and by how much.

Example::

    nbdist.diff("model.state_dict()")          # a DataFrame: path, rank, kind, detail, ...
    %dist_diff model.state_dict()               # the same as a report:
    # ['fc.weight']: rank 1 differs from rank 0: max |diff| 3.2e-02 at (4, 7); 1 of 80 elements differs
    # 1 of 4 values differs on rank 1 (reference rank 0; ranks 0-1 compared)

How, and what it costs:

1. EXPR runs on the ranks as a cell (so it fails like one, a ``RankError``),
   held there under a fresh token (:mod:`nbdist.engine.rank_diff`).
2. Each rank sends a fingerprint per leaf (:mod:`nbdist.engine.fingerprint`):
   for a tensor its shape, dtype, device type, a hash of its values computed on
   its device and a few statistics: a few hundred bytes per tensor, whatever its size.
3. The kernel compares the fingerprints with the reference rank's (``ref``,
   default 0), grouping ranks whose values agree with each other.
4. Only for tensors (and long strings) whose hash differs, the reference rank's
   leaf is relayed through the kernel, at most :data:`BATCH_BYTES` at a time, to
   one rank of each group, which computes max |diff| and the first differing
   index on its own device. Nothing goes over ``torch.distributed``: see
   :mod:`nbdist.engine.fingerprint` for why. The kernel never imports torch.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field

from nbdist.engine import rank_diff
from nbdist.errors import format_ranks
from nbdist.number_ranges import number_shape, with_ranges

__all__ = [
    "BATCH_BYTES",
    "COLUMNS",
    "DiffResult",
    "Difference",
    "apply_measurement",
    "compare_values",
    "compare_records",
    "diff",
]

# Reference leaves relayed per round trip: bounds what the kernel holds at once.
BATCH_BYTES = 256 << 20
COLUMNS = ("path", "rank", "kind", "detail", "max_abs_diff", "first_index")
_MAX_LINES = 100
# Beyond this many groups of ranks differing on one leaf in ways alike but for their numbers
# (weights never broadcast: each rank its own max |diff|), the report gives them one line.
_MAX_LISTED_GROUPS = 3


@dataclass
class Difference:
    """One leaf on which ``ranks`` (all holding the same value) differ from the reference rank."""

    path: str
    ranks: list[int]
    kind: str  # missing, type, shape, dtype, device, values
    detail: str
    max_abs_diff: float | None = None
    first_index: tuple | None = None


@dataclass
class DiffResult:
    """What :func:`compare_values` found: the differences, and what was compared."""

    expr: str
    ref: int
    ranks: list[int]
    values: int  # leaves compared (containers not counted)
    differences: list[Difference] = field(default_factory=list)

    def rows(self) -> list[dict]:
        """One dict per (leaf, rank) that differs, with the keys of :data:`COLUMNS`."""
        return [
            dict(zip(COLUMNS, (d.path, r, d.kind, d.detail, d.max_abs_diff, d.first_index)))
            for d in self.differences
            for r in d.ranks
        ]

    def table(self):
        """:meth:`rows` as a pandas DataFrame (if pandas imports), else the list of dicts."""
        try:
            import pandas as pd
        except ImportError:
            return self.rows()
        frame = pd.DataFrame(self.rows(), columns=list(COLUMNS))
        frame.attrs.update(expr=self.expr, ref=self.ref, ranks=self.ranks, summary=self.summary())
        return frame

    def summary(self) -> str:
        """The last line of the report: how many values differ, where, against which rank."""
        plural = "value" if self.values == 1 else "values"
        compared = f"{format_ranks(self.ranks)}, {self.values} {plural} compared"
        if not self.differences:
            return f"no rank differs from rank {self.ref} ({compared})"
        paths = len({d.path for d in self.differences})
        ranks = format_ranks(r for d in self.differences for r in d.ranks)
        verb = "differs" if paths == 1 else "differ"
        return (
            f"{paths} of {self.values} {plural} {verb} on {ranks} "
            f"(reference rank {self.ref}; {format_ranks(self.ranks)} compared)"
        )

    def report(self) -> str:
        """One line per differing leaf and group of ranks, then :meth:`summary`.

        A leaf on which more than three groups of ranks differ alike but for the
        numbers (every rank's own max |diff|) is one line, each number the range the
        groups span: at 256 ranks a state_dict never broadcast is one line per leaf.
        """
        families: dict[tuple[str, str], list[Difference]] = {}
        for d in self.differences:
            families.setdefault((d.path, d.kind), []).append(d)
        lines = []
        for family in families.values():
            if len(family) <= _MAX_LISTED_GROUPS:
                for d in family:
                    verb = "differs" if len(d.ranks) == 1 else "differ"
                    who = format_ranks(d.ranks)
                    lines.append(f"{d.path}: {who} {verb} from rank {self.ref}: {d.detail}")
                continue
            ranks = format_ranks(r for d in family for r in d.ranks)
            lines.append(
                f"{family[0].path}: {ranks} differ from rank {self.ref} ({len(family)} different "
                f"values): {self._folded(family)}"
            )
        if len(lines) > _MAX_LINES:
            lines[_MAX_LINES:] = [
                f"... and {len(lines) - _MAX_LINES} more (nbdist.diff({self.expr!r}) lists them all)"
            ]
        return "\n".join([*lines, self.summary()])

    def _folded(self, family: list[Difference]) -> str:
        """One detail for the groups of ranks ``family`` (one leaf, one kind of difference)."""
        details = [d.detail for d in family]
        if len({number_shape(detail) for detail in details}) == 1:
            return with_ranges(details)  # "shape (5–8,), rank 0: (4,)"
        gaps = [d.max_abs_diff for d in family if d.max_abs_diff is not None]
        if len(gaps) == len(family):
            worst = max(family, key=lambda d: d.max_abs_diff)
            return (
                f"max |diff| {min(gaps):.1e}–{max(gaps):.1e} (the largest on "
                f"{format_ranks(worst.ranks)})"
            )
        return f"in {len(family)} ways (nbdist.diff({self.expr!r}) lists them)"

    def __str__(self) -> str:
        """The report."""
        return self.report()


def _key(rec: dict | None):
    """What makes two records the same value (NaN equal to NaN)."""
    if rec is None:
        return ("missing",)
    kind = rec["kind"]
    if kind == "tensor":
        return (kind, rec["shape"], rec["dtype"], rec["device"], rec["hash"])
    if kind == "number":
        value = rec["value"]
        return (kind, "nan" if value != value else value)
    if kind in ("text", "object"):
        return (kind, rec["type"], rec["hash"])
    if kind == "container":
        return (kind, rec["type"])
    return (kind,)


def _what(rec: dict) -> str:
    kind = rec["kind"]
    if kind == "tensor":
        return f"a tensor {rec['shape']} {rec['dtype']}"
    if kind == "number":
        return f"{rec['type']} {rec['value']!r}"
    if kind == "text":
        return f"{rec['type']} of length {rec['length']}"
    if kind == "container":
        return f"{rec['type']} of {rec['length']}"
    if kind == "none":
        return "None"
    return rec["type"]


def _short(text) -> str:
    shown = repr(text)
    return shown if len(shown) <= 60 else shown[:57] + "..."


def _first_char(a, b) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def _describe(rec: dict | None, ref_rec: dict | None, ref: int) -> tuple[Difference, bool]:
    """The difference of ``rec`` from ``ref_rec`` (path and ranks filled in later), and
    whether the reference rank's leaf must be relayed to measure it."""
    if rec is None:
        return Difference("", [], "missing", f"missing (rank {ref} has {_what(ref_rec)})"), False
    if ref_rec is None:
        return Difference("", [], "missing", f"{_what(rec)}, missing on rank {ref}"), False
    kind = rec["kind"]
    if kind != ref_rec["kind"] or (rec.get("type") != ref_rec.get("type") and kind != "number"):
        return Difference("", [], "type", f"{_what(rec)}, rank {ref}: {_what(ref_rec)}"), False
    if kind == "tensor":
        for part in ("shape", "dtype", "device"):
            if rec[part] != ref_rec[part]:
                detail = f"{part} {rec[part]}, rank {ref}: {ref_rec[part]}"
                return Difference("", [], part, detail), False
        return Difference("", [], "values", ""), True
    if kind == "number":
        value, other = rec["value"], ref_rec["value"]
        try:
            gap = abs(value - other)
        except TypeError:
            gap = None
        gap = None if gap is None or gap != gap else float(gap)
        detail = f"{value!r}, rank {ref}: {other!r}"
        if gap is not None:
            detail += f" (|diff| {gap:.1e})"
        return Difference("", [], "values", detail, max_abs_diff=gap), False
    if kind == "text":
        if rec["text"] is None or ref_rec["text"] is None:
            detail = f"length {rec['length']}, rank {ref}: {ref_rec['length']}"
            return Difference("", [], "values", detail), True
        at = _first_char(rec["text"], ref_rec["text"])
        detail = f"{_short(rec['text'])}, rank {ref}: {_short(ref_rec['text'])} (first difference at {at})"
        return Difference("", [], "values", detail, first_index=(at,)), False
    return Difference("", [], "values", f"{rec['repr']}, rank {ref}: {ref_rec['repr']}"), False


def apply_measurement(diff: Difference, found: dict) -> bool:
    """Fill ``diff`` from what a rank's ``compare_with`` found for its leaf; False if equal after all."""
    if not found:  # the rank had no such leaf to compare (not expected: its hash differed)
        diff.detail = diff.detail or "values differ"
        return True
    first = found.get("first_index")
    if first is None:  # same values after all (e.g. float8 NaNs with other bits)
        return False
    diff.first_index = first
    if "n_diff" not in found:  # a string
        diff.detail += f"; first difference at {first[0]}"
        return True
    worst, n, nans = found["max_abs_diff"], found["n_diff"], found["nan_mismatch"]
    parts = []
    if n > nans:
        diff.max_abs_diff = worst
        at = found["max_index"]
        parts.append(f"max |diff| {worst:.1e}" + (f" at {at}" if at else ""))
    if nans:
        parts.append(f"NaN on one rank only at {nans} element{'s' if nans > 1 else ''}")
    noun = "element" if found["numel"] == 1 else "elements"
    verb = "differs" if n == 1 else "differ"
    where = f", the first at {first}" if first and first != found.get("max_index") else ""
    parts.append(f"{n} of {found['numel']} {noun} {verb}{where}")
    diff.detail = "; ".join(parts)
    return True


def _display(path: tuple[str, ...], expr: str) -> str:
    return "".join(path) if path else expr


def compare_records(records: dict, ref: int, expr: str):
    """Compare fingerprints: {rank: [(path, record)]} from :func:`~nbdist.engine.rank_diff.held_fingerprints`.

    Returns (differences, pending, values): every difference found, in path
    order, ranks that hold the same value grouped; ``pending``, the differences
    still to measure, as (difference, path, representative rank, bytes of the
    reference leaf), to be filled by :func:`apply_measurement`; and the number
    of leaves compared.
    """
    order: dict[tuple, None] = {}
    for rank in [ref, *records]:
        order.update(dict.fromkeys(path for path, _ in records[rank]))
    by_rank = {rank: dict(found) for rank, found in records.items()}
    cut: dict[int, list[tuple]] = {rank: [] for rank in records}  # subtrees already reported
    differences, pending, values = [], [], 0
    for path in order:
        ref_rec = by_rank[ref].get(path)
        if any(
            r is not None and r["kind"] != "container"
            for r in (by_rank[x].get(path) for x in records)
        ):
            values += 1
        groups: dict[tuple, list[int]] = {}
        for rank in records:
            if rank == ref or any(path[: len(c)] == c for c in cut[rank]):
                continue
            rec = by_rank[rank].get(path)
            if _key(rec) != _key(ref_rec):
                groups.setdefault(_key(rec), []).append(rank)
        for ranks in groups.values():
            diff, relay = _describe(by_rank[ranks[0]].get(path), ref_rec, ref)
            diff.path, diff.ranks = _display(path, expr), ranks
            if diff.kind in ("missing", "type"):
                for rank in ranks:
                    cut[rank].append(path)
            differences.append(diff)
            if relay:
                size = ref_rec.get("nbytes", ref_rec.get("length", 0))
                pending.append((diff, path, ranks[0], size))
    return differences, pending, values


def _batches(pending: list, limit: int):
    batch, size = [], 0
    for item in pending:
        if batch and size + item[3] > limit:
            yield batch
            batch, size = [], 0
        batch.append(item)
        size += item[3]
    if batch:
        yield batch


def _measure(session, token: str, ref: int, pending: list) -> list[Difference]:
    """Relay the reference rank's leaves in batches; returns the differences that turned out equal."""
    equal = []
    for batch in _batches(pending, BATCH_BYTES):
        paths = list(dict.fromkeys(path for _, path, _, _ in batch))
        data = session.apply(rank_diff.held_reference_data, token, paths, ranks=[ref])[0]
        wanted: dict[int, list] = {}
        for _, path, rank, _ in batch:
            wanted.setdefault(rank, []).append(path)
        reps = sorted(wanted)
        found = dict(
            zip(reps, session.apply(rank_diff.compare_held, token, data, wanted, ranks=reps))
        )
        del data  # the batch's reference bytes, before the next batch arrives
        for diff, path, rank, _ in batch:
            if not apply_measurement(diff, found[rank].get(path, {})):
                equal.append(diff)
    return equal


def compare_values(session, expr: str, ranks=None, ref: int = 0) -> DiffResult:
    """Evaluate ``expr`` on ``ranks`` (all by default) and compare each with rank ``ref``.

    The reference rank is always evaluated, also when ``ranks`` leaves it out.
    Raises ``SyntaxError`` for an ``expr`` that is not an expression, a
    ``PlacementError`` for ranks that do not exist, and the cell's ``RankError``
    when ``expr`` raises on a rank.
    """
    compile(expr, "<dist_diff>", "eval")  # before anything runs on the ranks
    chosen = sorted({r.rank for r in session.select(ranks)} | {session.select(ref)[0].rank})
    token = f"diff-{uuid.uuid4().hex}"
    # An assignment, so the cell shows nothing; the newline lets EXPR end in a comment.
    code = (
        f"__import__('nbdist.engine.rank_diff', fromlist=['held']).held[{token!r}] = (\n{expr}\n)\n"
    )
    try:
        session.run(code, chosen)
        found = session.apply(rank_diff.held_fingerprints, token, ranks=chosen)
        records = dict(zip(chosen, found))
        differences, pending, values = compare_records(records, ref, expr)
        equal = _measure(session, token, ref, pending)
        differences = [d for d in differences if all(d is not e for e in equal)]
    finally:
        try:
            session.apply(rank_diff.forget, token, ranks=chosen)
        except Exception:  # a rank that died above; its value went with it
            pass
    return DiffResult(expr, ref, chosen, values, differences)


def diff(expr: str, ranks=None, ref: int = 0, *, session=None):
    """Which ranks' values of ``expr`` differ from rank ``ref``'s, as a table.

    ``expr`` is evaluated on each rank (``ranks``: '0,2', '0-3', [1, 3]; None:
    all) in its namespace; tensors, numbers, strings, None and nested dicts,
    lists and tuples (``model.state_dict()``, ``optimizer.state_dict()``) are
    compared leaf by leaf. Returns a pandas DataFrame (a list of dicts without
    pandas) with one row per differing leaf and rank: path, rank, kind
    (missing, type, shape, dtype, device, values), detail, max_abs_diff,
    first_index; no rows when no rank differs. ``session``: default the
    running one (``nbdist.current_session()``). Example::

        nbdist.diff("model.state_dict()")
        nbdist.diff("loss.item()", ranks="1-3", ref=1)
    """
    if session is None:
        from nbdist.driver.live_sessions import current_session

        session = current_session()
    return compare_values(session, expr, ranks, ref).table()
