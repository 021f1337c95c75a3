"""Rank side: choose a parallel plan for a model: enumerate, estimate, measure the best few, apply the winner.

:func:`autoplan` runs on every rank (in ``%%on_all_ranks``), in four steps:

1. **Enumerate** every plan for the world size
   (:func:`~nbdist.strategies.plan.estimate.enumerate_plans`): each
   ``dp × tp × pp`` factorisation; for pure data parallelism DDP, ZeRO-1 or
   FSDP2, in 2D/3D layouts FSDP2 over ``dp``; activation checkpointing off and,
   when ``blocks`` names the repeated block class, on. Plans the model or
   batch cannot take (a width ``tp`` does not divide, fewer layers than
   stages, a batch ``dp`` does not divide) stay in the table with the reason.
2. **Estimate** each plan's peak memory on its busiest rank from parameter,
   gradient and optimizer-state bytes and activations measured in one forward
   of the batch in this process (:func:`~nbdist.strategies.plan.estimate.model_facts`),
   and its bytes communicated per step. Plans over ``memory_per_rank`` are
   dropped, with the estimate in the table.
3. **Measure** the most promising plans that fit, fewest estimated bytes
   communicated first (checkpointing, which recomputes a forward, and pipeline
   bubbles only break ties), ``top_k`` of them, for a few steps on the live
   ranks with the machinery :func:`~nbdist.strategies.plan.compare.compare` uses
   (:func:`~nbdist.strategies.plan.compare.measure_steps`): real steps/s, real peak
   memory per rank, real bytes. A plan whose *measured* peak exceeds the
   budget is marked and the next candidate measured instead ("estimated, then
   checked"). Timings are the slowest rank's and peaks are gathered from all
   ranks before anything is compared, so every rank ranks alike.
4. **Apply** the fastest measured plan to a fresh ``model_fn()`` and return it.

The result: ``plan.table`` (one dict per plan: layout, estimate, measurement,
status; ``nbdist.dashboard.plan_comparison.plans_table`` shows it), ``plan.best`` (the
winning row), ``plan.model``, ``plan.optimizer`` (for pipeline plans also
``plan.stage`` and ``plan.schedule``) and ``plan.step(x, y)``, one training step
on the global batch returning its loss.

Costs: one single-process forward/backward for the estimate, and
``(warmup + steps + 2)`` steps for each measured plan. On GPUs the measured
peak is the allocator's, less what the rank held before the plan was built
(cuBLAS's workspace, the notebook's other tensors); on CPU the tensors alive
plus the profiler's record (DDP's buckets and pipeline receive buffers are not
seen there). The GPU path has not been run on a GPU yet.

Example (on every rank)::

    from nbdist.strategies.plan.autoplan import autoplan
    plan = autoplan(build, (x, y), world_size=world_size, memory_per_rank="2 MiB",
                    loss_fn=lm_loss, blocks=Block, colwise=COLWISE, rowwise=ROWWISE)
    model, opt = plan.model, plan.optimizer
    for step in range(100):
        loss = plan.step(*batch(step))       # the global batch; each rank takes its share
"""

from __future__ import annotations

import gc
import numbers
import re
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from nbdist.strategies.measure import device_baseline
from nbdist.strategies.plan.build import Built, build_plan
from nbdist.strategies.plan.compare import measure_steps
from nbdist.strategies.plan.estimate import NotAdmitted, enumerate_plans, model_facts

__all__ = ["AutoPlan", "autoplan", "parse_bytes"]

_MIB = 2**20
_UNITS = {"": 1, "b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "kib": 2**10, "mib": _MIB, "gib": 2**30}


def parse_bytes(value) -> float:
    """``memory_per_rank`` in bytes: a number of bytes, or a string such as ``"64 MiB"``, ``"2GB"``."""
    if isinstance(value, numbers.Real) and not isinstance(value, bool) and value > 0:
        return float(value)
    if isinstance(value, str):
        # One decimal number ("1.2.3" is none) and a unit; "0 MiB" is refused as 0 is.
        match = re.fullmatch(r"\s*([0-9]+\.?[0-9]*|\.[0-9]+)\s*([a-zA-Z]*)\s*", value)
        if match and match.group(2).lower() in _UNITS and float(match.group(1)) > 0:
            return float(match.group(1)) * _UNITS[match.group(2).lower()]
    raise ValueError(
        f"memory_per_rank={value!r}: give bytes (a positive number) or a string such as "
        f"'512 MiB' or '2 GB' (units {', '.join(u for u in _UNITS if u)})"
    )


class AutoPlan:
    """What :func:`autoplan` chose: ``table``, ``best``, and the plan applied (see the module docstring)."""

    def __init__(self, table: list[dict], best: dict, built: Built) -> None:
        """Hold the ranked table and the applied plan."""
        self.table, self.best, self.built = table, best, built
        self.plan = built.plan
        self.model, self.optimizer = built.model, built.optimizer
        self.stage, self.schedule = built.stage, built.schedule
        self.dims = built.dims

    def step(self, x: torch.Tensor, y: torch.Tensor, *, reduce: bool = True):
        """One optimizer step on the global batch ``(x, y)``: the global loss (see ``Built.step``)."""
        return self.built.step(x, y, reduce=reduce)

    def __repr__(self) -> str:
        """``AutoPlan(fsdp2×tp2: 812 samples/s, peak 1.20 MiB)``."""
        b = self.best
        return f"AutoPlan({b['plan']}: {b['samples_per_s']:.0f} samples/s, peak {b['peak_mib']:.2f} MiB)"


def _row(plan, est) -> dict:
    shard = plan.shard if plan.dp > 1 else "none"  # one replica: nothing to shard over dp
    row = dict(plan=plan.name, dp=plan.dp, tp=plan.tp, pp=plan.pp, shard=shard, ac=plan.ac)
    if isinstance(est, NotAdmitted):
        return {**row, "est_mib": None, "est_comm_mib": None, "status": f"not admitted: {est}"}
    return {**row, "est_mib": est["memory"] / _MIB, "est_comm_mib": est["comm"] / _MIB}


def autoplan(
    model_fn: Callable[[], nn.Module],
    batch: tuple[torch.Tensor, torch.Tensor],
    *,
    world_size: int,
    memory_per_rank,
    loss_fn: Callable = nn.functional.mse_loss,
    optimizer: type[torch.optim.Optimizer] = torch.optim.Adam,
    optimizer_kwargs: dict | None = None,
    blocks: type | None = None,
    colwise: Sequence[str] | None = None,
    rowwise: Sequence[str] | None = None,
    top_k: int = 3,
    steps: int = 3,
    warmup: int = 1,
    microbatches: int | None = None,
    seed: int = 0,
    device: torch.device | str | None = None,
    log: bool = True,
) -> AutoPlan:
    """Find the fastest plan for ``model_fn()`` on ``world_size`` ranks within ``memory_per_rank``.

    Call it on every rank with the same arguments. ``model_fn()`` builds the
    model on the CPU (seeded with ``seed``); ``batch`` is the *global* batch
    ``(inputs, targets)``, the same on every rank; ``loss_fn(output, target)``
    averages over the batch. ``memory_per_rank``: bytes, or ``"64 MiB"``.
    ``blocks`` (the repeated block class) with ``colwise``/``rowwise`` (the
    ``nn.Linear`` names inside one block, as for ``apply_fsdp_tp``) describe a
    transformer; without them FSDP2 shards each child with parameters and tensor
    parallel pairs the ``nn.Linear`` layers. ``top_k`` plans are measured for
    ``warmup`` + ``steps`` (+ 2) steps each. Returns an :class:`AutoPlan`.

    Raises ``ValueError`` naming the numbers when no plan suits the model and
    batch, or when nothing fits the budget (with the smallest estimate).

    Example::

        plan = autoplan(build, (x, y), world_size=4, memory_per_rank="8 MiB")
        plan.table          # rows for nbdist.dashboard.plan_comparison.plans_table
    """
    from nbdist.strategies.arguments import require_builder, require_whole

    require_builder(model_fn, "autoplan", "model_fn")
    # Counts: "4" from a config file is no rank count, and 2.5 steps cannot be run.
    counts = dict(world_size=world_size, top_k=top_k, steps=steps, warmup=warmup)
    if microbatches is not None:
        counts["microbatches"] = microbatches
    require_whole("autoplan", **counts)
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("autoplan() runs on the ranks (%%on_all_ranks): no process group")
    if world_size != dist.get_world_size():
        raise ValueError(
            f"autoplan(world_size={world_size!r}) but the process group has "
            f"{dist.get_world_size()} ranks: pass world_size=world_size"
        )
    if top_k < 1 or steps < 1 or warmup < 0:
        raise ValueError(
            f"top_k ({top_k!r}) and steps ({steps!r}) must be >= 1, warmup ({warmup!r}) >= 0"
        )
    budget = parse_bytes(memory_per_rank)
    from nbdist.engine.helpers import device as rank_device

    device = torch.device(device) if device is not None else rank_device()
    common = dict(loss_fn=loss_fn, optimizer=optimizer, optimizer_kwargs=optimizer_kwargs)
    facts = model_facts(
        model_fn, batch, blocks=blocks, colwise=colwise, rowwise=rowwise, seed=seed, **common
    )
    plans = enumerate_plans(facts, world_size, microbatches=microbatches)
    rows = [_row(plan, est) for plan, est in plans]
    admitted = [(plan, est, row) for (plan, est), row in zip(plans, rows) if isinstance(est, dict)]
    if not admitted:
        reasons = "; ".join(f"{r['plan']}: {r['status'][14:]}" for r in rows[:6])
        raise ValueError(
            f"no parallel plan suits this model and batch on {world_size} ranks (global batch "
            f"{facts.batch}): {reasons}"
        )
    for _, est, row in admitted:
        if est["memory"] > budget:
            row["status"] = f"over budget: estimated {est['memory'] / _MIB:.3f} MiB"
    fits = [(p, e, r) for p, e, r in admitted if e["memory"] <= budget]
    if not fits:
        plan, est, _ = min(admitted, key=lambda a: a[1]["memory"])
        raise ValueError(
            f"no plan fits memory_per_rank={budget / _MIB:.3f} MiB: the smallest estimate is "
            f"{plan.name} at {est['memory'] / _MIB:.3f} MiB per rank; give at least that, more "
            f"ranks, or a smaller batch"
        )
    # Communication is what parallel plans pay for; recomputation and bubbles break ties.
    fits.sort(key=lambda a: (a[0].ac, a[1]["comm"], a[1]["bubble"], a[1]["memory"], a[0]))
    x, y = batch
    batches = [(x, y)] * (warmup + steps + 2)
    run = dict(warmup=warmup, steps=steps, batches=batches, global_batch=len(x), log_every=log)
    build = dict(blocks=blocks, colwise=colwise, rowwise=rowwise, seed=seed, device=device)
    build.update(common)
    measured = []
    for plan, est, row in fits:
        if len(measured) == top_k:
            row["status"] = "fits; not measured"
            continue
        base = device_baseline(device)
        built = build_plan(model_fn, plan, microbatches=est["microbatches"], **build)
        got = measure_steps(
            plan.name, built.params, built.optimizer, built.forward_backward, device=device, **run
        )
        del built
        gc.collect()  # free this plan's tensors before the next is built
        peak = max(p - b / _MIB for p, b in zip(got["peak_mib"], base))
        row.update(
            steps_per_s=1000 / got["step_ms"],
            samples_per_s=got["samples_per_s"],
            step_ms=got["step_ms"],
            peak_mib=peak,
            comm_mib=max(got["comm_mib"]),
            loss=got["loss"],
            microbatches=est["microbatches"] if plan.pp > 1 else None,
        )
        if peak * _MIB > budget:
            row["status"] = f"over budget: measured {peak:.3f} MiB"
        else:
            row["status"] = "measured"
            measured.append((plan, est, row))
    if not measured:
        low = min((r for _, _, r in fits), key=lambda r: r["peak_mib"])
        raise ValueError(
            f"no plan fits memory_per_rank={budget / _MIB:.3f} MiB once measured: every plan "
            f"estimated to fit peaked above it, the lowest {low['plan']} at {low['peak_mib']:.3f} "
            f"MiB per rank; give at least that, more ranks, or a smaller batch"
        )
    measured.sort(key=lambda m: -m[2]["samples_per_s"])
    for i, (_, _, row) in enumerate(measured, 1):
        row["rank"] = i
    plan, est, best = measured[0]
    best["status"] = "chosen"
    order = {id(r): i for i, (_, _, r) in enumerate(measured)}
    # Measured first (fastest first), then the other fitting ones, then those dropped.
    table = sorted(rows, key=lambda r: (order.get(id(r), len(order)), _group(r)))
    built = build_plan(model_fn, plan, microbatches=est["microbatches"], **build)
    return AutoPlan(table, best, built)


def _group(row: dict) -> int:
    status = row.get("status", "")
    return 0 if status.startswith("fits") else 1 if status.startswith("over") else 2
