"""Rank side: ``torch.compile`` on every rank, and a fair timer for eager vs compiled steps.

``torch.compile`` traces the model into a graph and lets TorchInductor fuse
chains of element-wise operations (bias add, GELU, normalisation, the
optimizer's arithmetic...) into a few generated kernels (C++/OpenMP on CPU,
Triton on GPUs), so fewer passes over memory and fewer Python dispatches per
step. Each rank compiles its own copy; the first steps pay the compile time
(seconds to minutes), later steps run the fused code.

:func:`compile_ddp` compiles the module and wraps it in DDP (gradients still
averaged by DDP's reducer). For large models ``torch.compile(DDP(model))`` is the
alternative: Dynamo then splits the graph at DDP's bucket boundaries so
all-reduces overlap the compiled backward. :func:`step_times` times steps the
same way for both versions (barrier first, device synchronised).

Example (on every rank)::

    from nbdist.strategies.training.compile import compile_ddp, step_times
    model = compile_ddp(Net().to(device))
    times = step_times(lambda: train_step(model), steps=20, warmup=3)  # warmup compiles
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch
from torch import nn

__all__ = ["compile_ddp", "median_ms", "step_times"]


def compile_ddp(
    model: nn.Module, *, example: tuple | None = None, ddp: bool = True, **compile_kwargs
) -> nn.Module:
    """``DDP(torch.compile(model, **compile_kwargs))`` (without DDP when ``ddp=False``).

    The model must already be on this rank's device. Without ``example``,
    compilation happens at the first forward and backward, on every rank at
    once. With ``example`` (a tuple of inputs of the training shapes), rank 0
    compiles first (one forward and backward, gradients then cleared) and the
    other ranks follow, finding the generated code in TorchInductor's on-disk
    cache: one compilation's CPU time instead of one per rank, which matters when
    ranks share a machine's cores.

    Example::

        model = compile_ddp(Net().to(nbdist.device()), example=(x[:1],))
    """
    from nbdist.strategies.arguments import require_module

    require_module(model, "compile_ddp")
    compiled = torch.compile(model, **compile_kwargs)
    if example is not None:
        from nbdist.engine.helpers import rank_zero_first

        # No collective may run inside: rank 0 is alone in this block.
        with rank_zero_first():
            out = compiled(*example)
            (out if isinstance(out, torch.Tensor) else out[0]).float().sum().backward()
            model.zero_grad(set_to_none=True)
    if not ddp:
        return compiled
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            "compile_ddp(ddp=True) needs a process group: run it on the ranks "
            "(%%on_all_ranks), or pass ddp=False for a single process"
        )
    return DDP(compiled)


def _sync() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def step_times(step: Callable[[], object], *, steps: int, warmup: int = 1) -> list[float]:
    """Seconds per call of ``step()``, after ``warmup`` untimed calls.

    Starts with a barrier (when a process group exists) so ranks begin together,
    and synchronises CUDA around each call: GPU kernels run asynchronously and
    an unsynchronised timer measures only the launch.

    Example::

        ms = median_ms(step_times(lambda: train_step(model), steps=20, warmup=2))
    """
    if steps < 1 or warmup < 0:
        raise ValueError(f"steps ({steps}) must be >= 1 and warmup ({warmup}) >= 0")
    import torch.distributed as dist

    for _ in range(warmup):
        step()
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
    times = []
    for _ in range(steps):
        _sync()
        t0 = time.perf_counter()
        step()
        _sync()
        times.append(time.perf_counter() - t0)
    return times


def median_ms(times: list[float]) -> float:
    """The median of ``times`` (seconds) in milliseconds: robust to a slow outlier step.

    Example::

        median_ms([0.010, 0.011, 0.5])   # 11.0
    """
    return 1000 * statistics.median(times)
