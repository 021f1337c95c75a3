"""Rank side: the timing loops behind ``%dist_bench comm`` and ``%dist_start --check``.

The kernel (:mod:`nbdist.driver.comm_check`) applies these functions on every
rank at once; each returns this rank's raw timings, and the kernel turns the
timings of all ranks into latency and bandwidth. They import torch only when
they run, so the kernel can name them without importing torch.

How one figure is timed, on every rank alike:

1. a barrier (a one-element all_reduce, then a CUDA synchronise on GPU: NCCL
   works on its own stream, so only the synchronise says it finished), so
   that every rank starts the clock as the last one arrives;
2. the operation, then a CUDA synchronise on GPU;
3. the time between the two, on this rank's clock.

Warm-up iterations come first and are not returned (they connect the ranks,
and on NCCL create the communicator of each pair for send/recv). The kernel
takes, per iteration, the slowest rank's time (the operation is over only
when it is over everywhere) and the median over iterations.

Message sizes follow nccl-tests: ``size`` is the whole buffer, the output of
an all_gather and the input of a reduce_scatter, each rank contributing or
keeping ``size / n`` of it. float32 zeros: the sums stay 0, so no inf or
denormal numbers change the cost from one call to the next.
"""

from __future__ import annotations

import os
import time

from nbdist.engine import backend_support

__all__ = ["OPS", "PROBED_AS", "elements", "memory_limit", "time_collectives", "time_pairs"]

OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast")
# The names :mod:`nbdist.engine.backend_support` probes these under (gloo on a GPU lacks some).
PROBED_AS = {
    "all_reduce": "all_reduce",
    "all_gather": "all_gather_into_tensor",
    "reduce_scatter": "reduce_scatter_tensor",
    "broadcast": "broadcast",
    "sendrecv": "send/recv",
}
_ITEM = 4  # bytes of a float32


def elements(op: str, nbytes: int, world: int) -> int:
    """float32 elements of the whole buffer of ``op`` for a message of about ``nbytes``.

    all_gather and reduce_scatter split the buffer in ``world`` equal shards, so
    their count is a multiple of ``world``; every count is at least one element
    per rank. Example: ``elements("all_gather", 1000, 3) == 249``.
    """
    count = max(1, nbytes // _ITEM)
    if op in ("all_gather", "reduce_scatter"):
        count = max(world, count - count % world)
    return count


def _local_ranks() -> int:
    return max(1, int(os.environ.get("LOCAL_WORLD_SIZE") or 1))


def _available_host_bytes() -> int:
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def memory_limit() -> dict:
    """This rank's device (``cpu``, ``cuda:0``) and the bytes it may take for buffers.

    On a GPU: its free memory, shared among the ranks of this host that use
    it; on CPU: the host's available memory shared among its ranks. The
    kernel takes the smallest of all ranks and leaves room to spare.
    """
    import torch

    from nbdist.engine.helpers import device

    dev = device()
    if dev.type == "cuda":
        free, _ = torch.cuda.mem_get_info(dev)
        sharing = -(-_local_ranks() // max(1, torch.cuda.device_count()))
        return {"device": str(dev), "type": "cuda", "free": int(free // sharing)}
    return {"device": str(dev), "type": dev.type, "free": _available_host_bytes() // _local_ranks()}


class _Clock:
    """Barrier, then time one call on this rank (synchronising CUDA around it)."""

    def __init__(self, torch, dist, dev):
        self.torch, self.dist, self.dev = torch, dist, dev
        self.cuda = dev.type == "cuda"
        self.token = torch.zeros(1, device=dev)

    def sync(self) -> None:
        if self.cuda:
            self.torch.cuda.synchronize(self.dev)

    def barrier(self) -> None:
        self.dist.all_reduce(self.token)
        self.sync()

    def time(self, call) -> float:
        self.barrier()
        start = time.perf_counter()
        call()
        self.sync()
        return time.perf_counter() - start


def _calls(dist, op: str, big, small, count: int, world: int):
    """A no-argument function running ``op`` once on the first ``count`` elements of ``big``."""
    whole, shard = big[:count], small[: count // world]
    if op == "all_reduce":
        return lambda: dist.all_reduce(whole)
    if op == "broadcast":
        return lambda: dist.broadcast(whole, src=0)
    if op == "all_gather":
        gather = backend_support.tensor_all_gather()
        return lambda: gather(whole, shard)
    scatter = backend_support.tensor_reduce_scatter()
    return lambda: scatter(shard, whole)


def _skipped(ops) -> dict[str, str]:
    missing = backend_support.missing()
    return {op: missing[PROBED_AS[op]] for op in ops if PROBED_AS[op] in missing}


def time_collectives(sizes, ops, iters, warmup: int) -> dict:
    """Seconds per call of each op in ``ops`` at each size in ``sizes``, on this rank.

    ``iters``: timed calls per size, a dict {size: iterations} or one number.
    Every rank must call it with the same arguments. Returns ``{"device",
    "backend", "world", "times": [(op, bytes, [seconds, ...]), ...],
    "skipped": {op: why}}``, where bytes is the buffer actually used (see
    :func:`elements`) and ops the backend cannot run here are skipped.
    """
    import torch
    import torch.distributed as dist

    from nbdist.engine.helpers import device

    dev, world = device(), dist.get_world_size()
    skipped = _skipped(ops)
    ops = [op for op in ops if op not in skipped]
    largest = max((elements(op, s, world) for op in ops for s in sizes), default=1)
    # One buffer of the largest size and one shard, sliced per size (as nccl-tests).
    big = torch.zeros(largest, dtype=torch.float32, device=dev)
    small = torch.zeros(largest // world + 1, dtype=torch.float32, device=dev)
    clock = _Clock(torch, dist, dev)
    times = []
    try:
        for size in sizes:
            n = iters[size] if isinstance(iters, dict) else int(iters)
            for op in ops:
                count = elements(op, size, world)
                call = _calls(dist, op, big, small, count, world)
                found = [clock.time(call) for _ in range(warmup + n)][warmup:]
                times.append((op, count * _ITEM, found))
    finally:
        del big, small
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    return {
        "device": str(dev),
        "backend": dist.get_backend(),
        "world": world,
        "times": times,
        "skipped": skipped,
    }


def time_pairs(nbytes: int, iters: int, warmup: int) -> dict:
    """Seconds per bidirectional exchange of ``nbytes`` between rank 0 and each other rank.

    Both ranks of a pair send ``nbytes`` and receive ``nbytes`` at once
    (nccl-tests' sendrecv, both ways); the other ranks wait at the barrier.
    Pairs take turns within each iteration, so a burst of load from elsewhere
    hits every pair alike rather than one pair's whole series. Every rank must
    call it. Returns ``{"bytes", "times": {peer: [seconds, ...]}, "skipped"}``:
    times measured on this rank (empty unless it is rank 0 or the peer).
    """
    import torch
    import torch.distributed as dist

    from nbdist.engine.helpers import device

    dev, me, world = device(), dist.get_rank(), dist.get_world_size()
    skipped = _skipped(["sendrecv"])
    count = max(1, nbytes // _ITEM)
    times: dict[int, list[float]] = {}
    if skipped or world < 2:
        return {"bytes": count * _ITEM, "times": times, "skipped": skipped}
    send = torch.zeros(count, dtype=torch.float32, device=dev)
    recv = torch.zeros(count, dtype=torch.float32, device=dev)
    clock = _Clock(torch, dist, dev)

    def exchange(other: int):
        # One batch: NCCL posts both in one group, so neither side waits on the other's send.
        ops = [dist.P2POp(dist.isend, send, other), dist.P2POp(dist.irecv, recv, other)]
        return lambda: [work.wait() for work in dist.batch_isend_irecv(ops)]

    calls = {peer: exchange(peer if me == 0 else 0) for peer in range(1, world)}
    for i in range(warmup + iters):
        for peer in range(1, world):
            if me in (0, peer):
                took = clock.time(calls[peer])
                if i >= warmup:
                    times.setdefault(peer, []).append(took)
            else:
                clock.barrier()  # the pair's barrier, so every rank keeps in step
    return {"bytes": count * _ITEM, "times": times, "skipped": skipped}
