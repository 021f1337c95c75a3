"""Rank side: train one model under DDP, ZeRO-1, FSDP2, tensor, pipeline, 2D/3D parallelism and
compressed communication; measure each.

:func:`compare` runs on every rank (in ``%%on_all_ranks``). For each strategy it
builds the model afresh (same seed on every rank), trains a few steps on the
*same global batch* and returns one row per strategy: throughput, time per step,
peak memory per rank, bytes communicated per rank and step, and the final loss.
Because every strategy computes the same mathematics on the same data, the
losses agree; the costs differ. Each plan is made by the function a user would
call: FSDP2, tensor and pipeline parallel (alone or as 2D/3D) by
:func:`~nbdist.strategies.parallel.parallelize.parallelize`, the others by DDP,
``zero_optimizer``, ``apply_comm_hook`` or ``apply_onebit_adam``.
``nbdist.dashboard.plan_comparison.comparison_table`` and ``comparison_chart``
show the rows in the notebook.

The default five (:data:`DEFAULT_STRATEGIES`) are ``ddp``, ``zero``, ``fsdp``,
``tp`` and ``pp``. On request (``strategies=...``) come:

- ``fsdp_tp``: 2D, tensor parallel over ``tp_size`` neighbouring ranks, FSDP2
  over the ``world / tp_size`` replicas;
- ``3d``: ``dp × tp × pp`` with ``tp_size`` and ``pp_size`` (``dp`` takes the
  rest: 8 ranks give 2 × 2 × 2, 4 ranks 1 × 2 × 2), a 1F1B schedule;
- ``ddp_fp16``, ``ddp_bf16``, ``ddp_powersgd``: DDP with a compressed
  communication hook (:func:`~nbdist.strategies.optim.compression.apply_comm_hook`);
- ``onebit_adam``: Adam's momentum all-reduced as signs
  (:func:`~nbdist.strategies.optim.onebit_adam.apply_onebit_adam`; needs Adam).

PowerSGD and 1-bit Adam start compressing after ``compress_after`` steps
(default ``warmup``: the timed steps are compressed, so their bytes show the
saving, and their losses drift a little from DDP's). 2D and 3D are built by
:func:`~nbdist.strategies.plan.build.build_plan`, the builder ``autoplan``
uses; ``blocks``/``colwise``/``rowwise`` tell it a transformer's layout,
otherwise tensor parallel pairs the ``nn.Linear`` layers.

How each strategy sees the data: ``make_batch(step, rank)`` gives one rank's
share; DDP, ZeRO, FSDP and the compressed ones give rank ``r`` its own share;
tensor and pipeline parallelism (over all ranks) feed every rank / the first
stage the concatenated global batch (the pipeline splits it into
micro-batches); 2D/3D cut the global batch into one chunk per ``dp`` replica.

How it measures:

- **time**: ``warmup`` untimed steps, then ``steps`` timed steps between two
  barriers; throughput = global batch × steps / the slowest rank's time.
- **bytes communicated**: one extra step under
  :class:`~nbdist.strategies.measure.CommBytes`, which sees every collective and
  send/recv as it reaches torch's dispatcher (DDP's C++ reducer included) and
  counts its tensor payload. Set-up traffic (DDP's initial broadcast, barriers)
  is not counted.
- **peak memory**: one more step under :func:`~nbdist.strategies.measure.peak_bytes`:
  CUDA's allocator peak on GPUs (set-up and all steps) above what the rank held
  before the strategy was built (the batches, the caller's tensors; the strategy
  before it is freed first), on CPU the tensors alive before the step plus the
  profiler's highest allocation level during it.

Example (on every rank)::

    from nbdist.strategies.plan.compare import compare
    rows = compare(lambda: nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64)),
                   lambda step, rank: (torch.randn(32, 64), torch.randn(32, 64)),
                   steps=10)

and in the notebook::

    rows = %dist_pull rows --rank 0
    from nbdist.dashboard.plan_comparison import comparison_chart, comparison_table
    comparison_table(rows); comparison_chart(rows)
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import nn

from nbdist.metrics.log import log as _log_metric
from nbdist.strategies.measure import CommBytes, device_baseline, peak_bytes, resident_bytes
from nbdist.strategies.parallel.mesh import ParallelDims
from nbdist.strategies.parallel.parallelize import parallelize
from nbdist.strategies.parallel.tensor_parallel import device_mesh, linear_pairs
from nbdist.strategies.parallel.zero import zero_optimizer
from nbdist.strategies.plan.build import Plan, build_plan, reduce_loss

__all__ = ["DEFAULT_STRATEGIES", "STRATEGIES", "compare", "measure_steps"]

DEFAULT_STRATEGIES = ("ddp", "zero", "fsdp", "tp", "pp")
_LAYERED, _COMPRESSED = ("fsdp_tp", "3d"), ("ddp_fp16", "ddp_bf16", "ddp_powersgd", "onebit_adam")
STRATEGIES = DEFAULT_STRATEGIES + _LAYERED + _COMPRESSED


class _Setup(NamedTuple):
    """One strategy made on this rank: what :func:`measure_steps` needs.

    ``forward_backward(x, y, xg, yg)`` takes this rank's share and the global
    batch and returns the loss (or ``None``); ``counter`` is the ``CommCounter``
    a compressed strategy fills (``None``: ``CommBytes`` counts).
    """

    params: list
    optimizer: torch.optim.Optimizer
    forward_backward: Callable
    counter: object = None


def _dims(name: str, world: int, layout: dict) -> ParallelDims:
    """The ``dp × tp × pp`` layout of strategy ``name`` on ``world`` ranks."""
    if name in _LAYERED:
        pp = layout["pp_size"] if name == "3d" else 1
        # dp=-1: what tp × pp leave; the error shows the numbers and a layout that fits.
        return ParallelDims(world, dp=-1, tp=layout["tp_size"], pp=pp)
    if name == "tp":
        return ParallelDims(world, dp=1, tp=world)
    if name == "pp":
        return ParallelDims(world, dp=1, pp=world)
    return ParallelDims(world, dp=world)


def _setup(
    name, build, device, optimizer, optimizer_kwargs, tp_plan, microbatches, loss_fn, layout
):
    """One strategy made on this rank, by the function a user calls: a :class:`_Setup`.

    FSDP2, tensor and pipeline parallel alone and 2D/3D go through ``parallelize``
    (2D/3D by ``build_plan``, the builder autoplan uses); the data-parallel ones
    through DDP, ``zero_optimizer``, ``apply_comm_hook`` or ``apply_onebit_adam``.
    """
    dims = _dims(name, dist.get_world_size(), layout)
    if name in _LAYERED:
        # The plan autoplan would build, on the global batch cut per dp replica.
        built = build_plan(
            build,
            Plan(dp=dims.dp, tp=dims.tp, pp=dims.pp),
            loss_fn=loss_fn,
            optimizer=optimizer,
            optimizer_kwargs=optimizer_kwargs,
            microbatches=microbatches,
            device=device,
            blocks=layout["blocks"],
            colwise=layout["colwise"],
            rowwise=layout["rowwise"],
        )
        return _Setup(
            built.params, built.optimizer, lambda x, y, xg, yg: built.forward_backward(xg, yg)
        )
    model = build().to(device)
    if name in ("fsdp", "tp", "pp"):
        return _one_dimension(
            name, model, dims, device, optimizer, optimizer_kwargs, tp_plan, microbatches, loss_fn
        )
    return _data_parallel(name, model, optimizer, optimizer_kwargs, loss_fn, layout)


def _one_dimension(name, model, dims, device, optimizer, kwargs, tp_plan, microbatches, loss_fn):
    # FSDP2, tensor or pipeline parallel over all ranks, on a 1-D mesh of the world (its
    # process group is the default one, as for a user's apply_fsdp/apply_tp/pipeline_schedule).
    mesh = device_mesh(
        (dims.world_size,), (name if name != "fsdp" else "dp",), device_type=device.type
    )
    if name == "fsdp":
        # reshard_after_forward=None: torch's default (the root keeps its parameters
        # gathered for backward), as compare has always measured FSDP2.
        done = parallelize(
            model, dims, mesh=mesh, reshard_after_forward=None, device=device, caller="compare"
        )
        return _Setup(
            list(done.model.parameters()),
            optimizer(done.model.parameters(), **kwargs),
            _local_step(done.model, loss_fn, feed_global=False),
        )
    if name == "tp":
        colwise = rowwise = None
        if not tp_plan:  # else the caller's own parallelize_module plan
            try:
                colwise, rowwise = linear_pairs(model, dims.tp)
            except ValueError as exc:
                raise ValueError(f"{exc}; or pass tp_plan=..., or leave 'tp' out") from None
        done = parallelize(
            model,
            dims,
            mesh=mesh,
            colwise=colwise,
            rowwise=rowwise,
            tp_plan=tp_plan,
            device=device,
            caller="compare",
        )
        # Tensor parallel: every rank gets the whole batch.
        return _Setup(
            list(done.model.parameters()),
            optimizer(done.model.parameters(), **kwargs),
            _local_step(done.model, loss_fn, feed_global=True),
        )
    try:
        done = parallelize(
            model,
            dims,
            mesh=mesh,
            n_microbatches=microbatches,
            loss_fn=loss_fn,
            schedule="gpipe",
            device=device,
            caller="compare",
        )
    except (TypeError, ValueError) as exc:
        raise ValueError(f"pipeline parallel: {exc}; or leave 'pp' out") from None
    stage, schedule = done.stage, done.schedule

    def fb(x, y, xg, yg):
        # The first stage feeds the global batch in, the last gets its targets.
        if stage.is_first:
            schedule.step(xg)
            return None
        if stage.is_last:
            losses = []
            schedule.step(target=yg, losses=losses)
            return torch.stack([loss.detach() for loss in losses]).mean()
        schedule.step()
        return None

    return _Setup(list(done.model.parameters()), optimizer(done.model.parameters(), **kwargs), fb)


def _data_parallel(name, model, optimizer, kwargs, loss_fn, layout):
    # DDP, ZeRO-1 and the compressed ones: every rank trains on its own share.
    from torch.nn.parallel import DistributedDataParallel as DDP

    counter = None  # what a compressed strategy's own counter says it sent
    if name.startswith("ddp_"):
        from nbdist.strategies.optim.compression import apply_comm_hook

        # One bucket for PowerSGD: on gloo the P and Q all-reduces of two buckets' hooks
        # interleave differently on each rank and gloo aborts ("Received data size doesn't
        # match expected size"; torch 2.13, any model over DDP's 1 MiB first bucket).
        grads_mib = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
        model = DDP(model, bucket_cap_mb=2 * grads_mib + 1 if name == "ddp_powersgd" else None)
        # PowerSGD's plain all-reduce steps: at least 2 (DDP rebuilds its buckets after step 1).
        counter = apply_comm_hook(model, name[4:], start_iter=max(2, layout["compress_after"]))
        opt = optimizer(model.parameters(), **kwargs)
    elif name == "onebit_adam":
        from nbdist.strategies.optim.onebit_adam import apply_onebit_adam

        if optimizer is not torch.optim.Adam:
            raise ValueError(
                f"onebit_adam is Adam with 1-bit momentum, but optimizer={optimizer.__name__}: "
                "pass optimizer=torch.optim.Adam, or leave 'onebit_adam' out"
            )
        adam = {k: v for k, v in kwargs.items() if k in ("lr", "betas", "eps", "weight_decay")}
        opt = apply_onebit_adam(model, freeze_step=max(1, layout["compress_after"]), **adam)
        counter = opt.counter
    elif name in ("ddp", "zero"):
        model = DDP(model)
        if name == "zero":
            opt = zero_optimizer(model.parameters(), optimizer, **kwargs)
        else:
            opt = optimizer(model.parameters(), **kwargs)
    else:
        raise ValueError(f"strategy {name!r} is not known; choose from {', '.join(STRATEGIES)}")
    return _Setup(
        list(model.parameters()), opt, _local_step(model, loss_fn, feed_global=False), counter
    )


def _local_step(model, loss_fn, *, feed_global: bool) -> Callable:
    def fb(x, y, xg, yg):
        inputs, targets = (xg, yg) if feed_global else (x, y)
        loss = loss_fn(model(inputs), targets)
        loss.backward()
        return loss.detach()

    return fb


def compare(
    build_model: Callable[[], nn.Module],
    make_batch: Callable[[int, int], tuple[torch.Tensor, torch.Tensor]],
    *,
    strategies: Sequence[str] = DEFAULT_STRATEGIES,
    steps: int = 5,
    warmup: int = 2,
    loss_fn: Callable = nn.functional.mse_loss,
    optimizer: type[torch.optim.Optimizer] = torch.optim.Adam,
    optimizer_kwargs: dict | None = None,
    tp_plan: dict | None = None,
    microbatches: int | None = None,
    blocks: type | None = None,
    colwise: Sequence[str] | None = None,
    rowwise: Sequence[str] | None = None,
    tp_size: int = 2,
    pp_size: int = 2,
    compress_after: int | None = None,
    seed: int = 0,
    device: torch.device | str | None = None,
    log: bool = True,
) -> list[dict]:
    """Train ``build_model()`` under each strategy; one row of measurements per strategy.

    Call it on every rank, with the same arguments. ``build_model()`` builds the
    model on the CPU (seeded with ``seed``, so identical on every rank);
    ``make_batch(step, rank)`` returns ``(inputs, targets)``, rank ``rank``'s
    share of step ``step`` (deterministic, so any rank can rebuild the global
    batch). ``loss_fn(output, target)`` must average over the batch. ``'tp'``
    pairs the model's ``nn.Linear`` layers column- then row-parallel (or uses
    ``tp_plan``, a ``parallelize_module`` plan); ``'pp'`` needs an
    ``nn.Sequential`` and splits it into one stage per rank, ``microbatches``
    micro-batches (default ``2 * world_size``; ``2 * pp_size`` for ``'3d'``).
    ``'fsdp_tp'`` and ``'3d'`` use ``tp_size``/``pp_size`` and, for a
    transformer, ``blocks`` (its block class) with ``colwise``/``rowwise``
    (layer names inside one block); ``compress_after``: plain steps before
    PowerSGD and 1-bit Adam compress (default ``warmup``). With ``log=True``
    each timed step goes to the live dashboard (``nbdist.log``:
    ``loss_<strategy>``, ``samples``).

    Each row: ``strategy``, ``layout`` (``dp × tp × pp``), ``samples_per_s``,
    ``step_ms``, ``peak_mib`` (list, per rank), ``comm_mib`` (list: payload per rank and step), ``comm_ops``
    (collective counts on this rank), ``loss`` (global-batch loss after the last
    timed step). Every rank returns the same rows.

    Example::

        rows = compare(build, make_batch, strategies=("ddp", "fsdp"), steps=10)
    """
    from nbdist.strategies.arguments import require_builder

    require_builder(build_model, "compare")
    if isinstance(strategies, str):  # not split into letters
        raise TypeError(
            f"compare: strategies={strategies!r} is one string; give a list, e.g. "
            f"strategies=[{strategies!r}]"
        )
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("compare() runs on the ranks (%%on_all_ranks): no process group")
    unknown = [s for s in strategies if s not in STRATEGIES]
    if unknown or not strategies:
        raise ValueError(f"strategies={tuple(strategies)!r}: choose from {STRATEGIES}")
    if steps < 1 or warmup < 0:
        raise ValueError(f"steps ({steps}) must be >= 1 and warmup ({warmup}) >= 0")
    from nbdist.engine.helpers import device as rank_device

    device = torch.device(device) if device is not None else rank_device()
    rank, world = dist.get_rank(), dist.get_world_size()
    micro_3d = microbatches or 2 * pp_size  # per dp replica, over pp_size stages
    microbatches = microbatches or 2 * world
    kwargs = dict(optimizer_kwargs or {"lr": 1e-3})

    def batch(step):
        x, y = make_batch(step, rank)
        shares = [make_batch(step, r) for r in range(world)]
        xg = torch.cat([s[0] for s in shares]).to(device)
        yg = torch.cat([s[1] for s in shares]).to(device)
        return x.to(device), y.to(device), xg, yg

    global_batch = sum(len(make_batch(0, r)[0]) for r in range(world))
    total = warmup + steps + 2  # + one counted step, + one profiled step (CPU)
    batches = [batch(s) for s in range(total)]
    run = dict(
        warmup=warmup, steps=steps, batches=batches, global_batch=global_batch, log_every=log
    )
    after = warmup if compress_after is None else compress_after
    layout = dict(blocks=blocks, colwise=colwise, rowwise=rowwise, tp_size=tp_size)
    layout.update(pp_size=pp_size, compress_after=after)
    rows = []
    for name in strategies:
        torch.manual_seed(seed)  # the same initial weights for every strategy
        base = device_baseline(device)
        m = micro_3d if name == "3d" else microbatches
        made = _setup(name, build_model, device, optimizer, kwargs, tp_plan, m, loss_fn, layout)
        row = measure_steps(
            name,
            made.params,
            made.optimizer,
            made.forward_backward,
            device=device,
            counter=made.counter,
            **run,
        )
        # Freed before the next strategy is built: on CUDA its tensors would count in the
        # next one's peak (ZeRO's would hold all of DDP's model, gradients and Adam state).
        del made
        gc.collect()
        row["peak_mib"] = [round(p - b / 2**20, 3) for p, b in zip(row["peak_mib"], base)]
        dims = _dims(name, world, layout)
        rows.append(
            {"strategy": name, "layout": f"dp {dims.dp} × tp {dims.tp} × pp {dims.pp}", **row}
        )
    return rows


def measure_steps(
    name: str,
    params: list,
    opt,
    fb: Callable,
    *,
    device: torch.device,
    warmup: int,
    steps: int,
    batches: Sequence[tuple],
    global_batch: int,
    log_every: bool = True,
    counter=None,
) -> dict:
    """Time, bytes and peak memory of one built plan: what :func:`compare` reports for each.

    ``fb(*batches[i])`` runs forward and backward of step ``i`` and returns
    this rank's loss (a tensor, or ``None`` where the rank computes none);
    ``opt.step()`` follows. ``warmup`` untimed steps, ``steps`` timed ones, one
    under :class:`~nbdist.strategies.measure.CommBytes`, one under
    :func:`~nbdist.strategies.measure.peak_bytes`: ``batches`` needs
    ``warmup + steps + 2`` entries. Call it on every rank; all ranks return
    the same ``samples_per_s``, ``step_ms``, ``peak_mib`` and ``comm_mib``
    (lists per rank) and ``loss`` (mean over the ranks that have one);
    ``comm_ops`` is this rank's. With ``log_every`` each timed step is logged
    as ``loss_<name>`` (non-word characters of ``name`` become ``_``).
    ``counter``: a :class:`~nbdist.strategies.optim.compression.CommCounter` that the
    plan's compression fills; its bytes replace ``CommBytes``' (PowerSGD's
    all-reduce of ``Q`` runs in a callback on another thread, unseen there).
    """
    import re

    world = dist.get_world_size()
    key = "loss_" + re.sub(r"\W", "_", name)

    def step(i):
        opt.zero_grad(set_to_none=True)
        loss = fb(*batches[i])
        opt.step()
        return loss

    for i in range(warmup):
        step(i)
    dist.barrier()
    t0 = time.perf_counter()
    for i in range(warmup, warmup + steps):
        loss = step(i)
        if log_every:
            # The live dashboard: each strategy's loss as its own series, and
            # samples/s of every phase on one throughput chart.
            values = {key: loss} if loss is not None else {}
            _log_metric(step=i, samples=global_batch // world, **values)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    # On the rank's device: NCCL reduces only GPU tensors.
    elapsed = torch.tensor([time.perf_counter() - t0], dtype=torch.float64, device=device)
    if counter is not None:
        counter.take()
    with CommBytes() as comm:
        step(warmup + steps)
    sent = counter.take() if counter is not None else comm.bytes
    opt.zero_grad(set_to_none=True)
    resident = resident_bytes(params, opt)
    peak = peak_bytes(lambda: step(warmup + steps + 1), resident=resident, device=device)
    stats = torch.tensor([peak, sent], dtype=torch.float64, device=device)
    gathered = [torch.zeros_like(stats) for _ in range(world)]
    dist.all_gather(gathered, stats)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    # The last timed step's loss: mean of the ranks' shares = the global batch's loss (a
    # pipeline's lives on its last stages only).
    final_loss = reduce_loss(loss, device)
    seconds = elapsed.item()
    dist.barrier()
    return {
        "samples_per_s": global_batch * steps / seconds,
        "step_ms": 1000 * seconds / steps,
        "peak_mib": [round(g[0].item() / 2**20, 3) for g in gathered],
        "comm_mib": [round(g[1].item() / 2**20, 3) for g in gathered],
        "comm_ops": dict(sorted(comm.ops.items())),
        "loss": final_loss,
    }
