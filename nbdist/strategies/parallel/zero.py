"""Rank side: ZeRO stage 1: each rank keeps the optimizer state of only its share of the parameters.

:func:`zero_optimizer` wraps torch's ``ZeroRedundancyOptimizer``: every rank
still holds all parameters and gradients (train it under DDP as usual), but
Adam's ``exp_avg``/``exp_avg_sq`` exist for ``1/world_size`` of them; after
``step()`` each rank broadcasts the parameters it updated. Use it when the
optimizer state, not the model, is what does not fit (Adam: 2x the
parameters in fp32). :func:`optimizer_state_bytes` shows the saving.

Example (on every rank)::

    from nbdist.strategies.parallel.zero import zero_optimizer, optimizer_state_bytes
    model = DDP(net.to(device))
    opt = zero_optimizer(model.parameters(), torch.optim.Adam, lr=1e-3)
    ...  # the usual loop: loss.backward(); opt.step()
    print(optimizer_state_bytes(opt))  # about 1/world_size of plain Adam's
"""

from __future__ import annotations

import torch

__all__ = ["optimizer_state_bytes", "zero_optimizer"]


def zero_optimizer(params, optimizer_class=torch.optim.Adam, *, overlap_with_ddp=False, **defaults):
    """A ``ZeroRedundancyOptimizer`` sharding ``optimizer_class``'s state over the ranks.

    ``params`` is an iterable of parameters (e.g. ``model.parameters()``);
    ``defaults`` go to ``optimizer_class`` (``lr=...``). Needs an initialised
    process group (``%dist_start`` made one).
    """
    import torch.distributed as dist
    from torch.distributed.optim import ZeroRedundancyOptimizer

    from nbdist.engine.backend_support import require
    from nbdist.strategies.arguments import require_numbers, require_params

    require_params(params, "zero_optimizer")
    # "1e-3" from a config file would fail inside torch's optimizer as "'<=' not supported";
    # a tensor lr is torch's own (capturable) choice and stays allowed.
    hyper = ("lr", "eps", "weight_decay", "momentum")
    require_numbers(
        "zero_optimizer",
        **{k: v for k, v in defaults.items() if k in hyper and not isinstance(v, torch.Tensor)},
    )

    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            "zero_optimizer needs a torch.distributed process group: call it on the ranks "
            "(in a %%on_all_ranks cell after %dist_start), not in the notebook kernel"
        )
    # It broadcasts each rank's updated shard to the others after every step.
    require("ZeRO (zero_optimizer)", ("broadcast",))
    if not (
        isinstance(optimizer_class, type) and issubclass(optimizer_class, torch.optim.Optimizer)
    ):
        raise TypeError(
            f"optimizer_class must be a torch.optim.Optimizer subclass such as torch.optim.Adam, "
            f"got {optimizer_class!r}"
        )
    return ZeroRedundancyOptimizer(
        list(params),
        optimizer_class=optimizer_class,
        overlap_with_ddp=overlap_with_ddp,
        **defaults,
    )


def optimizer_state_bytes(optimizer) -> int:
    """Bytes of optimizer state held by this rank (tensors in ``optimizer.state``).

    For a ``ZeroRedundancyOptimizer`` this is the local shard only (its
    ``optim`` attribute), so compare it with a plain optimizer's figure.
    """
    from nbdist.strategies.optim.optimizers import state_bytes

    # ZeroRedundancyOptimizer.state mirrors all ranks' keys after consolidation;
    # the local optimizer holds what this rank really keeps.
    return state_bytes(getattr(optimizer, "optim", optimizer))
