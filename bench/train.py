"""DDP training steps/s through nbdist against the same code under torchrun.

One MLP (3 Linear layers, 512 wide, ReLU), batch 64, SGD, synthetic data from a
fixed seed, gloo on CPU. The same training code runs

- nbdist:   in the ranks of a ``DistSession(n)``, each window one
            ``session.run(...)`` (the path of ``%%on_all_ranks``);
- torchrun: in a script written to a temp file, ``torchrun --standalone
            --nproc_per_node n``, with the threads nbdist gives a rank
            (``OMP_NUM_THREADS`` and ``torch.set_num_threads``: max(1, cores // n))
            and gloo on loopback, as nbdist's ranks use.

Both jobs are up at the same time and take turns: a window of ``steps`` steps on
one, then a window on the other (the order swapped every pair), so a slow drift
or a burst of load from elsewhere hits both alike. The torchrun job waits for
its turn blocked on a FIFO (rank 0) and in a broadcast (the other ranks); the
nbdist engines wait idle as they do between cells. Steps/s are measured on rank 0
inside the loop: ``dist.barrier()``, then ``time.perf_counter()`` around the
steps. The figure is the median over nbdist's windows divided by the median over
torchrun's (goal >= 0.97); the median of the per-pair ratios is printed too.
A second, identical torchrun job ("torchrun_b", left out by ``--no-control`` and
``--quick``) takes its turns too: its ratio to the first is an A/A control, the
noise floor of the run. All jobs start from the same seed and run the same steps,
so their final losses agree (a check that they ran the same computation).

Usage: python bench/train.py [--n 2] [--windows 12] [--steps 100] [--warmup 20]
                             [--no-control] [--quick]
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
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

GOAL = 0.97

# The training code, identical for both jobs; run on every rank with torch.distributed ready.
TRAIN = """
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


class BenchTrainer:
    def __init__(self, width=512, batch=64, seed=0):
        torch.manual_seed(seed)
        model = torch.nn.Sequential(
            torch.nn.Linear(width, width),
            torch.nn.ReLU(),
            torch.nn.Linear(width, width),
            torch.nn.ReLU(),
            torch.nn.Linear(width, 10),
        )
        self.ddp = DDP(model)
        self.opt = torch.optim.SGD(self.ddp.parameters(), lr=0.01)
        self.loss_fn = torch.nn.CrossEntropyLoss()
        gen = torch.Generator().manual_seed(seed + 1 + dist.get_rank())
        self.xs = torch.randn(8, batch, width, generator=gen)
        self.ys = torch.randint(0, 10, (8, batch), generator=gen)
        self.i = 0
        self.loss = float("nan")

    def step(self):
        k = self.i % 8
        self.opt.zero_grad(set_to_none=True)
        loss = self.loss_fn(self.ddp(self.xs[k]), self.ys[k])
        loss.backward()
        self.opt.step()
        self.i += 1
        return loss

    def window(self, steps):
        # Steps/s of ``steps`` steps, timed on this rank after a barrier.
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(steps):
            loss = self.step()
        rate = steps / (time.perf_counter() - t0)
        self.loss = float(loss.detach())
        return rate

    def info(self):
        return {"threads": torch.get_num_threads(), "loss": self.loss, "steps": self.i}
"""

# torchrun's driver: rank 0 reads the number of steps of the next window from a
# FIFO (blocking, no CPU), broadcasts it; 0 ends the job.
TORCHRUN_MAIN = """
import json
import os
import sys

torch.set_num_threads(int(os.environ["BENCH_THREADS"]))
dist.init_process_group("gloo")
try:
    trainer = BenchTrainer(**json.loads(sys.argv[1]))
    rank = dist.get_rank()
    if rank == 0:
        print("BENCH_READY", flush=True)  # then block until the benchmark opens the FIFO
    fifo = open(sys.argv[2], "rb", buffering=0) if rank == 0 else None
    while True:
        cmd = torch.zeros(1, dtype=torch.int64)
        if rank == 0:
            line = b""
            while not line.endswith(b"\\n"):
                chunk = fifo.read(1)
                if not chunk:
                    break
                line += chunk
            cmd[0] = int(line or b"0")
        dist.broadcast(cmd, src=0)
        steps = int(cmd[0])
        if steps <= 0:
            break
        rate = trainer.window(steps)
        if rank == 0:
            print("BENCH_RATE " + json.dumps(rate), flush=True)
    if rank == 0:
        print("BENCH_INFO " + json.dumps(trainer.info()), flush=True)
finally:
    dist.destroy_process_group()
"""


class TorchrunJob:
    """A torchrun job that runs a training window each time it is told to."""

    def __init__(self, n: int, threads: int, workdir: str, model_kwargs: dict):
        self.script = os.path.join(workdir, "train_ddp.py")
        self.fifo_path = os.path.join(workdir, "windows.fifo")
        with open(self.script, "w") as f:
            f.write(TRAIN + TORCHRUN_MAIN)
        os.mkfifo(self.fifo_path)
        torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
        env = dict(
            os.environ,
            OMP_NUM_THREADS=str(threads),
            BENCH_THREADS=str(threads),
            GLOO_SOCKET_IFNAME=os.environ.get("GLOO_SOCKET_IFNAME", "lo"),
        )
        cmd = [torchrun, "--standalone", f"--nproc_per_node={n}", self.script]
        self.proc = subprocess.Popen(
            [*cmd, json.dumps(model_kwargs), self.fifo_path],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.lines: queue.Queue = queue.Queue()
        self.stderr: list[str] = []
        threading.Thread(target=self._read, args=(self.proc.stdout, True), daemon=True).start()
        threading.Thread(target=self._read, args=(self.proc.stderr, False), daemon=True).start()
        self.fifo: int | None = None

    def _read(self, stream, keep: bool) -> None:
        for line in stream:
            if keep:
                self.lines.put(line.rstrip("\n"))
            else:
                self.stderr.append(line)
        if keep:
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
        return f"torchrun job: {what} (exit code {self.proc.poll()}):\n" + "".join(
            self.stderr[-40:]
        )

    def wait_ready(self, timeout: float = 300.0) -> None:
        self._expect("BENCH_READY", timeout)
        # Rank 0 opens the FIFO for reading right after BENCH_READY.
        deadline = time.monotonic() + 30
        while self.fifo is None:
            try:
                self.fifo = os.open(self.fifo_path, os.O_WRONLY | os.O_NONBLOCK)
            except OSError as exc:
                if exc.errno != errno.ENXIO or time.monotonic() > deadline:
                    raise
                time.sleep(0.01)

    def window(self, steps: int, timeout: float = 300.0) -> float:
        os.write(self.fifo, f"{steps}\n".encode())
        return float(self._expect("BENCH_RATE", timeout))

    def finish(self, timeout: float = 60.0) -> dict:
        os.write(self.fifo, b"0\n")
        info = json.loads(self._expect("BENCH_INFO", timeout))
        self.proc.wait(timeout=timeout)
        return info

    def close(self) -> None:
        if self.fifo is not None:
            try:
                os.close(self.fifo)
            except OSError:
                pass
            self.fifo = None
        if self.proc.poll() is None:
            # torchrun passes SIGTERM on to its workers; kill only if it hangs.
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        for path in (self.fifo_path, self.script):
            try:
                os.remove(path)
            except OSError:
                pass


def _main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=2, help="ranks (default 2)")
    parser.add_argument("--windows", type=int, default=None, help="timed windows per job (12)")
    parser.add_argument("--steps", type=int, default=None, help="steps per window (100)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed steps per job (20)")
    parser.add_argument(
        "--no-control", action="store_true", help="leave out the second torchrun job (A/A)"
    )
    parser.add_argument(
        "--quick", action="store_true", help="smoke run: 3 windows of 30 steps, no control"
    )
    args = parser.parse_args(argv)
    n = args.n
    windows = args.windows or (3 if args.quick else 12)
    steps = args.steps or (30 if args.quick else 100)
    warmup = args.warmup if args.warmup is not None else (5 if args.quick else 20)
    control = not (args.no_control or args.quick)
    model_kwargs = dict(width=512, batch=64, seed=0)
    threads = threads_per_rank(n)

    info = machine()
    meter = CpuMeter()
    print(
        f"train: n={n}, {windows} windows of {steps} steps per job after {warmup} warm-up "
        f"steps, {threads} thread(s)/rank, control job: {control}, {info}",
        flush=True,
    )
    from nbdist import DistSession

    variants = ["nbdist", "torchrun"] + (["torchrun_b"] if control else [])
    rates: dict[str, list[float]] = {v: [] for v in variants}
    pair_ratios: list[float] = []
    control_ratios: list[float] = []
    final: dict[str, dict] = {}
    leftovers: list[int] = []
    session = DistSession(n, cpu=True)
    workdir = tempfile.mkdtemp(prefix="nbdist-bench-")
    jobs: dict[str, TorchrunJob] = {}
    try:
        for name in variants[1:]:
            jobdir = os.path.join(workdir, name)
            os.mkdir(jobdir)
            jobs[name] = TorchrunJob(n, threads, jobdir, model_kwargs)
        session.start()
        session.run(TRAIN + f"\n_trainer = BenchTrainer(**{model_kwargs!r})")
        for job in jobs.values():
            job.wait_ready()
        # Warm-up: the same number of steps on every job, not timed.
        if warmup:
            session.run(f"_ = _trainer.window({warmup})")
            for job in jobs.values():
                job.window(warmup)

        def nbdist_window() -> float:
            session.run(f"_rate = _trainer.window({steps})")
            return session.pull("_rate", rank=0)

        run = {"nbdist": nbdist_window}
        run.update({name: (lambda job=job: job.window(steps)) for name, job in jobs.items()})
        for w in range(windows):
            k = w % len(variants)  # rotate, so no job always follows the same one
            got = {}
            for variant in variants[k:] + variants[:k]:
                got[variant] = run[variant]()
                rates[variant].append(got[variant])
            pair_ratios.append(ratio(got["nbdist"], got["torchrun"]))
            line = (
                f"  window {w + 1}/{windows}: nbdist {got['nbdist']:.1f}, torchrun "
                f"{got['torchrun']:.1f} steps/s ({pair_ratios[-1]:.3f}x)"
            )
            if control:
                control_ratios.append(ratio(got["torchrun_b"], got["torchrun"]))
                line += f", control torchrun_b {got['torchrun_b']:.1f} ({control_ratios[-1]:.3f}x)"
            print(line + f", load {load()}", flush=True)
        session.run("_info = _trainer.info()")
        final["nbdist"] = session.pull("_info", rank=0)
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

    base = median(rates["torchrun"])
    ours = median(rates["nbdist"])
    r = ratio(ours, base)
    pair_median = median(pair_ratios)
    losses = {v: (final[v]["loss"], final[v]["steps"]) for v in final}
    same_loss = len(set(losses.values())) == 1
    thread_counts = {v: final[v]["threads"] for v in final}
    control_row = {}
    if control:
        control_row = dict(
            torchrun_b_steps_s=round(median(rates["torchrun_b"]), 2),
            control_ratio=round(ratio(median(rates["torchrun_b"]), base), 3),
            control_pair_ratio_median=round(median(control_ratios), 3),
            control_pair_ratios=[round(x, 3) for x in control_ratios],
        )
    print()
    print(f"{'n':>2} {'torchrun':>14} {'nbdist':>14} {'ratio':>6} {'pairs':>6}")
    print(f"{n:>2} {base:>8.1f} st/s {ours:>8.1f} st/s {r:>5.3f}x {pair_median:>5.3f}x")
    if control:
        print(
            f"   {'torchrun_b':>14} {control_row['torchrun_b_steps_s']:>8.1f} st/s "
            f"{control_row['control_ratio']:>5.3f}x {control_row['control_pair_ratio_median']:>5.3f}x"
            "  (A/A control: the noise floor of this run)"
        )
    print(
        f"final losses {{job: (loss, steps)}} {losses} (all equal: {same_loss}); "
        f"threads per rank: {thread_counts}"
    )
    print_goal_and_cpu(f"nbdist >= {GOAL}x torchrun steps/s", r >= GOAL, leftovers, cpu)
    print_summary(
        dict(
            bench="train",
            quick=args.quick,
            n=n,
            windows=windows,
            steps=steps,
            warmup=warmup,
            model="MLP 512-512-512-10, batch 64, SGD lr 0.01, DDP, gloo",
            machine=info,
            load_end=load(),
            cpu=cpu,
            threads_per_rank=thread_counts,
            torchrun_steps_s=round(base, 2),
            nbdist_steps_s=round(ours, 2),
            ratio=round(r, 3),
            pair_ratio_median=round(pair_median, 3),
            goal_ratio=GOAL,
            goal_met=r >= GOAL,
            **control_row,
            same_final_loss=same_loss,
            final=final,
            samples={k: [round(x, 2) for x in v] for k, v in rates.items()},
            pair_ratios=[round(x, 3) for x in pair_ratios],
            leftover_pids=leftovers,
        )
    )
    return 0


if __name__ == "__main__":
    run_benchmark(_main)
