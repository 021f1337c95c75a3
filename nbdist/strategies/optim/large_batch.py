"""Rank side: large-batch training: scale the learning rate with the global batch, warm it up.

Data parallelism multiplies the global batch by the number of ranks. Goyal et
al. 2017 ("Accurate, Large Minibatch SGD: Training ImageNet in 1 Hour") keep the
accuracy of a small-batch recipe by two rules:

- **linear scaling**: multiply the learning rate by ``global_batch / base_batch``
  (:func:`scaled_lr`); for Adam-like optimizers a square-root rule is common
  (``rule="sqrt"``);
- **warmup**: start far below that rate and ramp linearly over the first steps,
  because early gradients are large and the scaled rate would diverge
  (:func:`warmup_schedule`, optionally followed by a cosine decay).

Past a few thousand samples per step, layer-wise optimizers help further
(:class:`~nbdist.strategies.optim.optimizers.LARS`, :class:`~nbdist.strategies.optim.optimizers.LAMB`).

Example::

    from nbdist.strategies.optim.large_batch import global_batch, scaled_lr, warmup_schedule
    lr = scaled_lr(0.1, global_batch(64), base_batch=256)   # 64 per rank
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    sched = warmup_schedule(opt, warmup_steps=100, total_steps=1000)
    for step in range(1000):
        ...; opt.step(); sched.step()
"""

from __future__ import annotations

import math

import torch

__all__ = ["global_batch", "scaled_lr", "warmup_factor", "warmup_schedule"]


def global_batch(per_rank_batch: int, *, accumulation_steps: int = 1) -> int:
    """Samples per optimizer step over all ranks: ``per_rank_batch * world_size * accumulation``.

    Example::

        global_batch(64)   # 128 on 2 ranks
    """
    import torch.distributed as dist

    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    if per_rank_batch < 1 or accumulation_steps < 1:
        raise ValueError(
            f"per_rank_batch ({per_rank_batch}) and accumulation_steps ({accumulation_steps}) "
            "must be at least 1"
        )
    return per_rank_batch * world * accumulation_steps


def scaled_lr(
    base_lr: float, batch_size: int, *, base_batch: int = 256, rule: str = "linear"
) -> float:
    """The learning rate for ``batch_size`` given one tuned at ``base_batch``.

    ``rule="linear"``: ``base_lr * batch_size / base_batch`` (Goyal et al., for SGD);
    ``rule="sqrt"``: ``base_lr * sqrt(batch_size / base_batch)`` (common for Adam/LAMB).

    Example::

        scaled_lr(0.1, 1024)                 # 0.4
        scaled_lr(1e-3, 1024, rule="sqrt")   # 0.002
    """
    from nbdist.strategies.arguments import require_numbers

    require_numbers("scaled_lr", base_lr=base_lr, batch_size=batch_size, base_batch=base_batch)
    if base_lr <= 0 or batch_size < 1 or base_batch < 1:
        raise ValueError(
            f"scaled_lr needs base_lr > 0 and batch sizes >= 1; got base_lr={base_lr}, "
            f"batch_size={batch_size}, base_batch={base_batch}"
        )
    ratio = batch_size / base_batch
    if rule == "linear":
        return base_lr * ratio
    if rule == "sqrt":
        return base_lr * math.sqrt(ratio)
    raise ValueError(f"rule={rule!r} is not known; use 'linear' or 'sqrt'")


def warmup_factor(
    step: int, *, warmup_steps: int, total_steps: int | None = None, start: float = 0.0
) -> float:
    """The multiplier of the peak learning rate at ``step`` (0-based).

    Linear from ``start`` to 1 over ``warmup_steps`` steps (it reaches 1 at step
    ``warmup_steps``), then constant, or a cosine decay to 0 at ``total_steps``.

    Example::

        [warmup_factor(s, warmup_steps=4) for s in range(6)]  # [0.0, 0.25, 0.5, 0.75, 1.0, 1.0]
    """
    if warmup_steps < 0 or not 0.0 <= start <= 1.0:
        raise ValueError(
            f"warmup_steps ({warmup_steps}) must be >= 0 and start ({start}) in [0, 1]"
        )
    if total_steps is not None and total_steps <= warmup_steps:
        raise ValueError(
            f"total_steps ({total_steps}) must be larger than warmup_steps ({warmup_steps})"
        )
    if step < warmup_steps:
        return start + (1.0 - start) * step / warmup_steps
    if total_steps is None:
        return 1.0
    progress = min(1.0, (step - warmup_steps) / (total_steps - warmup_steps))
    return 0.5 * (1.0 + math.cos(math.pi * progress))


def warmup_schedule(
    optimizer: torch.optim.Optimizer,
    *,
    warmup_steps: int,
    total_steps: int | None = None,
    start: float = 0.0,
) -> torch.optim.lr_scheduler.LambdaLR:
    """A ``LambdaLR`` applying :func:`warmup_factor` to every param group's rate.

    Call ``scheduler.step()`` after each ``optimizer.step()``.

    Example::

        sched = warmup_schedule(opt, warmup_steps=50, total_steps=500)
    """
    from nbdist.strategies.arguments import require_optimizer

    require_optimizer(optimizer, "warmup_schedule")
    # Validate now, not at the first scheduler step deep inside the loop.
    warmup_factor(0, warmup_steps=warmup_steps, total_steps=total_steps, start=start)
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda step: warmup_factor(
            step, warmup_steps=warmup_steps, total_steps=total_steps, start=start
        ),
    )
