"""Rank side: one flush's points, as ``nbdist.log`` queued them, turned into columns.

``log`` only stamps and appends ``(step, time, previous call's time, {key: value},
step timers, memory reading or None)``; the flush thread hands the batch to
:func:`to_columns`, which reads the tensors (one ``torch.stack`` per device, the
batch's one device sync) and works out every derived key for the whole batch at
once with numpy: step time and its breakdown, throughput, TFLOP/s and MFU, and
the memory reading carried by every point. The result is what goes on the wire
(:mod:`nbdist.metrics.wire`): each key's name once per batch, its values as one
list, so neither side builds a dictionary per point (bench/RESULTS.md: this
moved the flush thread from ~11 us of CPU per point to a few).

The values are the same floats, to the bit, as one point at a time gives: the
same IEEE operations in the same order (``step_time - comm - data``, ``samples /
step_time``, ``flops / step_time / 1e12``).
"""

from __future__ import annotations

import math

from nbdist.metrics import steptime

__all__ = ["PEAK", "to_columns"]

# The key under which a point's peak TFLOP/s waits for flush (never sent).
PEAK = "__peak"
_PLAIN = frozenset((int, float, bool))


def to_columns(batch: list[tuple], reading: dict) -> tuple[list, list, dict, dict]:
    """``(steps, times, columns, last reading)`` of ``batch``.

    ``times`` and each column's values are float64 arrays; ``columns``: ``{key:
    (indices or None, values)}``, indices into the batch of the points that carry
    the key (None: every point). ``reading``: the memory reading the previous flush ended
    with, carried by the points before this batch's first one.
    """
    import numpy as np

    n = len(batch)
    steps = [p[0] for p in batch]
    times = [p[1] for p in batch]
    raw: dict[str, tuple[list[int], list]] = {}
    for i, point in enumerate(batch):
        for key, value in point[3].items():
            column = raw.get(key)
            if column is None:
                column = raw[key] = ([], [])
            column[0].append(i)
            column[1].append(value)
    _numbers(raw)
    peak = raw.pop(PEAK, None)

    out: dict[str, tuple] = {}
    full: dict[str, np.ndarray] = {}  # the keys derived values need, NaN where absent
    for key, (idx, values) in raw.items():
        if key in ("samples", "tokens", "flops", "data_time"):
            full[key] = _spread(np, n, idx, values)
        out[key] = (idx, values)
    reading = _memory(batch, reading, out)

    lasts = [p[2] for p in batch]
    if any(last is not None for last in lasts):
        when = np.array(times, dtype=np.float64)
        last = np.array([math.nan if t is None else t for t in lasts], dtype=np.float64)
        dt = when - last
        has = ~np.isnan(last)
        timers = [p[4] for p in batch]
        if any(t[2] for t in timers):  # CUDA collectives' events to read
            comm = np.array([_comm(t) for t in timers], dtype=np.float64)
        else:
            comm = np.array([t[0] for t in timers], dtype=np.float64)
        data = np.array([t[1] or 0.0 for t in timers], dtype=np.float64)
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
    return steps, np.array(times, dtype=np.float64), columns, reading


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


def _memory(batch: list[tuple], reading: dict, out: dict) -> dict:
    """Every point carries the latest memory reading: add those columns to ``out``;
    returns the reading the batch ends with."""
    segments = []  # (first point, reading) where a new reading starts
    start = 0
    for i, point in enumerate(batch):
        if point[5] is not None:
            if i > start and reading:
                segments.append((start, i, reading))
            reading, start = point[5], i
    if len(batch) > start and reading:
        segments.append((start, len(batch), reading))
    for first, end, values in segments:
        for key, value in values.items():
            column = out.get(key)
            if column is None:
                column = out[key] = ([], [])
            column[0].extend(range(first, end))
            column[1].extend([value] * (end - first))
    return reading


def _comm(timers: tuple) -> float:
    comm, _data, events = timers
    if events:  # CUDA collectives: the device time between their events
        try:
            comm += steptime.events_seconds(events)
        except Exception:
            comm = math.nan
    return comm


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
