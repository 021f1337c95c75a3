"""Forming the process group over a session's engines (kernel side).

The engines describe themselves (host, address, GPUs, slot), the ranks are
numbered (by slot where nbdist started them, host by host where attached), rank 0
opens the rendezvous socket, and every rank joins the group; each rank's
``init_rank`` returns only after one collective succeeded.
"""

from __future__ import annotations

import time

from .placement import EngineInfo, plan_attached
from .runner import RankRun

__all__ = ["controller_host", "form_group", "metrics_ip", "metrics_key"]


def form_group(session) -> None:
    """Describe the engines, number the ranks, open the rendezvous and init every rank.

    Sets ``session.placement`` (attached clusters), ``session._ranks``,
    ``session._rendezvous_addr`` and clears ``session.cells`` (fresh namespaces).
    """
    from . import _bootstrap  # rank-side code, shipped to the engines (imports torch there)
    from .cluster import serializer_ready
    from .session import RankInfo

    handle, opts = session._handle, session.options
    client = handle.client
    serializer_ready()  # the serializer's set-up may still run on its thread: not thread-safe
    engine_ids = sorted(client.ids)
    towards = opts["ip"] if handle.owned else controller_host(client)
    infos = dict(zip(engine_ids, client[engine_ids].apply_sync(_bootstrap.describe, towards)))
    if handle.owned and all(info["slot"] is not None for info in infos.values()):
        by_slot = {info["slot"]: eid for eid, info in infos.items()}
        engine_of = {slot.rank: by_slot[slot.local_rank] for slot in session.placement.slots}
        slots = {engine_of[s.rank]: s for s in session.placement.slots}
    else:
        placement, slots = plan_attached(
            [EngineInfo(e, i["host"], i["address"], i["gpus"]) for e, i in infos.items()],
            cores={i["host"]: i["cores"] for i in infos.values()},
            backend=opts["backend"],
            cpu=opts["cpu"],
            threads=opts["threads"],
        )
        session.placement = placement
    rank0_engine = next(e for e, s in slots.items() if s.rank == 0)
    master_addr = infos[rank0_engine]["address"]
    session._rendezvous_addr = master_addr
    loopback_only = master_addr.startswith("127.")
    port = client[[rank0_engine]].apply_sync(_bootstrap.open_rendezvous, master_addr)[0]
    pending = {}
    for eid, slot in slots.items():
        spec = dict(
            rank=slot.rank, local_rank=slot.local_rank, world_size=len(slots),
            local_world_size=slot.local_world_size, master_addr=master_addr,
            master_port=port, backend=session.placement.backend, gpu=slot.gpu,
            threads=session.placement.threads_for(slot), timeout=opts["group_timeout"],
            loopback_only=loopback_only, metrics_url=session._metrics.url,
            # Under CurveZMQ the cluster key is empty and this channel encrypted:
            # the ranks get the metrics key here (never over an unencrypted channel).
            metrics_key=None if client.session.key else session._metrics.collector.key,
        )  # fmt: skip
        pending[eid] = client[[eid]].apply_async(_bootstrap.init_rank, spec)
    ranks = []
    deadline = time.monotonic() + opts["timeout"]
    for eid, ar in pending.items():
        run = RankRun(ar, [slots[eid].rank], interrupt=session.interrupt, sink=None)
        run._timeout = max(0.1, deadline - time.monotonic())
        result = run.wait()[0]
        slot = slots[eid]
        ranks.append(
            RankInfo(
                slot.rank,
                slot.local_rank,
                eid,
                infos[eid]["pid"],
                # plan_local says "localhost"; attached hosts keep their placement label
                infos[eid]["host"] if slot.host == "localhost" else slot.host,
                result["device"],
            )
        )
    session._ranks = sorted(ranks, key=lambda r: r.rank)
    if len({r.host for r in session._ranks}) > 1:  # the dashboard names each rank's host
        session._metrics.run.hosts = {r.rank: r.host for r in session._ranks}
    session.cells = []  # fresh namespaces: earlier cells no longer describe them


def metrics_key(client) -> bytes:
    """The key metrics are signed with: the cluster key, or a random one where the
    cluster has none (ipyparallel drops its HMAC key when CurveZMQ encrypts)."""
    import secrets

    return client.session.key or secrets.token_bytes(32)


def metrics_ip(client) -> str:
    """Where the metrics collector listens for attached ranks: the controller's side."""
    from ._bootstrap import _address_towards

    return _address_towards(controller_host(client))


def controller_host(client) -> str:
    url = getattr(client, "_config", {}).get("interface", "") or ""
    host = url.rpartition("//")[2] or "127.0.0.1"
    return host if host not in ("*", "0.0.0.0") else "127.0.0.1"
