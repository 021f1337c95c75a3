"""Kernel side: the whole output of one rank in the latest cell, ``nbdist.output(rank=3)``.

A cell's folded output keeps the latest lines of each rank
(``NBDIST_OUTPUT_LINES``, 1000 by default) and says how many earlier ones it
left out; this is where they are read::

    >>> print(nbdist.output(rank=3))                    # doctest: +SKIP
    epoch 0 done
    ...

It covers the latest cell run on the ranks in this kernel (``%%on_all_ranks``,
``DistSession.run``, the group forming of ``%dist_start``), as far as it was
streamed (``NBDIST_OUTPUT_LIMIT`` characters per rank and stream).
"""

from __future__ import annotations

import threading

from nbdist.driver.output import STREAMS
from nbdist.errors import NbdistError, format_ranks

__all__ = ["RankOutput", "output", "remember"]

_lock = threading.Lock()
_latest = None  # the OutputMerger of the latest cell


class RankOutput(str):
    """One rank's output, a ``str`` that IPython shows as the text itself (not its repr)."""

    def _repr_pretty_(self, printer, cycle: bool) -> None:
        printer.text(str(self))


def remember(merger) -> None:
    """Make ``merger`` (an :class:`~nbdist.driver.output.OutputMerger`) the latest cell's output."""
    global _latest
    with _lock:
        _latest = merger


def output(rank: int = 0, stream: str | None = None) -> RankOutput:
    """The latest cell's whole output of ``rank``, as it printed it.

    ``stream``: ``"stdout"`` or ``"stderr"`` (None: both, in the order they came).
    Example: ``nbdist.output(rank=3)``; ``print(nbdist.output(3, "stderr"))``.
    """
    if stream is not None and stream not in STREAMS:
        raise ValueError(f"stream must be 'stdout', 'stderr' or None (both), got {stream!r}")
    with _lock:
        merger = _latest
    if merger is None:
        raise NbdistError(
            "no cell has run on the ranks in this kernel yet: nbdist.output reads the latest one"
        )
    if rank not in merger.ranks:
        raise ValueError(
            f"rank {rank!r} did not run the latest cell ({format_ranks(merger.ranks)}); "
            "pass one of those"
        )
    return RankOutput(merger.rank_output(rank, stream))
