"""Round trip of a no-op cell on every rank, against raw ipyparallel on the same engines.

One cluster per rank count, started through a real IPython shell
(``InteractiveShell.instance()``, ``%load_ext nbdist``, ``%dist_start N``). On
its engines, interleaved in every iteration (so a busy machine slows all alike):

- raw:     ``session.client[engine_ids].execute("pass", block=True)`` (the baseline)
- run:     ``session.run("pass")`` (what ``%%on_all_ranks`` calls)
- magic:   ``shell.run_cell_magic("on_all_ranks", "", "pass")`` (the whole magic)

A cell with nothing to show (``pass``) goes to the ranks as ``silent=True``,
like the raw baseline; a cell that ends with an expression must go
``silent=False`` so its value can be shown. That case is measured too:

- magic_expr: ``%%on_all_ranks`` of ``None`` (ends with an expression, shows nothing)

References that split the difference between raw and run:

- raw_loud:   ``execute("pass", silent=False, block=True)``: ipyparallel's
  ``execute`` defaults to ``silent=True`` (no execute_input/execute_result on
  iopub, no execution count); a cell that shows a value needs ``silent=False``.
- raw_output: raw_loud, non-blocking, then ``ar.get()`` and ``ar.wait_for_output()``:
  also waits until every engine's output is complete (iopub idle), as nbdist must
  before it can show all of a cell's output.

The nbdist paths use the session's default run history; the benchmark points
``NBDIST_HISTORY`` at a temporary file (removed at the end) unless it is set.

Median and p90 of 50 round trips after warm-up; the figure is the ratio of the
medians to raw (goal <= 1.2; the debugging loop's goal for the magic: <= 1.1).

Usage: python bench/roundtrip.py [--n 2 4] [--reps 50] [--warmup 5] [--quick]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import (  # noqa: E402
    CpuMeter,
    assert_no_children,
    conclude,
    load,
    machine,
    median,
    p90,
    ratio,
    run_benchmark,
)

GOAL = 1.2
# The debugging loop's stricter goal: a no-op %%on_all_ranks within 1.1x raw execute.
LOOP_GOAL = 1.1
CODE = "pass"


def _shell():
    from IPython.core.interactiveshell import InteractiveShell

    shell = InteractiveShell.instance()
    shell.run_line_magic("load_ext", "nbdist")
    return shell


def measure(shell, n: int, reps: int, warmup: int) -> dict:
    import nbdist

    with contextlib.redirect_stdout(io.StringIO()) as banner:
        shell.run_line_magic("dist_start", f"{n} --cpu")
    print(f"  {banner.getvalue().strip()}", flush=True)
    session = nbdist.current_session()
    try:
        engine_ids = [r.engine_id for r in session.ranks]
        view = session.client[engine_ids]

        def raw():
            view.execute(CODE, block=True)

        def raw_loud():
            # ipyparallel's execute defaults to silent=True (no execute_input /
            # execute_result, no execution count); a cell that shows a value needs silent=False.
            view.execute(CODE, silent=False, block=True)

        def raw_output():
            # raw_loud, plus waiting until every engine's output is complete
            # (iopub idle), which nbdist must do to show all of a cell's output.
            ar = view.execute(CODE, silent=False, block=False)
            ar.get()
            ar.wait_for_output()

        def run():
            session.run(CODE)

        def magic():
            shell.run_cell_magic("on_all_ranks", "", CODE)

        def magic_expr():
            shell.run_cell_magic("on_all_ranks", "", "None")

        paths = {
            "raw": raw,
            "raw_loud": raw_loud,
            "raw_output": raw_output,
            "run": run,
            "magic": magic,
            "magic_expr": magic_expr,
        }
        for _ in range(warmup):
            for fn in paths.values():
                fn()
        times: dict[str, list[float]] = {name: [] for name in paths}
        order = list(paths)
        for i in range(reps):
            # Rotate the order so no path always runs right after another.
            k = i % len(order)
            for name in order[k:] + order[:k]:
                t0 = time.perf_counter()
                paths[name]()
                times[name].append(time.perf_counter() - t0)
    finally:
        with contextlib.redirect_stdout(io.StringIO()):
            shell.run_line_magic("dist_stop", "")
        if session.running:  # the magic stops it; this is the safety net
            session.stop()
    base = median(times["raw"])
    row = {"n": n, "reps": reps}
    for name, values in times.items():
        row[name] = {
            "median_ms": round(median(values) * 1e3, 3),
            "p90_ms": round(p90(values) * 1e3, 3),
            "ratio": round(ratio(median(values), base), 3),
        }
    return row


def _main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, nargs="+", default=None, help="ranks (default: 2 4)")
    parser.add_argument("--reps", type=int, default=None, help="round trips per path (default 50)")
    parser.add_argument("--warmup", type=int, default=5, help="untimed round trips per path")
    parser.add_argument("--quick", action="store_true", help="smoke run: n=2, 10 round trips")
    args = parser.parse_args(argv)
    ns = args.n or ([2] if args.quick else [2, 4])
    reps = args.reps or (10 if args.quick else 50)
    warmup = min(args.warmup, 2) if args.quick else args.warmup

    info = machine()
    meter = CpuMeter()
    print(f"roundtrip: n={ns}, {reps} round trips after {warmup} warm-up, {info}", flush=True)
    rows = []
    leftovers: list[int] = []
    try:
        shell = _shell()
        for n in ns:
            rows.append(measure(shell, n, reps, warmup))
            print(f"  n={n} done, load {load()}", flush=True)
    finally:
        leftovers = assert_no_children()
        cpu = meter.read()

    print()
    print(f"{'n':>2} {'path':<10} {'median':>9} {'p90':>9} {'x raw':>6}")
    for row in rows:
        for name in ("raw", "raw_loud", "raw_output", "run", "magic", "magic_expr"):
            r = row[name]
            print(
                f"{row['n']:>2} {name:<10} {r['median_ms']:>7.2f}ms {r['p90_ms']:>7.2f}ms "
                f"{r['ratio']:>5.2f}x"
            )
    ok = all(row[p]["ratio"] <= GOAL for row in rows for p in ("run", "magic"))
    magic = ", ".join(f"n={row['n']} {row['magic']['ratio']:.2f}x" for row in rows)
    loop_ok = all(row["magic"]["ratio"] <= LOOP_GOAL for row in rows)
    print(
        f"no-op %%on_all_ranks <= {LOOP_GOAL}x raw execute: {'met' if loop_ok else 'not met'} ({magic})"
    )
    goal = f"session.run and %%on_all_ranks <= {GOAL}x raw execute"
    extra = dict(code=CODE, loop_goal_ratio=LOOP_GOAL, loop_goal_met=loop_ok, rows=rows)
    conclude("roundtrip", goal, GOAL, ok, leftovers, cpu, info, args.quick, **extra)
    return 0


if __name__ == "__main__":
    run_benchmark(_main)
