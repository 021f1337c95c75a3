"""Kernel side: the magics that look at the ranks: %dist_where, %dist_dashboard, %dist_diff, %dist_profile.

Registered by :func:`nbdist.magics.register`; each magic parses its line and
calls the library (:mod:`nbdist.driver.where`, :mod:`nbdist.dashboard`,
:mod:`nbdist.driver.diff`, :mod:`nbdist.driver.trace_merge`).
"""

from __future__ import annotations

import ast
import re

from IPython.core.error import UsageError
from IPython.core.magic import line_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments

from nbdist.errors import NbdistError, PlacementError, RankError, format_ranks
from nbdist.launch.values import is_digits
from nbdist.magics.args import RANKS, SessionMagics, asked_for_help, parse_magic_line

__all__ = ["InspectMagics", "parse_profile_line", "split_diff_line"]

# --ranks / --ref at either end of the line; what is left is the expression.
_LEADING = re.compile(r"^\s*--(ranks|ref)(?:\s*=\s*|\s+)(\S+)")
_TRAILING = re.compile(r"\s--(ranks|ref)(?:\s*=\s*|\s+)(\S+)\s*$")


def split_diff_line(line: str) -> tuple[str, str | None, int]:
    """``%dist_diff``'s line as (expression, ranks or None, reference rank); bad input: UsageError."""
    options: dict[str, str] = {}
    rest = line
    while True:
        match = _LEADING.match(rest) or _TRAILING.search(rest)
        if match is None:
            break
        if match.group(1) in options:
            raise UsageError(f"--{match.group(1)} given twice in {line!r}")
        options[match.group(1)] = match.group(2)
        rest = rest[: match.start()] + rest[match.end() :]
    expr = rest.strip()
    if not expr:
        raise UsageError(
            "%dist_diff needs an expression, e.g. %dist_diff model.state_dict() --ranks 0,1"
        )
    ref = options.get("ref", "0")
    if not ref.isdigit():
        raise UsageError(f"--ref {ref!r}: give a rank number, e.g. --ref 0")
    return expr, options.get("ranks"), int(ref)


def _undefined_name(expr: str, error: RankError) -> str | None:
    """The name of ``expr`` that every failing rank lacked, if that is all that failed."""
    missing = error.undefined_name()
    names = {
        node.id for node in ast.walk(ast.parse(expr, mode="eval")) if isinstance(node, ast.Name)
    }
    return missing if missing in names else None


def parse_profile_line(line: str) -> tuple[int | None, int, bool]:
    """``%dist_profile``'s line as (steps or None, skip, collect); bad input: UsageError."""
    words = line.split()
    steps, skip, collect = None, 1, False
    while words:
        word = words.pop(0)
        if word == "--collect":
            collect = True
        elif word == "--skip" or word.startswith("--skip="):
            value = word.partition("=")[2] or (words.pop(0) if words else "")
            if not value.isdigit():
                raise UsageError(f"--skip {value!r}: give a number of steps, e.g. --skip 1")
            skip = int(value)
        elif word.isdigit() and steps is None and int(word) > 0:
            steps = int(word)
        else:
            raise UsageError(
                f"%dist_profile: {word!r} not understood: %dist_profile N [--skip K], or --collect"
            )
    if steps is None and not collect:
        raise UsageError("%dist_profile needs a number of steps, e.g. %dist_profile 3")
    if steps is not None and collect:
        raise UsageError(
            f"%dist_profile {line.strip()!r}: either N steps (%dist_profile {steps}) "
            "or --collect (gather what was recorded), not both"
        )
    return steps, skip, collect


def _pids(session) -> tuple:
    return tuple((r.host, r.pid) for r in session.ranks)


@magics_class
class InspectMagics(SessionMagics):
    """%dist_where, %dist_dashboard, %dist_diff, %dist_profile: on the session ``self.dist`` holds."""

    def __init__(self, shell, dist_magics):
        """Magics for ``shell`` on ``dist_magics.session``; after each cell, gathers a finished profile."""
        super().__init__(shell, dist_magics)
        self._profile_armed = False
        # (steps, skip) of the last %dist_profile N, and the rank processes it armed: a
        # restart's fresh ones are armed again after the cell that restarted them.
        self._profile_request: tuple[int, int] = (0, 0)
        self._profile_pids: tuple = ()
        self._profile_session = None
        if shell is not None:
            # After each cell: gather a profile the ranks finished (cheap unless one may be ready).
            callbacks = shell.events.callbacks["post_run_cell"]
            for old in [c for c in callbacks if getattr(c, "__name__", "") == "_gather_profile"]:
                shell.events.unregister("post_run_cell", old)
            shell.events.register("post_run_cell", self._gather_profile)

    @magic_arguments()
    @RANKS
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

        if asked_for_help(self.dist_where, line):
            return
        if re.fullmatch(r"[0-9][0-9,-]*", line.strip()):  # %dist_where 1: the flag left out
            raise UsageError(
                f"%dist_where {line.strip()!r}: name the ranks with --ranks, "
                f"e.g. %dist_where --ranks {line.strip()}"
            )
        args = parse_magic_line(self.dist_where, line)
        session = self.dist.running_session()
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

        if asked_for_help(self.dist_dashboard, line):
            return
        args = parse_magic_line(self.dist_dashboard, line)
        if args.run is not None and not is_digits(args.run):
            raise UsageError(
                f"run {args.run!r}: give a run id, e.g. %dist_dashboard 3 (see nbdist.runs())"
            )
        session = self.dist.session
        try:
            own = session.metrics if session is not None else None
        except NbdistError:  # a session that never started has no run
            own = None
        try:
            run = pick_run(None if args.run is None else int(args.run), current=own)
        except LookupError as exc:
            raise UsageError(str(exc.args[0])) from None
        show_run(run, states=session.rank_states if own is not None and run is own else None)

    @line_magic
    def dist_diff(self, line=""):
        """Which ranks' values of an expression differ from rank 0's (or --ref R's), and by how much.

        Usage: ``%dist_diff EXPR [--ranks 0,2 | 0-3] [--ref R]``

        EXPR is evaluated on every rank (or --ranks, plus the reference rank) in
        its namespace; an error there fails the cell like %%on_all_ranks. Tensors
        (max |diff|, where, how many elements; shape, dtype or device mismatch;
        NaN equals NaN in the same place), numbers, strings, None and nested
        dicts, lists and tuples are compared leaf by leaf. Ranks holding the same
        value are reported together; the last line sums up. Examples::

            %dist_diff model.state_dict()
            # ['fc.weight']: rank 1 differs from rank 0: max |diff| 3.2e-02 at (4, 7); 1 of 80 elements differs
            # 1 of 4 values differs on rank 1 (reference rank 0; ranks 0-1 compared)

            %dist_diff optimizer.state_dict() --ranks 1-3 --ref 1
            %dist_diff loss.item()
            # no rank differs from rank 0 (ranks 0-3, 1 value compared)

        Only fingerprints (shape, dtype, a hash, a few statistics) travel for
        tensors that agree; see nbdist.driver.diff. The table form, a pandas
        DataFrame: nbdist.diff("model.state_dict()").
        """
        from nbdist.driver.diff import compare_values

        if asked_for_help(self.dist_diff, line, anywhere=False):  # the rest is an expression
            return
        expr, ranks, ref = split_diff_line(line)
        session = self.dist.running_session()
        try:
            result = compare_values(session, expr, ranks, ref)
        except PlacementError as exc:
            raise UsageError(str(exc)) from None
        except SyntaxError as exc:
            raise UsageError(f"%dist_diff {expr!r} is not a Python expression: {exc.msg}") from None
        except RankError as exc:
            missing = _undefined_name(expr, exc)
            if missing is None:
                raise
            raise UsageError(
                f"%dist_diff: {missing!r} is not defined on {format_ranks(exc.ranks)}: "
                "define it in an %%on_all_ranks cell first"
            ) from None
        print(result.report())

    @line_magic
    def dist_profile(self, line=""):
        """Profile the next N steps of a loop that calls nbdist.log, on every rank; one merged trace.

        Usage: ``%dist_profile N [--skip K]`` · ``%dist_profile --collect``

        On every rank, the next ``nbdist.log`` call starts torch.profiler; the
        following K steps (default 1) are skipped (warm-up), the N after them
        recorded; each ``nbdist.log`` call ends a step. After the cell in which
        the ranks finish, the kernel gathers their traces, aligns their clocks
        and writes ONE Chrome/Perfetto trace, a process row per rank, under
        ``profiles/run-<id>/`` beside the run history, printing its path and a
        summary per rank (compute / communication / idle share, their overlap,
        top operators by self time). ``--collect`` stops profiles still
        recording (keeping their steps so far) and gathers now. Example::

            %dist_profile 3
            %%on_all_ranks
            for step in range(10):
                train_step()
                nbdist.log(step=step, loss=loss)
            # nbdist: merged profile of 2 ranks (rank 0: 3, rank 1: 3 steps): .../profile-1-....json
            # open it at https://ui.perfetto.dev: 'Open trace file' (or drop the file on the page)

        On the ranks, ``with nbdist.profile(steps=3): ...`` does the same around
        a block (see nbdist.engine.profiling); its trace is gathered after the
        cell too. From a script: nbdist.driver.trace_merge.collect(session).
        """
        from nbdist.driver.trace_merge import collect
        from nbdist.engine import profiling

        if asked_for_help(self.dist_profile, line):
            return
        steps, skip, gather = parse_profile_line(line)
        session = self.dist.running_session()
        if gather:
            merged = collect(session, stop=True)
            self._profile_armed = False
            print(merged.report() if merged else "nbdist: no profile recorded on the ranks")
            return
        try:
            session.apply(profiling.arm, steps, skip)
        except Exception as exc:
            if "already running" not in str(exc):
                raise
            raise UsageError(
                "%dist_profile: a profile is still recording on the ranks (started by"
                " nbdist.profile in a thread, or a cell still running): %dist_profile --collect"
                " stops it and gathers its steps; then %dist_profile N again"
            ) from None
        self._profile_armed = True
        self._profile_request, self._profile_pids = (steps, skip), _pids(session)
        self._profile_session = session
        print(
            f"nbdist: profiling {steps} steps after {skip} skipped, from the next nbdist.log call;"
            " the merged trace is written after the cell that finishes them"
        )

    def _arm_again(self, session) -> None:
        # The session was restarted after %dist_profile N: its fresh ranks know nothing of it.
        from nbdist.engine import profiling

        steps, skip = self._profile_request
        self._profile_pids = _pids(session)
        try:
            session.apply(profiling.arm, steps, skip)
        except Exception as exc:  # the cell itself succeeded: say why, do not fail it
            self._profile_armed = False
            print(f"nbdist: could not arm the profile again after the restart: {exc}")
            return
        print(
            f"nbdist: the ranks were restarted before the profile was taken: %dist_profile "
            f"{steps} armed again on the new ones, from their next nbdist.log call"
        )

    def _gather_profile(self, result=None):
        # Asks the ranks only after a cell that armed or may have run nbdist.profile.
        raw = str(getattr(getattr(result, "info", None), "raw_cell", "") or "")
        if raw.lstrip().startswith("%dist_profile"):
            return
        if not (self._profile_armed or "profile(" in raw):
            return
        session = self.dist.session
        if session is None or not session.running:
            return
        if self._profile_armed and session is not self._profile_session:
            self._profile_armed = False  # armed on ranks that were stopped: nothing to gather
        if self._profile_armed and self._profile_pids != _pids(session):
            self._arm_again(session)
            return
        from nbdist.driver.trace_merge import collect

        try:
            merged = collect(session)
        except Exception as exc:  # the cell itself succeeded: say why, do not fail it
            print(f"nbdist: could not gather the profile: {exc}")
            return
        if merged is not None:
            self._profile_armed = False
            print(merged.report())
