"""tests/gpu has a test for every row of README's strategies table, and collects here without a GPU.

Each GPU test names the rows it covers with ``@pytest.mark.example(N, ...)`` (the
notebook numbers); a new row without a GPU test fails here, on any machine.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _table_rows() -> set[int]:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = text.split("## Strategies: one notebook each", 1)[1].split("\n## ", 1)[0]
    return {int(m) for m in re.findall(r"^\| (\d+) \| \[", section, flags=re.MULTILINE)}


def _marked_examples() -> dict[int, list[str]]:
    """{row: [test names]} from every ``pytest.mark.example(...)`` decorator in tests/gpu."""
    found: dict[int, list[str]] = {}
    for path in sorted((ROOT / "tests" / "gpu").glob("test_*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, ast.FunctionDef):
                continue
            for deco in node.decorator_list:
                if (
                    isinstance(deco, ast.Call)
                    and isinstance(deco.func, ast.Attribute)
                    and deco.func.attr == "example"
                ):
                    for arg in deco.args:
                        found.setdefault(ast.literal_eval(arg), []).append(
                            f"{path.name}::{node.name}"
                        )
    return found


def test_every_strategy_row_has_a_gpu_test():
    rows = _table_rows()
    assert len(rows) >= 30, f"README's strategies table not found or cut short: {sorted(rows)}"
    marked = _marked_examples()
    missing = sorted(rows - set(marked))
    assert not missing, f"rows of README's strategies table without a test in tests/gpu: {missing}"
    assert set(marked) <= rows, f"tests/gpu names rows README lacks: {sorted(set(marked) - rows)}"


def test_tests_gpu_collects_without_a_gpu():
    """Collection imports every GPU test module: no import error hides a test from a GPU run."""
    command = [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider"]
    out = subprocess.run(
        [*command, "tests/gpu"], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    assert re.search(r"^\d+ tests collected", out.stdout, flags=re.MULTILINE), out.stdout[-2000:]
