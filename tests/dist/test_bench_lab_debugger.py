"""bench/lab_debugger.py on real CPU ranks, once through: the debugger on, then off.

It drives the kernel's debugger router itself (attach, a breakpoint, detach); a change to
the router's ``connect`` (it now takes every rank's target at once) broke the benchmark
unnoticed until this ran it end to end. Its ratios are not judged: timing belongs to
bench/RESULTS.md.
"""

from __future__ import annotations

import re

import pytest
from bench_script import run_bench


@pytest.mark.timeout(300)
def test_the_debugger_is_switched_on_and_off_and_each_ratio_printed():
    run = run_bench("lab_debugger.py", "--windows", "1", "--steps", "5", timeout=280)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    for label in ("A/A (debugger never on in either):", "debugger on, breakpoint not hit:"):
        ratios = rf"^{re.escape(label)}\s+\d+\.\d{{3}}\s+\d+\.\d{{3}}$"
        assert re.search(ratios, run.stdout, re.M), (label, run.stdout)
    off = r"^debugger switched off again:\s+\d+\.\d{3}\s+\d+\.\d{3}  \(goal"
    assert re.search(off, run.stdout, re.M), run.stdout
