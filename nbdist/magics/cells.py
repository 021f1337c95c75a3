"""Kernel side: the magics that run code and move values: %%on_all_ranks, %%on_rank, %dist_push, %dist_pull.

Each parses its flags and calls the running :class:`nbdist.DistSession`
(``run``, ``push``, ``pull``); :func:`run_on_ranks` is the one way a magic sends
code to the ranks (``%dist_run`` in :mod:`nbdist.magics.scripts` uses it too).
"""

from __future__ import annotations

import weakref

from IPython.core.error import UsageError
from IPython.core.magic import cell_magic, line_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments

from nbdist.driver import export
from nbdist.driver.lab_debugger_cells import prepare_cell
from nbdist.errors import NbdistError, PlacementError, RankError, format_ranks
from nbdist.launch.values import is_digits
from nbdist.magics.args import (
    CELL_TIMEOUT,
    NOBLOCK,
    RANKS,
    SessionMagics,
    asked_for_help,
    parse_magic_line,
    seconds,
)

__all__ = ["CellMagics", "run_on_ranks"]


def run_on_ranks(dist_magics, cell: str, ranks, noblock: bool, timeout):
    """Run ``cell`` on ``ranks`` (None: all) of ``dist_magics``' session; the result of --noblock, else None.

    ``timeout``: the magic's ``--timeout`` word (seconds), or None for no limit.
    """
    session = dist_magics.running_session()
    on_all = ranks is None
    timeout_s = seconds(timeout) if timeout is not None else None
    try:
        selected = session.select(ranks)
    except PlacementError as exc:
        raise UsageError(str(exc)) from None
    ranks = [r.rank for r in selected]
    prepare_cell(session, ranks, cell)  # JupyterLab's debugger, when it is on
    if noblock:
        dist_magics.last_run = session.run(cell, ranks, block=False, timeout=timeout_s)
        # Weakly: a stopped session's run and client must not outlive it here.
        dist_magics.last_run_session = weakref.ref(session)
        return dist_magics.last_run
    _say_queued(dist_magics, session, ranks)
    # Blocking through the session: the cell returns with its metrics points in
    # the run, and may be sent silent when it has nothing to show.
    session.run(cell, ranks, timeout=timeout_s)
    # %dist_run's script: in the export, where it ran (reached only if no rank raised).
    entry = export.run_script_entry(cell, cell_name(dist_magics.shell)) if on_all else ""
    if entry:
        export.record(session, entry)
    return None


def cell_name(shell) -> str:
    """'In[7]': the notebook cell running now, as the export's messages name it."""
    number = getattr(shell, "execution_count", None)
    return f"In[{number}]" if isinstance(number, int) and number > 0 else "a cell"


def _first_line(cell: str) -> str:
    lines = [line.strip() for line in cell.splitlines() if line.strip()]
    return repr(lines[0][:60] if lines else "")


def _say_queued(dist_magics, session, ranks: list[int]) -> None:
    # A rank runs one cell at a time: behind a --noblock cell still running, this one
    # waits with nothing shown (its --timeout counting) unless told.
    earlier = dist_magics.last_run
    of = dist_magics.last_run_session
    if earlier is None or of is None or of() is not session or earlier.done():
        return
    busy = sorted(set(earlier.ranks) & set(ranks))
    if busy:
        print(
            f"nbdist: {format_ranks(busy)} still run{'s' if len(busy) == 1 else ''} the "
            "--noblock cell started earlier; this cell runs there after it (interrupt the "
            "kernel to stop both)"
        )


def _unsendable(values: dict) -> tuple[str, str] | None:
    """(name, why) of the first value ipyparallel cannot serialize, as a push would; else None."""
    from ipyparallel.serialize import serialize_object

    for name, value in values.items():
        try:
            serialize_object(value)
        except Exception as exc:  # whatever pickling raises (TypeError, PicklingError, ...)
            return name, str(exc) or type(exc).__name__
    return None


@magics_class
class CellMagics(SessionMagics):
    """%%on_all_ranks, %%on_rank, %dist_push, %dist_pull: on the session ``self.dist`` holds."""

    @magic_arguments("%on_all_ranks")  # its usage line then reads %%on_all_ranks
    @RANKS
    @NOBLOCK
    @CELL_TIMEOUT
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
        if asked_for_help(self.on_all_ranks, line):
            return None
        args = parse_magic_line(self.on_all_ranks, line)
        result = run_on_ranks(self.dist, cell, args.ranks, args.noblock, args.timeout)
        # Reached only if no rank raised: failed cells are not exported (a --noblock
        # one is recorded once it succeeded on every rank).
        name, session = cell_name(self.shell), self.dist.session
        if args.no_export:
            return result
        if args.ranks is None:
            entry, warning = export.recorded_entry(cell, name)
            if warning:
                print(f"nbdist: {warning}")
        else:
            entry = export.note_cell(
                f"{name} (%%on_all_ranks --ranks {args.ranks}, {_first_line(cell)}) is left "
                "out: it ran on some ranks only (in the script, guard it with `if rank == ...:`)"
            )
        export.record(session, entry, result)
        return result

    @magic_arguments("%on_rank")
    @argument("rank", help="the rank to run on")
    @NOBLOCK
    @CELL_TIMEOUT
    @cell_magic
    def on_rank(self, line, cell):
        """Run the cell on one rank.

        Example::

            %%on_rank 0
            print(model)
        """
        if asked_for_help(self.on_rank, line):
            return None
        args = parse_magic_line(self.on_rank, line)
        if not is_digits(args.rank):
            raise UsageError(f"rank {args.rank!r}: give one rank number, e.g. %%on_rank 0")
        result = run_on_ranks(self.dist, cell, args.rank, args.noblock, args.timeout)
        note = (
            f"{cell_name(self.shell)} (%%on_rank {args.rank}, {_first_line(cell)}) is left out: "
            f"it ran on rank {args.rank} only (in the script, guard it with `if rank == {args.rank}:`)"
        )
        export.record(self.dist.session, export.note_cell(note), result)
        return result

    @line_magic
    def dist_push(self, line=""):
        """Copy variables from the notebook to every rank.

        Usage: ``%dist_push NAME [NAME...]``. Example::

            lr = 0.1
            %dist_push lr
        """
        if asked_for_help(self.dist_push, line):
            return
        names = line.split()
        if not names:
            raise UsageError("%dist_push needs variable names, e.g. %dist_push lr batch_size")
        missing = [n for n in names if n not in self.shell.user_ns]
        if missing:
            raise UsageError(f"%dist_push: {missing[0]!r} is not defined in the notebook")
        values = {n: self.shell.user_ns[n] for n in names}
        session = self.dist.running_session()
        try:
            session.push(values)
        except NbdistError:  # the ranks' own trouble (one died): as it is
            raise
        except Exception:  # pickling fails before anything is sent: name the value
            culprit = _unsendable(values)
            if culprit is None:
                raise
            raise UsageError(
                f"%dist_push: {culprit[0]!r} cannot be sent to the ranks ({culprit[1]}): "
                "nothing was pushed; create it on the ranks in an %%on_all_ranks cell"
            ) from None
        shown = ", ".join(f"{n} = {repr(v)[:40]}" for n, v in values.items())
        note = (
            f"{cell_name(self.shell)} (%dist_push {' '.join(names)}) is left out: the ranks got "
            f"{shown} from the notebook: define {'it' if len(names) == 1 else 'them'} in the script"
        )
        export.record(session, export.note_cell(note))

    @magic_arguments()
    @argument("name", help="variable name on the ranks")
    @argument("--rank", default=None, help="one rank's value (default: a list by rank)")
    @line_magic
    def dist_pull(self, line=""):
        """A variable's value from the ranks: a list by rank, or one rank's.

        Examples::

            losses = %dist_pull loss
            w0 = %dist_pull weight --rank 0
        """
        if asked_for_help(self.dist_pull, line):
            return None
        args = parse_magic_line(self.dist_pull, line)
        if not args.name.isidentifier():
            raise UsageError(
                f"%dist_pull {args.name!r}: give a variable name, e.g. %dist_pull loss"
            )
        session = self.dist.running_session()
        rank = None
        if args.rank is not None:
            if not is_digits(args.rank):
                raise UsageError(f"--rank {args.rank!r}: give a rank number, e.g. --rank 0")
            rank = int(args.rank)
            if rank >= session.world_size:
                raise UsageError(
                    f"rank {rank} does not exist: this cluster has ranks 0..{session.world_size - 1}"
                )
        try:
            return session.pull(args.name, rank=rank)
        except RankError as exc:
            # The name itself missing is a slip of the user's, not a rank's error: one line.
            if exc.undefined_name() == args.name:
                raise UsageError(
                    f"%dist_pull {args.name!r}: not defined on {format_ranks(exc.ranks)}: "
                    "assign it in an %%on_all_ranks cell first (or pull a name that exists)"
                ) from None
            # The ranks could not pickle the value (a generator, a lock, an open file).
            unpicklable = ("cannot pickle", "can't pickle")
            if all(f.evalue.lower().startswith(unpicklable) for f in exc.failures):
                raise UsageError(
                    f"%dist_pull {args.name!r}: its value on {format_ranks(exc.ranks)} cannot "
                    f"be sent to the notebook ({exc.failures[0].evalue}): pull what you need "
                    "of it, e.g. assign list(...) or .state_dict() to a name in a cell first"
                ) from None
            raise
