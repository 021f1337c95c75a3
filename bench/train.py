"""DDP training steps/s through nbdist against the same code under torchrun, and what logging costs.

Runs in the benchmark's own process (the place of a notebook kernel); ``TRAIN``
runs on the ranks. One MLP (3 Linear layers, 512 wide, ReLU), batch 64, SGD,
synthetic data from a fixed seed. Where:

- CPU (no CUDA, or ``--cpu``): 2 ranks, gloo;
- CUDA: NCCL, one rank per GPU, the model and data on the rank's GPU
  (``nbdist.device()`` on nbdist's ranks, ``cuda:LOCAL_RANK`` under torchrun).
  The model stays this small: on a GPU its step is launch-bound (thousands of
  steps/s, windows of 1000 steps), so every microsecond a rank's process adds
  per step shows.
  On a one-GPU machine that is world size 1: what ``%dist_start`` gives there,
  and it works with every NCCL; the figure is the cost of running the loop in an
  nbdist rank, which needs no second rank. ``--n 2`` makes 2 ranks share the GPU
  as nbdist has them share it (NCCL >= 2.30 with ``NCCL_MULTI_RANK_GPU_ENABLE=1``,
  set on both sides; else gloo with CUDA tensors), which adds the GPU's
  time-slicing between two processes to both sides alike.

The same training code runs

- nbdist:     in the ranks of a ``DistSession(n)``, each window one
              ``session.run(...)`` (the path of ``%%on_all_ranks``);
- nbdist_log: the same session, a second identical model whose loop also calls
              ``nbdist.log(step=, loss=, samples=)`` every step;
- torchrun:   a script under ``torchrun --standalone --nproc_per_node n``, with
              the threads nbdist gives a rank (``OMP_NUM_THREADS`` and
              ``torch.set_num_threads``: max(1, cores // n)), sockets on loopback.

All jobs are up at the same time and take turns, a window of ``steps`` steps
each, so a slow drift or a burst of load from elsewhere hits all alike; the order
changes every time so that each job directly follows every other equally often
(``balanced_orders``: a job's leftovers do not always land on the same other one).
The torchrun job waits for its turn in a blocking read of a FIFO per rank; the
nbdist engines wait idle as between cells. Steps/s are
measured on rank 0 inside the loop: ``dist.barrier()`` (and on GPU
``torch.cuda.synchronize()``), then ``time.perf_counter()`` around the steps (on
GPU up to a final synchronize). Figures: each job's steps/s over all its windows
(their steps over the seconds they took together), nbdist's divided by torchrun's
(goal >= 0.97 on CPU, >= 1.0 on GPU: ``_common.rate_ratio``, window ``i`` of both jobs
paired, so a slow patch that stretched both cancels), and the cost of logging,
1 - nbdist_log / nbdist (goal <= 2 %); medians of per-window ratios too. A second,
identical torchrun job ("torchrun_b", left out by ``--no-control`` and ``--quick``) is
an A/A control, the noise floor of the run. ``--no-log`` leaves the logged job out: the
ratio alone, a third more windows in the same minutes (bench/log_cost.py measures the
logging cost on its own).
All jobs start from the same seed and run the same steps, so their final losses
agree (a check that they ran the same computation).

``--slices K`` splits every window into K turns per job (``steps / K`` steps each; the
jobs take turns K times, in a changing balanced order), so the jobs a ratio compares run
within a fraction of a second of each other. On the H200 (bench/RESULTS.md "GPU,
2026-12-04, second session") a job's 1000-step window (1.6 s) varied in rate by ~11 %
(standard deviation of its log), correlated 0.12-0.34 with its window before and only
0.35-0.58 with the other jobs' windows of the same round: most of the noise lasts less
than a window, so a window's ratio carries it; finer turns cancel more of it, at a
turn's cost (a barrier and a cell, outside the timing). On the 2-core machine 10 turns a
window cut the windows a ratio within ±1 % needs from 1080 to 248-464, and
bench/step_noise.py says beforehand which turn length needs the fewest minutes
(bench/RESULTS.md, "How long the slow spells last"). The logged job flushes at every turn's
end (below), so turns much shorter than the 0.5 s between flushes overstate its cost.

Every job's turn starts alike, outside the timing: a pause (``--turn-pause``, 20 ms) and
untimed steps (``--turn-warmup``, a tenth of the turn), both 0 with whole windows. Without
them the turns did not start alike: a torchrun turn's end is the next turn's start, an
nbdist turn ends only once its cell has ended and its result was pulled, so the previous
job's tail (its OpenMP threads spin on for a while after their last parallel region)
overlapped more of an nbdist turn's first steps, which also follow the cell's own Python
in the same process. On the 2-core machine at one rank (2 threads), 50-step turns
(~80 ms) gave nbdist 0.946-0.983x torchrun in thirteen runs where whole windows gave
0.996 and 1.000, and so did ``OMP_WAIT_POLICY=PASSIVE`` (no spinning; 0.994 twice): a
bias of the turns, not of nbdist's steps. Starting them alike removed about half of it
(0.979-0.995 in six runs); about 1 % (~1 ms a turn) stays, so a ratio from turns much
shorter than ~200 steps is read beside whole windows (bench/RESULTS.md, "Turns that
start alike").

The logged job's turn ends with ``nbdist.metrics.log.flush()`` on the clock: the flush
thread sends every 0.5 s, and the rest a turn logged would otherwise go at the cell's
end, off the clock (in bench/log_cost.py's first GPU run 6-28 % of a ``log`` window's points
did). A flush made so waits for nothing the final synchronize would not, and its work
counts whole, not only where it held up the training thread: at most an overestimate.
Those flushes' time is printed beside the cost (``log_flush_ms`` a window and
``log_flush_share`` of the logged job's time in the JSON): a flush a turn where logging
alone flushes every 0.5 s, so at most that share of the cost is the turns'.

Whether a run has enough windows: a bootstrap 95 % interval of the nbdist / torchrun
ratio (the windows resampled as pairs) is printed with it, and how many windows this
run's spread would need for a 99 % one within ±PCT % (``_common.windows_needed``). On a
noisy machine (an H200 whose windows varied 0.72-1.28x, bench/RESULTS.md) a dozen windows
cannot tell 1.0x from 0.97x; ``--settle PCT`` keeps adding windows after ``--windows``
until the interval lies on one side of the goal or is at most ±PCT % wide, or ``--max-minutes``
have passed (a window that would end past them is not started); fewer than 10 windows
never count as settled (a bootstrap of 3 sees 10 distinct resamples). The stop looks at a
99 % interval, printed after every window: checked that often, a 95 % one would stop on
the wrong side of the goal more often than once in twenty.

Usage: python bench/train.py [--cpu] [--n N] [--windows 12] [--steps S] [--warmup W]
                             [--no-control] [--no-log] [--quick] [--slices K]
                             [--turn-warmup W] [--turn-pause MS]
                             [--settle PCT [--max-minutes M]]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import (  # noqa: E402
    SERVE,
    CpuMeter,
    TorchrunJob,
    add_settle_arguments,
    add_slices_argument,
    assert_no_children,
    balanced_orders,
    check_settle_arguments,
    check_slices,
    interval_verdict,
    load,
    machine,
    median,
    overall_rate,
    plan_ranks,
    print_goal_and_cpu,
    print_summary,
    rate_ratio,
    ratio,
    ratio_interval,
    run_benchmark,
    settled,
    threads_per_rank,
    turn_orders,
    windows_needed,
)

GOAL_CPU, GOAL_GPU = 0.97, 1.0
# BenchTrainer's arguments, and the model in words (bench/log_cost.py times the same one).
MODEL = dict(width=512, batch=64, seed=0)
MODEL_TEXT = "MLP 512-512-512-10, batch 64, SGD lr 0.01, DDP"
GOAL_LOG_COST = 0.02
# How every job's turn starts when windows are cut into turns (module docstring): a pause,
# then a tenth of the turn in untimed steps.
TURN_PAUSE_MS = 20
TURN_WARMUP_DIVISOR = 10

# The training code, identical for all jobs; run on every rank with torch.distributed ready.
TRAIN = """
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


class BenchTrainer:
    def __init__(self, device, width=512, batch=64, seed=0):
        self.device = torch.device(device)
        self.batch = batch
        torch.manual_seed(seed)
        model = torch.nn.Sequential(
            torch.nn.Linear(width, width),
            torch.nn.ReLU(),
            torch.nn.Linear(width, width),
            torch.nn.ReLU(),
            torch.nn.Linear(width, 10),
        ).to(self.device)
        cuda = self.device.type == "cuda"
        self.ddp = DDP(model, device_ids=[self.device] if cuda else None)
        self.opt = torch.optim.SGD(self.ddp.parameters(), lr=0.01)
        self.loss_fn = torch.nn.CrossEntropyLoss()
        # Generated on CPU, then moved: the same numbers on every device.
        gen = torch.Generator().manual_seed(seed + 1 + dist.get_rank())
        self.xs = torch.randn(8, batch, width, generator=gen).to(self.device)
        self.ys = torch.randint(0, 10, (8, batch), generator=gen).to(self.device)
        self.i = 0
        self.loss = float("nan")

    def _sync(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # kernels are queued: wait until they ran

    def step(self):
        k = self.i % 8
        self.opt.zero_grad(set_to_none=True)
        loss = self.loss_fn(self.ddp(self.xs[k]), self.ys[k])
        loss.backward()
        self.opt.step()
        self.i += 1
        return loss

    def window(self, steps, warm=0, pause_ms=0, log=None, flush=None):
        # Steps/s of ``steps`` steps, timed on this rank after a pause, ``warm`` untimed
        # steps and a barrier; ``log``: called every step as a training loop calls
        # nbdist.log; ``flush``: sends what is left, on the clock (else the cell's end
        # would, off it).
        time.sleep(pause_ms / 1000)
        for _ in range(warm):
            self.step()
        dist.barrier()
        self._sync()
        t0 = time.perf_counter()
        for _ in range(steps):
            loss = self.step()
            if log is not None:
                log(step=self.i, loss=loss.detach(), samples=self.batch)
        if flush is not None:
            flush()
        self._sync()
        rate = steps / (time.perf_counter() - t0)
        self.loss = float(loss.detach())
        return rate

    def stamped(self, steps, after=None):
        # The clock after every step (stamps[0]: before the first), after a barrier;
        # ``after(step, loss, batch)`` after each step. The caller synchronises at the end.
        dist.barrier()
        self._sync()
        clock = time.perf_counter
        stamps = [0.0] * (steps + 1)
        stamps[0] = clock()
        for k in range(steps):
            loss = self.step()
            if after is not None:
                after(self.i, loss, self.batch)
            stamps[k + 1] = clock()
        return stamps

    def info(self):
        return {
            "threads": torch.get_num_threads(),
            "device": str(self.device),
            "backend": dist.get_backend(),
            "loss": self.loss,
            "steps": self.i,
        }
"""

# The logged job's flush at each turn's end, timed on the rank (the seconds, summed).
TIMED_FLUSH = """
_flush_s = 0.0


def _timed_flush():
    global _flush_s
    began = time.perf_counter()
    nbdist.metrics.log.flush()
    _flush_s += time.perf_counter() - began
"""

TORCHRUN_MAIN = """
cfg, device = bench_init()
try:
    trainer = BenchTrainer(device, **cfg["model"])
    bench_serve(trainer.window, trainer.info)
finally:
    dist.destroy_process_group()
"""


def _main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu", action="store_true", help="gloo on CPU even if CUDA is there")
    parser.add_argument("--n", type=int, default=None, help="ranks (2 on CPU, one per GPU)")
    parser.add_argument("--windows", type=int, default=None, help="timed windows per job (12)")
    parser.add_argument("--steps", type=int, default=None, help="steps per window (100; GPU 1000)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed steps (20; GPU 200)")
    parser.add_argument(
        "--turn-warmup",
        type=int,
        default=None,
        metavar="W",
        help="untimed steps at the start of every turn, on every job "
        "(a tenth of a turn with --slices > 1, else 0)",
    )
    parser.add_argument(
        "--turn-pause",
        type=int,
        default=None,
        metavar="MS",
        help="milliseconds every job waits before its turn's untimed steps "
        "(20 with --slices > 1, else 0)",
    )
    parser.add_argument("--no-control", action="store_true", help="no second torchrun job (A/A)")
    parser.add_argument(
        "--no-log", action="store_true", help="no logged job (the ratio alone: more windows)"
    )
    parser.add_argument("--quick", action="store_true", help="smoke run: 3 short windows")
    add_slices_argument(parser, "job", "1")
    add_settle_arguments(parser, "windows")
    args = parser.parse_args(argv)
    check_settle_arguments(parser, args)
    began = time.monotonic()
    plan = plan_ranks(args.n, cpu=args.cpu, one_gpu_ranks=1)
    n, cuda = plan["n"], plan["cuda"]
    os.environ.update(plan["env"])  # every job inherits it
    # On a GPU this small model is launch-bound (thousands of steps/s): longer windows.
    scale = 10 if cuda else 1
    windows = args.windows or (3 if args.quick else 12)
    steps = args.steps or scale * (30 if args.quick else 100)
    warmup = args.warmup if args.warmup is not None else scale * (5 if args.quick else 20)
    control = not (args.no_control or args.quick)
    logged = not args.no_log
    slices = 1 if args.slices is None else args.slices
    check_slices(parser, slices, steps)
    turn_warmup = args.turn_warmup
    if turn_warmup is None:
        turn_warmup = steps // slices // TURN_WARMUP_DIVISOR if slices > 1 else 0
    if turn_warmup < 0:
        parser.error(f"--turn-warmup {turn_warmup}: give 0 or more untimed steps a turn")
    pause = args.turn_pause
    if pause is None:
        pause = TURN_PAUSE_MS if slices > 1 else 0
    if pause < 0:
        parser.error(f"--turn-pause {pause}: give 0 or more milliseconds")
    goal = GOAL_GPU if cuda else GOAL_CPU
    threads = threads_per_rank(n)

    info = machine()
    meter = CpuMeter()
    print(
        f"train: {plan['note']}; n={n}, {windows} windows of {steps} steps per job in "
        f"{slices} turn(s) each (a turn starts with a {pause} ms pause and {turn_warmup} "
        "untimed step(s)), after "
        f"{warmup} warm-up steps, {threads} thread(s)/rank, "
        f"control job: {control}, logged job: {logged}, {info}",
        flush=True,
    )
    from nbdist import DistSession

    variants = ["nbdist"] + (["nbdist_log"] if logged else []) + ["torchrun"]
    variants += ["torchrun_b"] if control else []
    rates: dict[str, list[float]] = {v: [] for v in variants}
    final: dict[str, dict] = {}
    session = DistSession(n, cpu=not cuda, backend=plan["backend"])
    workdir = tempfile.mkdtemp(prefix="nbdist-bench-")
    jobs: dict[str, TorchrunJob] = {}
    config = dict(cuda=cuda, backend=plan["backend"], model=MODEL)
    env = dict(OMP_NUM_THREADS=str(threads), BENCH_THREADS=str(threads))
    try:
        for name in [v for v in variants if v.startswith("torchrun")]:
            os.mkdir(os.path.join(workdir, name))
            code = TRAIN + SERVE + TORCHRUN_MAIN
            jobs[name] = TorchrunJob(n, code, os.path.join(workdir, name), config=config, env=env)
        session.start()
        make = f"BenchTrainer(nbdist.device(), **{MODEL!r})"
        setup = TRAIN + f"\n_trainer = {make}"
        if logged:
            setup += f"\n_trainer_log = {make}\n" + TIMED_FLUSH
        session.run(setup)
        for job in jobs.values():
            job.wait_ready()

        def nbdist_window(
            steps: int, warm: int, pause: int, trainer: str = "_trainer", log: str = ""
        ) -> float:
            session.run(f"_rate = {trainer}.window({steps}, {warm}, {pause}{log})")
            return session.pull("_rate", rank=0)

        run = {"nbdist": nbdist_window}
        if logged:
            log = ", log=nbdist.log, flush=_timed_flush"
            run["nbdist_log"] = lambda k, warm, pause: nbdist_window(
                k, warm, pause, "_trainer_log", log
            )
        run.update({name: job.call for name, job in jobs.items()})
        if warmup:  # the same untimed steps on every job
            for variant in variants:
                run[variant](warmup, 0, 0)
        if logged:
            session.run("_flush_s = 0.0")  # the timed windows' flushes only
        orders = balanced_orders(variants)  # each job follows every other equally often
        deadline = began + 60 * args.max_minutes
        w, took = 0, 0.0
        so_far = (0.0, float("inf"))  # the ratio's interval after the latest window

        def unsettled() -> bool:
            # With --settle, past --windows: another window while time is left for it.
            if args.settle is None or time.monotonic() + took > deadline:
                return False
            return not settled(so_far, goal, args.settle / 100, w)

        def one_window(w: int) -> dict[str, float]:
            # Each job's steps/s over its turns: its steps over the seconds its turns took.
            turn = steps // slices
            seconds = dict.fromkeys(variants, 0.0)
            for order in turn_orders(orders, w, slices):
                for variant in order:
                    seconds[variant] += turn / run[variant](turn, turn_warmup, pause)
            return {v: steps / seconds[v] for v in variants}

        while w < windows or unsettled():
            started = time.monotonic()
            got = one_window(w)
            for variant in variants:
                rates[variant].append(got[variant])
            took = time.monotonic() - started
            w += 1
            line = ", ".join(f"{v} {got[v]:.1f}" for v in variants)
            # With --settle the interval the stop looks at, printed and read by unsettled():
            # 99 %, since looked at after every window a 95 % one would stop on the wrong side
            # of the goal more often than one time in twenty. Without, a quick 95 % one.
            shown = ""
            if w >= 3:
                level, rounds = (0.99, 2000) if args.settle is not None else (0.95, 500)
                so_far = ratio_interval(
                    rates["nbdist"], rates["torchrun"], rounds=rounds, level=level
                )
                shown = (
                    f", nbdist / torchrun so far {100 * level:g} % "
                    f"[{so_far[0]:.3f}, {so_far[1]:.3f}]"
                )
            label = f"{w}/{windows}" if args.settle is None else f"{w} (at least {windows})"
            print(f"  window {label}: {line} steps/s, load {load()}{shown}", flush=True)
        windows = w
        session.run("_info = [_trainer.info()]" + (" + [_trainer_log.info()]" if logged else ""))
        final.update(zip(["nbdist", "nbdist_log"], session.pull("_info", rank=0)))
        flush_s = session.pull("_flush_s", rank=0) if logged else 0.0
        for name, job in jobs.items():
            final[name] = job.finish()
    finally:
        try:
            session.stop()
        finally:
            for job in jobs.values():
                job.close()
            for path in [os.path.join(workdir, name) for name in jobs] + [workdir]:
                try:
                    os.rmdir(path)
                except OSError:
                    pass
            leftovers = assert_no_children()
            cpu = meter.read()

    overall = {v: overall_rate(rates[v]) for v in variants}

    def pairs(a: str, b: str) -> float:
        return median([ratio(x, y) for x, y in zip(rates[a], rates[b])])

    r = rate_ratio(rates["nbdist"], rates["torchrun"])
    interval = ratio_interval(rates["nbdist"], rates["torchrun"])
    is_settled = settled(interval, goal, (args.settle or 1.0) / 100, windows)
    losses = {v: (final[v]["loss"], final[v]["steps"]) for v in final}
    same_loss = len(set(losses.values())) == 1
    setup = {v: (final[v]["threads"], final[v]["device"], final[v]["backend"]) for v in final}
    rows = [("nbdist", "torchrun", "nbdist / torchrun")]
    if logged:
        rows.append(("nbdist_log", "nbdist", "logging every step / not logging"))
        rows.append(("nbdist_log", "torchrun", "nbdist logging / torchrun"))
    if control:
        rows.append(("torchrun_b", "torchrun", "A/A control: the noise floor of this run"))
    print()
    for v in variants:
        print(f"{v:>12} {overall[v]:>9.1f} steps/s (over its {windows} windows)")
    for a, b, what in rows:
        print(f"{rate_ratio(rates[a], rates[b]):>10.3f}x  pairs {pairs(a, b):.3f}x  {what}")
    print(
        f"nbdist / torchrun {r:.3f}x, "
        + interval_verdict(interval, goal, is_settled, windows, "windows")
    )
    # How many windows this machine's spread asks for: what a GPU run has to plan for.
    within = (args.settle or 1.0) / 100
    needed = windows_needed(rates["nbdist"], rates["torchrun"], within) if windows > 1 else None
    if needed is not None:
        print(
            f"at this run's spread a 99 % interval of nbdist / torchrun within ±{100 * within:g} % "
            f"needs about {needed} windows"
        )
    logging = {}
    if logged:
        logging = _logging_cost(rates, pairs("nbdist_log", "nbdist"), steps, flush_s)
    print(
        f"final losses {{job: (loss, steps)}} {losses} (all equal: {same_loss}); "
        f"(threads, device, backend): {setup}"
    )
    ok = ratio_ok = r >= goal
    goal_text = f"nbdist {r:.3f}x >= {goal}x torchrun steps/s"
    if logged:
        log_ok = logging["log_cost"] <= GOAL_LOG_COST
        ok = ratio_ok and log_ok
        goal_text += (
            f" ({'met' if ratio_ok else 'MISSED'}), logging every step costs "
            f"{100 * logging['log_cost']:.1f} % <= {100 * GOAL_LOG_COST:g} % "
            f"({'met' if log_ok else 'MISSED'}); both"
        )
    print_goal_and_cpu(goal_text, ok, leftovers, cpu)
    print_summary(
        dict(
            bench="train",
            quick=args.quick,
            n=n,
            plan=plan,
            windows=windows,
            steps=steps,
            slices=slices,
            turn_warmup=turn_warmup,
            turn_pause_ms=pause,
            warmup=warmup,
            model=f"{MODEL_TEXT}, {plan['backend']}",
            machine=info,
            load_end=load(),
            cpu=cpu,
            setup=setup,
            steps_s={v: round(x, 2) for v, x in overall.items()},
            ratio=round(r, 3),
            ratio_interval=[round(x, 3) for x in interval],
            settled=is_settled,
            settle_pct=args.settle,
            windows_needed=needed,
            pair_ratio_median=round(pairs("nbdist", "torchrun"), 3),
            goal_ratio=goal,
            logged=logged,
            **logging,
            **(
                dict(control_ratio=round(rate_ratio(rates["torchrun_b"], rates["torchrun"]), 3))
                if control
                else {}
            ),
            goal_met=ok,
            same_final_loss=same_loss,
            final=final,
            samples={k: [round(x, 2) for x in v] for k, v in rates.items()},
            leftover_pids=leftovers,
        )
    )
    return 0


def _logging_cost(
    rates: dict[str, list[float]], pair_median: float, steps: int, flush_s: float
) -> dict:
    """The logged job against nbdist's: its cost, printed, and the summary's fields.

    ``flush_s``: the seconds its turn-end flushes took on rank 0 over the timed windows.
    """
    log_ratio = rate_ratio(rates["nbdist_log"], rates["nbdist"])
    log_cost = 1 - log_ratio
    # The cost's interval, as the ratio's: its windows resampled as pairs.
    low, high = ratio_interval(rates["nbdist_log"], rates["nbdist"])
    print(
        f"cost of nbdist.log every step: {100 * log_cost:.1f} % (pairs "
        f"{100 * (1 - pair_median):.1f} %), 95 % interval {100 * (1 - high):.1f} to "
        f"{100 * (1 - low):.1f} %"
    )
    # A flush a turn, where logging alone flushes every 0.5 s (on its own thread): with
    # turns much shorter than that, this share of the cost is the turns'.
    windows = len(rates["nbdist_log"])
    flush_share = flush_s / sum(steps / rate for rate in rates["nbdist_log"])
    print(
        f"its turn-end flushes on the clock: {1e3 * flush_s / windows:.2f} ms a window, "
        f"{100 * flush_share:.2f} % of its time (at most that much of the cost is the turns')"
    )
    return dict(
        log_ratio=round(log_ratio, 4),
        log_pair_ratio_median=round(pair_median, 4),
        log_cost=round(log_cost, 4),
        log_cost_interval=[round(1 - high, 4), round(1 - low, 4)],
        log_flush_ms=round(1e3 * flush_s / windows, 3),
        log_flush_share=round(flush_share, 5),
        goal_log_cost=GOAL_LOG_COST,
    )


if __name__ == "__main__":
    run_benchmark(_main)
