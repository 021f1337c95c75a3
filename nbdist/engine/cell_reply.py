"""Rank side: what a rank says about itself at the end of each cell, in its execute reply.

The kernel sends every cell with one Jupyter *user expression*
(:data:`nbdist.driver.cells.AFTER_CELL`) that calls :func:`after_cell` right
after the cell, in the rank's namespace, where ``get_ipython`` is defined. The
answer rides on the execute reply the kernel waits for anyway:

- the rank's running count of ``nbdist.log`` points sent (it sends what the
  cell logged first), so the kernel knows how many points to wait for;
- the shell's ``ast_node_interactivity``, which says whether a cell with no
  expression to show may be sent *silent*.
"""

from __future__ import annotations

from nbdist.metrics.log import end_of_cell

__all__ = ["after_cell"]


def after_cell(shell=None) -> str:
    """``"<points sent> <ast_node_interactivity>"`` (-1: no metrics channel; 'unknown': no shell)."""
    total = end_of_cell()
    interactivity = getattr(shell, "ast_node_interactivity", None) or "unknown"
    return f"{-1 if total is None else total} {interactivity}"
