"""The house rules of docs/architecture.md, checked on the code as it is.

The import contracts live in pyproject.toml (``[tool.importlinter]``) and run
through import-linter's own command; the rest is read from the source files.
Every check names the offending module, so a failure says what to move.
"""

from __future__ import annotations

import ast
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "nbdist"
BIN = Path(sys.executable).parent
MAX_LINES = 400
# The first words of every module's docstring: which side of the wire it runs on.
SIDES = (
    "Kernel side",
    "Rank side",
    "Both sides",
    "Separate process",
    "Jupyter server",
    "Kernel and Jupyter server",
)


def _modules() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if "labextension" not in p.parts)


def _tool(name: str) -> str:
    path = BIN / name
    if not path.exists():
        pytest.skip(f"{name} is not installed next to {sys.executable} (pip install -e .[test])")
    return str(path)


def test_import_contracts_hold():
    """engine alone; launch below driver; no IPython/ipywidgets/plotly on the rank side; no cycles."""
    out = subprocess.run(
        [_tool("lint-imports"), "--no-cache"], cwd=ROOT, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stdout + out.stderr
    # All four contracts were checked (a contract dropped from pyproject.toml fails here).
    assert out.stdout.count(" KEPT") == 4, out.stdout


def test_no_module_is_over_the_line_limit():
    long = {
        str(p.relative_to(ROOT)): n
        for p in _modules()
        if (n := len(p.read_text(encoding="utf-8").splitlines())) > MAX_LINES
    }
    assert not long, f"modules over {MAX_LINES} lines (split them by responsibility): {long}"


def test_every_module_says_its_side_first():
    missing = {}
    for path in _modules():
        doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) or ""
        first = doc.splitlines()[0] if doc else ""
        if not first.startswith(SIDES):
            missing[str(path.relative_to(ROOT))] = first or "(no docstring)"
    assert not missing, f"first docstring line must start with one of {SIDES}: {missing}"


def test_no_private_access_and_every_public_name_documented():
    """ruff's SLF001 (another module's private names) and D1 (docstrings) find nothing."""
    out = subprocess.run(
        [_tool("ruff"), "check", "--select", "SLF001,D1", "--output-format", "concise", "nbdist"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stdout + out.stderr


def test_the_rank_side_imports_with_torch_alone():
    """A rank (or a torchrun script) imports nbdist's rank side without IPython or ipyparallel."""
    engine = sorted(p.stem for p in (PACKAGE / "engine").glob("*.py") if p.stem != "__init__")
    strategies = sorted(
        p.stem for p in (PACKAGE / "strategies").glob("*.py") if p.stem != "__init__"
    )
    imports = [f"nbdist.engine.{m}" for m in engine] + [
        f"nbdist.strategies.{m}" for m in strategies
    ]
    code = (
        "import importlib, sys\n"
        f"for name in {imports!r} + ['nbdist', 'nbdist.checkpoint', 'nbdist.metrics.log']:\n"
        "    importlib.import_module(name)\n"
        "heavy = sorted(m for m in ('IPython', 'ipyparallel', 'ipywidgets', 'plotly', "
        "'nbdist.driver', 'nbdist.launch') if m in sys.modules)\n"
        "print(heavy)\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, env=env
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", f"imported on the rank side: {out.stdout.strip()}"


def test_public_api_names_resolve_and_rank_is_a_function():
    import nbdist

    for name in nbdist.__all__:
        assert getattr(nbdist, name) is not None, name
    # nbdist.rank is the function users call, not also a module of that name.
    assert callable(nbdist.rank) and nbdist.rank() == 0
    assert importlib.util.find_spec("nbdist.rank") is None
