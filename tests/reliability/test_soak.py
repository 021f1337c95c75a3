"""The soak, CI-sized: a real kernel through every kind of cell, stop/start, restarts, killed ranks.

Runs ``bench/soak.py`` for two rounds (about two and a half minutes on 2 cores; the 15-minute
run and its figures are in bench/RESULTS.md) and holds it to the soak's goals:
threads and fds back to the first stop's values (±2) after every stop (growth
seen only after a start is reported, not failed), the kernel's RSS beyond the
history it holds (every view released) within 10 % of the warmed-up value,
every logged point in the history, no process left.

In the default suite. Every miss names the kinds of descriptor that grew
(socket, pipe, eventfd, a file); descriptors that only a garbage collection in
the kernel closes are listed apart (``closed_by_gc``), not counted as a leak.
``NBDIST_SOAK_MINUTES`` lengthens it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.timeout(900)  # 80 s on a quiet machine, 2.8 min at load 8; far more at load 60
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
    print(report)  # the figures, shown with -s or -rP
    assert summary["goal_met"], report
    assert summary["starts"] >= 4 and summary["kills"] >= 2 and summary["named"] >= 1, report
