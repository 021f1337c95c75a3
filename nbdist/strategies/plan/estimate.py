"""Rank side: which parallel plans a model admits, and the memory and traffic each should cost per rank.

:func:`model_facts` looks at the model once, in this process on the CPU:
parameter bytes of each top-level layer (the layers of an ``nn.Sequential``,
which a pipeline can cut between), the bytes autograd saves for backward in
each layer during one forward of the global batch (with and without
activation checkpointing), the bytes entering and leaving each ``nn.Linear``
and each layer (what tensor and pipeline parallelism send), and how many bytes
of state the optimizer keeps per parameter byte (one real step: Adam 2, SGD
with momentum 1).

:func:`estimate` turns those facts into one plan's cost on its busiest rank:

- parameters: the stage's, tensor-parallel layers divided by ``tp``, then by
  ``dp`` under FSDP2; gradients the same; optimizer state the measured ratio
  times the parameters this rank updates (``1/dp`` of them under ZeRO-1);
- DDP and ZeRO-1 add their gradient buckets (one more copy of the gradients);
  FSDP2 adds the largest unit gathered whole, and its gradient, during use;
- activations: per sample, times the replica's samples (``batch / dp``), for
  the micro-batches a 1F1B stage holds at once (``min(m, pp - stage)`` of ``m``),
  plus, with checkpointing, one block recomputed in backward. Activations are
  not divided by ``tp``: the inputs of column-parallel layers, norms and
  residuals stay whole on every tensor-parallel rank, so this is an upper bound;
- communication (payload per step, as :class:`~nbdist.strategies.measure.CommBytes`
  counts it): DDP the gradients, ZeRO-1 the gradients and the updated
  parameters, FSDP2 three times the parameters (gathered for forward and for
  backward, gradients reduce-scattered), tensor parallel each pair's output
  (forward) and input gradient (backward), a pipeline stage its boundary
  activations and their gradients.

:func:`enumerate_plans` walks every ``dp × tp × pp`` factorisation of the world
size × sharding × checkpointing and says, for each, its estimate or why the
model or batch cannot take it. All of it is arithmetic on the same facts, so
every rank (and the kernel) reaches the same list.

Example::

    facts = model_facts(build, (x, y), loss_fn=F.mse_loss)
    for plan, cost in enumerate_plans(facts, 4):
        print(plan.name, cost)     # a dict of bytes, or the reason it is not admitted
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from nbdist.strategies.parallel.checkpointing import apply_ac, local_tensors
from nbdist.strategies.parallel.pipeline import split_sequential
from nbdist.strategies.plan.build import Plan, plan_units

__all__ = ["Facts", "NotAdmitted", "enumerate_plans", "estimate", "model_facts"]


class NotAdmitted(ValueError):
    """The model or the batch cannot take a plan; the message says which number does not fit."""


@dataclass
class Facts:
    """What :func:`model_facts` measured (bytes refer to the whole global batch)."""

    model: nn.Module
    layers: list[nn.Module]
    batch: int
    param_bytes: list[int]
    act_bytes: list[int]
    act_ac_bytes: list[int] | None
    out_bytes: list[int]
    in_bytes: int
    linear_io: dict[int, tuple[int, int]]
    optimizer_ratio: float
    blocks: type | None = None
    colwise: list[str] = field(default_factory=list)
    rowwise: list[str] = field(default_factory=list)


def _tensor(out):
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
        return out[0]
    return None


def _nbytes(t) -> int:
    return 0 if t is None else t.numel() * t.element_size()


def _saved_per_layer(model, layers, x, y, loss_fn):
    """Bytes autograd saves in each layer's forward (parameters left out), and each layer's output."""
    current, seen = [0], set()
    for p in model.parameters():
        seen.add(p.untyped_storage().data_ptr())
    saved, out_bytes = [0] * len(layers), [0] * len(layers)

    def pack(t):
        for local in local_tensors(t):
            # Saved tensors live until backward, so a storage is never reused meanwhile.
            key = local.untyped_storage().data_ptr()
            if key not in seen:
                seen.add(key)
                saved[current[0]] += local.untyped_storage().nbytes()
        return t

    def pre(i):
        return lambda module, args: current.__setitem__(0, i)

    def post(i):
        return lambda module, args, out: out_bytes.__setitem__(i, _nbytes(_tensor(out)))

    hooks = [layer.register_forward_pre_hook(pre(i)) for i, layer in enumerate(layers)]
    hooks += [layer.register_forward_hook(post(i)) for i, layer in enumerate(layers)]
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = loss_fn(model(x), y)  # the loss's own saves count to the last layer
    finally:
        for h in hooks:
            h.remove()
    return saved, out_bytes, loss


def model_facts(
    build_model: Callable[[], nn.Module],
    batch: tuple[torch.Tensor, torch.Tensor],
    *,
    loss_fn: Callable = nn.functional.mse_loss,
    optimizer: type[torch.optim.Optimizer] = torch.optim.Adam,
    optimizer_kwargs: dict | None = None,
    blocks: type | None = None,
    colwise=None,
    rowwise=None,
    seed: int = 0,
) -> Facts:
    """Measure ``build_model()`` on the global ``batch`` in this process (CPU): see the module docstring.

    One forward and backward of the whole batch, one optimizer step, and with
    ``blocks`` one more forward with every block checkpointed. Keep it small:
    the same cost as one single-process training step.
    """
    from nbdist.strategies.arguments import require_builder
    from nbdist.strategies.optim.optimizers import state_bytes

    require_builder(build_model, "model_facts")
    if not isinstance(batch, (tuple, list)) or len(batch) != 2:
        # One tensor would be unpacked along its first dimension as (inputs, targets).
        raise TypeError(
            f"batch must be (inputs, targets), a pair of tensors, got "
            f"{type(batch).__name__}{f' of shape {tuple(batch.shape)}' if isinstance(batch, torch.Tensor) else ''}"
            ": pass batch=(x, y)"
        )
    x, y = batch
    if not isinstance(x, torch.Tensor) or not isinstance(y, torch.Tensor) or len(x) != len(y):
        raise TypeError(
            "batch must be (inputs, targets): two tensors with the same first dimension"
        )
    x, y = x.cpu(), y.cpu()
    torch.manual_seed(seed)
    model = build_model().cpu()
    layers = list(model) if isinstance(model, nn.Sequential) else [model]
    linear_io: dict[int, tuple[int, int]] = {}

    def io(module, args, out):
        linear_io[id(module)] = (_nbytes(_tensor(args)), _nbytes(_tensor(out)))

    hooks = [m.register_forward_hook(io) for m in model.modules() if isinstance(m, nn.Linear)]
    try:
        act, out_bytes, loss = _saved_per_layer(model, layers, x, y, loss_fn)
    finally:
        for h in hooks:
            h.remove()
    act_ac = None
    if blocks is not None:
        checkpointed = copy.deepcopy(model)
        apply_ac(checkpointed, blocks=blocks)
        ac_layers = (
            list(checkpointed) if isinstance(checkpointed, nn.Sequential) else [checkpointed]
        )
        act_ac, _, _ = _saved_per_layer(checkpointed, ac_layers, x, y, loss_fn)
    loss.backward()
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    opt = optimizer(model.parameters(), **(optimizer_kwargs or {"lr": 1e-3}))
    opt.step()
    ratio = state_bytes(opt) / max(params, 1)
    model.zero_grad(set_to_none=True)
    return Facts(
        model=model,
        layers=layers,
        batch=len(x),
        param_bytes=[sum(p.numel() * p.element_size() for p in lay.parameters()) for lay in layers],
        act_bytes=act,
        act_ac_bytes=act_ac,
        out_bytes=out_bytes,
        in_bytes=_nbytes(x),
        linear_io=linear_io,
        optimizer_ratio=ratio,
        blocks=blocks,
        colwise=list(colwise or []),
        rowwise=list(rowwise or []),
    )


def _tp_layers(facts: Facts, part: nn.Module, tp: int) -> tuple[list, list]:
    """(column-parallel, row-parallel) ``nn.Linear`` modules of ``part`` under ``tp``; checks sizes."""
    from nbdist.strategies.parallel.tensor_parallel import linear_pairs

    if facts.blocks is None:
        try:
            cols, rows = linear_pairs(part, tp)
        except ValueError as exc:
            raise NotAdmitted(f"tp {tp}: {exc}") from None
        return [part.get_submodule(n) for n in cols], [part.get_submodule(n) for n in rows]
    cols, rows = [], []
    for _, block in plan_units(part, facts.blocks):
        for names, out, kind in ((facts.colwise, cols, "out"), (facts.rowwise, rows, "in")):
            for name in names:
                layer = block.get_submodule(name)
                size = layer.out_features if kind == "out" else layer.in_features
                if size % tp:
                    raise NotAdmitted(f"tp {tp} does not divide {name}.{kind}_features ({size})")
                out.append(layer)
    if not cols and not rows and tp > 1 and not facts.colwise and not facts.rowwise:
        raise NotAdmitted(f"tp {tp}: name the layers to split with colwise= and rowwise=")
    return cols, rows


def _pbytes(module: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


def _local_bytes(module: nn.Module, cols: list, rows: list, tp: int) -> float:
    """Parameter bytes of ``module`` one tensor-parallel rank keeps."""
    inside = {id(m) for m in module.modules()}
    # Column-parallel layers split weight and bias; row-parallel ones only the weight.
    split = sum(_pbytes(c) for c in cols if id(c) in inside)
    split += sum(r.weight.numel() * r.weight.element_size() for r in rows if id(r) in inside)
    return _pbytes(module) - split + split / tp


def estimate(facts: Facts, plan: Plan, *, microbatches: int | None = None) -> dict:
    """Bytes per rank of ``plan`` on its busiest rank (see the module docstring), or :class:`NotAdmitted`.

    Returns ``memory`` (peak estimate), its parts ``params``, ``grads``,
    ``optimizer``, ``activations``, ``transient``, and ``comm`` (payload per
    step), ``bubble`` (the pipeline's idle share) and ``microbatches``.
    """
    dp, tp, pp = plan.dp, plan.tp, plan.pp
    B = facts.batch
    if B % dp:
        raise NotAdmitted(f"dp {dp} does not divide the global batch ({B})")
    rb = B // dp  # samples per data-parallel replica
    if plan.ac and (facts.blocks is None or facts.act_ac_bytes is None):
        raise NotAdmitted("checkpointing needs blocks= (the class of the repeated blocks)")
    m = 1
    if pp > 1:
        if not isinstance(facts.model, nn.Sequential):
            raise NotAdmitted(f"pp {pp} needs an nn.Sequential model to cut into stages")
        if len(facts.layers) < pp:
            raise NotAdmitted(f"pp {pp} stages need {pp} layers, the model has {len(facts.layers)}")
        m = microbatches or next((k for k in (2 * pp, pp) if rb % k == 0), 0)
        if not m or rb % m or m < pp:
            raise NotAdmitted(
                f"pp {pp}: each replica's {rb} samples (batch {B} / dp {dp}) do not split into "
                f"{microbatches or f'{2 * pp} or {pp}'} micro-batches (1F1B needs at least {pp})"
            )
        parts = split_sequential(facts.model, pp)
    else:
        parts = [facts.model]
    index = {id(layer): i for i, layer in enumerate(facts.layers)}
    act = facts.act_ac_bytes if plan.ac else facts.act_bytes
    worst: dict = {}
    for s, part in enumerate(parts):
        ids = [index[id(layer)] for layer in part] if pp > 1 else list(range(len(facts.layers)))
        cols, rows = _tp_layers(facts, part, tp) if tp > 1 else ([], [])
        local = _local_bytes(part, cols, rows, tp)
        units = plan_units(part, facts.blocks) or [("", part)]
        unit_local = max(_local_bytes(u, cols, rows, tp) for _, u in units)
        if plan.shard == "fsdp" and dp > 1:
            params = grads = local / dp
            optim = facts.optimizer_ratio * local / dp
            transient = 2 * unit_local  # one unit gathered whole, and its unsharded gradient
            comm = 3 * local
        else:
            params = grads = local
            optim = facts.optimizer_ratio * (local / dp if plan.shard == "zero1" else local)
            transient = local if dp > 1 else 0  # DDP's gradient buckets
            comm = (2 * local if plan.shard == "zero1" else local) if dp > 1 else 0
        inflight = min(m, pp - s) / m if pp > 1 else 1.0
        activations = sum(act[i] for i in ids) * rb / B * inflight
        if plan.ac:
            # Backward recomputes one block at a time: its full activations for one micro-batch.
            per_block = [
                (facts.act_bytes[i] - act[i])
                / max(1, sum(isinstance(b, facts.blocks) for b in facts.layers[i].modules()))
                for i in ids
            ]
            transient += max(per_block, default=0) * rb / B / m
        if tp > 1:
            # Forward all-reduce of each row-parallel output, backward of each column-parallel input.
            io = sum(facts.linear_io[id(r)][1] for r in rows) + sum(
                facts.linear_io[id(c)][0] for c in cols
            )
            comm += io * rb / B
        if pp > 1:
            into = facts.in_bytes if ids[0] == 0 else facts.out_bytes[ids[0] - 1]
            sent = (into if s > 0 else 0) + (facts.out_bytes[ids[-1]] if s < pp - 1 else 0)
            comm += 2 * sent * rb / B  # activations forward, their gradients back
        total = params + grads + optim + activations + transient
        if total > worst.get("memory", -1):
            worst = dict(
                memory=total,
                params=params,
                grads=grads,
                optimizer=optim,
                activations=activations,
                transient=transient,
            )
        worst["comm"] = max(worst.get("comm", 0), comm)
    worst["bubble"] = (pp - 1) / (m + pp - 1)
    worst["microbatches"] = m
    return worst


def _factorisations(world: int) -> list[tuple[int, int, int]]:
    return [
        (dp, tp, world // (dp * tp))
        for dp in range(world, 0, -1)
        if world % dp == 0
        for tp in range(1, world // dp + 1)
        if (world // dp) % tp == 0
    ]


def enumerate_plans(facts: Facts, world_size: int, *, microbatches: int | None = None) -> list:
    """Every plan for ``world_size`` ranks: ``[(plan, estimate dict or NotAdmitted), ...]``.

    The space: each ``dp × tp × pp`` factorisation; sharding DDP, ZeRO-1 or
    FSDP2 for pure data parallelism (FSDP2 in 2D/3D layouts); activation
    checkpointing off and, with ``blocks``, on.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    out = []
    for dp, tp, pp in _factorisations(world_size):
        shards = ("ddp", "zero1", "fsdp") if dp > 1 and tp == pp == 1 else ("fsdp",)
        for shard in shards:
            for ac in (False, True) if facts.blocks is not None else (False,):
                plan = Plan(dp=dp, tp=tp, pp=pp, shard=shard, ac=ac)
                try:
                    out.append((plan, estimate(facts, plan, microbatches=microbatches)))
                except NotAdmitted as exc:
                    out.append((plan, exc))
    return out
