"""Kernel side: post-mortem pdb on a rank (what ``%dist_debug`` calls), through the notebook's stdin.

Each rank keeps the exception of its last failed cell (IPython stores it in
``sys.last_traceback`` there when it shows the error). :func:`post_mortem_on_rank`
runs :func:`nbdist.engine.stdin_bridge.post_mortem` on one rank as a cell:
pdb opens on the frame that raised, its prompts are served like any rank's
``breakpoint()`` (:mod:`nbdist.driver.prompts`), and ``q`` ends it with the
rank ready for the next cell.

Example (a script; in a notebook ``%dist_debug`` does the same)::

    try:
        s.run("def f(z):\\n    return z / 0\\nf(rank)")
    except nbdist.RankError as exc:
        post_mortem_on_rank(s, failed_rank(exc))   # (Pdb rank 0) p z
"""

from __future__ import annotations

from nbdist.errors import RankError, RanksInterrupted

__all__ = ["POST_MORTEM", "failed_rank", "post_mortem_on_rank"]

# Run on the rank as a cell; leaves no name behind in the rank's namespace.
POST_MORTEM = "__import__('nbdist.engine.stdin_bridge', fromlist=['_']).post_mortem()"


def failed_rank(error: BaseException | None) -> int | None:
    """The lowest rank whose own error failed the cell that raised ``error`` (None: not a rank's).

    ``error``: a :class:`~nbdist.errors.RankError` (or an interrupted cell's
    :class:`~nbdist.errors.RanksInterrupted`) as the kernel raised it.
    """
    if isinstance(error, RanksInterrupted):
        error = error.stopped
    if not isinstance(error, RankError):
        return None
    return error.ranks[0]


def post_mortem_on_rank(session, rank: int) -> None:
    """pdb on ``rank``'s last failed cell, at the frame that raised; returns when the user quits (q)."""
    session.run(POST_MORTEM, ranks=[rank])


def __getattr__(name: str):
    """``post_mortem``, the former name of :func:`post_mortem_on_rank` (deprecated)."""
    if name == "post_mortem":
        import warnings

        warnings.warn(
            "nbdist.driver.debugging.post_mortem is deprecated: use post_mortem_on_rank",
            DeprecationWarning,
            stacklevel=2,
        )
        return post_mortem_on_rank
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
