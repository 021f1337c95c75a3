"""What the kernel's :class:`~nbdist.metrics.run.Run` holds per logged point, and what adding
and reading points costs, against another revision's ``nbdist/metrics/run.py`` (default HEAD).

1. Memory (tracemalloc): 4 ranks x 20,000 points added through ``add_columns`` in batches
   as the collector gets them from ``wire.columns`` (each batch's floats made while
   tracing, as decoding makes them), for two kinds of point: 11 keys of distinct values
   each, and the 11 keys a rank logging ``loss``, ``samples`` and ``tokens`` sends (step
   time and its breakdown, throughput, memory; the constant columns travel as one number
   and the kernel gets ``[value] * n``, ``compute_s`` is ``step_time``'s list).
2. ``add_columns``: ns per point, batches of 5 points (10 steps/s, 2 flushes/s) and 100;
   and the collector's whole work on such a batch (JSON, ``wire.columns``, ``add_columns``).
3. ``series()``: a dense key's whole 20,000 points and its latest 300 (a dashboard's
   incremental read), and a sparse key's whole series.

Usage: python bench/run_memory.py [--against REV]
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import os
import subprocess
import sys
import tempfile
import timeit
import tracemalloc

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from nbdist.metrics import wire  # noqa: E402

RANKS, POINTS, KEYS = 4, 20_000, 11


def _load(path: str, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def _distinct(start: int, n: int, rng) -> tuple[list, list, dict]:
    """A batch of ``n`` points, 11 keys of distinct floats on every point."""
    steps = list(range(start, start + n))
    times = (1e9 + np.arange(start, start + n) * 0.1).tolist()
    return steps, times, {f"k{j}": (None, rng.random(n).tolist()) for j in range(KEYS)}


def _wire(start: int, n: int, rng) -> tuple[list, list, dict]:
    """A batch as the collector gets it: encoded by the rank's wire code, decoded by the kernel's."""
    step_time = 0.1 + rng.random(n) * 1e-3
    idx = None if start else list(range(1, n))  # a rank's first point has no step time
    sel = slice(None) if idx is None else slice(1, None)
    columns = {
        "loss": (None, rng.random(n)),
        "samples": (None, np.full(n, 64.0)),
        "tokens": (None, np.full(n, 8192.0)),
        "step_time": (idx, step_time[sel]),
        "comm_s": (idx, np.zeros(n)[sel]),
        "data_s": (idx, np.zeros(n)[sel]),
        "compute_s": (idx, step_time[sel]),
        "samples_per_s": (idx, (64.0 / step_time)[sel]),
        "tokens_per_s": (idx, (8192.0 / step_time)[sel]),
        "memory_mib": (None, 812.5 + start),
        "memory_peak_mib": (None, 1024.0 + start),
    }
    times = 1e9 + np.arange(start, start + n) * 0.1
    message = wire.points_message(0, list(range(start, start + n)), times, columns, start + n, 0)
    return wire.columns(message)


def _memory(module, make, batch: int) -> float:
    rng = np.random.default_rng(0)
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    run = module.Run(1, world_size=RANKS)
    for start in range(0, POINTS, batch):
        for rank in range(RANKS):
            run.add_columns(rank, *make(start, batch, rng))
    gc.collect()
    held = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    assert run.count() == RANKS * POINTS
    return held / (RANKS * POINTS)


def _add_ns(module, batch: int) -> float:
    rng = np.random.default_rng(1)
    batches = [_wire(start, batch, rng) for start in range(0, 4000, batch)]

    def add() -> None:
        run = module.Run(1, world_size=1)
        for b in batches:
            run.add_columns(0, *b)

    return min(timeit.repeat(add, number=1, repeat=7)) / 4000 * 1e9


def _kernel_ns(module, batch: int) -> float:
    """ns per point of what the collector does with a batch: JSON, columns, add_columns."""
    import json

    rng = np.random.default_rng(1)
    payloads = []
    for start in range(0, 4000, batch):
        steps, times, cols = _wire(start, batch, rng)
        message = wire.points_message(
            0,
            steps,
            np.asarray(times),
            {k: (i, np.asarray(v)) for k, (i, v) in cols.items()},
            start + batch,
            0,
        )
        payloads.append(json.dumps(message).encode())

    def collect() -> None:
        run = module.Run(1, world_size=1)
        for payload in payloads:
            run.add_columns(0, *wire.columns(json.loads(payload)))

    return min(timeit.repeat(collect, number=1, repeat=7)) / 4000 * 1e9


def _series_us(module) -> dict[str, float]:
    rng = np.random.default_rng(2)
    run = module.Run(1, world_size=1)
    for start in range(0, POINTS, 100):
        run.add_columns(0, *_wire(start, 100, rng))
    # a sparse key: a GPU reading about once a second (every 10th point)
    run.add_columns(
        0,
        list(range(POINTS, POINTS + 10_000)),
        [2e9 + i for i in range(10_000)],
        {"gpu_util": (list(range(0, 10_000, 10)), [50.0] * 1000)},
    )
    out = {}
    for name, call in (
        ("series(loss) 20k points", lambda: run.series("loss", 0)),
        ("series(loss, start=-300)", lambda: run.series("loss", 0, start=-300)),
        ("timeline(loss, start=-300)", lambda: run.timeline("loss", 0, start=-300)),
        ("series(gpu_util) 1k sparse", lambda: run.series("gpu_util", 0)),
    ):
        number = 20 if "20k" in name else 2000
        out[name] = min(timeit.repeat(call, number=number, repeat=5)) / number * 1e6
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--against", default="HEAD", help="the revision to compare with")
    args = parser.parse_args()
    text = subprocess.run(
        ["git", "show", f"{args.against}:nbdist/metrics/run.py"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "run_before.py")
        with open(path, "w") as f:
            f.write(text)
        impls = {
            args.against: _load(path, "run_before"),
            "working tree": _load(os.path.join(ROOT, "nbdist/metrics/run.py"), "run_now"),
        }
        for name, module in impls.items():
            print(f"== {name}")
            print(
                f"  bytes/point: distinct 11 keys {_memory(module, _distinct, 100):.1f}, "
                f"wire's 11 keys {_memory(module, _wire, 5):.1f} (batches of 5), "
                f"{_memory(module, _wire, 100):.1f} (batches of 100)"
            )
            print(
                f"  add_columns ns/point: batches of 5 {_add_ns(module, 5):.0f}, "
                f"of 100 {_add_ns(module, 100):.0f}; the collector's whole work (JSON, "
                f"wire.columns, add_columns): {_kernel_ns(module, 5):.0f}, {_kernel_ns(module, 100):.0f}"
            )
            for label, us in _series_us(module).items():
                print(f"  {label}: {us:.1f} us")


if __name__ == "__main__":
    main()
