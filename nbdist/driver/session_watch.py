"""Kernel side: a running session's watchers, from the group's forming to the ranks' stop.

The rank monitor (local ranks' deaths, at once, with how and where), the
launcher-started ranks' crash records, the session's entry among the kernel's
live sessions (the dashboard's) and its entry in the registry (the JupyterLab
sidebar's). :class:`nbdist.driver.session.DistSession` makes one when its group
forms and ends it before the ranks stop or are replaced.
"""

from __future__ import annotations

import functools

from nbdist.driver import live_sessions, registry
from nbdist.driver.launcher_crashes import CrashRecords
from nbdist.driver.rank_deaths import RankMonitor
from nbdist.launch import engine_unregister, zygote
from nbdist.launch.engine_log import EngineLastWords

__all__ = ["SessionWatch", "rank_monitor"]


def rank_monitor(handle, ranks, *, crash_records=None) -> RankMonitor | None:
    """A :class:`RankMonitor` of ``ranks`` (RankInfo) that ``handle`` started (None if attached).

    Where the zygote forked them, how a rank died and where it crashed come from its records;
    else ``crash_records(pid)`` reads where a launcher's rank crashed (None: not read). A rank
    that dies is dropped from the controller at once.
    """
    if not handle.owned:
        return None
    status_file = handle.zygote_status_file()
    record = functools.partial(zygote.read_exit, status_file) if status_file else None
    crash = functools.partial(zygote.read_crash, status_file) if status_file else crash_records
    log_file = getattr(handle.engine_launcher(), "output_file", "")
    words = EngineLastWords(log_file).of if log_file else None
    engine_ids = {info.rank: info.engine_id for info in ranks}

    def unregister(rank: int) -> None:
        # The controller keeps a local engine whose heart is silent (nbdist.launch.heartbeat):
        # a dead one leaves its list now, as if it had left.
        engine_unregister.unregister(handle, [engine_ids[rank]])

    return RankMonitor(
        ranks, on_death=unregister, exit_record=record, crash_record=crash, engine_words=words
    )


class SessionWatch:
    """A running session's watchers: the rank monitor (local ranks), its live entry, its sidebar entry."""

    def __init__(self, session, handle, hub, *, connection_file: str | None) -> None:
        """Watch ``session``'s ranks (its group formed), started through ``handle``."""
        # Ranks a launcher started keep crash records of their own (the zygote's are below).
        self.crashes = CrashRecords(session.group.ranks)
        self.monitor = rank_monitor(
            handle,
            session.group.ranks,
            crash_records=self.crashes.read_here if self.crashes else None,
        )
        live_sessions.started(session)
        self.session = session
        store = hub.store
        self.registry_path = registry.register_cluster(
            session,
            handle=handle,
            ranks=session.ranks,
            backend=session.backend,
            run_id=hub.run.id if store is not None else None,
            history=store.path if store is not None else None,
            connection_file=connection_file,
        )

    def remove_crash_records(self, client) -> None:
        """The ranks are about to end (not at a named session's detach): their records go."""
        self.crashes.remove(client, dead=self.monitor.dead if self.monitor is not None else ())

    def end(self) -> None:
        """The ranks are about to stop, or to be replaced, or this kernel lets go of them."""
        live_sessions.stopped(self.session)
        if self.monitor is not None:
            self.monitor.stop()
        registry.unregister_cluster(self.registry_path)
