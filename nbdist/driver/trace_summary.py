"""Kernel side: where each rank's profiled time went, read from a merged trace (:mod:`nbdist.driver.trace_merge`).

For every rank (process row ``pid = rank``), over its profiled window (from
the start of its first recorded ``ProfilerStep#`` to the end of its last; the
span of all its events when there is none):

- ``compute``: time covered by computation and not by communication. With GPU
  kernels in the trace (CUDA activity): GPU kernels, memcpy and memset that are
  not collectives. Without (CPU ranks): the rank's CPU operators (``cpu_op``,
  any thread) that are not collectives.
- ``communication``: time covered by collectives: events named ``c10d::...``,
  ``gloo:...``, ``nccl...`` (NCCL kernels included), ``record_param_comms``.
  On gloo the transfer itself runs on gloo's own threads (``gloo:all_reduce``);
  the main thread waits for it outside any operator.
- ``idle``: the rest of the window.

Each event counts once however deeply operators nest (intervals are merged),
so the three shares add up to 1 by construction (up to float rounding). ``overlap``
is the part of the communication time during which compute ran too (1: all
communication hidden behind compute; None when there was none), as HTA's
``comm_comp_overlap`` reports it. ``top_ops``: the operators (or kernels) with
the most self time (their time minus their children's, per thread).

With HTA (``pip install HolisticTraceAnalysis``) importable and GPU kernels in
the traces, :func:`hta_breakdown` adds HTA's own temporal breakdown and overlap
(``hta_*`` columns); nbdist's summary is always computed.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

from nbdist.errors import format_ranks
from nbdist.text_table import format_table

__all__ = ["RankSummary", "format_summary", "hta_breakdown", "is_comm", "summarize"]

_COMM_PREFIXES = ("c10d::", "gloo:", "nccl", "record_param_comms", "mpi:", "ucc:")
_GPU_COMPUTE = ("kernel", "gpu_memcpy", "gpu_memset")
_TOP = 5
# Past this many ranks the summary shows their median and the ranks that stand out:
# a compute, communication or idle share this far (a fraction of the window) from the median.
_MAX_RANK_ROWS = 8
_STANDS_OUT = 0.10


def is_comm(name: str) -> bool:
    """Whether an event of this name is communication (a collective or point-to-point op)."""
    low = name.lower()
    return low.startswith(_COMM_PREFIXES) or "nccl" in low


@dataclass
class RankSummary:
    """One rank's window and its shares (fractions of ``window_ms``)."""

    rank: int
    window_ms: float
    steps: int
    compute: float
    communication: float
    idle: float
    overlap: float | None
    mode: str  # "gpu" (kernels) or "cpu" (operators)
    top_ops: list[tuple[str, float, int]] = field(default_factory=list)  # name, self ms, calls
    hta: dict = field(default_factory=dict)

    def row(self) -> dict:
        """A flat dict (the columns of ``MergedProfile.to_pandas()``)."""
        top = "; ".join(f"{n} {ms:.2f} ms" for n, ms, _ in self.top_ops[:3])
        return {
            "rank": self.rank,
            "window_ms": self.window_ms,
            "steps": self.steps,
            "compute": self.compute,
            "communication": self.communication,
            "idle": self.idle,
            "overlap": self.overlap,
            "mode": self.mode,
            "top_ops": top,
            **{f"hta_{k}": v for k, v in self.hta.items()},
        }


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for start, end in sorted(intervals):
        if out and start <= out[-1][1]:
            out[-1][1] = max(out[-1][1], end)
        else:
            out.append([start, end])
    return [(a, b) for a, b in out]


def _length(intervals) -> float:
    return sum(b - a for a, b in intervals)


def _intersection(a, b) -> float:
    """Length of the intersection of two merged, sorted interval lists."""
    i = j = 0
    total = 0.0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if hi > lo:
            total += hi - lo
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def _clip(intervals, lo: float, hi: float):
    return [(max(a, lo), min(b, hi)) for a, b in intervals if b > lo and a < hi]


def _self_times(events: list[dict]) -> dict[str, list[float]]:
    """{name: [self µs, calls]}: each event's duration minus its direct children's, per thread."""
    totals: dict[str, list[float]] = {}
    by_thread: dict = {}
    for e in events:
        by_thread.setdefault(e.get("tid"), []).append(e)
    for thread_events in by_thread.values():
        thread_events.sort(key=lambda e: (e["ts"], -e["dur"]))
        stack: list[list] = []  # [end, name, self]
        for e in thread_events:
            start, end = e["ts"], e["ts"] + e["dur"]
            while stack and stack[-1][0] <= start:
                _pop(stack, totals)
            if stack:
                stack[-1][2] -= min(end, stack[-1][0]) - start
            stack.append([end, e["name"], e["dur"]])
        while stack:
            _pop(stack, totals)
    return totals


def _pop(stack, totals) -> None:
    _, name, own = stack.pop()
    entry = totals.setdefault(name, [0.0, 0])
    entry[0] += max(own, 0.0)
    entry[1] += 1


def summarize(trace: dict) -> list[RankSummary]:
    """One :class:`RankSummary` per rank (process row) of a merged trace, in rank order."""
    by_rank: dict[int, list[dict]] = {}
    for e in trace.get("traceEvents", []):
        if e.get("ph") == "X" and isinstance(e.get("pid"), int) and e.get("dur", 0) > 0:
            by_rank.setdefault(e["pid"], []).append(e)
    return [_summarize_rank(rank, events) for rank, events in sorted(by_rank.items())]


def _summarize_rank(rank: int, events: list[dict]) -> RankSummary:
    steps = [e for e in events if str(e.get("name", "")).startswith("ProfilerStep#")]
    span = steps or events
    lo = min(e["ts"] for e in span)
    hi = max(e["ts"] + e["dur"] for e in span)
    gpu = any(e.get("cat") == "kernel" for e in events)
    work, comm = [], []
    for e in events:
        name, cat = str(e.get("name", "")), e.get("cat")
        if is_comm(name) and cat != "python_function":
            comm.append(e)
        elif (cat in _GPU_COMPUTE) if gpu else (cat == "cpu_op"):
            work.append(e)
    comm_iv = _union(_clip([(e["ts"], e["ts"] + e["dur"]) for e in comm], lo, hi))
    work_iv = _union(_clip([(e["ts"], e["ts"] + e["dur"]) for e in work], lo, hi))
    window = hi - lo
    comm_t = _length(comm_iv)
    both = _intersection(work_iv, comm_iv)
    compute_only = _length(work_iv) - both
    busy = compute_only + comm_t
    if window <= 0:
        shares = (0.0, 0.0, 1.0)
    else:
        shares = (compute_only / window, comm_t / window, max(window - busy, 0.0) / window)
    ops = [e for e in work + comm if e.get("cat") in ("cpu_op", *_GPU_COMPUTE)]
    totals = _self_times(ops if gpu else [e for e in ops if e.get("cat") == "cpu_op"])
    top = sorted(totals.items(), key=lambda kv: -kv[1][0])[:_TOP]
    return RankSummary(
        rank=rank,
        window_ms=window / 1e3,
        steps=len(steps),
        compute=shares[0],
        communication=shares[1],
        idle=shares[2],
        overlap=(both / comm_t) if comm_t > 0 else None,
        mode="gpu" if gpu else "cpu",
        top_ops=[(name, us / 1e3, int(calls)) for name, (us, calls) in top],
    )


def _pct(value) -> str:
    return "-" if value is None else f"{100 * value:.1f} %"


def format_summary(rows: list[RankSummary]) -> str:
    """The summary as a text table, then the top operators by self time.

    Up to :data:`_MAX_RANK_ROWS` ranks, a row and a top-operators line per rank. Past it
    (256 ranks made 512 lines), a row of the ranks' medians, then only the ranks whose
    compute, communication or idle share is :data:`_STANDS_OUT` or more from that
    median (the farthest :data:`_MAX_RANK_ROWS`), and the operators' mean over the
    ranks; ``MergedProfile.to_pandas()`` keeps every rank.
    """
    header = ["rank", "window", "steps", "compute", "comm", "idle", "overlap"]
    if len(rows) <= _MAX_RANK_ROWS:
        lines = [format_table(header, [_cells(r.rank, r) for r in rows], right=range(len(header)))]
        lines += [_top_line(f"rank {r.rank}", r.top_ops) for r in rows if r.top_ops]
        return "\n".join(lines)
    median = _median_row(rows)
    distance = {r.rank: _distance(r, median) for r in rows}
    odd = [r for r in rows if distance[r.rank] >= _STANDS_OUT]
    shown = sorted(
        sorted(odd, key=lambda r: -distance[r.rank])[:_MAX_RANK_ROWS], key=lambda r: r.rank
    )
    everyone = format_ranks(r.rank for r in rows).removeprefix("ranks ")
    cells = [_cells(f"{everyone} (median)", median)] + [_cells(r.rank, r) for r in shown]
    lines = [format_table(header, cells, right=range(len(header)))]
    points = f"{100 * _STANDS_OUT:.0f} points or more from the median"
    if not odd:
        lines.append(f"no rank's compute, comm or idle share is {points}")
    else:
        left = len(odd) - len(shown)
        more = f" ({left} more, nearer the median, not shown)" if left else ""
        lines.append(
            f"{len(odd)} {'rank' if len(odd) == 1 else 'ranks'} with a compute, comm or idle "
            f"share {points} listed{more}; MergedProfile.to_pandas() has every rank"
        )
    lines.append(_top_line(f"ranks {everyone} (mean)", _mean_top(rows)))
    lines += [_top_line(f"rank {r.rank}", r.top_ops) for r in shown if r.top_ops]
    return "\n".join(lines)


def _cells(label, r) -> list:
    return [
        label,
        f"{r.window_ms:.1f} ms",
        r.steps,
        _pct(r.compute),
        _pct(r.communication),
        _pct(r.idle),
        _pct(r.overlap),
    ]


def _top_line(who: str, top_ops) -> str:
    top = ", ".join(
        f"{n} {ms:.2f} ms" + (f" ×{calls}" if calls is not None else "") for n, ms, calls in top_ops
    )
    return f"{who} top by self time: {top}"


def _median_row(rows: list[RankSummary]) -> RankSummary:
    """Each column's median over ``rows`` (overlap over the ranks that had communication)."""
    overlaps = [r.overlap for r in rows if r.overlap is not None]
    return RankSummary(
        rank=-1,
        window_ms=statistics.median(r.window_ms for r in rows),
        steps=int(statistics.median(r.steps for r in rows)),
        compute=statistics.median(r.compute for r in rows),
        communication=statistics.median(r.communication for r in rows),
        idle=statistics.median(r.idle for r in rows),
        overlap=statistics.median(overlaps) if overlaps else None,
        mode=rows[0].mode,
    )


def _distance(r: RankSummary, median: RankSummary) -> float:
    """How far the rank's shares are from the median's: the largest of the three gaps."""
    return max(
        abs(r.compute - median.compute),
        abs(r.communication - median.communication),
        abs(r.idle - median.idle),
    )


def _mean_top(rows: list[RankSummary]) -> list[tuple[str, float, None]]:
    """The operators with the most self time over all ranks: (name, mean ms per rank, None).

    From each rank's own top operators: one that is not among a rank's top counts 0 there,
    so a mean is a lower bound (calls are left out: few ranks may have counted them).
    """
    totals: dict[str, float] = {}
    for r in rows:
        for name, ms, _ in r.top_ops:
            totals[name] = totals.get(name, 0.0) + ms
    top = sorted(totals.items(), key=lambda item: -item[1])[:_TOP]
    return [(name, ms / len(rows), None) for name, ms in top]


def hta_breakdown(trace_dir: str) -> dict[int, dict] | None:
    """HTA's temporal breakdown and comm/compute overlap per rank, or None without HTA.

    ``trace_dir``: the ranks' own traces, one file each (HTA reads the rank from
    their ``distributedInfo``). HTA analyses GPU kernels: CPU-only traces give None.
    """
    try:
        from hta.trace_analysis import TraceAnalysis
    except Exception:
        return None
    try:
        analyzer = TraceAnalysis(trace_dir=trace_dir)
        temporal = analyzer.get_temporal_breakdown(visualize=False)
        overlap = analyzer.get_comm_comp_overlap(visualize=False)
    except Exception:  # CPU-only traces, or an HTA that changed its API: nbdist's summary stands
        return None
    found: dict[int, dict] = {}
    for record in temporal.to_dict("records"):
        found[int(record["rank"])] = {
            k: v for k, v in record.items() if k != "rank" and k.endswith("_pctg")
        }
    for record in overlap.to_dict("records"):
        found.setdefault(int(record["rank"]), {})["comp_comm_overlap_pctg"] = record.get(
            "comp_comm_overlap_pctg"
        )
    return found
