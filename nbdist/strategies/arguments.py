"""Rank side: the argument checks that the strategies, optimizers and planners share.

Each check runs before any collective or change to the model, so a bad value
raises alike on every rank and leaves nothing half done. Its message names
the function, the argument, what it got, and what to write instead.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable

import torch
from torch import nn

__all__ = [
    "as_dtype",
    "layer_names",
    "require_builder",
    "require_module",
    "require_numbers",
    "require_optimizer",
    "require_params",
    "require_whole",
]

_DTYPES = {
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
    "half": torch.float16,
    "fp32": torch.float32,
    "float32": torch.float32,
    "float": torch.float32,
}


def require_module(model, caller: str, arg: str = "model") -> None:
    """Refuse what is no ``nn.Module`` instance: a class, a state_dict, anything else."""
    if isinstance(model, nn.Module):
        return
    if isinstance(model, type):
        got = f"{model.__name__} is a class: pass the model you built, e.g. {model.__name__}(...)"
    elif isinstance(model, dict):
        got = "got a dict (a state_dict?): pass the module itself"
    else:
        got = f"got {type(model).__name__}"
    raise TypeError(f"{caller}: {arg} must be a torch.nn.Module; {got}")


def require_builder(build, caller: str, arg: str = "build_model") -> None:
    """Refuse a model where a function that builds one goes (the planners build it afresh)."""
    if isinstance(build, nn.Module):
        name = type(build).__name__
        raise TypeError(
            f"{caller}: {arg} must build the model (it is called once per layout, for fresh "
            f"weights), got a {name} instance: pass the class or a function, e.g. "
            f"{arg}=lambda: {name}(...)"
        )
    if not callable(build):
        raise TypeError(
            f"{caller}: {arg} must be a function that builds the model, got {type(build).__name__}"
        )


def require_params(params, caller: str) -> None:
    """Refuse the model where its parameters go (``LAMB(model)`` for ``LAMB(model.parameters())``)."""
    if isinstance(params, nn.Module):
        raise TypeError(
            f"{caller}: params takes the model's parameters, got the {type(params).__name__} "
            "model itself: pass model.parameters() (or a list of parameter groups)"
        )


def require_optimizer(optimizer, caller: str) -> None:
    """Refuse what is no ``torch.optim.Optimizer`` (a model, an optimizer class)."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        got = (
            f"the class {optimizer.__name__}: build it first, e.g. {optimizer.__name__}(model.parameters())"
            if isinstance(optimizer, type)
            else f"a {type(optimizer).__name__}"
        )
        raise TypeError(f"{caller}: optimizer must be a torch.optim.Optimizer, got {got}")


def require_numbers(caller: str, **values) -> None:
    """Refuse text (``"8"`` from a config file) or another non-number given for a number.

    Ranges are each caller's to check; this only makes sure the comparison can run
    and that its failure names the argument.
    """
    for arg, value in values.items():
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            hint = ""
            if isinstance(value, str):
                whole = value.strip().removeprefix("-").isdigit()
                hint = f", e.g. {arg}={'int' if whole else 'float'}({value!r})"
            raise TypeError(
                f"{caller}: {arg}={value!r} is {type(value).__name__}, not a number: "
                f"pass a number{hint}"
            )


def require_whole(caller: str, **values) -> None:
    """Refuse what is no whole number given for a count (``n_stages=2.5``, ``"8"``).

    NumPy's integers are whole numbers too; ranges are each caller's to check.
    """
    require_numbers(caller, **values)
    for arg, value in values.items():
        if not isinstance(value, numbers.Integral):
            example = int(value) if math.isfinite(value) and value >= 1 else 1
            raise TypeError(
                f"{caller}: {arg}={value!r} is no whole number: pass a count, e.g. {arg}={example}"
            )


def layer_names(value: Iterable[str], arg: str, caller: str) -> list[str]:
    """``value`` as a list of submodule names; one string (``"fc1"``) is refused, not split."""
    if isinstance(value, str):
        raise TypeError(
            f"{caller}: {arg}={value!r} is one string; give a list of layer names, "
            f"e.g. {arg}=[{value!r}]"
        )
    try:
        names = list(value)
    except TypeError:
        raise TypeError(
            f"{caller}: {arg} takes a list of layer names, got {type(value).__name__}"
        ) from None
    for name in names:
        if not isinstance(name, str):
            raise TypeError(
                f"{caller}: {arg} holds {type(name).__name__} {name!r}; give the layers' names "
                f"as model.named_modules() lists them, e.g. {arg}=['mlp.up']"
            )
    return names


def as_dtype(value, arg: str, caller: str) -> torch.dtype | None:
    """A torch dtype from ``torch.bfloat16`` or its short name (``"bf16"``); None stays None."""
    # FSDP computes and reduces gradients in it: an integer dtype fails deep in torch.
    if value is None or (isinstance(value, torch.dtype) and value.is_floating_point):
        return value
    if isinstance(value, str) and value.lower().removeprefix("torch.") in _DTYPES:
        return _DTYPES[value.lower().removeprefix("torch.")]
    raise TypeError(
        f"{caller}: {arg}={value!r} is no floating dtype; give torch.bfloat16, torch.float16 "
        "or torch.float32 (or 'bf16', 'fp16', 'fp32')"
    )
