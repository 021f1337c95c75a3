"""Run one of bench/'s scripts as a user would, from the repository's root (test side).

The benchmarks' own tests run them end to end on real ranks, unbuffered (the window lines
come as they are measured), and read the JSON summary each prints last.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_bench(script: str, *args: str, timeout: float) -> subprocess.CompletedProcess:
    """``python bench/<script> <args>``, its output captured as text."""
    return subprocess.run(
        [sys.executable, str(ROOT / "bench" / script), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        env=dict(os.environ, PYTHONUNBUFFERED="1"),
    )


def assert_refused(script: str, args: tuple[str, ...], message: str, banner: str) -> None:
    """``python bench/<script> <args>`` exits 2 naming the fault (``message`` in its stderr)
    before it starts anything: no ``banner``, the line a run prints once it has begun."""
    run = run_bench(script, *args, timeout=60)
    assert run.returncode == 2, run.stdout[-2000:] + run.stderr[-2000:]
    assert message in run.stderr
    assert banner not in run.stdout
