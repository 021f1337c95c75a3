"""The soak, CI-sized: a real kernel through every kind of cell, stop/start, restarts, killed ranks.

Runs ``bench/soak.py`` for two rounds (about two and a half minutes on 2 cores; the 15-minute
run and its figures are in bench/RESULTS.md) and holds it to the soak's goals:
threads and fds back to the first start's and first stop's values (±2) after
every start and stop, the kernel's RSS within 10 % of the warmed-up value,
every logged point in the history, no process left.

Opt-in (``NBDIST_TEST_SOAK=1``): one CI run in two saw a transient +3 fds after one start
(cause not yet found), so it does not gate the default suite until that
is explained.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.skipif(
    os.environ.get("NBDIST_TEST_SOAK") != "1",
    reason="the CI-sized soak is opt-in: NBDIST_TEST_SOAK=1 bash scripts/test.sh tests/reliability/test_soak.py",
)
def test_a_short_soak_leaks_nothing_and_loses_nothing(tmp_path):
    out = subprocess.run(
        [
            sys.executable,
            os.path.join(ROOT, "bench", "soak.py"),
            "--minutes",
            os.environ.get("NBDIST_SOAK_MINUTES", "1"),
            "--steps",
            "100",
            "--cycles",
            "2",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=900,
    )
    lines = out.stdout.strip().splitlines()
    assert out.returncode == 0 and lines, out.stdout[-4000:] + out.stderr[-4000:]
    summary = json.loads(lines[-1])
    report = "\n".join(lines[-30:])
    assert summary["goal_met"], report
    assert summary["starts"] >= 4 and summary["kills"] >= 2 and summary["named"] >= 1, report
