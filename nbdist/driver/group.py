"""Kernel side: forming the process group over a session's engines, and forming it again.

:func:`form_group`: the engines describe themselves (host, address, GPUs, slot),
the ranks are numbered (by slot where nbdist started them, host by host where
attached), rank 0 opens the rendezvous socket, and every rank joins the group;
each rank's ``init_rank`` returns only after one collective succeeded.

:func:`reform_group`: after the ranks were released from a hung or failed
collective (:mod:`nbdist.driver.faults`), the same processes form a new group
over a new rendezvous; their namespaces, models and tensors stay.

Both return or change a :class:`Group`; the session keeps it.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

from nbdist.driver.engine_questions import ask_engines, take_back
from nbdist.driver.ipp_internals import controller_interface, tolerate_shells_without_kernel
from nbdist.driver.join_guard import JoinGuard
from nbdist.driver.process_state import process_here, process_state_of, stopped_in_words
from nbdist.driver.rank_deaths import RankMonitor
from nbdist.driver.runner import RankRun
from nbdist.driver.store_connects import slow_connects_note
from nbdist.engine import bootstrap
from nbdist.engine.pid_space import pid_space
from nbdist.errors import NbdistError, format_ranks
from nbdist.launch.options import StartOptions
from nbdist.launch.placement import EngineInfo, Placement, parse_ranks, plan_attached
from nbdist.launch.serializer_warmup import serializer_ready

__all__ = [
    "Group",
    "RankInfo",
    "controller_host",
    "form_group",
    "gloo_on_gpu_reason",
    "metrics_ip",
    "metrics_key",
    "reform_group",
]


@dataclass(frozen=True)
class RankInfo:
    """One rank of a formed group: its numbers, its engine and process, where it runs."""

    rank: int
    local_rank: int
    engine_id: int
    pid: int
    host: str
    device: str
    # Whether ``pid`` names the rank's process on this (the kernel's) machine: False for
    # a rank on another host or in another PID namespace, whose PID is never read here.
    pid_here: bool = True
    # Where faulthandler writes this rank's Python stacks on a fatal signal, on the rank's
    # machine: ranks a launcher started (:mod:`nbdist.engine.crash_record`); '' for others.
    crash_record: str = ""


@dataclass
class Group:
    """A formed process group: its ranks (in rank order) and where they meet.

    ``released``: the ranks were released from a collective (or an attempt to
    form the group again failed); the group must be formed again before the
    next cell (:func:`reform_group`).
    """

    ranks: list[RankInfo]
    rendezvous_addr: str
    backend: str
    released: bool = False
    hosts: dict[int, str] = field(default_factory=dict)  # rank -> host, when several hosts
    # Ranks whose gloo connects lazily (TORCH_GLOO_LAZY_INIT): not releasable from a hang.
    lazy_gloo: list[int] = field(default_factory=list)
    # As the group was last formed again: the ranks' pipeline schedules whose step was cut
    # short ("schedule (ScheduleGPipe)"), which fail their next step.
    cut_schedules: list[str] = field(default_factory=list)
    # Each collective compared across the ranks before it runs (--check-collectives), also
    # when the group is formed again.
    checks_collectives: bool = False
    # Ranks held up seconds connecting to rank 0's store, and why (a sentence; '' if none were).
    slow_store_note: str = ""

    def notes(self) -> list[str]:
        """What the ready line says of this group beyond its ranks (a sentence each)."""
        notes = []
        if self.checks_collectives:
            notes.append(
                "each collective is compared across the ranks before it runs "
                "(--check-collectives): one whose kind, shapes or dtypes differ fails on every "
                "rank, naming them; every collective costs an extra exchange"
            )
        if self.lazy_gloo:
            have = "has" if len(self.lazy_gloo) == 1 else "have"
            notes.append(
                f"{format_ranks(self.lazy_gloo)} {have} TORCH_GLOO_LAZY_INIT set: gloo connects "
                "two ranks at their first collective together, and nbdist may not release ranks "
                "hung in one (Ctrl-C, --timeout, a dead rank); unset it before %dist_start to "
                "keep that"
            )
        if self.slow_store_note:
            notes.append(self.slow_store_note)
        return notes

    def cut_schedules_note(self) -> str:
        """'a pipeline step was cut short ...: schedule (ScheduleGPipe)' ('' if none was): what
        the user makes again, since torch's error at the next step would not say why."""
        if not self.cut_schedules:
            return ""
        return (
            "a pipeline step was cut short and its schedule keeps that step's losses, so its "
            "next step fails: make the stages and the schedule again: "
            + ", ".join(self.cut_schedules)
        )

    @property
    def engine_ids(self) -> list[int]:
        """The engines of the ranks, in rank order."""
        return [r.engine_id for r in self.ranks]

    def select(self, ranks=None) -> list[RankInfo]:
        """The ranks named by ``ranks`` ('0,2', '0-3', 2, [0, 2]; None: all), checked."""
        return [self.ranks[r] for r in parse_ranks(ranks, len(self.ranks))]


def _shell_reference():
    # The rank's own get_ipython, looked up in its namespace when the call runs
    # there: the rank-side code never imports IPython itself.
    import ipyparallel as ipp

    return ipp.Reference("get_ipython")


def form_group(
    client,
    *,
    owned: bool,
    placement: Placement | None,
    options: StartOptions,
    metrics_url: str,
    metrics_key_for_ranks: bytes | None,
    interrupt_engines: Callable[[list[int], list[int]], None],
    watch_deaths: Callable[[list[RankInfo]], RankMonitor | None] | None = None,
    engine_processes: Sequence = (),
) -> tuple[Group, Placement]:
    """Describe the engines, number the ranks, open the rendezvous and init every rank.

    ``placement``: the plan the engines were started from (None when attached:
    it is made here from what the engines report). ``options``: the session's
    checked start options. ``metrics_key_for_ranks``:
    sent to the ranks only where the cluster has no key of its own (CurveZMQ).
    ``interrupt_engines(pids, engine_ids)``: SIGINT to engines (a Ctrl-C or the
    --timeout while they join; the session's ranks are not numbered yet).
    ``watch_deaths(ranks)``: a :class:`~nbdist.driver.rank_deaths.RankMonitor` of the
    joining ranks' processes (None: a death is seen when the controller drops the engine);
    a rank that dies or fails while joining ends the start at once, with its error.
    ``engine_processes``: the engines' processes on this machine (``psutil.Process``,
    any order; empty where not known): an engine that does not answer is named with
    what its process is doing. Every wait ends at the start's --timeout. Returns the
    group and the placement it followed.
    """
    serializer_ready()  # the serializer's set-up may still run on its thread: not thread-safe
    tolerate_shells_without_kernel()  # a terminal IPython drives ranks too
    engine_ids = sorted(client.ids)
    towards = options.ip if owned else controller_host(client)

    def unanswered(answers: dict) -> list:
        # The engines' processes here whose PID no answer gave: the silent engines'.
        told = {answer["pid"] for answer in answers.values()}
        return [proc for proc in engine_processes if proc.pid not in told]

    described = ask_engines(
        client,
        engine_ids,
        bootstrap.describe_rank,
        towards,
        timeout=options.timeout,
        asking="for its host, address and devices",
        suspects=unanswered if engine_processes else None,
        engines_stay=not owned,  # a failed start stops the engines it started
    )
    infos = dict(zip(engine_ids, described))
    if owned and placement is not None and all(i["slot"] is not None for i in infos.values()):
        by_slot = {info["slot"]: eid for eid, info in infos.items()}
        slots = {by_slot[slot.local_rank]: slot for slot in placement.slots}
    else:
        placement, slots = plan_attached(
            [EngineInfo(e, i["host"], i["address"], i["gpus"]) for e, i in infos.items()],
            cores={i["host"]: i["cores"] for i in infos.values()},
            backend=options.backend,
            cpu=options.cpu,
            threads=options.threads,
        )
    rank0_engine = next(e for e, s in slots.items() if s.rank == 0)
    master_addr = infos[rank0_engine]["address"]
    here = pid_space()
    rank0_here = infos[rank0_engine].get("pid_space") == here
    port = ask_engines(
        client,
        [rank0_engine],
        bootstrap.open_rendezvous,
        master_addr,
        timeout=options.timeout,
        asking="to open the rendezvous socket as rank 0",
        suspects=(lambda _: process_here(infos[rank0_engine]["pid"])) if rank0_here else None,
        engines_stay=not owned,
    )[0]
    sharing = {r for ranks in placement.shared_gpus.values() for r in ranks}
    # torchrun's names: a "group" is a host; the run id ties the ranks of one start.
    host_index = {host: i for i, host in enumerate(placement.hosts)}
    run_id = f"nbdist-{secrets.token_hex(6)}"
    gloo_reason = gloo_on_gpu_reason(placement)
    ssh_launched = options.launch is not None and options.launch.engine_launcher == "ssh"
    pending = {}
    for eid, slot in slots.items():
        spec = dict(
            rank=slot.rank,
            local_rank=slot.local_rank,
            world_size=len(slots),
            local_world_size=slot.local_world_size,
            master_addr=master_addr,
            master_port=port,
            backend=placement.backend,
            gpu=slot.gpu,
            cuda_index=slot.cuda_index,
            threads=placement.threads_for(slot),
            timeout=options.group_timeout,
            join_timeout=options.timeout,
            check_collectives=options.check_collectives,
            loopback_only=master_addr.startswith("127."),
            metrics_url=metrics_url,
            metrics_key=metrics_key_for_ranks,
            shares_gpu=slot.rank in sharing,
            gloo_reason=gloo_reason,
            group_rank=host_index[slot.host],
            # gloo serves where NCCL was the choice but cannot share a GPU: a script's
            # init_process_group("nccl") is then served by it (user_group).
            gloo_for_nccl=gloo_reason if placement.shared_gpus else "",
            group_world_size=len(host_index),
            run_id=run_id,
            # Ranks a launcher started are nobody's children where they run: they watch
            # for the controller themselves (the zygote's ranks die with the kernel).
            controller_gone_s=options.controller_gone_s if owned else None,
            # The SSH launcher's /tmp/nbdist-ssh-<cluster> on each host: made for the ranks.
            engine_dir_is_ours=owned and ssh_launched,
        )
        pending[eid] = client[[eid]].apply_async(bootstrap.init_rank, spec, _shell_reference())
    # One wait for every rank, so what they print while joining (torch's c10d warnings, the
    # same on every rank but for a timestamp) is folded into one line, not one per rank.
    from ipyparallel import AsyncResult

    joined = AsyncResult.join(*pending.values())
    engine_of = {slot.rank: eid for eid, slot in slots.items()}

    def interrupt(ranks: Sequence[int]) -> None:
        chosen = [engine_of[r] for r in ranks]
        interrupt_engines([infos[e]["pid"] for e in chosen], chosen)

    # Each rank as the group will know it, its device once it joined (in ``pending``'s order).
    # A rank that dies or fails on its way in ends the start at once (the others would wait
    # for it until --timeout): the local ranks' processes are watched while they join.
    joining = [
        RankInfo(
            slots[eid].rank,
            slots[eid].local_rank,
            eid,
            infos[eid]["pid"],
            # plan_local says "localhost"; attached hosts keep their placement label
            infos[eid]["host"] if slots[eid].host == "localhost" else slots[eid].host,
            "",
            infos[eid].get("pid_space") == here,
        )
        for eid in pending
    ]
    monitor = watch_deaths(joining) if watch_deaths is not None else None
    lingers = (
        ""
        if owned
        else f"each gives up its wait in torch's store after --timeout ({options.timeout:g} s), "
        "then takes nbdist's next request"
    )
    try:
        results = RankRun(
            joined,
            [slots[eid].rank for eid in pending],
            interrupt=interrupt,
            sink=None,
            timeout=options.timeout,
            waiting_for=f"forming the process group (%dist_start --timeout {options.timeout:g})",
            guard=JoinGuard(
                interrupt,
                monitor=monitor,
                lingers=lingers,
                processes=_processes_here(joining, known=engine_processes),
                processes_stay=not owned,  # a failed start stops the ranks it started
            ),
        ).wait()
    except BaseException:
        # An engine that has not begun joining (stopped, busy) would join this dead
        # rendezvous when it frees, and wait there, ahead of the next start's requests.
        take_back(client, joined, list(pending))
        raise
    finally:
        if monitor is not None:
            monitor.stop()
    ranks = sorted(
        (
            replace(info, device=result["device"], crash_record=result.get("crash_record", ""))
            for info, result in zip(joining, results)
        ),
        key=lambda r: r.rank,
    )
    hosts = {r.rank: r.host for r in ranks} if len({r.host for r in ranks}) > 1 else {}
    lazy = sorted(
        slots[eid].rank for eid, result in zip(pending, results) if result.get("gloo_lazy")
    )
    connects = {
        slots[eid].rank: result.get("store_connect_s", 0.0) for eid, result in zip(pending, results)
    }
    group = Group(
        ranks,
        master_addr,
        placement.backend,
        hosts=hosts,
        lazy_gloo=lazy,
        checks_collectives=options.check_collectives,
        slow_store_note="" if hosts else slow_connects_note(connects, master_addr),
    )
    return group, placement


def gloo_on_gpu_reason(placement) -> str:
    """Why the ranks run gloo on GPUs, in words for a strategy's error ('' if they do not)."""
    if placement.backend != "gloo" or not placement.uses_gpus:
        return ""
    if not placement.shared_gpus:
        return "--backend gloo was asked for"
    version = ".".join(map(str, placement.nccl)) if placement.nccl else "none"
    (_host, gpu), ranks = next(iter(placement.shared_gpus.items()))
    return (
        f"ranks {','.join(map(str, ranks))} share GPU {gpu} and this torch's NCCL "
        f"({version}) cannot put two ranks on one GPU (2.30 can)"
    )


def reform_group(
    client,
    group: Group,
    *,
    group_timeout: float,
    timeout: float,
    interrupt: Callable[[Sequence[int]], None],
    monitor: RankMonitor | None = None,
) -> list[str]:
    """Form ``group`` again on the same processes (a new rendezvous); clears ``released``.

    Only the group changes on the ranks: namespaces, models and tensors stay.
    ``monitor``: the session's watch on its local ranks' processes (a rank that dies or
    fails on its way back in ends the wait at once, with its error, as at a start).
    ``group.released`` stays True if this fails, so the next cell tries again.
    Returns the ranks' variables that hold the old group, to be made again
    (``"ddp_model (DistributedDataParallel)"``; each name once, as any rank has it);
    the pipeline schedules whose step was cut short go to ``group.cut_schedules``.
    A rank whose process here is stopped (SIGSTOP, a tracer) cannot join until it is
    continued: :class:`NbdistError` at once, nothing sent.
    """
    group.released = True
    processes = _processes_here(group.ranks)
    stopped, words = stopped_in_words(
        [(rank, proc.pid, process_state_of(proc)) for rank, proc in processes.items()]
    )
    if stopped:
        raise NbdistError(
            f"the process group must be formed again after the release, and "
            f"{format_ranks(stopped)} cannot join it until continued: {words}; then run "
            "this again (%dist_restart starts fresh ranks)"
        )
    rank0 = group.ranks[0]
    rendezvous = client[[rank0.engine_id]].apply_async(
        bootstrap.open_rendezvous, group.rendezvous_addr
    )
    try:
        port = RankRun(
            rendezvous,
            [0],
            interrupt=interrupt,
            timeout=timeout,
            waiting_for="rank 0 opening the rendezvous socket again (the %dist_start --timeout)",
        ).wait()[0]
    except BaseException:
        take_back(client, rendezvous, [rank0.engine_id])
        raise
    base = dict(
        world_size=len(group.ranks),
        master_addr=group.rendezvous_addr,
        master_port=port,
        backend=group.backend,
        timeout=group_timeout,
        join_timeout=timeout,
        check_collectives=group.checks_collectives,
    )
    ar = client[group.engine_ids].apply_async(
        bootstrap.rejoin_as_this_rank, base, _shell_reference()
    )
    try:
        rejoined = RankRun(
            ar,
            [r.rank for r in group.ranks],
            interrupt=interrupt,
            timeout=timeout,
            waiting_for="forming the process group again (the %dist_start --timeout; "
            "the next cell tries again, %dist_restart starts fresh ranks)",
            # A rank whose way back in fails (a GPU a fault left unusable) or that dies ends
            # the wait with its own error, not the --timeout's "had failed (RuntimeError)".
            guard=JoinGuard(
                interrupt,
                monitor=monitor,
                lingers=f"each gives up its wait in torch's store after --timeout "
                f"({timeout:g} s), then takes the next cell, which tries again; %dist_restart "
                "starts fresh ranks",
                processes=processes,
            ),
        ).wait()
    except BaseException:
        # As at a start: a rank that has not begun would join this dead rendezvous later,
        # ahead of the next cell's try.
        take_back(client, ar, group.engine_ids)
        raise
    group.released = False
    stale: dict[str, str] = {}
    cut: dict[str, str] = {}
    for result in rejoined:
        for name, what in (result or {}).get("stale", ()):
            stale.setdefault(name, what)
        for name, what in (result or {}).get("cut", ()):
            cut.setdefault(name, what)
    group.cut_schedules = [f"{name} ({what})" for name, what in cut.items()]
    return [f"{name} ({what})" for name, what in stale.items()]


def _processes_here(ranks: Sequence[RankInfo], known: Sequence = ()) -> dict:
    # {rank: its process} of the ranks whose PID names a process on this machine; those of
    # ``known`` (noted at their start, so a PID reused since is not taken for them) as they are.
    noted = {proc.pid: proc for proc in known}
    return {
        r.rank: proc
        for r in ranks
        if r.pid_here
        for proc in ([noted[r.pid]] if r.pid in noted else process_here(r.pid))
    }


def metrics_key(client) -> bytes:
    """The key metrics are signed with: the cluster key, or a random one where the
    cluster has none (ipyparallel drops its HMAC key when CurveZMQ encrypts)."""
    return client.session.key or secrets.token_bytes(32)


def metrics_ip(client, *, owned: bool, ip: str) -> str:
    """Where the metrics collector listens: loopback, unless the ranks are elsewhere
    (``--ip`` beyond loopback, or an attached cluster: then the controller's side)."""
    if owned and ip.startswith("127."):
        return "127.0.0.1"
    return bootstrap.reachable_address(controller_host(client))


def controller_host(client) -> str:
    """The host the client's controller listens on, as the ranks reach it (loopback if any)."""
    url = controller_interface(client)
    host = url.rpartition("//")[2] or "127.0.0.1"
    return host if host not in ("*", "0.0.0.0") else "127.0.0.1"
