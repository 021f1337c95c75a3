"""The first DDP model a session builds, against the second, at N CPU ranks.

Runs in the benchmark's own process, which plays the notebook kernel (a
:class:`nbdist.DistSession`). For each N: ``DistSession(N, cpu=True)`` to ready, then
a cell that builds ``DistributedDataParallel(nn.Linear(32, 32))`` on every rank for
the first time, then the same cell again: the baseline, where everything it imports
is imported already. Building a DDP model imports ``torch._dynamo`` (torch 2.13: ~810
modules); where many ranks start, the zygote imports it before it forks
(:func:`nbdist.launch.zygote_imports.dynamo_pays`) and the ranks share it.

Prints, per N: the first cell's time, the second's, their ratio, and the growth of the
ranks' unique memory (USS, summed) over the first cell; the goal is on the memory.

Usage: python bench/first_ddp.py [--n 4 8 64 256]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time

import psutil

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import (  # noqa: E402
    CpuMeter,
    assert_no_children,
    conclude,
    load,
    machine,
    ratio,
    run_benchmark,
)

from nbdist.driver.sinks import ListSink  # noqa: E402

DEFAULT_NS = [4, 8, 64]
BUILD = "import torch\nm = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(32, 32))"
# The goal: where many ranks start, the first build grows a rank's own memory by at most
# this many MiB (the import shared from the zygote; a rank importing it grows by ~94).
# Its time is shown against the second build's, one sample each: on a crowded machine a
# ratio of two sub-second cells is noise, the memory is not.
GOAL_MIB = 10
GOAL_FROM_N = 8  # below it, the zygote leaves the import to the ranks (dynamo_pays)


def _uss_mib(pids: list[int]) -> float:
    total = 0
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            total += psutil.Process(pid).memory_full_info().uss
    return total / 2**20


def _timed(session, code: str) -> float:
    t0 = time.perf_counter()
    session.run(code, sink=ListSink())
    return time.perf_counter() - t0


def measure(n: int) -> dict:
    import nbdist

    t0 = time.perf_counter()
    session = nbdist.DistSession(n, cpu=True, threads=1, timeout=900, history=False).start()
    try:
        ready_s = time.perf_counter() - t0
        pids = [r.pid for r in session.ranks]
        uss0 = _uss_mib(pids)
        first_s = _timed(session, BUILD)
        uss1 = _uss_mib(pids)
        second_s = _timed(session, BUILD)
    finally:
        session.stop()
    return {
        "n": n,
        "ready_s": round(ready_s, 1),
        "first_s": round(first_s, 2),
        "second_s": round(second_s, 2),
        "first_x_second": round(ratio(first_s, second_s), 2),
        "uss_growth_mib": round(uss1 - uss0),
        "uss_growth_per_rank_mib": round((uss1 - uss0) / n, 1),
    }


def _main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--n", type=int, nargs="+", default=None, help=f"ranks (default {DEFAULT_NS})"
    )
    args = parser.parse_args(argv)
    ns = args.n or DEFAULT_NS
    info = machine()
    print(f"first_ddp: N = {ns}, {info}", flush=True)
    meter = CpuMeter()
    rows = []
    try:
        for n in ns:
            print(f"N={n}: load {load()}", flush=True)
            rows.append(measure(n))
            print(f"  {rows[-1]}", flush=True)
    finally:
        leftovers = assert_no_children()
        cpu = meter.read()
    print()
    print("| ranks | ready | first DDP build | second | first/second | USS growth (per rank) |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['n']} | {r['ready_s']:.1f} s | {r['first_s']:.2f} s | {r['second_s']:.2f} s "
            f"| {r['first_x_second']:.2f}× | {r['uss_growth_mib']} MiB "
            f"({r['uss_growth_per_rank_mib']} MiB) |"
        )
    judged = [r for r in rows if r["n"] >= GOAL_FROM_N]
    ok = all(r["uss_growth_per_rank_mib"] <= GOAL_MIB for r in judged)
    goal = f"the first DDP build grows a rank's own memory <= {GOAL_MIB} MiB at N >= {GOAL_FROM_N}"
    conclude("first_ddp", goal, None, ok, leftovers, cpu, info, False, rows=rows)
    return 0 if ok and not leftovers else 1


if __name__ == "__main__":
    run_benchmark(_main)
