"""Rank side: DeepSpeed ZeRO stage 1/2/3 through ``deepspeed.initialize`` on nbdist's ranks.

ZeRO partitions training state over the data-parallel ranks: stage 1 the
optimizer state (Adam's two moments), stage 2 also the gradients (reduce-
scatter instead of all-reduce), stage 3 also the parameters themselves
(gathered layer by layer for forward and backward, freed afterwards). Memory
per rank falls towards ``1/world_size`` of the state; stage 3 pays an extra
all-gather of the parameters in both forward and backward.

:func:`apply_deepspeed` builds the config dict from explicit keyword
arguments and hands the model to DeepSpeed, which joins the process group
nbdist already formed (a rank carries torchrun's environment). On CPU
DeepSpeed's CPU accelerator talks over the gloo group (``DS_ACCELERATOR=cpu``,
set here when no GPU is visible).

Example (on every rank)::

    from nbdist.strategies.deepspeed_zero import apply_deepspeed
    engine, opt = apply_deepspeed(net, stage=2, lr=1e-3, micro_batch_size=8)
    loss = loss_fn(engine(x), y)
    engine.backward(loss)   # scales, reduces/partitions the gradients
    engine.step()           # optimizer step on this rank's shard, zero_grad
"""

from __future__ import annotations

import os

import torch

__all__ = ["apply_deepspeed", "deepspeed_available"]

_INSTALL = "pip install nbdist[deepspeed]"


def deepspeed_available() -> str | None:
    """``None`` when DeepSpeed imports here, else the reason (the import error) as text."""
    _default_accelerator()
    try:
        import deepspeed  # noqa: F401
    except Exception as exc:  # an ImportError, or a failing accelerator probe inside deepspeed
        return f"{type(exc).__name__}: {exc}"
    return None


def _default_accelerator() -> None:
    # DeepSpeed picks its accelerator at import; without CUDA it must be told "cpu",
    # whose communication backend is the gloo group nbdist made.
    if "DS_ACCELERATOR" not in os.environ and not torch.cuda.is_available():
        os.environ["DS_ACCELERATOR"] = "cpu"


def apply_deepspeed(
    model: torch.nn.Module,
    *,
    stage: int,
    lr: float,
    micro_batch_size: int = 1,
    grad_accumulation_steps: int = 1,
    optimizer_class=torch.optim.Adam,
    optimizer_kwargs: dict | None = None,
    bf16: bool = False,
    offload_optimizer: bool = False,
    extra_config: dict | None = None,
):
    """Wrap ``model`` in a DeepSpeed engine with ZeRO ``stage``; return ``(engine, optimizer)``.

    ``optimizer_class(model.parameters(), lr=lr, **optimizer_kwargs)`` is built
    here and given to DeepSpeed (a plain torch optimizer: no C++ extension to
    compile). ``micro_batch_size`` is the batch one rank feeds per forward;
    DeepSpeed checks ``micro * accumulation * world_size`` against its
    ``train_batch_size``. ``offload_optimizer`` keeps optimizer state in CPU
    memory (ZeRO-Offload; stage >= 1). ``extra_config`` is merged last into the
    DeepSpeed config for keys not covered here.
    """
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"stage must be 0, 1, 2 or 3 (ZeRO stage), got {stage!r}")
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    for name, value in (
        ("micro_batch_size", micro_batch_size),
        ("grad_accumulation_steps", grad_accumulation_steps),
    ):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if not (
        isinstance(optimizer_class, type) and issubclass(optimizer_class, torch.optim.Optimizer)
    ):
        raise TypeError(
            f"optimizer_class must be a torch.optim.Optimizer subclass such as torch.optim.Adam, "
            f"got {optimizer_class!r}"
        )
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            "apply_deepspeed needs a torch.distributed process group: call it on the ranks "
            "(in a %%on_all_ranks cell after %dist_start), not in the notebook kernel"
        )
    _default_accelerator()
    try:
        import deepspeed
    except ImportError as exc:
        raise ImportError(f"apply_deepspeed needs DeepSpeed ({exc}): {_INSTALL}") from exc

    zero: dict = {"stage": stage}
    if offload_optimizer:
        if stage == 0:
            raise ValueError(
                "offload_optimizer=True needs stage >= 1 (ZeRO-Offload partitions the state)"
            )
        zero["offload_optimizer"] = {"device": "cpu"}
    config = {
        "train_micro_batch_size_per_gpu": micro_batch_size,
        "gradient_accumulation_steps": grad_accumulation_steps,
        "zero_optimization": zero,
        "bf16": {"enabled": bool(bf16)},
        # DeepSpeed prints a progress line per step otherwise; nbdist.log is the channel for metrics.
        "steps_per_print": 2**31 - 1,
        # ZeRO steps any torch optimizer on the flat fp32 partition; DeepSpeed asserts
        # unless optimizers outside its tested list (Adam, Adagrad, ...) are allowed.
        "zero_allow_untested_optimizer": True,
    }
    config.update(extra_config or {})
    optimizer = optimizer_class(model.parameters(), lr=lr, **(optimizer_kwargs or {}))
    # The group exists already (nbdist formed it); DeepSpeed's comm layer adopts it.
    deepspeed.init_distributed(dist_backend=dist.get_backend(), auto_mpi_discovery=False)
    engine, ds_optimizer, _, _ = deepspeed.initialize(
        model=model, optimizer=optimizer, config=config, dist_init_required=False
    )
    return engine, ds_optimizer
