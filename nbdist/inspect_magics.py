"""Kernel side: %dist_diff (which ranks' values differ) and other magics that look at the ranks' state.

Registered by :func:`nbdist.magics.register`; each magic parses its line and
calls the library (:mod:`nbdist.driver.diff`).
"""

from __future__ import annotations

import re

from IPython.core.error import UsageError
from IPython.core.magic import Magics, line_magic, magics_class

from nbdist.errors import PlacementError

__all__ = ["InspectMagics", "split_diff_line"]

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


@magics_class
class InspectMagics(Magics):
    """Magics that reach the session through nbdist's :class:`~nbdist.magics.DistMagics`."""

    def __init__(self, shell, dist_magics):
        """Magics for ``shell`` that use ``dist_magics.session`` and ``dist_magics.run_on_ranks``."""
        super().__init__(shell)
        self.dist = dist_magics

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
        from nbdist.driver.diff import compare

        expr, ranks, ref = split_diff_line(line)
        session = self.dist.session
        if session is None or not session.running:
            raise UsageError(
                "no nbdist cluster is running: start one with %dist_start (e.g. %dist_start 2)"
            )
        try:
            result = compare(session, expr, ranks, ref)
        except PlacementError as exc:
            raise UsageError(str(exc)) from None
        except SyntaxError as exc:
            raise UsageError(f"%dist_diff {expr!r} is not a Python expression: {exc.msg}") from None
        print(result.report())
