"""Kernel side: magics that measure the ranks' hardware: %dist_bench.

(Filled in with the magics; registered by :func:`nbdist.magics.register`.)
"""

from __future__ import annotations

from IPython.core.magic import Magics, magics_class

__all__ = ["PerfMagics"]


@magics_class
class PerfMagics(Magics):
    """Magics that reach the session through nbdist's :class:`~nbdist.magics.DistMagics`."""

    def __init__(self, shell, dist_magics):
        """Magics for ``shell`` that use ``dist_magics.session`` and ``dist_magics.run_on_ranks``."""
        super().__init__(shell)
        self.dist = dist_magics
