"""Rank side: parallel strategies, optimizers and planning tools, each importable with torch alone.

The modules run on the ranks (in ``%%on_all_ranks`` cells) and import neither
IPython, ipyparallel nor the dashboard. They are grouped by kind:

- :mod:`nbdist.strategies.parallel`: one module per way of spreading a model
  over ranks (DDP helpers, FSDP2, ZeRO, DeepSpeed, Horovod, tensor, sequence,
  context and pipeline parallel, activation checkpointing, the device mesh), each
  a short ``apply_*`` function, and :func:`~nbdist.strategies.parallel.parallelize.parallelize`,
  the one place that composes tensor parallel, activation checkpointing, FSDP2
  and pipeline parallel in that fixed order;
- :mod:`nbdist.strategies.optim`: optimizers (LARS, LAMB, 1-bit Adam and LAMB),
  large-batch schedules, compressed gradient communication;
- :mod:`nbdist.strategies.plan`: choosing a layout (``autoplan``), building one
  (``plan.build``), training one model under several strategies and measuring
  each (``compare``);
- :mod:`nbdist.strategies.training`: pieces that combine with any strategy
  (mixed precision, ``torch.compile``, sparse attention, evaluation, everyday chores);
- :mod:`nbdist.strategies.teaching`: data parallelism written by hand, to read;
- :mod:`nbdist.strategies.measure`: bytes communicated and peak memory of a step,
  used by all of the above.
- :mod:`nbdist.strategies.arguments`: the argument checks all of the above share (a
  model that is a module, layer names as a list, numbers that are numbers), run
  before any collective or change to the model.

The planning entry points are reachable from here, imported on first use so that
``import nbdist.strategies`` stays cheap::

    from nbdist.strategies import autoplan, compare, parallelize
"""

from __future__ import annotations

import importlib

__all__ = ["autoplan", "compare", "parallelize"]

# Name -> the module that defines it; imported when first asked for.
_LAZY = {
    "autoplan": "nbdist.strategies.plan.autoplan",
    "compare": "nbdist.strategies.plan.compare",
    "parallelize": "nbdist.strategies.parallel.parallelize",
}


def __getattr__(name: str):
    """``autoplan``, ``compare`` and ``parallelize``, imported when first used."""
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'nbdist.strategies' has no attribute {name!r}")


def __dir__() -> list[str]:
    """The module's names, the lazy ones included."""
    return sorted(set(globals()) | set(__all__))
