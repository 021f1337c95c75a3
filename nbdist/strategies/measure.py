"""Rank side: measure what a training step costs: bytes communicated, peak tensor memory.

:class:`CommBytes` is a ``TorchDispatchMode`` that sees every
``torch.distributed`` collective and point-to-point op as it reaches the
dispatcher: DDP's C++ reducer, ZeroRedundancyOptimizer's broadcasts, FSDP2's
all-gathers and reduce-scatters, DTensor's functional collectives, pipeline
send/recv. Each op counts the largest tensor payload among its arguments and
result: the tensor all-reduced or broadcast, the full gathered tensor of an
all-gather, the full input of a reduce-scatter, the tensor sent or received
(on the wire a ring all-reduce moves about ``2 (n-1)/n`` times its payload).
Intercepting every op costs Python time: measure bytes and time in separate steps.

:func:`peak_bytes` runs one step and returns the highest tensor memory during
it: ``torch.cuda.max_memory_allocated`` on CUDA; on CPU (no allocator
statistics) the tensors alive before the step (``resident``) plus the highest
point of the step's allocations minus frees, from ``torch.profiler`` with
``profile_memory=True``. Persistent buffers other than those (DDP's gradient
buckets, a pipeline stage's receive buffers) are only seen on CUDA.

Example (on a rank)::

    from nbdist.strategies.measure import CommBytes, peak_bytes, resident_bytes
    with CommBytes() as comm:
        train_step()
    comm.bytes, comm.ops                      # e.g. 34464, {'allreduce_': 1}
    opt.zero_grad(set_to_none=True)
    peak_bytes(train_step, resident=resident_bytes(model.parameters(), opt))
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterable
from contextlib import contextmanager

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass

__all__ = [
    "CommBytes",
    "device_baseline",
    "local_bytes",
    "peak_bytes",
    "quiet_stderr_fd",
    "resident_bytes",
]

_COMM_NAMESPACES = {"c10d", "_c10d_functional", "_c10d_functional_autograd"}
_NOT_COMM = {"wait_tensor", "barrier", "monitored_barrier", "_wrap_tensor_autograd"}


def _tensor_bytes(obj) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, (list, tuple)):
        return sum(_tensor_bytes(o) for o in obj)
    return 0


class CommBytes(TorchDispatchMode):
    """Counts collective and point-to-point payload bytes on this rank (see the module docstring).

    Example::

        with CommBytes() as comm:
            loss_fn(ddp_model(x), y).backward()
        comm.bytes, comm.ops     # e.g. 4 * number of parameters, 1 bucket
    """

    def __init__(self) -> None:
        """Nothing counted yet; count from ``__enter__`` to ``__exit__``."""
        super().__init__()
        self.bytes = 0
        self.ops: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        """Run each op; count the payload of collectives and send/recv."""
        kwargs = kwargs or {}
        # A tensor subclass (DTensor) must first turn itself into plain ops and
        # collectives; those come back through this mode.
        if any(t is not torch.Tensor and t is not nn.Parameter for t in types):
            return NotImplemented
        out = func(*args, **kwargs)
        namespace = getattr(func, "namespace", "")
        packet = getattr(func, "overloadpacket", None)  # OpOverload -> e.g. allreduce_
        name = packet.__name__ if packet is not None else str(func)
        if namespace in _COMM_NAMESPACES and name not in _NOT_COMM:
            payload = max([_tensor_bytes(a) for a in args] + [_tensor_bytes(out)])
            self.bytes += payload
            self.ops[name] = self.ops.get(name, 0) + 1
        return out


@contextmanager
def quiet_stderr_fd():
    """Silence file descriptor 2 inside the block (C/C++ code's stderr); Python's ``sys.stderr`` is untouched.

    The profiler's C++ side (kineto) prints start/stop lines on fd 2, and DeepSpeed's
    op probes print linker errors there: a notebook would show them under the cell.
    """
    sys.stderr.flush()
    saved, devnull = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


def device_baseline(device: torch.device) -> list[int]:
    """Each rank's CUDA bytes in use before a plan is built (a collective; 0s on CPU).

    A plan's peak minus this is the plan's own: on CUDA ``max_memory_allocated``
    counts every tensor of the process, also the batches and whatever the caller
    keeps. The peak is reset here, so the plan's starts from this level.
    """
    import torch.distributed as dist

    world = dist.get_world_size()
    if device.type != "cuda":
        return [0] * world  # peak_bytes on CPU counts the plan's own tensors only
    # cuBLAS allocates its workspace at the first matmul and keeps it: make it part of
    # the baseline, then start a fresh peak for the plan.
    torch.ones(8, 8, device=device) @ torch.ones(8, 8, device=device)
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    bases = [0] * world
    dist.all_gather_object(bases, torch.cuda.memory_allocated(device))
    return bases


def peak_bytes(step: Callable[[], object], *, resident: int = 0, device=None) -> int:
    """Run ``step()`` once; the peak bytes of tensor memory on this rank during it.

    On CUDA: ``torch.cuda.max_memory_allocated`` since the last
    ``reset_peak_memory_stats`` (``resident`` is ignored: the allocator knows).
    On CPU: ``resident`` plus the profiler's highest allocation level in the step.

    Example::

        peak_bytes(lambda: loss_fn(model(x), y).backward(), resident=resident_bytes(model.parameters()))
    """
    dev = torch.device(device) if device is not None else None
    if dev is not None and dev.type == "cuda":
        step()
        torch.cuda.synchronize(dev)
        return torch.cuda.max_memory_allocated(dev)
    from torch.profiler import ProfilerActivity, profile

    prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
    # Quiet for the whole step: the profiler also warns from C++ about each
    # tensor allocated before it started and freed during the step.
    with quiet_stderr_fd():
        prof.start()
        try:
            step()
        finally:
            prof.stop()
    # The raw allocation records (every allocation and free, in time order):
    # the op-level events would net allocations and frees inside each op.
    records = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    deltas = sorted((e.start_ns(), e.nbytes()) for e in records if e.device_type().name == "CPU")
    live = peak = 0
    for _, delta in deltas:
        live += delta
        peak = max(peak, live)
    return resident + peak


def local_bytes(tensors: Iterable) -> int:
    """Bytes this rank stores for ``tensors``: a DTensor's local shard only; non-tensors count 0.

    Tensor subclasses that wrap others (DTensor, torchao's 8-bit states) count
    what they wrap.

    The one byte count behind :func:`resident_bytes`, ``fsdp.param_bytes``,
    ``tensor_parallel.local_param_bytes`` and ``optimizers.state_bytes``.

    Example::

        local_bytes(model.parameters())   # FSDP2: about 1/world_size of the full model
    """
    return sum(_stored_bytes(t) for t in tensors if isinstance(t, torch.Tensor))


def _stored_bytes(t: torch.Tensor) -> int:
    # A wrapper subclass stores only its inner tensors: a DTensor its local shard,
    # an 8-bit optimizer state (torchao) its uint8 codes and scales.
    if is_traceable_wrapper_subclass(t):
        names, _ = t.__tensor_flatten__()
        inner = (getattr(t, name) for name in names)  # DTensor lists its mesh here too
        return sum(_stored_bytes(x) for x in inner if isinstance(x, torch.Tensor))
    return t.numel() * t.element_size()


def resident_bytes(params: Iterable[torch.Tensor], optimizer=None) -> int:
    """Bytes of ``params``, their gradients and the optimizer's state on this rank (local shards).

    Example::

        resident_bytes(model.parameters(), opt)
    """
    params = list(params)
    state = []
    # ZeroRedundancyOptimizer keeps its shard's state in an inner optimizer.
    for opt in (optimizer, getattr(optimizer, "optim", None)):
        if isinstance(opt, torch.optim.Optimizer):
            state += [v for s in opt.state.values() for v in s.values()]
    grads = [p.grad for p in params if p.grad is not None]
    return local_bytes(params) + local_bytes(state) + local_bytes(grads)
