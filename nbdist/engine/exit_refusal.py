"""Rank side: ``exit()`` and ``quit()`` in a cell raise instead of ending the rank's process.

In a Jupyter kernel ``exit()`` ends the kernel, which a notebook's own kernel survives
(the frontend offers a restart). On a rank it ended the engine's process: the rank died
("exited with code 1", nothing more), the process group with it, and every rank's state
was lost to the ``%dist_restart`` it took — for a line often copied from a script
(``if bad: exit()``). :func:`install` makes the rank's ``exit``/``quit`` raise
:class:`ExitOnRank` instead, which ends the cell like any error and keeps the rank, its
state and the group. ``exit(keep_kernel=True)`` asks for no end and still does nothing.

``sys.exit(n)`` already only raises ``SystemExit`` in a cell (the cell fails with
"SystemExit: n"); IPython then also warns "To exit: use 'exit', 'quit', or Ctrl-D.",
advice that is wrong on a rank, so that one warning is not shown there.

Example (on a rank)::

    >>> exit()
    ExitOnRank: exit() and quit() would end this rank's process and the process group with it ...
"""

from __future__ import annotations

import warnings

__all__ = ["ExitOnRank", "install"]

_WORDS = (
    "exit() and quit() would end this rank's process and the process group with it (every rank "
    "would need %dist_restart); this rank keeps running, its variables and the group as "
    "they were. To end a cell early, raise an exception; to stop the ranks, run "
    "%dist_stop in the notebook"
)


class ExitOnRank(RuntimeError):
    """``exit()`` or ``quit()`` was called on a rank; the rank keeps running."""


def install(shell) -> None:
    """Make ``exit()``/``quit()`` on this engine's ``shell`` raise :class:`ExitOnRank` (idempotent)."""
    ask_exit = shell.ask_exit
    if getattr(ask_exit, "nbdist_original", None) is not None:
        return

    def refuse_exit() -> None:
        if shell.keepkernel_on_exit:  # exit(keep_kernel=True): no end asked for
            ask_exit()
            return
        raise ExitOnRank(_WORDS)

    refuse_exit.nbdist_original = ask_exit
    # An instance attribute: ipykernel's ExitAutocall calls shell.ask_exit() for both names.
    shell.ask_exit = refuse_exit
    warnings.filterwarnings(
        "ignore", message=r"To exit: use 'exit', 'quit', or Ctrl-D\.", category=UserWarning
    )
