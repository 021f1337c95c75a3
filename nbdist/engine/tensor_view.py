"""Rank side: how a debugger attached to this rank shows torch tensors.

debugpy (pydevd inside it) shows a variable by its ``repr``, and a tensor's
``repr`` tells neither its shape nor, for a float32 tensor, its dtype, and
prints a large one in part only after formatting it. :func:`show_tensors` adds a
presentation for ``torch.Tensor`` (``nn.Parameter`` and other subclasses too)
to the debugpy running in this process:

- the value: shape, dtype, device, and the values of a small tensor
  (at most :data:`SMALL` elements) on one line, e.g.
  ``(2, 3) float32 cpu [[0., 1., 2.], [3., 4., 5.]]``;
- expanded: ``shape``, ``dtype``, ``device``, ``requires_grad``, ``grad``, and
  ``values`` (a nested list) for a small tensor.

A DTensor shows its global shape and placements and only its local shard's
values: the whole tensor would need a collective, which would wait for ranks
that may be paused. JupyterLab's debugger on the ranks and ``%dist_debugpy``
both get it (:func:`nbdist.engine.debugpy_server.listen` calls :func:`show_tensors`).
Nothing here imports torch: a tensor exists only once torch is imported.
"""

from __future__ import annotations

import re
import sys

__all__ = ["SMALL", "describe", "show_tensors"]

# Tensors with at most this many elements show their values (formatting a large one
# costs time at every stop, and a GPU tensor's values are a device-to-host copy).
SMALL = 100

_registered: list[bool] = [False]


def _is_tensor(type_object) -> bool:
    torch = sys.modules.get("torch")
    return (
        torch is not None
        and isinstance(type_object, type)
        and issubclass(type_object, torch.Tensor)
    )


def _local(tensor):
    # A DTensor's values on this rank, without a collective.
    to_local = getattr(tensor, "to_local", None)
    return (
        (to_local(), True)
        if callable(to_local) and hasattr(tensor, "placements")
        else (tensor, False)
    )


def _values_text(tensor) -> str | None:
    # torch's own formatting of the values, on one line: "[[0., 1.], [2., 3.]]".
    text = repr(tensor.detach())
    start = text.find("(") + 1
    depth, end = 0, None
    for i in range(start, len(text)):
        if text[i] == "[":
            depth += 1
        elif text[i] == "]":
            depth -= 1
            if depth == 0:
                end = i + 1
                break
        elif depth == 0 and text[i] in ",)":
            end = i  # a 0-d tensor: its one number
            break
    if end is None:
        return None
    return re.sub(r"\s+", " ", text[start:end]).strip()


def describe(tensor) -> str:
    """One line for ``tensor``: shape, dtype, device, and its values when it is small."""
    local, sharded = _local(tensor)
    parts = [str(tuple(tensor.shape)), str(tensor.dtype).removeprefix("torch."), str(tensor.device)]
    if sharded:
        parts.append(f"placements={tuple(tensor.placements)}")
    if tensor.requires_grad:
        parts.append("requires_grad")
    strided = local.layout is sys.modules["torch"].strided
    if local.numel() <= SMALL and strided and not local.is_meta:
        values = _values_text(local)
        if values is not None:
            parts.append(f"local shard {values}" if sharded else values)
    return " ".join(parts)


class _TensorStr:
    """debugpy's StrPresentationProvider for tensors."""

    def can_provide(self, type_object, type_name):
        return _is_tensor(type_object)

    def get_str(self, val):
        try:
            return describe(val)
        except Exception:  # noqa: BLE001 - a view must not break the debugger: plain repr
            return repr(val)


class _TensorChildren:
    """debugpy's TypeResolveProvider for tensors: what expanding one shows."""

    def can_provide(self, type_object, type_name):
        return _is_tensor(type_object)

    def get_dictionary(self, obj):
        local, sharded = _local(obj)
        found = {
            "shape": tuple(obj.shape),
            "dtype": obj.dtype,
            "device": obj.device,
            "requires_grad": obj.requires_grad,
            "grad": obj.grad if obj.is_leaf else None,
        }
        if sharded:
            found["placements"] = tuple(obj.placements)
        try:
            if local.numel() <= SMALL and not local.is_meta:
                found["local shard" if sharded else "values"] = local.detach().cpu().tolist()
        except Exception:  # noqa: BLE001 - sparse, quantized...: no values, the rest stands
            pass
        return found

    def resolve(self, obj, attribute):
        return self.get_dictionary(obj).get(attribute)


def show_tensors() -> bool:
    """Make the debugpy running in this process show tensors as :func:`describe` does.

    Once per process; False when debugpy's debugger (pydevd) is not loaded here.
    """
    if _registered[0]:
        return True
    try:
        from _pydevd_bundle import pydevd_extension_utils
        from _pydevd_bundle.pydevd_extension_api import (
            StrPresentationProvider,
            TypeResolveProvider,
        )
    except ImportError:
        return False
    # First in debugpy's own lists (their contents are what it asks, in order).
    pydevd_extension_utils.extensions_of_type(StrPresentationProvider).insert(0, _TensorStr())
    pydevd_extension_utils.extensions_of_type(TypeResolveProvider).insert(0, _TensorChildren())
    _registered[0] = True
    return True
