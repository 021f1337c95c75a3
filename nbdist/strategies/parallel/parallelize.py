"""Rank side: apply a ``dp × tp × pp`` layout to a model: TP → activation checkpointing → FSDP2 → PP.

:func:`parallelize` is the one place that composes them. It takes a model and a
:class:`~nbdist.strategies.parallel.mesh.ParallelDims` and applies, on this
rank, in one fixed order (torchtitan's ``parallelize_llama``):

0. **pipeline split** (``pp > 1``): the ``nn.Sequential`` is cut into ``pp``
   stages and this rank keeps its own; every step below works on that part;
1. **tensor parallel** (``tp > 1``) inside each block over ``mesh["tp"]``;
2. **activation checkpointing** (``ac=True``) of each block;
3. **FSDP2** (``dp > 1``) over ``mesh["dp"]``, each (checkpointed) block a unit;
4. **pipeline stage and schedule** (``pp > 1``) over ``mesh["pp"]``.

Why this order: FSDP2 shards what it is given, so tensor parallel goes first
and FSDP2 then shards the TP shards over ``dp`` (2D DTensors); checkpointing
wraps the block tensor parallel changed, and FSDP2 takes the wrapper as its
unit, so one all-gather serves the block's forward and its recomputation; the
pipeline stage wraps the finished part, since it only passes activations on.

:func:`apply_fsdp_tp` (2D) and :func:`apply_fsdp_tp_pp` (3D) are its
shorthands over a ``DeviceMesh``; ``build_plan`` (what ``autoplan`` applies)
and ``compare`` call it too.

Example (on every rank of 8)::

    from nbdist.strategies.parallel.mesh import ParallelDims
    from nbdist.strategies.parallel.parallelize import parallelize
    dims = ParallelDims(world_size, dp=2, tp=2, pp=2)
    done = parallelize(make_gpt(), dims, blocks=Block, colwise=["attn.q", "mlp.up"],
                       rowwise=["attn.o", "mlp.down"], ac=True, n_microbatches=4,
                       loss_fn=lm_loss)
    opt = torch.optim.AdamW(done.model.parameters())   # after parallelize
    if done.stage.is_first:
        done.schedule.step(x)                           # x: this dp replica's batch
    elif done.stage.is_last:
        done.schedule.step(target=y, losses=losses)
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import NamedTuple

import torch
from torch import nn

from nbdist.strategies.arguments import layer_names, require_module
from nbdist.strategies.parallel.mesh import ParallelDims, dims_of

__all__ = ["STEPS", "Parallelized", "apply_fsdp_tp", "apply_fsdp_tp_pp", "parallelize"]

# The order parallelize applies its steps in; ``Parallelized.steps`` lists those it took.
STEPS = ("pp_split", "tp", "ac", "fsdp", "pp_stage")


class Parallelized(NamedTuple):
    """What :func:`parallelize` made on this rank.

    ``model``: this rank's part, parallelized in place (the whole model when
    ``pp == 1``, its pipeline stage otherwise); ``mesh``: the ``DeviceMesh``;
    ``stage`` and ``schedule``: the ``PipelineStage`` and its schedule when
    ``pp > 1``, else ``None``; ``steps``: the steps of :data:`STEPS` it applied,
    in order.
    """

    model: nn.Module
    mesh: object
    stage: object = None
    schedule: object = None
    steps: tuple[str, ...] = ()


def parallelize(
    model: nn.Module,
    dims: ParallelDims,
    *,
    mesh=None,
    blocks=None,
    colwise: Iterable[str] | None = None,
    rowwise: Iterable[str] | None = None,
    tp_plan: dict | None = None,
    ac: bool = False,
    reshard_after_forward: bool | None = True,
    n_microbatches: int | None = None,
    loss_fn: Callable | None = None,
    schedule: str = "1f1b",
    device: torch.device | str | None = None,
    caller: str = "parallelize",
) -> Parallelized:
    """Apply ``dims`` to ``model`` on this rank: TP → activation checkpointing → FSDP2 → PP.

    Call it on every rank. ``mesh`` is a ``DeviceMesh`` with dimensions named
    ``"dp"``, ``"tp"`` (and ``"pp"`` when ``pp > 1``) matching ``dims``;
    default ``dims.build_mesh()``. The part this rank keeps goes to ``device``
    (default: this rank's).

    ``blocks`` are the units: a module class (``Block``; in a pipeline stage
    there may be none), a list of submodule names or submodules (as
    :func:`~nbdist.strategies.parallel.checkpointing.find_blocks` takes), or
    ``None``: the children of the part that own parameters. Tensor parallel
    shards the ``nn.Linear`` layers ``colwise``/``rowwise`` *inside each block*
    (``"attn.q"``, ``"mlp.down"``); with ``blocks=None`` these name layers of
    the whole part, and without them consecutive ``nn.Linear`` layers are paired
    (:func:`~nbdist.strategies.parallel.tensor_parallel.linear_pairs`).
    ``tp_plan`` adds a ready ``parallelize_module`` plan. When ``dp == 1`` the
    parameters tensor parallel left alone become replicated DTensors, so that the
    optimizer sees DTensors only (on GPUs torch's foreach optimizers refuse a mix).

    ``ac=True`` checkpoints each block (``blocks`` needed).
    ``reshard_after_forward`` goes to FSDP2 for every unit. ``pp > 1`` needs an
    ``nn.Sequential``, ``loss_fn`` and ``n_microbatches`` per step (default
    ``2 * pp``); ``schedule`` is ``"1f1b"`` or ``"gpipe"``. ``caller`` starts
    the error messages. Returns a :class:`Parallelized`; build the optimizer on
    ``result.model.parameters()`` afterwards.
    """
    import torch.distributed as dist

    from nbdist.engine.helpers import device as rank_device
    from nbdist.strategies.parallel.pipeline import SCHEDULES

    require_module(model, caller)
    if not isinstance(dims, ParallelDims):
        raise TypeError(f"{caller}: dims must be a ParallelDims, got {type(dims).__name__}")
    # Checked here, before the model moves or is cut: one string is no list of names.
    colwise = None if colwise is None else layer_names(colwise, "colwise", caller)
    rowwise = None if rowwise is None else layer_names(rowwise, "rowwise", caller)
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            f"{caller} runs on the ranks (in a %%on_all_ranks cell after %dist_start): "
            "no process group"
        )
    if ac and blocks is None:
        raise ValueError(
            f"{caller}: activation checkpointing needs blocks= (the class of the model's "
            "repeated blocks, e.g. blocks=Block)"
        )
    if dims.pp > 1:
        n_microbatches = _check_pipeline(dims.pp, n_microbatches, loss_fn, schedule, caller)
    elif schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
    device = torch.device(device) if device is not None else rank_device()
    if mesh is None:
        mesh = dims.build_mesh(device_type=device.type)
    steps: list[str] = []

    part = model
    if dims.pp > 1:
        from nbdist.strategies.parallel.pipeline import split_sequential

        part = split_sequential(model, dims.pp)[mesh["pp"].get_local_rank()]
        steps.append("pp_split")
    part = part.to(device)
    units = _units(part, blocks, in_stage=dims.pp > 1, caller=caller)

    if dims.tp > 1:
        _apply_tp(part, units, mesh["tp"], dims, blocks, colwise, rowwise, tp_plan, caller)
        steps.append("tp")
    if ac and units:
        from nbdist.strategies.parallel.checkpointing import apply_ac

        names = _outermost([name for name, _ in units])
        apply_ac(part, blocks=names)
        # FSDP2's units become the Checkpointed wrappers, now at the blocks' names.
        units = [(name, part.get_submodule(name)) for name in names]
        steps.append("ac")
    if dims.dp > 1:
        from nbdist.strategies.parallel.fsdp import apply_fsdp

        apply_fsdp(
            part,
            blocks=[unit for _, unit in units],
            mesh=mesh["dp"],
            reshard_after_forward=reshard_after_forward,
        )
        steps.append("fsdp")
    if dims.pp == 1:
        return Parallelized(part, mesh, steps=tuple(steps))

    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    pp_mesh = mesh["pp"]
    stage = PipelineStage(
        part, pp_mesh.get_local_rank(), dims.pp, device, group=pp_mesh.get_group()
    )
    from nbdist.strategies.parallel.pipeline import contiguous_inputs

    cls = ScheduleGPipe if schedule == "gpipe" else Schedule1F1B
    steps.append("pp_stage")
    return Parallelized(
        part,
        mesh,
        stage,
        contiguous_inputs(cls(stage, n_microbatches=n_microbatches, loss_fn=loss_fn)),
        tuple(steps),
    )


def _check_pipeline(n_stages, n_microbatches, loss_fn, schedule, caller) -> int:
    from nbdist.engine.backend_support import require
    from nbdist.strategies.parallel.pipeline import SCHEDULES

    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
    if loss_fn is None:
        raise ValueError(f"{caller}: pp {n_stages} > 1 needs loss_fn= for the last stage")
    if n_microbatches is None:
        n_microbatches = 2 * n_stages
    if n_microbatches < 1 or (schedule == "1f1b" and n_microbatches < n_stages):
        raise ValueError(
            f"n_microbatches={n_microbatches} is too few for {n_stages} stages with {schedule}: "
            f"use n_microbatches >= {n_stages if schedule == '1f1b' else 1}"
        )
    # Stages hand activations and gradients to their neighbours point to point.
    require(f"pipeline parallel ({caller})", ("send/recv",))
    return n_microbatches


def _units(part: nn.Module, blocks, *, in_stage: bool, caller: str):
    if blocks is None:
        return [(n, m) for n, m in part.named_children() if any(True for _ in m.parameters())]
    if in_stage and isinstance(blocks, type):
        # A pipeline stage may hold no block at all (only the embedding, say).
        return [(n, m) for n, m in part.named_modules() if n and isinstance(m, blocks)]
    from nbdist.strategies.parallel.checkpointing import find_blocks

    return find_blocks(part, blocks, caller=caller)


def _apply_tp(part, units, tp_mesh, dims, blocks, colwise, rowwise, tp_plan, caller) -> None:
    from nbdist.strategies.parallel.tensor_parallel import (
        apply_tp,
        linear_pairs,
        replicate_unsharded,
    )

    if blocks is None:
        if colwise is None and rowwise is None and not tp_plan:
            colwise, rowwise = linear_pairs(part, dims.tp)
        # apply_tp replicates the rest of the part itself.
        apply_tp(part, tp_mesh, colwise=colwise or (), rowwise=rowwise or (), plan=tp_plan)
        return
    for _, block in units:
        apply_tp(block, tp_mesh, colwise=colwise or (), rowwise=rowwise or (), plan=tp_plan)
    if dims.dp == 1:
        # No FSDP2 to make the layers outside the blocks DTensors: replicate them on
        # tp, or foreach optimizers (CUDA's default) refuse the mix at their first step.
        replicate_unsharded(part, tp_mesh, caller=caller)


def _outermost(names: list[str]) -> list[str]:
    # A block nested in another one is checkpointed with its parent.
    return [n for n in names if not any(n.startswith(p + ".") for p in names if p != n)]


def apply_fsdp_tp(
    model: nn.Module,
    mesh,
    *,
    blocks,
    colwise: Iterable[str],
    rowwise: Iterable[str],
    reshard_after_forward: bool = True,
) -> nn.Module:
    """2D parallel: tensor parallel in each block over ``mesh["tp"]``, FSDP2 over ``mesh["dp"]``.

    ``blocks`` picks the repeated blocks (a class such as ``Block``, or names);
    ``colwise``/``rowwise`` name the ``nn.Linear`` layers *inside one block*
    (``"attn.q"``, ``"mlp.down"``), paired as :func:`~nbdist.strategies.parallel.tensor_parallel.apply_tp`
    explains. Layers outside the blocks (embeddings, head) stay whole on the
    ``tp`` ranks and are sharded by FSDP2 alone. Ranks with the same ``dp``
    coordinate must be fed the same batch. The model moves to this rank's
    device. Returns ``model``, changed in place; build the optimizer afterwards.
    Made by :func:`parallelize`.
    """
    dims = dims_of(mesh)
    # On a 3D mesh the caller cut the stages: each pp slice is a 2D layout of its own.
    per_stage = ParallelDims(dims.dp * dims.tp, dp=dims.dp, tp=dims.tp)
    parallelize(
        model,
        per_stage,
        mesh=mesh,
        blocks=blocks,
        colwise=colwise,
        rowwise=rowwise,
        reshard_after_forward=reshard_after_forward,
        caller="apply_fsdp_tp",
    )
    return model


def apply_fsdp_tp_pp(
    model: nn.Sequential,
    mesh,
    *,
    blocks,
    colwise: Iterable[str],
    rowwise: Iterable[str],
    n_microbatches: int,
    loss_fn,
    schedule: str = "1f1b",
    device=None,
):
    """3D parallel: this rank's pipeline stage of ``model``, 2D-parallel inside, and its schedule.

    ``model`` (an ``nn.Sequential``) is cut into ``mesh["pp"].size()`` stages
    with :func:`~nbdist.strategies.parallel.pipeline.split_sequential`; this rank keeps
    stage ``pp`` coordinate, moves it to ``device`` (default: this rank's),
    applies tensor parallel and FSDP2 to it as :func:`apply_fsdp_tp` does, and
    wraps it in a ``PipelineStage`` that talks to the neighbouring stages of its
    own (dp, tp) coordinate. ``schedule`` is ``"gpipe"`` or ``"1f1b"``. Returns
    ``(stage, schedule)``: call ``schedule.step(x)`` on the first stage,
    ``schedule.step(target=y, losses=...)`` on the last, ``schedule.step()``
    between. Made by :func:`parallelize`.
    """
    dims = dims_of(mesh)
    if dims.pp == 1:
        raise ValueError(
            "apply_fsdp_tp_pp needs a mesh with pp > 1 (its pipeline stages); for 2D use "
            "apply_fsdp_tp"
        )
    done = parallelize(
        model,
        dims,
        mesh=mesh,
        blocks=blocks,
        colwise=colwise,
        rowwise=rowwise,
        n_microbatches=n_microbatches,
        loss_fn=loss_fn,
        schedule=schedule,
        device=device,
        caller="apply_fsdp_tp_pp",
    )
    return done.stage, done.schedule
