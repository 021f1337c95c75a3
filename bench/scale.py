"""Many ranks: start, cells, status and stop from 2 to 256 CPU ranks, each against a baseline at that N.

Runs in the benchmark's own process, which plays the notebook kernel (an
IPython shell with ``%load_ext nbdist``; the magics are the user's). For each N:

- start: ``%dist_start N --cpu --threads 1`` to ready, against the fork floor
  measured just before at the same N (one process imports torch and
  ipyparallel's engine, forks N children that exit, reaps them), and the
  kernel's own CPU time during the start;
- cells, interleaved (each repetition runs every path once, rotating the order):
  a no-op (``pass``) and an all_reduce of one float, each through
  ``%%on_all_ranks`` and through raw ipyparallel on the same engines,
  ``DirectView.execute(block=True)`` (the baseline) and
  ``Client.broadcast_view().execute(block=True)`` (the tree scheduler);
  figures are medians, ratios are to the DirectView median of the same run;
- the kernel's CPU per cell (its own process's user+system time, mean over the
  repetitions of the ``%%on_all_ranks`` no-op), to see how it grows with N;
- an error on every rank (``raise ValueError(...)``, the same on all): ``%%on_all_ranks``
  against raw ``DirectView.execute`` (ipyparallel's ``CompositeError``), and how many of
  nbdist's error cells released the ranks and formed the group again (none should: no rank
  waits for another);
- a 1 MiB output cell: 1 MiB printed in all, split evenly over the ranks
  (64-byte lines), shown by ``%%on_all_ranks``, against raw
  ``DirectView.execute(silent=False)`` waiting for all output;
- idle: the CPU every process of the session uses over 10 s with no cell running, in
  cores, and the part of it that is gloo's own TCP loop threads (what any gloo rank
  costs idle, under torchrun too: gloo's loop wakes every 10 ms) as its baseline;
- ``%dist_status`` (text), and ``%dist_stop`` until nothing of it is left;
- memory: the unique memory (USS) of every process the start made, per rank,
  and the kernel's RSS growth.

Usage: python bench/scale.py [--n 2 8 32 64 128 256] [--reps R] [--quick]
(``--quick``: N = 2, 8, 32 and few repetitions; a smoke run, not figures to quote).
"""

from __future__ import annotations

import argparse
import contextlib
import io
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
    median,
    ratio,
    run_benchmark,
)
from startup import floor_import_then_fork  # noqa: E402

from nbdist.launch.heartbeat import period_ms  # noqa: E402

NOOP_GOAL = 1.1  # no-op %%on_all_ranks <= 1.1x raw DirectView.execute at every N
ALL_NS = [2, 8, 32, 64, 128, 256]
QUICK_NS = [2, 8, 32]
NOOP = "pass"
ALL_REDUCE = "t = torch.ones(1)\ntorch.distributed.all_reduce(t)"
ERROR = "raise ValueError('the same on every rank')"
OUTPUT_BYTES = 1 << 20
LINE = 64  # bytes per printed line, newline included
IDLE_S = 10


def _output_code(n: int) -> str:
    lines = OUTPUT_BYTES // LINE // n
    return f"for i in range({lines}):\n    print(f'{{rank:05d}} {{i:07d}} ' + 'x' * {LINE - 15})"


def _failing(fn, released: list[str]):
    """``fn`` made a path that must raise; a failure whose words say ranks were released is kept."""

    def call():
        try:
            fn()
        except Exception as exc:  # raw: ipyparallel's CompositeError; nbdist: RankError
            if "released" in str(exc):
                released.append(str(exc).splitlines()[-1])
            return
        raise AssertionError(f"{ERROR!r} did not fail")

    return call


def _kernel_cpu() -> float:
    # This process's user+system time, all its threads (ns resolution; psutil's is 10 ms).
    return time.process_time()


def _quiet(fn, *args):
    with contextlib.redirect_stdout(io.StringIO()) as out:
        fn(*args)
    return out.getvalue()


def _shell():
    from IPython.core.interactiveshell import InteractiveShell

    shell = InteractiveShell.instance()
    shell.run_line_magic("load_ext", "nbdist")
    return shell


def _reps_for(n: int, asked: int | None, quick: bool) -> int:
    if asked:
        return asked
    if quick:
        return 3
    return 15 if n <= 8 else 9 if n <= 64 else 5


def measure(shell, n: int, reps: int) -> dict:
    import nbdist

    me = psutil.Process()
    floor_s, _ = floor_import_then_fork(n, engine_stack=True)
    rss0 = me.memory_info().rss
    cpu0, t0 = _kernel_cpu(), time.perf_counter()
    banner = _quiet(shell.run_line_magic, "dist_start", f"{n} --cpu --threads 1 --timeout 900")
    ready_s = time.perf_counter() - t0
    start_cpu_s = _kernel_cpu() - cpu0
    print(f"  {banner.strip().splitlines()[-1] if banner.strip() else banner}", flush=True)
    session = nbdist.current_session()
    row: dict = {"n": n, "reps": reps, "floor_s": round(floor_s, 2), "ready_s": round(ready_s, 2)}
    row["ready_x_floor"] = round(ratio(ready_s, floor_s), 2)
    row["start_kernel_cpu_s"] = round(start_cpu_s, 2)
    try:
        ours = me.children(recursive=True)
        uss = 0
        for proc in ours:
            with contextlib.suppress(psutil.Error):
                uss += proc.memory_full_info().uss
        row["processes"] = len(ours)
        row["uss_per_rank_mib"] = round(uss / n / 2**20, 1)
        row["uss_total_gib"] = round(uss / 2**30, 2)
        row["kernel_rss_growth_mib"] = round((me.memory_info().rss - rss0) / 2**20, 1)
        row["idle_cores"], row["idle_gloo_cores"] = _idle_cores(ours, IDLE_S)

        engine_ids = [r.engine_id for r in session.ranks]
        direct = session.client[engine_ids]
        broadcast = session.client.broadcast_view(targets=engine_ids)
        out_code = _output_code(n)

        def raw_output():
            ar = direct.execute(out_code, silent=False, block=False)
            ar.get()
            ar.wait_for_output()

        released: list[str] = []
        paths = {
            "noop_direct": lambda: direct.execute(NOOP, block=True),
            "noop_broadcast": lambda: broadcast.execute(NOOP, block=True),
            "noop_nbdist": lambda: _quiet(shell.run_cell_magic, "on_all_ranks", "", NOOP),
            "allreduce_direct": lambda: direct.execute(ALL_REDUCE, block=True),
            "allreduce_broadcast": lambda: broadcast.execute(ALL_REDUCE, block=True),
            "allreduce_nbdist": lambda: _quiet(
                shell.run_cell_magic, "on_all_ranks", "", ALL_REDUCE
            ),
            "error_direct": _failing(lambda: direct.execute(ERROR, block=True), []),
            "error_nbdist": _failing(
                lambda: _quiet(shell.run_cell_magic, "on_all_ranks", "", ERROR), released
            ),
            "output_direct": raw_output,
            "output_nbdist": lambda: _quiet(shell.run_cell_magic, "on_all_ranks", "", out_code),
        }
        for fn in paths.values():  # warm-up
            fn()
        times: dict[str, list[float]] = {k: [] for k in paths}
        cpu: dict[str, list[float]] = {k: [] for k in paths}
        order = list(paths)
        for i in range(reps):
            k = i % len(order)
            for name in order[k:] + order[:k]:
                c0, t0 = _kernel_cpu(), time.perf_counter()
                paths[name]()
                times[name].append(time.perf_counter() - t0)
                cpu[name].append(_kernel_cpu() - c0)
        for name in paths:
            row[f"{name}_ms"] = round(median(times[name]) * 1e3, 1)
            row[f"{name}_kernel_cpu_ms"] = round(sum(cpu[name]) / len(cpu[name]) * 1e3, 2)
        row["error_cells_released"] = len(released)  # of reps + 1 (the warm-up's counts)
        row["error_cells"] = reps + 1
        if released:
            print(f"  an error cell released the ranks: {released[0]}", flush=True)
        for kind in ("noop", "allreduce", "error", "output"):
            base = median(times[f"{kind}_direct"])
            row[f"{kind}_nbdist_x"] = round(ratio(median(times[f"{kind}_nbdist"]), base), 2)
            if f"{kind}_broadcast" in paths:
                row[f"{kind}_broadcast_x"] = round(
                    ratio(median(times[f"{kind}_broadcast"]), base), 2
                )

        status = []
        for _ in range(3):
            t0 = time.perf_counter()
            text = _quiet(shell.run_line_magic, "dist_status", "")
            status.append(time.perf_counter() - t0)
        row["status_ms"] = round(median(status) * 1e3, 1)
        row["status_lines"] = len(text.strip().splitlines())
    finally:
        pids = {p.pid for p in me.children(recursive=True)}
        t0 = time.perf_counter()
        _quiet(shell.run_line_magic, "dist_stop", "")
        row["stop_s"] = round(time.perf_counter() - t0, 2)
        if session.running:  # the magic stops it; this is the safety net
            session.stop()
        gone_at = time.perf_counter()
        while any(psutil.pid_exists(p) and _alive(p) for p in pids):
            if time.perf_counter() - gone_at > 60:
                break
            time.sleep(0.1)
        row["stop_all_gone_s"] = round(time.perf_counter() - t0, 2)
        row["left_after_stop"] = sorted(p for p in pids if _alive(p))
    return row


def _thread_cpu(procs) -> tuple[float, float]:
    """CPU seconds so far of ``procs`` and the kernel: (all threads, gloo's loop threads)."""
    total = gloo = 0.0
    for proc in procs:
        with contextlib.suppress(psutil.Error, OSError):
            for thread in proc.threads():
                spent = thread.user_time + thread.system_time
                total += spent
                with open(f"/proc/{proc.pid}/task/{thread.id}/comm") as f:
                    if f.read().startswith("gloo_tcp_loop"):
                        gloo += spent
    return total + _kernel_cpu(), gloo


def _idle_cores(procs, seconds: float) -> tuple[float, float]:
    """Cores the session's processes use while no cell runs: (all, gloo's loop threads)."""
    time.sleep(1)  # the start's last replies
    total0, gloo0 = _thread_cpu(procs)
    t0 = time.perf_counter()
    time.sleep(seconds)
    total1, gloo1 = _thread_cpu(procs)
    wall = time.perf_counter() - t0
    return round((total1 - total0) / wall, 3), round((gloo1 - gloo0) / wall, 3)


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _table(rows: list[dict]) -> str:
    head = (
        "| N | floor | ready | ×floor | start CPU (kernel) | no-op raw DirectView | broadcast | "
        "nbdist | all_reduce raw | broadcast | nbdist | error raw | nbdist (released) | "
        "1 MiB out raw | nbdist | "
        "kernel CPU / no-op cell | `%dist_status` | stop | USS / rank |"
    )
    sep = "|" + "---|" * (head.count("|") - 1)
    lines = [head, sep]
    for r in rows:
        lines.append(
            f"| {r['n']} | {r['floor_s']:.2f} s | {r['ready_s']:.1f} s | {r['ready_x_floor']:.2f}× "
            f"| {r['start_kernel_cpu_s']:.2f} s "
            f"| {r['noop_direct_ms']:.0f} ms | {r['noop_broadcast_ms']:.0f} ms "
            f"({r['noop_broadcast_x']:.2f}×) | {r['noop_nbdist_ms']:.0f} ms "
            f"({r['noop_nbdist_x']:.2f}×) "
            f"| {r['allreduce_direct_ms']:.0f} ms | {r['allreduce_broadcast_ms']:.0f} ms "
            f"({r['allreduce_broadcast_x']:.2f}×) | {r['allreduce_nbdist_ms']:.0f} ms "
            f"({r['allreduce_nbdist_x']:.2f}×) "
            f"| {r['error_direct_ms']:.0f} ms | {r['error_nbdist_ms']:.0f} ms "
            f"({r['error_nbdist_x']:.2f}×; {r['error_cells_released']} of {r['error_cells']}) "
            f"| {r['output_direct_ms']:.0f} ms | {r['output_nbdist_ms']:.0f} ms "
            f"({r['output_nbdist_x']:.2f}×) "
            f"| {r['noop_nbdist_kernel_cpu_ms']:.1f} ms (raw {r['noop_direct_kernel_cpu_ms']:.1f}) "
            f"| {r['status_ms']:.0f} ms | {r['stop_s']:.1f} s | {r['uss_per_rank_mib']:.0f} MiB |"
        )
    return "\n".join(lines)


def _main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, nargs="+", default=None, help=f"ranks (default {ALL_NS})")
    parser.add_argument("--reps", type=int, default=None, help="repetitions per cell path")
    parser.add_argument("--quick", action="store_true", help=f"smoke run: N = {QUICK_NS}")
    args = parser.parse_args(argv)
    ns = args.n or (QUICK_NS if args.quick else ALL_NS)

    info = machine()
    meter = CpuMeter()
    print(f"scale: N = {ns}, {info}", flush=True)
    rows: list[dict] = []
    try:
        shell = _shell()
        for n in ns:
            print(f"N={n}: load {load()}", flush=True)
            rows.append(measure(shell, n, _reps_for(n, args.reps, args.quick)))
            print(f"  {rows[-1]}", flush=True)
    finally:
        leftovers = assert_no_children()
        cpu = meter.read()

    print()
    print(_table(rows))
    ok = all(r["noop_nbdist_x"] <= NOOP_GOAL for r in rows)
    per_rank = [r["noop_nbdist_kernel_cpu_ms"] / r["n"] for r in rows]
    linear = (
        all(b <= 1.5 * max(per_rank[: i + 1]) for i, b in enumerate(per_rank[1:], 1))
        if rows
        else True
    )
    print(
        "kernel CPU per no-op cell per rank (ms): "
        + ", ".join(f"N={r['n']} {p:.2f}" for r, p in zip(rows, per_rank))
        + f" ({'at most linear' if linear else 'grows faster than linear'} in N)"
    )
    for r in rows:
        print(
            f"idle N={r['n']} (heartbeat every {period_ms(r['n'])} ms): "
            f"{r['idle_cores']:.3f} cores, gloo's own loop threads {r['idle_gloo_cores']:.3f} "
            f"(the rest {r['idle_cores'] - r['idle_gloo_cores']:.3f}: ipyparallel, nbdist)"
        )
    goal = f"no-op %%on_all_ranks <= {NOOP_GOAL}x raw DirectView.execute at every N"
    extra = dict(kernel_cpu_linear=linear, rows=rows)
    conclude("scale", goal, NOOP_GOAL, ok, leftovers, cpu, info, args.quick, **extra)
    return 0


if __name__ == "__main__":
    run_benchmark(_main)
