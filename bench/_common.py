"""Helpers shared by the benchmark scripts (statistics, machine facts, process hygiene).

Not a benchmark itself; each ``bench/NAME.py`` imports it from its own directory.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import signal
import statistics
import sys
import time

import psutil

__all__ = [
    "CpuMeter",
    "assert_no_children",
    "private_history",
    "cores",
    "load",
    "machine",
    "median",
    "p90",
    "print_goal_and_cpu",
    "print_summary",
    "ratio",
    "run_benchmark",
    "threads_per_rank",
]


def median(values) -> float:
    return statistics.median(values)


def p90(values) -> float:
    """90th percentile, nearest-rank (no interpolation: a sample that was really measured)."""
    ordered = sorted(values)
    index = max(0, -(-len(ordered) * 9 // 10) - 1)  # ceil(0.9 n) - 1
    return ordered[index]


def ratio(value: float, baseline: float) -> float:
    return value / baseline if baseline else float("nan")


def cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def threads_per_rank(n: int) -> int:
    """What nbdist gives each rank by default: the cores shared among the ranks, at least 1."""
    return max(1, cores() // n)


def load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def machine() -> dict:
    import torch

    return {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %z"),
        "cores": cores(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.cuda.is_available(),
        "load": load(),
    }


def print_goal_and_cpu(goal: str, ok: bool, leftovers, cpu: dict) -> None:
    """The two closing lines every benchmark prints before its JSON summary."""
    print(
        f"goal: {goal}: "
        + ("met" if ok else "MISSED")
        + (f"; processes left behind: {leftovers}" if leftovers else "")
    )
    print(
        f"cpu during the run: this benchmark {cpu['own_cpu_s']} CPU-s, other processes "
        f"{cpu.get('other_cpu_s', '?')} CPU-s (avg {cpu.get('other_cores', '?')} cores) "
        f"over {cpu['wall_s']} s; load average now {load()}"
    )


def print_summary(summary: dict) -> None:
    """The last line of every benchmark: one JSON object."""
    sys.stdout.flush()
    print(json.dumps(summary, sort_keys=False), flush=True)


def assert_no_children(grace: float = 5.0) -> list[int]:
    """PIDs of this process's descendants still alive after ``grace`` seconds (then killed).

    Every benchmark stops its sessions; anything still here is a leak (of the
    benchmark or of nbdist) and is reported. They are processes this script
    started, so they are ended by PID.
    """
    me = psutil.Process()
    deadline = time.monotonic() + grace
    alive = me.children(recursive=True)
    while alive and time.monotonic() < deadline:
        time.sleep(0.1)
        alive = [p for p in me.children(recursive=True) if p.is_running()]
    left = []
    for proc in alive:
        try:
            if proc.status() == psutil.STATUS_ZOMBIE:
                continue
            left.append(proc.pid)
            proc.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass
    if left:
        print(f"WARNING: processes left behind (killed): {left}", file=sys.stderr, flush=True)
    return left


def _system_busy_s() -> float | None:
    """CPU-seconds all processes of the machine have used since boot (Linux /proc/stat)."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = (fields + [0] * 8)[:8]
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def _own_cpu_s() -> float:
    # This process plus every descendant it (or they) reaped: ranks, controller, torchrun.
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


class CpuMeter:
    """How much CPU this benchmark used and how much everything else on the machine did.

    Read it after every child has been reaped. ``other_cores`` is the average
    number of cores other processes kept busy during the run: the load that
    did not come from the benchmark.
    """

    def __init__(self) -> None:
        self.t0 = time.monotonic()
        self.sys0 = _system_busy_s()
        self.own0 = _own_cpu_s()

    def read(self) -> dict:
        wall = time.monotonic() - self.t0
        own = _own_cpu_s() - self.own0
        out = {"wall_s": round(wall, 1), "own_cpu_s": round(own, 1)}
        sys1 = _system_busy_s()
        if self.sys0 is not None and sys1 is not None:
            other = max(0.0, (sys1 - self.sys0) - own)
            out["other_cpu_s"] = round(other, 1)
            out["other_cores"] = round(other / wall, 2) if wall else 0.0
        return out


@contextlib.contextmanager
def private_history():
    """Point nbdist's run history at a temporary file, so benchmarks leave the user's alone.

    Sessions still write their runs to SQLite on disk, as they do by default.
    Kept as is when ``NBDIST_HISTORY`` is already set.
    """
    if os.environ.get("NBDIST_HISTORY"):
        yield os.environ["NBDIST_HISTORY"]
        return
    import tempfile

    folder = tempfile.mkdtemp(prefix="nbdist-bench-history-")
    os.environ["NBDIST_HISTORY"] = os.path.join(folder, "history.sqlite")
    try:
        yield os.environ["NBDIST_HISTORY"]
    finally:
        os.environ.pop("NBDIST_HISTORY", None)
        import shutil

        shutil.rmtree(folder, ignore_errors=True)


def run_benchmark(main_fn) -> None:
    """Run a benchmark's main with a private run history, then exit with its status."""
    with private_history():
        code = main_fn()
    sys.exit(code or 0)
