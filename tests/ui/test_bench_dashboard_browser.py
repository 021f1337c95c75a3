"""bench/dashboard_browser.py once through at its smallest, in JupyterLab in Chromium.

The benchmark drives the page the dashboard tests drive (the notebook's Run menu, the loss
plot's traces, the page's stall monitor), so a change to any of them could stop it with
nothing to say so until a run for bench/RESULTS.md. Here both of its notebooks run, every
rank's last step reaches the loss plot (the script exits non-zero otherwise) and its table
prints. Its figures are not judged: timing belongs to bench/RESULTS.md.
"""

from __future__ import annotations

import re

import pytest

from tests.dist.bench_script import run_bench
from tests.ui.conftest import _require_browser


@pytest.mark.timeout(420)
def test_both_notebooks_reach_the_plot_and_the_table_prints():
    _require_browser()
    run = run_bench(
        "dashboard_browser.py",
        *("--ranks", "2", "--steps", "300", "--base-ranks", "2", "--base-steps", "100"),
        timeout=400,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert re.search(r"^\s+2x100\s+2x300\s+ratio$", run.stdout, re.M), run.stdout
    # Below the dashboard's point budget every step is drawn: 100 and 300 a rank.
    points = r"^points per loss trace drawn\s+100\s+300\s+3\.00x$"
    assert re.search(points, run.stdout, re.M), run.stdout
    assert "left behind by JupyterLab" not in run.stdout, run.stdout
