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
set here when the rank's device is the CPU: CPU ranks, or no GPU visible).

Gradient clipping is off unless asked for (``gradient_clipping=``): DeepSpeed's
own config default (1.0 in DeepSpeed 0.19) clips the global gradient norm
silently, so a ZeRO run would not update as the same torch optimizer does.

:func:`held_bytes` counts the tensor memory an engine holds on this rank, which
is what the stages differ in.

Example (on every rank)::

    from nbdist.strategies.parallel.deepspeed_zero import apply_deepspeed
    engine, opt = apply_deepspeed(net, stage=2, lr=1e-3, micro_batch_size=8)
    loss = loss_fn(engine(x), y)
    engine.backward(loss)   # scales, reduces/partitions the gradients
    engine.step()           # optimizer step on this rank's shard, zero_grad
"""

from __future__ import annotations

import collections
import gc
import os
import types
import warnings

import torch

from nbdist.strategies.measure import quiet_stderr_fd

__all__ = ["apply_deepspeed", "deepspeed_available", "held_bytes"]

_INSTALL = "pip install nbdist[deepspeed]"


def deepspeed_available() -> str | None:
    """``None`` when DeepSpeed imports here, else the reason (the import error) as text.

    On a rank it also picks DeepSpeed's accelerator for the rank's device, as
    :func:`apply_deepspeed` does; in the kernel (a test's collection) it leaves
    the environment alone, so ranks started later inherit nothing from it.
    """
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        _default_accelerator()
    try:
        import deepspeed  # noqa: F401
    except Exception as exc:  # an ImportError, or a failing accelerator probe inside deepspeed
        return f"{type(exc).__name__}: {exc}"
    return None


def _rank_device_type() -> str:
    from nbdist.engine.helpers import device

    return device().type if torch.cuda.is_available() else "cpu"


def _default_accelerator() -> None:
    # DeepSpeed picks its accelerator once, at import, from what it finds installed: on CPU
    # ranks (--cpu, or no GPU) it must be told "cpu", whose communication goes over the gloo
    # group nbdist made; left alone on a GPU machine it would move the model to a GPU.
    if "DS_ACCELERATOR" not in os.environ and _rank_device_type() == "cpu":
        os.environ["DS_ACCELERATOR"] = "cpu"


def _check_accelerator() -> None:
    from deepspeed.accelerator import get_accelerator

    chosen, mine = get_accelerator().device_name(), _rank_device_type()
    if chosen != mine:
        raise RuntimeError(
            f"DeepSpeed runs on its {chosen!r} accelerator but this rank's device is {mine!r}: "
            f"DeepSpeed was imported before apply_deepspeed with DS_ACCELERATOR="
            f"{os.environ.get('DS_ACCELERATOR')!r}; set DS_ACCELERATOR={mine} on the ranks "
            f"before the first `import deepspeed` (or restart them with %dist_restart)"
        )


def gpu_local_rank(device: torch.device, local_rank: str | None) -> str | None:
    """The ``LOCAL_RANK`` DeepSpeed needs on a rank whose device is ``device``; None: keep it.

    DeepSpeed takes ``LOCAL_RANK`` for the index of the rank's GPU: its engine calls
    ``set_device(LOCAL_RANK)`` and ZeRO-3 allocates on ``cuda:LOCAL_RANK``, at set-up
    and again in its first steps. That holds when local rank ``i`` has GPU ``i``;
    where ranks share a GPU (ranks 0 and 1 on ``cuda:0``) or run on other GPUs than
    their local ranks, it names a GPU that does not exist, or another rank's.
    """
    if device.type != "cuda" or device.index is None:
        return None
    wanted = str(device.index)
    return None if local_rank == wanted else wanted


def _point_local_rank_at_this_gpu() -> None:
    # nbdist's own local_rank() reads the rank's state, not this variable, so only code
    # that takes LOCAL_RANK for a GPU index (DeepSpeed) sees the change.
    from nbdist.engine.helpers import device

    value = gpu_local_rank(device(), os.environ.get("LOCAL_RANK"))
    if value is not None:
        os.environ["LOCAL_RANK"] = value


def _quiet_ops_probe() -> None:
    # On first use (in init_distributed) DeepSpeed probes which of its C++ ops could build by
    # compiling test programs; their linker errors ("cannot find -laio" without libaio) go to
    # fd 2, i.e. under the user's cell, and change nothing. Run the probe here, silenced.
    import deepspeed.ops

    if "__compatible_ops__" not in vars(deepspeed.ops):
        with quiet_stderr_fd():
            deepspeed.ops.__compatible_ops__  # noqa: B018 - computed and cached on first access


def _skip_shm_comm() -> None:
    # DeepSpeed's CPU communication backend builds its shared-memory all-reduce (a C++
    # extension: a compiler, Python's headers, OpenMP, about a minute the first time) when
    # the probe calls it compatible, and opens shared-memory segments between the host's
    # ranks. Only its inference_all_reduce uses it; ZeRO training goes through the gloo
    # group. Marked incompatible, DeepSpeed's backend goes without it.
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


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
    gradient_clipping: float = 0.0,
    offload_optimizer: bool = False,
    extra_config: dict | None = None,
):
    """Wrap ``model`` in a DeepSpeed engine with ZeRO ``stage``; return ``(engine, optimizer)``.

    ``optimizer_class(model.parameters(), lr=lr, **optimizer_kwargs)`` is built
    here and given to DeepSpeed (a plain torch optimizer: no C++ extension to
    compile). ``micro_batch_size`` is the batch one rank feeds per forward;
    DeepSpeed checks ``micro * accumulation * world_size`` against its
    ``train_batch_size``. ``gradient_clipping`` > 0 scales the gradients so
    their global norm is at most that value (as ``clip_grad_norm_``); 0, the
    default here, leaves them alone. ``offload_optimizer`` keeps optimizer state
    in CPU memory (ZeRO-Offload; stage >= 1). ``extra_config`` is merged last
    into the DeepSpeed config, a dict value into the dict already there (so
    ``{"zero_optimization": {"reduce_bucket_size": 2**20}}`` keeps the stage).

    On a GPU rank whose ``LOCAL_RANK`` is not its GPU's index (ranks sharing one
    GPU, or GPUs chosen with ``%dist_start --gpus``), ``LOCAL_RANK`` is set to that
    index, which is what DeepSpeed takes it for (:func:`gpu_local_rank`).

    From the first call on, this process ignores torch's FutureWarning about
    ``all_gather_into_tensor`` and ``reduce_scatter_tensor``, which DeepSpeed
    calls at every step.
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
    if not isinstance(gradient_clipping, (int, float)) or not gradient_clipping >= 0:
        raise ValueError(
            f"gradient_clipping must be a number >= 0 (the largest global gradient norm; "
            f"0 turns clipping off), got {gradient_clipping!r}"
        )
    from nbdist.strategies.arguments import require_numbers

    require_numbers("apply_deepspeed", lr=lr)
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
    _check_accelerator()
    _point_local_rank_at_this_gpu()
    _quiet_ops_probe()
    _skip_shm_comm()
    # DeepSpeed 0.19 calls these torch.distributed functions, deprecated in torch 2.13: a
    # FutureWarning under the cell at every step, about code the user did not write.
    warnings.filterwarnings(
        "ignore",
        message=r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated",
        category=FutureWarning,
    )

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
        # Explicit, because DeepSpeed's default clips at 1.0 where torch optimizers do not clip.
        "gradient_clipping": float(gradient_clipping),
        # DeepSpeed prints a progress line per step otherwise; nbdist.log is the channel for metrics.
        "steps_per_print": 2**31 - 1,
        # ZeRO steps any torch optimizer on the flat fp32 partition; DeepSpeed asserts
        # unless optimizers outside its tested list (Adam, Adagrad, ...) are allowed.
        "zero_allow_untested_optimizer": True,
    }
    for key, value in (extra_config or {}).items():
        if isinstance(value, dict) and isinstance(config.get(key), dict):
            config[key] = {**config[key], **value}
        else:
            config[key] = value
    optimizer = optimizer_class(model.parameters(), lr=lr, **(optimizer_kwargs or {}))
    # The group exists already (nbdist formed it); DeepSpeed's comm layer adopts it.
    deepspeed.init_distributed(dist_backend=dist.get_backend(), auto_mpi_discovery=False)
    engine, ds_optimizer, _, _ = deepspeed.initialize(
        model=model, optimizer=optimizer, config=config, dist_init_required=False
    )
    return engine, ds_optimizer


def held_bytes(engine) -> int:
    """Bytes of tensor memory ``engine`` holds on this rank (each storage counted once).

    Everything reachable from the engine's attributes: the model's parameters
    (under stage 3 this rank's slice; a gathered-then-freed parameter has an
    empty storage), their gradients, DeepSpeed's flat buffers and fp32 master
    partition, the optimizer state, communication buckets. Only containers,
    modules, optimizers and objects of torch's and DeepSpeed's own classes are
    followed: a logger or the shell an engine refers to would lead to the
    user's namespace (the data) or to other engines.

    Example::

        engine, opt = apply_deepspeed(net, stage=3, lr=1e-3)
        ...  # a training step, so the optimizer state exists
        held_bytes(engine) / 2**20   # MiB on this rank
    """
    storages: dict[tuple, int] = {}
    seen: set[int] = set()
    stack = [engine]
    while stack:
        obj = stack.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            if obj.device.type != "meta":
                storage = obj.untyped_storage()
                storages[(str(obj.device), storage.data_ptr())] = storage.nbytes()
            # A gradient lives in C++ (not a Python referent of its tensor); reading
            # .grad of a non-leaf warns, and non-leaves have none worth counting.
            if obj.is_leaf and obj.grad is not None:
                stack.append(obj.grad)
            stack.extend(gc.get_referents(obj))  # its __dict__: stage 3's ds_tensor
        elif isinstance(obj, types.FunctionType):
            # A hook's closure may hold buffers; its globals would reach everything.
            stack.extend(c.cell_contents for c in obj.__closure__ or () if _filled(c))
        elif _follow(obj):
            stack.extend(gc.get_referents(obj))
    return sum(storages.values())


_CONTAINERS = (dict, list, tuple, set, frozenset, collections.deque, types.MethodType)
_OWN_PACKAGES = {"torch", "deepspeed"}


def _follow(obj) -> bool:
    if isinstance(obj, _CONTAINERS + (torch.nn.Module, torch.optim.Optimizer)):
        return True
    return type(obj).__module__.partition(".")[0] in _OWN_PACKAGES


def _filled(cell) -> bool:
    try:
        _ = cell.cell_contents
    except ValueError:  # a closure variable not assigned yet
        return False
    return True
