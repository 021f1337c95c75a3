"""Both sides (kernel and rank): which GPUs are visible, which backend, which device a rank uses.

The kernel asks these questions before any engine starts (to plan the ranks,
:mod:`nbdist.launch.placement`); a rank asks them again when it joins the group
(:mod:`nbdist.engine.bootstrap`, :mod:`nbdist.engine.standalone`). One module
answers for both, so that the two sides cannot disagree. Imports the standard
library alone; torch only if the caller imported it already.

Example::

    >>> choose_backend(None, uses_gpus=False)
    'gloo'
    >>> gpus_from_mask("2,0", 4, already_masked=False)
    [2, 0]
    >>> device_for(3)
    'cuda:3'
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys

from nbdist.errors import PlacementError

__all__ = [
    "BACKENDS",
    "SHARED_GPU_ENV",
    "SHARED_GPU_NCCL",
    "choose_backend",
    "device_for",
    "gpus_from_mask",
    "local_device",
    "nccl_can_share",
    "nccl_version",
    "visible_gpus",
]

BACKENDS = ("nccl", "gloo")
# NCCL refuses two ranks on one GPU ("Duplicate GPU detected") up to 2.29; 2.30 allows it
# when this variable is 1 (experimental), so ranks that share a GPU get it set.
SHARED_GPU_ENV = "NCCL_MULTI_RANK_GPU_ENABLE"
SHARED_GPU_NCCL = (2, 30, 0)
# ASCII digits only: str.isdigit() accepts '²', which int() rejects.
_NUMBER = re.compile(r"^[0-9]+$")


def choose_backend(requested: str | None, *, uses_gpus: bool) -> str:
    """NCCL on GPUs, gloo on CPU; an explicit request is checked against the devices."""
    if requested is None:
        return "nccl" if uses_gpus else "gloo"
    backend = requested.lower()
    if backend not in BACKENDS:
        raise PlacementError(
            f"unknown backend {requested!r}: use one of {', '.join(BACKENDS)} "
            "(nccl on GPUs, gloo on CPU)"
        )
    if backend == "nccl" and not uses_gpus:
        raise PlacementError(
            "backend 'nccl' needs GPUs, but the ranks run on CPU: use --backend gloo "
            "(or drop --cpu if GPUs are visible)"
        )
    return backend


def device_for(cuda_index: int | None) -> str:
    """The torch device of a rank nbdist started: ``cpu``, or ``cuda:<its index>``.

    Every rank of a host sees the GPUs nbdist was given (one CUDA_VISIBLE_DEVICES
    for all, as torchrun leaves it), so a rank's index is into that list and
    the same in every process, whether or not CUDA started before.
    """
    return "cpu" if cuda_index is None else f"cuda:{cuda_index}"


def local_device(local_rank: int) -> str:
    """The device of a rank that a launcher such as ``torchrun`` started: one GPU per local rank.

    Every local rank sees all of its host's GPUs there; rank ``i`` takes GPU
    ``i`` (round robin when there are more ranks than GPUs). ``cpu`` without CUDA.
    """
    import torch

    if not torch.cuda.is_available():
        return "cpu"
    return f"cuda:{local_rank % torch.cuda.device_count()}"


def nccl_version() -> tuple[int, int, int] | None:
    """The NCCL version torch is built with, e.g. (2, 30, 7); None without NCCL (CPU builds).

    Imports torch (seconds, once): asked only when ranks would share a GPU.
    ``ncclGetVersion`` needs no GPU and does not initialise CUDA, so the
    process that forks the ranks may ask.
    """
    import torch

    if not torch.distributed.is_available() or not torch.distributed.is_nccl_available():
        return None
    try:
        version = torch.cuda.nccl.version()
    except (AttributeError, RuntimeError):
        return None
    return tuple(version) if isinstance(version, tuple) else None


def nccl_can_share(version: tuple[int, ...] | None, environ: dict[str, str] | None = None) -> bool:
    """True if NCCL can put several ranks on one GPU: NCCL >= 2.30, or the user said so.

    A user who sets NCCL_MULTI_RANK_GPU_ENABLE=1 themselves (a custom NCCL
    build, say) is taken at their word.
    """
    import os

    env = os.environ if environ is None else environ
    if env.get(SHARED_GPU_ENV) == "1":
        return True
    return version is not None and tuple(version) >= SHARED_GPU_NCCL


def visible_gpus(environ: dict[str, str] | None = None) -> list[int]:
    """Physical GPU indices this process may hand to ranks, without initialising CUDA here.

    CUDA must not be initialised in the process that forks the ranks, so this
    asks torch only when the caller already imported it, and otherwise asks
    ``nvidia-smi``. CUDA_VISIBLE_DEVICES, when set, restricts the list; each
    rank later gets ``CUDA_VISIBLE_DEVICES=<its index>``.
    """
    import os

    env = os.environ if environ is None else environ
    count, already_masked = _gpu_count()
    return gpus_from_mask(env.get("CUDA_VISIBLE_DEVICES"), count, already_masked=already_masked)


def gpus_from_mask(mask: str | None, count: int, *, already_masked: bool) -> list[int]:
    """Apply a CUDA_VISIBLE_DEVICES value to a GPU count (pure; unit-tested).

    ``already_masked``: the count came from torch, which applied the mask itself.
    UUID-style entries are not supported for per-rank assignment; the list ends there.
    """
    if mask is None:
        return list(range(count))
    indices: list[int] = []
    for part in mask.split(","):
        part = part.strip()
        # Like CUDA, the list ends at the first entry it cannot use (UUIDs included).
        if not _NUMBER.match(part) or (not already_masked and int(part) >= count):
            break
        indices.append(int(part))
    return indices[:count] if already_masked else indices


def _gpu_count() -> tuple[int, bool]:
    torch = sys.modules.get("torch")
    if torch is not None:
        return torch.cuda.device_count(), True
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return 0, False
    try:
        out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.TimeoutExpired):
        return 0, False
    return sum(1 for line in out.splitlines() if line.startswith("GPU ")), False
