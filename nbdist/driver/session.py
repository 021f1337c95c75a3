"""Kernel side: DistSession, a set of ranks with a ready process group, from a script or a notebook.

Example::

    from nbdist import DistSession

    with DistSession(2) as s:                       # 2 CPU ranks (gloo) on a machine without GPUs
        s.run("t = torch.ones(1) * rank; dist.all_reduce(t); print(t)")
        print(s.pull("t"))                          # [tensor([1.]), tensor([1.])]

A session starts its ranks (or connects to a running cluster, ``connect=``), forms
the group, watches the ranks while they run (a ``pidfd`` per local rank, an
entry in the JupyterLab sidebar), restarts them (forked afresh by the zygote
that is already running when it can, :mod:`nbdist.launch.restart`) and stops
them. :meth:`DistSession.summary` is the line ``%dist_start`` and
``%dist_restart`` print; a restart gives fresh processes, and the line says so::

    nbdist: restarted 2 ranks in 1.2 s · backend gloo · device cpu (fresh processes: names defined in cells are gone)
"""

from __future__ import annotations

import os
import sys
import warnings
from collections.abc import Callable, Mapping, Sequence

from nbdist.driver.background_runs import BackgroundRuns
from nbdist.driver.call_arguments import check_cell_timeout, check_code, check_names, check_one_rank
from nbdist.driver.cells import cell_channel
from nbdist.driver.faults import CellGuard
from nbdist.driver.group import Group, RankInfo, reform_group
from nbdist.driver.ipp_internals import fail_undecodable_replies
from nbdist.driver.pulls import pull_values
from nbdist.driver.rank_deaths import dead_ranks, dead_ranks_message
from nbdist.driver.runner import RankRun, submit
from nbdist.driver.session_lifecycle import Restarted, SessionLifecycle
from nbdist.driver.session_summary import ready_lines
from nbdist.driver.session_watch import SessionWatch
from nbdist.driver.sigint_latch import SigintLatch
from nbdist.driver.status import rank_status
from nbdist.driver.where import RankWhere, locate
from nbdist.engine import helpers
from nbdist.errors import ClusterNotRunning, NbdistError, PlacementError
from nbdist.launch.cluster import ClusterHandle, interrupt_engines
from nbdist.launch.options import StartOptions, check_start_options
from nbdist.launch.placement import Placement, plan_start
from nbdist.rank_states import HeldState, held_word

__all__ = ["DistSession", "RankInfo", "Restarted"]


def _history_option(history) -> str | bool | None:
    """``history=`` as the metrics hub takes it: a path as text, None, or False."""
    if history is None or isinstance(history, bool):
        return None if history is True else history
    if isinstance(history, (str, os.PathLike)) and os.fspath(history):
        return os.fspath(history)
    # Anything else used to mean the default location, silently.
    raise PlacementError(
        f"history={history!r}: give a file path for the run history (e.g. 'runs.db'), "
        "None for the default location, or False to keep no history"
    )


class DistSession(SessionLifecycle):
    """Ranks as ipyparallel engines with ``torch.distributed`` initialised on them.

    Parameters mirror ``%dist_start``: ``n`` ranks (default: one per visible
    GPU, or 2 CPU ranks), ``backend`` ('nccl'/'gloo', default by device),
    ``cpu`` to ignore GPUs, ``gpus`` (indices) to choose GPUs, ``threads``
    torch threads per rank (default: cores shared among the ranks),
    ``timeout`` seconds to wait for the ranks to be ready, ``launcher``/
    ``profile`` passed to ipyparallel, ``connect`` the connection file
    (cluster file) of a running ipyparallel cluster to use instead of starting
    one, ``ip`` the controller address (loopback by default),
    ``start_method`` 'fork' (engines forked after importing torch) or 'spawn',
    ``group_timeout`` the process group's own timeout, ``check_collectives``
    each collective's kind, shapes and dtypes compared across the ranks before
    it runs (slower; torch's ``TORCH_DISTRIBUTED_DEBUG=DETAIL``), ``history`` where the
    run's metrics are kept (a path, None for the default, False for none),
    ``launch_options`` for ``launcher`` 'slurm', 'ssh' or 'mpi' (partition,
    time, account, hosts...: :mod:`nbdist.launch.launcher_options`).
    ``attach`` is the former name of ``connect`` (deprecated).
    Every option is checked here, before anything starts
    (:func:`nbdist.launch.options.check_start_options`).
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
        connect: str | None = None,
        ip: str = "127.0.0.1",
        start_method: str = "fork",
        group_timeout: float = 1800.0,
        check_collectives: bool = False,
        history: str | bool | None = None,
        launch_options: Mapping[str, object] | None = None,
        attach: str | None = None,
    ):
        """Check the options and plan the ranks (nothing starts until :meth:`start`)."""
        if helpers.is_rank():
            # %dist_start in %%on_all_ranks: each rank would start ranks of its own.
            raise NbdistError(
                f"a session cannot start on a rank (this is rank {helpers.rank()} of "
                f"{helpers.world_size()}, whose group is formed: rank, world_size and dist are "
                "in every rank's namespace): run %dist_start (or DistSession) in the notebook's "
                "own cells, not in %%on_all_ranks or code the ranks run"
            )
        if attach is not None:
            warnings.warn(
                "DistSession(attach=...) is deprecated: use connect= (the connection file of "
                "a running ipyparallel cluster)",
                DeprecationWarning,
                stacklevel=2,
            )
            if connect is not None and connect != attach:
                raise TypeError("DistSession: pass connect= alone (attach= is its former name)")
            connect = attach
        self.options = opts = check_start_options(
            StartOptions(
                n,
                backend=backend,
                cpu=cpu,
                gpus=gpus,
                threads=threads,
                timeout=timeout,
                launcher=launcher,
                profile=profile,
                connect=connect,
                ip=ip,
                start_method=start_method,
                group_timeout=group_timeout,
                check_collectives=check_collectives,
                launch_options=launch_options,
            )
        )
        # Connected: None until the engines describe themselves (plan_attached).
        self.placement: Placement | None = plan_start(opts)
        self.history = _history_option(history)
        self.startup_seconds: float | None = None
        self.restarted: Restarted | None = None  # the last restart, until the next start
        # Code run on every rank since the group formed, in order: what %dist_export writes.
        self.cells: list[str] = []
        self._cells_ranks = 0  # how many ranks ran the recorded cells (export after a stop)
        self.group: Group | None = None  # the formed process group, while running
        self._hub = None  # nbdist.metrics.hub.MetricsHub, made at the first start
        self._handle: ClusterHandle | None = None
        self._watch: SessionWatch | None = None  # rank monitor and sidebar entry, while running
        # Cells sent without waiting: every other wait drives their guards (background_runs.py).
        self._background = BackgroundRuns()

    # -- what it is -------------------------------------------------------
    @property
    def running(self) -> bool:
        """Started and not stopped."""
        return self._handle is not None

    @property
    def world_size(self) -> int:
        """The number of ranks (0 when not running)."""
        return len(self.ranks)

    @property
    def ranks(self) -> list[RankInfo]:
        """The ranks, in rank order (empty when not running)."""
        return list(self.group.ranks) if self.group is not None else []

    @property
    def backend(self) -> str | None:
        """'nccl' or 'gloo'."""
        return self.placement.backend if self.placement else None

    @property
    def cluster(self) -> ClusterHandle | None:
        """The processes behind the ranks (PIDs, profile directory, how they started), or None."""
        return self._handle

    @property
    def client(self):
        """The ipyparallel ``Client`` connected to the ranks' engines."""
        self._require_running()
        return self._handle.client

    @property
    def metrics_hub(self):
        """The :class:`~nbdist.metrics.hub.MetricsHub`: the run, its collector and history."""
        if self._hub is None:
            raise ClusterNotRunning("no metrics yet: start the session first")
        return self._hub

    @property
    def metrics(self):
        """This session's run (:class:`nbdist.metrics.run.Run`): every point ``nbdist.log`` sent."""
        return self.metrics_hub.run

    def _require_running(self) -> None:
        if not self.running:
            raise ClusterNotRunning("this session is not running: call start() (or %dist_start)")

    # -- running code -----------------------------------------------------
    def select(self, ranks=None) -> list[RankInfo]:
        """The ranks named by ``ranks`` ('0,2', '0-3', 2, [0, 2]; None: all), checked."""
        self._require_running()
        return self.group.select(ranks)

    def run(self, code: str, ranks=None, *, block: bool = True, timeout=None, sink=None):
        """Run ``code`` on the ranks (all by default) in their persistent namespaces.

        Output streams live, labelled by rank. Blocking: returns the per-rank
        results and raises :class:`~nbdist.errors.RankError` if any rank raised.
        ``block=False`` returns a :class:`~nbdist.driver.runner.RankRun`; call ``.wait()``.
        ``timeout``: seconds before the ranks are interrupted (none by default).
        """
        from nbdist.dashboard import cell_watcher

        code, timeout = check_code(code), check_cell_timeout(timeout)
        chosen = self.select(ranks)
        self._require_whole()
        self._ready_for_collectives()
        client, engine_ids = self._handle.client, [r.engine_id for r in chosen]
        watch = cell_watcher(self._hub.run, self.rank_states)
        # A Ctrl-C from here on, once the cell may be on its way, is held and handed to
        # the wait, which interrupts the ranks: raised before the wait, it would end the
        # kernel's cell and leave the ranks running it (sigint_latch.py).
        with SigintLatch(holding=True) as latch:
            run = submit(
                client,
                engine_ids,
                [r.rank for r in chosen],
                code,
                interrupt=self.interrupt,
                sink=sink,
                timeout=timeout,
                watch=watch,
                guard=CellGuard(self, chosen, self._background),
                silent_if_possible=block,
                background=self._background,
            )
            if not block and not latch.pending:
                self._background.add(run)
                return run
            try:
                return run.wait(latch)
            finally:
                sent = cell_channel(client).learn(engine_ids, run.results or [])
                self._hub.settle(dict(zip(run.ranks, sent)))
                # A short cell's points can all arrive while the kernel settles, after the
                # waiting loop ended: its dashboard still appears under it.
                watch()

    def _ready_for_collectives(self) -> None:
        """Before a request that may make collective calls: a failed ``--noblock`` cell's other
        ranks released (``BackgroundRuns.settle``), the group formed again if a release left it
        broken."""
        self._background.settle()
        if self.group.released:  # an earlier attempt to form the group again failed
            stale = self.reform_group()
            if stale:
                # The cell's own note (faults.py) could not name them: that attempt failed.
                print(
                    "nbdist: the process group was formed again before this cell; these were "
                    "made with the old group: make them again before using them: "
                    + ", ".join(stale),
                    file=sys.stderr,
                )
            if self.group.cut_schedules:
                print(f"nbdist: {self.group.cut_schedules_note()}", file=sys.stderr)

    def record_cell(self, code: str) -> None:
        """Remember ``code`` as run on every rank, for :meth:`export` (``%%on_all_ranks`` calls it)."""
        self.cells.append(code)
        self._cells_ranks = self.world_size

    def export(self, path: str, **options) -> str:
        """Write the recorded cells as a ``torchrun`` script; see :func:`nbdist.driver.export.export_script`."""
        from nbdist.driver.export import export_script

        options.setdefault("ranks", max(1, self.world_size or self._cells_ranks))
        return export_script(self.cells, path, **options)

    def _on_ranks(self, ranks, send: Callable, *, collectives: bool = False) -> list:
        # send(view) -> AsyncResult; waited for like a cell (errors by rank, Ctrl-C relayed).
        # collectives: what it runs may make collective calls (apply).
        chosen = self.select(ranks)
        # ipyparallel would answer with a KeyError (or wait for an engine that is gone).
        dead = self._require_alive([r.rank for r in chosen])
        if collectives and not dead:
            self._ready_for_collectives()
        else:
            # A value read or written needs no group (one a release left broken is formed
            # again by the next cell: that could fail, and the value is wanted), and none
            # forms with a rank dead.
            self._background.settle()
        fail_undecodable_replies(self._handle.client)  # a value the kernel cannot unpickle
        with SigintLatch(holding=True) as latch:  # as in run(): a Ctrl-C once sent is theirs
            ar = send(self._handle.client[[r.engine_id for r in chosen]])
            run = RankRun(
                ar,
                [r.rank for r in chosen],
                interrupt=self.interrupt,
                background=self._background,
            )
            return run.wait(latch)

    def apply(self, fn: Callable, *args, ranks=None, **kwargs) -> list:
        """Call ``fn(*args, **kwargs)`` on the ranks; returns results in rank order."""
        return self._on_ranks(
            ranks, lambda view: view.apply_async(fn, *args, **kwargs), collectives=True
        )

    def push(self, mapping: Mapping[str, object], ranks=None) -> None:
        """Copy names from here into the ranks' namespaces."""
        names = check_names(mapping)
        self._on_ranks(ranks, lambda view: view.push(names, block=False))

    def pull(self, name: str, rank: int | None = None):
        """A name's value from one rank, or a list of values by rank when ``rank`` is None."""
        rank = check_one_rank(rank)
        values = pull_values(self._on_ranks, name, rank)
        return values[0] if rank is not None else values

    def interrupt(self, ranks=None) -> None:
        """Send SIGINT to the ranks: running code raises KeyboardInterrupt there."""
        chosen = self.select(ranks)
        interrupt_engines(self._handle, [r.pid for r in chosen], [r.engine_id for r in chosen])

    # -- faults -----------------------------------------------------------
    def dead_ranks(self, among=None) -> dict[int, str]:
        """{rank: how it died} for ranks whose process ended (or engine vanished); ``among``: ranks."""
        if self._handle is None:
            return {}
        monitor = self._watch.monitor if self._watch is not None else None
        crashes = self._watch.crashes if self._watch is not None else None
        return dead_ranks(monitor, self._handle.client, self.ranks, among, crashes)

    def _require_whole(self) -> None:
        self._require_alive(None)

    def _require_alive(self, among) -> dict[int, str]:
        # NbdistError naming the dead ranks among ``among`` (None: all), and what brings them
        # back; else every dead rank (outside ``among``), as dead_ranks() says.
        every = self.dead_ranks()  # asked once: a vanished rank's words may need a peer
        dead = {r: c for r, c in every.items() if among is None or r in among}
        if dead:
            alive = [r.rank for r in self.ranks if r.rank not in every]
            first = alive[0] if alive and among is not None else None
            raise NbdistError(dead_ranks_message(dead, self.restart_hint(), first))
        return every

    def restart_hint(self) -> str:
        """What brings dead ranks back, as the errors that name them say it."""
        if self._handle is not None and not self._handle.owned:
            return (
                "The engines of a cluster nbdist connected to (--connect) are started by "
                "whoever started them: start the missing ones again, then %dist_restart "
                "(or restart()) forms the group"
            )
        return "%dist_restart (or restart()) brings every rank back"

    def reform_group(self) -> list[str]:
        """Form the process group again on the same processes, after its ranks were released.

        Namespaces, models and tensors stay; objects bound to the old group (a
        ``DistributedDataParallel`` wrapper, a subgroup, a DeviceMesh, DTensors) must
        be made again: returns the ranks' variables that hold one, as ``"name (what)"``.
        """
        self._require_running()
        return reform_group(
            self._handle.client,
            self.group,
            group_timeout=self.options.group_timeout,
            timeout=self.options.timeout,
            interrupt=self.interrupt,
            monitor=self._watch.monitor if self._watch is not None else None,
        )

    # -- reporting --------------------------------------------------------
    def where(self, ranks=None) -> list[RankWhere]:
        """Where each rank is, without stopping it: its Python stack and last collective.

        Returns :class:`nbdist.driver.where.RankWhere` objects;
        ``nbdist.driver.where.format_where`` turns them into the ``%dist_where`` report.
        """
        return locate(self.client, self.select(ranks), self.dead_ranks())

    def status(self) -> list[dict]:
        """One row per rank: rank, engine, host, pid, device, backend, state, memory, GPU figures.

        A rank the metrics make a straggler has ``straggler``: why.
        """
        self._require_running()
        run = self._hub.run if self._hub is not None else None
        drop = run.dropped if run is not None else None
        return rank_status(
            self._handle,
            self.ranks,
            self.backend,
            self.dead_ranks(),
            dropped=drop,
            run=run,
            settle=True,
        )

    def rank_states(self) -> dict[int, str]:
        """{rank: state} in the words of :mod:`nbdist.rank_states` ({} when not running); a
        rank whose process here is stopped or held by a debugger as a
        :class:`~nbdist.rank_states.HeldState`."""
        if not self.running:
            return {}
        rows = rank_status(self._handle, self.ranks, self.backend, self.dead_ranks(), gpu=False)
        # gpu=False: no round trip per cell. A rank stopped or held by a debugger says so.
        return {
            row["rank"]: HeldState(row["state"], held_word(row["process"]))
            if row.get("process")
            else row["state"]
            for row in rows
        }

    def dashboard(self):
        """Show this session's live dashboard here (``%dist_dashboard``); see ``show_run``."""
        from nbdist.dashboard import show_run

        return show_run(self.metrics, states=self.rank_states)

    def summary(self) -> str:
        """One line: ranks, backend, devices, start-up (or restart) seconds; a second where ranks share GPUs."""
        self._require_running()
        return ready_lines(self)

    def __repr__(self) -> str:
        """``<DistSession: 2 ranks, gloo>``."""
        if not self.running:
            return "<DistSession: not running>"
        return f"<DistSession: {self.world_size} ranks, {self.backend}>"
