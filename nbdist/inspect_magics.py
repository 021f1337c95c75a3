"""Kernel side: %dist_diff (which ranks' values differ) and other magics that look at the ranks' state.

(Filled in with the magics; registered by :func:`nbdist.magics.register`.)
"""

from __future__ import annotations

from IPython.core.magic import Magics, magics_class

__all__ = ["InspectMagics"]


@magics_class
class InspectMagics(Magics):
    """Magics that reach the session through nbdist's :class:`~nbdist.magics.DistMagics`."""

    def __init__(self, shell, dist_magics):
        """Magics for ``shell`` that use ``dist_magics.session`` and ``dist_magics.run_on_ranks``."""
        super().__init__(shell)
        self.dist = dist_magics
