"""The house rules of docs/architecture.md, checked on the code as it is.

The import contracts live in pyproject.toml (``[tool.importlinter]``) and run
through import-linter's own command; the rest is read from the source files.
Every check names the offending module, so a failure says what to move.
"""

from __future__ import annotations

import ast
import importlib.util
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "nbdist"
BIN = Path(sys.executable).parent
# A module past REVIEW_LINES is worth a look for a second concern (a warning in the test
# report, not a failure: a long module with one responsibility is fine). One past
# MAX_LINES has more than one, whatever it says.
REVIEW_LINES = 600
MAX_LINES = 1000
# The only modules at the package's top level: the public face and what both sides share.
TOP_LEVEL = {
    "__init__.py",
    "checkpoint.py",
    "errors.py",
    "integrations.py",
    "number_ranges.py",
    "rank_states.py",
    "text_table.py",
}
# Public names that several modules define on purpose, each with one meaning:
# ``main`` of a separate process's entry module, ``install`` of each rank-side patch
# (listed in nbdist/engine/patches.py), and Horovod's own API mirrored by the Horovod
# strategy (``hvd.rank()``, ``hvd.local_rank()``).
SHARED_NAMES = {"main", "install", "rank", "local_rank"}
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
    """engine alone; launch below driver; torch alone on the rank side; magics last; no cycles."""
    out = subprocess.run(
        [_tool("lint-imports"), "--no-cache"], cwd=ROOT, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stdout + out.stderr
    # All four contracts were checked (a contract dropped from pyproject.toml fails here).
    assert out.stdout.count(" KEPT") == 5, out.stdout


def _line_counts() -> dict[str, int]:
    return {
        str(p.relative_to(ROOT)): len(p.read_text(encoding="utf-8").splitlines())
        for p in _modules()
    }


def test_long_modules_are_flagged_for_review():
    counts = _line_counts()
    review = {m: n for m, n in counts.items() if n > REVIEW_LINES}
    if review:
        warnings.warn(
            f"modules over {REVIEW_LINES} lines, worth a look for a concern to split off: {review}",
            stacklevel=1,
        )
    too_long = {m: n for m, n in counts.items() if n > MAX_LINES}
    assert not too_long, f"modules over {MAX_LINES} lines hold several concerns: {too_long}"


def test_no_formatter_folds():
    """Code is laid out by ruff format, never folded onto fewer lines by hand: the package,
    its tests, benchmarks, scripts and examples."""
    sources = _modules() + sorted(
        p
        for folder in ("tests", "bench", "scripts", "examples")
        for p in (ROOT / folder).rglob("*.py")
    )
    marker = "fmt" + ":"  # spelled apart, so this test's own source holds no marker
    folds = [
        f"{p.relative_to(ROOT)}:{i}"
        for p in sources
        for i, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1)
        if re.search(rf"#\s*{marker}\s*(skip|off)", line)
    ]
    assert not folds, f"`# {marker} skip`/`# {marker} off` (let ruff format lay it out): {folds}"


def test_top_level_holds_only_the_public_face_and_shared_modules():
    found = {p.name for p in PACKAGE.glob("*.py")}
    assert found == TOP_LEVEL, (
        f"top-level modules {sorted(found - TOP_LEVEL)} belong in a subpackage "
        f"(magics/, driver/, engine/, ...); missing: {sorted(TOP_LEVEL - found)}"
    )


def test_each_public_name_is_defined_in_one_module():
    """Two public functions or classes of one name in two modules would do different things."""
    where: dict[str, list[str]] = {}
    for path in _modules():
        for node in ast.parse(path.read_text(encoding="utf-8")).body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                if not node.name.startswith("_") and node.name not in SHARED_NAMES:
                    where.setdefault(node.name, []).append(str(path.relative_to(ROOT)))
    twice = {name: paths for name, paths in where.items() if len(paths) > 1}
    assert not twice, f"public names defined in more than one module (rename one): {twice}"


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
    imports = [
        ".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        for sub in ("engine", "strategies")
        for p in sorted((PACKAGE / sub).rglob("*.py"))
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
    # nbdist.rank is the function users call, not also a module of that name; a star
    # import leaves the rank values every rank's namespace holds alone.
    assert callable(nbdist.rank) and nbdist.rank() == 0
    assert importlib.util.find_spec("nbdist.rank") is None
    assert not {"rank", "local_rank", "world_size", "device"} & set(nbdist.__all__)


@pytest.mark.parametrize(
    ("old", "home"),
    [
        ("flops_per_step", "nbdist.metrics"),
        ("device_peak", "nbdist.metrics"),
        ("set_peak", "nbdist.metrics"),
        ("transformer_flops", "nbdist.metrics"),
        ("autoplan", "nbdist.strategies"),
    ],
)
def test_moved_public_names_warn_and_still_work(old, home):
    import nbdist

    new = getattr(importlib.import_module(home), old)
    with pytest.warns(DeprecationWarning, match=rf"nbdist\.{old} moved to {home}\.{old}"):
        assert getattr(nbdist, old) is new
