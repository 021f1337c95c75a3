"""The quick-start notebook runs top to bottom; a failing rank fails a notebook run.

Notebooks are executed with nbclient on the venv's ``python3`` kernel, in a
temporary copy, as a CI job or ``jupyter nbconvert --execute`` would.
"""

from __future__ import annotations

import re
import shutil
import time
from pathlib import Path

import nbformat
import pytest
from nbclient.exceptions import CellExecutionError
from nbformat.v4 import new_code_cell, new_notebook

from tests.kernel_start import execute_notebook

_ANSI = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]")
QUICKSTART = Path(__file__).resolve().parents[2] / "examples" / "00_quickstart.ipynb"


def _execute(nb, workdir: Path) -> float:
    t0 = time.monotonic()
    execute_notebook(
        nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(workdir)}}
    )
    return time.monotonic() - t0


def _text_outputs(nb) -> list[str]:
    """Every stream text of the notebook's code cells, line by line."""
    lines = []
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            if out.output_type == "stream":
                lines.extend(out.text.splitlines())
    return lines


def test_quickstart_is_stored_without_outputs():
    nb = nbformat.read(QUICKSTART, as_version=4)
    nbformat.validate(nb)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code, "no code cells"
    assert all(c.outputs == [] and c.execution_count is None for c in code)
    assert nb.metadata.kernelspec.name == "python3"


def test_quickstart_runs(tmp_path):
    copy = tmp_path / QUICKSTART.name
    shutil.copy(QUICKSTART, copy)
    nb = nbformat.read(copy, as_version=4)
    seconds = _execute(nb, tmp_path)

    errors = [o for c in nb.cells for o in c.get("outputs", []) if o.output_type == "error"]
    assert errors == []
    lines = _text_outputs(nb)
    assert "[rank 0] 0 tensor([1., 1.])" in lines
    assert "[rank 1] 1 tensor([1., 1.])" in lines
    # print0 prints on rank 0 only: four loss lines (steps 0, 10, 20, 29).
    steps = [line for line in lines if " step " in line]
    assert len(steps) == 4 and all(s.startswith("[rank 0] step ") for s in steps), steps
    assert any(line.startswith("[rank 0] identical on all 2 ranks") for line in lines)
    # %dist_status: an HTML table in a notebook, the same table as text beside it.
    status = [
        o["data"]
        for c in nb.cells
        if c.cell_type == "code" and c.source.strip() == "%dist_status"
        for o in c.get("outputs", [])
        if o.output_type == "display_data"
    ]
    assert len(status) == 1
    assert status[0]["text/plain"].split()[:6] == "rank host pid device backend state".split()
    html = status[0]["text/html"]
    assert html.startswith("<table class='nbdist-status'>") and html.count("<tr>") == 3
    assert lines[-1] == "nbdist: stopped 2 ranks"
    print(f"quick start executed in {seconds:.1f} s")  # shown with -s; timings belong in bench/


def test_failing_rank_fails_the_notebook(tmp_path):
    nb = new_notebook(
        cells=[
            new_code_cell("%load_ext nbdist"),
            new_code_cell("%dist_start 2 --cpu"),
            new_code_cell(
                "%%on_all_ranks\n"
                "if rank == 1:\n"
                "    raise ValueError('boom on rank 1')\n"
                "print('survived', rank)"
            ),
            new_code_cell("print('not reached')"),
        ]
    )
    nb.metadata["kernelspec"] = {
        "name": "python3",
        "display_name": "Python 3",
        "language": "python",
    }
    with pytest.raises(CellExecutionError) as info:
        _execute(nb, tmp_path)

    error = info.value
    assert error.ename == "RankError"
    assert error.evalue == "rank 1: ValueError: boom on rank 1"
    message = _ANSI.sub("", str(error))  # what nbconvert --execute would print
    assert "[rank 1] ValueError: boom on rank 1" in message
    assert "raise ValueError('boom on rank 1')" in message  # rank 1's own traceback
    assert "1 of 2 ranks failed" in message

    failing = nb.cells[2]
    errors = [o for o in failing.outputs if o.output_type == "error"]
    assert len(errors) == 1
    assert errors[0].ename == "RankError"
    assert errors[0].evalue == "rank 1: ValueError: boom on rank 1"
    assert "survived 0" in " ".join(_text_outputs(nb))  # rank 0 finished and printed
    assert nb.cells[3].get("outputs", []) == []  # execution stopped at the failing cell


def test_saved_quickstart_with_its_dashboard_stays_small(tmp_path):
    """The executed notebook keeps the dashboard's widget state, but not plotly.js: < 2 MB."""
    nb = nbformat.read(str(QUICKSTART), as_version=4)
    execute_notebook(
        nb,
        timeout=300,
        kernel_name="python3",
        store_widget_state=True,
        resources={"metadata": {"path": str(tmp_path)}},
    )
    out = tmp_path / "executed.ipynb"
    nbformat.write(nb, str(out))
    widget_outputs = [
        o
        for cell in nb.cells
        for o in cell.get("outputs", [])
        if "application/vnd.jupyter.widget-view+json" in o.get("data", {})
    ]
    assert len(widget_outputs) == 1  # the training cell's dashboard
    assert "widgets" in nb.metadata  # its state was saved with the notebook
    print(f"executed quick start with its dashboard: {out.stat().st_size} bytes")
    assert out.stat().st_size < 2 * 2**20, out.stat().st_size
