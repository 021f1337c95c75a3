"""Rank side: tensor parallelism (Megatron-style) with DTensor: split each layer's weights over the ranks.

An MLP ``down(act(up(x)))`` is cut so that no rank ever holds a full weight:
``up`` is split by output features (column-parallel: each rank computes a
slice of the hidden activations), ``down`` by input features (row-parallel:
each rank multiplies its slice and one all-reduce sums the partial outputs).
One all-reduce per MLP in the forward pass, one in the backward. Use it when a
single layer is too big for one device, inside a node with fast links.

Example (on every rank)::

    from nbdist.strategies.parallel.tensor_parallel import apply_tp, device_mesh
    mesh = device_mesh()                                  # 1-D mesh over all ranks
    mlp = apply_tp(MLP().to(device), mesh, colwise=["up"], rowwise=["down"])
    out = mlp(x)                                          # same x on every rank, same out
"""

from __future__ import annotations

import numbers
from collections.abc import Iterable

from torch import nn

__all__ = [
    "apply_tp",
    "device_mesh",
    "linear_pairs",
    "local_param_bytes",
    "reduce_partial_grads",
    "replicate_unsharded",
]


def device_mesh(
    shape: tuple[int, ...] | int | None = None,
    names: tuple[str, ...] | None = None,
    *,
    device_type: str | None = None,
):
    """A ``DeviceMesh`` over the ranks on this rank's device type (``cuda`` or ``cpu``).

    ``shape`` defaults to ``(world_size,)``; e.g. ``device_mesh((2, 4), ("dp", "tp"))``
    on 8 ranks. The product of ``shape`` must equal the world size.
    ``device_type`` overrides the rank's device type.
    """
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from nbdist.engine.helpers import device

    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            "device_mesh needs a torch.distributed process group: call it on the ranks "
            "(in a %%on_all_ranks cell after %dist_start)"
        )
    world = dist.get_world_size()
    if shape is None:
        shape = (world,)
    elif isinstance(shape, numbers.Integral):
        shape = (shape,)
    # Whole sizes only: int() would cut 1.5 to 1, and a string "12" to (1, 2), without a word.
    sizes = [shape] if isinstance(shape, str) or not isinstance(shape, Iterable) else list(shape)
    if not all(isinstance(s, numbers.Integral) and not isinstance(s, bool) for s in sizes):
        raise TypeError(
            f"device_mesh: shape={shape!r} must hold whole numbers, one size per dimension, "
            f"whose product is the world size: e.g. shape=({world},)"
        )
    shape = tuple(int(s) for s in shape)
    product = 1
    for s in shape:
        product *= s
    if product != world:
        dims = " * ".join(str(s) for s in shape)
        raise ValueError(
            f"mesh shape {dims} = {product} != world size {world}: choose a shape whose "
            f"product is {world}"
        )
    if names is not None and len(names) != len(shape):
        raise ValueError(f"mesh names {names!r} must have one name per dimension of {shape}")
    if device_type is not None:
        try:
            torch.device(device_type)
        except (RuntimeError, TypeError):
            # Accepted by DeviceMesh as any text, to fail at the first collective on it.
            raise ValueError(
                f"device_mesh: device_type={device_type!r} is no torch device type: give "
                "'cuda' or 'cpu' (or leave it out for this rank's device)"
            ) from None
    return init_device_mesh(device_type or device().type, shape, mesh_dim_names=names)


def apply_tp(
    model: nn.Module,
    mesh,
    *,
    colwise: Iterable[str] = (),
    rowwise: Iterable[str] = (),
    plan: dict | None = None,
) -> nn.Module:
    """Shard the ``nn.Linear``/``nn.Embedding`` layers named in ``colwise``/``rowwise`` over ``mesh``.

    Names are those of ``model.named_modules()`` (``"up"``, ``"blocks.0.fc1"``).
    Pair them as Megatron does: a column-parallel layer followed by a
    row-parallel one, with only element-wise work in between
    (:func:`linear_pairs` finds such pairs). Inputs and outputs of the model
    stay ordinary (replicated) tensors. ``plan`` adds a ready
    ``parallelize_module`` plan (``{name or pattern: ParallelStyle}``, e.g.
    ``SequenceParallel()``), passed on as it is and taking precedence over
    ``colwise``/``rowwise``. The gradients of replicated parameters that a
    plan's module computes on a shard (``SequenceParallel`` norms) are reduced
    in backward (:func:`reduce_partial_grads`). Returns ``model``, changed in place.
    """
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    from nbdist.engine.backend_support import require
    from nbdist.strategies.arguments import layer_names, require_module

    # Row-parallel outputs are all-reduced; sequence-parallel styles gather and scatter.
    require(
        "tensor parallel (apply_tp)",
        ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor"),
    )

    require_module(model, "apply_tp")
    colwise = layer_names(colwise, "colwise", "apply_tp")
    rowwise = layer_names(rowwise, "rowwise", "apply_tp")
    if mesh is None:
        raise TypeError(
            "apply_tp: mesh=None; give the tensor-parallel mesh, e.g. device_mesh() or "
            "dims.build_mesh()['tp']"
        )
    if not colwise and not rowwise and not plan:
        raise ValueError("apply_tp: name at least one layer, e.g. colwise=['up'], rowwise=['down']")
    modules = dict(model.named_modules())
    for name in colwise + rowwise:
        if name not in modules:
            raise ValueError(
                f"apply_tp: no submodule named {name!r}; the model has "
                f"{sorted(n for n in modules if n)[:20]}"
            )
        if not isinstance(modules[name], (nn.Linear, nn.Embedding)):
            raise TypeError(
                f"apply_tp: {name!r} is a {type(modules[name]).__name__}; column/row-parallel "
                f"sharding applies to nn.Linear and nn.Embedding layers"
            )
    _check_even(modules, colwise, rowwise, plan or {}, mesh.size())
    styles = {name: ColwiseParallel() for name in colwise}
    styles.update({name: RowwiseParallel() for name in rowwise})
    styles.update(plan or {})
    parallelize_module(model, mesh, styles)
    replicate_unsharded(model, mesh, caller="apply_tp")
    reduce_partial_grads(model)  # a plan's SequenceParallel norms: partial gradients
    return model


def reduce_partial_grads(model: nn.Module) -> None:
    """Reduce a replicated parameter's partial gradient as soon as backward has accumulated it.

    A module that runs on a shard of the activations (a ``SequenceParallel``
    norm) gives each rank a partial sum (DTensor ``Partial``) as the gradient
    of its replicated weight, which only the optimizer's step would reduce. How
    a step reduces it depends on the torch version: torch 2.11's SGD with
    momentum on an H200 moved the norms' weights away from the one-process
    model's from the second step on (example 27: 0.7 % after 30 steps; torch
    2.13 on CPU matched within 1e-7). Reduced here, every optimizer, and anyone
    reading ``.grad``, sees the same whole gradient on every rank: the
    all-reduce the step would have done, done earlier. A gradient that is not
    partial is left as it is.
    """
    from torch.distributed.tensor import DTensor

    for p in model.parameters():
        if isinstance(p, DTensor) and all(q.is_replicate() for q in p.placements):
            p.register_post_accumulate_grad_hook(_reduce_if_partial)


def _reduce_if_partial(param) -> None:
    grad = param.grad
    placements = getattr(grad, "placements", ())
    if any(p.is_partial() for p in placements):
        param.grad = grad.redistribute(grad.device_mesh, param.placements)


def _check_even(modules: dict, colwise: list, rowwise: list, plan: dict, tp: int) -> None:
    """Refuse a Linear whose sharded width ``tp`` ranks cannot split evenly, before any change.

    Uneven shards fail later, at the first forward, with a sharding-propagation error
    about matrix shapes that names no layer.
    """
    for names, attr in ((colwise, "out_features"), (rowwise, "in_features")):
        for name in names:
            layer = modules[name]
            if name in plan or not isinstance(layer, nn.Linear) or not getattr(layer, attr) % tp:
                continue
            width = getattr(layer, attr)
            raise ValueError(
                f"apply_tp: {name!r} has {attr}={width}, which {tp} tensor-parallel ranks "
                f"cannot split evenly: make it divisible by {tp} (e.g. {-(-width // tp) * tp}), "
                "or leave the layer out of colwise/rowwise"
            )


def linear_pairs(model: nn.Module, world: int) -> tuple[list[str], list[str]]:
    """Megatron's pairing of ``model``'s ``nn.Linear`` layers: (colwise names, rowwise names).

    Consecutive layers are paired, the first column-parallel, the second
    row-parallel, so the activation between them stays sharded and one
    all-reduce ends the pair. Each column-parallel layer's ``out_features`` must
    divide by ``world``; the error names the layer that does not.
    """
    linears = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    colwise, rowwise = [], []
    for (first, a), (second, _) in zip(linears[0::2], linears[1::2]):
        if a.out_features % world:
            raise ValueError(
                f"tensor parallel shards {first}.out_features ({a.out_features}) over {world} "
                f"ranks: make it divisible by {world}"
            )
        colwise.append(first)
        rowwise.append(second)
    if not colwise:
        raise ValueError("tensor parallel needs at least two nn.Linear layers")
    return colwise, rowwise


def local_param_bytes(model: nn.Module) -> int:
    """Bytes of parameters this rank really stores (the local shard of each DTensor)."""
    from nbdist.strategies.measure import local_bytes

    return local_bytes(model.parameters())


# Layers whose forward uses only their inputs, parameters and buffers: as replicated
# DTensors they compute exactly what they did (their inputs made replicated DTensors,
# their outputs plain again).
_REPLICABLE = (nn.Linear, nn.Embedding, nn.LayerNorm, nn.RMSNorm)


def replicate_unsharded(
    model: nn.Module, mesh, *, caller: str = "replicate_unsharded"
) -> list[str]:
    """Make the parameters a tensor-parallel plan left alone replicated DTensors on ``mesh``.

    Why: on GPUs torch's optimizers default to foreach kernels, which refuse a list
    mixing DTensors and plain tensors ("got mixed torch.Tensor and DTensor"), so a
    model whose sharded layers are DTensors and whose other layers (embeddings,
    norms, the head) are not fails at its first ``opt.step()`` there (on CPU the
    default per-parameter loop hides it). Each ``nn.Linear``, ``nn.Embedding``,
    ``nn.LayerNorm`` or ``nn.RMSNorm`` with plain parameters gets them as
    ``Replicate()`` DTensors; its plain tensor inputs enter as replicated DTensors
    and its outputs leave as plain tensors again, so the code around it sees what
    it saw before. Their gradients need no communication: in tensor parallelism
    every rank computes the same ones. Parameters of other modules, and weights
    tied between modules (replicating one would untie them), stay plain: a warning
    names them and the fix (``foreach=False`` for the optimizer). Returns the names
    of the parameters made replicated.
    """
    from torch.distributed.tensor import DTensor

    def plain(module: nn.Module) -> list[str]:
        return [n for n, p in module.named_parameters(recurse=False) if not isinstance(p, DTensor)]

    owners: dict[int, int] = {}
    for module in model.modules():
        for p in module.parameters(recurse=False):
            owners[id(p)] = owners.get(id(p), 0) + 1
    replicated, left = [], []
    for name, module in model.named_modules():
        names = plain(module)
        if not names:
            continue
        prefix = f"{name}." if name else ""
        tied = any(owners[id(p)] > 1 for p in module.parameters(recurse=False))
        if (
            isinstance(module, _REPLICABLE)
            and not tied
            and len(names) == len(list(module.parameters(recurse=False)))
        ):
            _replicate(module, mesh)
            replicated += [prefix + n for n in names]
        else:
            left += [prefix + n for n in names]
    if left and any(isinstance(p, DTensor) for p in model.parameters()):
        import warnings

        shown = ", ".join(left[:6]) + (f" and {len(left) - 6} more" if len(left) > 6 else "")
        warnings.warn(
            f"{caller}: {shown} stay plain tensors next to DTensor parameters (a module "
            f"nbdist cannot replicate safely, or a tied weight); on GPUs torch's optimizers "
            f"refuse that mix at their first step: pass foreach=False to the optimizer, or "
            f"give those modules a style in plan=",
            stacklevel=3,
        )
    return replicated


def _replicate(module: nn.Module, mesh) -> None:
    """``module``'s parameters replicated on ``mesh``; plain tensors in, plain tensors out."""
    import torch
    from torch.distributed.tensor import DTensor, Replicate, distribute_module

    replicate = [Replicate()] * mesh.ndim

    def inputs_in(_module, inputs, device_mesh):
        converted = tuple(
            DTensor.from_local(x, device_mesh, replicate, run_check=False)
            if isinstance(x, torch.Tensor) and not isinstance(x, DTensor)
            else x
            for x in inputs
        )
        # Outputs go back to plain tensors only where the inputs came in plain.
        _module.nbdist_plain_inputs = any(a is not b for a, b in zip(converted, inputs))
        return converted

    def outputs_out(_module, outputs, device_mesh):
        if not getattr(_module, "nbdist_plain_inputs", False):
            return outputs
        if isinstance(outputs, DTensor):
            return outputs.to_local()
        if isinstance(outputs, tuple):
            return tuple(o.to_local() if isinstance(o, DTensor) else o for o in outputs)
        return outputs

    distribute_module(module, mesh, None, input_fn=inputs_in, output_fn=outputs_out)
