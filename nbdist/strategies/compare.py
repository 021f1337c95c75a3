"""Train one model under DDP, ZeRO-1, FSDP2, tensor and pipeline parallelism, and measure each.

:func:`compare` runs on every rank (in ``%%on_all_ranks``). For each strategy it
builds the model afresh (same seed on every rank), trains a few steps on the
*same global batch* and returns one row per strategy: throughput, time per step,
peak memory per rank, bytes communicated per rank and step, and the final loss.
Because every strategy computes the same mathematics on the same data, the
losses agree; the costs differ. :func:`table` and :func:`chart` show the rows in
the notebook.

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
    from nbdist.strategies.compare import chart, table
    table(rows); chart(rows)
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from nbdist.metrics.log import log as _log_metric
from nbdist.strategies.measure import CommBytes, peak_bytes, resident_bytes

__all__ = ["STRATEGIES", "chart", "compare", "table"]

STRATEGIES = ("ddp", "zero", "fsdp", "tp", "pp")


def _tp_plan(model: nn.Module, world: int) -> dict:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    linears = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    plan = {}
    # Megatron's pairing: a column-parallel layer feeds a row-parallel one, so
    # the activation between them stays sharded and one all-reduce ends the pair.
    for (first, a), (second, _) in zip(linears[0::2], linears[1::2]):
        if a.out_features % world:
            raise ValueError(
                f"tensor parallel shards {first}.out_features ({a.out_features}) over {world} "
                f"ranks: make it divisible by {world}, pass tp_plan=..., or leave 'tp' out"
            )
        plan[first], plan[second] = ColwiseParallel(), RowwiseParallel()
    if not plan:
        raise ValueError("tensor parallel needs at least two nn.Linear layers; leave 'tp' out")
    return plan


def _pp_stage(model: nn.Module, rank: int, world: int) -> nn.Module:
    children = list(model.children()) if isinstance(model, nn.Sequential) else []
    if len(children) < world:
        raise ValueError(
            f"pipeline parallel splits an nn.Sequential into {world} stages; got "
            f"{type(model).__name__} with {len(children)} sequential children: build an "
            "nn.Sequential with at least one layer per rank, or leave 'pp' out"
        )
    # Contiguous stages with about equal parameter counts: cut where the running
    # total is closest to k/world of the whole, keeping one child per stage at least.
    sizes = [sum(p.numel() for p in c.parameters()) for c in children]
    prefix = [0]
    for size in sizes:
        prefix.append(prefix[-1] + size)
    bounds = [0]
    for k in range(1, world):
        lo, hi = bounds[-1] + 1, len(children) - (world - k)
        target = prefix[-1] * k / world
        bounds.append(min(range(lo, hi + 1), key=lambda i: abs(prefix[i] - target)))
    bounds.append(len(children))
    return nn.Sequential(*children[bounds[rank] : bounds[rank + 1]])


def _setup(name, build, device, optimizer, optimizer_kwargs, tp_plan, microbatches, loss_fn):
    """(params, optimizer, forward_backward(x, y, xg, yg) -> loss or None) for one strategy."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model = build().to(device)
    if name in ("ddp", "zero"):
        from torch.nn.parallel import DistributedDataParallel as DDP

        model = DDP(model)
        if name == "zero":
            from torch.distributed.optim import ZeroRedundancyOptimizer

            opt = ZeroRedundancyOptimizer(
                model.parameters(), optimizer_class=optimizer, **optimizer_kwargs
            )
        else:
            opt = optimizer(model.parameters(), **optimizer_kwargs)

        def fb(x, y, xg, yg):
            loss = loss_fn(model(x), y)
            loss.backward()
            return loss.detach()

    elif name == "fsdp":
        from torch.distributed.fsdp import fully_shard

        for child in model.children():
            if any(True for _ in child.parameters()):
                fully_shard(child)
        fully_shard(model)
        opt = optimizer(model.parameters(), **optimizer_kwargs)

        def fb(x, y, xg, yg):
            loss = loss_fn(model(x), y)
            loss.backward()
            return loss.detach()

    elif name == "tp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import parallelize_module

        mesh = init_device_mesh(device.type, (world,))
        model = parallelize_module(model, mesh, tp_plan or _tp_plan(model, world))
        opt = optimizer(model.parameters(), **optimizer_kwargs)

        def fb(x, y, xg, yg):
            loss = loss_fn(model(xg), yg)
            loss.backward()
            return loss.detach()

    elif name == "pp":
        from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

        model = _pp_stage(model, rank, world)
        stage = PipelineStage(model, rank, world, device)
        schedule = ScheduleGPipe(stage, n_microbatches=microbatches, loss_fn=loss_fn)
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

    else:
        raise ValueError(f"strategy {name!r} is not known; choose from {', '.join(STRATEGIES)}")
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


def table(rows: list[dict]):
    """The rows as a pandas DataFrame, one line per strategy, one column per rank's memory/bytes.

    Example::

        table(rows)   # strategy | samples/s | step ms | peak MiB r0 | ... | comm MiB/step r0 | ... | loss
    """
    import pandas as pd

    records = []
    for row in rows:
        record = {
            "strategy": row["strategy"],
            "samples/s": round(row["samples_per_s"], 1),
            "step ms": round(row["step_ms"], 2),
        }
        for r, value in enumerate(row["peak_mib"]):
            record[f"peak MiB r{r}"] = round(value, 2)
        for r, value in enumerate(row["comm_mib"]):
            record[f"comm MiB/step r{r}"] = round(value, 3)
        record["loss"] = row["loss"]
        records.append(record)
    return pd.DataFrame.from_records(records).set_index("strategy")


def chart(rows: list[dict]):
    """A plotly figure: throughput, peak memory per rank, bytes per rank and step, side by side.

    Example::

        chart(rows).show()   # or just ``chart(rows)`` as a cell's last line
    """
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    names = [row["strategy"] for row in rows]
    fig = make_subplots(
        rows=1,
        cols=3,
        subplot_titles=("throughput (samples/s)", "peak memory (MiB)", "communicated (MiB/step)"),
    )
    fig.add_trace(go.Bar(x=names, y=[r["samples_per_s"] for r in rows], name="all ranks"), 1, 1)
    for rank in range(len(rows[0]["peak_mib"])):
        color = f"hsl({(rank * 67) % 360}, 60%, 50%)"
        fig.add_trace(
            go.Bar(
                x=names,
                y=[r["peak_mib"][rank] for r in rows],
                name=f"rank {rank}",
                marker_color=color,
                legendgroup=f"r{rank}",
            ),
            1,
            2,
        )
        fig.add_trace(
            go.Bar(
                x=names,
                y=[r["comm_mib"][rank] for r in rows],
                name=f"rank {rank}",
                marker_color=color,
                legendgroup=f"r{rank}",
                showlegend=False,
            ),
            1,
            3,
        )
    fig.update_layout(barmode="group", height=360, margin=dict(t=40, b=30, l=40, r=10))
    return fig
