"""Kernel side: the IPython magics, a thin layer over :class:`nbdist.DistSession`.

Each magic parses its flags, makes one API call and shows the result (a script
can do the same with ``nbdist.current_session()``). Bad input raises IPython's
``UsageError`` naming the value and the fix, and changes nothing.
"""

from __future__ import annotations

from IPython.core.error import UsageError
from IPython.core.magic import Magics, cell_magic, line_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments

from nbdist.errors import NbdistError, PlacementError
from nbdist.launch.options import parse_gpu_list, parse_launch_options
from nbdist.launch.values import is_digits, parse_count, parse_seconds
from nbdist.magic_args import parse_magic_line, seconds

__all__ = ["DistMagics", "register"]


# Flags several magics share, declared once (each magic's help lists them).
_RANKS = argument("--ranks", default=None, help="ranks: 0,2 or 0-3 (default: all)")
_NOBLOCK = argument("--noblock", action="store_true", help="return at once; .wait() on the result")
_CELL_TIMEOUT = argument(
    "--timeout", default=None, help="interrupt the ranks after this many seconds (default: none)"
)


@magics_class
class DistMagics(Magics):
    """%dist_start, %%on_all_ranks, %%on_rank, %dist_status, %dist_stop, ... (scripts: ScriptMagics)."""

    def __init__(self, shell):
        """Magics for ``shell``, with no session yet."""
        super().__init__(shell)
        self.session = None
        self.last_run = None

    # -- helpers ----------------------------------------------------------
    def running_session(self):
        """The running session; a UsageError naming %dist_start when there is none."""
        if self.session is None or not self.session.running:
            raise UsageError(
                "no nbdist cluster is running: start one with %dist_start (e.g. %dist_start 2)"
            )
        return self.session

    # -- start / stop -----------------------------------------------------
    @magic_arguments()
    @argument("n", nargs="?", default=None, help="ranks (default: one per GPU, or 2 without GPUs)")
    @argument("--backend", default=None, help="nccl or gloo (default: nccl on GPUs, gloo on CPU)")
    @argument("--cpu", action="store_true", help="run on CPU even if GPUs are visible")
    @argument("--gpus", default=None, help="GPU indices to use, e.g. 0,1")
    @argument("--threads", default=None, help="torch threads per rank (default: cores / ranks)")
    @argument("--timeout", default="120", help="seconds to wait for the ranks (default 120)")
    @argument("--group-timeout", default="1800", help="the process group's timeout, s (1800)")
    @argument("--launcher", default=None, help="ipyparallel engine launcher: mpi, ssh, slurm, ...")
    @argument("--profile", default=None, help="ipyparallel profile name (for its launcher config)")
    @argument("--attach", default=None, help="cluster file of a running ipyparallel cluster")
    @argument("--ip", default="127.0.0.1", help="controller address (default loopback only)")
    @argument("--spawn", action="store_true", help="start engines as separate processes, no fork")
    @argument(
        "--name", default=None, help="a name: the session outlives the kernel (%%dist_attach NAME)"
    )
    @argument(
        "--check", action="store_true", help="time each rank's link to rank 0 (seconds at most)"
    )
    @argument("--partition", default=None, help="--launcher slurm: the partition (queue)")
    @argument("--time", default=None, help="--launcher slurm: time limit, e.g. 01:00:00")
    @argument("--account", default=None, help="--launcher slurm: the account to charge")
    @argument("--hosts", default=None, help="--launcher ssh/mpi: hosts and ranks, node1:4,node2:4")
    @argument(
        "--launch-opt",
        action="append",
        default=None,
        metavar="KEY=VALUE",
        help="another launcher option (repeatable), e.g. gpus_per_node=8 (see docs/multihost.md)",
    )
    @line_magic
    def dist_start(self, line=""):
        """Start N ranks with torch.distributed ready on each; returns when all are ready.

        Examples::

            %dist_start              # one rank per GPU, or 2 CPU ranks without GPUs
            %dist_start 2            # on one GPU: both ranks share it (see below)
            %dist_start 4 --cpu      # 4 CPU ranks (gloo), threads shared among them
            %dist_start 4 --check    # then times each link to rank 0; warns if one is slow
            %dist_start --gpus 0,2   # two ranks on GPUs 0 and 2 (NCCL)
            %dist_start --attach ~/.ipython/profile_default/security/cluster-abc.json
            %dist_start 16 --launcher slurm --ip 10.1.0.5 --partition gpu --time 01:00:00 \
                --launch-opt gpus_per_node=8
            %dist_start --launcher ssh --ip 10.1.0.5 --hosts node1:4,node2:4
            %dist_start 4 --name train1   # outlives the kernel: %dist_attach train1 from another

        More ranks than GPUs share them round robin, over NCCL >= 2.30 (nbdist sets
        NCCL_MULTI_RANK_GPU_ENABLE=1) or else gloo, which stops a strategy it cannot serve.
        Every rank's namespace starts with torch, dist, nbdist, rank, local_rank,
        world_size and device. Stop with %dist_stop.
        """
        args = parse_magic_line(self.dist_start, line)
        if self.session is not None and self.session.running:
            raise UsageError(
                f"a cluster of {self.session.world_size} ranks is already running: "
                "%dist_stop or %dist_restart first"
            )
        from nbdist.driver.session import DistSession

        make = DistSession
        if args.name is not None:
            from functools import partial

            from nbdist.driver.named import NamedSession

            make = partial(NamedSession, name=args.name)
        try:
            n = parse_count(args.n, "number of ranks", "4") if args.n is not None else None
            threads = None
            if args.threads is not None:
                threads = parse_count(args.threads, "--threads", "2")
            gpus = parse_gpu_list(args.gpus) if args.gpus is not None else None
            launch_options = parse_launch_options(args.launch_opt)
            for name in ("partition", "time", "account", "hosts"):
                if getattr(args, name) is not None:
                    launch_options[name] = getattr(args, name)
            session = make(
                n,
                backend=args.backend,
                cpu=args.cpu,
                gpus=gpus,
                threads=threads,
                timeout=parse_seconds(args.timeout),
                group_timeout=parse_seconds(args.group_timeout, "--group-timeout"),
                launcher=args.launcher,
                profile=args.profile,
                attach=args.attach,
                ip=args.ip,
                start_method="spawn" if args.spawn else "fork",
                launch_options=launch_options or None,
            )
        except PlacementError as exc:
            raise UsageError(str(exc)) from None
        try:
            session.start()
        except PlacementError as exc:  # what a launcher refused before starting anything
            raise UsageError(str(exc)) from None
        self.session = session
        print(session.summary())
        if args.check:  # warns about a link far slower than the others (comm_check)
            from nbdist.driver.comm_check import check_links

            print("\n".join(check_links(session)))

    @line_magic
    def dist_stop(self, line=""):
        """Stop the ranks (and the controller) nbdist started; nothing is left running.

        With a name: end that named session, wherever it was started. Examples::

            %dist_stop
            %dist_stop train1
        """
        if line.strip():
            from nbdist.named_magics import stop_named_session

            return stop_named_session(self, line.strip())
        if self.session is None or not self.session.running:
            print("nbdist: no cluster running")
            return
        n = self.session.world_size
        self.session.stop()
        print(f"nbdist: stopped {n} ranks")

    @line_magic
    def dist_restart(self, line=""):
        """Fresh engines, the process group formed again, same number of ranks.

        Rank namespaces start empty again (except the standard names). Example::

            %dist_restart
        """
        if line.strip():
            raise UsageError(f"%dist_restart takes no arguments, got {line.strip()!r}")
        self.running_session().restart()
        print(self.session.summary())

    @line_magic
    def dist_status(self, line=""):
        """A table of ranks: rank, host, pid, device, backend, state, memory (and GPU figures).

        An HTML table in a notebook (each rank in its dashboard colour), the same
        table as text in a terminal or a saved notebook's plain text; dead ranks
        and how they died are listed under it. Example::

            %dist_status
        """
        from IPython.display import display

        from nbdist.driver.status import StatusTable

        if line.strip():
            raise UsageError(f"%dist_status takes no arguments, got {line.strip()!r}")
        display(StatusTable(self.running_session().status()))

    @magic_arguments()
    @_RANKS
    @line_magic
    def dist_where(self, line=""):
        """Where each rank is, without stopping anything: its Python stack and last collective.

        Ranks answer on their control channel, so this works while they run or
        hang (after a --noblock cell, or from a subshell console while a cell
        hangs). A rank waiting in a collective that another rank never entered
        is named. Example::

            %dist_where
            # rank 0: inside all_reduce #118 for 42.0 s
            #   File "/tmp/ipykernel_123/456.py", line 9, in <module>: dist.all_reduce(t)
            # rank 1: never entered all_reduce #118 (last: all_reduce #117, returned 42.1 s ago)
            #   File "/tmp/ipykernel_124/456.py", line 7, in <module>: time.sleep(60)
        """
        from nbdist.driver.where import format_where

        args = parse_magic_line(self.dist_where, line)
        session = self.running_session()
        try:
            found = session.where(args.ranks)
        except PlacementError as exc:
            raise UsageError(str(exc)) from None
        print(format_where(found))

    @magic_arguments()
    @argument(
        "run",
        nargs="?",
        default=None,
        help="a run id from nbdist.runs() (default: this session's run)",
    )
    @line_magic
    def dist_dashboard(self, line=""):
        """Show a run's dashboard: live plots of every logged series per rank, throughput, a rank table.

        Without an argument: the current session's run (it also appears by itself
        under a cell whose ranks call nbdist.log). With a run id: that run from the
        history, also after a kernel restart. Outside a notebook: a text summary.
        Examples::

            %dist_dashboard
            %dist_dashboard 12
        """
        from nbdist.dashboard import show_run
        from nbdist.metrics.store import pick_run

        args = parse_magic_line(self.dist_dashboard, line)
        if args.run is not None and not is_digits(args.run):
            raise UsageError(
                f"run {args.run!r}: give a run id, e.g. %dist_dashboard 3 (see nbdist.runs())"
            )
        try:
            own = self.session.metrics if self.session is not None else None
        except NbdistError:  # a session that never started has no run
            own = None
        try:
            run = pick_run(None if args.run is None else int(args.run), current=own)
        except LookupError as exc:
            raise UsageError(str(exc.args[0])) from None
        show_run(run, states=self.session.rank_states if own is not None and run is own else None)

    # -- running code -----------------------------------------------------
    @magic_arguments()
    @_RANKS
    @_NOBLOCK
    @_CELL_TIMEOUT
    @argument("--no-export", action="store_true", help="leave this cell out of %%dist_export")
    @cell_magic
    def on_all_ranks(self, line, cell):
        """Run the cell on every rank (or --ranks); state persists between cells.

        Output streams live, labelled by rank; lines every rank printed alike are
        shown once. If any rank raises, the cell fails with tracebacks grouped by
        rank. Interrupting the kernel interrupts every rank. No time limit unless
        --timeout is given. Examples::

            %%on_all_ranks
            t = torch.ones(2) * rank
            dist.all_reduce(t)
            print(rank, t)

            %%on_all_ranks --ranks 0,1 --timeout 60
            print(rank)

        Cells run on every rank are recorded for %dist_export, unless run with
        --no-export or marked with the comment ``# nbdist: no-export``.
        """
        args = parse_magic_line(self.on_all_ranks, line)
        result = self.run_on_ranks(cell, args.ranks, args.noblock, args.timeout)
        if args.ranks is None and not args.no_export:
            # Reached only if no rank raised: failed cells are not exported.
            self.session.record_cell(cell)
        return result

    @magic_arguments()
    @argument("rank", help="the rank to run on")
    @_NOBLOCK
    @_CELL_TIMEOUT
    @cell_magic
    def on_rank(self, line, cell):
        """Run the cell on one rank. Example::

        %%on_rank 0
        print(model)
        """
        args = parse_magic_line(self.on_rank, line)
        if not is_digits(args.rank):
            raise UsageError(f"rank {args.rank!r}: give one rank number, e.g. %%on_rank 0")
        return self.run_on_ranks(cell, args.rank, args.noblock, args.timeout)

    def run_on_ranks(self, cell, ranks, noblock, timeout):
        """Run ``cell`` on ``ranks`` (None: all); the result of --noblock, else None."""
        session = self.running_session()
        timeout_s = seconds(timeout) if timeout is not None else None
        try:
            selected = session.select(ranks)
        except PlacementError as exc:
            raise UsageError(str(exc)) from None
        ranks = [r.rank for r in selected]
        if noblock:
            self.last_run = session.run(cell, ranks, block=False, timeout=timeout_s)
            return self.last_run
        # Blocking through the session: the cell returns with its metrics points in
        # the run, and may be sent silent when it has nothing to show.
        session.run(cell, ranks, timeout=timeout_s)
        return None

    # -- moving values ----------------------------------------------------
    @line_magic
    def dist_push(self, line=""):
        """Copy variables from the notebook to every rank. Example::

        lr = 0.1
        %dist_push lr
        """
        names = line.split()
        if not names:
            raise UsageError("%dist_push needs variable names, e.g. %dist_push lr batch_size")
        missing = [n for n in names if n not in self.shell.user_ns]
        if missing:
            raise UsageError(f"%dist_push: {missing[0]!r} is not defined in the notebook")
        self.running_session().push({n: self.shell.user_ns[n] for n in names})

    @magic_arguments()
    @argument("name", help="variable name on the ranks")
    @argument("--rank", default=None, help="one rank's value (default: a list by rank)")
    @line_magic
    def dist_pull(self, line=""):
        """A variable's value from the ranks: a list by rank, or one rank's. Examples::

        losses = %dist_pull loss
        w0 = %dist_pull weight --rank 0
        """
        args = parse_magic_line(self.dist_pull, line)
        if not args.name.isidentifier():
            raise UsageError(
                f"%dist_pull {args.name!r}: give a variable name, e.g. %dist_pull loss"
            )
        session = self.running_session()
        rank = None
        if args.rank is not None:
            if not is_digits(args.rank):
                raise UsageError(f"--rank {args.rank!r}: give a rank number, e.g. --rank 0")
            rank = int(args.rank)
            if rank >= session.world_size:
                raise UsageError(
                    f"rank {rank} does not exist: this cluster has ranks 0..{session.world_size - 1}"
                )
        return session.pull(args.name, rank=rank)


def register(ipython) -> DistMagics:
    """Register nbdist's magics on ``ipython`` (what ``%load_ext nbdist`` does); returns them."""
    from nbdist.debug_magics import DebugMagics
    from nbdist.inspect_magics import InspectMagics
    from nbdist.named_magics import NamedMagics
    from nbdist.perf_magics import PerfMagics
    from nbdist.script_magics import ScriptMagics

    magics = DistMagics(ipython)
    ipython.register_magics(magics)
    for more in (ScriptMagics, DebugMagics, InspectMagics, PerfMagics, NamedMagics):
        ipython.register_magics(more(ipython, magics))
    return magics
