"""Kernel side: a run's points as TensorBoard event files, one run directory per rank.

Example::

    run = nbdist.current_session().metrics      # or nbdist.runs()[-1].load()
    run.to_tensorboard("tb/run-7")               # then: tensorboard --logdir tb

Each rank gets its own directory (``rank0``, ``rank1``, ...), which TensorBoard
shows as a run of its own, and each series (``loss``, ``samples_per_s``,
``step_time``...) is a tag in it: one chart per series with one line per rank,
at the point's step and wall time, as a 32-bit float (TensorBoard's scalar); NaN
stays NaN. Writing needs the ``tensorboard`` package (``pip install tensorboard``),
imported only here. Every call writes new event files next to any already in ``logdir``, so export
a run into a directory of its own (TensorBoard would show both copies).
"""

from __future__ import annotations

import os

__all__ = ["to_tensorboard"]


def to_tensorboard(run, logdir: str | os.PathLike, *, keys=None) -> list[str]:
    """Write ``run``'s points under ``logdir``; returns the per-rank directories written.

    ``run``: a :class:`~nbdist.metrics.run.Run` (the session's, or one loaded from
    the history). ``keys``: the series to write (default: every one the run has).
    """
    try:
        from tensorboard.compat.proto.event_pb2 import Event
        from tensorboard.compat.proto.summary_pb2 import Summary
        from tensorboard.summary.writer.event_file_writer import EventFileWriter
    except ImportError as exc:
        raise ImportError(
            "run.to_tensorboard(...) writes TensorBoard's event files with the tensorboard "
            "package, which is not installed: pip install tensorboard"
        ) from exc
    wanted = list(run.keys()) if keys is None else list(keys)
    unknown = [key for key in wanted if not isinstance(key, str)]
    if unknown:
        raise TypeError(f"keys must be series names (str), got {unknown!r}: e.g. keys=['loss']")
    wanted_set = set(wanted)
    written: list[str] = []
    writer = None
    rank = None
    try:
        for row in run.rows():  # rank by rank, each rank's points in arrival order
            if row["rank"] != rank:
                if writer is not None:
                    writer.close()  # flushes its queue to disk
                rank = row["rank"]
                written.append(os.path.join(os.fspath(logdir), f"rank{rank}"))
                writer = EventFileWriter(written[-1])
            values = [
                Summary.Value(tag=key, simple_value=value)
                for key, value in row.items()
                if key in wanted_set
            ]
            if values:
                event = Event(wall_time=row["time"], step=int(row["step"]))
                event.summary.CopyFrom(Summary(value=values))
                writer.add_event(event)
    finally:
        if writer is not None:
            writer.close()
    return written
