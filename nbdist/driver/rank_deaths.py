"""Kernel side: how a rank died, noticed the moment it exits.

:class:`RankMonitor` is one thread per session that waits on a ``pidfd`` per local
rank: the kernel learns that a rank died the moment it exits (not after missed
heartbeats), and reads how it died (``/proc/<pid>/stat``'s exit status, readable until
the engine's parent reaps it; else the parent's record), with the cause in words
(:func:`death_cause`: a signal, the out-of-memory killer, a scheduler's SIGTERM, where
in Python a crash was). Ranks of an attached cluster are watched through the
controller (an engine that stops beating is unregistered after ~1 s):
:func:`dead_ranks` joins both; :func:`dead_ranks_message` is what a call on dead ranks
says. The cell guard (:mod:`nbdist.driver.faults`) releases the ranks that wait for a
dead one.

Example (what a notebook user sees)::

    rank 1 died: pid 4242 killed by SIGKILL (signal 9): kill -9, or the kernel's
    out-of-memory killer (dmesg names it). %dist_restart (or restart()) brings every rank back
"""

from __future__ import annotations

import os
import select
import signal
import threading
import time

from nbdist.driver import crash_stack
from nbdist.driver.oom import OomCounter, oom_counter
from nbdist.engine import held_collective
from nbdist.errors import format_ranks
from nbdist.number_ranges import fold_texts

__all__ = ["RankMonitor", "dead_ranks", "dead_ranks_message", "death_cause"]


# The fatal signals faulthandler dumps the Python stack for.
_DUMPED = {signal.SIGSEGV, signal.SIGFPE, signal.SIGABRT, signal.SIGBUS, signal.SIGILL}


def death_cause(status: int | None, oom: OomCounter | None = None) -> str:
    """Words for a ``waitpid`` status (None: not known).

    ``oom``: the rank's memory cgroup counter, read while it was alive; if it rose,
    a SIGKILL was the kernel's out-of-memory killer and the words say so.
    """
    if status is None:
        return "exited (exit status not available)"
    sig = status & 0x7F
    if sig:
        try:
            name = signal.Signals(sig).name
        except ValueError:
            name = f"signal {sig}"
        if sig == signal.SIGKILL:
            if oom is not None and oom.rose():
                limit = oom.limit()
                return (
                    f"killed by the kernel's out-of-memory killer ({name}): its memory cgroup "
                    f"{oom.directory} ran out of memory"
                    + (f" (limit {limit})" if limit else "")
                    + ". Use less memory per rank (smaller batches, fewer data-loader "
                    "workers, fewer ranks per host) or raise the limit"
                )
            return (
                f"killed by {name} (signal {sig}): kill -9, or the kernel's out-of-memory "
                "killer (dmesg names it)"
            )
        if sig == signal.SIGSEGV:
            return f"crashed: segmentation fault ({name}, signal {sig}) in native code"
        return f"killed by {name} (signal {sig})"
    code = (status >> 8) & 0xFF
    if code == 128 + signal.SIGTERM:
        # Engines a scheduler started end themselves on its SIGTERM (nbdist.launch.batch_task_engine).
        return (
            f"exited with code {code} on SIGTERM: its job was cancelled (scancel), ran out "
            "of time, or was preempted"
        )
    if code == held_collective.EXIT_CODE:
        return (
            f"exited with code {code}: nbdist ended it, held in a collective after a release "
            "(its wait would have lasted until the group's timeout)"
        )
    return f"exited with code {code}"


def _exit_status(pid: int) -> int | None:
    """The exit status of a zombie (field 52 of /proc/<pid>/stat, Linux >= 3.5)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            text = f.read()
    except OSError:
        return None
    fields = text.rpartition(")")[2].split()
    # fields[0] is field 3 (state); exit_code is field 52.
    if len(fields) < 50 or fields[0] != "Z":
        return None
    return int(fields[49])


def _wait_for_record(exit_record, pid: int, timeout: float = 0.5) -> int | None:
    deadline = time.monotonic() + timeout
    while True:
        status = exit_record(pid)
        if status is not None or time.monotonic() > deadline:
            return status
        time.sleep(0.02)


class RankMonitor:
    """Notices local ranks dying, at once, and records how (``dead``: {rank: cause})."""

    def __init__(
        self, ranks, on_death=None, exit_record=None, crash_record=None, engine_words=None
    ) -> None:
        """Watch the local ``ranks`` (RankInfo); ``on_death(rank)`` is called on the watcher thread
        (here, before this returns, for a rank whose process was gone already).

        ``exit_record(pid)``: the wait status the ranks' parent kept, or None (for a
        rank reaped before its zombie could be read). ``crash_record(pid)``: what
        faulthandler wrote when the rank died of a fatal signal ('' if nothing): the
        cause then says where in Python it was (:mod:`nbdist.driver.crash_stack`).
        ``engine_words(engine_id)``: the last CRITICAL line the rank's engine logged
        ('' if none, :class:`nbdist.launch.engine_log.EngineLastWords`): a rank that
        exited by itself is named with it (the engine's "received signal 15, stopping"
        is all that tells a ``kill`` from outside from any other exit with code 1).
        """
        self.dead: dict[int, str] = {}
        self._on_death = on_death
        self._exit_record = exit_record
        self._crash_record = crash_record
        self._engine_words = engine_words
        self._engine_ids = {info.rank: info.engine_id for info in ranks}
        self._fds: dict[int, tuple[int, int]] = {}  # fd -> (rank, pid)
        self._oom: dict[int, OomCounter | None] = {}  # rank -> its memory cgroup's OOM kills
        # Ranks whose process had ended before it could be watched (reaped: no PID; or a
        # zombie, below): a named session's rank that died while no kernel
        # held it. The controller never drops a local engine by itself
        # (nbdist.launch.heartbeat), so they are named here, before this returns: the next
        # cell must not be sent to them.
        gone: list[tuple[int, int]] = []
        for info in ranks:
            if not info.pid_here:  # a PID of another host (or namespace) names another process
                continue
            try:
                fd = os.pidfd_open(info.pid)
            except ProcessLookupError:
                gone.append((info.rank, info.pid))
                continue
            except (OSError, AttributeError):  # no pidfd (old kernel)
                continue
            # A zombie leader whose other threads still exit (a SIGKILLed rank's gloo and torch
            # threads, on a loaded machine) is dead, but its pidfd reads only once they are gone.
            if select.select([fd], [], [], 0)[0] or _exit_status(info.pid) is not None:
                os.close(fd)
                gone.append((info.rank, info.pid))
                continue
            self._fds[fd] = (info.rank, info.pid)
            # Read now: a dead process no longer shows its cgroup.
            self._oom[info.rank] = oom_counter(info.pid)
        for rank, pid in gone:
            self._died(rank, pid)
        self._stop_r, self._stop_w = os.pipe()
        self._thread = threading.Thread(target=self._watch, name="nbdist-rank-monitor", daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        poller = select.poll()
        for fd in self._fds:
            poller.register(fd, select.POLLIN)
        poller.register(self._stop_r, select.POLLIN)
        while self._fds:
            for fd, _ in poller.poll():
                if fd == self._stop_r:
                    return
                rank, pid = self._fds.pop(fd)
                poller.unregister(fd)
                os.close(fd)
                self._died(rank, pid)

    def _died(self, rank: int, pid: int) -> None:
        """Record how ``rank`` (``pid``) died, then tell ``on_death`` (on the watcher thread, or
        on the caller's for a rank already gone when the watch began)."""
        # From the zombie if its parent has not reaped it yet, else from the
        # parent's record (the zygote reaps within 0.1 s, then writes it).
        status = _exit_status(pid)
        if status is None and self._exit_record is not None:
            status = _wait_for_record(self._exit_record, pid)
        cause = death_cause(status, self._oom.get(rank))
        where = self._where(pid, status) or self._last_words(rank, status)
        if status is None and where:  # 'crashed: <what>, <where>' from its record
            self.dead[rank] = f"pid {pid} {where}"
        else:
            # " - ", not "; ": several ranks' causes are joined with "; ".
            self.dead[rank] = f"pid {pid} {cause}" + (f" - {where}" if where else "")
        if self._on_death is not None:
            self._on_death(rank)

    def _where(self, pid: int, status: int | None) -> str:
        if self._crash_record is None:
            return ""
        if status is None:
            # A launcher's rank, reaped by its own parent (slurmstepd, orted, sshd's child)
            # before its status could be read: its record says whether it crashed.
            return crash_stack.crash_words(self._crash_record(pid))
        if (status & 0x7F) not in _DUMPED:
            return ""
        return crash_stack.summary(self._crash_record(pid))

    def _last_words(self, rank: int, status: int | None) -> str:
        if self._engine_words is None or status is None or status & 0x7F:
            return ""  # not known, or a signal it did not handle: the signal says it
        words = self._engine_words(self._engine_ids[rank])
        return f"its engine logged: {words}" if words else ""

    def stop(self) -> None:
        """Stop watching and close the pidfds (idempotent)."""
        try:
            os.write(self._stop_w, b"x")
        except OSError:
            pass
        self._thread.join(timeout=2)
        for fd in [*self._fds, self._stop_r, self._stop_w]:
            try:
                os.close(fd)
            except OSError:
                pass
        self._fds.clear()


def dead_ranks(
    monitor: RankMonitor | None, client, ranks, among=None, crashes=None
) -> dict[int, str]:
    """{rank: how it died}: what ``monitor`` saw end, and engines the controller no longer has.

    ``ranks``: RankInfo of the group; ``among``: only these rank numbers (None: all);
    ``crashes``: the launcher-started ranks' crash records
    (:class:`nbdist.driver.launcher_crashes.CrashRecords`), for where a vanished one crashed.
    """
    dead = dict(monitor.dead) if monitor is not None else {}
    alive_ids = set(client.ids)
    for info in ranks:
        if info.engine_id not in alive_ids and info.rank not in dead:
            cause = "its engine stopped answering the controller's heartbeat"
            where = crashes.words(info.rank, client) if crashes else ""
            dead[info.rank] = f"{cause} - {where}" if where else cause
    return {r: c for r, c in dead.items() if among is None or r in among}


def dead_ranks_message(dead: dict[int, str], hint: str, alive: int | None) -> str:
    """What a call on dead ranks says: how each died, ``hint`` (what brings them back), and,
    with ``alive`` (a live rank), that its values can still be pulled first."""
    which = "; ".join(f"{format_ranks(r)} died: {c}" for r, c in fold_texts(dead))
    keep = (
        ""
        if alive is None
        else f"; what a live rank holds can be pulled first: %dist_pull NAME --rank {alive}"
    )
    return f"{which}. {hint}{keep}"
