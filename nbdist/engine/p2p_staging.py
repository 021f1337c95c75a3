"""Rank side: send/recv of CUDA tensors over gloo, copied through host memory by nbdist.

Where several ranks share one GPU and torch's NCCL is older than 2.30, nbdist's
group is gloo with CUDA tensors. gloo copies CUDA tensors through host memory
for its collectives (all_reduce, broadcast, all_gather, reduce_scatter,
all_to_all, DDP: all measured to work with torch 2.11 on an H200), but not for
send/recv: it hands the tensor's device address to the socket, the write fails
("writev ... Bad address") and the failure closes the connection between the
two ranks, so every later collective of the group fails too. Hand-written
all-reduces (example 03), pipeline parallelism and ring attention all use
send/recv.

:func:`install` (called when such a group forms, never otherwise) replaces
``send``, ``recv``, ``isend``, ``irecv`` and ``batch_isend_irecv`` of
``torch.distributed`` (and ``isend``/``irecv`` of ``distributed_c10d`` too, where
``P2POp`` checks that its op is one of them) with versions that send a CPU copy
and receive into a CPU buffer, copying it into the CUDA tensor when the receive
completes (for ``irecv``, when its work's ``wait()`` returns). CPU tensors go
straight through. What it costs: one device-to-host copy per send and one
host-to-device copy per receive, on top of gloo's own host-memory transfer.
A reference to the original function stays in each replacement's ``nbdist_plain``.

The copy into the received tensor runs without autograd, as NCCL's own receive
writes: torch's pipelining receives into leaf tensors that require grad, where
an in-place copy under autograd raises ("a leaf Variable that requires grad is
being used in an in-place operation"; seen on an H200 with examples 12 and 18).
``install(stage_cpu_tensors=True)`` stages CPU tensors through a host copy as
well, so machines without a GPU run every line of the staging path (tests).
"""

from __future__ import annotations

import functools

__all__ = ["install", "installed"]

_installed = False
_stage_cpu_tensors = False  # install(stage_cpu_tensors=True): the staging path on CPU too


def _staged(tensor) -> bool:
    return tensor.is_cuda or _stage_cpu_tensors


def _copy_received(tensor, buffer) -> None:
    import torch

    with torch.no_grad():  # a receive writes data, as NCCL's does: no autograd record
        tensor.copy_(buffer)


def installed() -> bool:
    """Whether point-to-point calls are staged through host memory on this rank."""
    return _installed


class _ReceivedWork:
    """A receive's work: ``wait()`` waits for gloo, then copies the host buffer into the tensor."""

    def __init__(self, work, tensor, buffer) -> None:
        self._work = work
        self._copy = (tensor, buffer)  # done once, at the first wait()

    def wait(self, *args, **kwargs):
        result = self._work.wait(*args, **kwargs)
        if self._copy is not None:
            tensor, buffer = self._copy
            self._copy = None
            _copy_received(tensor, buffer)
        return result

    def __getattr__(self, name):  # is_completed, exception, source_rank, ...: gloo's work
        return getattr(self._work, name)


def _sender(plain):
    """``plain`` (send or isend) given a host copy of a CUDA tensor; the work holds the copy."""

    @functools.wraps(plain)
    def send(tensor, *args, **kwargs):
        staged = tensor.detach().to("cpu", copy=True) if _staged(tensor) else tensor
        return plain(staged, *args, **kwargs)

    return send


def _receiver(plain, *, asynchronous: bool):
    """``plain`` (recv or irecv) into a host buffer, copied into the CUDA tensor once it arrived."""

    @functools.wraps(plain)
    def recv(tensor, *args, **kwargs):
        if not _staged(tensor):
            return plain(tensor, *args, **kwargs)
        import torch

        buffer = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu")
        result = plain(buffer, *args, **kwargs)
        if asynchronous:  # irecv: the data is there only after the work's wait()
            return _ReceivedWork(result, tensor, buffer)
        _copy_received(tensor, buffer)
        return result

    return recv


def _unwrapped(op, plain: set):
    """``op``, or the function of ``plain`` it wraps (nbdist's collectives wrapper, installed
    after this module's, is what ``dist.isend`` is then)."""
    while op not in plain and hasattr(op, "nbdist_original"):
        op = op.nbdist_original
    return op


def install(*, stage_cpu_tensors: bool = False) -> None:
    """Stage point-to-point calls of CUDA tensors through host memory (idempotent).

    ``stage_cpu_tensors=True`` copies CPU tensors through a host buffer too (for tests
    of the staging path on machines without a GPU; no use otherwise).
    """
    global _installed, _stage_cpu_tensors
    _stage_cpu_tensors = _stage_cpu_tensors or stage_cpu_tensors
    if _installed:
        return
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    isend = _sender(c10d.isend)
    irecv = _receiver(c10d.irecv, asynchronous=True)
    sending = {isend, c10d.isend}
    plain_batch = c10d.batch_isend_irecv

    @functools.wraps(plain_batch)
    def batch_isend_irecv(p2p_op_list):
        # Each op posted on its own (gloo's CPU path does the same): both sides are
        # posted before any is waited on, so a ring cannot deadlock.
        works = []
        for p2p in p2p_op_list:
            # P2POp keeps the peer both ways (global and group rank): pass the group one.
            if _unwrapped(p2p.op, sending) in sending:
                work = isend(p2p.tensor, group=p2p.group, tag=p2p.tag, group_dst=p2p.group_peer)
            else:
                work = irecv(p2p.tensor, group=p2p.group, tag=p2p.tag, group_src=p2p.group_peer)
            if work is not None:
                works.append(work)
        return works

    replacements = {
        "send": _sender(c10d.send),
        "recv": _receiver(c10d.recv, asynchronous=False),
        "isend": isend,
        "irecv": irecv,
        "batch_isend_irecv": batch_isend_irecv,
    }
    for name, replacement in replacements.items():
        replacement.nbdist_plain = getattr(c10d, name)
        setattr(dist, name, replacement)
        if name in ("isend", "irecv"):
            # P2POp (and pipelining's own checks) compare ops with these by identity.
            setattr(c10d, name, replacement)
    _installed = True
