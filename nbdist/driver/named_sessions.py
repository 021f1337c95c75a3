"""Kernel side: named sessions, which outlive the kernel that started them, and attaching to them.

Example::

    from nbdist.driver.named_sessions import NamedSession, named_sessions, stop_named

    s = NamedSession(2, cpu=True, name="train1").start()   # %dist_start 2 --cpu --name train1
    s.run("x = rank")
    # ... the kernel dies, or s.detach() ...
    s = NamedSession.attach("train1")                      # %dist_attach train1, from any kernel
    s.follow_unfinished()      # the output of a cell still running on the ranks, until it ends
    s.pull("x")                # [0, 1]: the rank namespaces are intact
    named_sessions()           # [{'name': 'train1', 'ranks': 2, 'state': 'running', 'idle_s': ...}]
    stop_named("train1")       # %dist_stop train1, from any kernel
    stop_idle(3600)            # %dist_sessions --stop-idle 1h: end those idle for an hour

A session is idle while no kernel is attached and no cell runs on its ranks;
``NamedSession(..., idle_timeout=SECONDS)`` (``%dist_start --idle-timeout``) ends it
after that long idle. By default a named session runs until it is stopped.

The processes belong to a keeper process (:mod:`nbdist.launch.named_session_keeper`),
detached from every kernel, which also receives the ranks' metrics into the
run history; an attached kernel follows that run
(:class:`nbdist.metrics.follow.FollowHub`). A kernel that exits detaches from
its named sessions instead of stopping them (:mod:`nbdist.driver.live_sessions`).
Records live in ``<jupyter runtime dir>/nbdist/sessions`` (:mod:`nbdist.launch.named_session_records`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import subprocess
import sys
import time
from functools import partial

from nbdist.driver import file_sync
from nbdist.driver.group import Group, RankInfo, form_group
from nbdist.driver.ipp_internals import flush_sends
from nbdist.driver.session import DistSession
from nbdist.driver.session_watch import rank_monitor
from nbdist.errors import NbdistError, PlacementError
from nbdist.launch import named_session_records
from nbdist.launch.cluster import ClusterHandle, interrupt_engines
from nbdist.launch.values import check_seconds

__all__ = ["NamedSession", "named_sessions", "stop_idle", "stop_named"]

# Seconds on top of the ranks' own start-up timeout for the keeper to import and report.
_KEEPER_SLACK_S = 30.0


class NamedSession(DistSession):
    """A :class:`~nbdist.DistSession` whose processes outlive this kernel; ``name`` finds it again.

    Takes the options of ``DistSession`` (not ``connect``, and the metrics go to a
    history: ``history=False`` is refused). :meth:`stop` ends the ranks wherever
    they were started; :meth:`detach` leaves them running for a later
    :meth:`attach`. A named session is not restarted from a kernel.
    """

    #: Read by :mod:`nbdist.driver.live_sessions`: a kernel's exit detaches, it does not stop.
    outlives_kernel = True

    def __init__(
        self, n: int | None = None, *, name: str, idle_timeout: float | None = None, **options
    ):
        """Check ``name`` and the options (PlacementError if not valid); nothing starts yet.

        ``idle_timeout``: seconds with no kernel attached and no cell running after
        which the session ends itself (None: it runs until stopped).
        """
        try:
            named_session_records.check_name(name)
        except NbdistError as exc:
            raise PlacementError(str(exc)) from None
        if idle_timeout is not None:
            idle_timeout = check_seconds(idle_timeout, "idle_timeout")
        if options.get("connect") or options.get("attach"):
            raise PlacementError(
                f"--name {name} with --connect: a cluster connected to already runs apart from "
                "the kernel; leave out --name (or --connect to start a named session)"
            )
        if options.get("history") is False:
            raise PlacementError(
                f"session {name!r}: a named session keeps its metrics in the run history "
                "(history=False is not possible); pass a path, or None for the default"
            )
        super().__init__(n, **options)
        self.name = name
        keep = ("backend", "cpu", "gpus", "threads", "timeout", "launcher", "profile", "ip")
        self._keeper_options = {k: options[k] for k in keep if options.get(k) is not None}
        self._keeper_options.update(
            n=n,
            start_method=self.options.start_method,
            group_timeout=self.options.group_timeout,
            check_collectives=self.options.check_collectives,
            launch_options=dict(options["launch_options"])
            if options.get("launch_options")
            else None,
            history=self.history,
            idle_timeout=idle_timeout,
        )
        if self._keeper_options.get("gpus") is not None:
            self._keeper_options["gpus"] = list(self._keeper_options["gpus"])

    # -- lifecycle --------------------------------------------------------
    def start(self) -> NamedSession:
        """Start the keeper (which starts the ranks), then form the group from here; returns self."""
        if self.running:
            raise NbdistError(f"session {self.name!r} is running here already: %dist_stop first")
        # From the check that the name is free until the session runs (or is cleaned up):
        # another kernel starting the same name meanwhile is refused, nothing of it started.
        with named_session_records.claim(self.name):
            record = named_session_records.read(self.name)
            if record is not None:
                state = named_session_records.state_of(record)
                if state != "gone":
                    raise NbdistError(
                        f"a session named {self.name!r} is {state} already: %dist_attach "
                        f"{self.name} to use it, %dist_stop {self.name} to end it, or pick "
                        "another name"
                    )
                stop_named(self.name)  # what is left of a session whose keeper was killed
            t0 = time.perf_counter()
            record = _spawn_keeper(self.name, self._keeper_options, self.options.timeout)
            try:
                self._connect(record, None)
            except BaseException:
                self.stop()
                raise
        self.startup_seconds = time.perf_counter() - t0
        return self

    @classmethod
    def attach(cls, name: str, *, timeout: float | None = None) -> NamedSession:
        """Connect to the running named session ``name`` (started by this or another kernel).

        The ranks keep their namespaces; a cell still running on them goes on
        (:meth:`follow_unfinished` shows its output). ``timeout``: seconds to reach the engines.
        """
        record = named_session_records.read(named_session_records.check_name(name))
        if record is None:
            known = ", ".join(r["name"] for r in named_session_records.records()) or "none"
            raise NbdistError(
                f"no named session {name!r} (this user's: {known}); %dist_sessions lists them"
            )
        state = named_session_records.state_of(record)
        if state != "running":
            fix = (
                f"its keeper process ended: %dist_stop {name} removes what is left"
                if state == "gone"
                else "wait until it is running, or %dist_stop it"
            )
            raise NbdistError(f"session {name!r} is {state}: {fix}")
        options = dict(record.get("options") or {})
        n = options.pop("n", None)
        if timeout is not None:
            options["timeout"] = timeout
        session = cls(n, name=name, **options)
        session._connect(record, named_session_records.read_group(name))
        return session

    def _connect(self, record: dict, group: dict | None) -> None:
        # Reach the keeper's controller; form the group (first start) or take the
        # one recorded (attach: the ranks may be busy with a cell and answer nothing).
        from nbdist.metrics.follow import FollowHub

        handle = _connect_client(record, self.name, self.options.timeout)
        self._handle = handle
        try:
            self._hub = FollowHub(
                record["history"],
                record["run_id"],
                url=record["metrics_url"],
                world_size=record["n"],
                backend=record.get("backend") or "",
                started=record.get("run_started"),
            )
            if group is None:
                self.group, self.placement = form_group(
                    handle.client,
                    owned=True,
                    placement=self.placement,
                    options=self.options,
                    metrics_url=self._hub.url,
                    metrics_key_for_ranks=None,  # the cluster key signs: the keeper checks it
                    interrupt_engines=partial(interrupt_engines, handle),
                    watch_deaths=partial(rank_monitor, handle),
                )
                _write_group(self.name, self.group)
            else:
                self.group = Group(
                    [RankInfo(**r) for r in group["ranks"]],
                    group["rendezvous_addr"],
                    group["backend"],
                    hosts={int(k): v for k, v in (group.get("hosts") or {}).items()},
                    checks_collectives=bool(group.get("checks_collectives")),
                )
            if self.group.hosts:
                self._hub.run.hosts = dict(self.group.hosts)
        except BaseException:
            self.detach()
            raise
        self.cells = []
        self._start_watching(handle, connection_file=record.get("connection_file"))
        named_session_records.mark_attached(self.name)  # in use: not idle while attached

    def _stop_ranks(self) -> list[int]:
        # Leaves the ranks (and their group) running: only this kernel lets go of them.
        handle = self._unwatch()
        if handle is not None:
            named_session_records.mark_detached(self.name)
        self.group = None
        if handle is not None and handle.client is not None:
            try:
                flush_sends(handle.client)  # a --noblock cell sent just before still runs
                handle.client.close()
            except Exception:  # a dead controller: nothing to close
                pass
        return []

    def detach(self) -> list[int]:
        """Let go of the ranks, which keep running (a kernel's exit does this); idempotent."""
        return DistSession.stop(self)

    def stop(self) -> list[int]:
        """End the session: its keeper stops the ranks and the controller; idempotent.

        Returns the PIDs that had to be force-killed (normally none).
        """
        if self._handle is not None:  # while this kernel still reaches the ranks
            file_sync.session_stopping(self, self._handle.client)
            self._remove_crash_records()
        self.detach()
        try:
            return stop_named(self.name)
        except NbdistError:  # stopped already (here, or from another kernel)
            return []

    def restart_hint(self) -> str:
        """Not %dist_restart: a named session starts again by its name (and was maybe stopped)."""
        record = named_session_records.read(self.name)
        if record is None or named_session_records.state_of(record) == "gone":
            return (
                f"Session {self.name!r} was stopped (%dist_stop {self.name} in another kernel, "
                f"or its keeper ended): %dist_start with --name {self.name} starts it again"
            )
        return (
            f"A named session's ranks are not restarted from a kernel: %dist_stop {self.name}, "
            f"then %dist_start with --name {self.name} again"
        )

    def restart(self) -> NamedSession:
        """Not offered: a named session's processes belong to its keeper, not to this kernel."""
        raise NbdistError(
            f"session {self.name!r} is named: its ranks are not restarted from a kernel. "
            f"%dist_stop {self.name}, then %dist_start with --name {self.name} again"
        )

    def follow_unfinished(self, sink=None) -> list:
        """Stream the output of cells still running on the ranks (begun by an earlier kernel).

        Returns the per-rank results of the last such cell ([] when none ran);
        raises :class:`~nbdist.errors.RankError` if a rank raised in it.
        """
        from nbdist.driver.named_session_replay import follow_unfinished

        self._require_running()
        return follow_unfinished(self._handle.client, self.group, self._hub, self.interrupt, sink)

    def summary(self) -> str:
        """The start line, naming the session."""
        line = super().summary()
        return f"{line}\nnbdist: session {self.name!r} outlives this kernel: %dist_attach {self.name} reconnects"

    def __repr__(self) -> str:
        """``<NamedSession 'train1': 2 ranks, gloo>``."""
        state = f"{self.world_size} ranks, {self.backend}" if self.running else "not attached"
        return f"<NamedSession {self.name!r}: {state}>"


def _spawn_keeper(name: str, options: dict, timeout: float) -> dict:
    """Start the keeper of ``name`` and wait until its ranks are up; its record."""
    folder = named_session_records.session_dir(name, create=True)
    log_path = os.path.join(folder, named_session_records.LOG)
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    command = [sys.executable, "-m", "nbdist.launch.named_session_keeper"]
    command += ["--dir", folder, "--name", name, "--options", json.dumps(options)]
    with os.fdopen(fd, "w") as log:
        first = subprocess.Popen(
            command,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=log,
            start_new_session=True,
            close_fds=True,
        )
        first.wait()  # it forks the keeper proper and exits at once
    try:
        return _wait_for_keeper(name, log_path, timeout)
    except KeyboardInterrupt:
        # The keeper is no child of this kernel: it is ended through its record, which it
        # writes first thing (a few ms after the fork).
        until = time.monotonic() + 5.0
        while named_session_records.read(name) is None and time.monotonic() < until:
            time.sleep(0.05)
        with contextlib.suppress(NbdistError):
            stop_named(name)
        raise


def _wait_for_keeper(name: str, log_path: str, timeout: float) -> dict:
    deadline = time.monotonic() + timeout + _KEEPER_SLACK_S
    while True:
        record = named_session_records.read(name)
        state = named_session_records.state_of(record) if record is not None else "starting"
        if state == "running":
            return record
        # The keeper writes why it failed, then stops what it started and ends: by the next
        # look it may be gone already, and its record still says why.
        if record is not None and record.get("state") == "failed":
            stop_named(name)  # the keeper's leftovers and its directory: nothing runs there
            raise NbdistError(f"session {name!r} did not start: {record.get('error')}")
        if (record is not None and state == "gone") or time.monotonic() > deadline:
            tail = _tail(log_path)
            stop_named(name)
            why = "its keeper process ended" if state == "gone" else f"not up after {timeout:g} s"
            raise NbdistError(
                f"session {name!r} did not start ({why}): raise --timeout if the machine is busy"
                + (f"\n--- keeper log (last lines) ---\n{tail}" if tail else "")
            )
        time.sleep(0.1)


def _tail(path: str, lines: int = 15) -> str:
    try:
        with open(path) as f:
            return "".join(f.readlines()[-lines:])
    except OSError:
        return ""


def _connect_client(record: dict, name: str, timeout: float) -> ClusterHandle:
    import ipyparallel as ipp

    path = record.get("connection_file")
    if not path or not os.path.exists(path):
        raise NbdistError(f"session {name!r}: its connection file {path!r} is gone")
    client = ipp.Client(path, timeout=timeout)
    deadline = time.monotonic() + timeout
    while len(client.ids) < record["n"] and time.monotonic() < deadline:
        time.sleep(0.1)
    if len(client.ids) < record["n"]:
        client.close()
        raise NbdistError(
            f"session {name!r}: {len(client.ids)} of {record['n']} ranks answer: "
            f"%dist_stop {name} and start it again"
        )
    handle = ClusterHandle(
        client=client,
        cluster=None,  # the keeper's: this kernel stops nothing itself
        owned=True,  # local processes: signalled and watched by PID
        profile_dir=record.get("profile_dir"),
        start_method=record.get("start_method") or "fork",
        zygote_status=record.get("zygote_status"),
        start_note=f"session {name!r}",
    )
    handle.note_entries(record.get("pids", []))  # each checked by its start time
    return handle


def _write_group(name: str, group: Group) -> None:
    content = {
        "ranks": [dataclasses.asdict(r) for r in group.ranks],
        "rendezvous_addr": group.rendezvous_addr,
        "backend": group.backend,
        "hosts": {str(k): v for k, v in group.hosts.items()},
        "checks_collectives": group.checks_collectives,
    }
    named_session_records.write_json(
        os.path.join(named_session_records.session_dir(name), "group.json"), content
    )


def named_sessions() -> list[dict]:
    """This user's named sessions: name, ranks, launcher, started, state, last_step, run_id."""
    return [named_session_records.describe_session(r) for r in named_session_records.records()]


def stop_named(name: str, *, wait: float = 20.0) -> list[int]:
    """End session ``name`` wherever it runs; the PIDs force-killed (see :func:`nbdist.launch.named_session_records.stop`)."""
    return named_session_records.stop(name, wait=wait)


def stop_idle(seconds: float) -> list[str]:
    """End every named session idle (no kernel attached, no cell running) for ``seconds`` or more.

    Returns their names. ``%dist_sessions --stop-idle 2h`` calls it.
    """
    check_seconds(seconds, "seconds")
    ended = []
    for row in named_sessions():
        if row["idle_s"] is not None and row["idle_s"] >= seconds:
            try:
                stop_named(row["name"])
            except NbdistError:  # stopped meanwhile
                continue
            ended.append(row["name"])
    return ended
