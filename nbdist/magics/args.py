"""Kernel side: how nbdist's magics read their lines; bad input becomes IPython's UsageError.

Shared by every module of :mod:`nbdist.magics`, so every magic words a bad line
the same way: the flags several magics take (``--ranks``, ``--noblock``, a cell's
``--timeout``) are declared here once, and :class:`SessionMagics` is the base of
every group of magics that reaches the session of :class:`~nbdist.magics.lifecycle.DistMagics`.
Every magic answers ``--help`` with the help ``%magic?`` shows
(:func:`asked_for_help`), and a line argparse refuses points to that help.
"""

from __future__ import annotations

import inspect
import re

from IPython.core.error import UsageError
from IPython.core.magic import Magics
from IPython.core.magic_arguments import argument
from IPython.utils.process import arg_split

from nbdist.errors import PlacementError
from nbdist.launch.values import parse_seconds

__all__ = [
    "CELL_TIMEOUT",
    "NOBLOCK",
    "RANKS",
    "SessionMagics",
    "asked_for_help",
    "magic_name",
    "line_words",
    "parse_magic_line",
    "seconds",
]

# Only the long form: "-h" may be an expression (%dist_diff -h) or a stray word a refusal should name.
HELP_WORDS = ("--help",)
# argparse's refusal of a flag whose value it took for another option.
_NO_VALUE = re.compile(r"argument (--[\w-]+): expected one argument")

# Flags several magics share, declared once (each magic's help lists them).
RANKS = argument("--ranks", default=None, help="ranks: 0,2 or 0-3 (default: all)")
NOBLOCK = argument("--noblock", action="store_true", help="return at once; .wait() on the result")
CELL_TIMEOUT = argument(
    "--timeout", default=None, help="interrupt the ranks after this many seconds (default: none)"
)


def seconds(text: str, flag: str = "--timeout") -> float:
    """``text`` as seconds (e.g. '90', '1.5'); a UsageError naming it and ``flag`` otherwise."""
    try:
        return parse_seconds(text, flag)
    except PlacementError as exc:
        raise UsageError(str(exc)) from None


def magic_name(magic) -> str:
    """How a user types ``magic`` (a bound magic method): ``%dist_start``, ``%%on_all_ranks``."""
    owner = getattr(magic, "__self__", None)
    cells = getattr(owner, "magics", {}).get("cell", {})
    return ("%%" if magic.__name__ in cells else "%") + magic.__name__


def asked_for_help(magic, line: str, anywhere: bool = True) -> bool:
    """True, after printing ``magic``'s help (what ``%magic?`` shows), if ``line`` asks for it.

    ``--help`` as a word of the line (``anywhere``), or as the whole
    line, for magics whose line is passed on (a script's arguments, an expression).
    """
    words = line.split() if anywhere else [line.strip()]
    if not any(word in HELP_WORDS for word in words):
        return False
    print(inspect.getdoc(magic))
    return True


def line_words(line: str) -> list[str]:
    """A magic's line in words: quotes group words, and a word quoted whole loses them.

    IPython's own split (``parse_argstring``) keeps them: ``--name "train1"`` would
    name ``"train1"``, a path with a space could not be given at all. Its split is
    kept otherwise, unlike a shell's: a backslash (``C:\\data``) and a quote inside a
    word (``/tmp/o'brien``) stay as typed.
    """
    try:
        words = arg_split(line, strict=True)
    except ValueError as exc:  # the line's quotes do not close
        raise UsageError(f"could not parse {line!r} ({exc}): close the quotes") from None
    return [_unquoted(word) for word in words]


def _unquoted(word: str) -> str:
    if len(word) >= 2 and word[0] == word[-1] and word[0] in "'\"":
        return word[1:-1]
    return word


def parse_magic_line(magic, line: str):
    """``line`` parsed by ``magic``'s declared arguments; bad input is a UsageError."""
    words = line_words(line)
    try:
        return magic.parser.parse_args(words)
    except UsageError as exc:  # argparse's words: add which value, and where the help is
        message = str(exc)
        missing = _NO_VALUE.match(message)
        if missing:
            after = re.search(re.escape(missing.group(1)) + r"\s+(-\S+)", line)
            if after:
                message += f" ({after.group(1)!r} starts with '-', so it reads as an option)"
        raise UsageError(f"{message}; see {magic_name(magic)}? for its arguments") from None
    except SystemExit as exc:  # argparse's own exit on bad input
        raise UsageError(f"could not parse {line!r}: see the magic's help (?)") from exc


class SessionMagics(Magics):
    """Magics that reach nbdist's session through its :class:`~nbdist.magics.lifecycle.DistMagics`."""

    def __init__(self, shell, dist_magics):
        """Magics for ``shell`` that use ``dist_magics.session`` and ``dist_magics.running_session()``."""
        super().__init__(shell)
        self.dist = dist_magics
