"""How a machine's training steps vary at each time scale, and which turn length settles a ratio soonest.

bench/train.py compares jobs that take turns: its ratio's spread is how much two turns
of the same length, run a few turns apart, differ for reasons that are not the jobs. On
an H200 a 1000-step window (1.6 s) varied by ~11 % and needed ~940 windows for a ratio
within ±1 % (bench/RESULTS.md, "GPU, 2026-12-04, second session" and "The ratio's
statistic"); whether shorter turns cancel most of that depends on how long the machine's
slow and fast spells last, which one steady stream of steps shows.

This runs train.py's model (MLP 512-512-512-10, batch 64, SGD, DDP) on the ranks of one
session, as train.py's nbdist job does (2 on CPU, one per GPU: 1 on a one-GPU machine;
``--n``), for ``--seconds`` (and at least the 210 steps the shortest turns' 20 pairs
need) without a pause, the time after every step taken on rank 0's training thread
(``time.perf_counter``; on a GPU the queue is not synchronised between steps, so a
stamp is when the step was issued: this launch-bound step keeps the queue short). Runs
in the benchmark's own process (the place of a notebook kernel); the stepping runs on
the rank. Then, for turns of L steps (10 to 2000): the stream cut into
consecutive turns, and the log ratio of the durations of two turns ``g`` turns apart,
g = 1 .. jobs - 1 (the distances at which ``--jobs`` jobs in balanced order run their
turns of one round); its standard deviation pooled over those g is the A/A spread of
one turn pair, ``s(L)``. A ratio within ±``--within`` % at 99 % then needs about
``(2.58 s(L) / within)^2`` turn pairs, and a run of that many rounds takes
``jobs x (1.1 L / steps/s + 20 ms + a turn's cost)`` per round (train.py's turns start
with a 20 ms pause and a tenth of the turn untimed): the minutes column. A turn's cost
(a barrier and a cell, outside the timing) is measured in the same session.

Same-process turns are a lower bound for separate jobs, which add their own
differences: if even this says a ratio needs more than a GPU session, train.py cannot
settle it in one. On the 2-core machine its plan for 10-step turns (2907 turn pairs,
16 minutes) was within a factor 1.6 of what five runs of train.py in such turns said of
themselves (2480-4640 pairs; bench/RESULTS.md, "How long the slow spells last"). The
plan is for the ratio of steps/s; train.py's logged job flushes at every turn's end, so
turns much shorter than the 0.5 s between flushes add flushes to its logging cost.

Usage: python bench/step_noise.py [--cpu] [--n N] [--seconds S] [--jobs 4] [--within 1]
                                  [--quick]
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import (  # noqa: E402
    CpuMeter,
    assert_no_children,
    machine,
    median,
    plan_ranks,
    print_goal_and_cpu,
    print_summary,
    run_benchmark,
    threads_per_rank,
)
from train import (  # noqa: E402  (train.py's model and step, and how its turns start)
    MODEL,
    MODEL_TEXT,
    TRAIN,
    TURN_PAUSE_MS,
    TURN_WARMUP_DIVISOR,
)

TURN_LENGTHS = (10, 20, 50, 100, 200, 500, 1000, 2000)
# Fewer turn pairs than this at a length and its spread is not printed: an sd of a handful
# of pairs is itself off by a third or more.
MIN_PAIRS = 20

# Run on the rank after TRAIN: a steady stream of steps, stamped after each.
STREAM = """
def _stream(steps):
    stamps = _trainer.stamped(steps)
    _trainer._sync()
    stamps[-1] = max(stamps[-1], time.perf_counter())  # the last turn ends when its kernels ran
    return stamps


def _turn_cost():
    # What train.py's every turn adds outside its timing: a barrier and a synchronize.
    dist.barrier()
    _trainer._sync()
"""


def turn_spread(stamps: list[float], length: int, jobs: int) -> tuple[float, int] | None:
    """The A/A spread of two turns of ``length`` steps 1 .. ``jobs`` - 1 turns apart.

    ``stamps``: the clock after every step of one stream (``stamps[0]`` before the first).
    The standard deviation of ``log(d_j / d_(j+g))``, ``d`` the turns' durations, pooled
    over the distances ``g``; with the number of pairs at the closest distance. None when
    fewer than :data:`MIN_PAIRS` pairs.

    >>> turn_spread([float(k) for k in range(1001)], 10, 4)
    (0.0, 99)
    """
    turns = (len(stamps) - 1) // length
    d = [stamps[(j + 1) * length] - stamps[j * length] for j in range(turns)]
    if turns - 1 < MIN_PAIRS:
        return None
    variances = []
    for g in range(1, jobs):
        logs = [math.log(d[j] / d[j + g]) for j in range(turns - g)]
        if len(logs) < 2:
            return None
        variances.append(statistics.pvariance(logs, mu=0.0))  # A/A: the ratio's mean is 1
    return math.sqrt(statistics.fmean(variances)), turns - 1


def plan_rows(
    stamps: list[float], jobs: int, within: float, turn_cost_s: float, level: float = 0.99
) -> list[dict]:
    """Per turn length: its spread, the turn pairs a ratio within ``±within`` at ``level``
    needs, and the minutes a run of that many rounds of ``jobs`` turns takes."""
    rate = (len(stamps) - 1) / (stamps[-1] - stamps[0])
    z = statistics.NormalDist().inv_cdf(0.5 + level / 2)
    rows = []
    for length in TURN_LENGTHS:
        got = turn_spread(stamps, length, jobs)
        if got is None:
            continue
        spread, pairs = got
        needed = math.ceil((z * spread / within) ** 2)
        # A turn as train.py's turned windows take it: its timed steps, a tenth more
        # untimed, the pause before them and the cell around them.
        timed = length / rate
        turn_s = timed + timed / TURN_WARMUP_DIVISOR + TURN_PAUSE_MS / 1000 + turn_cost_s
        minutes = needed * jobs * turn_s / 60
        rows.append(
            dict(
                steps=length,
                turn_ms=round(1e3 * length / rate, 1),
                pairs=pairs,
                spread=round(spread, 4),
                pairs_needed=needed,
                minutes=round(minutes, 1),
            )
        )
    return rows


def _main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu", action="store_true", help="gloo on CPU even if CUDA is there")
    parser.add_argument("--n", type=int, default=None, help="ranks (2 on CPU, one per GPU)")
    parser.add_argument(
        "--seconds", type=float, default=None, help="seconds of steps (20; GPU 60; --quick 4)"
    )
    parser.add_argument(
        "--jobs", type=int, default=4, help="jobs taking turns, as train.py's (4: with control)"
    )
    parser.add_argument(
        "--within", type=float, default=1.0, metavar="PCT", help="the ratio's ±PCT %% at 99 %% (1)"
    )
    parser.add_argument("--quick", action="store_true", help="smoke run: 4 seconds")
    args = parser.parse_args(argv)
    if args.seconds is not None and args.seconds <= 0:
        parser.error(f"--seconds {args.seconds}: give seconds > 0, e.g. --seconds 60")
    if args.n is not None and args.n < 1:
        parser.error(f"--n {args.n}: give 1 rank or more, e.g. --n 2")
    if args.jobs < 2:
        parser.error(f"--jobs {args.jobs}: a ratio compares at least 2 jobs; give 2 or more")
    if args.within <= 0:
        parser.error(f"--within {args.within}: give a half-width in percent > 0, e.g. --within 1")
    plan = plan_ranks(args.n, cpu=args.cpu, one_gpu_ranks=1)
    n = plan["n"]
    cuda = plan["cuda"]
    seconds = args.seconds or (4.0 if args.quick else 60.0 if cuda else 20.0)
    warmup = 200 if cuda else 20
    info = machine()
    meter = CpuMeter()
    print(
        f"step_noise: {plan['note']}; n={n}, {seconds:g} s of steps after {warmup} warm-up steps, "
        f"turns compared as {args.jobs} jobs take them; {info}",
        flush=True,
    )
    from nbdist import DistSession

    os.environ.update(plan["env"])
    session = DistSession(n, cpu=not cuda, backend=plan["backend"], threads=threads_per_rank(n))
    try:
        session.start()
        session.run(TRAIN + STREAM + f"\n_trainer = BenchTrainer(nbdist.device(), **{MODEL!r})")
        # The rate from the warm-up's second half: its first steps are slower.
        session.run(f"_w = _stream({warmup})\n_rate = {warmup // 2} / (_w[-1] - _w[{warmup // 2}])")
        rate = session.pull("_rate", rank=0)
        costs = []
        for _ in range(20):  # a turn's cost as nbdist's job in train.py pays it
            began = time.perf_counter()
            session.run("_turn_cost()")
            costs.append(time.perf_counter() - began)
        turn_cost = median(costs)
        # At least the shortest turns' pairs, however slow the stream (a loaded machine):
        # a plan always has its first row.
        steps = max((MIN_PAIRS + 1) * TURN_LENGTHS[0], int(seconds * rate))
        session.run(f"_stamps = _stream({steps})")
        stamps = session.pull("_stamps", rank=0)
    finally:
        session.stop()
        leftovers = assert_no_children()
        cpu = meter.read()

    within = args.within / 100
    rows = plan_rows(stamps, args.jobs, within, turn_cost)
    took = stamps[-1] - stamps[0]
    print(
        f"\n{steps} steps in {took:.1f} s ({steps / took:.1f} steps/s); a turn's cost outside "
        f"the timing {1e3 * turn_cost:.1f} ms (median of 20)"
    )
    print(
        f"{'turn steps':>10} {'turn ms':>8} {'pairs':>6} {'A/A spread':>11} "
        f"{'pairs needed':>13} {'minutes':>8}"
    )
    for r in rows:
        print(
            f"{r['steps']:>10} {r['turn_ms']:>8.1f} {r['pairs']:>6} {r['spread']:>11.4f} "
            f"{r['pairs_needed']:>13} {r['minutes']:>8.1f}"
        )
    print(
        f"A/A spread: sd of the log ratio of two turns 1-{args.jobs - 1} turns apart; pairs "
        f"needed: for a 99 % interval within ±{args.within:g} %; minutes: that many rounds of "
        f"{args.jobs} turns, each with train.py's pause, untimed steps and cell (a lower "
        "bound for separate jobs)"
    )
    best = min(rows, key=lambda r: r["minutes"])  # the stream holds the first row's pairs
    print(
        f"soonest: turns of {best['steps']} steps, about {best['minutes']:g} minutes "
        f"(train.py: --steps W --slices W/{best['steps']})"
    )
    print_goal_and_cpu("nothing left running", not leftovers, leftovers, cpu)
    print_summary(
        dict(
            bench="step_noise",
            quick=args.quick,
            plan=plan,
            model=f"{MODEL_TEXT}, {plan['backend']}",
            n=n,
            machine=info,
            cpu=cpu,
            steps=steps,
            seconds=round(took, 2),
            steps_s=round(steps / took, 2),
            jobs=args.jobs,
            within_pct=args.within,
            turn_cost_ms=round(1e3 * turn_cost, 2),
            rows=rows,
            soonest=best,
            leftover_pids=leftovers,
        )
    )
    return 0


if __name__ == "__main__":
    run_benchmark(_main)
