"""A Ctrl-C the moment a cell leaves the kernel, at N ranks: does every rank stop?

An engine ignores SIGINT between requests. Interrupted right after the cell was
sent, the ranks that had not begun it yet (at many ranks on a small machine, most
of them) miss the SIGINT. nbdist then asks every running rank on its control
channel (``nbdist.driver.missed_interrupt``): a rank drops the cell if it has not
begun it, or stops it if it began after the SIGINT. The baseline, measured in the
same run on the same ranks, is the kernel without those questions
(``RankRun._reach_missed`` turned off): SIGINT alone, as before.

Each trial: the cell ``ran_whole = False; time.sleep(S); ran_whole = True`` is
sent, and the kernel is interrupted as soon as its request is out (the moment a
loaded kernel lags behind its ranks). Reported per way: how many ranks ran the cell
whole after the interrupt, whether the kernel said every rank stopped, and the
seconds from the interrupt to the cell's end in the kernel (a rank that does not
stop costs the 10 s the kernel waits for interrupted ranks). The ways take turns.

Usage: python bench/early_interrupt.py [--n 64] [--reps 3] [--sleep 12] [--quick]
"""

from __future__ import annotations

import _thread
import argparse
import os
import sys
import time
from collections import Counter

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
from nbdist.driver.runner import RankRun  # noqa: E402
from nbdist.driver.sinks import ListSink  # noqa: E402
from nbdist.errors import RanksInterrupted  # noqa: E402


def _trial(s, seconds: float, *, asks: bool) -> dict:
    """One interrupted cell; what came of it."""
    cell = f"import time\nran_whole = False\ntime.sleep({seconds:g})\nran_whole = True"
    reach = RankRun._reach_missed
    asked: list = []  # the run's MissedInterrupt: each rank's last answer
    if asks:

        def reach_and_keep(self, sent_at):
            reach(self, sent_at)
            asked.append(self._missed)

        RankRun._reach_missed = reach_and_keep
    else:
        RankRun._reach_missed = lambda self, sent_at: None
    fired: list[float] = []

    def on_call(frame, event, arg):
        if event == "call" and frame.f_code is RankRun.__init__.__code__ and not fired:
            fired.append(time.monotonic())
            _thread.interrupt_main()

    said = ""
    sys.setprofile(on_call)
    try:
        s.run(cell, sink=ListSink())
    except KeyboardInterrupt as exc:
        said = str(exc) if isinstance(exc, RanksInterrupted) else f"bare {exc!r}"
    finally:
        sys.setprofile(None)
        RankRun._reach_missed = reach
    ended = time.monotonic()
    # Whatever is still running ends before the next trial: a cell queued behind it waits.
    s.run("pass", sink=ListSink())
    ran = s.pull("ran_whole")
    took = ended - fired[0] if fired else float("nan")
    got = dict(
        ran_whole=sum(map(bool, ran)), every_rank_stopped="every rank stopped" in said, s=took
    )
    if asked and asked[0] is not None:
        # The last answer of each rank asked (a rank whose reply came first was not asked
        # again): what the ranks that ran the cell whole said, against all.
        answers = asked[0].answers
        got["answers"] = dict(Counter(answers.values()))
        got["answers_of_ranks_that_ran_whole"] = dict(
            Counter(answers.get(i, "not asked") for i, r in enumerate(ran) if r)
        )
    return got


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--sleep", type=float, default=12.0, help="seconds the cell sleeps")
    ap.add_argument("--quick", action="store_true", help="smoke run: 2 ranks, 1 repetition")
    args = ap.parse_args()
    n, reps = (2, 1) if args.quick else (args.n, args.reps)
    print("machine:", machine(), flush=True)
    meter = CpuMeter()
    s = nbdist.DistSession(n, cpu=True, threads=1, timeout=600)
    t0 = time.monotonic()
    s.start()
    print(f"{n} ranks ready in {time.monotonic() - t0:.1f} s", flush=True)
    rows: dict[str, list[dict]] = {"nbdist": [], "SIGINT alone": []}
    try:
        s.run("ran_whole = False", sink=ListSink())
        for rep in range(reps):
            for way in ("nbdist", "SIGINT alone") if rep % 2 == 0 else ("SIGINT alone", "nbdist"):
                got = _trial(s, args.sleep, asks=way == "nbdist")
                rows[way].append(got)
                print(f"rep {rep + 1} {way}: {got}", flush=True)
    finally:
        s.stop()
    leftovers = assert_no_children()
    summary: dict = {"bench": "early_interrupt", "n": n, "reps": reps, "sleep_s": args.sleep}
    for way, got in rows.items():
        whole = [g["ran_whole"] for g in got]
        stopped = sum(g["every_rank_stopped"] for g in got)
        took = [g["s"] for g in got]
        print(
            f"{way:>12}: ranks that ran the cell whole per trial {whole}; "
            f"'every rank stopped' in {stopped}/{len(got)}; "
            f"interrupt to the cell's end: median {median(took):.2f} s, max {max(took):.2f} s",
            flush=True,
        )
        key = "nbdist" if way == "nbdist" else "sigint_alone"
        summary[key] = dict(
            ran_whole=whole, every_rank_stopped=stopped, median_s=round(median(took), 2)
        )
    ok = all(g["ran_whole"] == 0 and g["every_rank_stopped"] for g in rows["nbdist"])
    print_goal_and_cpu(
        "no rank runs an interrupted cell whole; every rank stopped", ok, leftovers, meter.read()
    )
    summary.update(goal_met=ok, leftover_pids=leftovers)
    print_summary(summary)
    return 0


if __name__ == "__main__":
    run_benchmark(main)
