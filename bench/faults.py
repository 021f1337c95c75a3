"""Faults: how fast a failing, hung, interrupted or dead rank is noticed and the others released.

On one session of N CPU ranks (gloo), each case repeated ``--reps`` times:

- fail:      rank 1 raises while the others wait in ``all_reduce``; from the
             raise (timestamp taken on the rank) to the cell's RankError in the
             kernel, the group formed again included (a 0.5 s grace lets
             ranks that were about to finish do so).
- interrupt: rank 1 sleeps, the others wait in ``all_reduce``; from the
             KeyboardInterrupt in the kernel to RanksInterrupted (every rank
             stopped, the group formed again).
- where:     ``session.where()`` while rank 0 waits in ``all_reduce``.
- kill:      the kernel SIGKILLs rank 1 while rank 0 waits in ``all_reduce``;
             time until the session knows it died (``detect``) and until the
             cell fails (``cell``); then ``%dist_restart`` (``restart``).
- output:    one rank writes 10 MB to stdout and 10 MB to stderr; the cell's
             time with the default 1 MiB limit per stream and without limit.
- tracking:  cost of nbdist's bookkeeping around a collective: 2,000
             ``all_reduce`` of one float, tracked vs torch's own function, and
             the wrapper alone around a no-op (best of 3 x 200,000 calls).

Without nbdist's release, fail/kill/interrupt would wait for the group's
timeout (torch's default: 30 minutes; 58.8 s measured with a 60 s timeout).

``--long S`` adds a cell that runs S seconds (an all_reduce and a printed line
every second, metrics logged): it must complete (the 15-minute case: ``--long 900``).

Usage: python bench/faults.py [--n 2] [--reps 5] [--long 0] [--quick]
"""

from __future__ import annotations

import _thread
import argparse
import os
import signal
import sys
import threading
import time

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
from nbdist.errors import RankError, RanksInterrupted  # noqa: E402

HANG = "import time\nif rank == 1:\n    time.sleep(60)\ndist.all_reduce(torch.ones(1))\n"


def _fail(s) -> float:
    try:
        s.run(
            "import time\nif rank == 1:\n    raise ValueError(repr(time.time()))\n"
            "dist.all_reduce(torch.ones(1))\n",
            sink=ListSink(),
        )
    except RankError as err:
        return time.time() - float(err.failures[0].evalue)
    raise AssertionError("the cell did not fail")


def _interrupt(s) -> float:
    marks = {}

    def fire():
        marks["t"] = time.monotonic()
        _thread.interrupt_main()

    timer = threading.Timer(1.0, fire)
    timer.start()
    try:
        s.run(HANG, sink=ListSink())
    except RanksInterrupted as exc:
        assert not exc.still_running, exc
        return time.monotonic() - marks["t"]
    finally:
        timer.cancel()
    raise AssertionError("the cell was not interrupted")


def _where(s) -> float:
    run = s.run(HANG, block=False, sink=ListSink())
    try:
        time.sleep(0.5)
        t0 = time.perf_counter()
        found = s.where()
        took = time.perf_counter() - t0
        assert found[0].collective and found[0].collective["inside"], found
        return took
    finally:
        s.interrupt([1])
        try:
            run.wait()
        except RankError:
            pass


def _kill(s) -> dict:
    victim = s.ranks[1].pid
    out: dict = {}

    def kill():
        time.sleep(0.5)
        t0 = time.monotonic()
        os.kill(victim, signal.SIGKILL)
        while not s.dead_ranks():
            time.sleep(0.001)
        out["detect"] = time.monotonic() - t0
        out["t0"] = t0

    killer = threading.Thread(target=kill)
    killer.start()
    try:
        s.run(HANG, sink=ListSink())
    except RankError:
        out["cell"] = time.monotonic() - out["t0"]
    killer.join()
    t0 = time.monotonic()
    s.restart()
    out["restart"] = time.monotonic() - t0
    return out


def _output(s, limit: str) -> float:
    os.environ["NBDIST_OUTPUT_LIMIT"] = limit
    try:
        t0 = time.perf_counter()
        s.run(
            "import sys\nline = 'x' * 99 + '\\n'\nif rank == 0:\n"
            "    sys.stdout.write(line * 100_000)\n    sys.stderr.write(line * 100_000)\n",
            sink=ListSink(),
        )
        return time.perf_counter() - t0
    finally:
        os.environ.pop("NBDIST_OUTPUT_LIMIT", None)


def _tracking(s) -> dict:
    s.run(
        "import time\nt = torch.ones(1)\nfns = {'tracked': dist.all_reduce, "
        "'torch': dist.all_reduce.nbdist_original}\ncost = {}\n"
        "for _ in range(2):\n"
        "    for name, fn in fns.items():\n"
        "        dist.barrier(); t0 = time.perf_counter()\n"
        "        for _ in range(2000):\n"
        "            fn(t)\n"
        "        cost[name] = (time.perf_counter() - t0) / 2000\n",
        sink=ListSink(),
    )
    cost = s.pull("cost", rank=0)
    # The bookkeeping alone, around a function that does nothing (here, not on a rank).
    import timeit

    import torch

    from nbdist.engine import collectives

    def noop(x):
        return x

    tracked = collectives._tracked("all_reduce", noop)
    n = 200_000
    t = torch.ones(1)  # what a collective takes: its shape and dtype are recorded
    bare = min(timeit.repeat(lambda: noop(t), number=n, repeat=3)) / n
    wrapped = min(timeit.repeat(lambda: tracked(t), number=n, repeat=3)) / n
    return {
        "tracked_us": round(cost["tracked"] * 1e6, 1),
        "torch_us": round(cost["torch"] * 1e6, 1),
        "bookkeeping_us": round((wrapped - bare) * 1e6, 2),
    }


def _long(s, seconds: float) -> float:
    t0 = time.monotonic()
    s.run(
        "import time\nstart = time.monotonic()\nstep = 0\n"
        f"while time.monotonic() - start < {seconds}:\n"
        "    t = torch.ones(1); dist.all_reduce(t)\n"
        "    nbdist.log(step=step, loss=1.0 / (step + 1), samples=1)\n"
        "    if step % 60 == 0:\n"
        "        nbdist.print0(f'{time.monotonic() - start:.0f} s')\n"
        "    step += 1\n    time.sleep(1)\n",
        sink=ListSink(),
    )
    return time.monotonic() - t0


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=2)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--long", type=float, default=0.0, help="seconds of a long cell (0: none)")
    ap.add_argument("--quick", action="store_true", help="smoke run: 1 repetition")
    ap.add_argument("--long-only", action="store_true", help="only the long cell (with --long)")
    args = ap.parse_args()
    reps = 1 if args.quick else args.reps
    print("machine:", machine(), flush=True)
    meter = CpuMeter()
    s = nbdist.DistSession(args.n, timeout=120, group_timeout=60)
    s.start()
    summary: dict = {"bench": "faults", "n": args.n, "reps": reps}
    try:
        if not args.long_only:
            _measure_cases(s, reps, summary)
        if args.long:
            took = _long(s, args.long)
            summary["long_cell_s"] = round(took, 1)
            print(f"long cell of {args.long:g} s completed in {took:.1f} s", flush=True)
    finally:
        s.stop()
    leftovers = assert_no_children()
    ok = args.long_only or (
        summary["fail_max_s"] < 5
        and summary["interrupt_max_s"] < 2
        and summary["kill_cell_max_s"] < 5
    )
    print_goal_and_cpu(
        "failure and death release < 5 s, interrupt < 2 s", ok, leftovers, meter.read()
    )
    summary.update(goal_met=ok, leftover_pids=leftovers)
    print_summary(summary)
    return 0


def _measure_cases(s, reps: int, summary: dict) -> None:
    cases = {"fail": _fail, "interrupt": _interrupt, "where": _where}
    for name, fn in cases.items():
        times = [fn(s) for _ in range(reps)]
        summary[f"{name}_s"] = round(median(times), 3)
        summary[f"{name}_max_s"] = round(max(times), 3)
        print(f"{name}: median {median(times):.3f} s, max {max(times):.3f} s", flush=True)
    kills = [_kill(s) for _ in range(reps)]
    for key in ("detect", "cell", "restart"):
        values = [k[key] for k in kills]
        summary[f"kill_{key}_s"] = round(median(values), 3)
        summary[f"kill_{key}_max_s"] = round(max(values), 3)
        print(f"kill {key}: median {median(values):.3f} s, max {max(values):.3f} s")
    for label, limit in (("limited", ""), ("unlimited", "0")):
        took = median([_output(s, limit) for _ in range(max(1, reps // 2))])
        summary[f"output_{label}_s"] = round(took, 2)
        print(f"10 MB stdout + 10 MB stderr, {label}: {took:.2f} s", flush=True)
    summary.update(_tracking(s))
    print(
        f"all_reduce of one float: tracked {summary['tracked_us']} µs, "
        f"torch {summary['torch_us']} µs; bookkeeping alone {summary['bookkeeping_us']} µs",
        flush=True,
    )


if __name__ == "__main__":
    run_benchmark(main)
