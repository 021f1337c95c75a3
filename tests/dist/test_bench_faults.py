"""bench/faults.py on real CPU ranks, once through (``--quick``): every case measured.

Its tracking case reads torch's own function through the attribute nbdist's wrapper keeps
(``dist.all_reduce.nbdist_original``); a rename there broke the benchmark unnoticed until
this ran it end to end. Its figures are not judged: timing belongs to bench/RESULTS.md.
"""

from __future__ import annotations

import json

import pytest
from bench_script import run_bench


@pytest.mark.timeout(420)
def test_every_case_is_measured_and_nothing_is_left_running():
    run = run_bench("faults.py", "--quick", timeout=400)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    summary = json.loads(run.stdout.strip().splitlines()[-1])
    assert summary["bench"] == "faults" and summary["reps"] == 1
    for case in ("fail", "interrupt", "where", "kill_detect", "kill_cell", "kill_restart"):
        assert summary[f"{case}_s"] > 0, (case, summary)
    assert summary["output_limited_s"] > 0 and summary["output_unlimited_s"] > 0
    # The collective's cost, tracked and torch's own, and the wrapper's alone.
    assert summary["tracked_us"] > 0 and summary["torch_us"] > 0, summary
    assert summary["bookkeeping_us"] > 0, summary
    assert summary["leftover_pids"] == [], summary
    assert "all_reduce of one float: tracked " in run.stdout
