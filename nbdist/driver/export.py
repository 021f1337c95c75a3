"""Kernel side: a path out of the notebook, the session's ``%%on_all_ranks`` cells as a ``torchrun`` script.

The script starts with :func:`nbdist.engine.standalone.init`, which gives the cells
the names they had on the ranks (``torch``, ``dist``, ``nbdist``, ``rank``,
``local_rank``, ``world_size``, ``device``; ``nbdist.log`` writes to the run
history), then the cells in the order they ran, then
:func:`nbdist.engine.standalone.finish`.

Cells that only made sense interactively (inspecting a tensor, a plot) are left
out when they carry the marker comment ``# nbdist: no-export`` (or ran with
``%%on_all_ranks --no-export``); cells that failed are never recorded. A cell
that is not plain Python (a magic, a shell escape) goes in commented out.

What the cells depended on but a script cannot repeat is recorded as a *note*
(:func:`note_cell`) among the cells: the script lists each at its top as a
``# NOTE:`` line (and ``%dist_export`` prints them): values pushed with
``%dist_push``, cells run with ``--ranks``/``%%on_rank``. Paths synced with
``%dist_sync`` become a ``sys.path.insert`` and ``%dist_run`` scripts a
:func:`nbdist.engine.scripts.run_script` call, in their place among the cells.

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
import weakref
from collections.abc import Sequence

from nbdist.errors import NbdistError

__all__ = [
    "EXPORT_MARK",
    "NO_EXPORT_MARKER",
    "export_notes",
    "exportable_cells",
    "export_script",
    "note_cell",
    "plain_python_problem",
    "record",
    "recorded_entry",
    "run_script_entry",
    "settle",
    "script_text",
]

NO_EXPORT_MARKER = "# nbdist: no-export"
# In the first lines of every script written here: %dist_export replaces such a file
# without --force, and no other.
EXPORT_MARK = "Written by nbdist (%dist_export)"
_MARKER = re.compile(r"^\s*#\s*nbdist:\s*no-export\s*$", re.MULTILINE)
# The first line of a recorded note (not a cell): note_cell().
_NOTE = "# nbdist-note: "

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
{notes}
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


def note_cell(note: str, code: str = "") -> str:
    """A recorded entry that is no cell: ``note`` for the script's NOTE lines, ``code`` (if any) in its place."""
    first = " ".join(note.split())
    return f"{_NOTE}{first}\n{code}".rstrip() + "\n"


def _is_note(cell: str) -> bool:
    return cell.startswith(_NOTE)


def exportable_cells(cells: Sequence[str]) -> list[str]:
    """The cells to export: those without the ``# nbdist: no-export`` marker, blank ones and notes dropped."""
    return [c for c in cells if c.strip() and not _is_note(c) and not _MARKER.search(c)]


def export_notes(cells: Sequence[str]) -> list[str]:
    """The notes recorded among ``cells`` (:func:`note_cell`), and one per cell that is not
    plain Python, in order: what the script leaves out or needs done."""
    notes, number = [], 0
    for cell in cells:
        if _is_note(cell):
            notes.append(cell.splitlines()[0][len(_NOTE) :])
        elif cell in exportable_cells([cell]):
            number += 1
            problem = plain_python_problem(cell)
            if problem:
                notes.append(f"cell {number} is commented out: {problem}")
    return notes


def plain_python_problem(code: str) -> str:
    """Why ``code`` cannot run as a script's Python (a magic, a shell escape...), '' if it can."""
    try:
        ast.parse(code)
    except SyntaxError as exc:
        line = (exc.text or "").strip()
        return (
            f"not plain Python (line {exc.lineno}: {line!r}; magics, shell escapes and "
            "top-level await do not run under torchrun): rewrite it in Python"
        )
    return ""


def _commented(code: str) -> str:
    return "\n".join("# " + line if line.strip() else "#" for line in code.rstrip().splitlines())


def script_text(
    cells: Sequence[str],
    *,
    backend: str | None = None,
    ranks: int = 2,
    name: str = "train.py",
    title: str = "Training exported from a notebook.",
) -> str:
    """The script for ``cells`` (see the module docstring).

    A cell that is not plain Python is written commented out, and named in a NOTE line.
    """
    chosen = exportable_cells(cells)
    notes = export_notes(cells)
    lines = "".join(f"# NOTE: {note}\n" for note in notes)
    parts = [
        _HEADER.format(
            title=title,
            count=len(chosen),
            ranks=ranks,
            name=name,
            backend=backend,
            notes=f"\n{lines}" if lines else "",
        )
    ]
    number = 0
    for cell in cells:
        if _is_note(cell):
            note, _, code = cell.partition("\n")
            if code.strip():
                parts.append(f"\n{note.replace(_NOTE, '# --- ', 1)}\n{code.rstrip()}\n")
            continue
        if cell not in exportable_cells([cell]):
            continue
        number += 1
        code = cell.rstrip()
        if plain_python_problem(code):
            code = "# (not plain Python: commented out, see the NOTE at the top)\n" + _commented(
                code
            )
        parts.append(f"\n# --- cell {number} " + "-" * 60 + "\n" + code + "\n")
    parts.append(_FOOTER)
    return "".join(parts)


def recorded_entry(code: str, name: str) -> tuple[str, str]:
    """What to record of a cell ``name`` (e.g. 'In[7]') that ran on every rank, and a warning
    ('' if none): the cell itself, or, if it is not plain Python, a note with it commented out."""
    problem = "" if _MARKER.search(code) else plain_python_problem(code)
    if not problem:
        return code, ""
    note = f"{name} is commented out: {problem}"
    text = (
        f"{name} is not plain Python ({problem.partition('(')[2].partition(';')[0]}): "
        "%dist_export will write it commented out (run it again in Python to export it)"
    )
    return note_cell(note, _commented(code)), text


# By session: what waits on a --noblock run to be recorded, in order: [(run or None, entry)].
_PENDING: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def settle(session) -> int:
    """Record what waited on --noblock runs that ended (dropped where a rank failed); how
    many runs still run (what waits on them is not recorded yet)."""
    queue = _PENDING.get(session, [])
    while queue:
        run, entry = queue[0]
        if run is not None and not run.done():
            break
        queue.pop(0)
        if run is None or all(state == "ok" for state in run.child_states().values()):
            session.record_cell(entry)
    return sum(1 for run, _ in queue if run is not None)


def record(session, entry: str, run=None) -> None:
    """Record ``entry`` (a cell or :func:`note_cell`) for the export: now, or, given ``run`` (a
    --noblock :class:`~nbdist.driver.runner.RankRun`), once it succeeded on every rank."""
    if settle(session) or run is not None:
        _PENDING.setdefault(session, []).append((run, entry))
    else:
        session.record_cell(entry)


def run_script_entry(cell: str, name: str) -> str:
    """The note (and call) to record for a ``%dist_run`` cell ('' if ``cell`` is not one)."""
    try:
        [stmt] = ast.parse(cell).body
        call = stmt.value
        assert isinstance(call, ast.Call) and getattr(call.func, "attr", "") == "run_script"
        path, args = ast.literal_eval(call.args[0]), ast.literal_eval(call.args[1])
    except (SyntaxError, ValueError, AssertionError, AttributeError, IndexError, TypeError):
        return ""
    shown = " ".join([os.path.basename(path), *args])
    code = (
        "from nbdist.engine.scripts import run_script as _nbdist_run_script\n\n"
        f"_nbdist_run_script({path!r}, {args!r}, globals())"
    )
    return note_cell(
        f"{name} (%dist_run {shown}) runs here as on the ranks: {path} must exist where "
        "this script runs",
        code,
    )


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
    if not exportable_cells(cells) and not any(
        _is_note(c) and c.partition("\n")[2].strip() for c in cells
    ):
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
