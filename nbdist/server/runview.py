"""Jupyter server: one run of the history as the past-run view charts it, panel by panel.

The panels are the notebook dashboard's: the user's keys (loss first) against step,
the throughput and the GPU's utilisation and memory against seconds since the run
started, then what nbdist derives (step time and its parts, memory, TFLOP/s, MFU)
against step; titles, units and axis titles come from :mod:`nbdist.dashboard.labels`.
Counters (``samples``, ``tokens``, ``flops``) and ``total_steps`` are no charts, nor is
a metric that stayed 0 on every rank (``comm_s`` of ranks that never communicated). Each
series is decimated, keeping spikes (min and max per bucket), to :data:`RUN_CHART_POINTS`.
Up to the dashboard's ``PER_RANK_UP_TO`` ranks each rank has its line; above that, as on
the dashboard, each panel has the median across the ranks with their min-max band, and at
most ``SHOWN_RANKS`` ranks on their own, the ones that deviate (:mod:`nbdist.server.run_spread`),
so a 256-rank run's payload is the size of an 8-rank one's and its charts stay readable.
NaN or infinite values are left out.

The server builds a run's payload off its event loop and keeps the last few
(:class:`PayloadCache`): opening a finished run again reads only its version
(:func:`nbdist.metrics.store.run_version`), not its points.

Example::

    from nbdist.metrics import store
    payload = run_payload(store.load_run(3), running=False)   # GET nbdist/api/runs/3
    payload["panels"]["loss"]["xtitle"]                        # 'step'
"""

from __future__ import annotations

import math
import threading
from collections import OrderedDict

from nbdist.dashboard.decimate import MIN_BUDGET, minmax_indices
from nbdist.dashboard.labels import describe_key
from nbdist.dashboard.table import (
    COUNTERS,
    PER_RANK_UP_TO,
    PROGRESS_KEY,
    plotted_keys,
    throughput_key,
)
from nbdist.metrics import store
from nbdist.server.run_spread import band, shown_ranks

__all__ = [
    "BY_TIME_GPU_KEYS",
    "CACHED_RUNS",
    "RUN_CHART_POINTS",
    "PayloadCache",
    "panel_keys",
    "run_payload",
]

RUN_CHART_POINTS = 2000  # points per trace (a rank's line, the median, a band's edge)
BY_TIME_GPU_KEYS = ("gpu_util", "gpu_mem_mib")  # the GPU panels the dashboard draws
CACHED_RUNS = 4  # built payloads the server keeps (a few MB each in memory at most)


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


def _line(xs: list, values: list, budget: int) -> list[list]:
    """One rank's ``[x, value]`` pairs, decimated to ``budget`` points, with ``[x, None]``
    (a gap: plotly draws no line across it) before each x lower than the one before it
    (a loop run again, a restart), as the live dashboard does (:meth:`Trace.extend_steps`).
    Decimation keeps the points either side of the latest ``budget // 8`` gaps."""
    back = [i for i in range(1, len(xs)) if xs[i] < xs[i - 1]][-(budget // 8) :]
    inner = max(MIN_BUDGET, budget - 3 * len(back))
    keep = set(minmax_indices(values, inner).tolist() if len(xs) > inner else range(len(xs)))
    keep.update(j for i in back for j in (i - 1, i))
    gaps = set(back)
    out = []
    for i in sorted(keep):
        y = values[i]
        if i in gaps:
            out.append([xs[i], None])
        if y is not None and math.isfinite(y):
            out.append([xs[i], float(y)])
    return out


def run_payload(run, *, running: bool) -> dict:
    """The JSON of ``GET nbdist/api/runs/<id>``: the run's facts, ``keys``, ``panels``, ``series``.

    ``panels[key]``: ``title``, ``unit``, ``ytitle``, ``xtitle``, ``log`` and
    ``by_time``; ``series[key][rank]``: ``[x, value]`` pairs, x a step or seconds,
    at most :data:`RUN_CHART_POINTS` of them; ``[x, null]`` before a step lower than
    the one before it (a loop run again): a gap, no line drawn back. Above ``PER_RANK_UP_TO`` ranks
    ``series`` holds only the ranks in ``shown`` (``[{"rank", "why"}]``, the deviating
    ones), and ``bands[key]`` the ``median``, ``min`` and ``max`` across every rank.
    """
    keys = panel_keys(run.keys())
    rate = throughput_key(run.keys())
    many = len(run.ranks) > PER_RANK_UP_TO
    shown = shown_ranks(run, keys[0]) if many and keys else []
    drawn = [entry["rank"] for entry in shown] if many else run.ranks
    panels, series, bands = {}, {}, {}
    for key in keys:
        by_time = key == rate or key in BY_TIME_GPU_KEYS
        panel = describe_key(key, by_time=by_time)
        if key == rate:
            panel["title"] = f"throughput per rank ({panel['unit']})"  # no total drawn here
        panels[key] = {**panel, "by_time": by_time}
        per_rank = {}
        for rank in drawn:
            if by_time:
                times, values = run.timeline(key, rank)
                xs = [round(t - run.started, 3) for t in times]
            else:
                xs, values = run.series(key, rank)
            if xs:
                per_rank[str(rank)] = _line(xs, values, RUN_CHART_POINTS)
        spread = band(run, key, by_time=by_time, budget=RUN_CHART_POINTS) if many else {}
        lines = [*per_rank.values(), *spread.values()]
        if any(y != 0 for points in lines for _, y in points):
            series[key] = per_rank
            if many:
                bands[key] = spread
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
        **({"shown": shown, "bands": bands} if many else {}),
    )


class PayloadCache:
    """The last :data:`CACHED_RUNS` run payloads built, each kept while its run is unchanged.

    Blocking (it reads the history): call :meth:`payload` from a worker thread, not
    the server's event loop. Thread-safe; two requests for the same run at once
    build it once (the second waits for the first, then reads the cache).
    """

    def __init__(self, size: int = CACHED_RUNS):
        """Keep at most ``size`` payloads, the least recently asked for going first."""
        self.size = size
        self._built: OrderedDict[tuple[str, int], tuple[tuple, dict]] = OrderedDict()
        self._lock = threading.Lock()
        self._building: dict[tuple[str, int], threading.Lock] = {}

    def payload(self, run_id: int, paths: list[str]) -> tuple[str, dict] | None:
        """``(history path, payload)`` of run ``run_id`` in the first of ``paths`` holding it.

        The payload is :func:`run_payload`'s with ``running`` False (the caller knows
        better); None when no history holds the run. Only the run's version is read
        when a payload built from the same version is kept.
        """
        for path in paths:
            key = (path, run_id)
            with self._lock:
                building = self._building.setdefault(key, threading.Lock())
            with building:
                version = store.run_version(run_id, path=path)
                if version is None:
                    with self._lock:  # one lock kept per run id ever asked for: not for these
                        self._building.pop(key, None)
                    continue
                with self._lock:
                    kept = self._built.get(key)
                    if kept is not None and kept[0] == version:
                        self._built.move_to_end(key)
                        return path, kept[1]
                try:
                    run = store.load_run(run_id, path=path)
                except KeyError:  # gone since its version was read
                    continue
                # Built from at least `version` (a batch stored since makes the next
                # request's version differ, and rebuild): never served stale.
                built = run_payload(run, running=False)
                with self._lock:
                    self._built[key] = (version, built)
                    self._built.move_to_end(key)
                    while len(self._built) > self.size:
                        # Its lock goes too (at worst a request racing it builds it twice).
                        self._building.pop(self._built.popitem(last=False)[0], None)
                return path, built
        return None
