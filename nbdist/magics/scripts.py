"""Kernel side: the magics that carry files and scripts to and from the ranks.

``%dist_sync``, ``%dist_run``, ``%dist_export``.

``%dist_run train.py --lr 0.1`` runs a torchrun-style script on every rank as
``__main__`` with its own ``sys.argv`` (:mod:`nbdist.engine.scripts`), so
its ``if __name__ == "__main__":`` block runs, its argparse reads its own
arguments, its ``init_process_group`` meets the group nbdist formed and its
``destroy_process_group`` leaves it up (:mod:`nbdist.engine.user_group`);
afterwards its globals are in the ranks' namespaces for the next cell.
``%dist_export`` goes the other way: the session's cells as a torchrun script.
``%dist_sync src`` makes this machine's files importable on ranks on other
machines (:mod:`nbdist.driver.file_sync`), ``%dist_run`` of a synced script included.
"""

from __future__ import annotations

import os
import shlex
import tokenize

from IPython.core.error import UsageError
from IPython.core.magic import line_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments

from nbdist.driver.export import EXPORT_MARK
from nbdist.engine.devices import BACKENDS
from nbdist.errors import NbdistError
from nbdist.magics.args import SessionMagics, asked_for_help, parse_magic_line
from nbdist.magics.cells import cell_name, run_on_ranks

__all__ = ["ScriptMagics", "split_run_line"]


def split_run_line(line: str) -> tuple[str | None, str, list[str]]:
    """``[--timeout S] script.py [args…]`` -> (timeout or None, script, the script's arguments).

    The script's arguments are passed on untouched (quotes included), so
    options of the script never collide with those of the magic.
    """
    rest = line.strip()
    timeout = None
    first = rest.split(None, 1)[0] if rest else ""
    if first == "--timeout" or first.startswith("--timeout="):  # argparse's two spellings
        if first == "--timeout":
            parts = rest.split(None, 2)[1:]
        else:
            parts = [first.partition("=")[2], *rest.split(None, 1)[1:]]
        if not parts or not parts[0]:
            raise UsageError("%dist_run --timeout needs seconds, e.g. %dist_run --timeout 600 x.py")
        timeout, rest = parts[0], parts[1] if len(parts) > 1 else ""
    if not rest:
        raise UsageError("%dist_run needs a script, e.g. %dist_run train.py --epochs 2")
    try:
        tokens = shlex.split(rest)
    except ValueError as exc:
        raise UsageError(f"could not parse {line!r} ({exc}): close the quotes") from None
    script, args = tokens[0], tokens[1:]
    return timeout, script, args


def _check_python(script: str, path: str) -> None:
    """A UsageError naming the line if the file at ``path`` is not Python (before any rank runs it)."""
    try:
        with tokenize.open(path) as f:  # honours a coding declaration, as runpy does
            compile(f.read(), path, "exec", dont_inherit=True)
    except SyntaxError as exc:
        text = (exc.text or "").strip()
        raise UsageError(
            f"%dist_run: {script} is not Python: line {exc.lineno}: {exc.msg}"
            + (f": {text}" if text else "")
        ) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise UsageError(f"%dist_run: cannot read {script} as a Python file ({exc})") from None


def _someone_elses(path: str) -> bool:
    """True if ``path`` is an existing file whose first lines are not a %dist_export header."""
    path = os.path.abspath(os.path.expanduser(path))
    if not os.path.isfile(path):
        return False
    try:
        with open(path, errors="replace") as f:
            head = f.read(1024)
    except OSError:  # unreadable: the write will say why
        return False
    return EXPORT_MARK not in head


def _record_sync(session, paths: list[str], name: str) -> None:
    """For %dist_export: the synced paths first on the script's sys.path, as on the ranks."""
    from nbdist.driver import export

    found = [os.path.abspath(os.path.expanduser(p)) for p in paths]
    folders = [os.path.dirname(p) if os.path.isfile(p) else p for p in found]
    code = f"import sys\n\nsys.path[:0] = {folders!r}"
    note = (
        f"{name} (%dist_sync {' '.join(paths)}) puts {', '.join(folders)} first on sys.path here "
        "too: on another machine, copy it there (or set PYTHONPATH)"
    )
    export.record(session, export.note_cell(note, code))


def _export_report(session, path: str) -> str:
    from nbdist.driver.export import export_notes, exportable_cells

    lines = [
        f"nbdist: wrote {path} ({len(exportable_cells(session.cells))} cells); "
        "run it with torchrun --nproc_per_node N"
    ]
    notes = export_notes(session.cells)
    if notes:
        lines.append("  NOTE (also at the top of the script):")
        lines += [f"  - {note}" for note in notes]
    return "\n".join(lines)


@magics_class
class ScriptMagics(SessionMagics):
    """%dist_sync, %dist_run and %dist_export: on the session ``self.dist`` holds."""

    @magic_arguments()
    @argument("paths", nargs="*", help="directories or files on this machine, e.g. src train.py")
    @argument(
        "--exclude",
        action="append",
        default=[],
        metavar="GLOB",
        help="leave out names or relative paths that match (repeatable), e.g. 'data/*'",
    )
    @argument(
        "--copy", action="store_true", help="a copy on every machine, even where seen in place"
    )
    @argument(
        "--reload", action="store_true", help="reload modules the ranks imported from changed files"
    )
    @line_magic
    def dist_sync(self, line=""):
        """Make directories or files of this machine importable on every rank, wherever it runs.

        A machine that sees the path itself with the same files (this one, a shared
        file system) uses it in place; any other gets a copy, and a later
        %dist_sync sends only the files whose content changed (and removes those
        deleted). The paths go first on the ranks' sys.path, the first given
        first, and %dist_run of a script under one runs the copy. Left out: .git, __pycache__, *.pyc,
        .ipynb_checkpoints, .venv, venv, node_modules and tool caches, and what
        --exclude names; more than 1 GiB (or 100,000 files) is refused. A restart syncs the paths
        again; %dist_stop removes the copies. Modules the ranks imported from a
        changed file are named (--reload reloads them). From a script:
        nbdist.driver.file_sync.sync_files(session, ["src"]). Examples::

            %dist_sync src
            %dist_sync . --exclude 'data/*' --exclude '*.ckpt'
            %dist_sync src --reload
        """
        if asked_for_help(self.dist_sync, line):
            return None
        args = parse_magic_line(self.dist_sync, line)
        session = self.dist.running_session()
        if not args.paths:
            raise UsageError("%dist_sync needs a directory or file, e.g. %dist_sync src")
        from nbdist.driver.file_sync import sync_files

        try:
            report = sync_files(
                session, args.paths, exclude=args.exclude, copy=args.copy, reload=args.reload
            )
        except NbdistError as exc:
            raise UsageError(str(exc)) from None
        print(report)
        _record_sync(session, args.paths, cell_name(self.shell))
        return None

    @line_magic
    def dist_run(self, line=""):
        """Run a torchrun-style script on every rank, as ``__main__`` with its own arguments.

        Output streams like a cell's; an error on any rank fails it. Inside the
        script, ``init_process_group`` is served by the group nbdist formed and
        ``destroy_process_group()`` leaves it up; the torchrun variables (RANK,
        LOCAL_RANK, WORLD_SIZE, TORCHELASTIC_RUN_ID, ...) are set. As with
        ``python script.py`` in the notebook's directory, modules beside the script
        import (an edited one afresh) and relative paths start there. Its globals
        stay on the ranks for the next cell, also after ``sys.exit(main())`` or an
        error (copied, as IPython's ``%run`` does). ``--timeout S`` (before the
        script) interrupts the ranks after S seconds. Examples::

            %dist_run train.py --epochs 2 --lr 0.1
            %dist_run --timeout 600 scripts/pretrain.py --config small.yaml
        """
        if asked_for_help(self.dist_run, line, anywhere=False):  # the rest is the script's
            return None
        timeout, script, args = split_run_line(line)
        path = os.path.abspath(os.path.expanduser(script))
        if os.path.isdir(path):
            raise UsageError(
                f"%dist_run: {script!r} is a directory: give the path of a script in it, "
                f"e.g. %dist_run {os.path.join(script, 'train.py')}"
            )
        if not os.path.isfile(path):
            raise UsageError(
                f"%dist_run: no file {script!r} (looked for {path}): give the path of a script"
            )
        _check_python(script, path)
        cell = (
            "__import__('nbdist.engine.scripts', fromlist=['run_script']).run_script("
            f"{path!r}, {args!r}, get_ipython().user_ns, {os.getcwd()!r})"
        )
        return run_on_ranks(self.dist, cell, None, False, timeout)

    @magic_arguments()
    @argument("path", help="the script to write, e.g. train.py")
    @argument("--backend", default=None, help="nccl or gloo in the script (default: by device)")
    @argument("--force", action="store_true", help="overwrite a file %%dist_export did not write")
    @line_magic
    def dist_export(self, line=""):
        """Write this session's %%on_all_ranks cells, in order, as a torchrun script.

        The script gives the cells rank, local_rank, world_size, device, torch,
        dist and nbdist as the ranks had them; nbdist.log writes to the run
        history. Cells marked ``# nbdist: no-export`` (or run with --no-export)
        and failed cells are left out; a cell that is not plain Python is
        commented out. What the script lacks (%dist_push values, --ranks and
        %%on_rank cells) is listed, also as NOTE lines at its top; %dist_sync
        paths and %dist_run scripts go in as on the ranks. A script it wrote before is
        replaced; any other existing file only with --force. Example::

            %dist_export train.py
            !torchrun --nproc_per_node 2 train.py
        """
        if asked_for_help(self.dist_export, line):
            return
        args = parse_magic_line(self.dist_export, line)
        # Checked before anything is written: the script would fail at its start.
        if args.backend is not None and args.backend.lower() not in BACKENDS:
            raise UsageError(
                f"--backend {args.backend!r}: use one of {', '.join(BACKENDS)} "
                "(or leave it out: nccl with GPUs, gloo without)"
            )
        session = self.dist.session
        if session is None:
            raise UsageError("nothing to export: %dist_start, then run %%on_all_ranks cells")
        if not args.force and _someone_elses(args.path):
            raise UsageError(
                f"%dist_export {args.path!r}: the file exists and was not written by %dist_export: "
                "choose another name, or add --force to overwrite it"
            )
        from nbdist.driver.export import settle

        running = settle(session)  # --noblock cells that succeeded since
        try:
            path = session.export(args.path, backend=args.backend)
        except NbdistError as exc:
            raise UsageError(str(exc)) from None
        except OSError as exc:  # a missing directory, no permission: the path is the problem
            raise UsageError(
                f"%dist_export {args.path!r}: cannot write it ({exc.strerror}): "
                "choose a path in a directory you can write"
            ) from None
        print(_export_report(session, path))
        if running:
            print(
                f"  - {running} --noblock cell(s) still running: left out (exported once they "
                "succeeded: %dist_export again then)"
            )
