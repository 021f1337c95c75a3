"""Kernel side: a path out of the notebook, the session's ``%%on_all_ranks`` cells as a ``torchrun`` script.

The script starts with :func:`nbdist.engine.standalone.init`, which gives the cells
the names they had on the ranks (``torch``, ``dist``, ``nbdist``, ``rank``,
``local_rank``, ``world_size``, ``device``; ``nbdist.log`` writes to the run
history), then the cells in the order they ran, then
:func:`nbdist.engine.standalone.finish`.

Cells that only made sense interactively (inspecting a tensor, a plot) are left
out when they carry the marker comment ``# nbdist: no-export`` (or ran with
``%%on_all_ranks --no-export``). Cells run with ``--ranks``/``%%on_rank`` and
cells that failed are never recorded. Values pushed from the notebook
(``%dist_push``) are not in the script: define them in a cell instead.

Example::

    >>> text = script_text(["x = torch.ones(2) * rank", "# nbdist: no-export\\nprint(x)"])
    >>> "x = torch.ones(2) * rank" in text, "print(x)" in text
    (True, False)

In a notebook: ``%dist_export train.py``, then ``torchrun --nproc_per_node 4 train.py``.
"""

from __future__ import annotations

import ast
import os
import re
from collections.abc import Sequence

from nbdist.errors import NbdistError

__all__ = ["EXPORT_MARK", "NO_EXPORT_MARKER", "exportable_cells", "export_script", "script_text"]

NO_EXPORT_MARKER = "# nbdist: no-export"
# In the first lines of every script written here: %dist_export replaces such a file
# without --force, and no other.
EXPORT_MARK = "Written by nbdist (%dist_export)"
_MARKER = re.compile(r"^\s*#\s*nbdist:\s*no-export\s*$", re.MULTILINE)

_HEADER = '''\
#!/usr/bin/env python
"""{title}

Written by nbdist (%dist_export) from {count} %%on_all_ranks cell(s), in the order they ran.
Run it on one machine:      torchrun --nproc_per_node {ranks} {name}
On several (node R of N):   torchrun --nnodes N --node_rank R --nproc_per_node G \\
                                --master_addr NODE0_IP --master_port 29500 {name}
Under Slurm:                srun python {name}   (with MASTER_ADDR/MASTER_PORT exported)
Metrics from nbdist.log go to the run history: nbdist.runs()[-1].to_pandas()
"""

import torch
import torch.distributed as dist

import nbdist
from nbdist.engine.standalone import finish as _nbdist_finish
from nbdist.engine.standalone import init as _nbdist_init

rank, local_rank, world_size, device = _nbdist_init({backend!r})
'''

_FOOTER = """
_nbdist_finish()
"""


def exportable_cells(cells: Sequence[str]) -> list[str]:
    """The cells to export: those without the ``# nbdist: no-export`` marker, blank ones dropped."""
    return [c for c in cells if c.strip() and not _MARKER.search(c)]


def _check_plain_python(code: str, number: int) -> None:
    try:
        ast.parse(code)
    except SyntaxError as exc:
        line = (exc.text or "").strip()
        raise NbdistError(
            f"cell {number} of the export is not plain Python (line {exc.lineno}: {line!r}): "
            "magics, shell escapes and top-level await do not run under torchrun. Rewrite "
            f"that line in Python, or add the comment {NO_EXPORT_MARKER!r} to the cell"
        ) from None


def script_text(
    cells: Sequence[str],
    *,
    backend: str | None = None,
    ranks: int = 2,
    name: str = "train.py",
    title: str = "Training exported from a notebook.",
) -> str:
    """The script for ``cells`` (see the module docstring); raises if a cell is not plain Python."""
    chosen = exportable_cells(cells)
    for number, code in enumerate(chosen, 1):
        _check_plain_python(code, number)
    parts = [
        _HEADER.format(title=title, count=len(chosen), ranks=ranks, name=name, backend=backend)
    ]
    for number, code in enumerate(chosen, 1):
        parts.append(f"\n# --- cell {number} " + "-" * 60 + "\n" + code.rstrip() + "\n")
    parts.append(_FOOTER)
    return "".join(parts)


def export_script(
    cells: Sequence[str],
    path: str,
    *,
    backend: str | None = None,
    ranks: int = 2,
    overwrite: bool = True,
) -> str:
    """Write :func:`script_text` to ``path`` (a ``.py`` file); returns the absolute path."""
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"export to {path!r}: give the script's path, e.g. 'train.py'")
    path = os.path.abspath(os.path.expanduser(os.fspath(path)))
    if not path.endswith(".py"):
        raise NbdistError(f"export to {path!r}: name a Python file, e.g. train.py")
    if not os.path.isdir(os.path.dirname(path)):
        raise NbdistError(
            f"export to {path!r}: there is no directory {os.path.dirname(path)}: make it first, "
            "or name a file in one that exists"
        )
    if not exportable_cells(cells):
        raise NbdistError(
            "nothing to export: no %%on_all_ranks cell has run on every rank since "
            "%dist_start (cells marked no-export, --ranks and failed cells are left out; "
            "from Python, session.record_cell(code) records code run with session.run)"
        )
    if os.path.exists(path) and not overwrite:
        raise NbdistError(f"{path} exists: choose another name, or allow overwriting")
    text = script_text(cells, backend=backend, ranks=ranks, name=os.path.basename(path))
    with open(path, "w") as f:
        f.write(text)
    return path
