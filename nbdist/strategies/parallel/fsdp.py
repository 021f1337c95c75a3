"""Rank side: fully sharded data parallel (FSDP2, ``torch.distributed.fsdp.fully_shard``).

Like DDP, every rank trains on its own batch; unlike DDP, each rank stores
only ``1/world_size`` of every parameter, gradient and optimizer state. A
block's full weights are all-gathered just before its forward (and backward)
and freed right after; gradients are reduce-scattered. Use it when the model
plus Adam's state does not fit one device; pass ``offload=True`` on GPUs to
keep the shards in CPU memory between uses (slower, much less GPU memory).

Example (on every rank)::

    from nbdist.strategies.parallel.fsdp import apply_fsdp, param_bytes
    model = apply_fsdp(Net().to(device), blocks=Block)    # each Block, then the root
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)   # create it after sharding
    ...  # the usual loop
    local, full = param_bytes(model)                      # local ~ full / world_size
"""

from __future__ import annotations

import torch
from torch import nn

from nbdist.strategies.measure import local_bytes
from nbdist.strategies.parallel.checkpointing import find_blocks

__all__ = ["apply_fsdp", "full_state_dict", "param_bytes"]


def apply_fsdp(
    model: nn.Module,
    *,
    blocks=None,
    mesh=None,
    offload: bool = False,
    param_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype | None = None,
    reshard_after_forward: bool | int | None = True,
) -> nn.Module:
    """Shard ``model`` with ``fully_shard``: each of ``blocks`` first, then the whole model.

    ``blocks`` (a class such as ``Block``, or a list of submodules or their
    names: see :func:`~nbdist.strategies.parallel.checkpointing.find_blocks`; ``None``:
    the model is one unit) sets the unit of all-gather: one block's full
    weights live at a time. ``mesh`` defaults to all ranks on this rank's
    device. ``offload=True`` keeps shards on the CPU (``CPUOffloadPolicy``; GPU
    ranks only). ``param_dtype`` / ``reduce_dtype`` (e.g. ``torch.bfloat16`` /
    ``torch.float32``) set mixed precision. ``reshard_after_forward`` goes to
    ``fully_shard`` for every unit (``None``: torch's choice, blocks reshard and
    the root keeps its parameters for backward). Returns ``model`` (now an
    ``FSDPModule``), changed in place; build the optimizer afterwards.
    """
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    from nbdist.engine.backend_support import require
    from nbdist.engine.helpers import device
    from nbdist.strategies.arguments import as_dtype, require_module
    from nbdist.strategies.parallel.tensor_parallel import device_mesh

    # Parameters are all-gathered before use, gradients reduce-scattered after.
    require("FSDP2 (apply_fsdp)", ("all_gather_into_tensor", "reduce_scatter_tensor"))

    if offload and device().type == "cpu":
        # torch says only "Cannot access accelerator device when none is available".
        raise ValueError(
            "apply_fsdp(offload=True) needs GPU ranks: CPU offload moves the shards from GPU "
            "memory to CPU memory, and on CPU ranks they already are in CPU memory. "
            "Use offload=False here."
        )
    require_module(model, "apply_fsdp")
    param_dtype = as_dtype(param_dtype, "param_dtype", "apply_fsdp")
    reduce_dtype = as_dtype(reduce_dtype, "reduce_dtype", "apply_fsdp")
    # Resolved (and checked) before any collective runs.
    units = [] if blocks is None else find_blocks(model, blocks, caller="apply_fsdp")
    if mesh is None:
        mesh = device_mesh()
    kwargs = {"mesh": mesh, "reshard_after_forward": reshard_after_forward}
    if offload:
        kwargs["offload_policy"] = CPUOffloadPolicy()
    if param_dtype is not None or reduce_dtype is not None:
        kwargs["mp_policy"] = MixedPrecisionPolicy(
            param_dtype=param_dtype, reduce_dtype=reduce_dtype
        )
    # Inner blocks first: the root then only owns what no block took (embeddings, head).
    for _, block in units:
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)
    return model


def param_bytes(model: nn.Module) -> tuple[int, int]:
    """``(local, full)``: parameter bytes this rank stores, and of the unsharded model."""
    params = list(model.parameters())
    # A DTensor's numel is the global one.
    return local_bytes(params), sum(p.numel() * p.element_size() for p in params)


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer, unsharded, on the CPU (a collective: call it on all ranks)."""
    out = {}
    for name, t in model.state_dict().items():
        full = t.full_tensor() if hasattr(t, "full_tensor") else t
        out[name] = full.detach().cpu()
    return out
