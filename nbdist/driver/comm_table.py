"""Kernel side: ``%dist_bench comm``: latency and bandwidth of the collectives between the ranks.

Example::

    nbdist.driver.comm_table.bench_comm(sizes="1K,1M,64M")   # a DataFrame, one row per op and size
    %dist_bench comm --sizes 1K,1M,64M                       # the same as a table

The ranks time the operations (:mod:`nbdist.engine.comm_bench`); here the
timings of all ranks become figures: per iteration the slowest rank's time,
then the median over iterations. Bandwidth as nccl-tests reports it
(https://github.com/NVIDIA/nccl-tests/blob/master/doc/PERFORMANCE.md), in
GB/s = 1e9 bytes/s: algBW = size / time; busBW = algBW x :func:`bus_factor`,
comparable with the links' hardware bandwidth whatever the number of ranks.

Besides the collectives, rank 0 exchanges one message size with each other
rank in turn, both ways at once ("sendrecv", ranks ``0↔r``): a rank behind a
slow NIC or PCIe path stands out there, where a collective would only be as
slow as its slowest link. ``%dist_start --check`` measures only that
(:mod:`nbdist.driver.comm_check`).
"""

from __future__ import annotations

import re
import statistics
import time
from dataclasses import dataclass, field

from nbdist.engine import comm_bench
from nbdist.errors import PlacementError, format_ranks
from nbdist.text_table import format_table

__all__ = [
    "COLUMNS",
    "SLOW_FACTOR",
    "SlowLink",
    "CommResult",
    "bench_comm",
    "bus_factor",
    "collective_rows",
    "default_sizes",
    "format_gbs",
    "slow_links",
    "format_size",
    "measure_comm",
    "pair_bytes",
    "pair_rows",
    "parse_ops",
    "parse_sizes",
    "rank_memory",
]

COLUMNS = ("op", "ranks", "size", "bytes", "time_us", "algbw_gbs", "busbw_gbs")
_UNITS = {"": 1, "B": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
_SIZE = re.compile(r"^(\d+)\s*([KMG]?)(?:I?B)?$", re.IGNORECASE)
_SIZES_FORMAT = (
    "a comma-separated list of sizes such as 1K,1M,64M (bytes; K, M, G = 1024, 1024², 1024³)"
)
_TOP = {"cpu": 64 << 20, "cuda": 1 << 30}  # the default ladder's largest size
_PAIR_BYTES = {"cpu": 4 << 20, "cuda": 64 << 20}
# Per size, iterations = budget // size within [lo, hi]; warm-up calls before them.
# NCCL is ~100x faster than gloo, so it gets more calls in about the same time.
_ITERS = {"gloo": (256 << 20, 5, 50, 2), "nccl": (8 << 30, 10, 100, 5)}
_PAIR_ITERS = 10


def parse_sizes(text: str) -> list[int]:
    """``"1K,1M,64M"`` -> ``[1024, 1048576, 67108864]``; a bad value is a PlacementError naming it."""
    sizes = []
    for part in str(text).split(","):
        match = _SIZE.match(part.strip())
        if not match or int(match.group(1)) == 0:
            raise PlacementError(
                f"--sizes: {part.strip()!r} in {text!r} is not a size; give {_SIZES_FORMAT}"
            )
        size = int(match.group(1)) * _UNITS[match.group(2).upper()]
        if size % 4:
            # The buffers are float32: 1001 B would be measured as 1000 B, a second row
            # of the same size (and 3 B as 4 or 8), with nothing said.
            near = sorted({max(4, size - size % 4), size - size % 4 + 4})
            raise PlacementError(
                f"--sizes: {part.strip()!r} is not a whole number of float32 elements (4 bytes "
                f"each): give {' or '.join(map(str, near))}"
            )
        sizes.append(size)
    return sorted(set(sizes))


def parse_ops(text) -> list[str]:
    """``"all_reduce,broadcast"`` (or a list) -> the ops, in the order of ``comm_bench.OPS``."""
    asked = [p.strip() for p in text.split(",")] if isinstance(text, str) else list(text)
    bad = [op for op in asked if op not in comm_bench.OPS]
    if bad or not asked:
        raise PlacementError(
            f"--ops: {bad[0] if bad else text!r} is not one of {','.join(comm_bench.OPS)}"
        )
    return [op for op in comm_bench.OPS if op in asked]


def format_size(nbytes: int) -> str:
    """1024 -> '1 KiB', 3 << 20 -> '3 MiB', 1500 -> '1.5 KiB', 1000 -> '1000 B'."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            value = nbytes / scale
            return f"{value:g} {unit}" if value == int(value) else f"{value:.1f} {unit}"
    return f"{nbytes} B"


def default_sizes(device_type: str, free_bytes: int, world: int) -> list[int]:
    """1 KiB, 4 KiB, ... up to 64 MiB on CPU or 1 GiB on GPU, capped by free memory.

    The largest size and its shard (size / world) take at most a quarter of the
    smallest ``free_bytes`` among the ranks.
    """
    top = _TOP.get(device_type, _TOP["cpu"])
    sizes = [1 << 10]
    while sizes[-1] * 4 <= top and sizes[-1] * 4 * (1 + 1 / world) <= free_bytes / 4:
        sizes.append(sizes[-1] * 4)
    return sizes


def pair_bytes(device_type: str, free_bytes: int) -> int:
    """The send/recv message: 4 MiB on CPU, 64 MiB on GPU (bandwidth-bound), within free memory."""
    return min(_PAIR_BYTES.get(device_type, _PAIR_BYTES["cpu"]), max(4, free_bytes // 8))


def bus_factor(op: str, n: int) -> float:
    """nccl-tests' busBW / algBW for ``op`` on ``n`` ranks: 2(n-1)/n, (n-1)/n or 1.

    A ring all_reduce sends and receives each byte twice, less the rank's own
    share: 2(n-1)/n; all_gather and reduce_scatter once: (n-1)/n; broadcast
    and send/recv: 1.
    """
    if op == "all_reduce":
        return 2 * (n - 1) / n
    if op in ("all_gather", "reduce_scatter"):
        return (n - 1) / n
    if op in ("broadcast", "sendrecv"):
        return 1.0
    raise ValueError(f"no bus bandwidth factor for {op!r}")


def _row(op: str, ranks: str, nbytes: int, seconds: float, n: int) -> dict:
    algbw = nbytes / seconds / 1e9 if seconds > 0 else float("nan")
    busbw = algbw * bus_factor(op, n)
    values = (op, ranks, format_size(nbytes), nbytes, seconds * 1e6, algbw, busbw)
    return dict(zip(COLUMNS, values))


def _group_time(series: list[list[float]]) -> float:
    """Median over iterations of the slowest rank's time in each."""
    return statistics.median(max(per_rank) for per_rank in zip(*series))


def collective_rows(results: list[dict]) -> list[dict]:
    """Rows of :data:`COLUMNS` from every rank's ``comm_bench.time_collectives`` result."""
    n = results[0]["world"]
    ranks = format_ranks(range(n)).removeprefix("ranks ").removeprefix("rank ")
    rows = []
    for i, (op, nbytes, _) in enumerate(results[0]["times"]):
        seconds = _group_time([r["times"][i][2] for r in results])
        rows.append(_row(op, ranks, nbytes, seconds, n))
    return sorted(rows, key=lambda r: (comm_bench.OPS.index(r["op"]), r["bytes"]))


def pair_rows(results: list[dict]) -> list[dict]:
    """Rows of :data:`COLUMNS` (op ``sendrecv``, ranks ``0↔r``) from ``comm_bench.time_pairs``."""
    nbytes, rows = results[0]["bytes"], []
    for peer in sorted(results[0]["times"]):
        seconds = _group_time([results[0]["times"][peer], results[peer]["times"][peer]])
        rows.append(_row("sendrecv", f"0↔{peer}", nbytes, seconds, 2))
    return rows


def format_gbs(value: float) -> str:
    """GB/s as 812.0, 8.12, 0.08, and 8.1e-04 below 0.01 (latency-bound sizes)."""
    if value >= 10:
        return f"{value:.1f}"
    return f"{value:.2f}" if value >= 0.01 else f"{value:.1e}"


def _table(rows: list[dict]) -> str:
    header = ["op", "ranks", "size", "µs", "algBW GB/s", "busBW GB/s"]
    cells = [
        [
            r["op"],
            r["ranks"],
            r["size"],
            f"{r['time_us']:.1f}",
            format_gbs(r["algbw_gbs"]),
            format_gbs(r["busbw_gbs"]),
        ]
        for r in rows
    ]
    return format_table(header, cells, right={2, 3, 4, 5})


# "Far below": a link this many times slower than the median of the others. Healthy
# links of one machine differ by less than 2x (PCIe across sockets vs under one switch),
# and the median of interleaved exchanges on a loaded 2-core machine stays well within
# that; the faults worth a warning are 4x and more (a PCIe link trained at x4 instead
# of x16, or an older generation; NCCL falling back from NVLink or InfiniBand to PCIe
# or TCP sockets: 5-50x).
SLOW_FACTOR = 3.0
_MAX_PAIR_ROWS = 8  # beyond: the links' median, and those far slower


@dataclass
class SlowLink:
    """A link from rank 0 far slower than the others: its rank, GB/s, the others' median."""

    rank: int
    gbs: float
    median: float

    @property
    def ratio(self) -> float:
        """How many times slower than the median of the other links."""
        return self.median / self.gbs if self.gbs > 0 else float("inf")

    def warning(self) -> str:
        """``nbdist: rank 3's link is 6.1x slower than the median ...: check its NIC or PCIe path``."""
        return (
            f"nbdist: rank {self.rank}'s link is {self.ratio:.1f}x slower than the median of the "
            f"others ({format_gbs(self.gbs)} vs {format_gbs(self.median)} GB/s): check its NIC or PCIe path"
        )


def slow_links(bandwidth: dict[int, float], factor: float = SLOW_FACTOR) -> list[SlowLink]:
    """Links (rank -> GB/s to and from rank 0) at least ``factor`` times below the others' median.

    Each link is compared with the median of the *other* links, so one slow
    link among two or three cannot pull its own yardstick down; with a single
    link there is nothing to compare and nothing is flagged. Example::

        >>> [s.rank for s in slow_links({1: 4.9, 2: 5.1, 3: 0.8})]
        [3]
    """
    found = []
    for rank, gbs in sorted(bandwidth.items()):
        others = [v for r, v in bandwidth.items() if r != rank]
        if not others:
            continue
        median = statistics.median(others)
        if gbs * factor <= median:
            found.append(SlowLink(rank, gbs, median))
    return found


@dataclass
class CommResult:
    """What :func:`measure_comm` found: one row per op and size, and what was measured."""

    world: int
    backend: str
    devices: list[str]
    rows: list[dict] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)
    note: str = ""

    def table(self):
        """The rows as a pandas DataFrame (if pandas imports), else the list of dicts."""
        try:
            import pandas as pd
        except ImportError:
            return [dict(r) for r in self.rows]
        frame = pd.DataFrame(self.rows, columns=list(COLUMNS))
        frame.attrs.update(world=self.world, backend=self.backend, devices=self.devices)
        return frame

    def report(self) -> str:
        """A first line on what was measured, the table, and the ops skipped (if any)."""
        devices = ", ".join(sorted(set(self.devices)))
        first = (
            f"nbdist: comm bench · {self.world} ranks · backend {self.backend} · device {devices}"
        )
        rows, folded = self._shown_rows()
        lines = [f"{first} · {self.note}", _table(rows), *folded]
        for op, why in self.skipped.items():
            lines.append(f"{op}: skipped, the {self.backend} group cannot run it here ({why})")
        return "\n".join(lines)

    def _shown_rows(self) -> tuple[list[dict], list[str]]:
        """The rows the report shows, and a line on the links left out.

        Past :data:`_MAX_PAIR_ROWS` links (256 ranks: 255 of them) the table shows their
        median and the links far slower than the others only, as ``%dist_status`` shows
        the ranks that deviate; :meth:`table` keeps every link.
        """
        pairs = [r for r in self.rows if r["op"] == "sendrecv"]
        if len(pairs) <= _MAX_PAIR_ROWS:
            return self.rows, []
        by_peer = {int(r["ranks"].split("↔")[1]): r for r in pairs}
        slow = {link.rank for link in slow_links({p: r["algbw_gbs"] for p, r in by_peer.items()})}
        peers = format_ranks(by_peer).removeprefix("ranks ")
        seconds = statistics.median(r["time_us"] / 1e6 for r in pairs)
        median = _row("sendrecv", f"0↔{peers} (median)", pairs[0]["bytes"], seconds, 2)
        shown = [r for r in self.rows if r["op"] != "sendrecv"] + [median]
        shown += [by_peer[p] for p in sorted(slow)]
        if slow:
            said = (
                f"{len(slow)} {SLOW_FACTOR:g}x or more slower than the median of the others, shown"
            )
        else:
            said = f"none {SLOW_FACTOR:g}x below the others"
        return shown, [
            f"sendrecv: {len(pairs)} links with rank 0, their median; {said} "
            "(nbdist.driver.comm_table.bench_comm() lists every link)"
        ]

    def __str__(self) -> str:
        """The report."""
        return self.report()


def _session(session):
    if session is None:
        from nbdist.driver.live_sessions import current_session

        return current_session()
    session.select(None)  # raises ClusterNotRunning when it is not running
    return session


def rank_memory(session) -> tuple[str, int, list[str]]:
    """("cuda" or "cpu", the smallest bytes a rank may take for buffers, each rank's device)."""
    found = session.apply(comm_bench.memory_limit)
    kind = "cuda" if any(f["type"] == "cuda" for f in found) else "cpu"
    return kind, min(f["free"] for f in found), [f["device"] for f in found]


def measure_comm(
    session=None, *, sizes=None, ops=None, iters=None, pairs: bool = True
) -> CommResult:
    """Time the collectives (and rank 0's send/recv with each rank) on the running ranks.

    ``sizes``: bytes, a list or text such as ``"1K,1M,64M"`` (default: 1 KiB,
    4 KiB, ... 64 MiB on CPU, 1 GiB on GPU, capped by free memory); ``ops``:
    some of ``comm_bench.OPS`` (default all); ``iters``: timed calls per size
    (default: fewer for larger sizes); ``pairs``: also the send/recv rows.
    Bad values raise PlacementError before anything runs; a session that is
    not running, ClusterNotRunning.
    """
    session = _session(session)
    if isinstance(sizes, str):
        sizes = parse_sizes(sizes)
    elif sizes is not None:
        if not sizes or any(not isinstance(s, int) or s <= 0 for s in sizes):
            raise PlacementError(f"sizes {sizes!r}: give positive byte counts, or {_SIZES_FORMAT}")
        sizes = sorted(set(sizes))
    ops = parse_ops(ops) if ops is not None else list(comm_bench.OPS)
    if iters is not None and (not isinstance(iters, int) or iters < 1):
        raise PlacementError(
            f"--iters: {iters!r} must be a whole number of at least 1, e.g. --iters 20"
        )
    world, backend = session.world_size, session.backend
    kind, free, devices = rank_memory(session)
    if sizes is None:
        sizes = default_sizes(kind, free, world)
    most = int(free / 2 / (1 + 1 / world))  # the buffer and its shard in half the free memory
    if sizes[-1] > most:
        raise PlacementError(
            f"--sizes: {format_size(sizes[-1])} does not fit: a rank has {format_size(free)} "
            f"free; give sizes up to {format_size(most)}"
        )
    budget, lo, hi, warmup = _ITERS["nccl" if backend == "nccl" else "gloo"]
    per_size = {int(s): int(iters) if iters else max(lo, min(hi, budget // s)) for s in sizes}
    started = time.perf_counter()
    found = session.apply(comm_bench.time_collectives, sorted(per_size), ops, per_size, warmup)
    rows = collective_rows(found)
    skipped = dict(found[0]["skipped"])
    if pairs and world > 1:
        nbytes = pair_bytes(kind, free)
        paired = session.apply(comm_bench.time_pairs, nbytes, int(iters or _PAIR_ITERS), warmup)
        rows += pair_rows(paired)
        skipped.update(paired[0]["skipped"])
    counts = sorted(set(per_size.values()))
    many = f"{counts[0]}" if len(counts) == 1 else f"{counts[0]}-{counts[-1]}"
    note = (
        f"median of {many} calls per size after {warmup} warm-up, each timed between barriers "
        f"(slowest rank); busBW as nccl-tests · {time.perf_counter() - started:.1f} s"
    )
    return CommResult(world, backend, devices, rows, skipped, note)


def bench_comm(sizes=None, ops=None, iters=None, *, pairs: bool = True, session=None):
    """Latency and bandwidth of the collectives between the running ranks, as a table.

    One row per op and size: op, ranks, size, bytes, time_us (median), algbw_gbs,
    busbw_gbs (nccl-tests' formulas); with ``pairs``, a ``sendrecv`` row per rank
    paired with rank 0. A pandas DataFrame, or a list of dicts without pandas.
    ``session``: default the running one. See :func:`measure_comm`. Example::

        bench_comm(sizes="1K,64M", ops="all_reduce,all_gather")
    """
    return measure_comm(session, sizes=sizes, ops=ops, iters=iters, pairs=pairs).table()
