"""Rank side: torch's functional all-gather of CUDA tensors on gloo, served by the c10d all-gather.

Where several ranks share one GPU and torch's NCCL is older than 2.30, nbdist's
group is gloo with CUDA tensors. There, torch's *functional* all-gather
(``torch.ops._c10d_functional.all_gather_into_tensor``, what DTensor's
``full_tensor()``, a Shard -> Replicate redistribute, tensor and sequence
parallel layers and ``get_model_state_dict(full_state_dict=True)`` call) kills
both ranks with a segmentation fault: measured with plain torch 2.11 (cu130,
NCCL 2.28.9) on an H200, two processes, no nbdist. The c10d call that does the
same thing, ``dist.all_gather_into_tensor``, works on the same tensors (gloo
copies them through host memory), as do the functional all-reduce and
reduce-scatter and FSDP2's training step. Examples 09, 11, 26 and 27 died there.

:func:`install` (called when such a group forms, never otherwise) registers a
CUDA kernel for the three functional all-gather operators
(``all_gather_into_tensor``, its ``_out`` and ``_coalesced`` forms) that runs the
c10d all-gather instead and returns the gathered tensor, already complete: the
caller's later ``wait_tensor`` finds no pending work and returns at once. The
kernel sits under autograd (the operators' own backward, a reduce-scatter, is
unchanged) and is not used when tracing (fake tensors have kernels of their
own). What it costs: the gather runs synchronously, where the functional form
would let the caller overlap it; on gloo with CUDA tensors it is a host-memory
copy either way.

``install(cpu_tensors=True)`` registers the same kernel for CPU tensors
(``NBDIST_GPU_LIKE=1``: machines without a GPU run every line of it, tests).
"""

from __future__ import annotations

from nbdist.engine import backend_support

__all__ = ["calls", "install", "serves_cuda"]

_OPS = ("all_gather_into_tensor", "all_gather_into_tensor_out", "all_gather_into_tensor_coalesced")
_library = None  # the torch.library.Library holding the kernels: alive as long as they are
_keys: set[str] = set()
_calls = 0


def serves_cuda() -> bool:
    """Whether this rank's functional all-gathers of CUDA tensors go through the c10d all-gather."""
    return "CUDA" in _keys


def calls() -> int:
    """How many functional all-gathers the kernel served on this rank (tests, diagnostics)."""
    return _calls


def _gather_into(out, tensor, group_name) -> None:
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _resolve_process_group

    global _calls
    _calls += 1
    # The operators take a group's name, or (torch 2.13's schema says Any) the group itself.
    group = group_name if isinstance(group_name, dist.ProcessGroup) else None
    group = group or _resolve_process_group(group_name)
    backend_support.tensor_all_gather()(out, tensor.contiguous(), group=group)


def _gathered_like(tensor, group_size):
    return tensor.new_empty((group_size * tensor.shape[0], *tensor.shape[1:]))


def _all_gather_into_tensor(tensor, group_size, group_name):
    out = _gathered_like(tensor, group_size)
    _gather_into(out, tensor, group_name)
    return out


def _all_gather_into_tensor_out(tensor, group_size, group_name, *, out):
    _gather_into(out, tensor, group_name)
    return out


def _all_gather_into_tensor_coalesced(tensors, group_size, group_name):
    return [_all_gather_into_tensor(t, group_size, group_name) for t in tensors]


def install(*, cpu_tensors: bool = False) -> None:
    """Serve the functional all-gathers of CUDA tensors (and CPU ones, ``cpu_tensors``); idempotent."""
    global _library
    wanted = {"CUDA"} | ({"CPU"} if cpu_tensors else set())
    new = wanted - _keys
    if not new:
        return
    import torch
    import torch.distributed._functional_collectives  # noqa: F401 - defines the operators

    if _library is None:
        _library = torch.library.Library("_c10d_functional", "IMPL")
    kernels = {
        "all_gather_into_tensor": _all_gather_into_tensor,
        "all_gather_into_tensor_out": _all_gather_into_tensor_out,
        "all_gather_into_tensor_coalesced": _all_gather_into_tensor_coalesced,
    }
    for key in sorted(new):
        for name in _OPS:
            _library.impl(name, kernels[name], key)
        _keys.add(key)
