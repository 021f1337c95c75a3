"""What one ``nbdist.log`` call, and one flush, cost a training thread (one process, no ranks).

1. The call: a loop of 0.5 ms steps (``y = (x @ w).relu().sum()``, x 64x1024, w
   1024x320, one thread) times each ``nbdist.log(step=i, loss=y, samples=64)`` right
   after its step, when the step's own data has filled the caches, against a call
   with the same keywords to a function that does nothing, in interleaved rounds;
   median and p90 of every call. The channel sends to a real socket that another
   process drains, as the kernel's collector would.
2. ``--flushes``: what a flush takes from the training thread's wall time. The same
   loop, logging every step, with the channel flushing 1, 10 and 50 times a second,
   against the loop without logging, interleaved; the extra per step beyond one flush
   a second, spread over the extra flushes, is what each flush cost the loop. On a
   machine with a core to spare that cost is the wait for the GIL: the flush thread
   runs Python holding it while the training thread, back from a torch op that ran
   without it, waits.

3. ``--batch``: what one batch of 1,000 points (a 0.5 ms loop's half second, logging
   ``loss`` and ``samples``) costs per point on each side, in one process: the flush
   thread turning it into columns (``to_columns``: step time and its breakdown,
   throughput, memory) and encoding the message, and the kernel decoding it, adding it
   to the run and appending it to the history.

``--cuda``: parts 1 and 2 with ``x`` and ``w`` on the GPU, so the logged loss is a CUDA
tensor, as on a GPU rank: the call only detaches it, and the flush thread reads the
batch's values in one copy to the host, which waits for the kernels queued before it
(nbdist.metrics.log). The steps are launch-bound there (a few microseconds of GPU work
each), so each timed stretch of steps ends with ``torch.cuda.synchronize()``. Without
a GPU it says so and exits 0, as bench/shared_gpu.py does.

Usage: python bench/log_call.py [--rounds 10] [--flushes] [--batch] [--cuda]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import load, machine, median, p90, print_summary, run_benchmark  # noqa: E402

_DRAIN = """
import sys, zmq
context = zmq.Context()
socket = context.socket(zmq.ROUTER)
print(socket.bind_to_random_port("tcp://127.0.0.1"), flush=True)
while True:
    socket.recv_multipart()
"""


def _nothing(step=None, **scalars) -> None:
    pass


def _calls(log, x, w, n: int) -> list[int]:
    """ns of each of ``n`` calls of ``log``, each right after a step."""
    clock, out = time.perf_counter_ns, []
    for i in range(n):
        y = (x @ w).relu().sum()
        t0 = clock()
        log(step=i, loss=y, samples=64)
        out.append(clock() - t0)
    return out


def _sync(x) -> None:
    if x.is_cuda:
        import torch

        torch.cuda.synchronize(x.device)


def _steps(log, x, w, n: int) -> float:
    """Seconds per step of ``n`` steps, logging each when ``log`` is given (on a GPU,
    up to the end of the last step's kernels)."""
    _sync(x)
    t0 = time.perf_counter()
    if log is None:
        for _ in range(n):
            (x @ w).relu().sum()
    else:
        for i in range(n):
            y = (x @ w).relu().sum()
            log(step=i, loss=y, samples=64)
    _sync(x)
    return (time.perf_counter() - t0) / n


def bench_call(rounds: int, x, w) -> dict:
    import nbdist

    funcs = {"nothing": _nothing, "nbdist.log": nbdist.log}
    got: dict[str, list[int]] = {name: [] for name in funcs}
    for log in funcs.values():
        _calls(log, x, w, 200)  # warm-up
    for r in range(rounds):
        for name in list(funcs)[r % 2 :] + list(funcs)[: r % 2]:
            got[name] += _calls(funcs[name], x, w, 1000)
    out = {
        name: {"median_us": round(median(v) / 1e3, 2), "p90_us": round(p90(v) / 1e3, 2)}
        for name, v in got.items()
    }
    extra = out["nbdist.log"]["median_us"] - out["nothing"]["median_us"]
    where = "a CUDA step (loss on the GPU)" if x.is_cuda else "a 0.5 ms step"
    print(
        f"call after {where}: nbdist.log median {out['nbdist.log']['median_us']} us "
        f"(p90 {out['nbdist.log']['p90_us']}), the same keywords to a function that does "
        f"nothing {out['nothing']['median_us']} us (p90 {out['nothing']['p90_us']}): the "
        f"call's own work {extra:.2f} us"
    )
    out["extra_us"] = round(extra, 2)
    return out


def bench_flushes(rounds: int, x, w) -> dict:
    import nbdist
    from nbdist.metrics import log as metrics_log

    per_s = [1, 10, 50]
    modes = ["off", *per_s]
    got: dict = {m: [] for m in modes}

    def one(mode, n):
        if mode != "off":
            metrics_log._FLUSH_INTERVAL_S = 1.0 / mode
        return _steps(None if mode == "off" else nbdist.log, x, w, n)

    for mode in modes:
        one(mode, 500)
    for r in range(rounds):
        for mode in modes[r % len(modes) :] + modes[: r % len(modes)]:
            got[mode].append(one(mode, 4000))
    off = median(got["off"])
    out: dict = {"step_us_off": round(off * 1e6, 1)}
    base = median(got[1]) - off
    for rate in per_s:
        extra = median(got[rate]) - off
        out[f"{rate}_per_s_extra_us_per_step"] = round(extra * 1e6, 2)
        if rate > 1:
            # the extra beyond 1 flush/s, per second of training, over the extra flushes
            per_flush = (extra - base) / off / (rate - 1)
            out[f"{rate}_per_s_ms_per_flush"] = round(per_flush * 1e3, 3)
    print(
        f"flushes: {out['step_us_off']} us steps; logged, extra per step at 1/10/50 flushes "
        f"a second {out['1_per_s_extra_us_per_step']} / {out['10_per_s_extra_us_per_step']} / "
        f"{out['50_per_s_extra_us_per_step']} us; wall time each flush took from training "
        f"{out['10_per_s_ms_per_flush']} ms (10/s), {out['50_per_s_ms_per_flush']} ms (50/s)"
    )
    return out


def _batch(n: int):
    """The buffer a 0.5 ms loop leaves for one flush: ``n`` points of loss and samples."""
    from nbdist.metrics.batch import Points

    points, start = Points(), time.time()
    points.first_last = start - 0.0005
    loss, samples = [], []
    points.cols = {"loss": loss, "samples": samples}
    for i in range(n):
        loss.append(0.5 + i * 1e-3)
        samples.append(64)
        points.steps.append(i)
        points.times.append(start + i * 0.0005)
    points.n = n
    return points


def bench_batch(rounds: int, n: int = 1000) -> dict:
    import tempfile

    from nbdist.metrics import steptime, wire
    from nbdist.metrics.batch import to_columns
    from nbdist.metrics.store import RunStore

    key, reading = os.urandom(16), steptime.memory(None)
    parts: dict[str, list[float]] = {
        k: [] for k in ("to_columns", "encode", "decode", "columns", "add", "store")
    }
    with tempfile.TemporaryDirectory(prefix="nbdist-bench-") as tmp:
        store = RunStore(os.path.join(tmp, "history.sqlite"))
        run = store.new_run(world_size=1)
        for _ in range(max(rounds, 10) * 3):
            points = _batch(n)
            clock = [time.perf_counter()]
            steps, times, columns = to_columns(points, reading)
            clock.append(time.perf_counter())
            frames = wire.encode(key, wire.points_message(0, steps, times, columns, n, 0))
            clock.append(time.perf_counter())
            message = wire.decode(key, frames)
            clock.append(time.perf_counter())
            decoded = wire.columns(message)
            clock.append(time.perf_counter())
            run.add_columns(0, *decoded)
            clock.append(time.perf_counter())
            store.append(run.id, 0, frames[1].decode(), n)
            clock.append(time.perf_counter())
            for name, t0, t1 in zip(parts, clock, clock[1:]):
                parts[name].append(t1 - t0)
        store.close()
    out = {name: round(median(v) / n * 1e6, 3) for name, v in parts.items()}
    out["payload_bytes_per_point"] = round(len(frames[1]) / n, 1)
    rank = out["to_columns"] + out["encode"]
    kernel = out["decode"] + out["columns"] + out["add"] + out["store"]
    print(
        f"a batch of {n} points, per point: flush thread {rank:.2f} us (to_columns "
        f"{out['to_columns']}, encode {out['encode']}), kernel {kernel:.2f} us (decode "
        f"{out['decode']}, columns {out['columns']}, add to the run {out['add']}, history "
        f"{out['store']}); {out['payload_bytes_per_point']} bytes a point on the wire"
    )
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--flushes", action="store_true", help="also part 2, the cost of a flush")
    parser.add_argument(
        "--batch", action="store_true", help="also part 3, a batch's cost per point"
    )
    parser.add_argument(
        "--cuda", action="store_true", help="parts 1 and 2 on the GPU: a CUDA loss, as on GPU ranks"
    )
    args = parser.parse_args()
    import torch

    if args.cuda and not torch.cuda.is_available():
        # As bench/shared_gpu.py: a GPU-only measurement says so and succeeds without one.
        print("--cuda: torch sees no CUDA device here, nothing measured (drop --cuda for the CPU)")
        return 0

    from nbdist.metrics import log as metrics_log

    torch.set_num_threads(1)
    print(f"machine: {machine()}; nbdist from {os.path.dirname(metrics_log.__file__)}")
    summary: dict = {"benchmark": "log_call", "device": "cuda" if args.cuda else "cpu"}
    summary["load_before"] = load()
    drain = subprocess.Popen(
        [sys.executable, "-c", _DRAIN], stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        port = int(drain.stdout.readline())
        metrics_log.configure(f"tcp://127.0.0.1:{port}", os.urandom(16), 0)
        device = "cuda" if args.cuda else "cpu"
        x, w = torch.randn(64, 1024, device=device), torch.randn(1024, 320, device=device)
        summary["call"] = bench_call(args.rounds, x, w)
        if args.flushes:
            summary["flushes"] = bench_flushes(args.rounds, x, w)
        if args.batch:
            summary["batch"] = bench_batch(args.rounds)
    finally:
        metrics_log.shutdown()
        drain.kill()
        drain.wait()
    summary["load_after"] = load()
    print_summary(summary)
    return 0


if __name__ == "__main__":
    run_benchmark(main)
