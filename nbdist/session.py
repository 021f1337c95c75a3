"""DistSession: a set of ranks with a ready process group, usable from a script or a notebook.

Example::

    from nbdist import DistSession

    with DistSession(2) as s:                       # 2 CPU ranks (gloo) on a machine without GPUs
        s.run("t = torch.ones(1) * rank; dist.all_reduce(t); print(t)")
        print(s.pull("t"))                          # [tensor([1.]), tensor([1.])]
"""

from __future__ import annotations

import atexit
import os
import signal
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from . import cluster as _cluster
from ._cells import cell_channel
from ._group import metrics_ip, metrics_key
from .errors import ClusterNotRunning, NbdistError, PlacementError
from .launch_options import LAUNCHERS, plan_launch
from .placement import Placement, parse_ranks, plan_local, visible_gpus
from .runner import RankRun, submit

__all__ = ["DistSession", "RankInfo", "current_session"]

_current: weakref.ReferenceType | None = None
_live: weakref.WeakSet = weakref.WeakSet()


@dataclass(frozen=True)
class RankInfo:
    rank: int
    local_rank: int
    engine_id: int
    pid: int
    host: str
    device: str


def current_session() -> DistSession:
    """The session started last in this process that is still running."""
    session = _current() if _current is not None else None
    if session is None or not session.running:
        raise ClusterNotRunning(
            "no nbdist cluster is running: start one with %dist_start (or DistSession().start())"
        )
    return session


class DistSession:
    """Ranks as ipyparallel engines with ``torch.distributed`` initialised on them.

    Parameters mirror ``%dist_start``: ``n`` ranks (default: one per visible
    GPU, or 2 CPU ranks), ``backend`` ('nccl'/'gloo', default by device),
    ``cpu`` to ignore GPUs, ``gpus`` (indices) to choose GPUs, ``threads``
    torch threads per rank (default: cores shared among the ranks),
    ``timeout`` seconds to wait for the ranks to be ready, ``launcher``/
    ``profile`` passed to ipyparallel, ``attach`` a cluster file of a running
    cluster, ``ip`` the controller address (loopback by default),
    ``start_method`` 'fork' (engines forked after importing torch) or 'spawn',
    ``launch_options`` for ``launcher`` 'slurm', 'ssh' or 'mpi' (partition,
    time, account, hosts...: :func:`nbdist.launch_options.plan_launch`).
    The placement is validated here, before anything starts.
    """

    def __init__(
        self,
        n: int | None = None,
        *,
        backend: str | None = None,
        cpu: bool = False,
        gpus: Sequence[int] | None = None,
        threads: int | None = None,
        timeout: float = 120.0,
        launcher: str | None = None,
        profile: str | None = None,
        attach: str | None = None,
        ip: str = "127.0.0.1",
        start_method: str = "fork",
        group_timeout: float = 1800.0,
        history: str | bool | None = None,
        launch_options: Mapping[str, object] | None = None,
    ):
        if timeout is None or timeout <= 0:
            raise PlacementError(f"timeout must be a positive number of seconds, got {timeout!r}")
        if start_method not in ("fork", "spawn"):
            raise PlacementError(f"start_method {start_method!r}: use 'fork' or 'spawn'")
        if attach and (launcher or profile):
            raise PlacementError("--attach uses a running cluster: leave out --launcher/--profile")
        self.options = dict(
            n=n, backend=backend, cpu=cpu, gpus=list(gpus) if gpus else None, threads=threads,
            timeout=float(timeout), launcher=launcher, profile=profile, attach=attach, ip=ip,
            start_method=start_method, group_timeout=float(group_timeout),
        )  # fmt: skip
        self.placement: Placement | None = None
        # --launcher slurm|ssh|mpi options, checked before anything starts.
        self.launch = None
        if not attach and (launch_options or str(launcher).lower() in LAUNCHERS):
            self.launch = plan_launch(launcher, n, ip=ip, **dict(launch_options or {}))
            # Engines start on other hosts, whose GPUs this machine cannot see: a
            # provisional CPU layout of n ranks until they report (plan_attached).
            self.placement = plan_local(self.launch.n, gpus_visible=[], cores=1, cpu=True)
        elif not attach:
            self.placement = plan_local(
                n,
                gpus_visible=[] if cpu else visible_gpus(),
                cores=os.cpu_count() or 1,
                backend=backend,
                cpu=cpu,
                gpus=gpus,
                threads=threads,
            )
        self.history = history
        self._metrics = None  # nbdist.metrics.hub.MetricsHub, made at the first start
        self._handle: _cluster.ClusterHandle | None = None
        self._ranks: list[RankInfo] = []
        self.startup_seconds: float | None = None
        self._monitor = None  # nbdist.faults.RankMonitor: notices ranks dying
        self._group_released = False  # ranks were released: form the group again
        self._rendezvous_addr: str | None = None
        # Code run on every rank since the group formed, in order: what %dist_export writes.
        self.cells: list[str] = []

    # -- lifecycle --------------------------------------------------------
    @property
    def running(self) -> bool:
        return self._handle is not None

    @property
    def world_size(self) -> int:
        return len(self._ranks)

    @property
    def ranks(self) -> list[RankInfo]:
        return list(self._ranks)

    @property
    def backend(self) -> str | None:
        return self.placement.backend if self.placement else None

    @property
    def client(self):
        self._require_running()
        return self._handle.client

    def start(self) -> DistSession:
        """Start (or attach to) the engines and form the process group; returns self."""
        global _current
        if self.running:
            raise NbdistError(
                f"this session already runs {self.world_size} ranks: stop() or restart() it first"
            )
        t0 = time.perf_counter()
        opts = self.options
        if opts["attach"]:
            handle = _cluster.attach(opts["attach"], timeout=opts["timeout"])
        else:
            placement = self.placement
            slot_envs = [
                {"NBDIST_SLOT": str(s.local_rank), "LOCAL_RANK": str(s.local_rank)}
                | ({"CUDA_VISIBLE_DEVICES": str(s.gpu)} if s.gpu is not None else {})
                for s in placement.slots
            ]
            handle = _cluster.start_local(
                n=placement.world_size,
                slot_environments=slot_envs,
                threads=placement.threads_for(placement.slots[0]),
                timeout=opts["timeout"],
                launcher=self.launch.engine_launcher if self.launch else opts["launcher"],
                launcher_config=self.launch.config if self.launch else None,
                profile=opts["profile"],
                ip=opts["ip"],
                start_method=opts["start_method"],
            )
        self._handle = handle
        try:
            if self._metrics is None:
                from .metrics.hub import MetricsHub

                self._metrics = MetricsHub.open(
                    metrics_key(handle.client),
                    world_size=self.placement.world_size
                    if self.placement
                    else len(handle.client.ids),
                    backend=self.placement.backend if self.placement else "",
                    history=self.history,
                    # Beyond loopback only where the ranks are: --ip, or an attached cluster.
                    ip="127.0.0.1"
                    if handle.owned and opts["ip"].startswith("127.")
                    else metrics_ip(handle.client),
                )
                self._metrics.states = self._rank_states
            else:
                # restart(): a new cluster, a new key, and the ranks sign their metrics with it.
                self._metrics.collector.new_cluster(metrics_key(handle.client))
            self._form_group()
            self._watch_ranks()
        except BaseException:
            self.stop()
            raise
        self.startup_seconds = time.perf_counter() - t0
        _current = weakref.ref(self)
        _live.add(self)
        from . import registry  # the JupyterLab sidebar lists running clusters

        registry.register(self)
        return self

    def _form_group(self) -> None:
        # Kept as a method: the start-up benchmark wraps it to time group formation.
        from ._group import form_group

        form_group(self)

    @property
    def metrics(self):
        """This session's run (:class:`nbdist.metrics.run.Run`): every point ``nbdist.log`` sent."""
        if self._metrics is None:
            raise ClusterNotRunning("no metrics yet: start the session first")
        return self._metrics.run

    def stop(self) -> list[int]:
        """Stop the ranks nbdist started (detach from an attached cluster); idempotent.

        Returns the PIDs that had to be force-killed (normally none). The run's
        metrics stay readable (``session.metrics``, ``nbdist.runs()``).
        """
        killed = self._stop_ranks()
        if self._metrics is not None:
            self._metrics.close()
        return killed

    def _stop_ranks(self) -> list[int]:
        handle, self._handle = self._handle, None
        if handle is None:
            return []
        _live.discard(self)
        if self._monitor is not None:
            self._monitor.stop()
            self._monitor = None
        self._group_released = False
        from . import registry

        registry.unregister(self)
        if handle.client is not None and not handle.owned and self._ranks:
            from . import _bootstrap

            try:  # leave the group so the attached engines can be reused
                client = handle.client
                client[[r.engine_id for r in self._ranks]].apply_async(_bootstrap.teardown).get(5)
            except Exception:
                pass
        self._ranks = []
        return _cluster.stop(handle)

    def restart(self) -> DistSession:
        """Fresh engines, the group formed again, same number of ranks; the run continues."""
        self._stop_ranks()
        return self.start()

    def __enter__(self) -> DistSession:
        if not self.running:
            self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def _require_running(self) -> None:
        if not self.running:
            raise ClusterNotRunning(
                "this session is not running: call start() (or %dist_start) first"
            )

    # -- running code -----------------------------------------------------
    def _select(self, ranks) -> list[RankInfo]:
        self._require_running()
        chosen = parse_ranks(ranks, self.world_size)
        return [self._ranks[r] for r in chosen]

    def run(
        self,
        code: str,
        ranks=None,
        *,
        block: bool = True,
        timeout: float | None = None,
        sink=None,
    ):
        """Run ``code`` on the ranks (all by default) in their persistent namespaces.

        Output streams live, labelled by rank. Blocking: returns the per-rank
        results and raises :class:`~nbdist.errors.RankError` if any rank raised.
        ``block=False`` returns a :class:`~nbdist.runner.RankRun`; call ``.wait()``.
        """
        from .faults import CellGuard

        chosen = self._select(ranks)
        self._require_whole()
        if self._group_released:  # an earlier attempt to form the group again failed
            self._reform_group()
        client, engine_ids = self._handle.client, [r.engine_id for r in chosen]
        run = submit(
            client,
            engine_ids,
            [r.rank for r in chosen],
            code,
            interrupt=self.interrupt,
            sink=sink,
            timeout=timeout,
            watch=self._metrics.cell_watcher(),
            guard=CellGuard(self, chosen),
            silent_if_possible=block,
        )
        if not block:
            return run
        try:
            return run.wait()
        finally:
            sent = cell_channel(client).learn(engine_ids, run._results or [])
            self._metrics.settle(dict(zip(run.ranks, sent)))

    def record_cell(self, code: str) -> None:
        """Remember ``code`` as run on every rank, for :meth:`export` (``%%on_all_ranks`` calls it)."""
        self.cells.append(code)

    def export(self, path: str, **options) -> str:
        """Write the recorded cells as a ``torchrun`` script; see :func:`nbdist.export.export_script`."""
        from .export import export_script

        options.setdefault("ranks", max(1, self.world_size))
        return export_script(self.cells, path, **options)

    # -- faults -----------------------------------------------------------
    def _watch_ranks(self) -> None:
        from .faults import RankMonitor

        if self._handle.owned:
            self._monitor = RankMonitor(self._ranks)

    def _dead_ranks(self, among=None) -> dict[int, str]:
        """{rank: how it died} for ranks whose process ended (or engine vanished)."""
        if self._handle is None:
            return {}
        dead = dict(self._monitor.dead) if self._monitor is not None else {}
        alive_ids = set(self._handle.client.ids)
        for info in self._ranks:
            if info.engine_id not in alive_ids and info.rank not in dead:
                dead[info.rank] = "its engine stopped answering the controller's heartbeat"
        return {r: c for r, c in dead.items() if among is None or r in among}

    def _require_whole(self) -> None:
        dead = self._dead_ranks()
        if dead:
            which = "; ".join(f"rank {r} died: {c}" for r, c in sorted(dead.items()))
            raise NbdistError(f"{which}. %dist_restart (or restart()) brings every rank back")

    def _reform_group(self) -> None:
        """Form the process group again on the same processes (after ranks were released)."""
        from .faults import reform_group

        reform_group(self)

    def where(self, ranks=None) -> list:
        """Where each rank is, without stopping it: its Python stack and last collective.

        Returns :class:`nbdist.where.RankWhere` objects; ``nbdist.where.format_where``
        turns them into the ``%dist_where`` report.
        """
        from .where import RankWhere, ask

        chosen = self._select(ranks)
        dead = self._dead_ranks()
        found = {w.rank: w for w in ask(self.client, [r for r in chosen if r.rank not in dead])}
        for rank, cause in dead.items():
            found[rank] = RankWhere(rank, answered=False, note=f"dead: {cause}")
        return [found[r.rank] for r in chosen if r.rank in found]

    def apply(self, fn: Callable, *args, ranks=None, **kwargs) -> list:
        """Call ``fn(*args, **kwargs)`` on the ranks; returns results in rank order."""
        chosen = self._select(ranks)
        ar = self._handle.client[[r.engine_id for r in chosen]].apply_async(fn, *args, **kwargs)
        return RankRun(ar, [r.rank for r in chosen], interrupt=self.interrupt).wait()

    def push(self, mapping: Mapping[str, object], ranks=None) -> None:
        """Copy names from here into the ranks' namespaces."""
        chosen = self._select(ranks)
        ar = self._handle.client[[r.engine_id for r in chosen]].push(dict(mapping), block=False)
        RankRun(ar, [r.rank for r in chosen], interrupt=self.interrupt).wait()

    def pull(self, name: str, rank: int | None = None):
        """A name's value from one rank, or a list of values by rank when ``rank`` is None."""
        chosen = self._select(rank)
        ar = self._handle.client[[r.engine_id for r in chosen]].pull(name, block=False)
        values = RankRun(ar, [r.rank for r in chosen], interrupt=self.interrupt).wait()
        return values[0] if rank is not None else values

    def interrupt(self, ranks=None) -> None:
        """Send SIGINT to the ranks: running code raises KeyboardInterrupt there."""
        chosen = self._select(ranks)
        if self._handle.owned:
            for info in chosen:
                try:
                    os.kill(info.pid, signal.SIGINT)
                except ProcessLookupError:
                    pass
        else:
            self._handle.client.send_signal(
                signal.SIGINT, targets=[r.engine_id for r in chosen], block=False
            )

    # -- reporting --------------------------------------------------------
    def status(self) -> list[dict]:
        """One row per rank: rank, engine, host, pid, device, backend, state, memory."""
        from .status import rank_status

        self._require_running()
        return rank_status(self._handle, self._ranks, self.backend, self._dead_ranks())

    def _rank_states(self) -> dict[int, str]:
        if not self.running:
            return {}
        return {row["rank"]: row["state"] for row in self.status()}

    def summary(self) -> str:
        """One line: ranks, backend, devices, start-up seconds."""
        self._require_running()
        devices = sorted({r.device for r in self._ranks})
        hosts = sorted({r.host for r in self._ranks})
        where = f" on {len(hosts)} hosts" if len(hosts) > 1 else ""
        note = f"; {self._handle.start_note}" if self._handle.start_note else ""
        return (
            f"nbdist: {self.world_size} ranks ready{where} · backend {self.backend} · "
            f"device {', '.join(devices)} · {self.startup_seconds:.1f} s{note}"
        )

    def __repr__(self) -> str:
        if not self.running:
            return "<DistSession: not running>"
        return f"<DistSession: {self.world_size} ranks, {self.backend}>"


@atexit.register
def _stop_live_sessions() -> None:
    # Kernel shutdown or restart: stop every session's processes before exit.
    for session in list(_live):
        try:
            session.stop()
        except Exception:
            pass
