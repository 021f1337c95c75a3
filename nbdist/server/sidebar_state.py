"""Jupyter server: what the sidebar shows (clusters, rank states, live metrics), computed here.

Everything is read without disturbing the ranks or the kernel:

- the clusters and their PIDs from the registry (:mod:`nbdist.driver.registry`);
- step, loss, samples/s, TFLOP/s and MFU (when the ranks log ``flops``),
  memory, the GPU's figures (on ranks that use one: :mod:`nbdist.metrics.gpu`) and the recent points of each rank from the
  run history (SQLite in WAL mode, opened read-only), incrementally: each poll
  reads only the batches stored since the previous one (by ``rowid``), so a
  poll costs the same after a million steps as after ten;
- dead/busy/idle from the operating system, by PID (local ranks only): a rank
  whose process is gone (or a zombie) is dead; one that used more than a tenth
  of a core since the previous poll, or logged in the last few seconds, is
  busy. Asking the controller instead would need a client connection per
  server and would queue behind the cell a busy rank is running. A rank whose
  process is stopped (SIGSTOP, Ctrl-Z) or held by a debugger (gdb) also says so
  (``process``): it is neither busy nor idle in the usual sense, and its cell waits.

Example::

    from nbdist.server.sidebar_state import LiveView

    view = LiveView()
    for cluster in view.clusters():          # what GET /nbdist/api/clusters returns
        print(cluster["id"], [r["step"] for r in cluster["ranks"]])
"""

from __future__ import annotations

import json
import math
import os
import sqlite3
import time
from collections import deque
from dataclasses import dataclass, field

import psutil

from nbdist.dashboard.table import HISTORY
from nbdist.driver import registry
from nbdist.metrics import wire
from nbdist.metrics.gpu import GPU_KEYS
from nbdist.rank_states import BUSY, DEAD, IDLE, held_word
from nbdist.server.rank_summary import RECENT_RATE_S, is_many, median_series, summarise
from nbdist.server.stragglers import RecentPoints, flag

__all__ = ["CHART_POINTS", "LiveView", "RankLive", "RunReader", "gpu_payload"]

CHART_POINTS = 300  # recent points per rank and series kept for the sidebar's small charts
_BUSY_CPU_FRACTION = 0.1
_BUSY_RECENT_S = 3.0
_RECENT_RATE_S = RECENT_RATE_S
# Points per rank the first read of a run takes in: the charts' and the straggler rule's
# (its (time, step) history).
_TAIL_POINTS = max(CHART_POINTS, HISTORY)


def _number(value) -> float | None:
    if value is None or isinstance(value, bool):
        return None
    try:
        value = float(value)
    except (TypeError, ValueError):
        return None
    return value if math.isfinite(value) else None


@dataclass
class RankLive:
    """The latest of one rank, and its recent loss and throughput points (of its current
    loop: since its step last went back)."""

    step: int | None = None
    time: float | None = None
    points: int = 0
    last: dict[str, float] = field(default_factory=dict)
    gpu_time: float | None = None  # when the latest GPU reading was taken (Unix seconds)
    loss: deque = field(default_factory=lambda: deque(maxlen=CHART_POINTS))
    throughput: deque = field(default_factory=lambda: deque(maxlen=CHART_POINTS))
    recent: RecentPoints = field(default_factory=RecentPoints)  # what the straggler rule reads


def gpu_payload(last: dict[str, float], when: float | None) -> dict | None:
    """A rank's latest GPU reading for the REST payload, or None when it sent none.

    ``{"index": 0, "util": 87.0, "mem_used_mib": 40211.0, "mem_total_mib": 81559.0,
    "temp_c": 61.0, "time": 1700000000.0}``; a figure the GPU did not report is null.
    """
    if not any(key in last for key in GPU_KEYS):
        return None
    index = last.get("gpu_index")
    return {
        "index": None if index is None else int(index),
        "util": last.get("gpu_util"),
        "mem_used_mib": last.get("gpu_mem_mib"),
        "mem_total_mib": last.get("gpu_mem_total_mib"),
        "temp_c": last.get("gpu_temp_c"),
        "time": when,
    }


class RunReader:
    """Follows one run of one history file, reading only what was stored since the last call."""

    def __init__(self, path: str, run_id: int):
        """Follow run ``run_id`` of the history file at ``path``; nothing is read before :meth:`update`."""
        self.path = path
        self.run_id = run_id
        self.rowid = 0
        self.ranks: dict[int, RankLive] = {}

    def update(self) -> None:
        """Take in the batches stored since the previous call into :attr:`ranks`.

        The first call reads only each rank's latest batches and its point count
        (see :meth:`_tail`). A missing or locked file is left for the next call.
        """
        if not os.path.exists(self.path):
            return
        conn = sqlite3.connect(f"file:{self.path}?mode=ro", uri=True, timeout=1.0)
        counts = None
        try:
            conn.execute("BEGIN")  # one snapshot for the queries below
            if self.rowid == 0:
                rows, counts = self._tail(conn)
            else:
                rows = conn.execute(
                    "SELECT rowid, rank, points FROM batches WHERE run=? AND rowid>? ORDER BY rowid",
                    (self.run_id, self.rowid),
                ).fetchall()
        except sqlite3.Error:
            return  # not created yet, or locked for a moment: next poll
        finally:
            conn.close()
        self._add(rows)
        for rank, total in (counts or {}).items():
            self.ranks.setdefault(rank, RankLive()).points = total

    def _tail(self, conn) -> tuple[list, dict[int, int]]:
        """The first read of a run: only each rank's latest batches, and its point count.

        A run of 200k points took 1.4 s to read whole (blocking the server); the
        sidebar shows the latest values and the last CHART_POINTS points only, and
        the straggler rule reads the last ``HISTORY``: each rank's newest batches
        holding :data:`_TAIL_POINTS` points (a batch holds ``n`` points, often
        dozens), and no more, are read.
        """
        counts = dict(
            conn.execute(
                "SELECT rank, COALESCE(SUM(n), 0) FROM batches WHERE run=? GROUP BY rank",
                (self.run_id,),
            ).fetchall()
        )
        rows = []
        for rank in counts:
            taken = 0
            # Newest first, fetched as they come: the cursor stops once enough points are in.
            cursor = conn.execute(
                "SELECT rowid, rank, n, points FROM batches WHERE run=? AND rank=? ORDER BY seq DESC",
                (self.run_id, rank),
            )
            for rowid, _, n, text in cursor:
                rows.append((rowid, rank, text))
                taken += max(1, n)
                if taken >= _TAIL_POINTS:
                    break
            cursor.close()
        rows.sort()
        return rows, counts

    def _add(self, rows: list) -> None:
        for rowid, rank, text in rows:
            self.rowid = rowid
            try:
                batch = wire.points(json.loads(text))  # a batch as columns, or points
            except (ValueError, TypeError, KeyError):
                continue
            live = self.ranks.setdefault(rank, RankLive())
            for step, when, values in batch:
                live.points += 1
                live.step, live.time = step, when
                live.recent.add(step, when, values)
                for key, value in values.items():
                    number = _number(value)
                    if number is not None:
                        live.last[key] = number
                if "gpu_util" in values or "gpu_mem_mib" in values:
                    live.gpu_time = when
                loss = _number(values.get("loss"))
                if loss is not None:
                    _append_loop(live.loss, step, loss)
                rate = _number(values.get("samples_per_s", values.get("tokens_per_s")))
                if rate is not None:
                    _append_loop(live.throughput, step, rate)


def _append_loop(points: deque, step: int, value: float) -> None:
    """Add a chart point; a step lower than the last (a loop run again, a restart) starts the
    chart over, so it shows the current loop: x ascending, no line drawn back."""
    if points and step < points[-1][0]:
        points.clear()
    points.append((step, value))


def _cpu_seconds(pid: int) -> float | None:
    try:
        times = psutil.Process(pid).cpu_times()
        return times.user + times.system
    except psutil.Error:
        return None


# A process that runs nothing until something outside it lets it go on: the cell waits.
def _held(proc: psutil.Process | None) -> str:
    """'stopped' or 'held by a debugger' when ``proc`` is, else ''."""
    if proc is None:
        return ""
    try:
        return held_word(proc.status())
    except psutil.Error:
        return ""


def _local_process(pid: int | None) -> psutil.Process | None:
    if not pid:
        return None
    try:
        proc = psutil.Process(pid)
        return None if proc.status() == psutil.STATUS_ZOMBIE else proc
    except psutil.Error:
        return None


class LiveView:
    """The server's view of every registered cluster; keep one per server (it caches readers)."""

    def __init__(self, registry_dir: str | None = None):
        """``registry_dir``: the cluster registry's folder (None: its default location)."""
        self.registry_dir = registry_dir
        self._readers: dict[tuple[str, int], RunReader] = {}
        self._cpu: dict[int, tuple[float, float]] = {}  # pid -> (monotonic, cpu seconds)

    def entries(self) -> list[dict]:
        """The registry entries of the clusters whose kernel is alive, oldest first."""
        return registry.clusters(self.registry_dir)

    def entry(self, cluster_id: str) -> dict | None:
        """The registry entry of cluster ``cluster_id``, or None if it is not running."""
        return next((e for e in self.entries() if e["id"] == cluster_id), None)

    def reader(self, entry: dict) -> RunReader | None:
        """The entry's run reader, updated now; None if the entry names no history or run."""
        if not entry.get("history") or entry.get("run_id") is None:
            return None
        key = (entry["history"], int(entry["run_id"]))
        reader = self._readers.get(key)
        if reader is None:
            reader = self._readers[key] = RunReader(*key)
        reader.update()
        return reader

    def owns_engines(self, entry: dict) -> bool:
        """True when the cluster's kernel started its engines (an attached cluster's are
        someone else's); of those, only the ranks in this PID namespace (``pid_here``) are
        read and signalled here."""
        return bool(entry.get("owned"))

    def _busy_by_cpu(self, pid: int) -> bool:
        now, cpu = time.monotonic(), _cpu_seconds(pid)
        previous = self._cpu.get(pid)
        if cpu is None:
            return False
        self._cpu[pid] = (now, cpu)
        if previous is None or now <= previous[0]:
            return False
        return (cpu - previous[1]) / (now - previous[0]) > _BUSY_CPU_FRACTION

    def rank_rows(self, entry: dict) -> list[dict]:
        """One dict per rank of ``entry``: host, PID, device, state (dead/busy/idle), step, points.

        Also the latest loss and samples/s, memory (MiB), last seen (Unix seconds)
        and the recent loss and throughput points as ``[step, value]`` lists. A rank
        that sent GPU readings also has ``gpu`` (:func:`gpu_payload`); others have none.
        A rank that logged ``flops`` also has ``tflops`` (its latest achieved TFLOP/s) and
        ``mfu`` (that as a fraction of its device's peak; null when no peak was had).
        A local rank whose process is stopped or held by a debugger also has ``process``
        ('stopped', 'held by a debugger'). A rank that logs the step breakdown also has ``breakdown``: its latest point's
        ``compute_s``, ``comm_s`` and ``data_s``; ``memory_peak_mib`` when it was logged.
        ``straggler`` says why the rank is one by the dashboard's rule
        (:mod:`nbdist.server.stragglers`), "" when it is not (a dead rank never is).
        """
        reader = self.reader(entry)
        owned = self.owns_engines(entry)
        now = time.time()
        rows = []
        for info in entry.get("ranks", []):
            # A PID of another host (or PID namespace) names some other process here.
            local = owned and info.get("pid_here", True)
            live = reader.ranks.get(info["rank"]) if reader else None
            proc = _local_process(info.get("pid")) if local else None
            last_seen = live.time if live else None
            recent = last_seen is not None and now - last_seen < _BUSY_RECENT_S
            if local and proc is None:
                state = DEAD
            elif (local and self._busy_by_cpu(info["pid"])) or recent:
                state = BUSY
            else:
                state = IDLE
            memory = live.last.get("memory_mib") if live else None
            if memory is None and proc is not None:
                try:
                    memory = proc.memory_info().rss / 2**20
                except psutil.Error:
                    memory = None
            last = live.last if live else {}
            rows.append(
                {
                    "rank": info["rank"],
                    "host": info.get("host"),
                    "pid": info.get("pid"),
                    "device": info.get("device"),
                    "state": state,
                    "step": live.step if live else None,
                    "points": live.points if live else 0,
                    "loss": last.get("loss"),
                    "samples_per_s": last.get("samples_per_s", last.get("tokens_per_s")),
                    "memory_mib": None if memory is None else round(memory, 1),
                    "last_seen": last_seen,
                    "loss_series": [list(p) for p in live.loss] if live else [],
                    "throughput_series": [list(p) for p in live.throughput] if live else [],
                }
            )
            held = _held(proc)
            if held:
                rows[-1]["process"] = held
            figures = gpu_payload(last, live.gpu_time if live else None)
            if figures is not None:
                rows[-1]["gpu"] = figures
            if "tflops" in last:
                rows[-1].update(tflops=last["tflops"], mfu=last.get("mfu"))
            if "comm_s" in last:
                parts = ("compute_s", "comm_s", "data_s")
                rows[-1]["breakdown"] = {k: last.get(k) for k in parts}
            if "memory_peak_mib" in last:
                rows[-1]["memory_peak_mib"] = round(last["memory_peak_mib"], 1)
        dead = {row["rank"] for row in rows if row["state"] == DEAD}
        flagged = flag({r: live.recent for r, live in reader.ranks.items()}, dead) if reader else {}
        for row in rows:
            row["straggler"] = flagged.get(row["rank"], "")
        return rows

    def clusters(self) -> list[dict]:
        """Every live cluster with its ranks' rows (see :meth:`rank_rows`).

        ``step_min`` and ``step_max``: the lowest and highest step of the ranks that
        are not dead (all ranks when every one is), so a lagging rank shows;
        ``samples_per_s``: the total of the ranks that logged in the last 5 s (None
        once training stops: an old rate is not a rate now); ``rate_key``: what the
        ranks' rates count, ``"tokens_per_s"`` or ``"samples_per_s"``.
        """
        out = []
        now = time.time()
        for entry in self.entries():
            ranks = self.rank_rows(entry)
            # Throughput now: only ranks that logged lately (an idle rank's last rate is stale).
            rates = [
                r["samples_per_s"]
                for r in ranks
                if r["samples_per_s"] is not None
                and r["last_seen"] is not None
                and now - r["last_seen"] < _RECENT_RATE_S
            ]
            alive = [r for r in ranks if r["state"] != DEAD] or ranks
            steps = [r["step"] for r in alive if r["step"] is not None]
            run_id = entry.get("run_id")
            reader = self._readers.get(
                (entry.get("history"), None if run_id is None else int(run_id))
            )
            tokens = reader is not None and any(
                "tokens_per_s" in live.last for live in reader.ranks.values()
            )
            out.append(
                {
                    "id": entry["id"],
                    "kernel_id": entry.get("kernel_id"),
                    "backend": entry.get("backend"),
                    "world_size": entry.get("world_size"),
                    "run_id": entry.get("run_id"),
                    "owned": bool(entry.get("owned")),
                    "started": entry.get("started"),
                    "ranks": ranks,
                    "step_min": min(steps) if steps else None,
                    "step_max": max(steps) if steps else None,
                    "samples_per_s": sum(rates) if rates else None,
                    "rate_key": "tokens_per_s" if tokens else "samples_per_s",
                    "dead": [r["rank"] for r in ranks if r["state"] == DEAD],
                }
            )
            if is_many(ranks):
                out[-1].update(_many(ranks, now))
        return out


def _many(ranks: list[dict], now: float) -> dict:
    """Above ``PER_RANK_UP_TO`` ranks: the summary, and the median lines for the charts.

    Only the deviating ranks keep their recent points (their lines are drawn); the
    others' go into the medians and are dropped from the payload.
    """
    summary = summarise(ranks, now)
    medians = {
        key: median_series([r[key] for r in ranks if r["state"] != DEAD])
        for key in ("loss_series", "throughput_series")
    }
    drawn = {d["rank"] for d in summary["deviating"][:4]}
    for row in ranks:
        if row["rank"] not in drawn:
            row["loss_series"] = []
            row["throughput_series"] = []
    return {"summary": summary, "median": medians}
