"""Rank side: one flush's points, as ``nbdist.log`` appended them, turned into wire columns.

``log`` appends each point straight into a :class:`Points` buffer, a list per
field and per key, so a logged step leaves no object of its own behind (a tuple
and a dictionary per point, kept until the flush, were garbage-collector work
on the training thread: bench/RESULTS.md). The flush thread hands the buffer to
:func:`to_columns`, which reads the tensors (one ``torch.stack`` per device, the
batch's one device sync) and works out every derived key for the whole batch at
once with numpy: step time and its breakdown, throughput, TFLOP/s and MFU, and
the memory reading every point carries. The result is what goes on the wire
(:mod:`nbdist.metrics.wire`): each key's name once per batch, its values as one
list, so neither side builds a dictionary per point.

The values are the same floats, to the bit, as one point at a time gives: the
same IEEE operations in the same order (``step_time - comm - data``, ``samples /
step_time``, ``flops / step_time / 1e12``).
"""

from __future__ import annotations

import math

from nbdist.metrics import steptime
from nbdist.metrics.point_keys import WORKED_OUT

__all__ = ["PEAK", "RESERVED_KEYS", "Points", "to_columns", "what_it_was"]

# The key under which a point's peak TFLOP/s waits for flush (never sent).
PEAK = "__peak"
# Names every point has of its own in the kernel (Run.last(), rows(), to_pandas()): a value
# logged under one would replace the point's own (to_pandas() then fails on the duplicate
# column), so it is left out and the user told, with a name to log it under instead.
RESERVED_KEYS = {
    "time": ("when the point was logged", "elapsed_s"),
    "rank": ("the rank that logged it, on every point already", "rank_id"),
}
# Names nbdist works out for a point itself: a value logged under one was replaced on the
# points where nbdist had its own and kept on the others (a rank's first point has no step
# time), so it is left out and told the same way.
RESERVED_KEYS.update(
    {key: (f"{meaning}, worked out by nbdist", f"my_{key}") for key, meaning in WORKED_OUT.items()}
)
_PLAIN = frozenset((int, float, bool))
# Counts a rate is made of (samples/s, tokens/s, TFLOP/s and MFU): a finite number >= 0.
_COUNTS = frozenset(("samples", "tokens", "flops"))


class Points:
    """The points logged since the last flush, by field: ``log`` appends, the flush takes
    the whole buffer (under the channel's lock) and leaves a new one in its place.

    What most steps have in common is not stored per point: a key every point so far
    carried keeps its values alone (``cols``: point ``j``'s value at ``j``), and the
    collective and data-timer seconds, and a step's resume time, only where they are not
    the usual (0, 0, the point's own time).
    """

    __slots__ = (
        "n",
        "steps",
        "times",
        "first_last",
        "prev_step",
        "resumes",
        "comm",
        "data",
        "events",
        "cols",
        "sparse",
    )

    def __init__(self) -> None:
        """An empty buffer."""
        self.n = 0
        self.steps: list[int | None] = []  # as logged; None: one more than the point before
        self.times: list[float] = []  # each call's time (Unix seconds)
        # When the step before this batch's first point resumed (None: the rank's first
        # point), and that point's step: set by the flush that left this buffer in place.
        self.first_last: float | None = None
        self.prev_step = -1
        # point -> when the next step resumed, where that is not the point's own time (a
        # peak measured inside the call; points dropped after it)
        self.resumes: dict[int, float] = {}
        self.comm: dict[int, float] = {}  # point -> seconds in collectives, where not 0
        self.data: dict[int, float] = {}  # point -> seconds in data_timer blocks, where not 0
        self.events: dict[int, list] = {}  # point -> its CUDA collectives' event pairs
        self.cols: dict[str, list] = {}  # key -> values of points 0, 1, ... (no gap yet)
        # key -> (indices of the points that carry it, their values as logged)
        self.sparse: dict[str, tuple[list[int], list]] = {}

    def add_sparse(self, key: str, i: int, value) -> None:
        """Point ``i``'s ``value`` of a key some point before it went without (or one that
        first appears after the batch's first point)."""
        dense = self.cols.pop(key, None)
        column = self.sparse.get(key)
        if column is None:
            column = self.sparse[key] = (list(range(len(dense))), dense) if dense else ([], [])
        column[0].append(i)
        column[1].append(value)

    def follow(self, before: Points) -> None:
        """Continue from ``before``, the batch logged just before this one: the step and the
        resume time its last point leaves for this batch's first (flush thread)."""
        n = before.n
        if not n:
            self.first_last, self.prev_step = before.first_last, before.prev_step
            return
        self.first_last = before.resumes.get(n - 1, before.times[n - 1])
        steps = before.steps
        for j in range(n - 1, -1, -1):  # the last step given, counted on from there
            if steps[j] is not None:
                self.prev_step = steps[j] + (n - 1 - j)
                return
        self.prev_step = before.prev_step + n


def to_columns(
    points: Points, reading: dict, left_out: dict | None = None
) -> tuple[list, object, dict]:
    """``(steps, times, columns)`` of ``points``.

    ``times`` and each column's values are float64 arrays (a memory column's, one float
    every point carries); ``columns``: ``{key: (indices or None, values)}``, indices into the batch of the points that carry
    the key (None: every point). ``reading``: the rank's memory now, carried by every
    point of the batch (empty: none). ``left_out``, when given, gets
    ``{key: what the value was}`` for each key of which a value was no number (the
    first such value of the batch), so the user can be told; a key of
    :data:`RESERVED_KEYS` is left out and told the same way.
    """
    import numpy as np

    n = points.n
    raw: dict[str, tuple] = {
        key: (None if len(values) == n else list(range(len(values))), values)
        for key, values in points.cols.items()
    }
    raw.update(points.sparse)
    told = {} if left_out is None else left_out
    for key in RESERVED_KEYS.keys() & raw.keys():  # once a flush, not on the training thread
        told.setdefault(key, _reserved(key, raw.pop(key)[1][0]))
    _numbers(raw, told)
    peak = raw.pop(PEAK, None)

    out: dict[str, tuple] = {}
    full: dict[str, np.ndarray] = {}  # the keys derived values need, NaN where absent
    for key, (idx, values) in raw.items():
        if key in ("samples", "tokens", "flops", "data_time"):
            full[key] = _spread(np, n, idx, values)
        out[key] = (idx, values)

    when = np.array(points.times, dtype=np.float64)
    if n > 1 or points.first_last is not None:
        last = np.empty(n, dtype=np.float64)
        last[0] = math.nan if points.first_last is None else points.first_last
        last[1:] = when[:-1]
        for i, resume in points.resumes.items():
            if i + 1 < n:
                last[i + 1] = resume
        dt = when - last
        has = ~np.isnan(last)
        comm = np.zeros(n, dtype=np.float64)
        for i, seconds in points.comm.items():
            comm[i] = seconds
        for i, events in points.events.items():  # CUDA collectives' events to read
            comm[i] = _comm(points.comm.get(i, 0.0), events)
        data = np.zeros(n, dtype=np.float64)
        for i, seconds in points.data.items():
            data[i] = seconds
        if "data_time" in full:  # the user's own figure wins where logged (NaN: none)
            logged = raw["data_time"][0]
            logged = slice(None) if logged is None else logged
            data[logged] = np.nan_to_num(full["data_time"][logged], nan=0.0)
        comm = np.minimum(np.maximum(comm, 0.0), dt)
        data = np.minimum(np.maximum(data, 0.0), dt - comm)
        compute = dt - comm - data
        for key, values in (
            ("step_time", dt),
            ("comm_s", comm),
            ("data_s", data),
            ("compute_s", compute),
        ):
            out[key] = _select(np, has, values)
        positive = has & (dt > 0)
        with np.errstate(divide="ignore", invalid="ignore"):
            for key in ("samples", "tokens"):
                if key in full:
                    out[f"{key}_per_s"] = _select(
                        np, positive & ~np.isnan(full[key]), full[key] / dt
                    )
            if "flops" in full:
                ok = positive & ~np.isnan(full["flops"])
                tflops = full["flops"] / dt / 1e12
                out["tflops"] = _select(np, ok, tflops)
                if peak is not None:
                    peaks = _spread(np, n, *peak)
                    ok &= ~np.isnan(peaks) & (peaks != 0)
                    out["mfu"] = _select(np, ok, tflops / peaks)
    columns = {}
    for key, (idx, values) in out.items():
        if idx is None:
            columns[key] = (None, np.asarray(values, dtype=np.float64))
        elif len(idx):  # a key no point carries is not sent (as a value that is no number)
            columns[key] = (None if len(idx) == n else idx, np.asarray(values, dtype=np.float64))
    if n:  # one number for the whole column: the wire carries it once (wire.column)
        for key, value in reading.items():
            columns[key] = (None, float(value))
    return _steps(points), when, columns


def _steps(points: Points) -> list[int]:
    """Each point's step: a step not given is one more than the point's before."""
    steps = points.steps
    if None not in steps:
        return steps
    out, step = [], points.prev_step
    for given in steps:
        step = step + 1 if given is None else given
        out.append(step)
    return out


def _numbers(raw: dict, left_out: dict) -> None:
    """Each column's values as floats, in place: tensors read in one stack per device;
    a value that is no number (nor a one-element tensor) is left out of its column, and
    described in ``left_out`` under its key (the first of the batch)."""
    tensors: dict[str, list] = {}
    bad = False
    for key, (_, values) in raw.items():
        for j, value in enumerate(values):
            cls = value.__class__
            if cls is float:
                continue
            if cls in _PLAIN:
                if cls is bool and key in _COUNTS:  # flops=True is no count of 1
                    values[j] = None
                    bad = True
                    left_out.setdefault(key, f"{what_it_was(value)}: a count is a number >= 0")
                    continue
                try:
                    values[j] = float(value)
                except OverflowError:  # an int beyond a float's range: this value alone goes
                    values[j] = None
                    bad = True
                    shown = what_it_was(value).rpartition(" (")[0]
                    left_out.setdefault(key, f"{shown} (an int beyond a float's range)")
            elif hasattr(value, "detach"):
                tensors.setdefault(str(value.device), []).append((key, values, j, value))
            else:
                values[j] = number = _as_float(value)
                if number is None:
                    bad = True
                    left_out.setdefault(key, what_it_was(value))
    if tensors:
        import torch

        for items in tensors.values():
            try:
                scalars = [v if v.dim() == 0 else v.reshape(()) for *_, v in items]
                # float64, as a CPU tensor's item() gives: float32 rounds an int64 counter
                # above 2**24 and a float64's digits. Mixed dtypes are made float64 before
                # the stack, which would promote int64 with float32 to float32.
                if len({v.dtype for v in scalars}) > 1:
                    scalars = [v.double() for v in scalars]
                stacked = torch.stack(scalars)
                # .cpu() waits for the device (one sync per flush, never on the training
                # thread) and lets go of the GIL while it waits; made float64 on the host
                # (no kernel of its own on the device).
                numbers = stacked.detach().cpu().double().tolist()
            except Exception:  # one of them is not one element (or not a number)
                numbers = [_as_float(v) if v.numel() == 1 else None for *_, v in items]
            for (key, values, j, value), number in zip(items, numbers):
                values[j] = number
                if number is None:
                    bad = True
                    left_out.setdefault(key, what_it_was(value))
    for key in _COUNTS & raw.keys():
        values = raw[key][1]
        for j, number in enumerate(values):
            # NaN is no count either; inf made MFU inf (and blamed the peak), -1 a rate < 0.
            if number is not None and not 0.0 <= number < math.inf:
                values[j] = None
                bad = True
                left_out.setdefault(key, f"{number!r}: a count is a finite number >= 0")
    if bad:
        for key, (idx, values) in list(raw.items()):
            keep = [j for j, v in enumerate(values) if v is not None]
            if len(keep) < len(values):
                raw[key] = ([j if idx is None else idx[j] for j in keep], [values[j] for j in keep])


def what_it_was(value) -> str:
    """A logged value that is no number, as the user is told about it (short, never raises)."""
    try:
        if hasattr(value, "detach") and hasattr(value, "shape"):
            return f"a tensor of shape {tuple(value.shape)} on {value.device}"
        text = repr(value)
        if len(text) > 40:
            text = text[:37] + "..."
        return f"{text} (a {type(value).__name__})"
    except Exception:
        return f"a {type(value).__name__}"


def _reserved(key: str, value) -> str:
    """What the user is told of a value logged under a name of :data:`RESERVED_KEYS`."""
    meaning, instead = RESERVED_KEYS[key]
    return (
        f"{what_it_was(value)} under {key!r}, a name each point has of its own "
        f"({meaning}): log it under another name, e.g. {instead}="
    )


def _comm(comm: float, events: list) -> float:
    """A step's collective seconds with its CUDA collectives' device time added."""
    try:
        return comm + steptime.events_seconds(events)
    except Exception:
        return math.nan


def _spread(np, n: int, idx: list[int] | None, values: list):
    """A column as a length-``n`` array, NaN where a point does not carry it (``idx``
    None: every point does)."""
    if idx is None:
        return np.array([math.nan if v is None else v for v in values], dtype=np.float64)
    full = np.full(n, math.nan)
    full[idx] = np.array([math.nan if v is None else v for v in values], dtype=np.float64)
    return full


def _select(np, mask, values) -> tuple[list[int] | None, object]:
    if mask.all():  # every point (None: no index list to build, send or store)
        return None, values
    idx = np.flatnonzero(mask)
    return idx.tolist(), values[idx]


def _as_float(value) -> float | None:
    try:
        return float(value)
    except (TypeError, ValueError, OverflowError):
        return None
