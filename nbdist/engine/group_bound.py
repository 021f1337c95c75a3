"""Rank side: the user's variables that hold the process group, named before it is formed again.

After a release (a failed or hung collective) nbdist forms the group again on the same
processes: tensors, models and optimisers stay, but an object that holds the old group
keeps using it and fails in a later cell, with gloo's "Connection closed" or torch's
"... not initialized in the world group map", far from the cause. Such objects are a
``DistributedDataParallel`` wrapper (and anything else with a ``process_group`` or a
``group``: FSDP, ``ZeroRedundancyOptimizer``, a ``PipelineStage``), a subgroup from
``dist.new_group``, a ``DeviceMesh``, a ``DTensor``, a module whose parameters are
DTensors (``fully_shard``, tensor parallel) and an optimiser over such parameters.
Naming them when the group is formed again tells the user what to make again.
"""

from __future__ import annotations

import sys

from nbdist.engine.user_variables import one_level_in, user_variables

__all__ = ["bound_to_group"]


def bound_to_group(namespace: dict) -> list[tuple[str, str]]:
    """``(name, what)`` for each variable of ``namespace`` that holds a process group.

    Top-level variables, and one level inside those that hold none themselves: a dict's
    or list's entries (``models['a']``), a plain object's attributes (``trainer.model``).

    Only what was imported can exist: DTensor and DeviceMesh are looked for only where
    their modules are loaded already (importing them would cost a rank ~0.3 s).
    """
    import torch
    import torch.distributed as dist

    dtensor_module = sys.modules.get("torch.distributed.tensor")
    mesh_module = sys.modules.get("torch.distributed.device_mesh")
    dtensor = getattr(dtensor_module, "DTensor", None)
    mesh = getattr(mesh_module, "DeviceMesh", None)
    group = dist.ProcessGroup

    def what(value) -> str:
        if isinstance(value, group):
            return "process group"
        if mesh is not None and isinstance(value, mesh):
            return "DeviceMesh"
        if dtensor is not None and isinstance(value, dtensor):
            return "DTensor"
        # DDP, FSDP, ZeroRedundancyOptimizer, PowerSGD's state: ``process_group``;
        # a PipelineStage given its group, nbdist's context-parallel helpers: ``group``.
        for attribute in ("process_group", "group"):
            if isinstance(getattr(value, attribute, None), group):
                return type(value).__name__
        if dtensor is None:
            return ""
        if isinstance(value, torch.nn.Module):
            if any(isinstance(p, dtensor) for p in value.parameters()):
                return f"{type(value).__name__} with DTensor parameters"
        elif isinstance(value, torch.optim.Optimizer):
            params = (p for g in value.param_groups for p in g["params"])
            if any(isinstance(p, dtensor) for p in params):
                return f"{type(value).__name__} over DTensor parameters"
        return ""

    def judged(value) -> str:
        try:
            return what(value)
        except Exception:  # a user's object whose attributes raise: not ours to judge
            return ""

    found = []
    for name, value in user_variables(namespace):
        kind = judged(value)
        if kind:
            found.append((name, kind))
            continue
        # One level in: a notebook's own trainer object (trainer.model = DDP(...)), or a
        # dict or list of models.
        inside = [
            (suffix, kind) for suffix, inner in one_level_in(value) if (kind := judged(inner))
        ]
        if len(inside) > 1 and isinstance(value, (dict, list, tuple)):
            # A list of 64 DTensors is one thing to make again, not 64 lines.
            kinds = ", ".join(dict.fromkeys(kind for _, kind in inside))
            found.append((name, f"{type(value).__name__} holding {len(inside)}: {kinds}"))
        else:
            found.extend((name + suffix, kind) for suffix, kind in inside)
    return found
