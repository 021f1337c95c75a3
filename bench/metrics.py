"""What ``nbdist.log`` and the dashboard cost: training speed, kernel CPU, bytes to the frontend.

1. Training steps/s of one DDP MLP (3 Linear 512 wide, batch 64, SGD, gloo) with
   ``nbdist.log(step=, loss=, samples=)`` every step, and with ``flops=`` added (TFLOP/s
   and MFU; FLOPs counted once by ``nbdist.metrics.flops_per_step``, the peak looked up before
   the rounds), against the same loop without logging, in the same session; the three
   take turns in rotated order each round. Goal >= 0.98x for each.
2. Kernel CPU time spent collecting + on the dashboard while 4 ranks log 10k steps
   each (``--ranks`` / ``--steps``; each step sleeps ``--sleep``, default 5 ms, i.e.
   ~800 points/s into the kernel; 0.5 ms is a stress case), as a share of the run's wall time. A live
   dashboard model refreshes at its normal <= 5 Hz. Measured: the kernel process's
   CPU time during the cell minus the same cell with logging off (the cell's own
   waiting loop costs the same in both). Goal < 5 %.
3. Bytes sent to the frontend per dashboard update against points added: each
   update's delta message is JSON-encoded as the widget would send it.

Usage: python bench/metrics.py [--ranks 4] [--steps 10000] [--rounds 3] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import load, machine, median, print_summary, ratio, run_benchmark  # noqa: E402

import nbdist  # noqa: E402
from nbdist.driver.sinks import ListSink  # noqa: E402

TRAIN = """
import time
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
torch.manual_seed(0)
model = DDP(nn.Sequential(nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 1)))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
g = torch.Generator().manual_seed(rank)
X, Y = torch.randn(64, 512, generator=g), torch.randn(64, 1, generator=g)
F = nbdist.metrics.flops_per_step(model, X)
PEAK = nbdist.metrics.device_peak()  # measured here (CPU), not inside a timed round

def train(steps, mode, start=0):
    dist.barrier()
    t0 = time.perf_counter()
    for i in range(steps):
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(X), Y)
        loss.backward()
        opt.step()
        if mode == "log":
            nbdist.log(step=start + i, loss=loss.detach(), samples=64)
        elif mode == "flops":
            nbdist.log(step=start + i, loss=loss.detach(), samples=64, flops=F)
    dist.barrier()
    return steps / (time.perf_counter() - t0)
"""


def bench_training(rounds: int, steps: int) -> dict:
    s = nbdist.DistSession(2, history=False).start()
    try:
        s.run(TRAIN, sink=ListSink())
        modes = ["log", "off", "flops"]
        for mode in modes:  # warm-up
            s.run(f"train({steps // 4}, {mode!r})", sink=ListSink())
        rates: dict[str, list[float]] = {m: [] for m in modes}
        for r in range(rounds):
            for mode in modes[r % 3 :] + modes[: r % 3]:
                s.run(f"rate = train({steps}, {mode!r}, start={r * steps})", sink=ListSink())
                rates[mode].append(s.pull("rate", rank=0))
        frame = s.metrics.to_pandas()
        peaks = s.pull("PEAK")
    finally:
        s.stop()
    on, off, flops = (median(rates[m]) for m in ("log", "off", "flops"))
    result = {
        "steps_per_s_log": round(on, 1),
        "steps_per_s_nolog": round(off, 1),
        "steps_per_s_log_flops": round(flops, 1),
        "ratio": round(ratio(on, off), 3),
        "ratio_flops": round(ratio(flops, off), 3),
        "ratio_flops_vs_log": round(ratio(flops, on), 3),
        "peak_tflops": [round(p.tflops, 4) for p in peaks],
        "peak_source": peaks[0].source,
        "median_mfu": [round(float(frame[frame["rank"] == r]["mfu"].median()), 3) for r in (0, 1)],
    }
    print(
        f"training, 2 ranks: log every step {result['steps_per_s_log']} steps/s, with flops "
        f"{result['steps_per_s_log_flops']} steps/s, no log {result['steps_per_s_nolog']} steps/s "
        f"-> {result['ratio']:.3f}x / {result['ratio_flops']:.3f}x (goal >= 0.98); flops vs "
        f"log alone {result['ratio_flops_vs_log']:.3f}x; peak {result['peak_tflops']} TFLOP/s "
        f"({result['peak_source']}), median MFU {result['median_mfu']}"
    )
    return result


def bench_kernel_cpu(ranks: int, steps: int, sleep: float) -> dict:
    from nbdist.dashboard.live import LiveDashboard

    s = nbdist.DistSession(ranks)  # writes its history, as sessions do (to a private file here)
    s.start()
    cell = (
        "import time\n"
        "t0 = time.perf_counter()\n"
        f"for i in range({steps}):\n"
        f"    time.sleep({sleep})\n"
        "    if LOG: nbdist.log(step=i, loss=1.0 / (i + 1), samples=32)\n"
    )
    try:
        dash = LiveDashboard(s.metrics)
        dash.start()  # the widget and its <= 5 Hz refresh thread; no frontend attached
        measured = {}
        for log_on in (False, True):
            s.push({"LOG": log_on})
            cpu0, wall0 = time.process_time(), time.perf_counter()
            s.run(cell, sink=ListSink())
            measured[log_on] = (time.process_time() - cpu0, time.perf_counter() - wall0)
        time.sleep(0.5)  # the dashboard's last refresh
        dash.close()
        received = s.metrics.count()
    finally:
        s.stop()
    (cpu_off, _), (cpu_on, wall_on) = measured[False], measured[True]
    share = (cpu_on - cpu_off) / wall_on
    result = {
        "ranks": ranks,
        "steps": steps,
        "step_sleep_s": sleep,
        "points_received": received,
        "kernel_cpu_s_logging": round(cpu_on, 3),
        "kernel_cpu_s_baseline": round(cpu_off, 3),
        "wall_s": round(wall_on, 2),
        "share_of_wall": round(share, 4),
    }
    print(
        f"kernel CPU, {ranks} ranks x {steps} steps of >= {1000 * sleep:g} ms: {cpu_on:.2f} s with logging + dashboard vs "
        f"{cpu_off:.2f} s without, over {wall_on:.1f} s wall -> {100 * share:.2f} % (goal < 5 %); "
        f"{received} of {ranks * steps} points received"
    )
    return result


def bench_bytes(ranks: int) -> dict:
    from nbdist.dashboard.live import LiveDashboard
    from nbdist.metrics.run import Run

    run = Run(1, world_size=ranks)
    dash = LiveDashboard(run)
    rows = []
    step = 0
    for added in (1, 10, 100):
        for _ in range(3):
            for rank in range(ranks):
                run.add(
                    rank,
                    [
                        (
                            step + i,
                            time.time(),
                            {"loss": 1.0 / (step + i + 1), "samples_per_s": 100.0},
                        )
                        for i in range(added)
                    ],
                )
            step += added
            delta, _table = dash.poll()
            size = len(json.dumps(delta, separators=(",", ":"))) if delta else 0
            rows.append((added, size))
    dash.close()
    per = {}
    for added, size in rows:
        per.setdefault(added, []).append(size)
    result = {
        str(a): {"bytes": int(median(v)), "bytes_per_point": round(median(v) / (a * ranks), 1)}
        for a, v in per.items()
    }
    for added, info in result.items():
        print(
            f"dashboard delta: {added} new point(s) per rank x {ranks} ranks -> {info['bytes']} B "
            f"({info['bytes_per_point']} B per logged point)"
        )
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--steps", type=int, default=10000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--sleep", type=float, default=0.005, help="seconds each logged step sleeps (the step time)"
    )
    parser.add_argument("--quick", action="store_true", help="small sizes, a smoke run")
    args = parser.parse_args()
    if args.quick:
        args.ranks, args.steps, args.rounds = 2, 500, 1
    print(f"machine: {machine()}")
    summary = {"benchmark": "metrics", "load_before": load()}
    summary["training"] = bench_training(args.rounds, 60 if args.quick else 300)
    summary["kernel_cpu"] = bench_kernel_cpu(args.ranks, args.steps, args.sleep)
    summary["bytes"] = bench_bytes(args.ranks)
    summary["load_after"] = load()
    print_summary(summary)


if __name__ == "__main__":
    run_benchmark(main)
