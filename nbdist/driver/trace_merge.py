"""Kernel side: gather every rank's ``nbdist.profile`` trace and write ONE time-aligned Chrome/Perfetto trace.

Example (``%dist_profile`` does the same)::

    session.run("with nbdist.profile(steps=3):\\n    train(5)")   # a loop calling nbdist.log
    merged = collect(session)
    print(merged.report())      # the file, how to open it, the per-rank summary
    merged.to_pandas()          # the summary as a table

What happens:

1. Each rank's :mod:`nbdist.engine.profiling` holds its finished profiles; the
   newest one every rank holds is gathered (the ranks number their profiles in
   the same order, as they run the same code).
2. Clocks. A trace's ``ts`` are microseconds on kineto's clock: kineto writes
   ``baseTimeNanoseconds`` with them, and ``baseTimeNanoseconds + 1000 * ts``
   is the rank's ``time.time_ns()`` (CLOCK_REALTIME; measured within ~0.1 ms of
   ``time.time_ns()`` taken as each ``ProfilerStep#`` began, the anchors the
   rank records, used instead when a trace lacks the field). Each rank's offset
   from the kernel's clock is measured now, at gather: five round trips
   calling ``time.time_ns`` on the rank, keeping the one with the least
   round-trip time (RTT), offset = rank time - midpoint of the round trip.
   The true offset lies within ±RTT/2 of that. The offset is applied only
   when it is larger than RTT/2: ranks on the kernel's host share its clock
   (their measured offset always lies within ±RTT/2 of 0) and are left exact;
   on other hosts the alignment is good to RTT/2, typically 0.2 to 2 ms
   through ipyparallel, as ``otherData.clock`` in the file records per rank.
3. Merge: every event gets ``pid = rank`` (its threads, CPU or GPU streams,
   keep their ``tid`` and names), a ``process_name`` "rank R" row per rank,
   flow ids made unique per rank, and times shifted onto one timeline whose
   zero is ``baseTimeNanoseconds`` (wall-clock ns) in the file.
4. The file goes to ``profiles/run-<id>/`` beside the run history
   (:func:`nbdist.metrics.store.history_path`), or to the temporary directory
   when the session keeps no history. Open it at https://ui.perfetto.dev
   ("Open trace file", or drop the file on the page; the page cannot be
   linked to a local file) or in ``chrome://tracing``.
5. :mod:`nbdist.driver.trace_summary` computes each rank's compute /
   communication / idle shares, their overlap and the top operators.
"""

from __future__ import annotations

import gzip
import json
import os
import tempfile
import time
from dataclasses import dataclass, field

from nbdist.driver.trace_summary import RankSummary, format_summary, hta_breakdown, summarize
from nbdist.engine import profiling
from nbdist.errors import NbdistError, format_ranks

__all__ = [
    "PERFETTO_URL",
    "ClockOffset",
    "MergedProfile",
    "collect",
    "measure_offsets",
    "merge_traces",
    "profiles_dir",
    "trace_base_ns",
]

PERFETTO_URL = "https://ui.perfetto.dev"
_ROUNDS = 5
_FLOW_STRIDE = 1 << 32  # flow ids of rank R become R * stride + id: unique across ranks
_DROPPED_METADATA = {"process_name", "process_labels", "process_sort_index"}


@dataclass(frozen=True)
class ClockOffset:
    """A rank's clock minus the kernel's, from the round trip with the least RTT."""

    offset_ns: int  # measured: rank time - midpoint of the round trip
    rtt_ns: int
    applied_ns: int  # what the merge subtracts (0 when within ±RTT/2, see the module docstring)


@dataclass
class MergedProfile:
    """The merged trace written to ``path``, and what was learnt making it."""

    path: str
    seq: int
    ranks: list[int]
    summary: list[RankSummary]
    offsets: dict[int, ClockOffset]
    steps: dict[int, int] = field(default_factory=dict)  # rank -> steps recorded
    asked: int = 0  # steps the profile was to record
    cut_short: list[int] = field(default_factory=list)  # ranks whose cell ended first
    notes: list[str] = field(default_factory=list)  # e.g. ranks left out

    def report(self) -> str:
        """The lines ``%dist_profile`` prints: the file, how to open it, alignment, summary."""
        # Ranks grouped by their count: "ranks 0-255: 3", not 256 entries.
        by_count: dict[int, list[int]] = {}
        for rank, count in sorted(self.steps.items()):
            by_count.setdefault(count, []).append(rank)
        steps = ", ".join(f"{format_ranks(r)}: {n}" for n, r in by_count.items())
        shifted = {r: o for r, o in self.offsets.items() if o.applied_ns}
        if shifted:
            worst = max(o.rtt_ns for o in shifted.values()) / 2e6
            clocks = f"clocks of {format_ranks(shifted)} aligned to within {worst:.2f} ms (RTT/2)"
        else:
            clocks = "clocks: every rank agrees with this kernel's clock (offsets within ±RTT/2)"
        lines = [f"nbdist: merged profile of {len(self.ranks)} ranks ({steps} steps): {self.path}"]
        if self.cut_short:
            got = sorted({self.steps.get(r, 0) for r in self.cut_short})
            lines.append(
                f"nbdist: profile stopped at the cell's end after {'/'.join(map(str, got))} of"
                f" {self.asked} steps (rank(s) {self.cut_short}): the steps so far are kept"
            )
        lines += [f"nbdist: {note}" for note in self.notes]
        lines += [
            f"open it at {PERFETTO_URL}: 'Open trace file' (or drop the file on the page)",
            clocks,
            format_summary(self.summary),
        ]
        return "\n".join(lines)

    def to_pandas(self):
        """The summary, one row per rank (a pandas DataFrame)."""
        import pandas as pd

        return pd.DataFrame([s.row() for s in self.summary])


def measure_offsets(session, rounds: int = _ROUNDS) -> dict[int, ClockOffset]:
    """{rank: ClockOffset}: ``rounds`` calls of ``time.time_ns`` on each rank, the least RTT kept."""
    found = {}
    for info in session.ranks:
        view = session.client[info.engine_id]
        best = None
        for _ in range(rounds):
            t0 = time.time_ns()
            remote = view.apply_sync(time.time_ns)
            t1 = time.time_ns()
            sample = (t1 - t0, remote - (t0 + t1) // 2)
            best = sample if best is None or sample[0] < best[0] else best
        rtt, offset = best
        found[info.rank] = ClockOffset(offset, rtt, offset if abs(offset) * 2 > rtt else 0)
    return found


def trace_base_ns(trace: dict, anchors=()) -> int:
    """Wall-clock ns of the trace's ``ts`` 0: kineto's ``baseTimeNanoseconds``, else from ``anchors``.

    ``anchors``: (step number, ``time.time_ns()``) taken on the rank just after
    each ``ProfilerStep#n`` began; each gives an upper bound of the base, the
    least is kept.
    """
    if isinstance(trace.get("baseTimeNanoseconds"), int):
        return trace["baseTimeNanoseconds"]
    begins = {}
    for e in trace.get("traceEvents", []):
        name = str(e.get("name", ""))
        if e.get("ph") == "X" and name.startswith("ProfilerStep#"):
            begins[int(name.split("#", 1)[1])] = e["ts"]
    bounds = [ns - round(begins[n] * 1000) for n, ns in anchors if n in begins]
    if not bounds:
        raise NbdistError("a rank's trace has neither baseTimeNanoseconds nor ProfilerStep events")
    return min(bounds)


def merge_traces(traces: dict[int, dict], bases_ns: dict[int, int], offsets_ns=None) -> dict:
    """One Chrome trace from ``{rank: trace}``, each rank its own process row (``pid = rank``).

    ``bases_ns``: each trace's :func:`trace_base_ns`; ``offsets_ns``: each rank's
    clock minus the kernel's (default 0). Event times become µs since the
    earliest rank's trace zero, on the kernel's clock.
    """
    offsets_ns = offsets_ns or {}
    wall = {r: bases_ns[r] - offsets_ns.get(r, 0) for r in traces}
    origin = min(wall.values())
    events: list[dict] = []
    for rank, trace in sorted(traces.items()):
        shift = (
            wall[rank] - origin
        ) / 1000  # integer ns first: no float loss on epoch-sized numbers
        events += [
            {
                "ph": "M",
                "name": "process_name",
                "pid": rank,
                "tid": 0,
                "args": {"name": f"rank {rank}"},
            },
            {
                "ph": "M",
                "name": "process_sort_index",
                "pid": rank,
                "tid": 0,
                "args": {"sort_index": rank},
            },
        ]
        devices = {
            e["pid"]: e["args"]["name"]
            for e in trace.get("traceEvents", [])
            if e.get("ph") == "M"
            and e.get("name") == "process_name"
            and str(e.get("args", {}).get("name", "")).startswith(("GPU", "CUDA"))
        }
        for e in trace.get("traceEvents", []):
            if e.get("ph") == "M" and e.get("name") in _DROPPED_METADATA:
                continue
            out = dict(e, pid=rank)
            if "ts" in out:
                out["ts"] = out["ts"] + shift
            if out.get("ph") in ("s", "t", "f") and isinstance(out.get("id"), int):
                out["id"] = rank * _FLOW_STRIDE + out["id"]
            if e.get("pid") in devices and e.get("name") == "thread_name" and e.get("ph") == "M":
                out["args"] = {"name": f"{devices[e['pid']]} {e['args'].get('name', '')}".strip()}
            events.append(out)
    return {"traceEvents": events, "displayTimeUnit": "ms", "baseTimeNanoseconds": origin}


_DIRS: dict[int, tuple[object, str]] = {}  # id(session) -> (session, its private folder)


def profiles_dir(session) -> str:
    """Where this session's merged profiles go: ``profiles/run-<id>`` beside the history.

    Without a history: a private folder (0700) of this session's own under the
    temporary directory, made on first use (never shared with another session
    or user).
    """
    hub = session.metrics_hub
    store = getattr(hub, "store", None)
    if store is not None:
        root = os.path.dirname(os.path.abspath(store.path))
        return os.path.join(root, "profiles", f"run-{hub.run.id}")
    held = _DIRS.get(id(session))
    if held is None or held[0] is not session or not os.path.isdir(held[1]):
        held = _DIRS[id(session)] = (session, tempfile.mkdtemp(prefix="nbdist-profiles-"))
    return held[1]


def _choose(records: list[list[dict]]) -> tuple[dict[int, dict], dict[int, dict]]:
    """({rank: record} to merge, {rank: record} left out): the ranks' latest profiles that belong together.

    Each rank's newest finished profile is taken; those whose window (start to
    the end of its cell) overlaps the window of the one that began last are
    merged; a rank whose newest profile ended before that one began is left
    out (its profile is of an earlier cell). Nothing while a rank still records
    or waits to (armed), or when no rank holds a profile.
    """
    if any(r.get("running") for rank_records in records for r in rank_records):
        return {}, {}
    latest = {}
    for rank_records in records:
        held = [r for r in rank_records if r.get("seq")]
        if held:
            newest = max(held, key=lambda r: r["seq"])
            latest[newest["rank"]] = newest
    if not latest:
        return {}, {}
    began = max(_window(r)[0] for r in latest.values())
    chosen = {k: r for k, r in latest.items() if _window(r)[1] >= began}
    return chosen, {k: r for k, r in latest.items() if k not in chosen}


def _window(record: dict) -> tuple[int, int]:
    window = record.get("window") or [0, record.get("finished_ns", 0)]
    return window[0], window[1]


def _left_out(stale: dict[int, dict], chosen: dict[int, dict]) -> str:
    began = max(_window(r)[0] for r in chosen.values())
    ago = ", ".join(
        f"rank {k}: {(began - _window(r)[1]) / 1e9:.1f} s earlier" for k, r in sorted(stale.items())
    )
    return (
        f"rank(s) {sorted(stale)} left out: their latest profile ended before the others"
        f" began ({ago}), so it is of another cell; it was discarded"
    )


def _decode(payload) -> dict:
    if isinstance(payload, bytes):
        payload = gzip.decompress(payload).decode("utf-8")
    return json.loads(payload)


def collect(session, *, stop: bool = False, out_dir: str | None = None) -> MergedProfile | None:
    """Gather the newest profile every rank finished, merge, write it; None when none is ready.

    ``stop``: first stop profiles still recording (their steps so far are kept)
    and drop an armed ``%dist_profile``. The ranks' temporary files are
    deleted once merged.
    """
    if stop:
        session.apply(profiling.disarm)
    records = session.apply(profiling.ready)
    chosen, stale = _choose(records)
    if not chosen:
        return None
    seqs = {k: r["seq"] for k, r in chosen.items()}
    for k, r in stale.items():
        seqs[k] = r["seq"] + 1  # with older=True: that one and any before it
    if any(not r.get("path") for r in chosen.values()):
        empty = sorted(rank for rank, r in chosen.items() if not r.get("path"))
        session.apply(profiling.discard, seqs, True)
        raise NbdistError(
            f"rank(s) {empty} recorded no step: each step must end with"
            " nbdist.log(...) or prof.step(), and a profile needs skip + 1 steps at least"
        )
    offsets = measure_offsets(session)
    traces, bases = {}, {}
    for info, payload in zip(
        session.ranks, session.apply(profiling.read_trace, {k: seqs[k] for k in chosen})
    ):
        if info.rank not in chosen:
            continue
        traces[info.rank] = _decode(payload)
        bases[info.rank] = trace_base_ns(traces[info.rank], chosen[info.rank]["anchors"])
    merged = merge_traces(traces, bases, {r: o.applied_ns for r, o in offsets.items()})
    seq = max(seqs[k] for k in chosen)
    merged["otherData"] = {
        "nbdist_profile": {str(k): seqs[k] for k in sorted(chosen)},
        "clock": {str(r): vars(o) for r, o in offsets.items()},
        "steps_recorded": {str(r): chosen[r]["steps_recorded"] for r in chosen},
    }
    folder = out_dir or profiles_dir(session)
    os.makedirs(folder, mode=0o700, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    path = os.path.join(folder, f"profile-{seq}-{stamp}.json")
    summary = summarize(merged)
    extra = _hta(traces, folder, f"profile-{seq}-{stamp}")
    for row in summary:
        row.hta = extra.get(row.rank, {}) if extra else {}
    with open(path, "w", encoding="utf-8") as f:
        json.dump(merged, f, separators=(",", ":"))
    session.apply(profiling.discard, seqs, True)
    return MergedProfile(
        path=path,
        seq=seq,
        ranks=sorted(traces),
        summary=summary,
        offsets=offsets,
        steps={r: chosen[r]["steps_recorded"] for r in sorted(chosen)},
        asked=chosen[min(chosen)].get("steps", 0),
        cut_short=sorted(r for r in chosen if chosen[r].get("stopped_at_cell_end")),
        notes=[_left_out(stale, chosen)] if stale else [],
    )


def _hta(traces: dict[int, dict], folder: str, name: str) -> dict | None:
    # HTA reads one file per rank; written only when HTA imports and there are GPU kernels.
    gpu = any(e.get("cat") == "kernel" for t in traces.values() for e in t.get("traceEvents", []))
    try:
        import hta  # noqa: F401
    except Exception:
        return None
    if not gpu:
        return None
    ranks_dir = os.path.join(folder, f"{name}.ranks")
    os.makedirs(ranks_dir, exist_ok=True)
    for rank, trace in traces.items():
        trace.setdefault("distributedInfo", {}).setdefault("rank", rank)
        with open(os.path.join(ranks_dir, f"rank{rank}.json"), "w", encoding="utf-8") as f:
            json.dump(trace, f)
    return hta_breakdown(ranks_dir)
