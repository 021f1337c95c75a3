"""Kernel side: what the dashboard says the ranks lost of what was logged.

Two kinds of loss, both rare and both worth a line under the table (text and
widget alike), since a chart that silently lacks a key looks like a bug in the
chart: points a rank could not send (a full buffer, a ``step`` that was no
number: :attr:`Run.dropped <nbdist.metrics.run.Run.dropped>`, with the first
error), and values ``nbdist.log`` left out of a point because they were no
number (:attr:`Run.left_out <nbdist.metrics.run.Run.left_out>`, the first per
key).

Example::

    >>> from nbdist.metrics.run import Run
    >>> run = Run(1, world_size=2)
    >>> run.set_left_out(1, {"note": "'fast' (a str)"})
    >>> loss_lines(run)
    ["'note' left out of the charts: rank 1 logged 'fast' (a str); log a Python number or a one-element tensor"]
"""

from __future__ import annotations

__all__ = ["loss_lines"]

FIX = "log a Python number or a one-element tensor"


def loss_lines(run) -> list[str]:
    """One line for the points dropped on the ranks (with the first error that dropped
    any), one each for messages the kernel could not read and history writes that failed,
    one per key left out; empty when nothing was lost."""
    dropped = {r: n for r, n in sorted(getattr(run, "dropped", {}).items()) if n}
    left_out = dict(getattr(run, "left_out", {}))
    error = left_out.pop("", None)
    lines = []
    if dropped:
        each = ", ".join(f"rank {r}: {n}" for r, n in dropped.items())
        total = sum(dropped.values())
        line = f"{total} point{'s' if total != 1 else ''} dropped on the ranks ({each})"
        if error is not None:
            line += f"; the first by an error on rank {error[0]}: {error[1]}"
        lines.append(line)
    kernel = getattr(run, "kernel_losses", {})
    if "unread" in kernel:
        count, first = kernel["unread"]
        lines.append(
            f"{count} message{'s' if count != 1 else ''} of points from the ranks could not be "
            f"read in the kernel (their points are missing); the first: {first}"
        )
    if "unstored" in kernel:
        count, first = kernel["unstored"]
        lines.append(
            f"the run's history could not be written {count} time{'s' if count != 1 else ''} "
            f"(the live charts have the points, the history may not); the first: {first}"
        )
    for key, (rank, what) in sorted(left_out.items()):
        # A value under a reserved name (nbdist.metrics.batch.RESERVED_KEYS) was a number:
        # its note says which name to log it under instead, not to log a number.
        fix = "" if "log it under another name" in what else f"; {FIX}"
        lines.append(f"{key!r} left out of the charts: rank {rank} logged {what}{fix}")
    return lines
