"""Rank side: one parallel plan (dp × tp × pp, sharding, activation checkpointing) built on the ranks.

A :class:`Plan` names a point of the space :func:`~nbdist.strategies.plan.autoplan.autoplan`
searches: how many ranks go to data (``dp``), tensor (``tp``) and pipeline
(``pp``) parallelism, how the data-parallel replicas keep their state
(``"ddp"``: everything replicated; ``"zero1"``: optimizer state sharded,
``ZeroRedundancyOptimizer``; ``"fsdp"``: parameters, gradients and optimizer
state sharded, FSDP2) and whether blocks recompute their activations in
backward (``ac``). :func:`build_plan` makes it with the functions a user calls:
DDP or ``zero_optimizer`` for pure data parallelism, otherwise
:func:`~nbdist.strategies.parallel.parallelize.parallelize` (pipeline split,
tensor parallel, activation checkpointing, FSDP2 over the ``dp`` ranks, the
pipeline schedule, in that order). Whenever ``tp`` or ``pp`` is above 1 the
data-parallel dimension is FSDP2 (as in torchtitan's 2D and 3D layouts); DDP
and ZeRO-1 are plans of pure data parallelism.

Every plan is fed the same *global* batch: data-parallel replica ``d`` (the
rank's ``dp`` coordinate in :class:`~nbdist.strategies.parallel.mesh.ParallelDims`)
trains on chunk ``d`` of ``dp`` equal chunks, the tensor-parallel ranks of a
replica see the same chunk, and the first pipeline stage cuts it into
micro-batches. With a loss that averages over the batch, every plan computes
the gradient of the global batch's loss.

Example (on every rank)::

    from nbdist.strategies.plan.build import Plan, build_plan
    built = build_plan(build, Plan(dp=2, tp=2), loss_fn=lm_loss, blocks=Block,
                       colwise=["attn.q", "mlp.up"], rowwise=["attn.o", "mlp.down"])
    loss = built.step(x, y)          # one optimizer step on the global batch (x, y)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from nbdist.strategies.parallel.checkpointing import apply_ac
from nbdist.strategies.parallel.mesh import ParallelDims

__all__ = ["SHARDINGS", "Built", "Plan", "build_plan", "plan_units", "reduce_loss"]

SHARDINGS = ("ddp", "zero1", "fsdp")


@dataclass(frozen=True, order=True)
class Plan:
    """``dp`` × ``tp`` × ``pp`` ranks, the data-parallel ``shard`` mode and activation checkpointing.

    ``shard`` is one of :data:`SHARDINGS`; ``"ddp"`` and ``"zero1"`` need ``tp ==
    pp == 1``. With ``dp == 1`` there is nothing to shard and ``shard`` is
    ``"fsdp"`` by convention (the name leaves it out). ``name`` reads like
    ``fsdp2×tp2``, ``ddp4``, ``tp2×pp2+ac``.
    """

    dp: int
    tp: int = 1
    pp: int = 1
    shard: str = "fsdp"
    ac: bool = False

    def __post_init__(self) -> None:
        """Check ``shard`` against the layout."""
        if self.shard not in SHARDINGS:
            raise ValueError(f"Plan: shard={self.shard!r}, choose from {SHARDINGS}")
        if self.shard != "fsdp" and (self.tp > 1 or self.pp > 1):
            raise ValueError(
                f"Plan: shard={self.shard!r} with tp {self.tp} × pp {self.pp}: in 2D/3D layouts "
                "the data-parallel dimension is FSDP2; use shard='fsdp'"
            )

    @property
    def world_size(self) -> int:
        """``dp * tp * pp``."""
        return self.dp * self.tp * self.pp

    @property
    def name(self) -> str:
        """A short label: ``ddp4``, ``zero4``, ``fsdp2×tp2``, ``tp2×pp2+ac``."""
        parts = []
        if self.dp > 1:
            parts.append(f"{'zero' if self.shard == 'zero1' else self.shard}{self.dp}")
        parts += [f"{k}{v}" for k, v in (("tp", self.tp), ("pp", self.pp)) if v > 1]
        return "×".join(parts or ["single"]) + ("+ac" if self.ac else "")

    def dims(self) -> ParallelDims:
        """The validated :class:`~nbdist.strategies.parallel.mesh.ParallelDims` of this plan."""
        return ParallelDims(self.world_size, dp=self.dp, tp=self.tp, pp=self.pp)


def plan_units(part: nn.Module, blocks) -> list[tuple[str, nn.Module]]:
    """The units a plan shards, checkpoints and splits by tensor parallel in ``part``.

    ``blocks`` a class (``Block``): every submodule of that type (none is fine
    in a pipeline stage that holds only an embedding); ``None``: the children
    of ``part`` that own parameters (each ``nn.Linear`` of an MLP).
    """
    if blocks is None:
        return [(n, m) for n, m in part.named_children() if any(True for _ in m.parameters())]
    if not isinstance(blocks, type):
        raise TypeError(f"blocks must be a module class such as Block, got {blocks!r}")
    return [(n, m) for n, m in part.named_modules() if n and isinstance(m, blocks)]


class Built:
    """A plan made on this rank: ``model`` (this rank's part), ``optimizer``, ``schedule`` (pp).

    ``forward_backward(x, y)`` runs forward and backward on this rank's share
    of the global batch ``(x, y)`` and returns the replica's loss (a detached
    tensor), or ``None`` on pipeline stages that compute none. :meth:`step`
    adds the optimizer step and the global loss.
    """

    def __init__(self, plan, dims, model, optimizer, loss_fn, device, stage=None, schedule=None):
        """Hold the parts :func:`build_plan` made."""
        self.plan, self.dims, self.model = plan, dims, model
        self.optimizer, self.stage, self.schedule = optimizer, stage, schedule
        self.params = list(model.parameters())
        self._loss_fn, self._device = loss_fn, device
        self._coords = dims.coordinates(dist.get_rank())

    def share(self, t: torch.Tensor) -> torch.Tensor:
        """This rank's data-parallel chunk of the global batch tensor ``t``, on its device."""
        dp = self.plan.dp
        if len(t) % dp:
            raise ValueError(f"the global batch ({len(t)}) does not split into dp {dp} replicas")
        return t.tensor_split(dp)[self._coords["dp"]].to(self._device)

    def forward_backward(self, x: torch.Tensor, y: torch.Tensor):
        """Forward and backward on this rank's share of ``(x, y)``; the replica's loss or ``None``."""
        x, y = self.share(x), self.share(y)
        if self.schedule is None:
            loss = self._loss_fn(self.model(x), y)
            loss.backward()
            return loss.detach()
        stage = self.stage
        if stage.is_first:
            self.schedule.step(x)
            return None
        if stage.is_last:
            losses: list[torch.Tensor] = []
            self.schedule.step(target=y, losses=losses)
            # Mean of the micro-batch losses = the replica batch's loss (a mean loss).
            return torch.stack([loss.detach() for loss in losses]).mean()
        self.schedule.step()
        return None

    def step(self, x: torch.Tensor, y: torch.Tensor, *, reduce: bool = True):
        """One optimizer step on the global batch ``(x, y)``; returns its loss as a float.

        ``reduce=True`` averages the losses of the ranks that have one (one small
        all-reduce, a sync point): every rank gets the global batch's loss.
        ``reduce=False`` returns this rank's replica loss tensor, or ``None``.
        """
        self.optimizer.zero_grad(set_to_none=True)
        loss = self.forward_backward(x, y)
        self.optimizer.step()
        if not reduce:
            return loss
        return reduce_loss(loss, self._device)


def reduce_loss(loss, device) -> float:
    """Mean of the ranks' losses over the ranks that have one (``None`` elsewhere); every rank."""
    t = torch.zeros(2, dtype=torch.float64, device=device)
    if loss is not None:
        t[0], t[1] = float(loss), 1.0
    dist.all_reduce(t)
    # Every replica is counted by the same number of ranks (tp, or its last stage's tp),
    # so the mean over ranks is the mean over replicas: the global batch's loss.
    return (t[0] / t[1]).item()


def build_plan(
    build_model: Callable[[], nn.Module],
    plan: Plan,
    *,
    loss_fn: Callable = nn.functional.mse_loss,
    optimizer: type[torch.optim.Optimizer] = torch.optim.Adam,
    optimizer_kwargs: dict | None = None,
    blocks=None,
    colwise=None,
    rowwise=None,
    microbatches: int | None = None,
    seed: int = 0,
    device: torch.device | str | None = None,
) -> Built:
    """Make ``plan`` on this rank from a fresh ``build_model()`` (seeded with ``seed``); call on every rank.

    ``blocks`` (a module class) are the units of FSDP2, checkpointing and
    tensor parallel, with ``colwise``/``rowwise`` naming the ``nn.Linear``
    layers inside one block; without ``blocks`` the model's children with
    parameters are the units and tensor parallel pairs its ``nn.Linear``
    layers (:func:`~nbdist.strategies.parallel.tensor_parallel.linear_pairs`).
    ``plan.pp > 1`` needs an ``nn.Sequential``, cut by
    :func:`~nbdist.strategies.parallel.pipeline.split_sequential` and run by a 1F1B
    schedule with ``microbatches`` (default ``2 * pp``) micro-batches per replica.
    """
    from nbdist.engine.helpers import device as rank_device
    from nbdist.strategies.arguments import require_builder
    from nbdist.strategies.parallel.parallelize import parallelize
    from nbdist.strategies.parallel.zero import zero_optimizer

    require_builder(build_model, "build_plan")
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("build_plan runs on the ranks (%%on_all_ranks): no process group")
    if plan.ac and blocks is None:
        raise ValueError(
            f"plan {plan.name}: activation checkpointing needs blocks= (the class of the "
            "model's repeated blocks, e.g. blocks=Block)"
        )
    dims = plan.dims()
    device = torch.device(device) if device is not None else rank_device()
    kwargs = dict(optimizer_kwargs or {"lr": 1e-3})
    torch.manual_seed(seed)  # the same initial weights on every rank and for every plan
    model = build_model()
    if plan.tp == 1 and plan.pp == 1 and plan.shard in ("ddp", "zero1"):
        # Pure data parallelism with replicated parameters: DDP, not a mesh.
        from torch.nn.parallel import DistributedDataParallel as DDP

        model = model.to(device)
        if plan.ac:
            apply_ac(model, blocks=blocks)
        model = DDP(model)
        if plan.shard == "zero1":
            opt = zero_optimizer(model.parameters(), optimizer, **kwargs)
        else:
            opt = optimizer(model.parameters(), **kwargs)
        return Built(plan, dims, model, opt, loss_fn, device)
    done = parallelize(
        model,
        dims,
        blocks=blocks,
        # Without blocks, tensor parallel pairs the part's nn.Linear layers itself.
        colwise=(colwise or ()) if blocks is not None else None,
        rowwise=(rowwise or ()) if blocks is not None else None,
        ac=plan.ac,
        n_microbatches=microbatches or None,
        loss_fn=loss_fn,
        device=device,
        caller="build_plan",
    )
    opt = optimizer(done.model.parameters(), **kwargs)
    return Built(plan, dims, done.model, opt, loss_fn, device, done.stage, done.schedule)
