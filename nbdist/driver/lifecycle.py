"""Kernel side: the steps a session's start, restart and stop share, and the line each prints.

- :class:`Watch`: while ranks run, the session watches them (a ``pidfd`` per
  local rank), lists them for the JupyterLab sidebar and counts as live.
- :func:`restart_in_place`: fresh ranks forked by the zygote that is already
  running (:mod:`nbdist.launch.restart`), or why a full restart is needed.
- :func:`summary_text`: the line ``%dist_start`` and ``%dist_restart`` print. A
  restart gives fresh processes, and the line says so::

    nbdist: restarted 2 ranks in 1.2 s · backend gloo · device cpu (fresh processes: names defined in cells are gone)
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from nbdist.driver import live_sessions, registry
from nbdist.driver.faults import RankMonitor
from nbdist.driver.group import metrics_ip, metrics_key
from nbdist.launch import restart, zygote
from nbdist.launch.cluster import stop_processes

__all__ = ["Restarted", "Watch", "metrics_for", "restart_in_place", "summary_text"]


def metrics_for(hub, handle, *, world_size: int, backend: str, history, ip: str):
    """The session's ``MetricsHub``: opened at its first start; at a restart, told of fresh ranks."""
    key = metrics_key(handle.client)
    if hub is None:
        from nbdist.metrics.hub import MetricsHub

        ip = metrics_ip(handle.client, owned=handle.owned, ip=ip)
        return MetricsHub.open(key, world_size=world_size, backend=backend, history=history, ip=ip)
    hub.collector.new_cluster(key)  # fresh ranks count their points from 0 (a new key if new)
    return hub


class Watch:
    """A running session's watchers: the rank monitor (local ranks), its live entry, its sidebar entry."""

    def __init__(self, session, handle, hub, *, attach) -> None:
        """Start watching ``session``'s ranks on ``handle`` (a ``ClusterHandle``); ``hub``: its metrics."""
        self.monitor = None
        if handle.owned:
            status_file = getattr(handle.engine_launcher(), "status_file", None)
            record = functools.partial(zygote.read_exit, status_file) if status_file else None
            self.monitor = RankMonitor(session.group.ranks, exit_record=record)
        live_sessions.started(session)
        self.session = session
        store = hub.store
        self.registry_path = registry.register(
            session, handle=handle, ranks=session.ranks, backend=session.backend,
            run_id=hub.run.id if store is not None else None,
            history=store.path if store is not None else None, attach=attach,
        )  # fmt: skip

    def end(self) -> None:
        """Stop watching (the ranks are about to stop, or to be replaced)."""
        live_sessions.stopped(self.session)
        if self.monitor is not None:
            self.monitor.stop()
        registry.unregister(self.registry_path)


def restart_in_place(handle, *, world_size: int, timeout: float, detach, rebuild, abort) -> str:
    """Fork fresh ranks from the running zygote; '' when done, else why a full restart is needed.

    ``detach()`` stops watching the old ranks and takes ``handle`` from the
    session; ``rebuild(handle)`` forms the group over the fresh ones; ``abort()``
    stops everything (an interrupt midway). On failure the processes are stopped.
    """
    why = restart.in_place_refusal(handle) if handle is not None else "not running"
    if why:
        return why
    detach()
    try:
        restart.restart_in_place(handle, n=world_size, timeout=timeout)
    except BaseException as exc:
        stop_processes(handle)
        if not isinstance(exc, Exception):
            abort()
            raise
        return f"restarting in place failed ({exc})"
    try:
        rebuild(handle)  # which stops the processes itself if it fails
    except Exception as exc:
        return f"restarting in place failed ({exc})"
    except BaseException:
        abort()
        raise
    return ""


@dataclass(frozen=True)
class Restarted:
    """A session's last restart: its seconds, why it was a full one ('' if not), fresh processes or not.

    ``fresh`` is False for an attached cluster: its engines are the same
    processes, the group formed again on them, and their names are kept.
    """

    seconds: float
    note: str = ""
    fresh: bool = True


def summary_text(session) -> str:
    """The start line (or restart line) of a running ``session``; a second where ranks share GPUs."""
    ranks = session.ranks
    devices = ", ".join(sorted({r.device for r in ranks}))
    hosts = sorted({r.host for r in ranks})
    where = f" on {len(hosts)} hosts" if len(hosts) > 1 else ""
    what = f"backend {session.backend} · device {devices}"
    restarted = session.restarted
    if restarted is not None:
        if restarted.fresh:
            how = f"full restart: {restarted.note}; " if restarted.note else ""
            how += "fresh processes: names defined in cells are gone"
        else:
            how = f"{restarted.note}; the same processes: names defined in cells are kept"
        line = (
            f"nbdist: restarted {len(ranks)} ranks{where} in {restarted.seconds:.1f} s · {what} "
            f"({how})"
        )
    else:
        start_note = session.cluster.start_note
        line = (
            f"nbdist: {len(ranks)} ranks ready{where} · {what} · "
            f"{session.startup_seconds:.1f} s{f'; {start_note}' if start_note else ''}"
        )
    sharing = session.placement.sharing_note() if session.placement else ""
    return f"{line}\nnbdist: {sharing}" if sharing else line
