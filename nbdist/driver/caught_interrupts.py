"""Kernel side: which interrupted ranks caught the KeyboardInterrupt and run on.

A Ctrl-C relays SIGINT to the ranks. Where it raised KeyboardInterrupt in the user's
code and that code caught it, an ``except KeyboardInterrupt`` or ``finally`` block
runs (a checkpoint saved on Ctrl-C, Lightning's or a DataLoader's shutdown): the
rank is still busy with the request half a second later, as one the SIGINT did not
reach is. The guards SIGINT again only the second kind; a rank that caught it runs
its handling code to the end and the cell waits for it, as a kernel of its own
would, until a second Ctrl-C (:mod:`nbdist.driver.runner`).

Each rank says so itself, on its control channel
(:func:`nbdist.engine.late_interrupt.handling_interrupt`): a rank paused in debugpy
does not count (debugpy swallows the KeyboardInterrupt), nor does one that does not
answer. It answers for the request it runs, which may be one queued before the one
the kernel waits for (a ``--noblock`` cell): the SIGINT landed there, and the waited-for
request is dropped unrun (:mod:`nbdist.driver.missed_interrupt`).
"""

from __future__ import annotations

from collections.abc import Sequence

from nbdist.driver.where import control_request

__all__ = ["ASK_S", "caught_interrupt"]

# How long the ranks' answers are waited for: the control thread answers at once unless
# native code holds the GIL (then the rank is not running Python code that caught anything).
ASK_S = 1.0


def caught_interrupt(run, ranks: Sequence[int], timeout: float = ASK_S) -> set[int]:
    """Those of ``ranks`` (of ``run``, a :class:`~nbdist.driver.runner.RankRun`) that run code
    which caught the interrupt's KeyboardInterrupt: this request's, or that of one before
    it the SIGINT reached instead (this one, queued behind, is dropped meanwhile)."""
    engines = run.engine_ids(ranks)
    if not engines:
        return set()
    asked = sorted(engines)
    replies = control_request(run.client, [engines[r] for r in asked], "caught", timeout)
    return {rank for rank, reply in zip(asked, replies) if reply and reply.get("caught")}
