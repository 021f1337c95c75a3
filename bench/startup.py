"""Start-to-ready of ``DistSession(n).start()`` against two floors measured in the same run.

nbdist: ``DistSession(n).start()`` returns once the engines registered, torch is
imported on them, the process group is formed and one all_reduce went through.
Timed from before the constructor to the return of ``start()``; then ``stop()``.

Floors (same OMP_NUM_THREADS as the ranks get):
(a) n parallel ``python -c "import torch, torch.distributed"``: wall time until all
    exit (with ``os._exit(0)`` right after the import);
(b) one process that imports torch + torch.distributed and forks n children that
    exit at once: wall time until it has reaped them (it prints a CLOCK_MONOTONIC
    timestamp then). Also reported: until that process has exited normally,
    "b+exit", for comparison with figures that included it; and "b+engine":
    the same process also importing ipyparallel's engine before forking (what
    any fork-after-import launcher of ipyparallel engines must import).
A normal exit of a process that imported torch spends ~0.8 s here in interpreter
teardown, which a rank that stays up never pays; the floors leave it out.

The goal (<= 1.2 x floor b) is checked against b+exit: the goal's own reference
figures (floor b 2.2 s, a fork-after-import launcher 2.5 s = 1.12 x) timed whole
processes, exit included. The ratio to the stricter floor b is printed as well.

The debugging loop's goal (<= 1.3 x floor a) is printed too: floor (a) is the same
work as n ranks importing torch each, so it grows with n / cores on a machine with
fewer cores than ranks, where a zygote that imports once gains.

Reference row: the same with ``start_method="spawn"`` (separate engine processes).
Every repetition measures all variants back to back (interleaved), and each figure
is the median over repetitions, so a busy machine slows all of them alike.

Restart ratio (fork rows): within each repetition's session, right after its
start, ``restart()`` on request, then ``restart()`` after rank 1 was SIGKILLed
(timed from the call; the death is noticed before). Each is divided by that
session's own start-to-ready; the figure is the median of those ratios (goal
<= 0.5: the zygote forks fresh ranks, the controller stays).

Usage: python bench/startup.py [--n 2 4] [--reps 3] [--no-spawn] [--no-restart] [--no-floor-a]
[--quick]
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import (  # noqa: E402
    CpuMeter,
    assert_no_children,
    load,
    machine,
    median,
    print_goal_and_cpu,
    print_summary,
    ratio,
    run_benchmark,
    threads_per_rank,
)

GOAL_VS_FORK_FLOOR = 1.2
GOAL_VS_PARALLEL_IMPORTS = 1.3
GOAL_RESTART_VS_START = 0.5

# os._exit: a process that imported torch spends ~0.8 s (2 cores) in interpreter
# teardown on a normal exit, which the ranks never pay; the floor leaves it out.
_IMPORT = "import os, torch, torch.distributed; os._exit(0)"
_FORK_FLOOR = """
import os, sys, time
import torch, torch.distributed
n, engine_stack = int(sys.argv[1]), sys.argv[2] == "1"
if engine_stack:
    from ipyparallel.engine.app import IPEngine
pids = []
for _ in range(n):
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    pids.append(pid)
for pid in pids:
    os.waitpid(pid, 0)
print(time.monotonic(), flush=True)  # all reaped: the floor ends here
if engine_stack:
    os._exit(0)
"""


def _env(n: int) -> dict:
    return dict(os.environ, OMP_NUM_THREADS=str(threads_per_rank(n)))


def floor_parallel_imports(n: int) -> float:
    env = _env(n)
    t0 = time.perf_counter()
    procs = [subprocess.Popen([sys.executable, "-c", _IMPORT], env=env) for _ in range(n)]
    codes = [p.wait() for p in procs]
    elapsed = time.perf_counter() - t0
    if any(codes):
        raise RuntimeError(f"floor (a): import failed with exit codes {codes}")
    return elapsed


def floor_import_then_fork(n: int, engine_stack: bool = False) -> tuple[float, float]:
    """(until the children are reaped, until the process has also exited normally).

    ``engine_stack``: also import ipyparallel's engine (IPython, ipykernel, zmq)
    before forking, as nbdist's zygote must; that process then skips its teardown.
    """
    t0 = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-c", _FORK_FLOOR, str(n), "1" if engine_stack else "0"],
        env=_env(n),
        check=True,
        stdout=subprocess.PIPE,
        text=True,
    )
    exited = time.monotonic() - t0
    # CLOCK_MONOTONIC is system-wide on Linux: the child's timestamp compares with ours.
    reaped = float(proc.stdout.split()[-1]) - t0
    return reaped, exited


class _PhaseTimer:
    """Wraps nbdist's two start-up phases (read-only: nbdist itself is not changed)."""

    def __init__(self):
        from nbdist.driver import session
        from nbdist.launch import cluster

        self.phases: dict[str, float] = {}
        self._cluster, self._session = cluster, session
        self._start_local = cluster.start_local
        self._form_group = session.DistSession._form_group
        timer = self

        def start_local(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return timer._start_local(*args, **kwargs)
            finally:
                timer.phases["engines_registered_s"] = time.perf_counter() - t0

        def form_group(self_):
            t0 = time.perf_counter()
            try:
                return timer._form_group(self_)
            finally:
                timer.phases["group_formed_s"] = time.perf_counter() - t0

        cluster.start_local = start_local
        session.DistSession._form_group = form_group

    def restore(self):
        self._cluster.start_local = self._start_local
        self._session.DistSession._form_group = self._form_group


def _restart(session, n: int) -> tuple[float, str]:
    t0 = time.perf_counter()
    session.restart()
    took = time.perf_counter() - t0
    if len(session.ranks) != n:
        raise RuntimeError(f"expected {n} ranks after the restart, got {session.ranks}")
    return took, session.restarted.note


def _kill_rank(session, rank: int) -> None:
    os.kill(session.ranks[rank].pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while rank not in session.dead_ranks():
        if time.monotonic() > deadline:
            raise RuntimeError(f"rank {rank} was SIGKILLed but not seen dead within 10 s")
        time.sleep(0.02)


def nbdist_start_stop(n: int, start_method: str, phases: _PhaseTimer, restart=False) -> dict:
    from nbdist import DistSession

    phases.phases.clear()
    restarts: dict = {}
    start_phases: dict = {}
    t0 = time.perf_counter()
    session = DistSession(n, cpu=True, start_method=start_method)
    try:
        session.start()
        ready = time.perf_counter() - t0
        ranks = session.ranks
        method = session.cluster.start_method if session.cluster else "?"
        note = session.cluster.start_note if session.cluster else ""
        if len(ranks) != n:
            raise RuntimeError(f"expected {n} ranks, got {ranks}")
        start_phases = dict(phases.phases)
        if restart:
            restarts["restart_request_s"], restarts["restart_note"] = _restart(session, n)
            _kill_rank(session, n - 1)
            restarts["restart_dead_s"], note_dead = _restart(session, n)
            restarts["restart_note"] = restarts["restart_note"] or note_dead
            session.run("t = torch.ones(1); dist.all_reduce(t)")  # the group works again
    finally:
        t1 = time.perf_counter()
        killed = session.stop()
        stop = time.perf_counter() - t1
    return dict(
        ready_s=ready,
        stop_s=stop,
        method=method,
        note=note,
        killed=killed,
        startup_seconds=session.startup_seconds,
        **(start_phases or phases.phases),
        **restarts,
    )


def _main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, nargs="+", default=None, help="ranks (default: 2 4)")
    parser.add_argument("--reps", type=int, default=None, help="repetitions (default 3)")
    parser.add_argument("--no-spawn", action="store_true", help="skip the spawn reference row")
    parser.add_argument(
        "--no-restart", action="store_true", help="skip the restart ratio (fork rows)"
    )
    parser.add_argument(
        "--quick", action="store_true", help="smoke run: n=2, 1 repetition, no spawn row"
    )
    parser.add_argument(
        "--no-floor-a",
        action="store_true",
        help="skip floor (a) (n processes importing torch at once: 256 of them need ~75 GiB)",
    )
    args = parser.parse_args(argv)
    ns = args.n or ([2] if args.quick else [2, 4])
    reps = args.reps or (1 if args.quick else 3)
    spawn = not (args.no_spawn or args.quick)
    restart = not args.no_restart

    info = machine()
    meter = CpuMeter()
    print(f"startup: n={ns}, {reps} repetitions, {info}", flush=True)

    # Kernel-side imports happen once per kernel (at the first %dist_start); measured
    # here once and kept out of the start-to-ready figures.
    t0 = time.perf_counter()
    import ipyparallel  # noqa: F401

    import nbdist.driver.session  # noqa: F401

    kernel_import_s = time.perf_counter() - t0
    print(
        f"kernel-side import of nbdist.driver.session + ipyparallel: {kernel_import_s:.2f} s",
        flush=True,
    )

    # Warm the page cache so the first measured variant is not penalised.
    subprocess.run([sys.executable, "-c", _IMPORT], env=_env(2), check=True)

    phases = _PhaseTimer()
    rows = []
    leftovers: list[int] = []
    try:
        for n in ns:
            samples: dict[str, list] = {
                "a": [],
                "b": [],
                "b_exit": [],
                "b_engine": [],
                "fork": [],
                "spawn": [],
            }
            for rep in range(reps):
                samples["a"].append(float("nan") if args.no_floor_a else floor_parallel_imports(n))
                reaped, exited = floor_import_then_fork(n)
                samples["b"].append(reaped)
                samples["b_exit"].append(exited)
                samples["b_engine"].append(floor_import_then_fork(n, engine_stack=True)[0])
                samples["fork"].append(nbdist_start_stop(n, "fork", phases, restart=restart))
                if spawn:
                    samples["spawn"].append(nbdist_start_stop(n, "spawn", phases))
                line = (
                    f"  n={n} rep {rep + 1}/{reps}: floor(a) {samples['a'][-1]:.2f} s, "
                    f"floor(b) {samples['b'][-1]:.2f} s (b+exit {samples['b_exit'][-1]:.2f} s, "
                    f"b+engine imports {samples['b_engine'][-1]:.2f} s), "
                    "nbdist fork "
                    f"{samples['fork'][-1]['ready_s']:.2f} s "
                    f"(stop {samples['fork'][-1]['stop_s']:.2f} s)"
                )
                if restart:
                    fork = samples["fork"][-1]
                    line += (
                        f", restart on request {fork['restart_request_s']:.2f} s, "
                        f"after a dead rank {fork['restart_dead_s']:.2f} s"
                    )
                if spawn:
                    line += (
                        f", spawn {samples['spawn'][-1]['ready_s']:.2f} s "
                        f"(stop {samples['spawn'][-1]['stop_s']:.2f} s)"
                    )
                print(line + f", load {load()}", flush=True)
            a, b = median(samples["a"]), median(samples["b"])
            b_exit = median(samples["b_exit"])
            b_engine = median(samples["b_engine"])
            for variant in ("fork", "spawn"):
                runs = samples[variant]
                if not runs:
                    continue
                ready = median([r["ready_s"] for r in runs])
                row = dict(
                    n=n,
                    start_method=variant,
                    effective_method=runs[-1]["method"],
                    floor_a_s=round(a, 3),
                    floor_b_s=round(b, 3),
                    floor_b_exit_s=round(b_exit, 3),
                    floor_b_engine_s=round(b_engine, 3),
                    ready_s=round(ready, 3),
                    ratio_a=round(ratio(ready, a), 3),
                    ratio_b=round(ratio(ready, b), 3),
                    ratio_b_exit=round(ratio(ready, b_exit), 3),
                    ratio_b_engine=round(ratio(ready, b_engine), 3),
                    stop_s=round(median([r["stop_s"] for r in runs]), 3),
                    engines_registered_s=round(
                        median([r.get("engines_registered_s", float("nan")) for r in runs]), 3
                    ),
                    group_formed_s=round(
                        median([r.get("group_formed_s", float("nan")) for r in runs]), 3
                    ),
                    killed_at_stop=sorted({p for r in runs for p in r["killed"]}),
                    samples_ready_s=[round(r["ready_s"], 3) for r in runs],
                    samples_floor_a_s=[round(x, 3) for x in samples["a"]],
                    samples_floor_b_s=[round(x, 3) for x in samples["b"]],
                )
                if runs[-1]["note"]:
                    row["note"] = runs[-1]["note"]
                if "restart_dead_s" in runs[-1]:
                    for kind in ("request", "dead"):
                        took = [r[f"restart_{kind}_s"] for r in runs]
                        row[f"restart_{kind}_s"] = round(median(took), 3)
                        row[f"restart_{kind}_ratio"] = round(
                            median([ratio(t, r["ready_s"]) for t, r in zip(took, runs)]), 3
                        )
                        row[f"samples_restart_{kind}_s"] = [round(t, 3) for t in took]
                    if runs[-1]["restart_note"]:
                        row["restart_note"] = runs[-1]["restart_note"]
                rows.append(row)
    finally:
        phases.restore()
        leftovers = assert_no_children()
        cpu = meter.read()

    print()
    print(
        f"{'n':>2} {'method':<6} {'floor a':>8} {'floor b':>8} {'b+exit':>8} {'b+eng':>8} "
        f"{'nbdist':>8} {'x a':>6} {'x b':>6} {'x b+ex':>6} {'x b+en':>6} {'stop':>6} "
        f"{'engines':>8} {'group':>6}"
    )
    for r in rows:
        print(
            f"{r['n']:>2} {r['start_method']:<6} {r['floor_a_s']:>7.2f}s {r['floor_b_s']:>7.2f}s "
            f"{r['floor_b_exit_s']:>7.2f}s {r['floor_b_engine_s']:>7.2f}s {r['ready_s']:>7.2f}s "
            f"{r['ratio_a']:>5.2f}x {r['ratio_b']:>5.2f}x {r['ratio_b_exit']:>5.2f}x "
            f"{r['ratio_b_engine']:>5.2f}x {r['stop_s']:>5.2f}s "
            f"{r['engines_registered_s']:>7.2f}s {r['group_formed_s']:>5.2f}s"
        )
    fork_rows = [r for r in rows if r["start_method"] == "fork"]
    restart_ok = None
    if restart:
        print(
            f"\n{'n':>2} {'start':>7} {'restart (request)':>18} {'x start':>8} "
            f"{'restart (dead rank)':>20} {'x start':>8}"
        )
        for r in fork_rows:
            print(
                f"{r['n']:>2} {r['ready_s']:>6.2f}s {r['restart_request_s']:>17.2f}s "
                f"{r['restart_request_ratio']:>7.2f}x {r['restart_dead_s']:>19.2f}s "
                f"{r['restart_dead_ratio']:>7.2f}x"
            )
        restart_ok = all(
            r["restart_request_ratio"] <= GOAL_RESTART_VS_START
            and r["restart_dead_ratio"] <= GOAL_RESTART_VS_START
            for r in fork_rows
        )
        print(
            f"restart <= {GOAL_RESTART_VS_START}x start (same session, median of ratios): "
            + ("met" if restart_ok else "not met")
        )
    # The debugging loop's goal: start-to-ready <= 1.3x n bare `python -c "import torch"` in
    # parallel (floor a). On fewer cores than ranks floor (a) pays the import n / cores
    # times over while the zygote imports once, so (a) is easy there and hard at n <= cores.
    loop_ok = all(r["ratio_a"] <= GOAL_VS_PARALLEL_IMPORTS for r in fork_rows)
    print(
        f"nbdist (fork) <= {GOAL_VS_PARALLEL_IMPORTS}x floor (a), n parallel imports: "
        + ("met" if loop_ok else "not met")
        + " ("
        + ", ".join(f"n={r['n']} {r['ratio_a']:.2f}x" for r in fork_rows)
        + ")"
    )
    # The goal's own figures (floor b 2.2 s, the zygote 2.5 s = 1.12x) timed whole
    # processes, exit included: that is b+exit here. Also said: against the stricter
    # floor that stops at the reap.
    ok = all(r["ratio_b_exit"] <= GOAL_VS_FORK_FLOOR for r in fork_rows)
    strict = all(r["ratio_b"] <= GOAL_VS_FORK_FLOOR for r in fork_rows)
    print(
        f"stricter: nbdist (fork) <= {GOAL_VS_FORK_FLOOR}x floor (b) until the reap: "
        + ("met" if strict else "not met")
    )
    print_goal_and_cpu(
        f"nbdist (fork) <= {GOAL_VS_FORK_FLOOR}x floor (b) as the goal measured it (b+exit)",
        ok,
        leftovers,
        cpu,
    )
    print_summary(
        dict(
            bench="startup",
            quick=args.quick,
            reps=reps,
            machine=info,
            load_end=load(),
            cpu=cpu,
            kernel_import_s=round(kernel_import_s, 3),
            goal_ratio_b=GOAL_VS_FORK_FLOOR,
            goal_met=ok,
            goal_met_strict_floor_b=strict,
            goal_restart_ratio=GOAL_RESTART_VS_START,
            goal_restart_met=restart_ok,
            leftover_pids=leftovers,
            rows=rows,
        )
    )
    return 0


if __name__ == "__main__":
    run_benchmark(_main)
