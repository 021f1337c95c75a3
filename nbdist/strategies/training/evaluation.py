"""Rank side: distributed evaluation that returns exactly the single-process numbers.

``DistributedSampler`` is made for training: it pads the dataset by repeating samples
until every rank has the same count, and deals samples out round-robin. For
evaluation both hurt: repeated samples are counted twice (a wrong metric whenever the
size is not a multiple of the world size) and predictions come back interleaved.

- :class:`SequentialDistributedSampler` gives each rank one contiguous block, sizes
  differing by at most one, no padding: every sample is seen exactly once, in order.
- :func:`all_reduce_sums` adds metric sums (correct answers, loss sums, counts) over ranks;
  divide afterwards, never average per-rank ratios.
- :func:`all_gather_uneven` collects per-rank tensors of different lengths (collectives
  need equal shapes: pad to the longest, gather, trim), concatenated in rank order.

Example (on every rank)::

    from nbdist.strategies.training.evaluation import (
        SequentialDistributedSampler, all_gather_uneven, all_reduce_sums)
    loader = DataLoader(test_set, batch_size=256, sampler=SequentialDistributedSampler(test_set))
    preds = torch.cat([model(x).argmax(1) for x, _ in loader])
    sums = all_reduce_sums(correct=(preds == labels_of_my_block).sum(), count=len(preds))
    accuracy = sums["correct"] / sums["count"]            # equals the single-process accuracy
    all_preds = all_gather_uneven(preds)                   # len(test_set) predictions, in order
"""

from __future__ import annotations

from collections.abc import Iterator, Sized

import torch
import torch.distributed as dist
from torch.utils.data import Sampler

__all__ = ["SequentialDistributedSampler", "all_gather_uneven", "all_reduce_sums", "block_range"]


def block_range(length: int, rank: int, world_size: int) -> range:
    """The contiguous indices rank ``rank`` evaluates out of ``length`` (no padding).

    The first ``length % world_size`` ranks get one sample more.

    >>> [list(block_range(5, r, 2)) for r in range(2)]
    [[0, 1, 2], [3, 4]]
    """
    if length < 0:
        raise ValueError(f"dataset length {length} is negative")
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in range(world_size={world_size})")
    base, extra = divmod(length, world_size)
    start = rank * base + min(rank, extra)
    return range(start, start + base + (1 if rank < extra else 0))


def _rank_and_size(rank, world_size, group) -> tuple[int, int]:
    if rank is not None and world_size is not None:
        return rank, world_size
    if not dist.is_initialized():
        return (0 if rank is None else rank), (1 if world_size is None else world_size)
    return (
        dist.get_rank(group) if rank is None else rank,
        dist.get_world_size(group) if world_size is None else world_size,
    )


class SequentialDistributedSampler(Sampler[int]):
    """Each rank gets one contiguous block of the dataset; nothing repeated, nothing reordered.

    ``data`` is a dataset (anything with ``len``) or its length. Ranks may get
    different numbers of samples (by one at most), so use it for evaluation, where no
    collective runs per batch; for training keep ``DistributedSampler``.

    >>> [list(SequentialDistributedSampler(5, rank=r, world_size=2)) for r in range(2)]
    [[0, 1, 2], [3, 4]]
    """

    def __init__(
        self,
        data: Sized | int,
        *,
        rank: int | None = None,
        world_size: int | None = None,
        group=None,
    ) -> None:
        """Indices of this rank's block of ``data``; ``rank``/``world_size`` default to the group's."""
        length = data if isinstance(data, int) else len(data)
        self.rank, self.world_size = _rank_and_size(rank, world_size, group)
        self.indices = block_range(length, self.rank, self.world_size)

    def __iter__(self) -> Iterator[int]:
        """This rank's indices, in order."""
        return iter(self.indices)

    def __len__(self) -> int:
        """How many samples this rank gets."""
        return len(self.indices)


def all_reduce_sums(*, device=None, group=None, **sums) -> dict[str, float]:
    """Sum each named value over ranks, in one collective, in float64; returns plain floats.

    Values are numbers or 0-d tensors (their ``.item()`` happens once, after the
    collective). ``device`` defaults to the first tensor's device, else this rank's
    device (NCCL needs CUDA tensors).

    Example::

        s = all_reduce_sums(correct=(pred == y).sum(), loss=loss_sum, count=len(y))
        accuracy = s["correct"] / s["count"]
    """
    if not sums:
        raise TypeError(
            "all_reduce_sums() needs named values, e.g. all_reduce_sums(correct=c, count=n)"
        )
    if device is None:
        tensors = [v for v in sums.values() if isinstance(v, torch.Tensor)]
        if tensors:
            device = tensors[0].device
        else:
            from nbdist.engine.helpers import device as rank_device

            device = rank_device()
    for name, value in sums.items():
        if isinstance(value, torch.Tensor) and value.numel() != 1:
            raise ValueError(f"{name} has shape {tuple(value.shape)}: pass a scalar (e.g. .sum())")
    # float64 keeps integer counts exact up to 2**53.
    packed = torch.stack(
        [torch.as_tensor(v, dtype=torch.float64).reshape(()).to(device) for v in sums.values()]
    )
    if dist.is_initialized():
        dist.all_reduce(packed, group=group)
    return dict(zip(sums, packed.tolist()))


def all_gather_uneven(tensor: torch.Tensor, *, group=None) -> torch.Tensor:
    """Concatenate every rank's ``tensor`` along dim 0, in rank order; lengths may differ.

    Two collectives: the lengths, then the tensors padded to the longest (all ranks
    must pass the same trailing shape and dtype); the padding is trimmed.

    Example: rank 0 holds ``[0, 1, 2]``, rank 1 holds ``[3, 4]``; every rank gets
    ``tensor([0, 1, 2, 3, 4])``.
    """
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(
            f"all_gather_uneven: tensor must be a torch.Tensor, got {type(tensor).__name__}: "
            "pass torch.as_tensor(...) of it"
        )
    if not dist.is_initialized():
        return tensor
    if tensor.dim() == 0:
        tensor = tensor.reshape(1)
    n = dist.get_world_size(group)
    length = torch.tensor([tensor.shape[0]], dtype=torch.int64, device=tensor.device)
    lengths = [torch.empty_like(length) for _ in range(n)]
    dist.all_gather(lengths, length, group=group)
    sizes = [int(x) for x in torch.cat(lengths).tolist()]
    longest = max(sizes)
    padded = tensor.new_zeros((longest, *tensor.shape[1:]))
    padded[: tensor.shape[0]] = tensor
    parts = [torch.empty_like(padded) for _ in range(n)]
    dist.all_gather(parts, padded.contiguous(), group=group)
    return torch.cat([part[:size] for part, size in zip(parts, sizes)])
