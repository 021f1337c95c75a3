"""Rank side: which collectives the process group can run on this rank's tensors.

NCCL runs every collective on CUDA tensors, gloo every one on CPU tensors. The
odd case is gloo with CUDA tensors, which nbdist uses when several ranks share
one GPU and NCCL is older than 2.30 (it refuses two ranks on one GPU): gloo
then copies through host memory, and it does so only for some collectives,
depending on the torch build. Rather than trust a table, each rank measures
it once when the group forms (:func:`probe`, a few small collectives), and a
strategy asks before it starts (:func:`require`), so the user gets an error
naming the strategy, the missing collective and the fix, instead of a gloo
error from deep inside FSDP or a hang.

send/recv is the exception, never tried on a CUDA device: gloo's send/recv
hand a CUDA tensor's device address to the socket, and the failed write closes
the connection between the ranks, breaking the group for every later
collective. nbdist copies those through host memory itself
(:mod:`nbdist.engine.p2p_staging`), so send/recv is there.

Example (on CPU everything is there)::

    >>> require("FSDP2 (apply_fsdp)", ("reduce_scatter_tensor",))  # no error
"""

from __future__ import annotations

import datetime
from collections.abc import Callable, Iterable

__all__ = [
    "COLLECTIVES",
    "StrategyUnavailable",
    "missing",
    "probe",
    "require",
    "tensor_all_gather",
    "tensor_reduce_scatter",
]

# A missing collective raises at once on every rank alike (gloo checks the device
# before it sends anything, except send/recv: not probed on CUDA, see the module
# docstring); the bound only guards against a surprise.
_PROBE_WAIT = datetime.timedelta(seconds=30)
# What was found missing on this rank's device, by the last probe (empty: all there).
_missing: dict[str, str] = {}
_context: dict[str, str] = {}


class StrategyUnavailable(RuntimeError):
    """A strategy needs a collective the process group cannot run on these tensors."""


def _all_reduce(dist, torch, device, rank, world):
    t = torch.full((4,), float(rank + 1), device=device)
    return [dist.all_reduce(t, async_op=True)], lambda: t[0].item() == world * (world + 1) / 2


def _broadcast(dist, torch, device, rank, world):
    t = torch.full((4,), float(rank), device=device)
    return [dist.broadcast(t, src=0, async_op=True)], lambda: t.sum().item() == 0


def tensor_all_gather():
    """``torch.distributed``'s all-gather into one tensor, under this torch's name.

    torch 2.13 renamed ``all_gather_into_tensor`` to ``all_gather_single`` (the same
    collective; the old name warns); older torch has only the old one.
    """
    import torch.distributed as dist

    return getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def tensor_reduce_scatter():
    """``reduce_scatter_tensor`` (torch 2.13: ``reduce_scatter_single``), as :func:`tensor_all_gather`."""
    import torch.distributed as dist

    return getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _all_gather_into_tensor(dist, torch, device, rank, world):
    out = torch.empty(2 * world, device=device)
    src = torch.full((2,), float(rank), device=device)
    work = tensor_all_gather()(out, src, async_op=True)
    return [work], lambda: out.tolist() == [float(r) for r in range(world) for _ in range(2)]


def _reduce_scatter_tensor(dist, torch, device, rank, world):
    out = torch.empty(2, device=device)
    src = torch.ones(2 * world, device=device)
    work = tensor_reduce_scatter()(out, src, async_op=True)
    return [work], lambda: out.tolist() == [float(world)] * 2


def _all_to_all_single(dist, torch, device, rank, world):
    out = torch.empty(world, device=device)
    src = torch.full((world,), float(rank), device=device)
    work = dist.all_to_all_single(out, src, async_op=True)
    return [work], lambda: out.tolist() == [float(r) for r in range(world)]


def _send_recv(dist, torch, device, rank, world):
    # A ring: each rank sends to the next and receives from the previous.
    src = torch.full((2,), float(rank), device=device)
    out = torch.empty(2, device=device)
    works = [dist.isend(src, (rank + 1) % world), dist.irecv(out, (rank - 1) % world)]
    return works, lambda: out.tolist() == [float((rank - 1) % world)] * 2


# Name -> probe; the names are the torch.distributed functions strategies call.
COLLECTIVES: dict[str, Callable] = {
    "all_reduce": _all_reduce,
    "broadcast": _broadcast,
    "all_gather_into_tensor": _all_gather_into_tensor,
    "reduce_scatter_tensor": _reduce_scatter_tensor,
    "all_to_all_single": _all_to_all_single,
    "send/recv": _send_recv,
}


def probe(device: str, *, context: str = "") -> dict[str, str]:
    """Try each collective once on ``device``; remember and return {name: why} for those missing.

    Called on every rank right after the group forms, and only for gloo on a
    CUDA device (elsewhere every collective is there). ``context`` says why
    the ranks use gloo on a GPU, for the errors :func:`require` raises.
    """
    import torch
    import torch.distributed as dist

    _missing.clear()
    _context.update(context=context, device=device)
    rank, world = dist.get_rank(), dist.get_world_size()
    for name, attempt in COLLECTIVES.items():
        if name == "send/recv" and (world < 2 or device.startswith("cuda")):
            continue  # on CUDA: trying breaks the group; p2p_staging serves it instead
        try:
            works, correct = attempt(dist, torch, device, rank, world)
            for work in works:
                work.wait(_PROBE_WAIT)
            if not correct():
                _missing[name] = "gave a wrong result"
        except (RuntimeError, ValueError, NotImplementedError) as exc:
            _missing[name] = (
                str(exc).strip().splitlines()[0][:160] if str(exc) else type(exc).__name__
            )
    return dict(_missing)


def missing() -> dict[str, str]:
    """{collective: why} the last probe found missing on this rank ({} if all there)."""
    return dict(_missing)


def require(strategy: str, collectives: Iterable[str]) -> None:
    """Raise :class:`StrategyUnavailable` if ``strategy`` needs a collective found missing.

    The message names the strategy, the collectives, why the group is what it
    is, and the ways out (one rank per GPU, CPU ranks, a newer NCCL).
    """
    lacking = [c for c in collectives if c in _missing]
    if not lacking:
        return
    why = _context.get("context") or "this process group"
    raise StrategyUnavailable(
        f"{strategy} needs {', '.join(lacking)} on {_context.get('device', 'the GPU')}, "
        f"which gloo cannot do here ({_missing[lacking[0]]}); the ranks use gloo because "
        f"{why}. Fix: %dist_start with at most one rank per GPU, or %dist_start N --cpu, "
        "or install a torch built with NCCL >= 2.30 (then ranks share a GPU over NCCL)."
    )
