"""Rank side: the user's variables in a rank's namespace, and one level inside each.

What nbdist tells a user to make again after the group is formed again (objects holding the
old group: :mod:`nbdist.engine.group_bound`; pipeline schedules whose step was cut short:
:mod:`nbdist.engine.pipeline_schedules`) is looked for among the variables a cell made, and
one level inside them: a notebook's own trainer object (``trainer.model``), a dict or list of
models, a tuple a helper returned (``stage, schedule = ...``).
"""

from __future__ import annotations

import itertools
import types

__all__ = ["one_level_in", "user_variables"]

# IPython's own names in a namespace: never the user's objects.
_IPYTHON_NAMES = frozenset({"In", "Out", "exit", "quit", "get_ipython"})
# Entries looked at inside one variable: a list of a million tensors is not walked.
_INNER_LIMIT = 64


def user_variables(namespace: dict) -> list[tuple[str, object]]:
    """``(name, value)`` for the namespace's variables but private (``_x``) and IPython's."""
    return [
        (name, value)
        for name, value in list(namespace.items())
        if not name.startswith("_") and name not in _IPYTHON_NAMES
    ]


def one_level_in(value) -> list[tuple[str, object]]:
    """``(suffix, value)`` one level inside a dict, list, tuple or plain object; the first 64.

    Modules (Python's and torch's) and classes are not entered: their attributes are
    their machinery, and torch modules are judged whole.
    """
    import torch

    if isinstance(value, dict):
        items = ((f"[{key!r}]", inner) for key, inner in value.items())
    elif isinstance(value, (list, tuple)):
        items = ((f"[{index}]", inner) for index, inner in enumerate(value))
    elif isinstance(value, (types.ModuleType, type, torch.nn.Module)):
        return []
    else:
        attributes = getattr(value, "__dict__", None)
        if not isinstance(attributes, dict):
            return []
        items = ((f".{key}", inner) for key, inner in attributes.items() if key[:1] != "_")
    try:
        return list(itertools.islice(items, _INNER_LIMIT))
    except Exception:  # a container that changes or raises while read
        return []
