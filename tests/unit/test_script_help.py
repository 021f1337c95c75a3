"""The set-up and run scripts answer --help and refuse arguments they do not take.

Each case ends before a script installs, builds or starts anything: ``--help``
prints usage on stdout and exits 0 in well under a second (a script that went on
to set up a venv, build Horovod or run a notebook would take minutes and write
files), and a bad argument exits 2 with a message that names it. Before, ``bash
scripts/build_horovod.sh --help`` ran ``python -m venv --help`` as if ``--help``
were the venv to build into, and ``bash scripts/quickstart.sh --help`` set up the
venv and then failed to open a notebook called ``--help``.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = ROOT / "scripts"

# (script, what its usage line starts with)
HELPED = [
    ("quickstart.sh", "usage: bash scripts/quickstart.sh [NOTEBOOK]"),
    ("test.sh", "usage: bash scripts/test.sh [--gpu-like] [PYTEST ARGS...]"),
    ("install_browser.sh", "usage: bash scripts/install_browser.sh [VENV]"),
    ("build_horovod.sh", "usage: bash scripts/build_horovod.sh [VENV]"),
    ("slurm_local.sh", "usage: bash scripts/slurm_local.sh start|stop|status"),
    ("run_notebook.py", "usage: run_notebook.py [-h] [notebook]"),
]


def _run(script: str, *args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    path = SCRIPTS / script
    command = [sys.executable, str(path)] if script.endswith(".py") else ["bash", str(path)]
    return subprocess.run([*command, *args], cwd=cwd, capture_output=True, text=True, timeout=60)


def _tree(folder: Path) -> set[str]:
    return {str(p.relative_to(folder)) for p in folder.rglob("*")}


@pytest.mark.parametrize("flag", ["--help", "-h"])
@pytest.mark.parametrize(("script", "usage"), HELPED, ids=[s for s, _ in HELPED])
def test_help_prints_usage_and_does_nothing_else(tmp_path, script, usage, flag):
    res = _run(script, flag, cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith(usage), res.stdout
    assert res.stderr == ""
    # Nothing set up or written: no venv, no build folder, no artifacts/ in the cwd.
    assert _tree(tmp_path) == set()


@pytest.mark.parametrize(
    ("script", "args", "message"),
    [
        ("quickstart.sh", ("--verbose",), "takes one notebook path, got: --verbose"),
        ("quickstart.sh", ("a.ipynb", "b.ipynb"), "takes one notebook path, got: a.ipynb b.ipynb"),
        ("install_browser.sh", ("--venv",), "'--venv' is not a directory"),
        ("install_browser.sh", ("/no/such/venv",), "'/no/such/venv' is not a directory"),
        ("install_browser.sh", ("a", "b"), "takes one venv directory, got: a b"),
        ("build_horovod.sh", ("--clean",), "takes one venv directory, got: --clean"),
        ("slurm_local.sh", ("begin",), "'begin' is not start, stop or status"),
        ("slurm_local.sh", (), "usage: bash scripts/slurm_local.sh start|stop|status"),
        ("run_notebook.py", ("no_such.ipynb",), "no notebook at 'no_such.ipynb'"),
    ],
)
def test_a_bad_argument_is_named_and_nothing_starts(tmp_path, script, args, message):
    res = _run(script, *args, cwd=tmp_path)
    assert res.returncode == 2, (res.stdout, res.stderr)
    assert message in res.stderr, res.stderr
    assert res.stdout == ""
    assert _tree(tmp_path) == set()


def test_a_folder_that_is_not_a_venv_is_refused(tmp_path):
    res = _run("install_browser.sh", str(tmp_path))
    assert res.returncode == 1
    assert f"no Python at {tmp_path}/bin/python" in res.stderr
    assert "is not a venv (python3 -m venv" in res.stderr
