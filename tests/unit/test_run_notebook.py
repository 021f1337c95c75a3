"""scripts/run_notebook.py in a real kernel: what its log says when a notebook fails.

The GPU check keeps only a job's last lines and its ``FAILED:`` line
(scripts/gpu_check_steps.py), so that line must name the cell and the cause also
when no cell raised: a kernel that died, or one that never started.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import nbformat

ROOT = Path(__file__).resolve().parents[2]
RUNNER = ROOT / "scripts" / "run_notebook.py"


def _run(tmp_path: Path, *sources: str, env: dict | None = None) -> subprocess.CompletedProcess:
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_markdown_cell("# a notebook")])
    nb.cells += [nbformat.v4.new_code_cell(src) for src in sources]
    path = tmp_path / "nb.ipynb"
    nbformat.write(nb, path)
    return subprocess.run(
        [sys.executable, str(RUNNER), str(path)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )


def test_a_cell_that_raises_is_named_with_its_exception(tmp_path):
    res = _run(tmp_path, "x = 1", "1 / 0", "print('never')")
    assert res.returncode == 1
    assert (
        "FAILED: code cell 1 (['1 / 0']) raised ZeroDivisionError: division by zero" in res.stderr
    )


def test_a_kernel_that_dies_names_the_running_cell_and_keeps_what_ran(tmp_path):
    res = _run(tmp_path, "print('first cell ran')", "import os\nos._exit(3)", "print('never')")
    assert res.returncode == 1, res.stdout + res.stderr
    failed = [line for line in res.stderr.splitlines() if line.startswith("FAILED: ")]
    assert failed and failed[-1].startswith(
        "FAILED: code cell 1 (['import os', 'os._exit(3)']) raised DeadKernelError"
    ), res.stderr[-2000:]
    # The outputs of the cells before it are printed and the notebook is written.
    assert "first cell ran" in res.stdout
    written = nbformat.read(tmp_path / "artifacts" / "nb.ipynb", as_version=4)
    assert written.cells[1].outputs[0]["text"] == "first cell ran\n"


def test_every_cell_running_says_ok(tmp_path):
    res = _run(tmp_path, "print(6 * 7)")
    assert res.returncode == 0, res.stderr[-2000:]
    assert "42" in res.stdout and res.stdout.rstrip().endswith("OK: every cell ran")


def _kernels_that_die_at_start(tmp_path: Path, times: int) -> dict:
    # An IPython startup file runs while the kernel starts, before it answers anything:
    # exiting there is a kernel dying before its first reply, as one whose port another
    # process took does. It dies ``times`` times, then starts.
    startup = tmp_path / "ipython" / "profile_default" / "startup"
    startup.mkdir(parents=True)
    (startup / "00-die.py").write_text(
        "import os\n"
        f"count = os.path.join({str(tmp_path)!r}, 'starts')\n"
        "with open(count, 'a') as f:\n"
        "    f.write('x')\n"
        f"if os.path.getsize(count) <= {times}:\n"
        "    os._exit(7)\n"
    )
    return {**os.environ, "IPYTHONDIR": str(tmp_path / "ipython")}


def test_a_kernel_that_dies_before_its_first_reply_is_started_again(tmp_path):
    res = _run(tmp_path, "print(6 * 7)", env=_kernels_that_die_at_start(tmp_path, 1))
    assert res.returncode == 0, res.stderr[-2000:]
    assert "the kernel died before its first reply (start 1 of 3" in res.stderr
    assert res.stdout.rstrip().endswith("OK: every cell ran")
    assert (tmp_path / "starts").read_text() == "xx"


def test_a_kernel_that_never_starts_is_tried_three_times_and_named(tmp_path):
    res = _run(tmp_path, "print(6 * 7)", env=_kernels_that_die_at_start(tmp_path, 99))
    assert res.returncode == 1
    assert (
        "FAILED: the kernel, before the first cell, raised RuntimeError: Kernel died" in res.stderr
    )
    assert (tmp_path / "starts").read_text() == "xxx"
