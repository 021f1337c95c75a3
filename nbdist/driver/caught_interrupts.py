"""Kernel side: which interrupted ranks caught the KeyboardInterrupt and run on.

A Ctrl-C relays SIGINT to the ranks. Where it raised KeyboardInterrupt in the user's
code and that code caught it, an ``except KeyboardInterrupt`` or ``finally`` block
runs (a checkpoint saved on Ctrl-C, Lightning's or a DataLoader's shutdown): the
rank is still busy with the request half a second later, as one the SIGINT did not
reach is. The guards SIGINT again only the second kind; a rank that caught it runs
its handling code to the end and the cell waits for it, as a kernel of its own
would, until a second Ctrl-C (:mod:`nbdist.driver.runner`).

Each rank says so itself, on its control channel
(:func:`nbdist.engine.late_interrupt.caught_in`): a rank paused in debugpy does not
count (debugpy swallows the KeyboardInterrupt), nor does one that does not answer.
"""

from __future__ import annotations

from collections.abc import Sequence

from nbdist.driver.where import control_request

__all__ = ["ASK_S", "caught_interrupt"]

# How long the ranks' answers are waited for: the control thread answers at once unless
# native code holds the GIL (then the rank is not running Python code that caught anything).
ASK_S = 1.0


def caught_interrupt(run, ranks: Sequence[int], timeout: float = ASK_S) -> set[int]:
    """Those of ``ranks`` (of ``run``, a :class:`~nbdist.driver.runner.RankRun`) whose code
    caught the interrupt's KeyboardInterrupt and still runs the request."""
    requests = run.requests(ranks)
    if not requests:
        return set()
    asked = sorted(requests)
    replies = control_request(
        run.client,
        [requests[r][0] for r in asked],
        "caught",
        timeout,
        per_engine=[{"msg_id": requests[r][1]} for r in asked],
    )
    return {rank for rank, reply in zip(asked, replies) if reply and reply.get("caught")}
