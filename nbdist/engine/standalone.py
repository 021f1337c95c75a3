"""Rank side, under ``torchrun``: what ``%dist_start`` gives a cell, for an exported script.

A script written by ``%dist_export`` starts with :func:`init`, which forms the
process group from the launcher's environment and returns the names every
``%%on_all_ranks`` cell could use (``rank``, ``local_rank``, ``world_size``,
``device``). ``nbdist.log`` keeps working: rank 0 collects every rank's points
into the run history (``nbdist.runs()`` reads them afterwards), over the same
signed channel the notebook uses, listening on loopback unless the ranks span
several hosts (then on rank 0's address on the route to them; the key goes to
the ranks over the process group, as plain as the collectives themselves).

Launchers understood: ``torchrun`` (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR...),
``srun`` (SLURM_PROCID, SLURM_LOCALID, SLURM_NTASKS; MASTER_ADDR/MASTER_PORT
must be exported by the batch script) and a plain ``python script.py`` (one rank).

Example::

    import torch, torch.distributed as dist, nbdist
    from nbdist.engine.standalone import init, finish

    rank, local_rank, world_size, device = init()
    nbdist.log(step=0, loss=1.0)
    finish()   # also runs at exit
"""

from __future__ import annotations

import atexit
import os
import secrets
import sys

from nbdist.engine import backend_support, patches
from nbdist.engine.devices import (
    SHARED_GPU_ENV,
    choose_backend,
    local_device,
    nccl_can_share,
    nccl_version,
)
from nbdist.engine.helpers import remember_identity
from nbdist.engine.netif import address_towards, choose_socket_ifname, is_loopback
from nbdist.metrics.log import configure, flush, shutdown

__all__ = ["finish", "init", "launcher_environment", "metrics_run"]

_state: dict = {}
# How long rank 0 waits at the end for the other ranks' last points.
_FINAL_WAIT_S = 10.0


def launcher_environment(environ: dict[str, str]) -> dict[str, str]:
    """RANK/LOCAL_RANK/WORLD_SIZE/LOCAL_WORLD_SIZE/MASTER_* from torchrun's or srun's variables.

    Pure (unit-tested): returns the torchrun-style variables to use.

    >>> launcher_environment({"SLURM_PROCID": "3", "SLURM_LOCALID": "1", "SLURM_NTASKS": "4",
    ...     "SLURM_NTASKS_PER_NODE": "2", "MASTER_ADDR": "node1"})["LOCAL_WORLD_SIZE"]
    '2'
    """
    keys = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    if "RANK" in environ:
        out = {k: environ[k] for k in keys if k in environ}
        out.setdefault("LOCAL_RANK", "0")
        out.setdefault("WORLD_SIZE", "1")
        out.setdefault("LOCAL_WORLD_SIZE", out["WORLD_SIZE"])
        return out
    if "SLURM_PROCID" in environ:
        if not environ.get("MASTER_ADDR"):
            raise RuntimeError(
                "running under srun without MASTER_ADDR: export it in the batch script, e.g. "
                "export MASTER_ADDR=$(scontrol show hostnames $SLURM_JOB_NODELIST | head -n 1)"
            )
        per_node = environ.get("SLURM_NTASKS_PER_NODE", "").split("(")[0]
        return {
            "RANK": environ["SLURM_PROCID"],
            "LOCAL_RANK": environ.get("SLURM_LOCALID", "0"),
            "WORLD_SIZE": environ.get("SLURM_NTASKS", "1"),
            "LOCAL_WORLD_SIZE": per_node or environ.get("SLURM_NTASKS", "1"),
            "MASTER_ADDR": environ["MASTER_ADDR"],
            "MASTER_PORT": environ.get("MASTER_PORT", "29500"),
        }
    return {}


def init(backend: str | None = None, *, history: str | bool | None = None):
    """Form the process group and set up ``nbdist.log``; returns rank, local_rank, world_size, device.

    ``backend``: 'nccl'/'gloo' (default: nccl with GPUs, gloo without).
    ``history``: a run history path, None for the default, False to keep no points.
    """
    import torch
    import torch.distributed as dist

    env = launcher_environment(dict(os.environ))
    os.environ.update(env)
    rank, world = int(env.get("RANK", 0)), int(env.get("WORLD_SIZE", 1))
    local_rank = int(env.get("LOCAL_RANK", 0))
    use_gpus = torch.cuda.is_available()
    # More local ranks than GPUs: they share them round robin (local_device), over
    # NCCL >= 2.30 or else gloo with CUDA tensors, as ranks in the notebook do.
    shares = use_gpus and int(env.get("LOCAL_WORLD_SIZE", 1)) > torch.cuda.device_count()
    if shares and backend is None:
        chosen = "nccl" if nccl_can_share(nccl_version()) else "gloo"
    else:
        chosen = choose_backend(backend, uses_gpus=use_gpus)
    device = "cpu"
    if chosen == "nccl" or shares:
        device = local_device(local_rank)
        torch.cuda.set_device(torch.device(device))
    if shares and chosen == "nccl":
        os.environ.setdefault(SHARED_GPU_ENV, "1")
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    if not dist.is_initialized():
        kwargs = {"device_id": torch.device(device)} if chosen == "nccl" else {}
        if env:
            master = env.get("MASTER_ADDR", "127.0.0.1")
            # A MASTER_ADDR host name can resolve to loopback on rank 0's own host
            # (Debian's 127.0.1.1): there, leave the choice to gloo/NCCL (or the user).
            if _several_hosts(env) and not _is_loopback_or_unknown(_address_or_empty(master)):
                choose_socket_ifname(master)
            dist.init_process_group(chosen, **kwargs)
        else:  # plain `python script.py`: a group of one, nothing listens
            dist.init_process_group(chosen, store=dist.HashStore(), rank=0, world_size=1, **kwargs)
    gloo_on_cuda = chosen == "gloo" and device != "cpu"
    reason = ""
    if gloo_on_cuda:
        reason = "more ranks than GPUs share them and this torch's NCCL cannot (< 2.30)"
        backend_support.probe(device, context=reason)
    # gloo's own send/recv of CUDA tensors break the group: staged through host memory.
    # The cells' own init_process_group/destroy_process_group meet this group, as on the ranks.
    patches.install_in_script(stage_p2p=gloo_on_cuda, gloo_for_nccl=reason)
    remember_identity(rank=rank, local_rank=local_rank, world_size=world, device=device)
    _state.update(rank=rank, world_size=world)
    if history is not False:
        _open_metrics(rank, world, chosen, env, history)
    atexit.register(finish)
    return rank, local_rank, world, torch.device(device)


def _open_metrics(rank: int, world: int, backend: str, env: dict, history) -> None:
    import torch.distributed as dist

    several = world > 1 and _several_hosts(env)
    seen: list = [None] * world
    if several:
        # Every rank's address towards rank 0: rank 0 listens where the other hosts route.
        dist.all_gather_object(seen, _address_or_empty(env.get("MASTER_ADDR", "127.0.0.1")))
    found = [None]
    if rank == 0:
        from nbdist.metrics.collector import Collector
        from nbdist.metrics.store import RunStore

        # Loopback unless ranks run on other hosts: then rank 0's address towards them.
        ip = _collector_address(seen, env.get("MASTER_ADDR", "")) if several else "127.0.0.1"
        store = RunStore(history if isinstance(history, str) else None)
        label = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else "script"
        run = store.new_run(world_size=world, backend=backend, label=label)
        key = secrets.token_bytes(32)
        collector = Collector(key, run, store, ip=ip)
        _state.update(collector=collector, store=store, run=run)
        found = [(collector.url, key)]
    if world > 1:
        dist.broadcast_object_list(found, src=0)
    url, key = found[0]
    configure(url, key, rank)


def _address_or_empty(host: str) -> str:
    try:
        return address_towards(host)
    except OSError:
        return ""


def _is_loopback_or_unknown(address: str) -> bool:
    # '' is an address a rank could not find: as useless to another host as loopback.
    return not address or is_loopback(address)


def _collector_address(seen: list, master: str) -> str:
    """Rank 0's address on the route to a rank of another host (``seen``: by rank)."""
    own = seen[0] or ""
    for address in seen[1:]:
        if address and address != own and not _is_loopback_or_unknown(address):
            found = _address_or_empty(address)
            if found and not _is_loopback_or_unknown(found):
                return found
    return _address_or_empty(master) or "127.0.0.1"


def _several_hosts(env: dict[str, str]) -> bool:
    return int(env.get("LOCAL_WORLD_SIZE", 1)) < int(env.get("WORLD_SIZE", 1))


def metrics_run():
    """On rank 0: the :class:`~nbdist.metrics.run.Run` its collector fills with every rank's
    points (None on other ranks, or before :func:`init`).

    Hand them to a tracker without slowing the training loop, on a thread of rank 0::

        fwd = metrics_run().forward(lambda p: wandb.log(p.values, step=p.step), ranks=[0])
        ...
        finish()
        fwd.close()   # after finish(): the last points arrive during it
    """
    return _state.get("run")


def finish() -> None:
    """Send the last points, close the run (rank 0) and leave the group; idempotent."""
    if _state.get("finished") or "rank" not in _state:
        return
    _state["finished"] = True
    try:
        flush({"cell": 1})  # the end marker: rank 0 waits for every rank's
        shutdown()
    finally:
        collector = _state.pop("collector", None)
        if collector is not None:
            collector.wait_for_cells(
                {r: 1 for r in range(_state["world_size"])}, timeout=_FINAL_WAIT_S
            )
            collector.stop()
            store, run = _state.pop("store"), _state.pop("run")
            store.end_run(run.id)
            store.close()
        import torch.distributed as dist

        from nbdist.engine.user_group import original

        if dist.is_initialized():  # torch's own: the script's destroy_process_group leaves it up
            original("destroy_process_group")()
