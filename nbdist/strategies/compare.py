"""Rank side: train one model under DDP, ZeRO-1, FSDP2, tensor and pipeline parallelism; measure each.

:func:`compare` runs on every rank (in ``%%on_all_ranks``). For each strategy it
builds the model afresh (same seed on every rank), trains a few steps on the
*same global batch* and returns one row per strategy: throughput, time per step,
peak memory per rank, bytes communicated per rank and step, and the final loss.
Because every strategy computes the same mathematics on the same data, the
losses agree; the costs differ. Each plan is made by the function a user would
call (:func:`~nbdist.strategies.fsdp.apply_fsdp`, ...).
``nbdist.dashboard.compare.table`` and ``chart`` show the rows in the notebook.

How each strategy sees the data: ``make_batch(step, rank)`` gives one rank's
share; DDP, ZeRO and FSDP give rank ``r`` its own share; tensor and pipeline
parallelism (over all ranks) feed every rank / the first stage the concatenated
global batch (the pipeline splits it into micro-batches).

How it measures:

- **time**: ``warmup`` untimed steps, then ``steps`` timed steps between two
  barriers; throughput = global batch × steps / the slowest rank's time.
- **bytes communicated**: one extra step under
  :class:`~nbdist.strategies.measure.CommBytes`, which sees every collective and
  send/recv as it reaches torch's dispatcher (DDP's C++ reducer included) and
  counts its tensor payload. Set-up traffic (DDP's initial broadcast, barriers)
  is not counted.
- **peak memory**: one more step under :func:`~nbdist.strategies.measure.peak_bytes`:
  CUDA's allocator peak on GPUs (set-up and all steps), on CPU the tensors alive
  before the step plus the profiler's highest allocation level during it.

Example (on every rank)::

    from nbdist.strategies.compare import compare
    rows = compare(lambda: nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64)),
                   lambda step, rank: (torch.randn(32, 64), torch.randn(32, 64)),
                   steps=10)

and in the notebook::

    rows = %dist_pull rows --rank 0
    from nbdist.dashboard.compare import chart, table
    table(rows); chart(rows)
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from nbdist.metrics.log import log as _log_metric
from nbdist.strategies.fsdp import apply_fsdp
from nbdist.strategies.measure import CommBytes, peak_bytes, resident_bytes
from nbdist.strategies.pipeline import pipeline_schedule
from nbdist.strategies.tensor_parallel import apply_tp, device_mesh, linear_pairs
from nbdist.strategies.zero import zero_optimizer

__all__ = ["STRATEGIES", "compare"]

STRATEGIES = ("ddp", "zero", "fsdp", "tp", "pp")


def _setup(name, build, device, optimizer, optimizer_kwargs, tp_plan, microbatches, loss_fn):
    """(params, optimizer, forward_backward(x, y, xg, yg) -> loss or None) for one strategy.

    Each plan is made by the same function a user calls (``apply_fsdp``,
    ``apply_tp``, ``zero_optimizer``, ``pipeline_schedule``).
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    model = build().to(device)
    feed_global = False  # tensor parallel: every rank gets the whole batch
    if name in ("ddp", "zero"):
        from torch.nn.parallel import DistributedDataParallel as DDP

        model = DDP(model)
        if name == "zero":
            opt = zero_optimizer(model.parameters(), optimizer, **optimizer_kwargs)
        else:
            opt = optimizer(model.parameters(), **optimizer_kwargs)
    elif name == "fsdp":
        blocks = [c for c in model.children() if any(True for _ in c.parameters())]
        # reshard_after_forward=None: torch's default (the root keeps its parameters
        # gathered for backward), as compare has always measured FSDP2.
        mesh = device_mesh(device_type=device.type)
        apply_fsdp(model, blocks=blocks, mesh=mesh, reshard_after_forward=None)
        opt = optimizer(model.parameters(), **optimizer_kwargs)
    elif name == "tp":
        mesh = device_mesh(device_type=device.type)
        if tp_plan:  # the caller's own parallelize_module plan
            model = apply_tp(model, mesh, plan=tp_plan)
        else:
            try:
                colwise, rowwise = linear_pairs(model, world)
            except ValueError as exc:
                raise ValueError(f"{exc}; or pass tp_plan=..., or leave 'tp' out") from None
            model = apply_tp(model, mesh, colwise=colwise, rowwise=rowwise)
        opt = optimizer(model.parameters(), **optimizer_kwargs)
        feed_global = True
    elif name == "pp":
        try:
            stage, schedule = pipeline_schedule(
                model, n_microbatches=microbatches, loss_fn=loss_fn, schedule="gpipe", device=device
            )
        except (TypeError, ValueError) as exc:
            raise ValueError(f"pipeline parallel: {exc}; or leave 'pp' out") from None
        model = stage.submod
        opt = optimizer(model.parameters(), **optimizer_kwargs)

        def fb(x, y, xg, yg):
            if rank == 0:
                schedule.step(xg)
                return None
            if rank == world - 1:
                losses = []
                schedule.step(target=yg, losses=losses)
                return torch.stack([loss.detach() for loss in losses]).mean()
            schedule.step()
            return None

        return list(model.parameters()), opt, fb
    else:
        raise ValueError(f"strategy {name!r} is not known; choose from {', '.join(STRATEGIES)}")

    def fb(x, y, xg, yg):
        inputs, targets = (xg, yg) if feed_global else (x, y)
        loss = loss_fn(model(inputs), targets)
        loss.backward()
        return loss.detach()

    return list(model.parameters()), opt, fb


def compare(
    build_model: Callable[[], nn.Module],
    make_batch: Callable[[int, int], tuple[torch.Tensor, torch.Tensor]],
    *,
    strategies: Sequence[str] = STRATEGIES,
    steps: int = 5,
    warmup: int = 2,
    loss_fn: Callable = nn.functional.mse_loss,
    optimizer: type[torch.optim.Optimizer] = torch.optim.Adam,
    optimizer_kwargs: dict | None = None,
    tp_plan: dict | None = None,
    microbatches: int | None = None,
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
    micro-batches (default ``2 * world_size``). With ``log=True`` each timed
    step goes to the live dashboard (``nbdist.log``: ``loss_<strategy>``, ``samples``).

    Each row: ``strategy``, ``samples_per_s``, ``step_ms``, ``peak_mib`` (list,
    per rank), ``comm_mib`` (list: payload per rank and step), ``comm_ops``
    (collective counts on this rank), ``loss`` (global-batch loss after the last
    timed step). Every rank returns the same rows.

    Example::

        rows = compare(build, make_batch, strategies=("ddp", "fsdp"), steps=10)
    """
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
    rows = []
    for name in strategies:
        _reset(device, seed)
        built = _setup(name, build_model, device, optimizer, kwargs, tp_plan, microbatches, loss_fn)
        rows.append(_measure(name, built, device, **run))
    return rows


def _reset(device: torch.device, seed: int) -> None:
    # Before each strategy: same initial weights everywhere, a fresh memory peak.
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    torch.manual_seed(seed)


def _measure(name, built, device, *, warmup, steps, batches, global_batch, log_every) -> dict:
    params, opt, fb = built
    rank, world = dist.get_rank(), dist.get_world_size()

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
            values = {f"loss_{name}": loss} if loss is not None else {}
            _log_metric(step=i, samples=global_batch // world, **values)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    # On the rank's device: NCCL reduces only GPU tensors.
    elapsed = torch.tensor([time.perf_counter() - t0], dtype=torch.float64, device=device)
    # The final loss lives on the last pipeline stage; elsewhere every rank has one.
    loss_t = torch.zeros(1, dtype=torch.float64, device=device)
    if name != "pp" or rank == world - 1:
        loss_t[0] = float(loss)
    with CommBytes() as comm:
        step(warmup + steps)
    opt.zero_grad(set_to_none=True)
    resident = resident_bytes(params, opt)
    peak = peak_bytes(lambda: step(warmup + steps + 1), resident=resident, device=device)
    stats = torch.tensor([peak, comm.bytes], dtype=torch.float64, device=device)
    gathered = [torch.zeros_like(stats) for _ in range(world)]
    dist.all_gather(gathered, stats)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    dist.all_reduce(loss_t, op=dist.ReduceOp.SUM)
    if name != "pp":
        loss_t /= world  # mean of the ranks' shares = the global batch's loss
    seconds = elapsed.item()
    dist.barrier()
    return {
        "strategy": name,
        "samples_per_s": global_batch * steps / seconds,
        "step_ms": 1000 * seconds / steps,
        "peak_mib": [round(g[0].item() / 2**20, 3) for g in gathered],
        "comm_mib": [round(g[1].item() / 2**20, 3) for g in gathered],
        "comm_ops": dict(sorted(comm.ops.items())),
        "loss": loss_t.item(),
    }
