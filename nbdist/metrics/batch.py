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

__all__ = ["PEAK", "Points", "to_columns"]

# The key under which a point's peak TFLOP/s waits for flush (never sent).
PEAK = "__peak"
_PLAIN = frozenset((int, float, bool))


class Points:
    """The points logged since the last flush, by field: ``log`` appends, the flush takes
    the whole buffer (under the channel's lock) and leaves a new one in its place."""

    __slots__ = ("n", "steps", "times", "lasts", "comm", "data", "events", "cols")

    def __init__(self) -> None:
        """An empty buffer."""
        self.n = 0
        self.steps: list[int] = []
        self.times: list[float] = []  # each call's time (Unix seconds)
        self.lasts: list[float | None] = []  # when the step before it resumed (None: first)
        self.comm: list[float] = []  # seconds in collectives since the previous call
        self.data: list[float] = []  # seconds in data_timer blocks since the previous call
        self.events: dict[int, list] = {}  # point -> its CUDA collectives' event pairs
        # key -> (indices of the points that carry it, their values as logged)
        self.cols: dict[str, tuple[list[int], list]] = {}


def to_columns(points: Points, reading: dict) -> tuple[list, object, dict]:
    """``(steps, times, columns)`` of ``points``.

    ``times`` and each column's values are float64 arrays (a memory column's, one float
    every point carries); ``columns``: ``{key: (indices or None, values)}``, indices into the batch of the points that carry
    the key (None: every point). ``reading``: the rank's memory now, carried by every
    point of the batch (empty: none).
    """
    import numpy as np

    n = points.n
    raw = points.cols
    _numbers(raw)
    peak = raw.pop(PEAK, None)

    out: dict[str, tuple] = {}
    full: dict[str, np.ndarray] = {}  # the keys derived values need, NaN where absent
    for key, (idx, values) in raw.items():
        if key in ("samples", "tokens", "flops", "data_time"):
            full[key] = _spread(np, n, idx, values)
        out[key] = (idx, values)

    lasts = points.lasts
    if any(last is not None for last in lasts):
        when = np.array(points.times, dtype=np.float64)
        last = np.array([math.nan if t is None else t for t in lasts], dtype=np.float64)
        dt = when - last
        has = ~np.isnan(last)
        comm = np.array(points.comm, dtype=np.float64)
        for i, events in points.events.items():  # CUDA collectives' events to read
            comm[i] = _comm(points.comm[i], events)
        data = np.array(points.data, dtype=np.float64)
        if "data_time" in full:  # the user's own figure wins where logged (NaN: none)
            logged = raw["data_time"][0]
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
        if idx:  # a key no point carries is not sent (as with a value that is no number)
            columns[key] = (None if len(idx) == n else idx, np.asarray(values, dtype=np.float64))
    if n:  # one number for the whole column: the wire carries it once (wire.column)
        for key, value in reading.items():
            columns[key] = (None, float(value))
    return points.steps, np.array(points.times, dtype=np.float64), columns


def _numbers(raw: dict) -> None:
    """Each column's values as floats, in place: tensors read in one stack per device;
    a value that is no number is left out of its column."""
    tensors: dict[str, list] = {}
    bad = False
    for values in (column[1] for column in raw.values()):
        for j, value in enumerate(values):
            cls = value.__class__
            if cls is float:
                continue
            if cls in _PLAIN:
                values[j] = float(value)
            elif hasattr(value, "detach"):
                tensors.setdefault(str(value.device), []).append((values, j, value))
            else:
                values[j] = number = _as_float(value)
                bad = bad or number is None
    if tensors:
        import torch

        for items in tensors.values():
            try:
                stacked = torch.stack([v if v.dim() == 0 else v.reshape(()) for _, _, v in items])
                # .cpu() waits for the device (one sync per flush, never on the training
                # thread) and lets go of the GIL while it waits.
                numbers = stacked.detach().float().cpu().tolist()
            except Exception:
                numbers = [_as_float(v) if v.numel() == 1 else math.nan for _, _, v in items]
            for (values, j, _), number in zip(items, numbers):
                values[j] = number
                bad = bad or number is None
    if bad:
        for key, (idx, values) in list(raw.items()):
            keep = [j for j, v in enumerate(values) if v is not None]
            raw[key] = ([idx[j] for j in keep], [values[j] for j in keep])


def _comm(comm: float, events: list) -> float:
    """A step's collective seconds with its CUDA collectives' device time added."""
    try:
        return comm + steptime.events_seconds(events)
    except Exception:
        return math.nan


def _spread(np, n: int, idx: list[int], values: list):
    """A column as a length-``n`` array, NaN where a point does not carry it."""
    full = np.full(n, math.nan)
    full[idx] = np.array([math.nan if v is None else v for v in values], dtype=np.float64)
    return full


def _select(np, mask, values) -> tuple[list[int], object]:
    idx = np.flatnonzero(mask)
    return idx.tolist(), values[idx]


def _as_float(value) -> float | None:
    try:
        return float(value)
    except (TypeError, ValueError, OverflowError):
        return None
