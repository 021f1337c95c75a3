"""process_tree.descendants: one walk of the process table finds what psutil's children() finds."""

from __future__ import annotations

import subprocess
import time

import psutil

from nbdist.engine import process_ending
from nbdist.launch import process_tree

# A shell that starts a shell with two sleeps, and a sleep of its own: four processes below it.
TREE = "sh -c 'sleep 60 & sleep 60' & sleep 60"


def test_descendants_of_several_roots_are_every_process_below_them_once():
    shells = [subprocess.Popen(["sh", "-c", TREE]) for _ in range(3)]
    try:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            expected = {
                p.pid for s in shells for p in psutil.Process(s.pid).children(recursive=True)
            }
            if len(expected) == 4 * len(shells):
                break
            time.sleep(0.05)
        found = process_tree.descendants([s.pid for s in shells])
        assert sorted(p.pid for p in found) == sorted(expected)
        assert len(expected) == 12
        # A root below another root is a root, not a descendant; a gone root finds nothing.
        inner = psutil.Process(shells[0].pid).children()[0].pid
        assert inner not in {p.pid for p in process_tree.descendants([shells[0].pid, inner])}
        assert process_tree.descendants([2**22 + 1]) == []
    finally:
        procs = [psutil.Process(s.pid) for s in shells]
        process_ending.end(procs + process_tree.descendants([s.pid for s in shells]))
        for s in shells:
            s.wait(timeout=10)
