"""Kernel side: a DistSession's start, stop and restart.

:class:`SessionLifecycle` is the part of :class:`nbdist.driver.session.DistSession` that
brings its processes up and down: the engines started (or connected to), the metrics hub
opened, the process group formed, the ranks watched (a ``pidfd`` each, the sidebar entry);
at a stop the same undone in reverse order, whatever fails midway; at a restart fresh
ranks forked by the running zygote (:mod:`nbdist.launch.restart`), else a full stop and
start. It works on the session's own state (its handle, group, hub and watch), so it is a
base of ``DistSession`` rather than a separate object; a named session
(:mod:`nbdist.driver.named_sessions`) overrides how its ranks are let go of.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from functools import partial
from typing import TypeVar

from nbdist.driver import file_sync
from nbdist.driver.group import form_group, metrics_ip, metrics_key
from nbdist.driver.session_watch import SessionWatch, rank_monitor
from nbdist.driver.sigint_deferred import sigint_deferred
from nbdist.engine import bootstrap
from nbdist.errors import NbdistError
from nbdist.launch import restart
from nbdist.launch.cluster import (
    ClusterHandle,
    interrupt_engines,
    start_processes,
    stop_processes,
)

__all__ = ["Restarted", "SessionLifecycle"]

# The session itself (a DistSession), as start(), restart() and a with block return it.
_Session = TypeVar("_Session", bound="SessionLifecycle")


@dataclass(frozen=True)
class Restarted:
    """A session's last restart: its seconds, why it was a full one ('' if not), fresh processes or not.

    ``fresh`` is False for a cluster the session connected to: its engines are
    the same processes, the group formed again on them, and their names are kept.
    """

    seconds: float
    note: str = ""
    fresh: bool = True


class SessionLifecycle:
    """How a :class:`~nbdist.driver.session.DistSession` starts, stops and restarts its ranks."""

    def start(self: _Session) -> _Session:
        """Start (or connect to) the engines and form the process group; returns self."""
        if self.running:
            raise NbdistError(
                f"this session already runs {self.world_size} ranks: stop() or restart() it first"
            )
        t0 = time.perf_counter()
        self.restarted = None
        try:
            self._ready(start_processes(self.options, self.placement))
        except BaseException:
            self.stop()
            raise
        self.startup_seconds = time.perf_counter() - t0
        return self

    def _ready(self, handle: ClusterHandle) -> None:
        # The engines are up (started, or forked afresh by a restart): the group forms.
        self._handle = handle
        try:
            self._open_metrics(handle)
            self._form_group()
        except BaseException:
            self._stop_ranks()
            raise
        self._start_watching(handle, connection_file=self.options.connect)

    def _open_metrics(self, handle: ClusterHandle) -> None:
        # The MetricsHub is opened at a start; at a restart it is told of fresh ranks. A
        # stop closed it (its socket, thread and store): a start after that opens a new one
        # and a new run, or the ranks would send their points to a closed port.
        key = metrics_key(handle.client)
        if self._hub is not None and not self._hub.closed:
            # Fresh ranks count their points from 0 (under a new key if the cluster is new).
            self._hub.collector.new_cluster(key)
            return
        from nbdist.metrics.hub import MetricsHub

        self._hub = MetricsHub.open(
            key,
            world_size=self.placement.world_size if self.placement else len(handle.client.ids),
            backend=self.backend or "",
            history=self.history,
            ip=metrics_ip(handle.client, owned=handle.owned, ip=self.options.ip),
        )

    def _form_group(self) -> None:
        # Kept as a method: the start-up benchmark wraps it to time group formation.
        client, opts = self._handle.client, self.options
        self.group, self.placement = form_group(
            client,
            owned=self._handle.owned,
            placement=self.placement if self._handle.owned else None,
            options=opts,
            metrics_url=self._hub.url,
            # Under CurveZMQ the cluster key is empty and this channel encrypted:
            # the ranks get the metrics key here (never over an unencrypted channel).
            metrics_key_for_ranks=None if client.session.key else self._hub.collector.key,
            interrupt_engines=partial(interrupt_engines, self._handle),
            watch_deaths=partial(rank_monitor, self._handle),
            engine_processes=self._handle.engine_processes(),
        )
        if self.group.hosts:  # the dashboard names each rank's host
            self._hub.run.hosts = dict(self.group.hosts)
        self.cells = []  # fresh namespaces: earlier cells no longer describe them
        file_sync.resync(self)  # fresh ranks: the synced paths on their sys.path again

    def _start_watching(self, handle: ClusterHandle, *, connection_file: str | None) -> None:
        # The group is formed: watch the ranks, count as live, appear in the sidebar.
        self._watch = SessionWatch(self, handle, self._hub, connection_file=connection_file)

    def stop(self) -> list[int]:
        """Stop the ranks nbdist started (disconnect from a connected cluster); idempotent.

        Returns the PIDs that had to be force-killed (normally none). The run's
        metrics stay readable (``session.metrics``, ``nbdist.runs()``).
        """
        with sigint_deferred():  # a Ctrl-C midway would leave half a stop
            killed = self._stop_ranks()
            if self._hub is not None:
                self._hub.close()
                from nbdist.dashboard.live import freeze_views

                freeze_views(self._hub.run)
        return killed

    def _stop_ranks(self) -> list[int]:
        with sigint_deferred():  # the handle is let go of first: the rest must follow
            # The ranks are gone after this, also where a failed restart in place let go of
            # the handle and stopped the processes already (no ranks while not running).
            self._remove_crash_records()
            group, self.group = self.group, None
            handle = self._unwatch()
            if handle is None:
                return []
            if handle.client is not None and not handle.owned and group is not None:
                try:  # leave the group so the engines of a connected cluster can be reused
                    handle.client[group.engine_ids].apply_async(bootstrap.teardown).get(5)
                except Exception:
                    pass
            file_sync.session_stopping(self, handle.client)
            return stop_processes(handle)

    def _remove_crash_records(self) -> None:
        # The ranks are about to end: the crash records of those a launcher started go.
        if self._watch is not None and self._handle is not None and self._handle.client:
            self._watch.remove_crash_records(self._handle.client)

    def _unwatch(self) -> ClusterHandle | None:
        # The handle, taken from the session, which no longer watches its ranks.
        handle, self._handle = self._handle, None
        self._background.clear()  # their ranks are stopped or about to be replaced
        if self._watch is not None:
            self._watch.end()
            self._watch = None
        if handle is not None and handle.client is not None:
            # JupyterLab's debugger may reach ranks on other machines through this
            # client: those relays close while the client can still tell the ranks.
            from nbdist.driver.lab_debugger_cells import session_ended

            session_ended(handle.client)
        return handle

    def restart(self: _Session) -> _Session:
        """Fresh ranks, the group formed again, same number of ranks; the run continues.

        Forked afresh by the zygote that imported torch, the controller kept
        (:mod:`nbdist.launch.restart`); else (connected, ``launcher``, spawned) a
        full stop and start, ``restarted.note`` says why. Cells' names are gone.
        """
        t0 = time.perf_counter()
        why = self._restart_in_place()
        if why:
            self._stop_ranks()
            self.start()
        note = "" if why == "not running" else why
        self.restarted = Restarted(time.perf_counter() - t0, note, fresh=self._handle.owned)
        self._hub.mark_restart(self.world_size)
        return self

    def _restart_in_place(self) -> str:
        # Fresh ranks forked by the running zygote: '' when done, else why a full
        # restart is needed. On failure the processes are stopped.
        handle = self._handle
        why = restart.in_place_refusal(handle) if handle is not None else "not running"
        if why:
            return why
        world_size = self.placement.world_size if self.placement else 0
        self._unwatch()
        try:
            restart.restart_in_place(handle, n=world_size, timeout=self.options.timeout)
        except BaseException as exc:
            stop_processes(handle)
            if not isinstance(exc, Exception):  # an interrupt midway: stop everything
                self.stop()
                raise
            return f"restarting in place failed ({exc})"
        try:
            self._ready(handle)  # which stops the processes itself if it fails
        except Exception as exc:
            return f"restarting in place failed ({exc})"
        except BaseException:
            self.stop()
            raise
        return ""

    def __enter__(self: _Session) -> _Session:
        """Start (unless running) for a ``with`` block, which stops it at the end."""
        if not self.running:
            self.start()
        return self

    def __exit__(self, *exc) -> None:
        """Stop at the end of the ``with`` block."""
        self.stop()
