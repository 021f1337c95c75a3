"""Rank side: gradient accumulation under DDP: skip the all-reduce of all but the last micro-batch.

To train with a batch ``K`` times larger than fits in memory, run ``K`` micro-batches
and step once. Under DDP every ``backward()`` all-reduces the gradients, which is
wasted work on the first ``K - 1`` micro-batches: ``model.no_sync()`` keeps their
gradients local (they still add up in ``.grad``) and the last ``backward()`` reduces
the sum once. Scale each micro-batch's loss by ``1 / K`` and the step equals one step
on the ``K``-times batch.

Example (on every rank)::

    from nbdist.strategies.parallel.accumulation import accumulate, AllReduceCounter
    counter = AllReduceCounter(ddp_model)               # optional: count the all-reduces
    for i, (x, y) in enumerate(micro_batches):
        with accumulate(ddp_model, i, every=K):
            (loss_fn(ddp_model(x), y) / K).backward()
        if (i + 1) % K == 0:
            opt.step()
            opt.zero_grad()
    print(counter.calls)                                 # buckets reduced: 1 per K micro-batches
"""

from __future__ import annotations

from contextlib import nullcontext

import torch
import torch.distributed as dist

__all__ = ["AllReduceCounter", "accumulate", "is_sync_step"]


def is_sync_step(micro_step: int, every: int) -> bool:
    """True for the micro-batch whose ``backward()`` must all-reduce (the last of each group).

    >>> [is_sync_step(i, 3) for i in range(6)]
    [False, False, True, False, False, True]
    """
    from nbdist.strategies.arguments import require_whole

    require_whole("accumulate", micro_step=micro_step, every=every)
    if every < 1:
        raise ValueError(f"every={every} micro-batches per step: it must be >= 1")
    if micro_step < 0:
        raise ValueError(f"micro_step={micro_step} must be >= 0 (count from 0)")
    return (micro_step + 1) % every == 0


def accumulate(model: torch.nn.Module, micro_step: int, every: int):
    """Context for one micro-batch's forward and backward: ``model.no_sync()`` unless it is
    the last of a group of ``every``.

    A model without ``no_sync`` (not wrapped in DDP, e.g. one rank) accumulates locally
    anyway, so it gets a context that does nothing. Run the forward inside the context
    too: DDP decides at forward time whether the next backward reduces.
    """
    if is_sync_step(micro_step, every) or not hasattr(model, "no_sync"):
        return nullcontext()
    return model.no_sync()


class AllReduceCounter:
    """Counts the gradient all-reduces a DDP model launches (a DDP communication hook).

    ``calls`` is the number of gradient buckets reduced and ``bytes`` their size; the
    reduction itself is DDP's default (sum, then divide by the world size). Register it
    before the first ``backward()``: DDP accepts one hook per model.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        """Count the all-reduces of ``model`` (a ``DistributedDataParallel``) by registering a hook."""
        if not hasattr(model, "register_comm_hook"):
            raise TypeError(
                f"{type(model).__name__} is not a DistributedDataParallel model: "
                "wrap it first, e.g. AllReduceCounter(DDP(model))"
            )
        self.calls = 0
        self.bytes = 0
        self.group = getattr(model, "process_group", None)
        model.register_comm_hook(self, AllReduceCounter._hook)

    def reset(self) -> None:
        """Start counting from zero."""
        self.calls = 0
        self.bytes = 0

    @staticmethod
    # No annotations: DDP checks a hook's return annotation, which `from __future__ import
    # annotations` would turn into a string.
    def _hook(state, bucket):
        buffer = bucket.buffer()
        state.calls += 1
        state.bytes += buffer.numel() * buffer.element_size()
        buffer.div_(dist.get_world_size(state.group))
        work = dist.all_reduce(buffer, group=state.group, async_op=True)
        return work.get_future().then(lambda fut: fut.value()[0])

    def __repr__(self) -> str:
        """``AllReduceCounter(calls=..., bytes=...)``."""
        return f"AllReduceCounter(calls={self.calls}, bytes={self.bytes})"
