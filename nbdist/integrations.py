"""Rank side: arguments that let libraries' own trainers run on nbdist's ranks, CPU or GPU.

Lightning, accelerate and HF ``Trainer`` see each rank as a process torchrun
started (RANK, LOCAL_RANK, WORLD_SIZE, TORCHELASTIC_RUN_ID, ... are set) and use
nbdist's process group. As under torchrun, every rank of a host sees the same
GPUs and uses ``cuda:<local rank>``, so ``Trainer(strategy="ddp", devices=N)``
works as written while there is a GPU per rank. Ranks that share GPUs (more
ranks than GPUs) are where torchrun code breaks: Lightning refuses ``devices``
beyond the GPUs it sees. :func:`lightning_trainer_kwargs` gives arguments that
fit either case::

    >>> trainer = L.Trainer(strategy="ddp", max_epochs=3, **nbdist.integrations.lightning_trainer_kwargs())

(``import nbdist.integrations`` imports no library; Lightning is imported when
the function is called.)
"""

from __future__ import annotations

import os

__all__ = ["lightning_trainer_kwargs"]


def _one_gpu_per_rank_environment():
    from lightning.pytorch.plugins.environments import TorchElasticEnvironment

    class OneDevicePerRank(TorchElasticEnvironment):
        """torchrun's environment, for a rank given one device of its own (``devices=[i]``).

        Lightning places a process on device number ``local_rank()`` of its
        ``devices``; with one device that is 0. Each rank counts as a node of
        one device, so the world (devices x nodes) is still WORLD_SIZE and the
        global rank is RANK.
        """

        def local_rank(self) -> int:
            return 0

        def node_rank(self) -> int:
            return int(os.environ["RANK"])

    return OneDevicePerRank()


def lightning_trainer_kwargs(*, one_device_per_rank: bool | None = None) -> dict:
    """``accelerator``, ``devices``, ``num_nodes`` (and ``plugins``) for ``lightning.Trainer``.

    A device per rank (CPU ranks; GPU ranks no more than the GPUs):
    ``devices=LOCAL_WORLD_SIZE``, ``num_nodes`` the hosts, as under torchrun.
    Ranks sharing GPUs (or ``one_device_per_rank=True``): ``devices=[the rank's
    GPU index]``, ``num_nodes=WORLD_SIZE`` and an environment plugin that puts
    the rank on it. Use with ``strategy="ddp"``.
    """
    import torch

    if not os.environ.get("WORLD_SIZE") or not os.environ.get("RANK"):
        raise RuntimeError(
            "lightning_trainer_kwargs describes a rank of a distributed job, and this process "
            "is none (WORLD_SIZE and RANK are not set): call it on the ranks, in a "
            "%%on_all_ranks cell after %dist_start (or under torchrun)"
        )
    world = int(os.environ["WORLD_SIZE"])
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    gpu = torch.cuda.is_available()
    if one_device_per_rank is None:
        one_device_per_rank = gpu and local > torch.cuda.device_count()
    accelerator = "gpu" if gpu else "cpu"
    if not one_device_per_rank:
        return {"accelerator": accelerator, "devices": local, "num_nodes": world // local}
    return {
        "accelerator": accelerator,
        "devices": [torch.cuda.current_device()] if gpu else 1,
        "num_nodes": world,
        "plugins": [_one_gpu_per_rank_environment()],
    }
