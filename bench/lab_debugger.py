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

Figures: median steps/s of ``debug`` windows over ``never`` windows, while on and
after off (goal for off: within 1 %), and an A/A pair before the debugger was
ever on (the noise floor of the run).

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
    t0 = time.perf_counter()
    for _ in range(steps):
        _opt.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(_model(_x), _y).backward()
        _opt.step()
    dist.barrier()
    return steps / (time.perf_counter() - t0)
"""


def _window(session, steps: int) -> float:
    session.run(f"_rate = window({steps})")
    return session.pull("_rate", rank=0)


def _pairs(a, b, windows: int, steps: int) -> float:
    ratios = []
    for i in range(windows):
        first, second = (a, b) if i % 2 == 0 else (b, a)
        rates = {id(first): _window(first, steps), id(second): _window(second, steps)}
        ratios.append(rates[id(b)] / rates[id(a)])
    return statistics.median(ratios)


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
        for rank, endpoint in enumerate(endpoints):
            router.connect(rank, endpoint["host"], endpoint["port"])
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
    print(f"ranks={args.n} windows={args.windows} steps={args.steps}")
    print(f"A/A (debugger never on in either): debug/never = {aa:.3f}")
    print(f"debugger on, breakpoint not hit:  debug/never = {on:.3f}")
    print(f"debugger switched off again:      debug/never = {off:.3f}  (goal >= 0.99)")


if __name__ == "__main__":
    main()
