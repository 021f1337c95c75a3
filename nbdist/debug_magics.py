"""Kernel side: %dist_debug (post-mortem pdb on a rank) and the other debugging magics.

Registered by :func:`nbdist.magics.register`; each magic parses its line and
calls the library (:mod:`nbdist.driver.debugging`). How debugging on the
ranks works, with a worked session: docs/debugging.md.
"""

from __future__ import annotations

import sys

from IPython.core.error import UsageError
from IPython.core.magic import Magics, line_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments

from nbdist.magic_args import parse_magic_line

__all__ = ["DebugMagics"]


@magics_class
class DebugMagics(Magics):
    """Magics that reach the session through nbdist's :class:`~nbdist.magics.DistMagics`."""

    def __init__(self, shell, dist_magics):
        """Magics for ``shell`` that use ``dist_magics.session`` and ``dist_magics.run_on_ranks``."""
        super().__init__(shell)
        self.dist = dist_magics

    @magic_arguments()
    @argument("--rank", default=None, help="the rank to debug (default: the one that failed)")
    @line_magic
    def dist_debug(self, line=""):
        """Post-mortem pdb on the frame where the last failed cell raised, on the rank that failed.

        The debugger runs on the rank; its prompt, ``(Pdb rank 1)``, is the
        notebook's input box (Jupyter's stdin channel) and its output streams
        into the cell. ``p z``, ``up``, ``ll``, ``w`` work as in pdb; ``q`` leaves
        it and the ranks are ready for the next cell. Without --rank: the lowest
        rank whose own error failed the last failed cell (ranks released from a
        collective because of it are not chosen; --rank R picks any rank, e.g.
        to see where a released rank was waiting). Example::

            %%on_all_ranks
            def f(z):
                return 1 / (z - rank)
            f(1)                      # ZeroDivisionError on rank 1

            %dist_debug
            # post-mortem of rank 1: ZeroDivisionError: division by zero
            # (Pdb rank 1) p z
            # [rank 1] 1

        A front end without stdin (nbclient or nbconvert without allow_stdin,
        papermill) gets an error at once. Breakpoints (``breakpoint()`` in a
        cell) use the same path; see docs/debugging.md.
        """
        from nbdist.driver.debugging import failed_rank, post_mortem
        from nbdist.launch.values import is_digits

        args = parse_magic_line(self.dist_debug, line)
        session = self.dist.session
        if session is None or not session.running:
            raise UsageError(
                "no nbdist cluster is running: start one with %dist_start (e.g. %dist_start 2)"
            )
        if args.rank is not None:
            if not is_digits(args.rank) or int(args.rank) >= session.world_size:
                raise UsageError(
                    f"--rank {args.rank!r}: give a rank of this cluster, 0..{session.world_size - 1}"
                )
            rank = int(args.rank)
        else:
            # The error IPython showed last, as its own %debug uses it.
            last = getattr(sys, "last_exc", None) or getattr(sys, "last_value", None)
            rank = failed_rank(last)
            if rank is None:
                raise UsageError(
                    "%dist_debug: the last error was not a failed cell on the ranks; "
                    "name a rank to debug its last failed cell, e.g. %dist_debug --rank 1"
                )
        post_mortem(session, rank)
