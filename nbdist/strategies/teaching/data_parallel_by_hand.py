"""Rank side: data parallelism by hand, to read: split a batch, all-reduce via rank 0, then over a ring.

The pieces DDP hides, written with plain ``torch.distributed`` point-to-point calls
(after "Dive into Deep Learning", section 13.5, with processes instead of devices):

- :func:`split_batch` gives this rank its share of a batch;
- :func:`all_reduce_via_rank0` is the obvious all-reduce: every rank sends its tensor to
  rank 0, which sums and sends the result back (rank 0 moves ``2 (n-1)`` tensors);
- :func:`ring_all_reduce` is the bandwidth-optimal one: a reduce-scatter then an
  all-gather around a ring, each rank sending ``2 (n-1) / n`` of the tensor whatever ``n``;
- :func:`broadcast_model` and :func:`average_gradients` make a training step.

Example (on every rank)::

    from nbdist.strategies.teaching import data_parallel_by_hand as by_hand
    by_hand.broadcast_model(model)               # same start everywhere
    x, y = by_hand.split_batch(X, Y)             # this rank's rows
    loss_fn(model(x), y).backward()
    by_hand.average_gradients(model, all_reduce=by_hand.ring_all_reduce)
    opt.step()

They run on gloo (CPU) and NCCL (GPU); tensors must sit on the backend's device.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as _c10d

__all__ = [
    "all_reduce_via_rank0",
    "average_gradients",
    "broadcast_model",
    "ring_all_reduce",
    "split_batch",
]


def _group_info(group) -> tuple[int, int]:
    if not dist.is_initialized():
        raise RuntimeError(
            "torch.distributed is not initialised: run this inside %%on_all_ranks "
            "(after %dist_start) or after dist.init_process_group(...)"
        )
    return dist.get_rank(group), dist.get_world_size(group)


def _global(group, rank: int) -> int:
    # send/recv take global ranks; the ring is laid out in group ranks.
    return rank if group is None else dist.get_global_rank(group, rank)


def split_batch(*tensors: torch.Tensor, rank: int | None = None, world_size: int | None = None):
    """This rank's contiguous share of each tensor along dim 0 (sizes differ by at most 1).

    Example: with 2 ranks and a batch of 5 rows, rank 0 gets rows 0-2 and rank 1 rows 3-4::

        x, y = split_batch(X, Y)

    Returns one tensor for one argument, else a tuple. ``rank``/``world_size`` default to
    the process group's (or 0/1 without one).
    """
    if not tensors:
        raise TypeError("split_batch() needs at least one tensor, e.g. split_batch(X, Y)")
    if rank is None or world_size is None:
        initialised = dist.is_initialized()
        rank = (dist.get_rank() if initialised else 0) if rank is None else rank
        world_size = (
            (dist.get_world_size() if initialised else 1) if world_size is None else world_size
        )
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in range(world_size={world_size})")
    n = len(tensors[0])
    if any(len(t) != n for t in tensors):
        raise ValueError(f"tensors differ in length along dim 0: {[len(t) for t in tensors]}")
    parts = tuple(t.tensor_split(world_size)[rank] for t in tensors)
    return parts[0] if len(parts) == 1 else parts


def all_reduce_via_rank0(tensor: torch.Tensor, *, group=None) -> torch.Tensor:
    """Sum ``tensor`` over ranks, in place, through rank 0 (gather, add, send back).

    Simple and correct, but rank 0 receives and sends ``n - 1`` whole tensors: its link
    is the bottleneck, and the time grows with the number of ranks.
    """
    me, n = _group_info(group)
    if n == 1:
        return tensor
    buf = tensor.detach().contiguous()
    if me == 0:
        incoming = torch.empty_like(buf)
        for src in range(1, n):
            dist.recv(incoming, src=_global(group, src), group=group)
            buf += incoming
        for dst in range(1, n):
            dist.send(buf, dst=_global(group, dst), group=group)
    else:
        dist.send(buf, dst=_global(group, 0), group=group)
        dist.recv(buf, src=_global(group, 0), group=group)
    if buf.data_ptr() != tensor.data_ptr():
        tensor.copy_(buf)
    return tensor


def ring_all_reduce(tensor: torch.Tensor, *, group=None) -> torch.Tensor:
    """Sum ``tensor`` over ranks, in place, with a ring of send/recv (what NCCL and gloo do).

    The flattened tensor is cut into ``n`` chunks. Reduce-scatter: in ``n - 1`` steps each
    rank sends one chunk to its right neighbour and adds the chunk coming from its left,
    after which rank ``r`` holds the full sum of chunk ``(r + 1) % n``. All-gather: in
    ``n - 1`` more steps the finished chunks travel around the ring. Each rank sends
    ``2 (n - 1) / n`` tensor sizes in total, independent of ``n``.

    Example::

        t = torch.randn(1000)
        expected = t.clone(); dist.all_reduce(expected)
        ring_all_reduce(t)
        torch.testing.assert_close(t, expected)
    """
    me, n = _group_info(group)
    if n == 1:
        return tensor
    flat = tensor.detach().reshape(-1).clone()
    # Pad to a multiple of n so every chunk has the same size (and none is empty).
    size = -(-flat.numel() // n)
    padded = torch.zeros(size * n, dtype=flat.dtype, device=flat.device)
    padded[: flat.numel()] = flat
    chunks = list(padded.split(size))
    right, left = _global(group, (me + 1) % n), _global(group, (me - 1) % n)
    incoming = torch.empty_like(chunks[0])

    def exchange(send_chunk: torch.Tensor) -> None:
        # Post both sides at once: a blocking send before the matching recv could deadlock.
        # P2POp accepts only c10d's own isend/irecv, not wrappers installed on `dist`.
        reqs = dist.batch_isend_irecv(
            [
                dist.P2POp(_c10d.isend, send_chunk, right, group),
                dist.P2POp(_c10d.irecv, incoming, left, group),
            ]
        )
        for req in reqs:
            req.wait()

    for step in range(n - 1):  # reduce-scatter
        exchange(chunks[(me - step) % n])
        chunks[(me - step - 1) % n] += incoming
    for step in range(n - 1):  # all-gather
        exchange(chunks[(me + 1 - step) % n])
        chunks[(me - step) % n].copy_(incoming)
    tensor.copy_(padded[: flat.numel()].view_as(tensor))
    return tensor


def broadcast_model(model: torch.nn.Module, *, src: int = 0, group=None) -> None:
    """Copy rank ``src``'s parameters and buffers to every rank (what DDP does at wrap time)."""
    _group_info(group)
    with torch.no_grad():
        for t in [*model.parameters(), *model.buffers()]:
            dist.broadcast(t.data, src=src, group=group)


def average_gradients(
    model: torch.nn.Module | Iterable[torch.Tensor],
    *,
    all_reduce: Callable[..., torch.Tensor] | None = None,
    group=None,
) -> None:
    """Replace each parameter's gradient by its mean over ranks (call after ``backward()``).

    ``all_reduce`` is any in-place sum (default :func:`ring_all_reduce`; try
    :func:`all_reduce_via_rank0` or ``dist.all_reduce``). Gradients are flattened into one
    buffer first, as DDP's buckets do, so there is one collective per call, not one per
    parameter.
    """
    _, n = _group_info(group)
    params = model.parameters() if isinstance(model, torch.nn.Module) else model
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        raise ValueError("no parameter has a gradient: call loss.backward() first")
    reduce = ring_all_reduce if all_reduce is None else all_reduce
    flat = torch.cat([g.reshape(-1) for g in grads])
    if reduce is dist.all_reduce:
        dist.all_reduce(flat, group=group)
    else:
        reduce(flat, group=group)
    flat /= n
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()
