"""Rank side: activation checkpointing: keep a block's inputs, recompute its insides during backward.

Autograd normally keeps every intermediate activation of the forward pass
until backward. Wrapping a block in :class:`Checkpointed` (what
:func:`apply_ac` does) keeps only the block's input and runs the block's
forward a second time in backward: activation memory drops from "all layers"
to "one block + the block inputs", for roughly one extra forward (~30 % more
compute). Use it when activations, not weights, fill the device (long
sequences, big batches, deep models). Gradients are unchanged.

Example (on every rank)::

    from nbdist.strategies.parallel.checkpointing import apply_ac, saved_activation_bytes
    apply_ac(model, blocks=Block)            # every Block recomputes in backward
    with saved_activation_bytes() as saved:
        loss = model(x).sum()
    print(saved.bytes)                       # what autograd keeps for backward
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

__all__ = [
    "Checkpointed",
    "SavedBytes",
    "apply_ac",
    "find_blocks",
    "local_tensors",
    "saved_activation_bytes",
]


class Checkpointed(nn.Module):
    """``block`` whose activations are recomputed in backward instead of stored.

    ``state_dict`` keys gain a ``block.`` prefix; parameters are the block's own.
    """

    def __init__(self, block: nn.Module) -> None:
        """Wrap ``block``: its forward is recomputed in backward instead of saved."""
        super().__init__()
        self.block = block

    def forward(self, *args, **kwargs):
        """``block``'s forward, checkpointed when gradients are being recorded."""
        if not torch.is_grad_enabled():
            return self.block(*args, **kwargs)  # nothing would be saved anyway
        # Non-reentrant: works with kwargs, inputs that need no grad, and FSDP/DDP.
        return checkpoint(self.block, *args, use_reentrant=False, **kwargs)


def find_blocks(
    model: nn.Module, blocks, *, caller: str = "find_blocks"
) -> list[tuple[str, nn.Module]]:
    """``(name, submodule)`` for each block of ``model`` that ``blocks`` picks out.

    ``blocks`` is a module class (``Block``) or a tuple of classes: every
    submodule of those types, in ``named_modules()`` order; or one submodule, or
    a list of submodule names (``["layers.0"]``) and/or submodules, in the order
    given. ``model`` itself is never a block. :func:`apply_ac` and
    ``fsdp.apply_fsdp`` choose their units with it; ``caller`` starts the error
    messages, which name what is missing.
    """
    named = [(n, m) for n, m in model.named_modules() if n]
    if isinstance(blocks, type) or (
        isinstance(blocks, tuple) and blocks and all(isinstance(b, type) for b in blocks)
    ):
        found = [(n, m) for n, m in named if isinstance(m, blocks)]
        if not found:
            raise ValueError(
                f"{caller}: the model has no submodule of type {blocks!r}; pass the class of "
                f"its repeated blocks (e.g. blocks=Block)"
            )
        return found
    if isinstance(blocks, nn.Module):
        items = [blocks]
    elif isinstance(blocks, Iterable) and not isinstance(blocks, str):
        items = list(blocks)
    else:
        items = None
    if items is None or not all(isinstance(b, (str, nn.Module)) for b in items):
        raise TypeError(
            f"{caller}: blocks must be a module class (blocks=Block), a tuple of classes, or a "
            f"list of submodule names or submodules; got {blocks!r}"
        )
    by_name = dict(named)
    name_of = {id(m): n for n, m in named}
    found = []
    for b in items:
        if isinstance(b, str):
            if b not in by_name:
                raise ValueError(
                    f"{caller}: no submodule named {b!r}; the model has {sorted(by_name)[:20]}"
                )
            found.append((b, by_name[b]))
        elif id(b) in name_of:
            found.append((name_of[id(b)], b))
        else:
            raise ValueError(
                f"{caller}: a {type(b).__name__} in blocks is not a submodule of the model"
            )
    return found


def apply_ac(model: nn.Module, *, blocks, every: int = 1) -> nn.Module:
    """Wrap submodules of ``model`` in :class:`Checkpointed`, in place; returns ``model``.

    ``blocks`` is a module class (``blocks=Block``), a tuple of classes, or a
    list of submodule names (``["layers.0", "layers.1"]``) or submodules (see
    :func:`find_blocks`). ``every=2`` checkpoints every second matching block
    (a memory/time middle ground).
    """
    from nbdist.strategies.arguments import require_module

    require_module(model, "apply_ac")
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise ValueError(
            f"apply_ac: every must be a whole number >= 1 (1 = every block), got {every!r}"
        )
    done = [name for name, m in model.named_modules() if isinstance(m, Checkpointed)]
    if done:
        # A notebook cell run twice would checkpoint inside checkpoints: every block's
        # forward recomputed once more in backward, for no memory saved.
        raise ValueError(
            f"apply_ac: the model has checkpointed blocks already ({', '.join(done[:3])}"
            f"{', ...' if len(done) > 3 else ''}): apply it once, to a freshly built model"
        )
    names = [name for name, _ in find_blocks(model, blocks, caller="apply_ac")]
    # A block nested in another chosen block is already covered by its parent.
    names = [n for n in names if not any(n.startswith(p + ".") for p in names if p != n)]
    for i, name in enumerate(names):
        if i % every:
            continue
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, attr, Checkpointed(getattr(parent, attr)))
    return model


def local_tensors(t: torch.Tensor):
    """The tensors that own ``t``'s memory on this rank: ``t`` itself, or for a DTensor (or
    another wrapper subclass, which owns no storage) its inner local tensors."""
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    if is_traceable_wrapper_subclass(t):
        names, _ = t.__tensor_flatten__()
        for name in names:
            inner = getattr(t, name)
            if hasattr(inner, "untyped_storage"):
                yield from local_tensors(inner)
    else:
        yield t


class SavedBytes:
    """What :func:`saved_activation_bytes` counted: ``bytes`` and ``tensors`` (distinct storages)."""

    def __init__(self) -> None:
        """Nothing counted yet."""
        self.bytes = 0
        self.tensors = 0
        self._seen: set[int] = set()

    def exclude(self, t: torch.Tensor) -> None:
        """Never count ``t``'s storage (a parameter: saved by autograd, but not an activation)."""
        for local in local_tensors(t):
            self._seen.add(local.untyped_storage().data_ptr())

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        """The saved-tensor hook: count ``t``'s storage once, keep ``t`` as it is."""
        for local in local_tensors(t):
            storage = local.untyped_storage()
            # Saved tensors stay alive until backward, so a storage pointer is not reused
            # meanwhile; counting storages once avoids counting a weight saved by two ops twice.
            key = storage.data_ptr()
            if key not in self._seen:
                self._seen.add(key)
                self.bytes += storage.nbytes()
                self.tensors += 1
        return t

    def __repr__(self) -> str:
        """``SavedBytes(bytes=..., tensors=...)``."""
        return f"SavedBytes(bytes={self.bytes}, tensors={self.tensors})"


class saved_activation_bytes:  # noqa: N801 - used as a context manager, like torch.no_grad
    """Count the bytes autograd saves for backward inside the block (on any device).

    A DTensor (tensor, sequence parallel) counts by its local shard: what this rank holds.

    Parameters saved by the ops count too, when they are saved; pass
    ``exclude=model.parameters()`` to leave them out and see activations alone.
    """

    def __init__(self, exclude: Iterable[torch.Tensor] = ()) -> None:
        """Count what autograd saves inside the block; ``exclude``: tensors (parameters) not to count."""
        self.result = SavedBytes()
        for p in exclude:
            self.result.exclude(p)
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self.result.pack, lambda t: t)

    def __enter__(self) -> SavedBytes:
        """Start counting; the :class:`SavedBytes` fills in as the forward runs."""
        self._hooks.__enter__()
        return self.result

    def __exit__(self, *exc) -> None:
        """Stop counting."""
        self._hooks.__exit__(*exc)
