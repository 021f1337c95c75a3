"""Rank side: sequence parallel (Megatron style): tensor parallel that also splits the sequence.

Plain tensor parallel splits the matrix multiplies, but every rank still
holds the whole ``(batch, sequence, hidden)`` activation around them: the
LayerNorms, dropouts and residual adds run on full copies. Sequence parallel
shards those on the sequence dimension instead, so each rank keeps ``1/tp``
of them. The all-reduce that ends each row-parallel layer becomes a
reduce-scatter (each rank keeps its slice of the sequence), and the next
column-parallel layer starts with an all-gather: the same bytes on the wire
as one all-reduce, and activation memory outside the matrix multiplies cut
``tp`` ways.

torch has the pieces (``SequenceParallel`` for norms, ``ColwiseParallel``
with ``input_layouts=Shard(1)``, ``RowwiseParallel`` with
``output_layouts=Shard(1)``); :func:`apply_sequence_parallel` assembles them
block by block, and keeps the model's input and output ordinary tensors: the
first block takes its slice of the (replicated) input, the last block's output
is all-gathered.

Example (on every rank; every rank gets the same batch, as with tensor parallel)::

    from nbdist.strategies.parallel.sequence_parallel import apply_sequence_parallel
    from nbdist.strategies.parallel.tensor_parallel import device_mesh
    model = apply_sequence_parallel(model, device_mesh(), blocks=Block,
                                    colwise=["attn.q", "attn.k", "attn.v", "mlp.up"],
                                    rowwise=["attn.o", "mlp.down"],
                                    norms=["norm1", "norm2"])
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from nbdist.strategies.parallel.checkpointing import saved_activation_bytes

__all__ = ["apply_sequence_parallel", "saved_local_bytes"]


def _check_names(block_name: str, block: nn.Module, names: list[str], kinds: tuple, what: str):
    modules = dict(block.named_modules())
    for name in names:
        if name not in modules:
            raise ValueError(
                f"apply_sequence_parallel: block {block_name!r} has no submodule {name!r}; "
                f"it has {sorted(n for n in modules if n)[:20]}"
            )
        if not isinstance(modules[name], kinds):
            raise TypeError(
                f"apply_sequence_parallel: {block_name}.{name} is a {type(modules[name]).__name__}; "
                f"{what} must be {' or '.join(k.__name__ for k in kinds)}"
            )


def apply_sequence_parallel(
    model: nn.Module,
    mesh,
    *,
    blocks,
    colwise: Iterable[str],
    rowwise: Iterable[str],
    norms: Iterable[str],
    gather: Iterable[str] = (),
    seq_dim: int = 1,
) -> nn.Module:
    """Tensor parallel with the activations between layers sharded on ``seq_dim``, in each block.

    ``blocks`` picks the repeated blocks (a class such as ``Block``, or names);
    the names after it are *inside one block*: ``colwise`` the layers that
    start a tensor-parallel pair (their input is all-gathered from the sequence
    shards), ``rowwise`` those that end one (their output is reduce-scattered
    onto the sequence shards), ``norms`` the LayerNorm/RMSNorm layers that run
    on a sequence shard. ``gather`` names submodules (``"attn"``, ``"mlp"``)
    whose input is all-gathered once for all the colwise layers inside them:
    without it, ``q``, ``k`` and ``v`` would each gather (and save for
    backward) their own copy of the full sequence. Everything in a block outside these layers must be
    element-wise along the sequence (residual adds, dropout, activations);
    attention itself runs between a colwise and a rowwise layer, on the whole
    sequence and ``heads / tp`` heads. The blocks must follow each other
    directly: the first takes this rank's slice of its (replicated) input, the
    last one's output is all-gathered, so the rest of the model and its
    inputs and outputs stay ordinary tensors. The norms' weights stay whole on
    every rank, and so do their gradients: each rank's partial gradient (from
    its sequence shard) is all-reduced as soon as backward has accumulated it.
    Returns ``model``, changed in place.
    """
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        PrepareModuleOutput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    from nbdist.engine.backend_support import require
    from nbdist.strategies.arguments import layer_names, require_module
    from nbdist.strategies.parallel.checkpointing import find_blocks
    from nbdist.strategies.parallel.tensor_parallel import (
        reduce_partial_grads,
        replicate_unsharded,
    )

    # Sequence shards are all-gathered before colwise layers and reduce-scattered after rowwise ones.
    require(
        "sequence parallel (apply_sequence_parallel)",
        ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor"),
    )
    caller = "apply_sequence_parallel"
    require_module(model, caller)
    colwise, rowwise = (
        layer_names(colwise, "colwise", caller),
        layer_names(rowwise, "rowwise", caller),
    )
    norms, gather = layer_names(norms, "norms", caller), layer_names(gather, "gather", caller)
    if not colwise or not rowwise:
        raise ValueError(
            "apply_sequence_parallel: name the layers of each block, e.g. "
            "colwise=['mlp.up'], rowwise=['mlp.down'], norms=['norm']"
        )
    if isinstance(seq_dim, bool) or not isinstance(seq_dim, int) or seq_dim < 0:
        raise ValueError(
            f"apply_sequence_parallel: seq_dim must be a non-negative int (1 for "
            f"(batch, sequence, hidden)), got {seq_dim!r}"
        )
    units = find_blocks(model, blocks, caller="apply_sequence_parallel")
    norm_types = (nn.LayerNorm, nn.RMSNorm, nn.Dropout)
    for name, block in units:
        _check_names(name, block, colwise + rowwise, (nn.Linear,), "colwise/rowwise layers")
        _check_names(name, block, norms, norm_types, "norms")
        _check_names(name, block, gather, (nn.Module,), "gather")
    shard = Shard(seq_dim)

    def gathered(layer: str) -> bool:
        return any(layer.startswith(g + ".") for g in gather)

    # One all-gather per gather module; its colwise layers then see a replicated input.
    plan = {
        g: PrepareModuleInput(
            input_layouts=(shard,), desired_input_layouts=(Replicate(),), use_local_output=True
        )
        for g in gather
    }
    plan.update(
        {
            n: ColwiseParallel() if gathered(n) else ColwiseParallel(input_layouts=shard)
            for n in colwise
        }
    )
    plan.update({n: RowwiseParallel(output_layouts=shard) for n in rowwise})
    plan.update({n: SequenceParallel(sequence_dim=seq_dim) for n in norms})
    for _, block in units:
        parallelize_module(block, mesh, plan)
    first, last = units[0][1], units[-1][1]
    # An uneven cut makes ranks' reduce-scatters differ in size, which aborts a rank under
    # gloo: the length is checked first, alike on every rank (the input is replicated).
    first.register_forward_pre_hook(_even_sequence(seq_dim, mesh.size()), prepend=True)
    # Slicing a replicated tensor costs no communication; gathering the output does.
    parallelize_module(
        first,
        mesh,
        PrepareModuleInput(
            input_layouts=(Replicate(),), desired_input_layouts=(shard,), use_local_output=True
        ),
    )
    parallelize_module(
        last,
        mesh,
        PrepareModuleOutput(
            output_layouts=(shard,), desired_output_layouts=(Replicate(),), use_local_output=True
        ),
    )
    # Embeddings, the final norm, the head: replicated DTensors too (foreach optimizers).
    replicate_unsharded(model, mesh, caller="apply_sequence_parallel")
    # The norms run on sequence shards: their weights' gradients are partial sums.
    reduce_partial_grads(model)
    return model


def _even_sequence(seq_dim: int, tp: int):
    def check(_module, args):
        x = args[0] if args else None
        if isinstance(x, torch.Tensor) and x.dim() > seq_dim and x.shape[seq_dim] % tp:
            length = x.shape[seq_dim]
            raise ValueError(
                f"apply_sequence_parallel: the sequence (dim {seq_dim} of the input, shape "
                f"{tuple(x.shape)}) has {length} tokens, which {tp} ranks cannot share "
                f"evenly: pad it to {-(-length // tp) * tp} tokens (or crop it to "
                f"{length // tp * tp})"
            )

    return check


class saved_local_bytes(saved_activation_bytes):  # noqa: N801 - a context manager
    """Bytes autograd saves for backward inside the block on this rank, DTensors by their local shard.

    The same as :func:`~nbdist.strategies.parallel.checkpointing.saved_activation_bytes`
    (which counts DTensors by their local shard too), under the name this
    module's examples use. Example::

        with saved_local_bytes(exclude=model.parameters()) as saved:
            loss = loss_fn(model(x), y)
        saved.bytes
    """
