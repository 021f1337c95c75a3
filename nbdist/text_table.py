"""Kernel and Jupyter server: the one plain-text table every text view of nbdist prints.

``%dist_status``, ``%dist_sessions``, ``%dist_bench comm``, a profile's summary and the
dashboard's text form all print rows under a header line. They share this formatter so
that columns line up the same way everywhere: text columns align left, numbers right,
two blanks between columns, no trailing blanks.

>>> print(format_table(["rank", "loss"], [["0", "0.25"], ["1", "0.5"]], right={0, 1}))
rank  loss
   0  0.25
   1   0.5

Pure Python, imported by every side that prints a table (no IPython, no torch).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence

__all__ = ["format_table"]


def format_table(
    header: Sequence[str] | None,
    rows: Iterable[Sequence[object]],
    *,
    right: Collection[int] = (),
    sep: str = "  ",
) -> str:
    """Rows under an optional header, each column as wide as its widest cell.

    ``right`` holds the indices of the columns aligned right (numbers); every other
    column aligns left. Cells are turned into text with ``str``; ``None`` shows as ``-``.
    A row shorter than the widest one is padded with empty cells. Each line loses its
    trailing blanks, so the last column never pads the line.
    """
    table = [[_cell(c) for c in row] for row in rows]
    if header is not None:
        table.insert(0, [str(h) for h in header])
    if not table:
        return ""
    ncols = max(len(row) for row in table)
    for row in table:
        row.extend([""] * (ncols - len(row)))
    widths = [max(len(row[i]) for row in table) for i in range(ncols)]
    lines = []
    for row in table:
        cells = [
            cell.rjust(w) if i in right else cell.ljust(w)
            for i, (cell, w) in enumerate(zip(row, widths))
        ]
        lines.append(sep.join(cells).rstrip())
    return "\n".join(lines)


def _cell(value: object) -> str:
    return "-" if value is None else str(value)
