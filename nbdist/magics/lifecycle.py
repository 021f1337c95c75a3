"""Kernel side: the magics that start and stop the ranks: %dist_start, %dist_stop, %dist_restart, %dist_status.

:class:`DistMagics` holds the notebook's session; the other groups of magics
(:mod:`nbdist.magics`) reach it through this object. Each magic parses its flags,
makes one call on :class:`nbdist.DistSession` and shows the result (a script can do
the same with ``nbdist.current_session()``). Bad input raises IPython's
``UsageError`` naming the value and the fix, and changes nothing.
"""

from __future__ import annotations

import warnings

from IPython.core.error import UsageError
from IPython.core.magic import Magics, line_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments

from nbdist.errors import PlacementError
from nbdist.launch.options import parse_gpu_list, parse_launch_options
from nbdist.launch.values import parse_count, parse_duration, parse_seconds
from nbdist.magics.args import asked_for_help, line_words, parse_magic_line

__all__ = ["DistMagics"]


@magics_class
class DistMagics(Magics):
    """%dist_start, %dist_stop, %dist_restart, %dist_status; holds the notebook's session.

    ``session`` is the running (or last) :class:`~nbdist.DistSession`; ``last_run``
    what the last ``--noblock`` cell returned, ``last_run_session`` a weak reference to the
    session it ran on.
    """

    def __init__(self, shell):
        """Magics for ``shell``, with no session yet."""
        super().__init__(shell)
        self.session = None
        self.last_run = None
        self.last_run_session = None

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
    @argument(
        "--check-collectives",
        action="store_true",
        help="compare each collective's kind, shapes and dtypes across the ranks before it "
        "runs: a mismatch fails at once, naming them (slower)",
    )
    @argument("--launcher", default=None, help="ipyparallel engine launcher: mpi, ssh, slurm, ...")
    @argument("--profile", default=None, help="ipyparallel profile name (for its launcher config)")
    @argument("--connect", default=None, help="connection file of a running ipyparallel cluster")
    @argument("--attach", default=None, help="deprecated: --connect FILE")
    @argument("--ip", default="127.0.0.1", help="controller address (default loopback only)")
    @argument("--spawn", action="store_true", help="start engines as separate processes, no fork")
    @argument(
        "--name", default=None, help="a name: the session outlives the kernel (%%dist_attach NAME)"
    )
    @argument(
        "--idle-timeout",
        default=None,
        help="with --name: end the session after this long with no kernel attached and no "
        "cell running, e.g. 2h (default: never)",
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
            %dist_start --connect ~/.ipython/profile_default/security/cluster-abc.json
            %dist_start 16 --launcher slurm --ip 10.1.0.5 --partition gpu --time 01:00:00 \\
                --launch-opt gpus_per_node=8
            %dist_start --launcher ssh --ip 10.1.0.5 --hosts node1:4,node2:4
            %dist_start 4 --name train1   # outlives the kernel: %dist_attach train1 from another
            %dist_start 4 --name train1 --idle-timeout 2h   # ends after 2 h with nobody using it

        More ranks than GPUs share them round robin, over NCCL >= 2.30 (nbdist sets
        NCCL_MULTI_RANK_GPU_ENABLE=1) or else gloo, which stops a strategy it cannot serve.
        Every rank's namespace starts with torch, dist, nbdist, rank, local_rank,
        world_size and device. Stop with %dist_stop.

        ``--connect FILE`` starts nothing: it connects to the engines of a running
        ipyparallel cluster, from its cluster file (cluster-*.json) or client connection
        file (ipcontroller-client.json). ``--attach FILE``, its former name, still works
        in this release, with a warning.
        """
        if asked_for_help(self.dist_start, line):
            return
        args = parse_magic_line(self.dist_start, line)
        connect = _connection_file(args)
        if self.session is not None and self.session.running:
            raise UsageError(
                f"a cluster of {self.session.world_size} ranks is already running: "
                "%dist_stop or %dist_restart first"
            )
        from nbdist.driver.session import DistSession

        make = DistSession
        if args.idle_timeout is not None and args.name is None:
            raise UsageError(
                f"--idle-timeout {args.idle_timeout} ends a named session: add --name NAME "
                "(a session without a name ends with its kernel)"
            )
        if args.name is not None:
            from functools import partial

            from nbdist.driver.named_sessions import NamedSession

            idle = None
            if args.idle_timeout is not None:
                try:
                    idle = parse_duration(args.idle_timeout, "--idle-timeout")
                except PlacementError as exc:
                    raise UsageError(str(exc)) from None
            make = partial(NamedSession, name=args.name, idle_timeout=idle)
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
                check_collectives=args.check_collectives,
                launcher=args.launcher,
                profile=args.profile,
                connect=connect,
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
        except KeyboardInterrupt:
            # start() stopped what it had started; the frames of a start are no help here.
            raise UsageError(
                "%dist_start interrupted: what it had started was stopped; run it again to start"
            ) from None
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
        if asked_for_help(self.dist_stop, line):
            return
        words = line_words(line)
        if len(words) > 1:
            raise UsageError(
                f"%dist_stop {line.strip()!r}: give one session name, e.g. %dist_stop train1"
            )
        if words:
            from nbdist.magics.named_sessions import stop_named_session

            return stop_named_session(self, words[0])
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
        if asked_for_help(self.dist_restart, line):
            return
        if line.strip():
            raise UsageError(f"%dist_restart takes no arguments, got {line.strip()!r}")
        session = self.running_session()
        try:
            session.restart()
        except KeyboardInterrupt:
            # A restart cut short stops what it had (no half-formed group is left to use);
            # the frames of a restart are no help here.
            if session.running:
                raise UsageError(
                    "%dist_restart interrupted: the ranks kept running; run it again to restart"
                ) from None
            raise UsageError(
                "%dist_restart interrupted: the ranks were stopped (a group half formed is "
                "of no use); %dist_start starts them again"
            ) from None
        print(session.summary())

    @line_magic
    def dist_status(self, line=""):
        """A table of ranks: rank, host, pid, device, backend, state, memory (and GPU figures).

        An HTML table in a notebook (each rank in its dashboard colour), the same
        table as text in a terminal or a saved notebook's plain text; dead ranks
        and how they died are listed under it. Above 8 ranks: the ranks counted
        by state, a row per host, and only the ranks that deviate (dead, busy
        while the others are idle); ``--all`` lists every rank. Example::

            %dist_status
            %dist_status --all
        """
        if asked_for_help(self.dist_status, line):
            return
        from IPython.display import display

        from nbdist.driver.status import StatusTable

        words = line.split()
        if any(word != "--all" for word in words):
            raise UsageError(f"%dist_status takes only --all, got {line.strip()!r}")
        session = self.running_session()
        display(StatusTable(session.status(), all_ranks=bool(words), hint=session.restart_hint()))


def _connection_file(args) -> str | None:
    # "attach" means a named session (%dist_attach NAME); a connection file is --connect.
    # --attach FILE, the flag's former name, keeps working for one release.
    if args.attach is None:
        return args.connect
    if args.connect is not None:
        raise UsageError(
            f"--attach {args.attach!r} and --connect {args.connect!r}: give the connection "
            "file once, with --connect FILE"
        )
    warnings.warn(
        "%dist_start --attach FILE is deprecated and will be removed in the next release: "
        f"use %dist_start --connect {args.attach}",
        FutureWarning,
        stacklevel=2,
    )
    return args.attach
