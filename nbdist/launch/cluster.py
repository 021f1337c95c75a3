"""Kernel side, starting separate processes: the ipyparallel controller and engines, by PID.

Two ways in:
- :func:`start_local` starts a controller (on loopback unless told otherwise)
  and the engines, by default through the torch-importing zygote.
- :func:`connect` connects to a cluster somebody else started (other hosts,
  a batch job); nbdist then owns no processes and stops none.

:func:`stop_processes` ends only processes this module started and those below
them, by PID, and waits until they are gone. ipyparallel settings are tuned for
start-up time (measured on a 2-core machine: defaults 10.8 s to a ready 4-rank
group, these 2.5 s):
heartbeat period 50 ms instead of 3 s, longer beyond 8 ranks (an engine counts
as registered on the first beat after its ping reply, up to two periods after it
asked), no delay between controller and engines, no nanny process per engine.

ipyparallel's one-time serializer set-up is paid on a thread while the
engines still import torch (:mod:`nbdist.launch.serializer_warmup`).
"""

from __future__ import annotations

import glob
import itertools
import json
import os
import signal
import time
from dataclasses import dataclass, field

import psutil

from nbdist.engine import process_ending
from nbdist.errors import NbdistError
from nbdist.launch import capacity, heartbeat, private_profiles, process_tree, remote_engines
from nbdist.launch.serializer_warmup import warm_serializer
from nbdist.launch.ssh_engines import SSHEngines
from nbdist.launch.start_failure import LauncherWords, port_clash, start_failure

__all__ = [
    "ClusterHandle",
    "connect",
    "end_cluster_thread",
    "interrupt_engines",
    "slot_environments",
    "start_local",
    "start_processes",
    "stop_processes",
]

_counter = itertools.count()


@dataclass
class ClusterHandle:
    """A running cluster and what nbdist owns of it."""

    client: object  # ipyparallel.Client
    cluster: object | None  # ipyparallel.Cluster when nbdist started it
    owned: bool
    profile_dir: str | None = None
    remove_profile_dir: bool = False
    pids: set[int] = field(default_factory=set)  # every process nbdist started
    start_method: str = "external"
    start_note: str = ""
    # The zygote's status file (its engines' exit statuses and crash records beside it) where
    # this handle holds no launcher object: a named session's keeper started the engines.
    zygote_status: str | None = None
    # Each noted PID's process, as psutil saw it then (with its start time): a process
    # that has ended frees its PID (a crashed rank, reaped by the zygote at once), and a
    # later stop or interrupt must not signal the process that has that number now.
    noted: dict[int, psutil.Process] = field(default_factory=dict, repr=False)

    def note(self, pids) -> None:
        """Add ``pids`` (running processes nbdist started), each held with its start time."""
        for pid in pids:
            try:
                self.noted[pid] = psutil.Process(pid)
            except psutil.Error:
                continue  # already gone: nothing to signal later
            self.pids.add(pid)

    def note_entries(self, entries) -> None:
        """Add processes recorded as :func:`~nbdist.launch.process_tree.pid_entry` dicts."""
        for entry in entries:
            proc = process_tree.alive(entry)
            if proc is not None:
                self.noted[proc.pid] = proc
                self.pids.add(proc.pid)

    def forget(self, pids) -> None:
        """Drop ``pids`` (processes that have ended)."""
        for pid in pids:
            self.pids.discard(pid)
            self.noted.pop(pid, None)

    def process(self, pid: int) -> psutil.Process | None:
        """The process noted as ``pid`` if it still runs, None if it ended (or the PID is reused)."""
        proc = self.noted.get(pid)
        try:
            # is_running() compares the start time psutil read when the PID was noted.
            if proc is not None and proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE:
                return proc
        except psutil.Error:
            pass
        return None

    def controller_running(self) -> bool | None:
        """Whether the controller nbdist started still runs (None: not nbdist's, or not known)."""
        pid = getattr(getattr(self.cluster, "controller", None), "pid", None)
        if not self.owned or not pid:
            return None
        try:
            return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
        except psutil.Error:
            return False

    def processes(self) -> list[psutil.Process]:
        """Every noted process still running (none that merely has a noted PID now)."""
        return [p for p in map(self.process, sorted(self.pids)) if p is not None]

    def engine_processes(self) -> list[psutil.Process]:
        """The engines' processes where nbdist's zygote started them on this machine, else none.

        Other launchers' noted processes are not the engines (``srun``, ``ssh``, ``mpiexec``).
        """
        from nbdist.launch.local_engines import ZygoteEngineSetLauncher

        engines = self.engine_launcher()
        if not isinstance(engines, ZygoteEngineSetLauncher):
            return []
        pids = engines.read_status().get("pids", [])
        return [self.noted[pid] for pid in pids if pid in self.noted]

    def zygote_status_file(self) -> str | None:
        """The zygote's status file, where nbdist's zygote started the engines (else None)."""
        from nbdist.launch.local_engines import ZygoteEngineSetLauncher

        engines = self.engine_launcher()
        if isinstance(engines, ZygoteEngineSetLauncher):
            return engines.status_file
        return self.zygote_status

    def engine_launcher(self):
        """The ipyparallel engine-set launcher nbdist started, or None."""
        if self.cluster is None:
            return None
        sets = list(self.cluster.engines.values())
        return sets[0] if sets else None

    def client_file(self) -> str | None:
        """The cluster's client connection file (0600; it holds the key), if known."""
        controller = getattr(self.cluster, "controller", None)
        path = getattr(controller, "connection_files", {}).get("client")
        if path and os.path.exists(path):
            return path
        security = os.path.join(self.profile_dir or "", "security")
        found = sorted(glob.glob(os.path.join(security, "ipcontroller*client.json")))
        return found[0] if found else None


_LOG_NAME = "nbdist.launch.cluster"


def _quiet_log():
    """ipyparallel logs each start/stop at INFO; nbdist prints its own one-line summary."""
    import logging

    log = logging.getLogger(_LOG_NAME)
    if log.level == logging.NOTSET:
        log.setLevel(logging.WARNING)
    return log


def _base_config(controller_ip: str):
    from traitlets.config import Config

    from nbdist.launch.local_engines import watched_controller_cmd

    config = Config()
    config.LocalControllerLauncher.controller_cmd = watched_controller_cmd()
    config.LocalControllerLauncher.stop_seconds_until_kill = 3
    config.LocalEngineLauncher.stop_seconds_until_kill = 5  # the zygote's 3 s grace fits
    return config


def start_local(
    *,
    n: int,
    slot_environments: list[dict[str, str]],
    threads: int,
    timeout: float,
    launcher: str | None = None,
    profile: str | None = None,
    ip: str = "127.0.0.1",
    start_method: str = "fork",
    launcher_config: dict | None = None,
) -> ClusterHandle:
    """Start a controller and ``n`` engines on this machine (or through ``launcher``).

    ``launcher_config``: traitlets config by class for ``launcher`` (see
    :mod:`nbdist.launch.options`), e.g. ``{"SlurmEngineSetLauncher": {...}}``.
    """
    from nbdist.launch.local_engines import ZygoteEngineSetLauncher

    # The options were checked before (nbdist.launch.options): nothing here refuses them.
    config = _base_config(ip)
    # The zygote ends its ranks itself (SIGTERM, SIGKILL after 3 s); ending 256 of them
    # on 2 cores took longer than 5 s, and ipyparallel then SIGKILLed the zygote and
    # warned "did not exit in 5 seconds after TERM". Leave it time in proportion (the
    # kernel's own sweep afterwards still ends whatever is left, by PID).
    config.LocalEngineLauncher.stop_seconds_until_kill = 5 + n // 16
    # The controller, closing a connection per engine, outlasted its 3 s at 64 ranks too.
    config.LocalControllerLauncher.stop_seconds_until_kill = 3 + n // 16
    if launcher_config:
        from traitlets.config import Config

        config.merge(Config(launcher_config))
    if launcher is None:
        engine_launcher_class = ZygoteEngineSetLauncher
        config.ZygoteEngineSetLauncher.slot_environments = slot_environments
        config.ZygoteEngineSetLauncher.threads = threads
        config.ZygoteEngineSetLauncher.start_method = start_method
    else:
        engine_launcher_class = launcher
    # The controller binds ports the OS reported free a moment earlier; another
    # process can take one in between (two notebooks starting at once). Then a
    # fresh controller picks other ports: one retry, only for a private profile
    # (a named profile may pin its ports, and would clash again).
    attempts = 1 if profile else 2
    # ipyparallel's warnings of a process that exits (its whole output) stay out of the cell:
    # a failed start's error carries that output, once.
    words = LauncherWords()
    _quiet_log().addFilter(words)
    try:
        for attempt in range(1, attempts + 1):
            handle = _start_attempt(
                n, timeout, launcher, engine_launcher_class, profile, ip, config
            )
            try:
                cluster = handle.cluster
                cluster.start_cluster_sync(n=n)
                handle.client = cluster.connect_client_sync()
                warm_serializer()  # the controller is up; the engines are still importing torch
                if launcher is None:
                    # Not start_and_connect: in a notebook it draws a progress bar of its own.
                    handle.client.wait_for_engines(
                        n, timeout=timeout, interactive=False, block=True
                    )
                else:  # watches the job/mpiexec/ssh too: a start that cannot succeed fails now
                    remote_engines.wait_for_engines(
                        handle.client, handle.engine_launcher(), n, timeout=timeout
                    )
                # Inside the try: an interrupt while these run stops what was started too.
                _note_started(handle, launcher)
                return handle
            except BaseException as exc:
                # Read before stop() removes the logs (and forgets the controller).
                clash = port_clash(cluster, words)
                failed = isinstance(exc, (TimeoutError, RuntimeError))
                failure = start_failure(exc, n, timeout, cluster, words) if failed else ""
                _record_pids(handle)
                stop_processes(handle)
                if not isinstance(exc, Exception):
                    raise  # a Ctrl-C (or an exit) ends the start, whatever else went wrong
                if clash and attempt < attempts:
                    continue
                if clash:
                    raise NbdistError(
                        f"the controller could not listen on {ip}: a port it was given is taken "
                        f"({clash}). Free it, or remove the fixed ports from profile {profile!r}"
                    ) from exc
                if failure:
                    raise NbdistError(failure) from exc
                raise
    finally:
        _quiet_log().removeFilter(words)
    raise AssertionError("unreachable: the last attempt returns or raises")


def _start_attempt(n, timeout, launcher, engine_launcher_class, profile, ip, config):
    """The cluster of one attempt, not started yet, in a handle that owns it."""
    import ipyparallel as ipp

    kwargs = {}
    if profile:
        kwargs["profile"] = profile
        remove = False
    else:
        # A private profile per session: its own connection files (0700 dir),
        # and two notebooks never see each other's clusters. Those a killed
        # kernel left are cleared first.
        private_profiles.remove_orphans()
        kwargs["profile_dir"], remove = private_profiles.make(), True
    period = heartbeat.period_ms(n)
    cluster = ipp.Cluster(
        n=n,
        cluster_id=f"nbdist-{os.getpid()}-{next(_counter)}",
        controller_ip=ip,
        controller_args=[
            f"--HeartMonitor.period={period}",
            f"--HeartMonitor.max_heartmonitor_misses={heartbeat.misses(launcher, period)}",
        ],
        delay=0,
        # Engines on other hosts (a batch job) cannot read this machine's private
        # profile dir: they get the connection info in their environment (the
        # SSH launcher copies the connection file over SSH instead).
        send_engines_connection_env=launcher not in (None, SSHEngines),
        engine_launcher_class=engine_launcher_class,
        engine_timeout=int(max(1, timeout)),
        # nbdist's own exit hook (driver/live_sessions.stop_all) stops it: ipyparallel's,
        # registered later and so run first, stopped the roots before nbdist could
        # find what lay below them (and printed "Stopping cluster" at every shutdown).
        shutdown_atexit=False,
        config=config,
        log=_quiet_log(),
        **kwargs,
    )
    return ClusterHandle(
        client=None,
        cluster=cluster,
        owned=True,
        profile_dir=cluster.profile_dir,
        remove_profile_dir=remove,
    )


def _note_started(handle: ClusterHandle, launcher) -> None:
    """Note every process of a started cluster, and make its connection files private."""
    from nbdist.launch.local_engines import ZygoteEngineSetLauncher

    _record_pids(handle)
    engines = handle.engine_launcher()
    if isinstance(engines, ZygoteEngineSetLauncher):
        status = engines.read_status()
        handle.start_method = status.get("method", "fork")
        if status.get("reason") and status.get("method") == "spawn":
            handle.start_note = f"engines spawned separately ({status['reason']})"
        handle.note(status.get("pids", []))
    else:
        handle.start_method = remote_engines.launcher_name(launcher)
        handle.start_note = remote_engines.start_note(engines)
    _secure_connection_files(handle.cluster.profile_dir)
    if handle.remove_profile_dir:  # a later start may clear it once these are all gone
        private_profiles.record_processes(handle.cluster.profile_dir, handle.pids)


def slot_environments(placement) -> list[dict[str, str]]:
    """Each rank's environment of its own, in rank order: its slot, LOCAL_RANK and the GPUs
    its host's ranks see (CUDA_VISIBLE_DEVICES, none for CPU ranks)."""
    # One mask per host, not per rank: each is a pass over every slot (per rank, 100,000
    # ranks took 10^10 steps before the limits could refuse them).
    masks = {host: placement.visible_mask(host) for host in placement.hosts}
    return [
        {"NBDIST_SLOT": str(s.local_rank), "LOCAL_RANK": str(s.local_rank)}
        | ({"CUDA_VISIBLE_DEVICES": masks[s.host]} if masks[s.host] else {})
        for s in placement.slots
    ]


def start_processes(options, placement) -> ClusterHandle:
    """The processes of one start: connect to ``options.connect``, or start the ``placement``.

    ``options``: a checked :class:`~nbdist.launch.options.StartOptions`. Each
    local engine gets its slot's environment (its GPU, LOCAL_RANK) before it starts.
    """
    if options.connect:
        return connect(options.connect, timeout=options.timeout)
    launch = options.launch
    zygote = launch is None and options.launcher is None
    # A launcher that runs every engine on this machine (local; mpiexec without hosts; Slurm
    # or SSH hosts that are this machine): its limits hold them all, each importing torch.
    here = (launch.here if launch is not None else _local_launcher(options.launcher)) or zygote
    # Open files, threads, memory for this many ranks: or nothing starts (a note if a limit was
    # raised). First: a start far beyond them (%dist_start 100000) is refused at once.
    raised = capacity.check_limits(
        placement.world_size,
        local=placement.world_size if here else 0,
        threads=placement.threads_for(placement.slots[0]),
        spawn=options.start_method == "spawn" or not zygote,
    )
    slot_envs = slot_environments(placement)
    if launch is not None:  # Slurm would run the job, every SSH host answers: or nothing starts
        remote_engines.check_before_start(launch)
    handle = start_local(
        n=placement.world_size,
        slot_environments=slot_envs,
        threads=placement.threads_for(placement.slots[0]),
        timeout=options.timeout,
        launcher=remote_engines.engine_launcher_class(
            launch.engine_launcher if launch else options.launcher
        ),
        launcher_config=launch.config if launch else None,
        profile=options.profile,
        ip=options.ip,
        start_method=options.start_method,
    )
    if raised:
        handle.start_note = "; ".join(n for n in (handle.start_note, raised) if n)
    return handle


def _local_launcher(launcher) -> bool:
    """Whether ``launcher`` (other than slurm, ssh, mpi) starts its engines on this machine."""
    from ipyparallel.cluster.launcher import LocalEngineSetLauncher, find_launcher_class
    from traitlets.utils.importstring import import_item

    if isinstance(launcher, str):
        try:
            found = (
                import_item(launcher)
                if "." in launcher
                else find_launcher_class(launcher, "engine")
            )
        except Exception:  # checked before (options): not a local one, then
            return False
        launcher = found
    return isinstance(launcher, type) and issubclass(launcher, LocalEngineSetLauncher)


def interrupt_engines(handle: ClusterHandle, pids: list[int], engine_ids: list[int]) -> None:
    """SIGINT to engines: by PID where nbdist forked them, else through the controller.

    Engines a launcher started (Slurm, MPI, SSH) may be on other hosts, where
    their PIDs name other processes: the controller relays the signal.
    """
    if handle.owned and handle.start_method in ("fork", "spawn"):
        for pid in pids:
            proc = handle.process(pid)  # None once the rank has ended: its PID may be reused
            if proc is None:
                continue
            try:
                proc.send_signal(signal.SIGINT)
            except psutil.Error:
                pass
    else:
        handle.client.send_signal(signal.SIGINT, targets=engine_ids, block=False)


def _record_pids(handle: ClusterHandle) -> None:
    from ipyparallel.cluster.launcher import SSHLauncher

    cluster = handle.cluster
    launchers = []
    if cluster is not None and cluster.controller is not None:
        launchers.append(cluster.controller)
    engines = handle.engine_launcher()
    if engines is not None:
        launchers += getattr(engines, "launchers", {}).values() or [engines]
    # An SSH launcher's pid is its process's on that host: here it names some other
    # process, or none. The ranks there end what they started (nbdist.engine.own_processes).
    roots = [getattr(x, "pid", -1) for x in launchers if not isinstance(x, SSHLauncher)]
    for pid in roots:
        if pid and pid > 0:
            handle.note([pid])
            try:
                handle.note(p.pid for p in psutil.Process(pid).children(recursive=True))
            except psutil.Error:
                pass


def _secure_connection_files(profile_dir: str) -> None:
    security = os.path.join(profile_dir, "security")
    if not os.path.isdir(security):
        return
    os.chmod(security, 0o700)
    for name in os.listdir(security):
        os.chmod(os.path.join(security, name), 0o600)


def connect(path: str, *, timeout: float) -> ClusterHandle:
    """Connect to a running cluster from its cluster file or client connection file."""
    import ipyparallel as ipp

    if not os.path.exists(path):
        raise NbdistError(
            f"--connect {path!r}: no such file. Pass the cluster file (cluster-*.json) or the "
            "client connection file (ipcontroller-client.json) of a running ipyparallel cluster"
        )
    try:
        with open(path) as f:
            content = json.load(f)
    except (OSError, ValueError) as exc:
        raise NbdistError(
            f"--connect {path!r} is not a readable JSON connection file: {exc}"
        ) from exc
    client_file = _client_file_of(content) if "cluster" in content else None
    if client_file is not None:
        client = ipp.Client(client_file, timeout=timeout)
    elif "cluster" in content:
        # Its controller's connection file is not here (one on another host, never
        # fetched): ipyparallel's Cluster fetches it. That object keeps a thread, an event
        # loop and a thread per process it lists, for the kernel's lifetime.
        cluster = ipp.Cluster.from_file(path)
        client = cluster.connect_client_sync()
    else:
        client = ipp.Client(path, timeout=timeout)
    deadline = time.monotonic() + timeout
    while not client.ids and time.monotonic() < deadline:
        time.sleep(0.1)
    if not client.ids:
        client.close()
        raise NbdistError(
            f"the cluster in {path!r} has no engines after {timeout:g} s: start engines "
            "(ipengine) for it, then connect again"
        )
    return ClusterHandle(client=client, cluster=None, owned=False, start_method="attached")


def _client_file_of(content: dict) -> str | None:
    """The client connection file a cluster file's controller wrote, if it is on this machine.

    Read directly: ``ipyparallel.Cluster.from_file`` would rebuild the cluster's launchers,
    each with a thread waiting on its process, and a thread and event loop for its calls,
    none of which ends when the kernel lets go of the cluster (every connect left them).
    """
    info = content.get("cluster") or {}
    profile_dir, cluster_id = info.get("profile_dir"), info.get("cluster_id")
    if not isinstance(profile_dir, str):
        return None
    name = f"ipcontroller-{cluster_id}-client.json" if cluster_id else "ipcontroller-client.json"
    path = os.path.join(profile_dir, "security", name)
    return path if os.path.exists(path) else None


def stop_processes(handle: ClusterHandle) -> list[int]:
    """Stop what nbdist started, and every process below it; the PIDs that had to be killed.

    Returns within about 10 s at a few ranks, longer in proportion at many (see
    docs/faults.md, "Nothing outlives %dist_stop").
    """
    client = handle.client
    if client is not None:
        try:
            client.close()
        except Exception:  # closing a dead client must not block the stop
            pass
    killed: list[int] = []
    if handle.owned and handle.cluster is not None:
        # What the ranks started, taken before anything stops: the zygote ends its
        # tree itself; this list is for what escaped it (other launchers, a zygote
        # killed before it finished).
        # Only processes that still are the ones noted: a PID freed since names another.
        mine = handle.processes()
        below = process_tree.descendants([p.pid for p in mine])
        words = LauncherWords()  # ipyparallel's warnings of the exits nbdist causes
        log = _quiet_log()
        log.addFilter(words)
        try:
            handle.cluster.stop_cluster_sync()
        except Exception:  # fall through to the PID sweep below
            pass
        finally:
            # After the cluster's thread ends: its launchers' last callbacks log on it.
            try:
                end_cluster_thread(handle.cluster)
            finally:
                log.removeFilter(words)
        killed = process_ending.end(mine + below)
    if handle.remove_profile_dir and handle.profile_dir:
        private_profiles.remove_profile(handle.profile_dir)
    return killed


def end_cluster_thread(cluster) -> None:
    """End the thread (and close the event loop) ipyparallel runs a ``Cluster``'s ``*_sync`` calls on.

    Inside a kernel, where an asyncio loop runs in the calling thread,
    ipyparallel 9 runs every ``Cluster.*_sync`` call on a thread of its own with
    its own event loop, and never ends it: one thread and three descriptors
    (the loop's epoll and its self-pipe) were left in the kernel by every
    ``%dist_start`` / ``%dist_stop``. Call it once the cluster is stopped (its
    launchers' waiting threads post their last callbacks to that loop, which
    tornado drops once it is closed); a no-op outside a kernel.
    """
    thread = cluster._async_thread  # noqa: SLF001
    loop = getattr(cluster, "_thread_loop", None)
    if thread is None or loop is None:
        return
    loop.add_callback(loop.stop)
    thread.join(timeout=5)
    if not thread.is_alive():
        loop.close()
        cluster._async_thread = None  # noqa: SLF001
