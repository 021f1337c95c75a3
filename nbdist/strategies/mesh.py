"""Rank side: 2D and 3D parallelism on one ``DeviceMesh``: data (FSDP2) × tensor × pipeline.

:class:`ParallelDims` is the one placement object: how many ranks go to each
kind of parallelism, checked against the world size before anything starts
(it needs no process group, so the kernel can check it before ``%dist_start``),
and the ``DeviceMesh`` that lays the ranks out. The mesh is ``pp × dp × tp``,
outermost first, as torchtitan orders it: the ranks of one tensor-parallel
group are neighbours (on GPUs, one node with fast links, since TP talks in
every layer), pipeline stages are farthest apart (they only pass activations).

:func:`apply_fsdp_tp` is 2D parallelism: tensor parallel inside each block
over the ``tp`` dimension, then FSDP2 over the ``dp`` dimension on top.
:func:`apply_fsdp_tp_pp` is 3D: the model is cut into ``pp`` stages first,
then each stage gets the 2D treatment, and a pipeline schedule runs it.

Example (on every rank of 8)::

    from nbdist.strategies.mesh import ParallelDims, apply_fsdp_tp_pp
    dims = ParallelDims(world_size, dp=2, tp=2, pp=2)
    mesh = dims.build_mesh()
    stage, schedule = apply_fsdp_tp_pp(model, mesh, blocks=Block,
                                       colwise=["attn.q", "attn.k", "attn.v", "mlp.up"],
                                       rowwise=["attn.o", "mlp.down"],
                                       n_microbatches=4, loss_fn=loss_fn)
    x, y = batch_for(dims.coordinates(rank)["dp"])     # one batch per data-parallel replica
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

__all__ = ["DIM_ORDER", "ParallelDims", "apply_fsdp_tp", "apply_fsdp_tp_pp"]

# Outermost first: pipeline stages far apart, tensor-parallel ranks adjacent.
DIM_ORDER = ("pp", "dp", "tp")


def _factorisations(world: int) -> list[tuple[int, int, int]]:
    return [
        (dp, tp, world // (dp * tp))
        for dp in range(1, world + 1)
        if world % dp == 0
        for tp in range(1, world // dp + 1)
        if (world // dp) % tp == 0
    ]


def _nearest(world: int, dp: int, tp: int, pp: int) -> tuple[int, int, int]:
    # The valid layout closest to the one asked for (in log ratio), keeping tp and pp first.
    def distance(c):
        return sum(abs(math.log(a / b)) * w for a, b, w in zip(c, (dp, tp, pp), (1, 1.01, 1.02)))

    return min(_factorisations(world), key=distance)


@dataclass(frozen=True)
class ParallelDims:
    """How ``world_size`` ranks split into data (``dp``), tensor (``tp``) and pipeline (``pp``) parallelism.

    ``dp=-1`` takes what ``tp`` and ``pp`` leave (``world_size // (tp * pp)``).
    The product must be the world size; every error shows the numbers and a
    layout that fits, e.g. ``ParallelDims(8, dp=2, tp=3, pp=2)`` raises
    ``dp 2 × tp 3 × pp 2 = 12 ≠ world size 8 ... e.g. dp 2 × tp 2 × pp 2``.
    Pure arithmetic: no process group needed.
    """

    world_size: int
    dp: int = -1
    tp: int = 1
    pp: int = 1

    def __post_init__(self) -> None:
        """Check the numbers; resolve ``dp=-1``."""
        for name in ("world_size", "dp", "tp", "pp"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"ParallelDims: {name} must be an int, got {value!r}")
        world, tp, pp = self.world_size, self.tp, self.pp
        if world < 1:
            raise ValueError(f"ParallelDims: world_size must be >= 1, got {world}")
        for name in ("tp", "pp"):
            if getattr(self, name) < 1:
                raise ValueError(
                    f"ParallelDims: {name} must be >= 1, got {getattr(self, name)} "
                    f"(1 turns {name} off)"
                )
        dp = self.dp
        if dp == -1:
            if world % (tp * pp):
                a, b, c = _nearest(world, 1, tp, pp)
                raise ValueError(
                    f"ParallelDims: tp {tp} × pp {pp} = {tp * pp} does not divide world size "
                    f"{world}, so dp=-1 has no whole value; e.g. dp {a} × tp {b} × pp {c}"
                )
            dp = world // (tp * pp)
            object.__setattr__(self, "dp", dp)
        elif dp < 1:
            raise ValueError(
                f"ParallelDims: dp must be >= 1 or -1 (all the ranks tp and pp leave), got {dp}"
            )
        if dp * tp * pp != world:
            a, b, c = _nearest(world, dp, tp, pp)
            raise ValueError(
                f"ParallelDims: dp {dp} × tp {tp} × pp {pp} = {dp * tp * pp} ≠ world size "
                f"{world}: choose sizes whose product is {world}, e.g. dp {a} × tp {b} × pp {c} "
                f"(or dp=-1 to give data parallel whatever tp × pp leaves)"
            )

    @property
    def shape(self) -> tuple[int, int, int]:
        """Mesh shape in :data:`DIM_ORDER` (``pp``, ``dp``, ``tp``)."""
        return (self.pp, self.dp, self.tp)

    def __str__(self) -> str:
        """``dp 2 × tp 2 × pp 2 = 8 ranks``."""
        return f"dp {self.dp} × tp {self.tp} × pp {self.pp} = {self.world_size} ranks"

    def coordinates(self, rank: int) -> dict[str, int]:
        """This rank's index along each mesh dimension, e.g. ``{"pp": 0, "dp": 1, "tp": 0}``.

        Ranks fill the mesh row-major (``tp`` fastest), as ``init_device_mesh`` lays them out.
        """
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside 0..{self.world_size - 1}")
        pp, rest = divmod(rank, self.dp * self.tp)
        dp, tp = divmod(rest, self.tp)
        return {"pp": pp, "dp": dp, "tp": tp}

    def check_model(
        self,
        *,
        n_heads: int | None = None,
        hidden: int | None = None,
        n_layers: int | None = None,
        batch: int | None = None,
        n_microbatches: int | None = None,
    ) -> None:
        """Check that a model and batch fit this layout; the error names the number that does not.

        Tensor parallel splits attention heads and hidden features ``tp`` ways;
        pipeline parallel needs a layer per stage; each data-parallel replica
        gets ``batch // dp`` samples, cut into ``n_microbatches``.
        """
        tp, pp, dp = self.tp, self.pp, self.dp
        if n_heads is not None and n_heads % tp:
            raise ValueError(f"tp {tp} must divide the number of attention heads ({n_heads})")
        if hidden is not None and hidden % tp:
            raise ValueError(f"tp {tp} must divide the hidden size ({hidden})")
        if n_layers is not None and n_layers < pp:
            raise ValueError(f"pp {pp} stages need at least {pp} layers, the model has {n_layers}")
        if batch is not None:
            if batch % dp:
                raise ValueError(f"dp {dp} must divide the global batch ({batch})")
            per_replica = batch // dp
            if n_microbatches is not None and per_replica % n_microbatches:
                raise ValueError(
                    f"each dp replica gets {per_replica} samples (batch {batch} / dp {dp}), "
                    f"which {n_microbatches} micro-batches do not divide"
                )

    def build_mesh(self, *, device_type: str | None = None):
        """The ``DeviceMesh`` ``pp × dp × tp`` over all ranks (call it on every rank).

        Dimensions of size 1 are kept, so ``mesh["tp"]`` always exists.
        ``device_type`` defaults to this rank's device type.
        """
        import torch.distributed as dist

        from nbdist.strategies.tensor_parallel import device_mesh

        if (
            dist.is_available()
            and dist.is_initialized()
            and dist.get_world_size() != self.world_size
        ):
            raise ValueError(
                f"ParallelDims was made for world size {self.world_size}, but the process group "
                f"has {dist.get_world_size()} ranks: make it with ParallelDims(world_size, ...)"
            )
        return device_mesh(self.shape, DIM_ORDER, device_type=device_type)


def _tp_fsdp(part, mesh, blocks, colwise, rowwise, reshard_after_forward, *, stage=False):
    from nbdist.strategies.checkpointing import find_blocks
    from nbdist.strategies.fsdp import apply_fsdp
    from nbdist.strategies.tensor_parallel import apply_tp, replicate_unsharded

    colwise, rowwise = list(colwise), list(rowwise)
    if stage and isinstance(blocks, type):
        # A pipeline stage may hold no block at all (only the embedding, say).
        units = [(n, m) for n, m in part.named_modules() if isinstance(m, blocks)]
    else:
        units = find_blocks(part, blocks, caller="apply_fsdp_tp")
    if mesh["tp"].size() > 1:
        # Tensor parallel first: FSDP2 then shards the TP shards over dp (2D DTensors).
        for _, block in units:
            apply_tp(block, mesh["tp"], colwise=colwise, rowwise=rowwise)
        if mesh["dp"].size() == 1:
            # No FSDP to make the layers outside the blocks DTensors: replicate them on
            # tp, or foreach optimizers (CUDA's default) refuse the mix at their first step.
            replicate_unsharded(part, mesh["tp"], caller="apply_fsdp_tp")
    if mesh["dp"].size() > 1:
        apply_fsdp(
            part,
            blocks=[b for _, b in units],
            mesh=mesh["dp"],
            reshard_after_forward=reshard_after_forward,
        )


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
    (``"attn.q"``, ``"mlp.down"``), paired as :func:`~nbdist.strategies.tensor_parallel.apply_tp`
    explains. Layers outside the blocks (embeddings, head) stay whole on the
    ``tp`` ranks and are sharded by FSDP2 alone. Ranks with the same ``dp``
    coordinate must be fed the same batch. Returns ``model``, changed in place;
    build the optimizer afterwards.
    """
    _tp_fsdp(model, mesh, blocks, colwise, rowwise, reshard_after_forward)
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
    with :func:`~nbdist.strategies.pipeline.split_sequential`; this rank keeps
    stage ``pp`` coordinate, moves it to ``device`` (default: this rank's),
    applies :func:`apply_fsdp_tp` to it, and wraps it in a ``PipelineStage``
    that talks to the neighbouring stages of its own (dp, tp) coordinate.
    ``schedule`` is ``"gpipe"`` or ``"1f1b"``. Returns ``(stage, schedule)``:
    call ``schedule.step(x)`` on the first stage, ``schedule.step(target=y,
    losses=...)`` on the last, ``schedule.step()`` between.
    """
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    from nbdist.engine.backend_support import require
    from nbdist.engine.helpers import device as rank_device
    from nbdist.strategies.pipeline import SCHEDULES, split_sequential

    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
    pp_mesh = mesh["pp"]
    n_stages, index = pp_mesh.size(), pp_mesh.get_local_rank()
    if n_microbatches < 1 or (schedule == "1f1b" and n_microbatches < n_stages):
        raise ValueError(
            f"n_microbatches={n_microbatches} is too few for {n_stages} stages with {schedule}: "
            f"use n_microbatches >= {max(1, n_stages if schedule == '1f1b' else 1)}"
        )
    require("3D parallel (apply_fsdp_tp_pp)", ("send/recv",))
    device = torch.device(device) if device is not None else rank_device()
    part = split_sequential(model, n_stages)[index].to(device)
    _tp_fsdp(part, mesh, blocks, colwise, rowwise, True, stage=True)
    stage = PipelineStage(part, index, n_stages, device, group=pp_mesh.get_group())
    cls = ScheduleGPipe if schedule == "gpipe" else Schedule1F1B
    return stage, cls(stage, n_microbatches=n_microbatches, loss_fn=loss_fn)
