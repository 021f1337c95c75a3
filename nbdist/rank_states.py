"""Kernel and Jupyter server: the one vocabulary of rank states every view uses.

``%dist_status`` (:meth:`nbdist.DistSession.status`), the dashboard's rank table,
the sidebar's REST API and the JupyterLab status bar all name a rank's state
with these words, and a dead rank is dead in every one of them:

``idle``
    alive, running no cell.
``busy``
    alive and running a cell (or, where only the operating system and the
    run history can be read, as in the Jupyter server: using CPU, or logging).
``dead``
    its process ended, or its engine stopped answering the controller; it
    stays dead until ``%dist_restart``.

Example::

    >>> from nbdist.rank_states import BUSY, RANK_STATES
    >>> BUSY in RANK_STATES
    True
"""

from __future__ import annotations

__all__ = ["BUSY", "DEAD", "IDLE", "RANK_STATES"]

IDLE = "idle"
BUSY = "busy"
DEAD = "dead"
RANK_STATES = (IDLE, BUSY, DEAD)
