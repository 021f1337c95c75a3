"""Kernel side: a name's value pulled from the ranks, and why one may not come back.

A value reaches the kernel pickled; its class must be importable here too. One
defined in a cell that ran on the ranks (a dataclass in ``%%on_all_ranks``), or
from a module only the ranks have, cannot be unpickled: the pull then fails at
once (see :func:`nbdist.driver.ipp_internals.fail_undecodable_replies`) with
the ranks, the name, the value's type as the ranks see it, why, and what to do.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from nbdist.errors import RankError, UnpicklableValue, format_ranks

__all__ = ["pull_values"]


def pull_values(on_ranks: Callable, name: str, ranks) -> list:
    """The value of ``name`` on each rank of ``ranks``, in rank order.

    ``on_ranks(ranks, send)``: sends ``send(view)`` to those ranks and waits, as
    ``DistSession._on_ranks`` does. Raises :class:`UnpicklableValue` when the
    kernel cannot unpickle the value of every rank that failed, the
    :class:`RankError` of the ranks otherwise (a name that is not defined).
    """
    try:
        return on_ranks(ranks, lambda view: view.pull(name, block=False))
    except RankError as exc:
        causes = {
            f.rank: UnpicklableValue.cause_in(f.evalue)
            for f in exc.failures
            if f.ename == UnpicklableValue.__name__
        }
        if not causes or len(causes) != len(exc.failures):
            raise
        types = _type_names(on_ranks, name, sorted(causes))
        raise UnpicklableValue(next(iter(causes.values())), _explain(name, causes, types)) from None


def _type_names(on_ranks: Callable, name: str, ranks: Sequence[int]) -> dict[int, str]:
    # Asked of the ranks: the class is theirs, and its name is plain text the kernel can read.
    expression = f"(lambda t: t.__module__ + '.' + t.__qualname__)(type({name}))"
    try:
        names = on_ranks(list(ranks), lambda view: view.pull(expression, block=False))
    except Exception:  # noqa: BLE001 - the pull's own error matters more than the type's name
        return {}
    return dict(zip(ranks, names))


def _explain(name: str, causes: dict[int, str], types: dict[int, str]) -> str:
    groups: dict[tuple[str, str], list[int]] = {}
    for rank, cause in sorted(causes.items()):
        groups.setdefault((types.get(rank, "value of unknown type"), cause), []).append(rank)
    fix = UnpicklableValue.fix.format(send="pull")
    if len(groups) == 1:
        ((type_name, cause), ranks) = next(iter(groups.items()))
        return (
            f"cannot pull {name!r}: on {format_ranks(ranks)} it is a {type_name}, which the "
            f"kernel cannot unpickle ({cause}); only the ranks know its class: {fix}"
        )
    lines = [f"cannot pull {name!r}: the kernel cannot unpickle it"]
    lines += [f"  {format_ranks(r)}: a {t} ({c})" for (t, c), r in groups.items()]
    lines.append(f"only the ranks know its class: {fix}")
    return "\n".join(lines)
