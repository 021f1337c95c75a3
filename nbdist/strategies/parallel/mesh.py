"""Rank side: the placement object of 2D/3D parallelism: ``ParallelDims`` and its ``DeviceMesh``.

:class:`ParallelDims` is the one placement object: how many ranks go to data
(``dp``), tensor (``tp``) and pipeline (``pp``) parallelism, checked against the
world size before anything starts (it needs no process group, so the kernel can
check it before ``%dist_start``), and the ``DeviceMesh`` that lays the ranks out.
The mesh is ``pp × dp × tp``, outermost first, as torchtitan orders it: the ranks
of one tensor-parallel group are neighbours (on GPUs, one node with fast links,
since TP talks in every layer), pipeline stages are farthest apart (they only
pass activations). :mod:`nbdist.strategies.parallel.parallelize` applies a layout
to a model (``parallelize``, and the 2D/3D helpers ``apply_fsdp_tp``,
``apply_fsdp_tp_pp``).

Example (in the kernel, or on every rank of 8)::

    from nbdist.strategies.parallel.mesh import ParallelDims
    dims = ParallelDims(8, dp=2, tp=2, pp=2)     # ParallelDims(8, dp=2, tp=3, pp=2) raises
    dims.check_model(n_heads=4, hidden=32, n_layers=6, batch=32, n_microbatches=4)
    mesh = dims.build_mesh()                     # on the ranks
    x, y = batch_for(dims.coordinates(rank)["dp"])     # one batch per data-parallel replica
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

__all__ = ["DIM_ORDER", "ParallelDims", "dims_of"]

# Outermost first: pipeline stages far apart, tensor-parallel ranks adjacent.
DIM_ORDER = ("pp", "dp", "tp")


def _factorisations(world: int) -> list[tuple[int, int, int]]:
    return [
        (dp, tp, world // (dp * tp))
        for dp in range(1, world + 1)
        if world % dp == 0
        for tp in range(1, world // dp + 1)
        if (world // dp) % tp == 0
    ]


def _nearest(world: int, dp: int, tp: int, pp: int) -> tuple[int, int, int]:
    # The valid layout closest to the one asked for (in log ratio), keeping tp and pp first.
    def distance(c):
        return sum(abs(math.log(a / b)) * w for a, b, w in zip(c, (dp, tp, pp), (1, 1.01, 1.02)))

    return min(_factorisations(world), key=distance)


@dataclass(frozen=True)
class ParallelDims:
    """How ``world_size`` ranks split into data (``dp``), tensor (``tp``) and pipeline (``pp``) parallelism.

    ``dp=-1`` takes what ``tp`` and ``pp`` leave (``world_size // (tp * pp)``).
    The product must be the world size; every error shows the numbers and a
    layout that fits, e.g. ``ParallelDims(8, dp=2, tp=3, pp=2)`` raises
    ``dp 2 × tp 3 × pp 2 = 12 ≠ world size 8 ... e.g. dp 2 × tp 2 × pp 2``.
    Pure arithmetic: no process group needed.
    """

    world_size: int
    dp: int = -1
    tp: int = 1
    pp: int = 1

    def __post_init__(self) -> None:
        """Check the numbers; resolve ``dp=-1``."""
        for name in ("world_size", "dp", "tp", "pp"):
            value = getattr(self, name)
            # NumPy's integers are whole numbers too (a size from a config array); kept as int.
            if isinstance(value, bool) or not isinstance(value, numbers.Integral):
                raise TypeError(f"ParallelDims: {name} must be an int, got {value!r}")
            object.__setattr__(self, name, int(value))
        world, tp, pp = self.world_size, self.tp, self.pp
        if world < 1:
            raise ValueError(f"ParallelDims: world_size must be >= 1, got {world}")
        for name in ("tp", "pp"):
            if getattr(self, name) < 1:
                raise ValueError(
                    f"ParallelDims: {name} must be >= 1, got {getattr(self, name)} "
                    f"(1 turns {name} off)"
                )
        dp = self.dp
        if dp == -1:
            if world % (tp * pp):
                a, b, c = _nearest(world, 1, tp, pp)
                raise ValueError(
                    f"ParallelDims: tp {tp} × pp {pp} = {tp * pp} does not divide world size "
                    f"{world}, so dp=-1 has no whole value; e.g. dp {a} × tp {b} × pp {c}"
                )
            dp = world // (tp * pp)
            object.__setattr__(self, "dp", dp)
        elif dp < 1:
            raise ValueError(
                f"ParallelDims: dp must be >= 1 or -1 (all the ranks tp and pp leave), got {dp}"
            )
        if dp * tp * pp != world:
            a, b, c = _nearest(world, dp, tp, pp)
            raise ValueError(
                f"ParallelDims: dp {dp} × tp {tp} × pp {pp} = {dp * tp * pp} ≠ world size "
                f"{world}: choose sizes whose product is {world}, e.g. dp {a} × tp {b} × pp {c} "
                f"(or dp=-1 to give data parallel whatever tp × pp leaves)"
            )

    @property
    def shape(self) -> tuple[int, int, int]:
        """Mesh shape in :data:`DIM_ORDER` (``pp``, ``dp``, ``tp``)."""
        return (self.pp, self.dp, self.tp)

    def __str__(self) -> str:
        """``dp 2 × tp 2 × pp 2 = 8 ranks``."""
        return f"dp {self.dp} × tp {self.tp} × pp {self.pp} = {self.world_size} ranks"

    def coordinates(self, rank: int) -> dict[str, int]:
        """This rank's index along each mesh dimension, e.g. ``{"pp": 0, "dp": 1, "tp": 0}``.

        Ranks fill the mesh row-major (``tp`` fastest), as ``init_device_mesh`` lays them out.
        """
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside 0..{self.world_size - 1}")
        pp, rest = divmod(rank, self.dp * self.tp)
        dp, tp = divmod(rest, self.tp)
        return {"pp": pp, "dp": dp, "tp": tp}

    def check_model(
        self,
        *,
        n_heads: int | None = None,
        hidden: int | None = None,
        n_layers: int | None = None,
        batch: int | None = None,
        n_microbatches: int | None = None,
    ) -> None:
        """Check that a model and batch fit this layout; the error names the number that does not.

        Tensor parallel splits attention heads and hidden features ``tp`` ways;
        pipeline parallel needs a layer per stage; each data-parallel replica
        gets ``batch // dp`` samples, cut into ``n_microbatches``.
        """
        given = dict(n_heads=n_heads, hidden=hidden, n_layers=n_layers, batch=batch)
        given["n_microbatches"] = n_microbatches
        for name, value in given.items():
            # Counts, checked first: 0 micro-batches divided by zero, "8" compared with an int.
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, numbers.Integral):
                fix = f"int({value!r})" if isinstance(value, str) else "a whole number"
                raise TypeError(f"check_model: {name}={value!r} is no count: pass {name}={fix}")
            if value < 1:
                raise ValueError(
                    f"check_model: {name}={value!r} must be a count >= 1 (or None: unchecked)"
                )
        tp, pp, dp = self.tp, self.pp, self.dp
        if n_heads is not None and n_heads % tp:
            raise ValueError(f"tp {tp} must divide the number of attention heads ({n_heads})")
        if hidden is not None and hidden % tp:
            raise ValueError(f"tp {tp} must divide the hidden size ({hidden})")
        if n_layers is not None and n_layers < pp:
            raise ValueError(f"pp {pp} stages need at least {pp} layers, the model has {n_layers}")
        if batch is not None:
            if batch % dp:
                raise ValueError(f"dp {dp} must divide the global batch ({batch})")
            per_replica = batch // dp
            if n_microbatches is not None and per_replica % n_microbatches:
                raise ValueError(
                    f"each dp replica gets {per_replica} samples (batch {batch} / dp {dp}), "
                    f"which {n_microbatches} micro-batches do not divide"
                )

    def build_mesh(self, *, device_type: str | None = None):
        """The ``DeviceMesh`` ``pp × dp × tp`` over all ranks (call it on every rank).

        Dimensions of size 1 are kept, so ``mesh["tp"]`` always exists.
        ``device_type`` defaults to this rank's device type.
        """
        import torch.distributed as dist

        from nbdist.strategies.parallel.tensor_parallel import device_mesh

        if (
            dist.is_available()
            and dist.is_initialized()
            and dist.get_world_size() != self.world_size
        ):
            raise ValueError(
                f"ParallelDims was made for world size {self.world_size}, but the process group "
                f"has {dist.get_world_size()} ranks: make it with ParallelDims(world_size, ...)"
            )
        return device_mesh(self.shape, DIM_ORDER, device_type=device_type)


def dims_of(mesh) -> ParallelDims:
    """The :class:`ParallelDims` of a ``DeviceMesh`` whose dimensions are named ``dp``, ``tp``, ``pp``.

    A dimension the mesh lacks counts as 1 (``device_mesh((2, 2), ("dp", "tp"))``
    is ``dp 2 × tp 2 × pp 1``).
    """
    names = mesh.mesh_dim_names or ()
    unknown = [n for n in names if n not in DIM_ORDER]
    if not names or unknown:
        raise ValueError(
            f"the mesh's dimensions are {names!r}: name them from {DIM_ORDER} "
            f"(ParallelDims(...).build_mesh() does)"
        )
    sizes = {name: mesh[name].size() for name in names}
    return ParallelDims(
        mesh.size(), dp=sizes.get("dp", 1), tp=sizes.get("tp", 1), pp=sizes.get("pp", 1)
    )
