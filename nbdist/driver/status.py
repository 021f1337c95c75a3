"""Kernel side: the rows of ``%dist_status``, what each rank is doing, read without disturbing it.

Everything comes from the controller (queue state, heartbeats) and from the
operating system (memory by PID for local ranks): asking a busy rank itself
would wait behind the cell it is running. States are :mod:`nbdist.rank_states`'s.
The one question ranks answer is their GPU's figures, and only ranks whose
device is a GPU are asked: on the engine's control channel, answered by the
rank's control thread while a cell runs (:mod:`nbdist.engine.control`). A row
has a ``gpu`` entry only when its rank answered with one, and the table has
GPU columns only when some row has.
"""

from __future__ import annotations

from nbdist.dashboard.table import fmt_gpu_memory, fmt_gpu_temp, fmt_gpu_util
from nbdist.driver.where import control_request
from nbdist.rank_states import BUSY, DEAD, IDLE
from nbdist.text_table import format_table

__all__ = ["StatusTable", "format_status", "rank_status", "status_html"]

# A rank holding the GIL in native code does not answer; its GPU figures are then left out.
_GPU_ANSWER_TIMEOUT_S = 1.0


def _rss_mib(pid: int) -> float | None:
    import psutil

    try:
        proc = psutil.Process(pid)
        if proc.status() == psutil.STATUS_ZOMBIE:  # exited, not yet reaped by its parent
            return None
        return proc.memory_info().rss / 2**20
    except psutil.Error:
        return None


def _gpu_figures(client, ranks, alive: set[int]) -> dict[int, dict]:
    """{rank: its GPU's figures} for the live ranks on a CUDA device that gave them."""
    asked = [r for r in ranks if r.engine_id in alive and str(r.device).startswith("cuda")]
    if not asked:
        return {}
    replies = control_request(
        client, [r.engine_id for r in asked], "gpu", timeout=_GPU_ANSWER_TIMEOUT_S
    )
    return {
        info.rank: reply["gpu"]
        for info, reply in zip(asked, replies)
        if reply is not None and isinstance(reply.get("gpu"), dict)
    }


def rank_status(
    handle,
    ranks,
    backend: str | None,
    dead: dict | None = None,
    *,
    gpu: bool = True,
    dropped: dict[int, int] | None = None,
) -> list[dict]:
    """One dict per rank; ``dead``: {rank: how it died}, as the session noticed it.

    ``dropped``: {rank: metrics points it could not send} (the run's
    :attr:`~nbdist.metrics.run.Run.dropped`); each row's ``dropped`` is that
    count (0 for a rank not in it), or None when not given.

    ``gpu``: ask the ranks on GPUs for their GPU's figures (``row["gpu"]``: ``index``,
    ``name``, ``uuid``, ``util`` %, ``mem_used_mib``, ``mem_total_mib``, ``temp_c``;
    a figure the GPU does not report is None). Rows of ranks without one have no ``gpu``.
    """
    dead = dead or {}
    client = handle.client
    alive_ids = set(client.ids)
    try:
        queues = client.queue_status(
            targets=[r.engine_id for r in ranks if r.engine_id in alive_ids]
        )
    except Exception:  # controller gone: every rank shows as dead below
        queues, alive_ids = {}, set()
    living = [r for r in ranks if r.rank not in dead]
    gpus = _gpu_figures(client, living, alive_ids) if gpu else {}
    rows = []
    for info in ranks:
        queue = queues.get(info.engine_id, {})
        if info.engine_id not in alive_ids:
            state = DEAD
        elif queue.get("queue", 0) or queue.get("tasks", 0):
            state = BUSY
        else:
            state = IDLE
        memory = _rss_mib(info.pid) if handle.owned else None
        if (handle.owned and memory is None) or info.rank in dead:
            state = DEAD
        rows.append(
            dict(
                rank=info.rank,
                engine=info.engine_id,
                host=info.host,
                pid=info.pid,
                device=info.device,
                backend=backend,
                state=state,
                memory_mib=None if memory is None else round(memory, 1),
                died=dead.get(info.rank),
                dropped=None if dropped is None else int(dropped.get(info.rank, 0)),
            )
        )
        if info.rank in gpus and state != DEAD:
            rows[-1]["gpu"] = gpus[info.rank]
    return rows


def _gpu_cells(gpu: dict | None) -> list[str]:
    if not gpu:
        return ["–", "–", "–", "–"]
    index, name = gpu.get("index"), gpu.get("name") or ""
    which = ("?" if index is None else str(index)) + (f" {name}" if name else "")
    return [
        which,
        fmt_gpu_util(gpu.get("util")),
        fmt_gpu_memory(gpu.get("mem_used_mib"), gpu.get("mem_total_mib")),
        fmt_gpu_temp(gpu.get("temp_c")),
    ]


def _table(rows: list[dict]) -> tuple[list[str], list[list[str]], list[str]]:
    """The headers, cells and notes both forms of the table show.

    The ipyparallel engine id is left out: it is nbdist's plumbing, differs from
    the rank after a restart, and read as a second rank number (it stays in the rows).
    """
    headers = ["rank", "host", "pid", "device", "backend", "state", "memory"]
    # Metrics points a rank logged but could not send (normally 0); when the session tells.
    with_dropped = any(r.get("dropped") is not None for r in rows)
    if with_dropped:
        headers.append("dropped")
    with_gpu = any(r.get("gpu") for r in rows)
    if with_gpu:
        headers += ["gpu", "gpu util", "gpu memory", "gpu temp"]
    table = [
        [
            str(r["rank"]),
            r["host"],
            str(r["pid"]),
            r["device"],
            str(r["backend"]),
            r["state"],
            "?" if r["memory_mib"] is None else f"{r['memory_mib']:.0f} MiB",
            *([str(r.get("dropped", "–"))] if with_dropped else []),
            *(_gpu_cells(r.get("gpu")) if with_gpu else []),
        ]
        for r in rows
    ]
    notes = []
    dead = [r for r in rows if r["state"] == DEAD]
    for r in dead:
        notes.append(f"rank {r['rank']} died: {r.get('died') or 'its process is gone'}")
    if dead:
        notes.append("%dist_restart brings every rank back")
    lost = sum(r.get("dropped") or 0 for r in rows)
    if lost:
        notes.append(
            f"{lost} metrics points dropped on the ranks: their buffer was full "
            "(NBDIST_LOG_BUFFER) or a value could not be sent"
        )
    shared = _shared_gpus(rows)
    if shared:
        notes.append(shared)
    return headers, table, notes


def format_status(rows: list[dict]) -> str:
    """A fixed-width text table of :func:`rank_status` rows, then its notes (dead ranks...)."""
    headers, table, notes = _table(rows)
    return "\n".join([format_table(headers, table), *notes])


def status_html(rows: list[dict]) -> str:
    """The same table as HTML: each rank in its dashboard colour, a dead rank's state in red."""
    from html import escape

    from nbdist.dashboard.palette import rank_colour

    headers, table, notes = _table(rows)
    head = "".join(f"<th style='text-align:left'>{escape(h)}</th>" for h in headers)
    body = []
    for r, cells in zip(rows, table):
        tds = []
        for h, c in zip(headers, cells):
            text = escape(c)
            if h == "rank":
                swatch = f"<span style='color:{rank_colour(int(r['rank']))}'>&#9632;</span> "
                text = swatch + text
            elif h == "state" and c == DEAD:
                text = f"<b style='color:#c62828'>{text}</b>"
            tds.append(f"<td style='text-align:left'>{text}</td>")
        body.append("<tr>" + "".join(tds) + "</tr>")
    foot = "".join(f"<div>{escape(n)}</div>" for n in notes)
    return (
        f"<table class='nbdist-status'><thead><tr>{head}</tr></thead>"
        f"<tbody>{''.join(body)}</tbody></table>{foot}"
    )


class StatusTable:
    """What ``%dist_status`` displays: HTML in a notebook, the text table elsewhere."""

    def __init__(self, rows: list[dict]):
        """``rows``: :func:`rank_status`'s."""
        self.rows = rows

    def __repr__(self) -> str:
        """The text table (a terminal, a saved notebook's text/plain)."""
        return format_status(self.rows)

    def _repr_html_(self) -> str:
        return status_html(self.rows)


def _shared_gpus(rows: list[dict]) -> str:
    """A note naming the GPUs several ranks share (their figures are the whole GPU's)."""
    by_gpu: dict[tuple, list[int]] = {}
    for r in rows:
        gpu = r.get("gpu")
        if gpu and (gpu.get("uuid") or gpu.get("index") is not None):
            by_gpu.setdefault((r["host"], gpu.get("uuid") or gpu.get("index")), []).append(
                r["rank"]
            )
    notes = []
    for (host, _), ranks in by_gpu.items():
        if len(ranks) > 1:
            index = next(r["gpu"].get("index") for r in rows if r["rank"] == ranks[0])
            notes.append(f"ranks {', '.join(map(str, ranks))} share GPU {index} on {host}")
    if not notes:
        return ""
    return "; ".join(notes) + " (gpu figures are the whole GPU's)"
