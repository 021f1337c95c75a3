"""Kernel side: ``%dist_start --check``: rank 0's link with each rank, and a warning for a slow one.

Example (5 ranks, rank 3 behind a slow PCIe path)::

    nbdist: check: links 0↔1-4 median 4.80 GB/s each way, slowest 0↔3 0.80 GB/s (...); 1 far below the others
    nbdist: rank 3's link is 6.1x slower than the median of the others (0.80 vs 4.90 GB/s): check its NIC or PCIe path

The measurement is ``%dist_bench comm``'s send/recv rows alone
(:func:`nbdist.driver.comm_table.pair_rows`), a fraction of a second to a
couple of seconds; :func:`nbdist.driver.comm_table.slow_links` decides what "far below" is.
"""

from __future__ import annotations

import statistics
import time

from nbdist.driver.comm_table import (
    SLOW_FACTOR,
    format_gbs,
    format_size,
    pair_bytes,
    pair_rows,
    rank_memory,
    slow_links,
)
from nbdist.engine import comm_bench
from nbdist.errors import format_ranks

__all__ = ["check_links", "link_report"]

_CHECK_ITERS, _CHECK_WARMUP = 7, 3


def link_report(bandwidth: dict[int, float], how: str) -> list[str]:
    """The check's line for links (rank -> GB/s with rank 0), then a warning per slow link.

    ``how`` says what was measured (size, iterations, seconds). Example::

        >>> link_report({1: 4.9, 2: 5.1, 3: 0.8}, "4 MiB")[1]
        "nbdist: rank 3's link is 6.2x slower than the median of the others (0.80 vs 5.00 GB/s): check its NIC or PCIe path"
    """
    if not bandwidth:
        return ["nbdist: check: one rank, no links to measure"]
    if len(bandwidth) == 1:
        ((peer, gbs),) = bandwidth.items()
        return [
            f"nbdist: check: link 0↔{peer} {format_gbs(gbs)} GB/s each way ({how}); "
            "one link, nothing to compare it with"
        ]
    slow = slow_links(bandwidth)
    low = min(bandwidth, key=bandwidth.get)
    verdict = (
        f"{len(slow)} far below the others" if slow else f"none {SLOW_FACTOR:g}x below the others"
    )
    line = (
        f"nbdist: check: links 0↔{format_ranks(bandwidth).removeprefix('ranks ')} median "
        f"{format_gbs(statistics.median(bandwidth.values()))} GB/s each way, slowest 0↔{low} "
        f"{format_gbs(bandwidth[low])} GB/s ({how}); {verdict}"
    )
    return [line, *(s.warning() for s in slow)]


def check_links(session) -> list[str]:
    """``%dist_start --check``: rank 0's send/recv with each rank (~2 s): :func:`link_report`'s lines.

    Never raises for a failed measurement (the group is up; the check only
    reports): the line then says why it could not measure.
    """
    started = time.perf_counter()
    try:
        kind, free, _ = rank_memory(session)
        nbytes = pair_bytes(kind, free)
        found = session.apply(comm_bench.time_pairs, nbytes, _CHECK_ITERS, _CHECK_WARMUP)
    except Exception as exc:  # a report, not a failure of %dist_start
        return [f"nbdist: check: could not measure the links ({type(exc).__name__}: {exc})"]
    if found[0]["skipped"]:
        return [
            f"nbdist: check: skipped, send/recv missing here ({found[0]['skipped']['sendrecv']})"
        ]
    rows = pair_rows(found)
    bandwidth = {int(r["ranks"].split("↔")[1]): r["algbw_gbs"] for r in rows}
    how = (
        f"{format_size(rows[0]['bytes']) if rows else ''} both ways, median of {_CHECK_ITERS}; "
        f"{time.perf_counter() - started:.1f} s"
    )
    return link_report(bandwidth, how)
