"""Rank side: where a step's time went (communication, data loading, compute) and the rank's memory.

``nbdist.log`` turns the time between two of its calls in one cell (``step_time``)
into three parts, stored with every point but a cell's first::

    comm_s     wall time inside nbdist's wrapped collectives (dist.all_reduce, ...)
    data_s     time waiting for data: nbdist.log(data_time=...) or nbdist.data_timer()
    compute_s  step_time - comm_s - data_s (everything else)

so ``compute_s + comm_s + data_s == step_time`` on every point, to float rounding.

What ``comm_s`` measures, and its limits:

- A collective called through the ``torch.distributed`` namespace
  (:mod:`nbdist.engine.collectives` wraps them) adds the wall time from its
  call to its return. For a blocking call on gloo (CPU) that is the whole
  collective, the wait for slower peers included.
- With ``async_op=True`` only the launch is counted; the ``work.wait()`` that
  follows is not wrapped and lands in ``compute_s``.
- On a GPU, where NCCL collectives return once queued, each collective on CUDA
  tensors is bracketed by two CUDA events on the current stream; ``comm_s`` is
  the device time between them (the stream's wait for the collective), read
  later on the flush thread, never on the training thread. Only in a cell that
  has called ``nbdist.log`` (its first point has no breakdown, so nothing is
  lost): a cell that never logs (a benchmark's loop of all_reduces) creates no
  events. At most :data:`MAX_EVENT_PAIRS` pairs wait for the next ``log``; past
  that the finished ones are read into the sum (a query, never a wait), so a
  cell that logs rarely holds a bounded number of events, not one pair per
  collective since its last point.
- DDP's gradient all-reduces run from its C++ reducer and do not pass through
  the wrapper: they overlap backward, and what is not hidden shows in
  ``compute_s``. A DDP comm hook written in Python
  (``model.register_comm_hook(state, hook)``; torch's ``allreduce_hook`` too)
  calls ``dist.all_reduce(..., async_op=True)``, so its launches are counted.

``data_s``: waiting for data cannot be told apart from compute without a
hook, so nbdist counts it only when told: ``nbdist.log(data_time=seconds)``
(capped at what the step left after communication; the raw value is kept as
``data_time``), else the time spent inside :func:`data_timer` blocks since the
previous ``log``, else 0 (the wait, if any, is in ``compute_s``).

Memory (per point unless ``NBDIST_LOG_MEMORY=0``): on a rank that uses CUDA,
``memory_mib`` (``torch.cuda.memory_allocated``), ``memory_reserved_mib``
(``memory_reserved``) and ``memory_peak_mib`` (``max_memory_allocated``); these
read the caching allocator's counters and never sync the device. On CPU,
``memory_mib`` is the process's resident set (RSS, ``/proc/self/statm``) and
``memory_peak_mib`` its high-water mark (``getrusage``).
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
import threading
import time

__all__ = [
    "BREAKDOWN_KEYS",
    "MAX_EVENT_PAIRS",
    "MEMORY_KEYS",
    "cell_begins",
    "collective_done",
    "cuda_comm_events",
    "data_timer",
    "events_seconds",
    "fold_finished",
    "memory",
    "split",
    "take",
    "timers",
    "StepTimers",
]

BREAKDOWN_KEYS = ("compute_s", "comm_s", "data_s")
MEMORY_KEYS = ("memory_mib", "memory_reserved_mib", "memory_peak_mib")


class StepTimers:
    """The running sums since the last :func:`take`, in one object: on a step that had no
    collective and no data timer (most steps of a plain loop) ``nbdist.log`` reads
    ``dirty`` alone, where it called :func:`take`, which built a tuple and a new list."""

    __slots__ = ("comm", "data", "events", "dirty", "armed")

    def __init__(self) -> None:
        """Nothing counted yet."""
        self.comm = 0.0  # seconds in wrapped collectives
        self.data = 0.0  # seconds in data_timer blocks
        self.events: list = []  # (start, end) CUDA event pairs of this step's collectives
        self.dirty = False  # set by every add; take() clears it
        self.armed = False  # nbdist.log called in this cell: bracket CUDA collectives


# Read and reset by ``nbdist.log`` on the training thread. Collectives from other threads
# (autograd's, for a comm hook) add without a lock: a float add under the GIL; at worst
# one collective lands in the next step.
timers = StepTimers()
_statm: tuple[int, int] | None = None  # (pid, fd): a forked rank must not read its parent's
_MEMORY_EVERY_S = 0.02  # memory read at most this often (RSS on CPU, the allocator on a GPU)
_last_rss: tuple[int, float, dict] | None = None  # (pid, when, reading)
_last_gpu: tuple[int, float, dict] | None = None  # (CUDA index, when, reading)
# CUDA event pairs held until the next ``log``: a cell logging every 1000 steps of 10
# collectives would otherwise keep 20 000 live events (and the flush thread wait on each).
MAX_EVENT_PAIRS = 256
_page_mib = os.sysconf("SC_PAGE_SIZE") / 2**20 if hasattr(os, "sysconf") else 4096 / 2**20
_local = threading.local()


def collective_done(seconds: float) -> None:
    """Add the wall time of one collective call (called by the collectives wrapper)."""
    timers.comm += seconds
    timers.dirty = True


def cell_begins() -> None:
    """A cell begins: no events until it calls ``nbdist.log`` (its first point has no breakdown)."""
    timers.armed = False


def cuda_comm_events(tensor):
    """A started (start, end) CUDA event pair when ``tensor`` is on a GPU, else None.

    The caller records ``end`` after the collective returns; both are on the
    current stream, so their elapsed time is how long that stream waited. None
    (the caller counts the call's wall time instead) when this cell has not
    logged, or when :data:`MAX_EVENT_PAIRS` pairs wait and none has finished.
    """
    try:
        t = timers
        if not t.armed or not getattr(tensor, "is_cuda", False):
            return None
        if len(t.events) >= MAX_EVENT_PAIRS and not fold_finished(t):
            return None
        import torch

        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        t.events.append((start, end))
        t.dirty = True
        return end
    except Exception:
        return None


def fold_finished(t: StepTimers) -> bool:
    """Read the oldest finished event pairs into ``t.comm`` and drop them; True if room was made.

    Never waits: ``query()`` asks whether the device has passed an event. Pairs are
    looked at oldest first and the first unfinished one stops the walk (a stream
    finishes its work in order).
    """
    events = t.events
    done = 0
    for start, end in events:
        try:
            if not end.query():
                break
            seconds = start.elapsed_time(end) / 1000.0
        except Exception:  # ``end`` not recorded yet: another thread's collective in flight
            break
        t.comm += seconds
        done += 1
    if done:
        del events[:done]
    return len(events) < MAX_EVENT_PAIRS


@contextlib.contextmanager
def data_timer():
    """Count the time inside this block as waiting for data (``data_s`` of the step).

    ``with nbdist.data_timer(): x, y = next(batches)``. Nested blocks count once.
    """
    depth = getattr(_local, "depth", 0)
    _local.depth = depth + 1
    t0 = time.perf_counter()
    try:
        yield
    finally:
        _local.depth = depth
        if depth == 0:
            timers.data += time.perf_counter() - t0
            timers.dirty = True


def take() -> tuple[float, float, list]:
    """(comm seconds, data-timer seconds, CUDA event pairs) since the previous call; resets them."""
    t = timers
    # Cleared first, so an add from another thread after the reset below sets it again; one
    # landing between the two is lost (as before: at worst one collective goes uncounted).
    t.dirty = False
    comm, data, events = t.comm, t.data, t.events
    t.comm, t.data, t.events = 0.0, 0.0, []
    return comm, data, events


def split(step_time: float, comm: float, data: float) -> dict[str, float]:
    """``comm_s``, ``data_s`` and ``compute_s`` of a step, each capped so none is negative.

    Communication is measured inside the step, so it is at most ``step_time``
    but for float rounding; data time the user logged may be anything, and
    gets what communication left.
    """
    comm = min(max(comm, 0.0), step_time)
    data = min(max(data, 0.0), step_time - comm)
    return {"comm_s": comm, "data_s": data, "compute_s": step_time - comm - data}


def events_seconds(events: list) -> float:
    """Device seconds between each (start, end) event pair, summed (flush thread: may wait)."""
    total = 0.0
    for start, end in events:
        end.synchronize()  # the flush thread waits for the device, never the training loop
        total += start.elapsed_time(end) / 1000.0
    return total


def memory(cuda_index: int | None) -> dict[str, float]:
    """This rank's memory now, in MiB (the keys of :data:`MEMORY_KEYS`); no device sync.

    ``nbdist.log``'s flush thread reads it once per flush, never the training thread
    (:mod:`nbdist.metrics.log`); a reading is reused for 20 ms, so flushes in quick
    succession (the end of a cell) read once. On a GPU one ``memory_stats_as_nested_dict``
    gives all three figures: ``torch.cuda.memory_allocated`` and its siblings each
    build, flatten and sort the allocator's whole statistics table, three times per
    ``nbdist.log`` call (logging every step of a 1.4 ms step cost 33 % on an H200,
    bench/RESULTS.md).
    """
    global _last_gpu
    if cuda_index is not None:
        now = time.monotonic()
        if (
            _last_gpu is not None
            and _last_gpu[0] == cuda_index
            and now - _last_gpu[1] < _MEMORY_EVERY_S
        ):
            return dict(_last_gpu[2])
        torch = sys.modules.get("torch")
        try:
            stats = torch.cuda.memory_stats_as_nested_dict(cuda_index)
            allocated = stats["allocated_bytes"]["all"]
            reading = {
                "memory_mib": allocated["current"] / 2**20,
                "memory_reserved_mib": stats["reserved_bytes"]["all"]["current"] / 2**20,
                "memory_peak_mib": allocated["peak"] / 2**20,
            }
        except Exception:
            return {}
        _last_gpu = (cuda_index, now, reading)
        return dict(reading)
    global _statm, _last_rss
    now = time.monotonic()
    # RSS read at most every 20 ms: two system calls each time.
    pid = os.getpid()  # a forked rank must not reuse its parent's reading
    if _last_rss is not None and _last_rss[0] == pid and now - _last_rss[1] < _MEMORY_EVERY_S:
        return dict(_last_rss[2])
    out: dict[str, float] = {}
    try:
        if _statm is None or _statm[0] != pid:
            _statm = (pid, os.open("/proc/self/statm", os.O_RDONLY))
        out["memory_mib"] = int(os.pread(_statm[1], 128, 0).split()[1]) * _page_mib
    except (OSError, ValueError, IndexError):
        out["memory_mib"] = math.nan
    try:
        import resource

        out["memory_peak_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    except (ImportError, OSError):
        pass
    _last_rss = (pid, now, out)
    return dict(out)
