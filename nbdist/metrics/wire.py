"""Both sides: the metrics wire format, JSON payloads signed with the cluster's key.

Ranks and the kernel share the ipyparallel cluster key (every engine's kernel
session already holds it). Each message is two frames, ``[signature,
payload]`` with ``signature = HMAC-SHA256(key, payload)`` in hex; the kernel
drops any message whose signature does not match before decoding it, and the
payload is JSON, never pickle, so nothing that arrives is executed.

Payload kinds::

    {"k": "points", "rank": 0, "step0": 0, "n": 3, "times": "<float64s>",
     "cols": {"loss": [null, "<float64s>"], "step_time": [[1, 2], "<float64s>"],
              "compute_s": [null, {"same": "step_time"}], "memory_mib": [null, 812.5]},
     "total": 3000, "dropped": 0}
    {"k": "cell", "rank": 0, "cell": 1, "total": 3000}   # end of a standalone script's run

A points message is a batch as columns: its steps as the first and the count when
they follow one another (``step0``, ``n``; else a list, ``steps``), and each key
once, with the indices (into the steps) of the points that carry it, or null when
every point does, and its values as base64 of little-endian float64s
(:func:`floats`; NaN travels as NaN); for a value every point of the column shares
(the memory reading of a flush), that one number (null for NaN); for values the
same to the bit as an earlier column's (``compute_s`` of a step without
collectives is its ``step_time``), that column's name (:func:`points_message`).
Per-point dictionaries, each float written out in decimal, and each step and index
as a JSON number, were most of what a point cost the rank's flush thread and the
kernel (bench/RESULTS.md). A column's values may also be a JSON list (null for
NaN), as may the older per-point form, ``"points": [[step, time, {"loss": 0.5,
...}], ...]``: all are still read (:func:`columns`), so histories written before
keep loading.

``total`` is the rank's running count of points sent, this message's included.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import math

__all__ = [
    "batch_columns",
    "column",
    "columns",
    "concat",
    "decode",
    "encode",
    "floats",
    "points",
    "point_columns",
    "points_message",
]


def encode(key: bytes, message: dict) -> list[bytes]:
    """The two frames ``[signature, payload]`` of ``message``: JSON, signed with ``key``."""
    payload = json.dumps(message, separators=(",", ":")).encode()
    return [_sign(key, payload), payload]


def decode(key: bytes, frames: list[bytes]) -> dict | None:
    """The message, or None if it is malformed or not signed with ``key``."""
    if len(frames) != 2:
        return None
    signature, payload = frames
    if not hmac.compare_digest(signature, _sign(key, payload)):
        return None
    try:
        message = json.loads(payload)
    except ValueError:
        return None
    return message if isinstance(message, dict) else None


def _sign(key: bytes, payload: bytes) -> bytes:
    return hmac.new(key, payload, hashlib.sha256).hexdigest().encode()


def point_columns(points) -> tuple[list, list, dict]:
    """``(steps, times, {key: (indices, values)})`` of ``(step, time, {key: value})`` points,
    each key with the indices of the points that carry it."""
    steps, times, cols = [], [], {}
    for i, (step, when, values) in enumerate(points):
        steps.append(step)
        times.append(when)
        for key, value in values.items():
            column = cols.get(key)
            if column is None:
                column = cols[key] = ([], [])
            column[0].append(i)
            column[1].append(value)
    return steps, times, cols


def columns(message: dict) -> tuple[list, list, dict]:
    """``(steps, times, {key: (indices or None, values)})`` of a points message, either
    form; NaN (JSON's null) restored. ``indices`` None: the key is on every point."""
    if "points" in message:  # the per-point form
        steps, times, cols = point_columns(message["points"])
    else:
        if "step0" in message:  # steps that follow one another
            step0 = message["step0"]
            steps = list(range(step0, step0 + message.get("n", 0)))
        else:
            steps = message.get("steps", [])
        times, cols = _values(message.get("times", [])), {}
        for key, (idx, values) in message.get("cols", {}).items():
            if values is None or isinstance(values, (int, float)):  # one value for all
                value = math.nan if values is None else float(values)
                cols[key] = (idx, [value] * (len(steps) if idx is None else len(idx)))
            elif isinstance(values, dict):  # the same values as an earlier column
                cols[key] = (idx, cols[values["same"]][1])
            else:
                cols[key] = (idx, _values(values))
        return steps, times, cols
    for key, (idx, values) in cols.items():
        if None in values:
            cols[key] = (idx, [math.nan if v is None else v for v in values])
    return steps, times, cols


def concat(batches: list[tuple[list, list, dict]]) -> tuple[list, list, dict]:
    """Several batches of one rank's columns (as :func:`columns` gives them) as one.

    A key on every point of every batch stays ``None`` (on every point): the run then
    takes its values whole (``RankSeries.extend``'s fast path) instead of index by index.
    """
    if len(batches) == 1:
        return batches[0]
    steps, times, cols = [], [], {}
    for b_steps, b_times, b_cols in batches:
        start, n = len(steps), len(b_steps)
        steps.extend(b_steps)
        times.extend(b_times)
        for key, (idx, values) in b_cols.items():
            column = cols.get(key)
            if column is None:
                column = cols[key] = [None, []]  # None: on every point so far
            if idx is None and column[0] is None and len(column[1]) == start:
                column[1].extend(values)
                continue
            if column[0] is None:
                column[0] = list(range(len(column[1])))
            column[0].extend(range(start, start + n) if idx is None else [start + i for i in idx])
            column[1].extend(values)
    # A key on every point of the first batches and missing from a later one is on the
    # points before that one only: named by index, or the run would put the key's next
    # values at the wrong points.
    return (
        steps,
        times,
        {
            key: (
                list(range(len(values))) if idx is None and len(values) != len(steps) else idx,
                values,
            )
            for key, (idx, values) in cols.items()
        },
    )


def batch_columns(stored) -> tuple[dict, tuple[list, list, dict]]:
    """A history row's batch (the message as it arrived, or a bare list of points): the
    message's other fields (``dropped``, ``total``; empty for a bare list) and its columns."""
    message = stored if isinstance(stored, dict) else {"points": stored}
    return message, columns(message)


def points_message(
    rank: int, steps: list[int], times, columns: dict, total: int, dropped: int
) -> dict:
    """The points message of one batch (rank side): ``columns`` as :func:`to_columns
    <nbdist.metrics.batch.to_columns>` gives them, each encoded once (:func:`column`), a
    column the same to the bit as an earlier one named instead of repeated."""
    n = len(steps)
    message: dict = {"k": "points", "rank": rank}
    if n and steps[-1] - steps[0] == n - 1 and steps == list(range(steps[0], steps[0] + n)):
        message["step0"], message["n"] = steps[0], n
    else:
        message["steps"] = steps
    message["times"] = floats(times)
    cols, seen = {}, {}
    for key, (idx, values) in columns.items():
        encoded = column(values)
        if isinstance(encoded, str):
            first = seen.setdefault(encoded, key)
            if first != key and cols[first][0] == idx:  # the same points, the same values
                encoded = {"same": first}
        cols[key] = (idx, encoded)
    message.update(cols=cols, total=total, dropped=dropped)
    return message


def column(values) -> str | float | None:
    """A column's values as the wire carries them: :func:`floats`, or a single float
    (None for NaN) that stands for every point of the column.

    ``values``: a float (every point's), or a float64 array, sent as one number when
    all its values are the same to the bit (``samples`` of a fixed batch size, ``comm_s``
    of a step without collectives): both sides then skip that column's encoding.
    """
    if not isinstance(values, float):
        import numpy as np

        values = np.asarray(values, dtype="<f8")
        bits = values.view("<i8")
        if len(bits) < 2 or (bits != bits[0]).any():
            return base64.b64encode(values.tobytes()).decode("ascii")
        values = float(values[0])
    return None if math.isnan(values) else values


def floats(values) -> str:
    """``values`` (numbers; None for NaN) as the wire carries a column: base64 of float64s."""
    import numpy as np

    return base64.b64encode(np.asarray(values, dtype="<f8").tobytes()).decode("ascii")


def _values(values) -> list:
    """A column's values as Python floats: from :func:`floats`' text, or a JSON list."""
    if isinstance(values, str):
        import numpy as np

        return np.frombuffer(base64.b64decode(values), dtype="<f8").tolist()
    if None in values:
        return [math.nan if v is None else v for v in values]
    return values


def points(stored) -> list[tuple[int, float, dict]]:
    """A history row's batch (either form) as ``(step, time, {key: value})`` points, for
    readers that want points rather than columns (the sidebar); NaN as NaN."""
    _, (steps, times, cols) = batch_columns(stored)
    out = [(step, when, {}) for step, when in zip(steps, times)]
    for key, (idx, values) in cols.items():
        for i, value in zip(range(len(out)) if idx is None else idx, values):
            out[i][2][key] = value
    return out
