"""Rank side: Horovod's data-parallel recipe with ``torch.distributed`` alone.

Horovod (Sergeev & Del Balso 2018) made data parallelism a two-line change to a
single-process script::

    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())

The optimizer wrapper starts an all-reduce of each gradient *as soon as backward
has produced it* (a hook per parameter), so communication of late layers
overlaps the backward pass of early ones, and ``step()`` waits for all of them
and averages before updating. This module does the same with
``torch.distributed`` (any backend: gloo on CPU, NCCL on GPUs), for code written
in Horovod's style or as a readable model of what DDP's C++ reducer does
(DDP adds gradient bucketing on top). Horovod itself (0.28.1, 2023) no longer
builds against current PyTorch without patches.

Example::

    from nbdist.strategies.horovod import DistributedOptimizer, broadcast_parameters
    broadcast_parameters(model.state_dict(), root_rank=0)
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                               named_parameters=model.named_parameters())
    loss_fn(model(x), y).backward()      # all-reduces start here, one per gradient
    opt.step()                           # waits, averages, updates
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["DistributedOptimizer", "broadcast_optimizer_state", "broadcast_parameters"]


def _broadcast(tensor: torch.Tensor, root_rank: int) -> None:
    # NCCL moves only GPU tensors; CPU ones (Adam's step counters) go through the GPU.
    if tensor.device.type == "cpu" and dist.get_backend() == "nccl":
        staged = tensor.cuda()
        dist.broadcast(staged, root_rank)
        tensor.copy_(staged)
    else:
        dist.broadcast(tensor, root_rank)


def broadcast_parameters(params, root_rank: int = 0) -> None:
    """Copy ``root_rank``'s tensors to every rank, in place.

    ``params``: a ``state_dict()``, ``named_parameters()`` or a list of tensors,
    the same order on every rank. Call once before training so every rank starts
    from the same weights.

    Example::

        broadcast_parameters(model.state_dict(), root_rank=0)
    """
    items = params.values() if isinstance(params, dict) else params
    with torch.no_grad():
        for item in items:
            tensor = item[1] if isinstance(item, tuple) else item
            _broadcast(tensor.data if isinstance(tensor, nn.Parameter) else tensor, root_rank)


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root_rank: int = 0) -> None:
    """Copy ``root_rank``'s optimizer state tensors (momentum, moments) to every rank.

    Needed after loading a checkpoint on one rank only; the state must already
    exist with the same shapes on every rank (e.g. after one step).

    Example::

        broadcast_optimizer_state(opt, root_rank=0)
    """
    for group in optimizer.param_groups:
        for p in group["params"]:
            for _, value in sorted(optimizer.state.get(p, {}).items()):
                if isinstance(value, torch.Tensor):
                    _broadcast(value, root_rank)


class _GradientAverager:
    """The hooks and pending all-reduces behind :func:`DistributedOptimizer`."""

    def __init__(self, params: list[nn.Parameter], group) -> None:
        self.group = group
        self.world = dist.get_world_size(group)
        self.pending: dict[nn.Parameter, dist.Work] = {}
        self.params = params
        self.reduced_count = 0  # all-reduces launched by the hooks since construction
        self.handles = [p.register_post_accumulate_grad_hook(self._launch) for p in params]

    def _launch(self, param: nn.Parameter) -> None:
        # Runs inside backward, the moment this gradient is complete: the
        # all-reduce proceeds while autograd computes the earlier layers.
        if param in self.pending:
            raise RuntimeError(
                "a gradient was produced twice before optimizer.step(): gradient "
                "accumulation over several backward passes is not supported by "
                "DistributedOptimizer; call step() after each backward()"
            )
        self.pending[param] = dist.all_reduce(param.grad, group=self.group, async_op=True)
        self.reduced_count += 1

    def synchronize(self) -> None:
        # Every rank must reduce the same gradients in the same order; a
        # parameter whose hook did not fire (no grad this step) is skipped on all
        # ranks alike only if the model is used identically everywhere.
        for param, work in self.pending.items():
            work.wait()
            param.grad.div_(self.world)
        self.pending.clear()

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def DistributedOptimizer(
    optimizer: torch.optim.Optimizer, named_parameters=None, *, group=None
) -> torch.optim.Optimizer:
    """Make ``optimizer`` average gradients over the ranks, all-reducing during backward.

    Returns the same optimizer object (so LR schedulers and ``state_dict`` keep
    working) with a hook on each of its parameters that launches an asynchronous
    all-reduce when the parameter's gradient is ready, and a step pre-hook that
    waits for them and divides by the world size. ``named_parameters`` is
    accepted for Horovod's call shape and ignored (the optimizer's own
    parameters are the ones averaged). ``optimizer.synchronize()`` waits without
    stepping (e.g. before gradient clipping); ``optimizer.remove_hooks()`` undoes it.

    Example::

        opt = DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=1e-3))
        loss.backward(); torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # after synchronize()
    """
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            "DistributedOptimizer needs a process group: run it on the ranks (%%on_all_ranks) "
            "or call torch.distributed.init_process_group first"
        )
    if getattr(optimizer, "nbdist_averager", None) is not None:
        raise ValueError("this optimizer is already a DistributedOptimizer")
    params = [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad]
    if len({id(p) for p in params}) != len(params):
        raise ValueError("a parameter appears twice in the optimizer's param groups")
    averager = _GradientAverager(params, group)
    pre_step = optimizer.register_step_pre_hook(lambda opt, args, kwargs: averager.synchronize())

    def remove_hooks() -> None:
        averager.remove()
        pre_step.remove()
        optimizer.nbdist_averager = None

    optimizer.nbdist_averager = averager
    optimizer.synchronize = averager.synchronize
    optimizer.remove_hooks = remove_hooks
    return optimizer
