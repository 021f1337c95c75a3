"""Rank side: run a torchrun-style script on this rank, as ``__main__``, with its own arguments.

What ``%dist_run script.py args`` does on each rank: ``sys.argv`` becomes
``[script, *args]`` for the run (then ``['-c']`` again), the script runs as
``__main__`` (its ``if __name__ == "__main__":`` block included), and its
globals are copied into the rank's namespace for the next cell. A script that
ends with ``sys.exit(0)`` (or ``sys.exit()``) succeeded; any other exit status,
argparse's 2 included, fails the cell with :class:`ScriptExit`.
"""

from __future__ import annotations

import runpy
import sys

from nbdist.engine.synced_files import local_path
from nbdist.engine.torchrun_env import CELL_ARGV

__all__ = ["ScriptExit", "run_script"]


class ScriptExit(RuntimeError):
    """The script called ``sys.exit`` with a failure status."""


def run_script(path: str, args: list[str], namespace: dict) -> None:
    """Run ``path`` with ``sys.argv = [path, *args]``; its globals land in ``namespace``.

    A script under a path ``%dist_sync`` copied to this machine runs from the copy.
    """
    path = local_path(path)
    sys.argv[:] = [path, *args]
    found: dict = {}
    try:
        found = runpy.run_path(path, run_name="__main__")
    except SystemExit as exc:
        if exc.code not in (0, None):
            raise ScriptExit(f"{path} exited with status {exc.code!r} (sys.exit)") from None
    finally:
        sys.argv[:] = CELL_ARGV
    namespace.update({k: v for k, v in found.items() if not k.startswith("__")})
