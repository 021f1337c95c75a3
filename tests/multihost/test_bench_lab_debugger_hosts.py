"""bench/lab_debugger_hosts.py once through at its smallest: 4 ranks in two network
namespaces (relayed) and 4 on the kernel's machine (direct), one stop each.

It speaks the debug protocol through the same helpers as tests/debugging and builds its
cluster as tests/multihost does, so a change to either could stop it with nothing to say so
until a run for bench/RESULTS.md. Here both paths stop at the breakpoint, answer Evaluate,
and the summary is complete with nothing left running. Its figures are not judged: timing
belongs to bench/RESULTS.md. Skipped where network namespaces cannot be made.
"""

from __future__ import annotations

import json

import pytest

from tests.dist.bench_script import run_bench
from tests.multihost.netns import namespaces_unavailable

_WHY_NOT = namespaces_unavailable()
pytestmark = pytest.mark.skipif(
    _WHY_NOT is not None, reason=f"multi-host test needs network namespaces: {_WHY_NOT}"
)


@pytest.mark.timeout(300)
def test_both_paths_stop_and_answer_and_leave_nothing_running():
    # The idle CPU read over 1 s, not 10: its figure is not judged here.
    run = run_bench(
        "lab_debugger_hosts.py",
        *("--turns", "1", "--rounds", "1", "--idle-seconds", "1"),
        timeout=280,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    summary = json.loads(run.stdout.strip().splitlines()[-1])
    assert summary["ranks"] == 4, summary
    for path in ("relayed", "direct"):
        # One stop per rank (--rounds 1), and Evaluate answered in each rank's frame.
        assert summary[path]["stop_ms"]["n"] == 4, summary
        assert summary[path]["evaluate_ms"]["n"] > 0, summary
        assert len(summary[path]["idle_cpu_pct"]) == 1, summary
    assert summary["leftover_pids"] == [], summary
