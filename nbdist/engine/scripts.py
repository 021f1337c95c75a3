"""Rank side: run a torchrun-style script on this rank, as ``__main__``, with its own arguments.

What ``%dist_run script.py args`` does on each rank, as ``python script.py args``
would: ``sys.argv`` becomes ``[script, *args]`` for the run (then ``['-c']``
again), the script's directory comes first on ``sys.path`` (a module beside it
imports; one edited since an earlier run is read again), the working directory
is the notebook's (where it exists on this machine), and the script runs as
``__main__`` (its ``if __name__ == "__main__":`` block included). Its globals
are then copied into the rank's namespace for the next cell, as IPython's
``%run`` does: also when it ends with ``sys.exit(main())`` or raises (what it had
made is there to inspect). Its own functions keep reading the script's globals.
A script that ends with ``sys.exit(0)`` (or ``sys.exit()``) succeeded; any
other exit status, argparse's 2 included, fails the cell with :class:`ScriptExit`.
``exit(n)`` and ``quit(n)`` in the script do what they do under ``python``: the
``sys.exit(n)`` above (IPython hides those builtins while a cell runs, which made
them a ``NameError`` in a script on a rank).
"""

from __future__ import annotations

import builtins
import os
import sys
import tokenize
import types

from nbdist.engine.synced_files import local_path
from nbdist.engine.torchrun_env import CELL_ARGV

__all__ = ["ScriptExit", "run_script"]


class ScriptExit(RuntimeError):
    """The script called ``sys.exit`` with a failure status."""


class _Exit:
    """``exit``/``quit`` as a script run by ``python`` has them (the site module's), but
    leaving ``sys.stdin`` open: the rank reads ``input()`` on after the script."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return f"Use {self.name}() to exit the script"

    def __call__(self, code=None):
        raise SystemExit(code)


def run_script(path: str, args: list[str], namespace: dict, cwd: str | None = None) -> None:
    """Run ``path`` with ``sys.argv = [path, *args]``; its globals land in ``namespace``.

    ``cwd``: the notebook's working directory, the script's for the run where this
    machine has it. A script under a path ``%dist_sync`` copied to this machine runs
    from the copy.
    """
    path = local_path(path)
    folder = os.path.dirname(os.path.abspath(path))
    with tokenize.open(path) as f:  # its coding cookie honoured, as Python does
        code = compile(f.read(), path, "exec", dont_inherit=True)
    module = types.ModuleType("__main__")
    module.__dict__.update(__file__=path, __builtins__=builtins, __cached__=None)
    module.__dict__.update(exit=_Exit("exit"), quit=_Exit("quit"))
    main, here = sys.modules.get("__main__"), os.getcwd()
    _forget_edited_modules(folder)
    sys.argv[:] = [path, *args]
    sys.path.insert(0, folder)
    sys.modules["__main__"] = module  # what pickle finds for the script's classes meanwhile
    if cwd and cwd != here and os.path.isdir(cwd):
        os.chdir(cwd)
    try:
        exec(code, module.__dict__)
    except SystemExit as exc:
        if exc.code not in (0, None):
            raise ScriptExit(f"{path} exited with status {exc.code!r} (sys.exit)") from None
    finally:
        sys.argv[:] = CELL_ARGV
        if sys.path and sys.path[0] == folder:
            del sys.path[0]
        if main is not None:
            sys.modules["__main__"] = main
        if os.getcwd() != here:
            os.chdir(here)
        _note_modules(folder)
        # The script's exit and quit stay behind: the rank's own fail a cell, not end the rank.
        namespace.update(
            {
                k: v
                for k, v in module.__dict__.items()
                if not k.startswith("__") and not isinstance(v, _Exit)
            }
        )


# Modules imported through a script's folder: their file's modification time after its run.
_beside: dict[str, float] = {}


def _modules_beside(folder: str):
    """(name, file, mtime) of the modules imported through ``folder``: a package or file
    directly in it; never nbdist's own (a checkout's script folder may hold the package)."""
    for name, module in list(sys.modules.items()):
        top = name.partition(".")[0]
        file = getattr(module, "__file__", None)
        if top == "nbdist" or not isinstance(file, str):
            continue
        relative = os.path.relpath(os.path.abspath(file), folder)
        if relative != f"{top}.py" and not relative.startswith(top + os.sep):
            continue
        try:
            yield name, file, os.stat(file).st_mtime
        except OSError:
            continue


def _forget_edited_modules(folder: str) -> None:
    # ``python script.py`` imports the modules beside it afresh each time; a rank keeps
    # what an earlier run imported, and ran a module edited since as it was then.
    for name, file, mtime in _modules_beside(folder):
        if _beside.get(file, mtime) != mtime:
            del sys.modules[name]


def _note_modules(folder: str) -> None:
    for _name, file, mtime in _modules_beside(folder):
        _beside[file] = mtime
