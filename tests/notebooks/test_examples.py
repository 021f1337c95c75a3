"""Every example notebook runs top to bottom in a real kernel, as CI or a reader would.

Each notebook ends with its own check (loss went down, ranks agree, numbers match a
reference) written as ``assert`` in a cell, so a wrong result fails the run here.
The quick start (00) has its own, more detailed test in ``test_quickstart.py``.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import nbformat
import pytest

from tests.kernel_start import execute_notebook

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
NOTEBOOKS = sorted(p for p in EXAMPLES.glob("[0-9][0-9]_*.ipynb") if not p.name.startswith("00_"))


def _code_cells(nb):
    return [c for c in nb.cells if c.cell_type == "code"]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_example_is_stored_clean(path):
    """Committed without outputs, valid, on the python3 kernel, and it stops its ranks."""
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    code = _code_cells(nb)
    assert code, "no code cells"
    assert all(c.outputs == [] and c.execution_count is None for c in code)
    assert nb.metadata.kernelspec.name == "python3"
    assert nb.cells[0].cell_type == "markdown" and nb.cells[0].source.startswith("# ")
    assert code[-1].source.strip() == "%dist_stop", "end with %dist_stop: nothing left running"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_example_runs(path, tmp_path):
    copy = tmp_path / path.name
    shutil.copy(path, copy)
    nb = nbformat.read(copy, as_version=4)
    # A failing cell raises CellExecutionError with the cell's traceback: the test's message.
    execute_notebook(
        nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
    )
    errors = [o for c in nb.cells for o in c.get("outputs", []) if o.output_type == "error"]
    assert errors == []
