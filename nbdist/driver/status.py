"""Kernel side: the rows of ``%dist_status``, what each rank is doing, read without disturbing it.

Everything comes from the controller (queue state, heartbeats) and from the
operating system (memory by PID for local ranks): asking a busy rank itself
would wait behind the cell it is running. States are :mod:`nbdist.rank_states`'s.
"""

from __future__ import annotations

from nbdist.rank_states import BUSY, DEAD, IDLE

__all__ = ["format_status", "rank_status"]


def _rss_mib(pid: int) -> float | None:
    import psutil

    try:
        proc = psutil.Process(pid)
        if proc.status() == psutil.STATUS_ZOMBIE:  # exited, not yet reaped by its parent
            return None
        return proc.memory_info().rss / 2**20
    except psutil.Error:
        return None


def rank_status(handle, ranks, backend: str | None, dead: dict | None = None) -> list[dict]:
    """One dict per rank; ``dead``: {rank: how it died}, as the session noticed it."""
    dead = dead or {}
    client = handle.client
    alive_ids = set(client.ids)
    try:
        queues = client.queue_status(
            targets=[r.engine_id for r in ranks if r.engine_id in alive_ids]
        )
    except Exception:  # controller gone: every rank shows as dead below
        queues, alive_ids = {}, set()
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
            )
        )
    return rows


def format_status(rows: list[dict]) -> str:
    """A fixed-width text table of :func:`rank_status` rows."""
    headers = ["rank", "engine", "host", "pid", "device", "backend", "state", "memory"]
    table = [
        [
            str(r["rank"]),
            str(r["engine"]),
            r["host"],
            str(r["pid"]),
            r["device"],
            str(r["backend"]),
            r["state"],
            "?" if r["memory_mib"] is None else f"{r['memory_mib']:.0f} MiB",
        ]
        for r in rows
    ]
    widths = [max(len(h), *(len(row[i]) for row in table)) for i, h in enumerate(headers)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(headers, widths))]
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths)) for row in table]
    dead = [r for r in rows if r["state"] == DEAD]
    for r in dead:
        lines.append(f"rank {r['rank']} died: {r.get('died') or 'its process is gone'}")
    if dead:
        lines.append("%dist_restart brings every rank back")
    return "\n".join(line.rstrip() for line in lines)
