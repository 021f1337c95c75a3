"""Kernel side: the ids JupyterLab's debugger is given for the ranks' frames and variables.

Each rank's debugpy numbers its frames and variables from small ids, the same
ranges on every rank and in the kernel's own debugpy. The router in
:mod:`nbdist.driver.lab_debugger` hands JupyterLab ids from :data:`FIRST_ID` up
instead and maps each back to ``(rank, the rank's own id)``. The same object
keeps its id for as long as the router knows it: JupyterLab lists the Callstack
again on every rank's stop and keeps the frame the user selected only if its id
is still listed.
"""

from __future__ import annotations

import threading

__all__ = ["FIRST_ID", "RankIds"]

# Ids handed to JupyterLab for ranks' objects start here; the kernel's own debugpy
# hands out small ones.
FIRST_ID = 1 << 40


class RankIds:
    """Two-way map between the ids JupyterLab holds and ``(rank, rank's id)``; thread-safe."""

    def __init__(self) -> None:
        """Empty: the first id given is :data:`FIRST_ID`."""
        self._lock = threading.Lock()
        self._by_id: dict[int, tuple[int, int]] = {}
        self._by_object: dict[tuple[int, int], int] = {}
        self._next = FIRST_ID

    @staticmethod
    def is_ours(value) -> bool:
        """Whether ``value`` (a frameId, a variablesReference) is an id this map hands out."""
        return isinstance(value, int) and value >= FIRST_ID

    def give(self, rank: int, rank_id: int) -> int:
        """JupyterLab's id for ``rank``'s object ``rank_id``: the one given before, else a new one.

        0 stays 0 (no children, in every DAP message)."""
        if not rank_id:
            return 0
        with self._lock:
            given = self._by_object.get((rank, rank_id))
            if given is None:
                given = self._next
                self._next += 1
                self._by_id[given] = (rank, rank_id)
                self._by_object[(rank, rank_id)] = given
        return given

    def find(self, given: int) -> tuple[int, int] | None:
        """``(rank, rank's id)`` for an id given, None for one this map never gave (or forgot)."""
        return self._by_id.get(given)

    def clear(self) -> None:
        """Forget every id (the debugger was switched off); new ones keep counting up."""
        with self._lock:
            self._by_id.clear()
            self._by_object.clear()
