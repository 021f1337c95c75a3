"""Which part of ``nbdist.log`` costs a training step its time: each part switched on alone.

bench/train.py measures what logging every step costs a DDP rank (its ``nbdist_log``
job against ``nbdist``); bench/log_call.py what one call costs. On an H200 the first
was 5.5 % of a 1.6 ms step (95 % interval 1.3-8.8 %) while the call was 1.3-2.2 us
(bench/RESULTS.md, "GPU, 2026-12-04"): most of the cost is not the call. This
benchmark runs train.py's model (MLP 512-512-512-10, batch 64, SGD, DDP) on one rank
of one session, in windows that take turns in balanced order, each window with one
of these after every step:

- ``none``: nothing (the baseline), and ``none_b``: nothing again (the A/A control: the
  noise floor of the run);
- ``detach``: ``loss.detach()``, dropped at once (what the caller of ``log`` pays);
- ``keep``: ``loss.detach()`` kept in a list emptied every 300 steps, about one
  flush's worth at 600 steps/s: what holding a step's 0-d device tensor until the
  flush costs the step (the host heap, the device allocator), without nbdist;
- ``copy``: ``loss.detach()`` copied into the next slot of a preallocated buffer on the
  loss's device (300 slots, reused), one small kernel a step: what holding nothing would
  cost instead, if ``keep`` shows holding is the cost;
- ``log_number``: ``nbdist.log(step=, loss=0.5, samples=)``, no tensor: the call and
  the flush without any device tensor to read (no stack, no copy to the host);
- ``log_bare``: ``nbdist.log(step=, loss=loss.detach(), samples=)`` with the flush's
  memory and NVML readings off (``NBDIST_LOG_MEMORY=0``, ``NBDIST_LOG_GPU=0``);
- ``log_held``: that call with both on, but no flush during the window (the flush
  thread waits for the channel's send lock, held by the window; the points go after
  it, untimed): the call and the holding without the flush thread's work beside the
  training thread;
- ``log``: the same call with both on: what bench/train.py's ``nbdist_log`` does.

``log_number``, ``log_bare`` and ``log`` end each turn with ``nbdist.metrics.log.flush()``
on the clock: what the flush thread has not sent by then would otherwise go at the
cell's end, off it (in the first GPU run, 6-28 % of a ``log`` window's points did), so all of
their flush work counts, and counts whole (not only where it held up the training
thread): if anything, an overestimate. ``log_held``'s points still go at the cell's end.
Those flushes' time a window and its share of the window are printed (``flush_ms``,
``flush_share``): a flush every turn where logging alone flushes every 0.5 s, so with
turns shorter than that the share bounds what the turns add to the cost.

``--slices K`` (GPU default 8, CPU 1) splits each window into K turns per variant of
``steps / K`` steps, the variants taking turns in a changing balanced order: on the
H200 a 1.3 s window's rate varied by 7-15 % against the baseline's window of the same
round, noise that lasts less than a window (bench/train.py's docstring); variants
compared within a fraction of a second of each other share more of it.

Each window times every step on the training thread (``time.perf_counter`` after
each), so the cost shows both as steps/s and as where it lands: a median step that
is longer (every step pays) or a few long steps (something stalls the thread, as a
flush holding the GIL or a device sync would). Per variant: steps/s over all its windows,
its ratio to ``none`` (``_common.rate_ratio``: the two variants' turns of a window paired)
with a 95 % bootstrap interval over the windows, the extra microseconds per
step split into the median step's shift and the rest, and the long steps (> 3x the
window's median). On a GPU also the device allocations (``cudaMalloc``) per window,
from the caching allocator's counters.

``--profile``: one more window of ``none`` and of ``log`` under ``torch.profiler``
(CPU, and CUDA on a GPU; every thread, the flush thread's too), then the ops whose
self CPU time differs most between the two.

``--variants LIST`` times only those (``none`` and ``log`` at least): ``--variants
none,none_b,log`` is the goal's pair and the A/A control, three times the windows of all
nine in the same minutes, for deciding the goal once the parts are known.

Goal: logging every step costs a GPU step <= 2 %, ``log`` at >= 0.98x ``none``.

Usage: python bench/log_cost.py [--cpu] [--windows N] [--steps N] [--slices K] [--quick]
                                [--variants LIST] [--profile]
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import (  # noqa: E402
    CpuMeter,
    add_slices_argument,
    assert_no_children,
    balanced_orders,
    check_slices,
    conclude,
    interval_verdict,
    machine,
    median,
    overall_rate,
    plan_ranks,
    rate_ratio,
    ratio_interval,
    run_benchmark,
    threads_per_rank,
    turn_orders,
)
from train import MODEL, MODEL_TEXT, TRAIN  # noqa: E402  (train.py's model and step)

GOAL = 0.98
VARIANTS = (
    "none",
    "none_b",
    "detach",
    "keep",
    "copy",
    "log_number",
    "log_bare",
    "log_held",
    "log",
)
LONG_STEP = 3.0  # a step this many times its window's median counts as a long one

# Run on the rank after TRAIN; one window of one variant, timed step by step.
WINDOW = """
import os as _os
import time as _time

import nbdist.metrics.log as _log_module


def _keeper():
    held = []

    def keep(step, loss, samples):
        held.append(loss.detach())
        if len(held) >= 300:
            held.clear()

    return keep


def _copier():
    slots = []

    def copy(step, loss, samples):
        if not slots:  # made at the first call, on the loss's device and of its dtype
            buffer = torch.zeros(300, dtype=loss.dtype, device=loss.device)
            slots.extend(buffer[i] for i in range(300))
        slots[step % 300].copy_(loss.detach())

    return copy


def _log(step, loss, samples):
    nbdist.log(step=step, loss=loss.detach(), samples=samples)


_VARIANTS = {
    "none": None,
    "none_b": None,
    "detach": lambda step, loss, samples: loss.detach(),
    "keep": _keeper(),
    "copy": _copier(),
    "log_number": lambda step, loss, samples: nbdist.log(step=step, loss=0.5, samples=samples),
    "log_bare": _log,
    "log_held": _log,
    "log": _log,
}
# Flushed at the end of each turn, on the clock: all of their flush work counts.
_FLUSHED = {"log_number", "log_bare", "log"}


def _device_allocs():
    if _trainer.device.type != "cuda":
        return None
    return torch.cuda.memory_stats(_trainer.device).get("num_device_alloc")


_GPU_ENV = _os.environ.get("NBDIST_LOG_GPU")  # as the rank started: restored after a window
_MEMORY = getattr(_log_module._channel, "memory", True)


def _bare(on):
    # The flush reads NBDIST_LOG_GPU at every flush, the memory switch once at start
    # (the channel's attribute): both set here, around one window, then put back.
    channel = _log_module._channel
    if on:
        _os.environ["NBDIST_LOG_GPU"] = "0"
    elif _GPU_ENV is None:
        _os.environ.pop("NBDIST_LOG_GPU", None)
    else:
        _os.environ["NBDIST_LOG_GPU"] = _GPU_ENV
    if channel is not None:
        if not hasattr(channel, "memory"):
            raise RuntimeError("nbdist's metrics channel has no 'memory' switch: update log_cost.py")
        channel.memory = False if on else _MEMORY


def _held(on):
    # A flush takes the channel's send lock first (log() never does): held by the window,
    # the flush thread waits there, off the GIL, until the window ends.
    channel = _log_module._channel
    if channel is None:
        return
    if not hasattr(channel, "send_lock"):
        raise RuntimeError("nbdist's metrics channel has no 'send_lock': update log_cost.py")
    global _holding
    if on:
        channel.send_lock.acquire()  # waits for a flush under way to end
        _holding = channel.send_lock
    elif globals().get("_holding") is not None:
        _holding, held = None, _holding
        held.release()


# What a window's turns of one variant add up to, until _window_summary takes it.
_turns = {}


def _turn(variant, steps):
    fn = _VARIANTS[variant]
    channel = _log_module._channel
    allocs = _device_allocs()
    try:
        _bare(variant == "log_bare")
        _held(variant == "log_held")
        sent = channel.total if channel is not None else 0
        stamps = _trainer.stamped(steps, fn)
        clock = _time.perf_counter
        # Points the flush thread sent during the steps (none while held).
        sent = (channel.total if channel is not None else 0) - sent
        flushed = 0.0
        if variant in _FLUSHED:  # the rest on the clock, not at the cell's end off it
            flushed = clock()
            _log_module.flush()
            flushed = clock() - flushed
        _trainer._sync()
        end = clock()
    finally:
        _bare(False)
        _held(False)
    after = _device_allocs()
    acc = _turns.setdefault(
        variant, {"took": [], "seconds": 0.0, "flush": 0.0, "allocs": None, "sent": 0}
    )
    acc["took"].extend(b - a for a, b in zip(stamps, stamps[1:]))
    acc["seconds"] += end - stamps[0]
    acc["flush"] += flushed
    acc["sent"] += sent
    if allocs is not None:
        acc["allocs"] = (acc["allocs"] or 0) + after - allocs


def _window_summary(variant, long_step):
    acc = _turns.pop(variant)
    took = sorted(acc["took"])
    mid = took[len(took) // 2]
    long = [t for t in took if t > long_step * mid]
    return {
        "rate": len(took) / acc["seconds"],
        "median_us": 1e6 * mid,
        "p99_us": 1e6 * took[min(len(took) - 1, int(0.99 * len(took)))],
        "max_us": 1e6 * took[-1],
        "long": len(long),
        "long_ms": 1e3 * sum(long),
        "flush_ms": 1e3 * acc["flush"],  # the turns' flushes on the clock, together
        "device_allocs": acc["allocs"],
        "sent": acc["sent"],
    }


def _timed_window(variant, steps, long_step):
    _turn(variant, steps)
    return _window_summary(variant, long_step)


def _profiled(variant, steps, long_step):
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if _trainer.device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities) as prof:
        _timed_window(variant, steps, long_step)
    rows = {}
    for event in prof.key_averages():
        rows[event.key] = (event.self_cpu_time_total, event.count)
    return rows
"""


def _main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu", action="store_true", help="gloo on CPU even if CUDA is there")
    parser.add_argument("--windows", type=int, default=None, help="windows per variant (8; GPU 10)")
    parser.add_argument("--steps", type=int, default=None, help="steps a window (200; GPU 800)")
    parser.add_argument("--quick", action="store_true", help="smoke run: 3 short windows")
    add_slices_argument(parser, "variant", "1; GPU 8")
    parser.add_argument(
        "--variants",
        default=None,
        metavar="LIST",
        help="comma-separated variants to time (all; none and log at least)",
    )
    parser.add_argument("--profile", action="store_true", help="also profile none against log")
    args = parser.parse_args(argv)
    for name in ("windows", "steps"):
        value = getattr(args, name)
        if value is not None and value < 1:
            parser.error(f"--{name} {value}: give a whole number >= 1, e.g. --{name} 8")
    variants = _variants(parser, args.variants)
    plan = plan_ranks(1, cpu=args.cpu, one_gpu_ranks=1)
    cuda = plan["cuda"]
    # Launch-bound GPU steps are short (~1.6 ms on an H200): longer windows there, and more
    # of them (a GPU window's rate varies by a few %, as bench/train.py's did). Nine
    # variants of 10 windows of 800 steps: about 2.5 minutes on an H200.
    scale = 4 if cuda else 1
    windows = args.windows or (3 if args.quick else 10 if cuda else 8)
    steps = args.steps or scale * (60 if args.quick else 200)
    warmup = scale * (10 if args.quick else 40)
    # On the H200 most of a window's noise lasted less than a window (bench/train.py's
    # docstring): turns of 100 steps (~0.17 s) put the variants compared close together.
    slices = args.slices if args.slices is not None else 8 if cuda and not args.quick else 1
    check_slices(parser, slices, steps)
    info = machine()
    meter = CpuMeter()
    print(
        f"log_cost: {plan['note']}; {windows} windows of {steps} steps per variant in "
        f"{slices} turn(s) each, after {warmup} warm-up steps each, variants "
        f"{', '.join(variants)}; {info}",
        flush=True,
    )
    from nbdist import DistSession

    got: dict[str, list[dict]] = {v: [] for v in variants}
    profiles: dict[str, dict] = {}
    os.environ.update(plan["env"])
    threads = threads_per_rank(1)
    session = DistSession(1, cpu=not cuda, backend=plan["backend"], threads=threads)
    try:
        session.start()
        session.run(TRAIN + WINDOW + f"\n_trainer = BenchTrainer(nbdist.device(), **{MODEL!r})")

        def summary(variant: str) -> dict:
            session.run(f"_got = _window_summary({variant!r}, {LONG_STEP})")
            return session.pull("_got", rank=0)

        for variant in variants:
            session.run(f"_turn({variant!r}, {warmup})")
            summary(variant)
        orders = balanced_orders(list(variants))
        for w in range(windows):
            # The variants take turns, ``slices`` a window, in a changing balanced order.
            for order in turn_orders(orders, w, slices):
                for variant in order:
                    session.run(f"_turn({variant!r}, {steps // slices})")
            for variant in variants:
                got[variant].append(summary(variant))
            line = ", ".join(f"{v} {got[v][-1]['rate']:.1f}" for v in variants)
            print(f"  window {w + 1}/{windows}: {line} steps/s", flush=True)
        if args.profile:
            for variant in ("none", "log"):
                session.run(f"_prof = _profiled({variant!r}, {steps}, {LONG_STEP})")
                profiles[variant] = session.pull("_prof", rank=0)
    finally:
        session.stop()
        leftovers = assert_no_children()
        cpu = meter.read()

    rates = {v: [g["rate"] for g in got[v]] for v in variants}
    base = overall_rate(rates["none"])
    rows = {}
    print()
    print(
        f"{'variant':>10} {'steps/s':>8} {'x none':>7} {'95 % interval':>16} {'extra us/step':>14}"
        f" {'median shift':>13} {'long steps':>11} {'long ms':>8} {'max ms':>7} {'cudaMalloc':>10}"
    )
    for v in variants:
        rate = overall_rate(rates[v])
        low, high = ratio_interval(rates[v], rates["none"])
        extra = 1e6 / rate - 1e6 / base
        shift = median([g["median_us"] for g in got[v]]) - median(
            [g["median_us"] for g in got["none"]]
        )
        allocs = [g["device_allocs"] for g in got[v] if g["device_allocs"] is not None]
        rows[v] = dict(
            steps_s=round(rate, 2),
            ratio=round(rate_ratio(rates[v], rates["none"]), 4),
            interval=[round(low, 4), round(high, 4)],
            extra_us_per_step=round(extra, 2),
            median_shift_us=round(shift, 2),
            long_steps=median([g["long"] for g in got[v]]),
            long_ms=round(median([g["long_ms"] for g in got[v]]), 2),
            max_ms=round(max(g["max_us"] for g in got[v]) / 1e3, 2),
            device_allocs=median(allocs) if allocs else None,
            sent_in_window=[g["sent"] for g in got[v]],
            flush_ms=round(median([g["flush_ms"] for g in got[v]]), 3),
        )
        r = rows[v]
        print(
            f"{v:>10} {rate:>8.1f} {r['ratio']:>7.3f} [{low:.3f}, {high:.3f}]"
            f" {extra:>14.1f} {shift:>13.1f} {r['long_steps']:>11} {r['long_ms']:>8.1f}"
            f" {r['max_ms']:>7.1f} {'-' if r['device_allocs'] is None else r['device_allocs']:>10}"
        )
    print(
        "extra us/step: 1e6/steps/s against none's; median shift: how much longer the median "
        f"step is (every step pays); long steps: steps > {LONG_STEP:g}x their window's median, "
        "their count and time a window (medians over windows); cudaMalloc: device allocations "
        "a window"
    )
    # Their share of a window: at most what the turn-end flushes add to a variant's cost
    # (a flush every turn, where logging alone would flush every 0.5 s).
    for v in variants:
        rows[v]["flush_share"] = round(rows[v]["flush_ms"] / 1e3 * rows[v]["steps_s"] / steps, 5)
    on_clock = ", ".join(
        f"{v} {rows[v]['flush_ms']:.2f} ({100 * rows[v]['flush_share']:.2f} % of it)"
        for v in variants
        if rows[v]["flush_ms"]
    )
    print(f"the turns' flushes on the clock, ms a window (median): {on_clock or 'none'}")
    if profiles:
        _print_profile_difference(profiles["none"], profiles["log"], steps)
    low, high = rows["log"]["interval"]
    log_ratio = rows["log"]["ratio"]
    ok = log_ratio >= GOAL
    decided = low >= GOAL or high < GOAL
    print(
        f"log / none {log_ratio:.3f}x, "
        + interval_verdict((low, high), GOAL, decided, windows, "windows", more="--windows")
    )
    conclude(
        "log_cost",
        f"logging every step costs {100 * (1 - log_ratio):.1f} % <= 2 % (log {log_ratio:.3f}x none)",
        GOAL,
        ok,
        leftovers,
        cpu,
        info,
        args.quick,
        plan=plan,
        windows=windows,
        steps=steps,
        slices=slices,
        warmup=warmup,
        model=f"{MODEL_TEXT}, {plan['backend']}, 1 rank",
        rows=rows,
        samples={v: [round(x, 2) for x in rates[v]] for v in variants},
        profiled=sorted(profiles),
    )
    return 0


def _variants(parser, text: str | None) -> tuple[str, ...]:
    """The variants ``--variants`` names, in the order of :data:`VARIANTS`; all when None."""
    if text is None:
        return VARIANTS
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in VARIANTS]
    if unknown:
        parser.error(
            f"--variants: unknown variant {unknown[0]!r}; choose from {', '.join(VARIANTS)}"
        )
    missing = [name for name in ("none", "log") if name not in names]
    if missing:
        parser.error(
            f"--variants {text}: the goal compares log with none; add {' and '.join(missing)}"
        )
    return tuple(v for v in VARIANTS if v in names)


def _print_profile_difference(none: dict, logged: dict, steps: int) -> None:
    """The ops whose self CPU time (all threads) differs most between the two windows."""
    keys = set(none) | set(logged)

    def diff(key: str) -> float:
        return logged.get(key, (0, 0))[0] - none.get(key, (0, 0))[0]

    print(f"\nprofile, one window of {steps} steps each: self CPU us (calls), log against none")
    print(f"{'op':>44} {'none':>16} {'log':>16} {'log - none, per step':>21}")
    for key in sorted(keys, key=lambda k: -abs(diff(k)))[:15]:
        a, b = none.get(key, (0, 0)), logged.get(key, (0, 0))
        print(
            f"{key[:44]:>44} {a[0]:>9.0f} ({a[1]:>4}) {b[0]:>9.0f} ({b[1]:>4})"
            f" {diff(key) / steps:>21.2f}"
        )


if __name__ == "__main__":
    run_benchmark(_main)
