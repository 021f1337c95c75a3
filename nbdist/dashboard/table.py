"""Kernel side: the per-rank table (step, loss, throughput, step time, memory, last seen, state) and stragglers.

On ranks that use GPUs the table also has the GPU's number, utilisation, memory
and temperature (the latest reading a rank sent, :mod:`nbdist.metrics.gpu`);
a run without GPU readings has no GPU columns at all. A run that logs ``flops``
has TFLOP/s and MFU columns (:mod:`nbdist.metrics.flops`); others have none.

Shared by the live widget and the text summary; pure Python, no widgets.

States are :mod:`nbdist.rank_states`'s: ``dead`` when the ``states`` callable
says so (the session knows which engines died); else what it says (``busy``
running a cell, ``idle`` between cells, as ``%dist_status`` shows); without the
session's word (a past run), ``busy`` when the rank logged a point in the last
``IDLE_AFTER_S`` seconds of a run that has not ended, else ``idle``. A dead rank is never flagged as a straggler.
A live rank whose process the session reads as held (a :class:`~nbdist.rank_states.HeldState`:
stopped, or by a debugger) reads ``idle · stopped``, and is among the deviating rows.

A rank is a straggler when its recent median step time is more than
``ratio`` (1.3) times the median of the other ranks' recent medians, or when it
is more than ``max_lag`` steps behind: behind is measured at the same moment
(the highest step any rank had logged by the time of this rank's last point),
so points that are merely still in flight (ranks flush every 50 ms) do not count.
The reason says why when the ranks log the step breakdown
(:mod:`nbdist.dashboard.breakdown`): "1.4× step time · data loading 41 % of step,
others 5 %"; in synchronous training, where every rank's step lasts as long as
the slowest's, a rank whose compute or data share stands out is flagged by that alone.
"""

from __future__ import annotations

import bisect
import math
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from nbdist.dashboard.breakdown import breakdown, explain, slow_parts
from nbdist.metrics.gpu import GPU_KEYS
from nbdist.metrics.point_keys import DERIVED_KEYS
from nbdist.rank_states import BUSY, DEAD, IDLE, counts_in_words

__all__ = [
    "IDLE_AFTER_S",
    "PER_RANK_UP_TO",
    "SHOWN_RANKS",
    "deviating_rows",
    "host_row",
    "PROGRESS_KEY",
    "plural",
    "RankRow",
    "find_stragglers",
    "fmt_percent",
    "fmt_tflops",
    "has_flops",
    "has_gpu",
    "pick_shown",
    "plotted_keys",
    "rank_rows",
    "rank_state",
    "seen_column",
    "state_counts",
    "step_lags",
    "throughput_key",
]

IDLE_AFTER_S = 2.0
# Text views list every rank up to this many; above it, hosts with counts and the
# ranks that deviate (the text summary, %dist_status without --all).
PER_RANK_UP_TO = 8
# Above PER_RANK_UP_TO ranks: at most this many ranks drawn on their own in a chart (the
# deviating ones), the rest as the median and min-max band (live and past runs alike).
SHOWN_RANKS = 4
RECENT = 20  # step times per rank that make its "recent median"
HISTORY = 512  # (time, step) points per rank kept for the lag check
# Logged to make throughput and TFLOP/s; plotted as samples_per_s/tokens_per_s, tflops and mfu.
COUNTERS = ("samples", "tokens", "flops")
# How many steps the loop will take: the header's progress bar, not a chart.
PROGRESS_KEY = "total_steps"


@dataclass
class RankRow:
    """One rank's line of the table; ``None`` where the rank has not logged that value."""

    rank: int
    step: int | None = None
    loss: float | None = None  # the first user key's latest value (``RankRow.loss_key`` names it)
    rate: float | None = None  # samples/s or tokens/s
    step_time: float | None = None  # recent median, seconds
    memory_mib: float | None = None
    memory_peak_mib: float | None = None
    seen: float | None = None  # time.time() of the latest point
    state: str = IDLE
    # 'stopped' or 'held by a debugger' (nbdist.rank_states): its process here runs nothing
    # until continued or detached, though the controller counts it idle or busy.
    held: str = ""
    straggler: str = ""  # why it is flagged, "" when it is not
    # Why it deviates other than by speed ("loss nan", "no points logged"), "" when it does not.
    note: str = ""
    host: str = ""  # shown next to the rank when the ranks span several hosts
    gpu: dict[str, float] | None = None  # the latest GPU reading, by GPU_KEYS; None without one
    tflops: float | None = None  # the latest achieved TFLOP/s
    mfu: float | None = None  # the latest MFU, a fraction of the device's peak

    def cells(self, now: float, *, gpu: bool = False, flops: bool = False) -> list[str]:
        """The row as text cells: rank, step, loss, rate, step time, memory, last seen, state, flag.

        ``flops``: with the TFLOP/s and MFU columns after step time; ``gpu``: with the
        GPU columns (gpu, gpu util, gpu memory, gpu temp) after memory.
        """
        figures = self.gpu or {}
        index = figures.get("gpu_index")
        gpu_cells = [
            "–" if index is None else str(int(index)),
            fmt_gpu_util(figures.get("gpu_util")),
            fmt_gpu_memory(figures.get("gpu_mem_mib"), figures.get("gpu_mem_total_mib")),
            fmt_gpu_temp(figures.get("gpu_temp_c")),
        ]
        return [
            f"{self.rank} · {self.host}" if self.host else str(self.rank),
            "–" if self.step is None else str(self.step),
            fmt_value(self.loss),
            fmt_rate(self.rate),
            fmt_seconds(self.step_time),
            *([fmt_tflops(self.tflops), fmt_percent(self.mfu)] if flops else []),
            fmt_mib(self.memory_mib)
            + ("" if self.memory_peak_mib is None else f" (peak {fmt_mib(self.memory_peak_mib)})"),
            *(gpu_cells if gpu else []),
            fmt_ago(None if self.seen is None else now - self.seen),
            f"{self.state} · {self.held}" if self.held else str(self.state),
            " · ".join(
                ([f"⚠ straggler ({self.straggler})"] if self.straggler else [])
                + ([f"⚠ {self.note}"] if self.note else [])
            ),
        ]


def deviating_rows(rows: Sequence[RankRow]) -> list[RankRow]:
    """The rows that stand out: dead, held (stopped, or by a debugger), stragglers, in a state
    few of the living share, or with a ``note`` (:func:`build_rows`: a NaN/inf loss, no points
    while the others log)."""
    living = [r for r in rows if r.state != DEAD]
    counts = {state: sum(1 for r in living if r.state == state) for state in (BUSY, IDLE)}
    common = max(counts.values(), default=0)
    return [
        r
        for r in rows
        if r.state == DEAD
        or r.held
        or r.straggler
        or r.note
        or (r.state in counts and counts[r.state] < common)
    ]


def pick_shown(
    stragglers: Sequence[int], dead: Sequence[int], lasts: Sequence[tuple[float, int]]
) -> list[int]:
    """The ranks a chart draws on their own above ``PER_RANK_UP_TO`` ranks: stragglers first,
    then dead ranks, then the outliers among ``lasts`` (``(value, rank)`` pairs of each rank's
    latest value): a NaN or infinite value first (a diverged rank: the band leaves it out,
    so only its own line shows it; when most ranks diverged, none is an outlier), then
    ranks whose value lies far outside the others' (beyond 1.5 interquartile ranges),
    farthest first; at most ``SHOWN_RANKS``."""
    broken = sorted(r for v, r in lasts if not math.isfinite(v))
    lasts = sorted((v, r) for v, r in lasts if math.isfinite(v))
    if len(broken) >= len(lasts):
        broken = []
    far = []
    if len(lasts) >= 4:  # fewer are no spread to stand out of
        q1, q3 = lasts[len(lasts) // 4][0], lasts[(3 * len(lasts)) // 4][0]
        middle = lasts[len(lasts) // 2][0]
        fence = 1.5 * (q3 - q1)
        far = [(abs(v - middle), r) for v, r in lasts if v < q1 - fence or v > q3 + fence]
    outlying = [r for _, r in sorted(far, reverse=True)]
    return list(dict.fromkeys([*stragglers, *dead, *broken, *outlying]))[:SHOWN_RANKS]


def host_row(
    host: str, rows: Sequence[RankRow], now: float, *, gpu: bool, flops: bool
) -> list[str]:
    """One table row for a host's ranks: its step range, median figures, total rate, counts by state."""

    def median(values):
        known = [v for v in values if v is not None and math.isfinite(v)]
        return statistics.median(known) if known else None

    steps = [r.step for r in rows if r.step is not None]
    rates = [r.rate for r in rows if r.rate is not None and r.state != DEAD]
    summary = RankRow(
        rank=0,
        step=max(steps) if steps else None,
        loss=median(r.loss for r in rows),
        rate=sum(rates) if rates else None,
        step_time=median(r.step_time for r in rows),
        memory_mib=median(r.memory_mib for r in rows),
        seen=max((r.seen for r in rows if r.seen is not None), default=None),
    )
    cells = summary.cells(now, gpu=gpu, flops=flops)
    cells[0] = f"{host}: {plural(len(rows), 'rank')}"
    if steps and min(steps) != max(steps):
        cells[1] = f"{min(steps)}–{max(steps)}"
    cells[-2] = " · ".join(state_counts(rows))
    return cells


def state_counts(rows: Sequence[RankRow]) -> list[str]:
    """The rows counted by state, the held among them said beside it:
    ``["3 busy (1 stopped)", "1 dead"]`` (:func:`nbdist.rank_states.counts_in_words`)."""
    return counts_in_words((r.state, r.held) for r in rows)


def plotted_keys(keys: Sequence[str]) -> list[str]:
    """User keys that get a loss-like plot vs step (not the derived ones, not samples/tokens)."""
    return [k for k in keys if k not in DERIVED_KEYS and k not in COUNTERS and k != PROGRESS_KEY]


def throughput_key(keys: Sequence[str]) -> str | None:
    """``tokens_per_s`` when logged, else ``samples_per_s``, else None."""
    for key in ("tokens_per_s", "samples_per_s"):
        if key in keys:
            return key
    return None


def has_gpu(keys: Sequence[str]) -> bool:
    """True when some rank sent a GPU reading (then the table has GPU columns)."""
    return any(k in GPU_KEYS for k in keys)


def has_flops(keys: Sequence[str]) -> bool:
    """True when some rank logged ``flops`` (then the table has TFLOP/s and MFU columns)."""
    return "tflops" in keys


def seen_column(keys: Sequence[str]) -> int:
    """The index of the "last seen" column in :func:`headers` (the browser ticks it)."""
    return headers(keys).index("last seen")


def headers(keys: Sequence[str]) -> list[str]:
    """Column titles matching :meth:`RankRow.cells` for a run with these keys."""
    user = plotted_keys(keys)
    rate = throughput_key(keys)
    gpu = ["gpu", "gpu util", "gpu memory", "gpu temp"] if has_gpu(keys) else []
    return [
        "rank",
        "step",
        user[0] if user else "loss",
        rate.replace("_per_s", "/s") if rate else "samples/s",
        "step time",
        *(["TFLOP/s", "MFU"] if has_flops(keys) else []),
        "memory",
        *gpu,
        "last seen",
        "state",
        "",
    ]


def step_lags(history: Mapping[int, Sequence[tuple[float, int]]]) -> dict[int, int]:
    """Steps each rank is behind, compared at the time of its latest point.

    ``history``: rank -> recent ``(time, step)`` points in arrival order. For
    rank r with latest point ``(t, s)``: the highest step any rank had logged at
    or before ``t``, minus ``s``. Ranks whose history does not reach back to
    ``t`` only count with what they had logged by then.
    """
    lags: dict[int, int] = {}
    for rank, points in history.items():
        if not points:
            continue
        t, s = points[-1]
        lead = s
        for other, theirs in history.items():
            if other == rank:
                continue
            i = bisect.bisect_right(theirs, (t, math.inf))  # their last point at or before t
            if i:
                lead = max(lead, theirs[i - 1][1])
        lags[rank] = lead - s
    return lags


def find_stragglers(
    step_times: Mapping[int, Sequence[float]],
    lags: Mapping[int, int],
    *,
    ratio: float = 1.3,
    max_lag: int = 5,
) -> dict[int, str]:
    """rank -> reason, for ranks that are slow (median step time) or behind (steps).

    ``step_times``: rank -> its recent step times; ``lags``: rank -> steps behind
    (:func:`step_lags`). Needs two ranks with step times to compare speeds.
    """
    medians = {r: statistics.median(v) for r, v in step_times.items() if len(v) >= 3}
    flagged: dict[int, str] = {}
    if len(medians) >= 2:
        for rank, mine in medians.items():
            others = statistics.median(m for r, m in medians.items() if r != rank)
            if others > 0 and mine > ratio * others:
                flagged[rank] = f"{mine / others:.1f}× step time"
    for rank, lag in lags.items():
        if lag > max_lag and rank not in flagged:
            flagged[rank] = f"{lag} steps behind"
    return flagged


def build_rows(
    run,
    recent_step_times: Mapping[int, Sequence[float]],
    history: Mapping[int, Sequence[tuple[float, int]]],
    states: Mapping[int, str] | None = None,
    *,
    now: float | None = None,
    ratio: float = 1.3,
    max_lag: int = 5,
) -> list[RankRow]:
    """Rows for every rank of ``run`` (0..world_size-1 and any other that logged)."""
    now = time.time() if now is None else now
    states = states or {}
    keys = run.keys()
    user = plotted_keys(keys)
    rate_key = throughput_key(keys)
    flagged = find_stragglers(recent_step_times, step_lags(history), ratio=ratio, max_lag=max_lag)
    if "comm_s" in keys:  # why: the part of the step that differs from the other ranks'
        parts = breakdown(run)
        for rank, why in flagged.items():
            detail = explain(parts, rank)
            flagged[rank] = f"{why} · {detail}" if detail else why
        for rank, why in slow_parts(parts).items():
            flagged.setdefault(rank, why)
    rows = []
    ranks = sorted(set(range(run.world_size)) | set(run.ranks) | set(states))
    for rank in ranks:
        last = run.last(rank)
        row = RankRow(rank=rank, host=getattr(run, "hosts", {}).get(rank, ""))
        if last:
            row.step = int(last["step"])
            row.seen = last["time"]
            row.loss = last.get(user[0]) if user else None
            row.rate = last.get(rate_key) if rate_key else None
            row.memory_mib = last.get("memory_mib")
            row.memory_peak_mib = last.get("memory_peak_mib")
            row.tflops, row.mfu = last.get("tflops"), last.get("mfu")
            row.gpu = {k: last[k] for k in GPU_KEYS if k in last} or None
            recent = recent_step_times.get(rank)
            row.step_time = statistics.median(recent) if recent else last.get("step_time")
        row.state = rank_state(run, rank, states, now=now, last=last)
        if row.state != DEAD:  # a dead rank is behind because it is dead: never a straggler
            row.straggler = flagged.get(rank, "")
            row.held = getattr(states.get(rank), "held", "")
        rows.append(row)
    _note(run, rows, user[0] if user else "loss", max_lag)
    return rows


def _note(run, rows: list[RankRow], key: str, max_lag: int) -> None:
    """Say why a rank deviates where no straggler check sees it (:attr:`RankRow.note`).

    A rank whose latest ``key`` is NaN or infinite, while more ranks have a finite one,
    diverged: medians and bands leave that value out, so without the note it would not
    show at all. A rank with no points while another logged more than ``max_lag`` has
    no step to lag behind with (the same allowance as a lag: ranks start a moment apart).
    """
    broken = [r for r in rows if r.loss is not None and not math.isfinite(r.loss)]
    finite = sum(1 for r in rows if r.loss is not None and math.isfinite(r.loss))
    if len(broken) < finite:  # when most ranks diverged, the rest are the odd ones out
        for row in broken:
            row.note = f"{key} {fmt_value(row.loss)}"
    if any(run.count(r.rank) > max_lag for r in rows if r.step is not None):
        for row in rows:
            if row.step is None:
                row.note = "no points logged"


def rank_state(run, rank: int, states: Mapping[int, str], *, now: float, last=None) -> str:
    """``rank``'s state: the session's word when it has one, else by its last point's age.

    ``last``: ``run.last(rank)`` if the caller has it already. Cheap (no series read).
    """
    said = states.get(rank)
    if said in (BUSY, IDLE, DEAD):
        return said
    last = run.last(rank) if last is None else last
    if last and now - last["time"] < IDLE_AFTER_S and getattr(run, "ended", None) is None:
        return BUSY
    return IDLE


def rank_rows(
    run,
    states: Mapping[int, str] | Callable[[], Mapping[int, str]] | None = None,
    *,
    now: float | None = None,
    ratio: float = 1.3,
    max_lag: int = 5,
) -> list[RankRow]:
    """The table of ``run`` read from scratch (the live dashboard keeps these inputs incrementally)."""
    if callable(states):
        states = call_states(states)
    step_times: dict[int, list[float]] = {}
    history: dict[int, list[tuple[float, int]]] = {}
    clock = "step_time" if "step_time" in run.keys() else (run.keys() or [None])[0]
    for rank in run.ranks:
        # Only the latest points are read: a whole series grows with the session.
        _, values = run.series("step_time", rank, start=-RECENT)
        if values:
            step_times[rank] = values
        if clock is not None:
            steps, _ = run.series(clock, rank, start=-HISTORY)
            times, _ = run.timeline(clock, rank, start=-HISTORY)
            history[rank] = list(zip(times, steps))
    return build_rows(run, step_times, history, states, now=now, ratio=ratio, max_lag=max_lag)


def call_states(states: Callable[[], Mapping[int, str]] | None) -> dict[int, str]:
    """``states()``, or {} when it fails (a stopped session must not break the table)."""
    if states is None:
        return {}
    try:
        # A HeldState stays one (str() would drop what holds the rank).
        return {int(r): s if isinstance(s, str) else str(s) for r, s in dict(states()).items()}
    except Exception:
        return {}


# -- formatting -------------------------------------------------------------------------


def plural(n: int, word: str) -> str:
    """``"1 rank"``, ``"2 ranks"``, ``"1,024 points"``: a count and its noun."""
    return f"{n:,} {word}{'' if n == 1 else 's'}"


def fmt_value(v: float | None) -> str:
    if v is None:
        return "–"
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    return f"{v:.4g}"


def fmt_rate(v: float | None) -> str:
    if v is None or not math.isfinite(v):
        return "–" if v is None else str(v)
    return f"{v:,.0f}" if abs(v) >= 100 else f"{v:.3g}"


def fmt_seconds(v: float | None) -> str:
    """A step time: ``"40 µs"``, ``"2.5 µs"`` below a millisecond, ``"12.3 ms"``, ``"1.25 s"``."""
    if v is None or not math.isfinite(v):
        return "–" if v is None else str(v)
    if abs(v) * 1e6 < 999.5:
        return f"{v * 1e6:.0f} µs" if abs(v) * 1e6 >= 9.95 else f"{v * 1e6:.1f} µs"
    return f"{v * 1000:.1f} ms" if v < 1 else f"{v:.2f} s"


def fmt_tflops(v: float | None) -> str:
    """Achieved TFLOP/s: ``"312"``, ``"41.7"``, ``"0.0312"``; ``"–"`` when not logged."""
    if v is None or not math.isfinite(v):
        return "–"
    return f"{v:.0f}" if abs(v) >= 100 else f"{v:.3g}"


def fmt_percent(v: float | None) -> str:
    """A fraction as a percentage: ``0.4213`` -> ``"42.1 %"``; ``"–"`` when not logged."""
    if v is None or not math.isfinite(v):
        return "–"
    return f"{100 * v:.1f} %"


def fmt_mib(v: float | None) -> str:
    if v is None or not math.isfinite(v):
        return "–"
    return f"{v / 1024:.2f} GiB" if v >= 1024 else f"{v:.0f} MiB"


def fmt_gpu_util(v: float | None) -> str:
    """``"87 %"``; ``"?"`` when the GPU did not report it."""
    return "?" if v is None or not math.isfinite(v) else f"{v:.0f} %"


def fmt_gpu_temp(v: float | None) -> str:
    """``"61 °C"``; ``"?"`` when the GPU did not report it."""
    return "?" if v is None or not math.isfinite(v) else f"{v:.0f} °C"


def fmt_gpu_memory(used_mib: float | None, total_mib: float | None) -> str:
    """The GPU's memory in use and in all: ``"1.2/80.0 GiB"``, ``"?"`` for a figure not reported.

    >>> fmt_gpu_memory(1228.8, 81920.0)
    '1.2/80.0 GiB'
    """

    def gib(v: float | None) -> str:
        return "?" if v is None or not math.isfinite(v) else f"{v / 1024:.1f}"

    if used_mib is None and total_mib is None:
        return "?"
    return f"{gib(used_mib)}/{gib(total_mib)} GiB"


def fmt_ago(v: float | None) -> str:
    if v is None:
        return "–"
    v = max(v, 0.0)
    if v < 60:
        return f"{v:.1f} s ago"
    if v < 3600:
        return f"{int(v // 60)}m{int(v % 60):02d}s ago"
    return f"{int(v // 3600)}h{int(v % 3600 // 60):02d}m ago"
