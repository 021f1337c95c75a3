"""What JupyterLab's debugger costs the ranks' training loop: on (a breakpoint set, not hit), and off again.

Runs in the benchmark's own process (the kernel's place); ``TRAIN`` runs on the
ranks. Two sessions of ``n`` CPU ranks are up at the same time and take turns,
a window of ``steps`` DDP steps each (a 3-layer MLP, 256 wide, batch 32: small
enough that the Python of the loop shows):

- never:  a session whose ranks never ran the debugger;
- debug:  a session whose ranks went through what the debugger does
  (:func:`nbdist.engine.lab_debug.prepare` starts debugpy, the kernel's router
  attaches and sets a breakpoint in a file the loop does not run) and then
  through what switching it off does (the router disconnects).

Figures: medians of ``debug`` windows over ``never`` windows, while on and
after off (goal for off: within 1 %), and an A/A pair before the debugger was
ever on (the noise floor of the run); each as rank 0's steps/s (wall clock) and
as steps per CPU-second of the ranks' training threads, which tracing raises
and other load on the machine disturbs less. The load average is printed with
them.

Usage: python bench/lab_debugger.py [--n 2] [--windows 8] [--steps 40]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import types

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import nbdist  # noqa: E402
from nbdist.driver.lab_debugger import LabDebugRouter  # noqa: E402
from nbdist.engine import lab_debug  # noqa: E402

TRAIN = """
import time
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
torch.manual_seed(0)
_model = DDP(torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(),
                                 torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10)))
_opt = torch.optim.SGD(_model.parameters(), lr=0.01)
_x, _y = torch.randn(32, 256), torch.randint(0, 10, (32,))

def window(steps):
    dist.barrier()
    t0, c0 = time.perf_counter(), time.thread_time()
    for _ in range(steps):
        _opt.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(_model(_x), _y).backward()
        _opt.step()
    cpu = time.thread_time() - c0
    dist.barrier()
    return steps / (time.perf_counter() - t0), steps / cpu
"""


def _window(session, steps: int) -> tuple[float, float]:
    # Rank 0's steps/s (wall clock), and steps per CPU-second of the training thread
    # summed over the ranks (what tracing costs, less sensitive to other load).
    session.run(f"_rate = window({steps})")
    rates = session.pull("_rate")
    return rates[0][0], 1.0 / sum(1.0 / r[1] for r in rates)


def _pairs(a, b, windows: int, steps: int) -> tuple[float, float]:
    wall, cpu = [], []
    for i in range(windows):
        first, second = (a, b) if i % 2 == 0 else (b, a)
        rates = {id(first): _window(first, steps), id(second): _window(second, steps)}
        wall.append(rates[id(b)][0] / rates[id(a)][0])
        cpu.append(rates[id(b)][1] / rates[id(a)][1])
    return statistics.median(wall), statistics.median(cpu)


def main() -> None:
    """Run the benchmark and print its figures."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--n", type=int, default=2)
    parser.add_argument("--windows", type=int, default=8)
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args()
    with (
        nbdist.DistSession(args.n, cpu=True, threads=1) as never,
        nbdist.DistSession(args.n, cpu=True, threads=1) as debug,
    ):
        for s in (never, debug):
            s.run(TRAIN)
            _window(s, args.steps)  # warm-up
        aa = _pairs(never, debug, args.windows, args.steps)
        # What the debugger does on the ranks when it is switched on.
        router = LabDebugRouter(types.SimpleNamespace(do_debug_request=None))
        router.active = True
        endpoints = debug.apply(lab_debug.prepare, "pass", "/nonexistent/cell.py", 1, "\npass")
        targets = [(rank, e["host"], e["port"], None, None) for rank, e in enumerate(endpoints)]
        failed = router.connect(targets)
        if failed:
            raise SystemExit(f"the router could not attach to the ranks: {failed}")
        for future in [
            c.request(
                "setBreakpoints",
                {"source": {"path": "/nonexistent/cell.py"}, "breakpoints": [{"line": 2}]},
            )
            for c in router._ranks.values()
        ]:  # noqa: SLF001 - a benchmark's peek
            future.result(30)
        on = _pairs(never, debug, args.windows, args.steps)
        router.disconnect()
        off = _pairs(never, debug, args.windows, args.steps)
    print(f"ranks={args.n} windows={args.windows} steps={args.steps}; load average {_load()}")
    print("median debug/never ratios:          steps/s (wall)  steps per CPU-s")
    print(f"A/A (debugger never on in either):  {aa[0]:.3f}           {aa[1]:.3f}")
    print(f"debugger on, breakpoint not hit:    {on[0]:.3f}           {on[1]:.3f}")
    print(
        f"debugger switched off again:        {off[0]:.3f}           {off[1]:.3f}  (goal >= 0.99)"
    )


def _load() -> str:
    return " ".join(f"{x:.1f}" for x in os.getloadavg())


if __name__ == "__main__":
    main()
