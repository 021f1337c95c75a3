"""Rank side: arguments that let libraries' own trainers run on nbdist's ranks, CPU or GPU.

Lightning, accelerate and HF ``Trainer`` see each rank as a process torchrun
started (RANK, LOCAL_RANK, WORLD_SIZE, TORCHELASTIC_RUN_ID, ... are set) and use
nbdist's process group. On CPU ranks ``Trainer(strategy="ddp", devices=N,
accelerator="cpu")`` works as written. On GPU ranks one thing differs from
torchrun: each rank sees only its own GPU, as ``cuda:0`` (torchrun shows every
rank all of the host's GPUs and the rank picks number LOCAL_RANK). accelerate
and HF ``Trainer`` take that in their stride; Lightning counts the GPUs it sees
and indexes them by LOCAL_RANK, so on GPU ranks it needs "one device per rank",
which :func:`lightning_trainer_kwargs` gives::

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
        """torchrun's environment, seen by a rank that sees one device: its own.

        Lightning places a process on device number ``local_rank()`` of those it
        sees; here that is 0. Each rank counts as a node of one device, so the
        world (devices x nodes) is still WORLD_SIZE and the global rank is RANK.
        """

        def local_rank(self) -> int:
            return 0

        def node_rank(self) -> int:
            return int(os.environ["RANK"])

    return OneDevicePerRank()


def lightning_trainer_kwargs(*, one_device_per_rank: bool | None = None) -> dict:
    """``accelerator``, ``devices``, ``num_nodes`` (and ``plugins``) for ``lightning.Trainer``.

    CPU ranks: ``accelerator="cpu"``, ``devices=LOCAL_WORLD_SIZE``, ``num_nodes`` the
    hosts, as under torchrun. GPU ranks (or ``one_device_per_rank=True``):
    ``accelerator="gpu"``, ``devices=1``, ``num_nodes=WORLD_SIZE`` and an environment
    plugin that places the rank on the one GPU it sees. Use with ``strategy="ddp"``.
    """
    import torch

    world = int(os.environ["WORLD_SIZE"])
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    gpu = torch.cuda.is_available()
    if one_device_per_rank is None:
        one_device_per_rank = gpu
    accelerator = "gpu" if gpu else "cpu"
    if not one_device_per_rank:
        return {"accelerator": accelerator, "devices": local, "num_nodes": world // local}
    return {
        "accelerator": accelerator,
        "devices": 1,
        "num_nodes": world,
        "plugins": [_one_gpu_per_rank_environment()],
    }
