"""Rank side: the steps of forming the process group, called by the kernel with ``apply``.

Order (each a round trip from the kernel):
1. :func:`describe_rank` on every engine: pid, host, address, GPUs, cores, slot.
2. :func:`open_rendezvous` on rank 0's engine: a listening socket on the
   rendezvous address, port chosen by the OS (no race for a "free" port, and
   it listens only where asked: loopback for a single machine).
3. :func:`init_rank` on every engine at once: environment, threads, device,
   ``init_process_group`` over a TCPStore that uses rank 0's socket, one
   all_reduce to prove the group works, nbdist's patches
   (:mod:`nbdist.engine.patches`), and the user namespace.

The engine's IPython shell is handed in by the kernel
(``ipyparallel.Reference("get_ipython")``, resolved in the rank's namespace), so
this module imports torch and the standard library only, and runs unchanged
where there is no shell (an exported script).
"""

from __future__ import annotations

import datetime
import os
import socket
import time

from nbdist.engine import (
    backend_support,
    collectives,
    control,
    controller_watch,
    crash_record,
    dtensor_caches,
    flight_recorder,
    group_bound,
    own_processes,
    patches,
    pipeline_schedules,
    rank_names,
    torchrun_env,
    user_group,
)
from nbdist.engine.devices import SHARED_GPU_ENV, device_for, visible_gpus
from nbdist.engine.helpers import device as rank_device
from nbdist.engine.helpers import rank as this_rank
from nbdist.engine.helpers import remember_identity
from nbdist.engine.netif import address_towards, choose_socket_ifname
from nbdist.engine.pid_space import pid_space
from nbdist.metrics.log import configure, shutdown

__all__ = [
    "close_rendezvous",
    "describe_rank",
    "init_rank",
    "open_rendezvous",
    "rejoin",
    "rejoin_as_this_rank",
    "teardown",
]

_listener: socket.socket | None = None


def describe_rank(controller_host: str = "127.0.0.1") -> dict:
    """Facts about this engine; touches neither torch nor CUDA."""
    return {
        "pid": os.getpid(),
        "pid_space": pid_space(),  # whether that PID means this process on the kernel's machine
        "host": socket.gethostname(),
        "address": reachable_address(controller_host),
        "gpus": len(visible_gpus()),
        "cores": len(os.sched_getaffinity(0))
        if hasattr(os, "sched_getaffinity")
        else os.cpu_count(),
        "slot": int(os.environ["NBDIST_SLOT"]) if "NBDIST_SLOT" in os.environ else None,
    }


def reachable_address(host: str) -> str:
    """This host's address on the route to ``host`` (what other hosts can reach).

    Where no route is known (no network), the address the hostname resolves to.
    """
    try:
        return address_towards(host)
    except OSError:
        return socket.gethostbyname(socket.gethostname())


def open_rendezvous(address: str) -> int:
    """Listen on ``address`` with an OS-chosen port, kept open for the TCPStore."""
    global _listener
    close_rendezvous()
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind((address, 0))
    listener.listen(128)
    _listener = listener
    return listener.getsockname()[1]


def _forget_listener() -> None:
    global _listener
    _listener = None


def close_rendezvous() -> None:
    """Close the rendezvous socket if this rank still holds it (idempotent)."""
    global _listener
    if _listener is not None:
        _listener.close()
        _listener = None


def _loopback_ifname() -> str:
    names = [name for _, name in socket.if_nameindex()]
    return next((n for n in names if n.startswith("lo")), "lo")


def init_rank(spec: dict, get_shell=None) -> dict:
    """Join the process group as ``spec['rank']`` and fill the user namespace.

    ``get_shell``: the engine's ``get_ipython`` (the kernel passes
    ``ipyparallel.Reference("get_ipython")``); without it no namespace is filled,
    no control requests are served and ``nbdist.log`` is not connected.
    """
    shell = get_shell() if get_shell is not None else None
    # The whole torchrun contract, so code written for torchrun runs unchanged here.
    torchrun_env.apply(
        torchrun_env.torchrun_environment(
            rank=spec["rank"],
            local_rank=spec["local_rank"],
            world_size=spec["world_size"],
            local_world_size=spec["local_world_size"],
            group_rank=spec.get("group_rank", 0),
            group_world_size=spec.get("group_world_size", 1),
            master_addr=spec["master_addr"],
            master_port=spec["master_port"],
            run_id=spec.get("run_id", "nbdist"),
        )
    )
    if spec.get("loopback_only"):
        # Keep gloo/NCCL's own sockets on loopback too; the user's setting wins.
        ifname = _loopback_ifname()
        os.environ.setdefault("GLOO_SOCKET_IFNAME", ifname)
        os.environ.setdefault("NCCL_SOCKET_IFNAME", ifname)
    else:
        # Several hosts: the interface holding this rank's address towards rank 0
        # (the backends' own guess can pick an unreachable one); the user's wins.
        choose_socket_ifname(spec["master_addr"])
    cuda_index = spec.get("cuda_index")
    if spec.get("shares_gpu") and spec["backend"] == "nccl":
        # NCCL >= 2.30 lets ranks share a GPU only when asked (experimental);
        # NVLink SHARP buffers are per GPU, so users of the mode turn them off.
        os.environ.setdefault(SHARED_GPU_ENV, "1")
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")

    import torch

    torch.set_num_threads(spec["threads"])
    # Every rank of a host sees the same GPUs, as under torchrun, and takes its own.
    device = device_for(cuda_index)
    if cuda_index is not None:
        torch.cuda.set_device(torch.device(device))
    elif str(device) == "cpu":
        # What `accelerate launch --cpu` sets: accelerate (HF Trainer too) counts a job on
        # CPU as distributed only when told, so Accelerator() on CPU ranks was one process of
        # one, each rank training alone on all the data. The user's setting wins.
        os.environ.setdefault("ACCELERATE_USE_CPU", "True")

    store_connect_s = _join_group(spec, device)
    remember_identity(
        rank=spec["rank"],
        local_rank=spec["local_rank"],
        world_size=spec["world_size"],
        device=device,
    )
    if spec.get("controller_gone_s"):  # a rank a launcher started, maybe on another host
        own_dir = controller_watch.engine_directory() if spec.get("engine_dir_is_ours") else None
        controller_watch.start(spec["controller_gone_s"], remove_dir=own_dir)
        own_processes.end_at_exit()  # no stop here can see below it
        # No zygote keeps its crash record: where it died of a fatal signal, read by the kernel.
        record = crash_record.open_record()
    else:
        record = ""
    kernel = getattr(shell, "kernel", None)
    patches.install_on_rank(kernel, shell)
    if kernel is not None:
        rank_names.fill(shell, spec, device)
        if spec.get("metrics_url"):
            # The engine's session key is the cluster key the kernel's collector checks.
            # (CurveZMQ: no cluster key; the kernel sent one of its own over the encrypted channel.)
            configure(
                spec["metrics_url"], spec.get("metrics_key") or kernel.session.key, spec["rank"]
            )
    # Plain str: torch.__version__ is a TorchVersion, and unpickling it would
    # import torch (seconds) in a kernel that may never need it.
    return {
        "device": device,
        "torch": str(torch.__version__),
        "threads": torch.get_num_threads(),
        "crash_record": record,
        "gloo_lazy": spec["backend"] == "gloo" and control.gloo_connects_lazily(),
        "store_connect_s": store_connect_s,
    }


def _join_group(spec: dict, device: str) -> float:
    """Form the process group (a fresh TCPStore on rank 0's socket), then prove it works.

    Returns the seconds this rank took to connect to the store (rank 0: also its wait for the
    others), which the kernel reads for ranks held up there (:mod:`nbdist.driver.store_connects`).
    """
    import torch
    import torch.distributed as dist

    if dist.is_initialized():
        _leave_group()
    _count_groups_afresh()
    before = control.socket_snapshot()
    timeout = datetime.timedelta(seconds=spec["timeout"])
    # The store's waits while the group forms (rank 0 for every rank, gloo's ranks for each
    # other's addresses) end with the kernel's patience (the start's --timeout), not the
    # group's: a SIGINT does not reach a rank waiting there in C++, so where a peer never
    # came (stopped, busy) this rank stayed held for --group-timeout (30 minutes by default),
    # deaf to the next try. The group's own timeout serves once it has formed.
    joining = datetime.timedelta(seconds=min(spec["timeout"], spec.get("join_timeout") or 1e9))
    is_master = spec["rank"] == 0
    listen_fd = None
    if is_master and _listener is not None:
        # The store takes the socket over and closes it with the group; detach
        # so Python never closes that fd number again (it may be reused by then).
        listen_fd = _listener.detach()
        _forget_listener()
    connecting = time.perf_counter()
    store = dist.TCPStore(
        spec["master_addr"],
        spec["master_port"],
        spec["world_size"],
        is_master,
        timeout=joining,
        master_listen_fd=listen_fd,
    )
    connect_s = time.perf_counter() - connecting
    # The group records its last collectives (what %dist_where shows of a hang) only
    # when asked before it forms.
    flight_recorder.enable()
    flight_recorder.group_forming()
    # --check-collectives: torch wraps the group in one that compares each collective's kind,
    # shapes and dtypes across the ranks first (TORCH_DISTRIBUTED_DEBUG=DETAIL), read as the
    # group forms. Otherwise the level the environment asks for, as torch's import read it.
    if spec.get("check_collectives"):
        dist.set_debug_level(dist.DebugLevel.DETAIL)
    else:
        dist.set_debug_level_from_env()
    init_kwargs = {}
    if spec["backend"] == "nccl":
        init_kwargs["device_id"] = torch.device(device)
    user_group.original("init_process_group")(
        spec["backend"],
        store=store,
        rank=spec["rank"],
        world_size=spec["world_size"],
        # The group's own timeout (a rank left waiting in a collective), not torch's default.
        timeout=timeout,
        **init_kwargs,
    )
    # One collective proves every rank can reach every other before we say "ready".
    probe = torch.ones(1, device=device) * (spec["rank"] + 1)
    dist.all_reduce(probe)
    expected = spec["world_size"] * (spec["world_size"] + 1) / 2
    if probe.item() != expected:
        raise RuntimeError(f"all_reduce check gave {probe.item()}, expected {expected}")
    store.set_timeout(timeout)  # formed: later groups (new_group, a mesh) wait as the group does

    gloo_on_cuda = spec["backend"] == "gloo" and device.startswith("cuda")
    if gloo_on_cuda:
        # gloo on a GPU copies through host memory, for some collectives only:
        # measure which, so strategies can say so before they start.
        backend_support.probe(device, context=spec.get("gloo_reason", ""))

    # The sockets the group opened (store, gloo pairs): what release() shuts down.
    control.remember_group_sockets(control.socket_snapshot() - before)
    # Counting starts here, the same in both records: the user's first collective is #1.
    flight_recorder.group_formed()
    collectives.reset()
    # gloo's own send/recv of CUDA tensors break the group: staged through host memory.
    patches.install_on_group(
        stage_p2p=gloo_on_cuda,
        gloo_for_nccl=spec.get("gloo_for_nccl", "") if device.startswith("cuda") else "",
    )
    return connect_s


def _count_groups_afresh() -> None:
    # torch names each group by a per-process count (the default group "0", the first
    # new_group "1", ...) that the ranks must agree on: gloo's ranks find each other under
    # that name in the store. A join cut short (a start's --timeout or Ctrl-C on engines
    # that live on, a re-forming interrupted) counted its group on the ranks that got that
    # far only, and destroy_process_group resets the count only when it succeeds; the next
    # join then waited for --group-timeout under names that differ. With no group left,
    # the count starts again, as in a fresh process.
    import torch.distributed as dist

    dist.distributed_c10d._world.group_count = 0  # noqa: SLF001 - torch has no public reset


def _leave_group() -> None:
    import torch.distributed as dist

    try:
        user_group.original("destroy_process_group")()
    except Exception:  # a released (broken) group may refuse a clean exit; it is gone anyway
        # torch has no public way to forget a group whose destroy failed.
        c10d = dist.distributed_c10d
        c10d._world.pg_map.clear()  # noqa: SLF001
        c10d._update_default_pg(None)  # noqa: SLF001


def rejoin(spec: dict, get_shell=None) -> dict:
    """Form the group again on a rank whose process survived (after a release).

    Only the group changes: the namespace, models and tensors stay. Objects
    bound to the old group (a ``DistributedDataParallel`` wrapper) must be
    made again. Returns this rank's last collective before the group was formed
    again (``before``), the user's variables bound to the old group (``stale``:
    ``(name, what)`` pairs) and the pipeline schedules whose step was cut short (``cut``:
    ``(name, class)``); none without ``get_shell``.
    """
    before = collectives.last()
    shell = get_shell() if get_shell is not None else None
    namespace = shell.user_ns if shell is not None else {}
    try:
        stale = group_bound.bound_to_group(namespace)
        cut = pipeline_schedules.cut_short(namespace)
    except Exception:  # a note for the user must never stop the group from forming again
        stale, cut = [], []
    os.environ["MASTER_PORT"] = str(spec["master_port"])
    # A new mesh over the same ranks must not be handed the old one from DTensor's caches.
    dtensor_caches.forget_meshes()
    _join_group(spec, str(rank_device()))
    return {"before": before, "stale": stale, "cut": cut}


def rejoin_as_this_rank(base: dict, get_shell=None) -> dict:
    """:func:`rejoin` with this rank's own number (the kernel sends every rank the same ``base``)."""
    return rejoin({**base, "rank": this_rank()}, get_shell)


def teardown() -> None:
    """Leave the process group (before the engines stop)."""
    import torch.distributed as dist

    shutdown()
    if dist.is_initialized():
        user_group.original("destroy_process_group")()
    close_rendezvous()
