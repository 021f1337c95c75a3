"""Kernel side: how nbdist's magics read their lines; bad input becomes IPython's UsageError.

Shared by :mod:`nbdist.magics` and :mod:`nbdist.script_magics`, so every magic
words a bad line the same way.
"""

from __future__ import annotations

from IPython.core.error import UsageError
from IPython.core.magic import Magics
from IPython.core.magic_arguments import parse_argstring

from nbdist.errors import PlacementError
from nbdist.launch.values import parse_seconds

__all__ = ["SessionMagics", "parse_magic_line", "seconds"]


def seconds(text: str) -> float:
    """``text`` as seconds (e.g. '90', '1.5'); a UsageError naming it otherwise."""
    try:
        return parse_seconds(text)
    except PlacementError as exc:
        raise UsageError(str(exc)) from None


def parse_magic_line(magic, line: str):
    """``line`` parsed by ``magic``'s declared arguments; bad input is a UsageError."""
    try:
        return parse_argstring(magic, line)
    except UsageError:
        raise
    except SystemExit as exc:  # argparse's own exit on bad input
        raise UsageError(f"could not parse {line!r}: see the magic's help (?)") from exc
    except ValueError as exc:  # the line's quotes do not close
        raise UsageError(f"could not parse {line!r} ({exc}): close the quotes") from None


class SessionMagics(Magics):
    """Magics that reach nbdist's session through its :class:`~nbdist.magics.DistMagics`."""

    def __init__(self, shell, dist_magics):
        """Magics for ``shell`` that use ``dist_magics.session`` and ``dist_magics.run_on_ranks``."""
        super().__init__(shell)
        self.dist = dist_magics
