"""What ``check_collectives`` (``%dist_start --check-collectives``) costs each collective.

With it, torch wraps the process group in one that first exchanges each collective's
kind, shapes and dtypes among the ranks over gloo (``TORCH_DISTRIBUTED_DEBUG=DETAIL``),
then runs the call. Two sessions of N ranks run side by side, one checked and one not
(the baseline, in the same run); in turns, each times a cell of ``--calls`` all-reduces per
size on every rank. Reported per size: the median seconds of one all-reduce (rank 0's, over
the turns) each way, and the ratio checked / plain.

Usage: python bench/check_collectives.py [--n 2] [--turns 5] [--calls 200] [--quick]
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import (  # noqa: E402
    CpuMeter,
    assert_no_children,
    machine,
    median,
    print_goal_and_cpu,
    print_summary,
    run_benchmark,
)

import nbdist  # noqa: E402
from nbdist.driver.sinks import ListSink  # noqa: E402

# Elements of float32: 1 KiB, 256 KiB, 16 MiB.
SIZES = (256, 65536, 4194304)

_CELL = """
import time as _time
_t = torch.ones({size}, device=device)
dist.all_reduce(_t)  # the first call of a size sets up its buffers
dist.barrier()
_t0 = _time.perf_counter()
for _ in range({calls}):
    dist.all_reduce(_t)
per_call = (_time.perf_counter() - _t0) / {calls}
"""


def _per_call(session, size: int, calls: int) -> float:
    session.run(_CELL.format(size=size, calls=calls), sink=ListSink())
    return session.pull("per_call", 0)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=2, help="ranks per session (default 2)")
    parser.add_argument("--turns", type=int, default=5, help="turns of each way (default 5)")
    parser.add_argument("--calls", type=int, default=200, help="all-reduces per cell (200)")
    parser.add_argument("--quick", action="store_true", help="2 turns of 50 calls")
    args = parser.parse_args()
    if args.quick:
        args.turns, args.calls = 2, 50
    info = machine()
    cpu_meter = CpuMeter()
    times: dict[str, dict[int, list[float]]] = {"plain": {}, "checked": {}}
    sessions = {}
    try:
        for way in ("plain", "checked"):
            sessions[way] = nbdist.DistSession(
                args.n, cpu=True, history=False, check_collectives=way == "checked"
            ).start()
        for turn in range(args.turns):
            order = ("plain", "checked") if turn % 2 == 0 else ("checked", "plain")
            for size in SIZES:
                calls = max(5, args.calls // (16 if size >= 1 << 22 else 1))
                for way in order:
                    times[way].setdefault(size, []).append(_per_call(sessions[way], size, calls))
    finally:
        for session in sessions.values():
            session.stop()
    leftovers = assert_no_children()
    cpu = cpu_meter.read()
    rows = []
    print(f"{args.n} CPU ranks (gloo), {args.turns} turns; median seconds per all-reduce:")
    print(f"{'size':>10} {'plain':>12} {'checked':>12} {'checked/plain':>14}")
    for size in SIZES:
        plain, checked = median(times["plain"][size]), median(times["checked"][size])
        rows.append(
            dict(bytes=size * 4, plain_s=plain, checked_s=checked, ratio=round(checked / plain, 2))
        )
        print(f"{size * 4:>10} {plain:>12.6f} {checked:>12.6f} {checked / plain:>14.2f}")
    print_goal_and_cpu("no goal (a debugging mode's price, as measured)", True, leftovers, cpu)
    print_summary(
        dict(bench="check_collectives", quick=args.quick, machine=info, cpu=cpu, rows=rows)
    )
    return 1 if leftovers else 0


if __name__ == "__main__":
    run_benchmark(main)
