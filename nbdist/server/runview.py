"""Jupyter server: one run of the history as the past-run view charts it, panel by panel.

The panels are the notebook dashboard's: the user's keys (loss first) against step,
the throughput and the GPU's utilisation and memory against seconds since the run
started, then what nbdist derives (step time and its parts, memory, TFLOP/s, MFU)
against step; titles, units and axis titles come from :mod:`nbdist.dashboard.labels`.
Counters (``samples``, ``tokens``, ``flops``) and ``total_steps`` are no charts, nor is
a metric that stayed 0 on every rank (``comm_s`` of ranks that never communicated). Each
series is decimated to :data:`RUN_CHART_POINTS` per rank, keeping spikes (min and max
per bucket), and NaN or infinite values are left out.

Example::

    from nbdist.metrics import store
    payload = run_payload(store.load_run(3), running=False)   # GET nbdist/api/runs/3
    payload["panels"]["loss"]["xtitle"]                        # 'step'
"""

from __future__ import annotations

import math

from nbdist.dashboard.decimate import decimate
from nbdist.dashboard.labels import describe_key
from nbdist.dashboard.table import COUNTERS, PROGRESS_KEY, plotted_keys, throughput_key

__all__ = ["BY_TIME_GPU_KEYS", "RUN_CHART_POINTS", "panel_keys", "run_payload"]

RUN_CHART_POINTS = 2000
BY_TIME_GPU_KEYS = ("gpu_util", "gpu_mem_mib")  # the GPU panels the dashboard draws


def panel_keys(keys: list[str]) -> list[str]:
    """The keys the view charts, in the dashboard's order (see the module docstring)."""
    rate = throughput_key(keys)
    first = plotted_keys(keys) + ([rate] if rate else [])
    skip = set(COUNTERS) | {PROGRESS_KEY, "samples_per_s", "tokens_per_s"}
    rest = [
        k
        for k in keys
        if k not in first and k not in skip and (not k.startswith("gpu_") or k in BY_TIME_GPU_KEYS)
    ]
    return first + rest


def run_payload(run, *, running: bool) -> dict:
    """The JSON of ``GET nbdist/api/runs/<id>``: the run's facts, ``keys``, ``panels``, ``series``.

    ``panels[key]``: ``title``, ``unit``, ``ytitle``, ``xtitle``, ``log`` and
    ``by_time``; ``series[key][rank]``: ``[x, value]`` pairs, x a step or seconds.
    """
    keys = panel_keys(run.keys())
    rate = throughput_key(run.keys())
    panels, series = {}, {}
    for key in keys:
        by_time = key == rate or key in BY_TIME_GPU_KEYS
        panel = describe_key(key, by_time=by_time)
        if key == rate:
            panel["title"] = f"throughput per rank ({panel['unit']})"  # no total drawn here
        panels[key] = {**panel, "by_time": by_time}
        per_rank = {}
        for rank in run.ranks:
            if by_time:
                times, values = run.timeline(key, rank)
                xs = [round(t - run.started, 3) for t in times]
            else:
                xs, values = run.series(key, rank)
            if xs:
                xs, ys = decimate(xs, values, budget=RUN_CHART_POINTS)
                per_rank[str(rank)] = [
                    [x, float(y)] for x, y in zip(xs, ys) if y is not None and math.isfinite(y)
                ]
        if any(y != 0 for points in per_rank.values() for _, y in points):
            series[key] = per_rank
        else:
            del panels[key]
    keys = [k for k in keys if k in series]
    return dict(
        id=run.id,
        started=run.started,
        ended=run.ended,
        world_size=run.world_size,
        backend=run.backend,
        keys=keys,
        panels=panels,
        series=series,
        running=running,
    )
