"""Rank side: Horovod's data-parallel recipe, with real Horovod when it is installed, else emulated.

Horovod (Sergeev & Del Balso 2018) made data parallelism a two-line change to a
single-process script::

    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())

The optimizer wrapper starts an all-reduce of each gradient *as soon as backward
has produced it* (a hook per parameter), so communication of late layers
overlaps the backward pass of early ones, and ``step()`` waits for all of them
and averages before updating.

**Real Horovod** (0.28.1, its last release) builds against torch 2.13 only with
C++17 patches: ``scripts/build_horovod.sh`` does that. When ``horovod.torch``
imports, :func:`init_horovod` runs a real ``hvd.init()`` on nbdist's ranks: a
:class:`Rendezvous` (Horovod's HTTP rendezvous server, started in the kernel,
on loopback) replaces ``horovodrun``, and each rank gets the ``HOROVOD_*``
environment ``horovodrun`` would have set. Running it again (after
``%dist_restart``, or to re-initialise) shuts the previous Horovod down first.

**The emulation** (this module's own :func:`DistributedOptimizer`,
:func:`broadcast_parameters`, ...) does the same with ``torch.distributed``
(any backend: gloo on CPU, NCCL on GPUs): for code written in Horovod's style
without Horovod, or as a readable model of what DDP's C++ reducer does (DDP
adds gradient bucketing on top). :func:`init_horovod` returns it, with
``rank()``, ``size()`` and ``local_rank()``, when Horovod is not installed, so
the same loop runs either way.

Example (the kernel holds the server, the ranks initialise)::

    rendezvous = start_rendezvous(2) if horovod_status()[0] else None   # in the kernel
    hvd = init_horovod(port)           # on each rank: horovod.torch, or this module
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    loss_fn(model(x), y).backward()      # all-reduces start here, one per gradient
    opt.step()                           # waits, averages, updates
"""

from __future__ import annotations

import os
import sys
import threading

import torch
import torch.distributed as dist
from torch import nn

__all__ = [
    "DistributedOptimizer",
    "Rendezvous",
    "broadcast_optimizer_state",
    "broadcast_parameters",
    "horovod_status",
    "init_horovod",
    "local_rank",
    "rank",
    "size",
    "start_rendezvous",
]

# Horovod reads these in hvd.init(); horovodrun would set them for each process it starts.
_HOROVOD_ENV = ("RANK", "SIZE", "LOCAL_RANK", "LOCAL_SIZE", "CROSS_RANK", "CROSS_SIZE")
_HOST = "localhost"  # the host name in the rendezvous plan and in HOROVOD_HOSTNAME


def horovod_status() -> tuple[bool, str]:
    """``(True, "horovod 0.28.1 ...")`` when ``horovod.torch`` imports here, else ``(False, why)``.

    Example::

        real, why = horovod_status()
        print("Horovod:", why)
    """
    try:
        import horovod
        import horovod.torch as hvd
    except Exception as exc:  # ImportError, or a build that does not load (an OSError)
        return False, f"not importable ({type(exc).__name__}: {exc}); using nbdist's emulation"
    if not hvd.gloo_built():
        return (
            False,
            f"horovod {horovod.__version__} was built without gloo; using nbdist's emulation",
        )
    return True, f"horovod {horovod.__version__} (gloo), real hvd.init() on the ranks"


class Rendezvous:
    """Kernel side: Horovod's HTTP rendezvous server for one machine's ``world_size`` ranks.

    What ``horovodrun`` runs in its own process: the ranks' gloo contexts find
    each other through it in ``hvd.init()``. Bound to ``host`` (loopback by
    default) on a free port (``.port``). :meth:`reset` starts a new round (it
    is called at start; call it again after ranks died mid-initialisation);
    :meth:`stop` ends the server.
    """

    def __init__(self, world_size: int, *, host: str = "127.0.0.1", verbose: int = 0) -> None:
        """Start serving on ``host``; needs Horovod installed in the kernel's environment."""
        from horovod.runner.http.http_server import RendezvousHandler, RendezvousHTTPServer

        if world_size < 1:
            raise ValueError(f"world_size={world_size}: the number of ranks, at least 1")
        self.world_size = world_size
        self.host = host
        # horovod.runner's RendezvousServer binds every interface; this one binds only `host`.
        self._httpd = RendezvousHTTPServer((host, 0), RendezvousHandler, verbose)
        self.port = self._httpd.server_address[1]
        self._thread = threading.Thread(
            target=self._httpd.serve_forever, name="horovod-rendezvous", daemon=True
        )
        self._thread.start()
        self.reset()

    def reset(self) -> None:
        """Forget every key: the next ``hvd.init()`` on the ranks is a fresh round."""
        from horovod.runner.common.util.hosts import get_host_assignments, parse_hosts

        plan = get_host_assignments(parse_hosts(f"{_HOST}:{self.world_size}"), self.world_size)
        self._httpd.init(plan)

    def stop(self) -> None:
        """Stop serving and close the socket."""
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join()

    def __repr__(self) -> str:
        """Where it listens."""
        return f"Rendezvous({self.world_size} ranks at {self.host}:{self.port})"


def start_rendezvous(world_size: int, *, host: str = "127.0.0.1") -> Rendezvous:
    """Kernel side: start a :class:`Rendezvous` for ``world_size`` ranks on this machine.

    Example::

        rendezvous = start_rendezvous(2)
        %dist_push rendezvous_port       # after rendezvous_port = rendezvous.port
    """
    return Rendezvous(world_size, host=host)


def init_horovod(
    port: int | None, *, addr: str = "127.0.0.1", iface: str = "lo", timeout_s: int = 30
):
    """On each rank: real ``hvd.init()`` through the kernel's rendezvous at ``addr:port``.

    Returns ``horovod.torch``, initialised with the rank and size of nbdist's
    process group (shut down first if it already was: re-running the cell
    re-initialises). ``port=None`` (no Horovod in the kernel) returns this
    module, the emulation, with the same ``rank()``, ``size()``,
    ``DistributedOptimizer`` and ``broadcast_parameters``. ``iface``: the
    network interface gloo uses (``lo`` on one machine); ``timeout_s``: how long
    ``hvd.init()`` waits for every rank.

    Example::

        hvd = init_horovod(rendezvous_port)
        print(hvd.rank(), hvd.size())
    """
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            "init_horovod runs on nbdist's ranks (%%on_all_ranks), inside their process group"
        )
    if port is None:
        return sys.modules[__name__]
    import horovod.torch as hvd

    world, me = dist.get_world_size(), dist.get_rank()
    local_size = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    if local_size != world:
        raise RuntimeError(
            f"real Horovod through nbdist runs on one machine: {world} ranks, {local_size} on this "
            "one; use horovodrun across machines, or port=None for nbdist's emulation"
        )
    values = (me, world, int(os.environ.get("LOCAL_RANK", me)), local_size, 0, 1)
    env = {f"HOROVOD_{k}": str(v) for k, v in zip(_HOROVOD_ENV, values)}
    env.update(
        HOROVOD_HOSTNAME=_HOST,
        HOROVOD_GLOO_RENDEZVOUS_ADDR=addr,
        HOROVOD_GLOO_RENDEZVOUS_PORT=str(int(port)),
        HOROVOD_CONTROLLER="gloo",
        HOROVOD_CPU_OPERATIONS="gloo",
        HOROVOD_GLOO_IFACE=iface,
        HOROVOD_GLOO_TIMEOUT_SECONDS=str(int(timeout_s)),
    )
    os.environ.update(env)
    if hvd.is_initialized():
        hvd.shutdown()
    hvd.init()
    if (hvd.rank(), hvd.size()) != (me, world):
        raise RuntimeError(
            f"hvd.init() gave rank {hvd.rank()} of {hvd.size()}, nbdist's group says {me} of {world}"
        )
    return hvd


def rank() -> int:
    """Emulation of ``hvd.rank()``: this rank in the process group."""
    return dist.get_rank()


def size() -> int:
    """Emulation of ``hvd.size()``: the number of ranks."""
    return dist.get_world_size()


def local_rank() -> int:
    """Emulation of ``hvd.local_rank()``: this rank's index on its machine (``LOCAL_RANK``)."""
    return int(os.environ.get("LOCAL_RANK", dist.get_rank()))


def _broadcast(tensor: torch.Tensor, root_rank: int) -> None:
    # NCCL moves only GPU tensors; CPU ones (Adam's step counters) go through the GPU.
    if tensor.device.type == "cpu" and dist.get_backend() == "nccl":
        staged = tensor.cuda()
        dist.broadcast(staged, root_rank)
        tensor.copy_(staged)
    else:
        dist.broadcast(tensor, root_rank)


def broadcast_parameters(params, root_rank: int = 0) -> None:
    """Copy ``root_rank``'s tensors to every rank, in place.

    ``params``: a ``state_dict()``, ``named_parameters()`` or a list of tensors,
    the same order on every rank. Call once before training so every rank starts
    from the same weights.

    Example::

        broadcast_parameters(model.state_dict(), root_rank=0)
    """
    items = params.values() if isinstance(params, dict) else params
    with torch.no_grad():
        for item in items:
            tensor = item[1] if isinstance(item, tuple) else item
            _broadcast(tensor.data if isinstance(tensor, nn.Parameter) else tensor, root_rank)


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root_rank: int = 0) -> None:
    """Copy ``root_rank``'s optimizer state tensors (momentum, moments) to every rank.

    Needed after loading a checkpoint on one rank only; the state must already
    exist with the same shapes on every rank (e.g. after one step).

    Example::

        broadcast_optimizer_state(opt, root_rank=0)
    """
    for group in optimizer.param_groups:
        for p in group["params"]:
            for _, value in sorted(optimizer.state.get(p, {}).items()):
                if isinstance(value, torch.Tensor):
                    _broadcast(value, root_rank)


class _GradientAverager:
    """The hooks and pending all-reduces behind :func:`DistributedOptimizer`."""

    def __init__(self, params: list[nn.Parameter], group) -> None:
        self.group = group
        self.world = dist.get_world_size(group)
        self.pending: dict[nn.Parameter, dist.Work] = {}
        self.params = params
        self.reduced_count = 0  # all-reduces launched by the hooks since construction
        self.handles = [p.register_post_accumulate_grad_hook(self._launch) for p in params]

    def _launch(self, param: nn.Parameter) -> None:
        # Runs inside backward, the moment this gradient is complete: the
        # all-reduce proceeds while autograd computes the earlier layers.
        if param in self.pending:
            raise RuntimeError(
                "a gradient was produced twice before optimizer.step(): gradient "
                "accumulation over several backward passes is not supported by "
                "DistributedOptimizer; call step() after each backward()"
            )
        self.pending[param] = dist.all_reduce(param.grad, group=self.group, async_op=True)
        self.reduced_count += 1

    def synchronize(self) -> None:
        # Every rank must reduce the same gradients in the same order; a
        # parameter whose hook did not fire (no grad this step) is skipped on all
        # ranks alike only if the model is used identically everywhere.
        for param, work in self.pending.items():
            work.wait()
            param.grad.div_(self.world)
        self.pending.clear()

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def DistributedOptimizer(
    optimizer: torch.optim.Optimizer, named_parameters=None, *, group=None
) -> torch.optim.Optimizer:
    """Make ``optimizer`` average gradients over the ranks, all-reducing during backward.

    Returns the same optimizer object (so LR schedulers and ``state_dict`` keep
    working) with a hook on each of its parameters that launches an asynchronous
    all-reduce when the parameter's gradient is ready, and a step pre-hook that
    waits for them and divides by the world size. ``named_parameters`` is
    accepted for Horovod's call shape and ignored (the optimizer's own
    parameters are the ones averaged). ``optimizer.synchronize()`` waits without
    stepping (e.g. before gradient clipping); ``optimizer.remove_hooks()`` undoes it.

    Example::

        opt = DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=1e-3))
        loss.backward(); torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # after synchronize()
    """
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            "DistributedOptimizer needs a process group: run it on the ranks (%%on_all_ranks) "
            "or call torch.distributed.init_process_group first"
        )
    from nbdist.strategies.arguments import require_optimizer

    require_optimizer(optimizer, "DistributedOptimizer")
    if getattr(optimizer, "nbdist_averager", None) is not None:
        raise ValueError("this optimizer is already a DistributedOptimizer")
    params = [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad]
    if len({id(p) for p in params}) != len(params):
        raise ValueError("a parameter appears twice in the optimizer's param groups")
    averager = _GradientAverager(params, group)
    pre_step = optimizer.register_step_pre_hook(lambda opt, args, kwargs: averager.synchronize())

    def remove_hooks() -> None:
        averager.remove()
        pre_step.remove()
        optimizer.nbdist_averager = None

    optimizer.nbdist_averager = averager
    optimizer.synchronize = averager.synchronize
    optimizer.remove_hooks = remove_hooks
    return optimizer
