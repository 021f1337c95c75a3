"""Rank side: the user's pipeline schedules whose last step was cut short.

torch.distributed.pipelining's schedules keep the losses of a step's micro-batches
(``_internal_losses``, torch 2.13) and clear them only where the step ends: a step cut short
(an interrupt, a rank released from its sends or receives) leaves them, and the schedule's
next steps fail on the last stage with torch's own words, which do not say why: ``Expecting 4
losses but got 5``, or ``Failed to run stage backward ... Output gradient: None`` where it took
a kept loss for its first micro-batch's (2 CPU ranks, a two-stage ``ScheduleGPipe``: the
next step failed after 4 and after 6 of 6 interrupts in two runs). A new schedule over new
stages runs. :func:`cut_short` names such schedules when the group is formed again after the
cell (:func:`nbdist.engine.bootstrap.rejoin`), so the cell's note can say so.
"""

from __future__ import annotations

import sys

from nbdist.engine.user_variables import one_level_in, user_variables

__all__ = ["cut_short"]


def cut_short(namespace: dict) -> list[tuple[str, str]]:
    """``(name, schedule class)`` for each schedule among ``namespace``'s variables (and one
    level in) that holds losses of a step that did not end; [] where torch's pipelining is
    not imported."""
    module = sys.modules.get("torch.distributed.pipelining.schedules")
    base = getattr(module, "_PipelineSchedule", None)
    if base is None:
        return []

    def cut(value) -> bool:
        try:
            return isinstance(value, base) and bool(getattr(value, "_internal_losses", None))
        except Exception:  # a user's object whose attributes raise: not ours to judge
            return False

    found = []
    for name, value in user_variables(namespace):
        if cut(value):
            found.append((name, type(value).__name__))
            continue
        found += [(name + suffix, type(v).__name__) for suffix, v in one_level_in(value) if cut(v)]
    return found
