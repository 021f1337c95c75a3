"""Helpers shared by the benchmark scripts (statistics, machine facts, process hygiene).

Not a benchmark itself; each ``bench/NAME.py`` imports it from its own directory.
Runs in the benchmark's own process (the notebook kernel's place); the ``SERVE``
text runs on the ranks of a torchrun job that a :class:`TorchrunJob` starts.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import queue
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time

import psutil

__all__ = [
    "SERVE",
    "CpuMeter",
    "TorchrunJob",
    "add_settle_arguments",
    "assert_no_children",
    "balanced_orders",
    "bootstrap_interval",
    "check_settle_arguments",
    "private_history",
    "conclude",
    "cores",
    "interval_verdict",
    "load",
    "machine",
    "median",
    "overall_rate",
    "p90",
    "plan_ranks",
    "print_goal_and_cpu",
    "print_summary",
    "ratio",
    "ratio_interval",
    "rate_ratio",
    "run_benchmark",
    "settled",
    "threads_per_rank",
]


def median(values) -> float:
    return statistics.median(values)


def p90(values) -> float:
    """90th percentile, nearest-rank (no interpolation: a sample that was really measured)."""
    ordered = sorted(values)
    index = max(0, -(-len(ordered) * 9 // 10) - 1)  # ceil(0.9 n) - 1
    return ordered[index]


def balanced_orders(items: list) -> list[list]:
    """Orders in which to run ``items`` so that each directly follows every other equally often.

    A Williams design (n orders for an even count, 2n for an odd one). A plain rotation
    keeps the cyclic order: a job would always run right after the same other one and
    pay what that one leaves behind (work it finishes after returning, caches it filled).

    >>> balanced_orders(["a", "b", "c", "d"])[:2]
    [['a', 'b', 'd', 'c'], ['b', 'c', 'a', 'd']]
    """
    n = len(items)
    first = [0] + [(k + 1) // 2 if k % 2 else n - k // 2 for k in range(1, n)]
    rows = [[(f + i) % n for f in first] for i in range(n)]
    if n % 2:
        rows += [row[::-1] for row in rows]
    return [[items[j] for j in row] for row in rows]


def ratio(value: float, baseline: float) -> float:
    return value / baseline if baseline else float("nan")


def overall_rate(rates: list[float]) -> float:
    """A job's steps/s over all its windows, every window the same steps: their steps over
    the seconds they took together (the harmonic mean of the rates).

    >>> overall_rate([10.0, 30.0])
    15.0
    """
    return len(rates) / sum(1 / r for r in rates)


def rate_ratio(values: list[float], baselines: list[float], idx=None) -> float:
    """``values``' steps/s over the windows ``idx`` (all when None) against ``baselines``'.

    Every window runs the same steps, so it is the baseline's seconds over the values'
    seconds, summed over the same windows: window ``i`` of both jobs ran side by side,
    and a slow patch of the machine that stretched both cancels out. A ratio of the two
    jobs' medians keeps less of that pairing (each median may come from a different
    window): over the 21 pairs of jobs in the H200's runs of train.py and log_cost.py its
    95 % intervals were on average 1.3-1.5x as wide as this one's (bench/RESULTS.md, "The
    ratio's statistic").

    >>> round(rate_ratio([10.0, 20.0], [10.0, 10.0]), 4)
    1.3333
    """
    if idx is not None:
        values, baselines = [values[i] for i in idx], [baselines[i] for i in idx]
    return overall_rate(values) / overall_rate(baselines)


def ratio_interval(
    values: list[float], baselines: list[float], *, rounds: int = 2000, level: float = 0.95
) -> tuple[float, float]:
    """A bootstrap confidence interval of :func:`rate_ratio`.

    The windows are resampled as pairs (window ``i`` of both jobs ran side by side,
    under the same load), ``rounds`` times with a fixed seed, and the ratio taken each
    time; the interval holds the middle ``level`` of those ratios. Its width says how
    many windows a run needs: a ratio whose interval lies on one side of the goal is
    settled, one whose interval straddles it is not.

    >>> ratio_interval([10, 10, 10], [5, 5, 5])
    (2.0, 2.0)
    """
    if len(values) != len(baselines) or not values:
        raise ValueError(
            f"need as many windows of each job, got {len(values)} and {len(baselines)}"
        )
    # rate_ratio over the resampled windows, each window's seconds a step taken once here
    # rather than in every resample (train.py's --settle bootstraps after every window).
    seconds, base_seconds = [1 / v for v in values], [1 / b for b in baselines]

    def of(idx: list[int]) -> float:
        return sum(base_seconds[i] for i in idx) / sum(seconds[i] for i in idx)

    return bootstrap_interval(len(values), of, rounds=rounds, level=level)


def bootstrap_interval(
    n: int, statistic, *, rounds: int = 2000, level: float = 0.95
) -> tuple[float, float]:
    """The middle ``level`` of ``statistic(idx)`` over ``rounds`` resamples of ``range(n)``.

    ``idx`` lists ``n`` indices drawn with replacement (a fixed seed: the same samples
    give the same interval); the statistic reads whatever it measured at those indices,
    every job's sample ``i`` together, since they ran side by side.

    >>> bootstrap_interval(4, lambda idx: sum(idx) / len(idx), rounds=200, level=1.0)
    (0.25, 2.75)
    """
    import random

    if n < 1:
        raise ValueError(f"need at least one sample to resample, got {n}")
    pick = random.Random(0)
    got = sorted(statistic([pick.randrange(n) for _ in range(n)]) for _ in range(rounds))
    tail = (1 - level) / 2
    return got[int(tail * (rounds - 1))], got[int((1 - tail) * (rounds - 1))]


def windows_needed(
    values: list[float], baselines: list[float], within: float, *, level: float = 0.99
) -> int:
    """About how many windows make :func:`rate_ratio`'s ``level`` interval at most ``±within``
    wide.

    At the spread these windows show: ``(z * sd / within) ** 2``, ``z`` the normal quantile
    of ``level`` (99 %: what ``--settle`` looks at) and ``sd`` the standard deviation of a
    window's part in the ratio's relative error (``u_i / mean(u) - t_i / mean(t)``, ``t``
    and ``u`` the two jobs' seconds a step: the delta method for a ratio of sums). An
    estimate from the normal approximation, for planning a run (a GPU's minutes are few),
    not a stopping rule.

    >>> windows_needed([1.1, 0.9, 1.0, 1.0], [1.0, 1.0, 1.0, 1.0], 0.01)
    450
    """
    import math

    if len(values) != len(baselines) or len(values) < 2:
        raise ValueError(
            f"need at least two windows of each job, got {len(values)} and {len(baselines)}"
        )
    t = [1 / v for v in values]
    u = [1 / b for b in baselines]
    mean_t, mean_u = statistics.fmean(t), statistics.fmean(u)
    sd = statistics.stdev(ui / mean_u - ti / mean_t for ti, ui in zip(t, u))
    z = statistics.NormalDist().inv_cdf(0.5 + level / 2)
    return math.ceil((z * sd / within) ** 2)


# Fewer windows than this never settle a ratio: their bootstrap cannot see a spread it has not
# sampled (3 windows resample to 10 distinct sets, and an interval of them looks tight).
SETTLE_MIN_WINDOWS = 10


def settled(
    interval: tuple[float, float],
    goal: float,
    within: float,
    windows: int,
    *,
    at_least: int = SETTLE_MIN_WINDOWS,
) -> bool:
    """True when ``interval``, from ``windows`` windows (``at_least`` of them, default
    :data:`SETTLE_MIN_WINDOWS`), lies wholly on one side of ``goal`` or is at most ``±within`` wide."""
    low, high = interval
    if windows < at_least:
        return False
    return low >= goal or high < goal or (high - low) / 2 <= within


def add_settle_arguments(parser, unit: str) -> None:
    """``--settle PCT`` and ``--max-minutes M``, as train.py and nccl.py take them (``unit``: what
    they add, "windows" or "rounds")."""
    parser.add_argument(
        "--settle",
        type=float,
        default=None,
        metavar="PCT",
        help=f"after --{unit}, add {unit} until the ratio's 99 %% interval is on one side of "
        "the goal or at most ±PCT %% wide",
    )
    parser.add_argument(
        "--max-minutes",
        type=float,
        default=10.0,
        help=f"with --settle: start none of the {unit} that would end later than this (10)",
    )


def check_settle_arguments(parser, args) -> None:
    """Refuse a ``--settle`` or ``--max-minutes`` that cannot be met, naming the value."""
    if args.settle is not None and not args.settle > 0:
        parser.error(f"--settle {args.settle}: give a half-width in percent > 0, e.g. --settle 1")
    if not args.max_minutes > 0:
        parser.error(f"--max-minutes {args.max_minutes}: give minutes > 0, e.g. --max-minutes 8")


def add_slices_argument(parser, unit: str, default: str) -> None:
    """``--slices K``, as train.py and log_cost.py take it (``unit``: "job" or "variant";
    ``default``: the default in words). Unset: None, for the script to choose."""
    parser.add_argument(
        "--slices",
        type=int,
        default=None,
        metavar="K",
        help=f"turns each {unit} takes a window, steps/K steps each ({default})",
    )


def check_slices(parser, slices: int, steps: int) -> None:
    """Refuse a turn count a window of ``steps`` steps cannot take, naming the value."""
    if slices < 1:
        parser.error(f"--slices {slices}: a window has at least one turn; give 1 or more")
    if steps % slices:
        parser.error(
            f"--slices {slices} does not divide a window's {steps} steps: "
            f"give --steps as a multiple of {slices}, or another --slices"
        )


def turn_orders(orders: list[list], window: int, slices: int) -> list[list]:
    """The order of each of window ``window``'s ``slices`` turns: ``orders`` (from
    :func:`balanced_orders`) taken on one per turn, so each job still follows every other
    equally often over the run.

    >>> turn_orders([["a", "b"], ["b", "a"]], 1, 3)
    [['b', 'a'], ['a', 'b'], ['b', 'a']]
    """
    return [orders[(window * slices + t) % len(orders)] for t in range(slices)]


def interval_verdict(
    interval: tuple[float, float],
    goal: float,
    is_settled: bool,
    count: int,
    unit: str,
    *,
    more: str = "--settle",
) -> str:
    """Where a ratio's 95 % ``interval`` from ``count`` ``unit`` lies against ``goal``, in words;
    ``more``: the option that adds ``unit``, named when the ratio is not settled.

    >>> interval_verdict((0.9, 0.93), 0.95, True, 12, "rounds")
    '95 % interval [0.900, 0.930] over 12 rounds: below the goal 0.95x (settled)'
    """
    low, high = interval
    where = (
        f"{'above' if low >= goal else 'below'} the goal {goal}x"
        if low >= goal or high < goal
        else f"straddles the goal {goal}x"
    )
    state = "settled" if is_settled else f"not settled: more {unit}, or {more}"
    return f"95 % interval [{low:.3f}, {high:.3f}] over {count} {unit}: {where} ({state})"


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


def _gpu_names() -> list[str]:
    # nvidia-smi, not torch: asking torch for a name would start CUDA in this process.
    query = ["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"]
    try:
        out = subprocess.run(query, capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [line.strip() for line in out.splitlines() if line.strip()]


def machine() -> dict:
    import torch

    cuda = torch.cuda.is_available()  # does not create a CUDA context
    info = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %z"),
        "cores": cores(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": cuda,
        "load": load(),
    }
    if cuda:
        info["gpus"] = _gpu_names()
        from nbdist.engine.devices import nccl_version

        info["nccl"] = ".".join(map(str, nccl_version() or ())) or None
    return info


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


def conclude(bench, goal, goal_ratio, ok, leftovers, cpu, info, quick, **fields) -> None:
    """The goal and CPU lines, then the JSON summary with the fields every ratio benchmark has.

    ``fields`` (rows, extra goals) follow the common ones in the summary.
    """
    print_goal_and_cpu(goal, ok, leftovers, cpu)
    summary = dict(bench=bench, quick=quick, machine=info, load_end=load(), cpu=cpu)
    summary |= dict(goal_ratio=goal_ratio, goal_met=ok, leftover_pids=leftovers)
    print_summary(summary | fields)


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
        shutil.rmtree(folder, ignore_errors=True)


def run_benchmark(main_fn) -> None:
    """Run a benchmark's main with a private run history, then exit with its status."""
    with private_history():
        code = main_fn()
    sys.exit(code or 0)


def plan_ranks(n: int | None, *, cpu: bool, one_gpu_ranks: int) -> dict:
    """Where a benchmark's ranks run: ``n`` (None: 2) CPU ranks on gloo, or GPU ranks.

    On GPUs ``n`` None is one rank per GPU, or ``one_gpu_ranks`` on a one-GPU machine.
    More ranks than GPUs share them as nbdist's placement has them: NCCL >= 2.30 with
    ``NCCL_MULTI_RANK_GPU_ENABLE=1`` and ``NCCL_NVLS_ENABLE=0`` (what nbdist sets on
    such ranks), else gloo with CUDA tensors. The returned ``env`` must reach both
    sides alike (put it in ``os.environ`` before either starts).
    """
    import torch

    if cpu or not torch.cuda.is_available():
        why = "--cpu" if cpu else "no CUDA device"
        return dict(cuda=False, n=n or 2, backend="gloo", env={}, note=f"CPU, gloo ({why})")
    from nbdist.engine.devices import SHARED_GPU_ENV, nccl_can_share, nccl_version

    gpus = torch.cuda.device_count()
    version = nccl_version()
    nccl = ".".join(map(str, version or ())) or "none"
    n = n or (gpus if gpus > 1 else one_gpu_ranks)
    plan = dict(cuda=True, n=n, gpus=gpus, backend="nccl", env={}, nccl=nccl)
    if n <= gpus:
        return plan | dict(note=f"{n} rank(s), one per GPU, NCCL {nccl}")
    share = f"{n} ranks share {gpus} GPU(s)"
    if nccl_can_share(version):
        env = {SHARED_GPU_ENV: "1", "NCCL_NVLS_ENABLE": "0"}
        return plan | dict(env=env, note=f"{share}: NCCL {nccl}, {SHARED_GPU_ENV}=1")
    why = f"NCCL {nccl} < 2.30 refuses two ranks on one GPU"
    return plan | dict(backend="gloo", note=f"{share}: {why}, so gloo with CUDA tensors")


# The torchrun side, appended to a benchmark's code in the script torchrun runs. Each
# rank waits for a command in a blocking read of its own FIFO: no CPU, no GPU, and no
# collective (an NCCL one would keep a kernel spinning on the GPU the others measure on).
SERVE = """
import json, os, sys


def bench_init():
    # Threads, device (cuda:LOCAL_RANK, round robin) and process group.
    cfg = json.loads(sys.argv[2])
    torch.set_num_threads(int(os.environ["BENCH_THREADS"]))
    device = torch.device("cpu")
    if cfg["cuda"]:
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]) % torch.cuda.device_count())
        torch.cuda.set_device(device)
    kwargs = {"device_id": device} if cfg["backend"] == "nccl" else {}
    dist.init_process_group(cfg["backend"], **kwargs)
    return cfg, device


def bench_serve(handle, info):
    # handle(*ints) for each line of ints on this rank's FIFO until 0; rank 0 prints results.
    rank = int(os.environ["RANK"])
    if rank == 0:
        print("BENCH_READY", flush=True)
    with open(sys.argv[1] + "." + str(rank), "rb") as fifo:
        for line in fifo:
            args = [int(x) for x in line.split()]
            if not args or args[0] <= 0:
                break
            result = handle(*args)
            if rank == 0:
                print("BENCH_RESULT " + json.dumps(result), flush=True)
    result = info()  # on every rank: it may be a collective
    if rank == 0:
        print("BENCH_INFO " + json.dumps(result), flush=True)
"""


class TorchrunJob:
    """A ``torchrun --standalone`` job that runs one command each time it is told to.

    ``code``: the whole script (the benchmark's code, :data:`SERVE`, a main calling
    ``bench_init`` and ``bench_serve``); ``config`` reaches it as JSON; ``env`` is added
    to this process's; sockets default to ``lo``, as on nbdist's ranks on one machine.
    """

    def __init__(self, n: int, code: str, workdir: str, *, config: dict, env: dict):
        self.script = os.path.join(workdir, "bench_job.py")
        self.stderr_path = os.path.join(workdir, "stderr.log")
        self.fifo_paths = [os.path.join(workdir, f"commands.fifo.{r}") for r in range(n)]
        with open(self.script, "w") as f:
            f.write(code)
        for path in self.fifo_paths:
            os.mkfifo(path)
        # Read-write (Linux): no open waits for the other end, lines wait in the pipe until
        # read, and the ranks read EOF (and end) when this process does.
        self.fifos = [os.open(path, os.O_RDWR) for path in self.fifo_paths]
        sockets = {"GLOO_SOCKET_IFNAME": "lo", "NCCL_SOCKET_IFNAME": "lo"}
        torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
        cmd = [torchrun, "--standalone", f"--nproc_per_node={n}", self.script]
        cmd += [os.path.join(workdir, "commands.fifo"), json.dumps(config)]
        with open(self.stderr_path, "w") as err:  # own session, as nbdist's engines: see README
            self.proc = subprocess.Popen(
                cmd,
                env=sockets | dict(os.environ, **env),
                stdout=subprocess.PIPE,
                stderr=err,
                text=True,
                start_new_session=True,
            )
        self.lines: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.put(line.rstrip("\n"))
        self.lines.put(None)

    def _expect(self, prefix: str, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self.lines.get(timeout=max(0.01, deadline - time.monotonic()))
            except queue.Empty:
                raise TimeoutError(self._failure(f"no {prefix} within {timeout:g} s")) from None
            if line is None:
                raise RuntimeError(self._failure(f"torchrun ended before {prefix}"))
            if line.startswith(prefix + " ") or line == prefix:
                return line[len(prefix) :].strip()

    def _failure(self, what: str) -> str:
        time.sleep(0.2)
        with open(self.stderr_path) as f:
            tail = "".join(f.readlines()[-40:])
        return f"torchrun job: {what} (exit code {self.proc.poll()}):\n{tail}"

    def wait_ready(self, timeout: float = 300.0) -> None:
        """Until the job is set up (rank 0 says so; the others may read their FIFO later)."""
        self._expect("BENCH_READY", timeout)

    def call(self, *args: int, timeout: float = 600.0, prefix: str = "BENCH_RESULT"):
        """Run one command on every rank; rank 0's result."""
        for fd in self.fifos:  # a short line: one atomic write (< PIPE_BUF)
            os.write(fd, (" ".join(map(str, args)) + "\n").encode())
        return json.loads(self._expect(prefix, timeout))

    def finish(self, timeout: float = 120.0) -> dict:
        """End the job; rank 0's ``info()``."""
        info = self.call(0, timeout=timeout, prefix="BENCH_INFO")
        self.proc.wait(timeout=timeout)
        return info

    def close(self) -> None:
        """Stop the job if still running (SIGTERM, which torchrun passes on); remove its files."""
        for fd in self.fifos:
            os.close(fd)
        self.fifos = []
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        for path in [self.script, self.stderr_path, *self.fifo_paths]:
            with contextlib.suppress(OSError):
                os.remove(path)
