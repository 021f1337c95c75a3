"""Each benchmark without a test of its own runs once through, in its shortest form.

Two of bench/'s scripts had stopped running (a name changed under them) with nothing to
say so until a run for bench/RESULTS.md; each here runs end to end on real CPU ranks and
prints the summary it ends with. Figures and goals are not judged: timing belongs to
bench/RESULTS.md. (faults.py, lab_debugger.py, log_cost.py, step_noise.py, train.py,
nccl.py and the others the GPU check runs have tests of their own; dashboard_browser.py's is
in tests/ui, lab_debugger_hosts.py's in tests/multihost.)
"""

from __future__ import annotations

import json

import pytest
from bench_script import run_bench

# (script, its shortest arguments, the benchmark's name in its JSON summary or None).
_SCRIPTS = [
    ("check_collectives.py", ("--quick",), "check_collectives"),
    ("early_interrupt.py", ("--quick",), "early_interrupt"),
    ("file_sync.py", ("--quick",), "file_sync"),
    ("roundtrip.py", ("--quick",), "roundtrip"),
    ("chaos.py", ("--runs", "1", "--kills", "1", "--steps", "10"), "chaos"),
    ("first_ddp.py", ("--n", "4"), "first_ddp"),
    ("run_memory.py", (), None),
]


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("script", "args", "name"), _SCRIPTS, ids=[s[0] for s in _SCRIPTS])
def test_the_benchmark_runs_through_and_leaves_nothing_running(script, args, name):
    run = run_bench(script, *args, timeout=280)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    if name is None:  # prints tables only: kernel-side costs, no ranks
        assert "series(loss) 20k points:" in run.stdout, run.stdout[-3000:]
        return
    summary = json.loads(run.stdout.strip().splitlines()[-1])
    assert summary["bench"] == name, summary
    assert summary.get("leftover_pids", []) == [], summary
