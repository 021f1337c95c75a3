"""Kernel side, before anything starts: where each rank runs (GPUs, backend, threads, rendezvous).

Pure logic, checked in the kernel before any engine starts, so that a bad
request fails fast with the numbers it saw and the fix, and nothing is left
half-started. Everything here is unit-tested without engines.

Example::

    >>> p = plan_local(4, gpus_visible=[0, 1, 2, 3], cores=32)
    >>> p.backend, [s.device for s in p.slots]
    ('nccl', ['cuda:0', 'cuda:1', 'cuda:2', 'cuda:3'])
    >>> plan_local(None, gpus_visible=[], cores=2).world_size
    2
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace

from nbdist.engine.devices import (
    SHARED_GPU_ENV,
    choose_backend,
    nccl_can_share,
    nccl_version,
    visible_gpus,
)
from nbdist.errors import PlacementError
from nbdist.launch.values import as_index, check_count, check_threads, is_digits

__all__ = [
    "DEFAULT_CPU_RANKS",
    "EngineInfo",
    "Placement",
    "RankSlot",
    "default_threads",
    "parse_ranks",
    "plan_attached",
    "plan_local",
    "plan_start",
    "share_backend",
]

# Without GPUs, two ranks show every distributed behaviour (collectives, ranks
# that disagree) while staying cheap on a small machine.
DEFAULT_CPU_RANKS = 2


@dataclass(frozen=True)
class RankSlot:
    """One rank: its number, the host it runs on and the device it owns."""

    rank: int
    local_rank: int
    host: str
    gpu: int | None  # the GPU as its host numbers it (a CUDA_VISIBLE_DEVICES entry), None on CPU
    local_world_size: int
    # Its index among the GPUs every rank of the host sees (torch's cuda:<i>), None on CPU.
    cuda_index: int | None = None

    @property
    def device(self) -> str:
        """The torch device this rank uses: ``cpu``, or ``cuda:<i>``.

        As under torchrun, every rank of a host sees the same GPUs (those nbdist
        was given) and uses its own: ``cuda:<local_rank>`` while there are
        enough, round robin beyond. Code written for torchrun that picks
        ``cuda:LOCAL_RANK`` (accelerate, Lightning) finds the same GPU.
        """
        return "cpu" if self.cuda_index is None else f"cuda:{self.cuda_index}"


@dataclass(frozen=True)
class Placement:
    """A validated layout of ranks over hosts and devices."""

    slots: tuple[RankSlot, ...]
    backend: str
    threads: dict[str, int]  # torch threads per rank, by host
    # Rank 0's address as the other hosts reach it (MASTER_ADDR); loopback on one machine.
    master_addr: str = "127.0.0.1"
    # NCCL's version where ranks share a GPU (asked only then), for the notice.
    nccl: tuple[int, ...] | None = None
    # Cores per host, where known (this machine's, or what attached engines reported).
    cores: dict[str, int] = field(default_factory=dict)

    @property
    def hosts(self) -> list[str]:
        """Hosts in rank order, each once."""
        return list(dict.fromkeys(s.host for s in self.slots))

    @property
    def world_size(self) -> int:
        """The number of ranks."""
        return len(self.slots)

    def visible_mask(self, host: str) -> str | None:
        """CUDA_VISIBLE_DEVICES for every rank nbdist starts on ``host`` (None: CPU ranks)."""
        gpus = [s.gpu for s in self.slots if s.host == host and s.gpu is not None]
        return ",".join(str(g) for g in dict.fromkeys(gpus)) if gpus else None

    @property
    def uses_gpus(self) -> bool:
        """True if any rank has a GPU."""
        return any(s.gpu is not None for s in self.slots)

    def threads_for(self, slot: RankSlot) -> int:
        """Torch threads for the rank in ``slot`` (by its host)."""
        return self.threads[slot.host]

    @property
    def shared_gpus(self) -> dict[tuple[str, int], list[int]]:
        """{(host, GPU index): ranks} for each GPU that more than one rank uses."""
        users: dict[tuple[str, int], list[int]] = {}
        for s in self.slots:
            if s.gpu is not None:
                users.setdefault((s.host, s.gpu), []).append(s.rank)
        return {gpu: ranks for gpu, ranks in users.items() if len(ranks) > 1}

    def threads_note(self) -> str:
        """One line where ``--threads`` gives a host's ranks more threads than its cores ('' if not).

        Only a count above the default share says so: ranks that outnumber the cores
        (256 ranks on 2 cores, one thread each) are what was asked for.
        """
        notes = []
        for host in self.hosts:
            ranks = sum(1 for s in self.slots if s.host == host)
            threads, cores = self.threads.get(host), self.cores.get(host)
            if not cores or not threads or threads <= default_threads(cores, ranks):
                continue
            if threads * ranks > cores:
                where = "" if host == "localhost" else f" of {host}"
                share = default_threads(cores, ranks)
                counted = f"{ranks} rank{'s' if ranks > 1 else ''} × {threads} torch threads"
                notes.append(
                    f"--threads {threads}: {counted} on the {cores} cores{where} take turns, "
                    f"so each step waits on the others; leave --threads out (cores / ranks: {share})"
                )
        return " · ".join(notes)

    def sharing_note(self) -> str:
        """One line on ranks sharing GPUs: which, the backend and what it costs ('' if none)."""
        shared = self.shared_gpus
        if not shared:
            return ""
        hosts = {host for host, _ in shared}
        groups = "; ".join(
            f"ranks {','.join(map(str, ranks))} share GPU {gpu}"
            + (f" on {host}" if len(hosts) > 1 or host != "localhost" else "")
            for (host, gpu), ranks in shared.items()
        )
        version = ".".join(map(str, self.nccl)) if self.nccl else "none"
        if self.backend == "nccl":
            how = (
                f"NCCL {version} multi-rank mode ({SHARED_GPU_ENV}=1, experimental): "
                "each rank gets a share of the GPU's compute and memory, "
                "right for trying and debugging, not for timing"
            )
        else:
            how = (
                f"gloo with CUDA tensors (NCCL {version} cannot put two ranks on one GPU; "
                "2.30 can): collectives go through host memory, and a strategy that needs "
                "a collective gloo lacks on GPUs stops with an error naming the fix"
            )
        return f"{groups} · {how}"


@dataclass(frozen=True)
class EngineInfo:
    """What an already-running engine reports about itself (attach mode)."""

    engine_id: int
    host: str
    address: str  # an address of that host the other hosts can reach
    gpus: int  # GPUs visible to that engine


def default_threads(cores: int, ranks_on_host: int) -> int:
    """Torch threads per rank: share the host's cores, at least one each.

    Oversubscribing (each rank keeping torch's default thread count) made
    4-rank CPU training about 4x slower on a 2-core machine.
    """
    return max(1, cores // max(1, ranks_on_host))


_RANGE = re.compile(r"^([0-9]+)\s*-\s*([0-9]+)$")


def parse_ranks(text: str | Sequence[int] | int | None, world_size: int) -> list[int]:
    """Rank selection: '0,2', '0-3', '1', [0, 2] or None (all ranks)."""
    if text is None:
        return list(range(world_size))
    given = text
    if as_index(text) is not None:  # one rank (NumPy's integers too)
        text = as_index(text)
    elif not isinstance(text, str):
        # A list, tuple, range or array of ranks (read once: it may be a generator); bytes
        # would be read as their character codes.
        text = list(text) if isinstance(text, Iterable) and not isinstance(text, bytes) else [None]
        if any(as_index(r) is None for r in text):
            raise PlacementError(f"ranks {given!r}: give whole rank numbers, e.g. [0, 2] or '0-3'")
        text = [as_index(r) for r in text]
    if isinstance(text, int):
        items: list[int] = [text]
    elif isinstance(text, str):
        items = []
        for part in text.split(","):
            part = part.strip()
            match = _RANGE.match(part)
            if match:
                lo, hi = int(match.group(1)), int(match.group(2))
                if lo > hi:
                    raise PlacementError(
                        f"rank range {part!r} runs backwards: write it low-high, e.g. {hi}-{lo}"
                    )
                items.extend(range(lo, hi + 1))
            elif is_digits(part):
                items.append(int(part))
            else:
                raise PlacementError(
                    f"ranks {text!r} not understood: write them like 0,2 or 0-3 "
                    f"(ranks run 0..{world_size - 1})"
                )
    else:
        items = [int(r) for r in text]
    bad = [r for r in items if not 0 <= r < world_size]
    if bad:
        raise PlacementError(
            f"rank {bad[0]} does not exist: this cluster has ranks 0..{world_size - 1}"
        )
    if not items:
        raise PlacementError("no ranks selected: name at least one, e.g. --ranks 0")
    return sorted(set(items))


def plan_local(
    n: int | None,
    *,
    gpus_visible: Sequence[int],
    cores: int,
    backend: str | None = None,
    cpu: bool = False,
    gpus: Sequence[int] | None = None,
    threads: int | None = None,
    host: str = "localhost",
    nccl: Callable[[], tuple[int, ...] | None] = nccl_version,
) -> Placement:
    """Ranks on this machine: one per GPU, or ``n`` CPU ranks.

    ``gpus_visible`` are the GPU indices this process can use (see
    :func:`visible_gpus`); ``gpus`` restricts to a subset (``--gpus``). More
    ranks than GPUs share them round robin (:func:`share_backend` says over
    which backend); ``nccl`` gives NCCL's version, asked only then.
    """
    check_count(n)
    check_threads(threads)
    if cpu and gpus:
        raise PlacementError("--cpu and --gpus contradict each other: pass one of them")
    use_gpus = not cpu and bool(gpus or gpus_visible)
    if gpus:
        missing = [g for g in gpus if g not in gpus_visible]
        if missing:
            seen = ",".join(map(str, gpus_visible)) or "none"
            raise PlacementError(
                f"GPU {missing[0]} is not visible (visible GPUs: {seen}): "
                "choose from those, or check CUDA_VISIBLE_DEVICES"
            )
    version = None
    if use_gpus:
        pool = list(gpus) if gpus else list(gpus_visible)
        count = len(pool) if n is None else n
        # Round robin: rank i on GPU i mod len(pool), so every GPU is used before any is shared.
        assigned: list[int | None] = [pool[i % len(pool)] for i in range(count)]
        if count > len(pool):
            version = nccl()
            backend = share_backend(backend, version, ranks=count, gpus=len(pool))
    else:
        count = DEFAULT_CPU_RANKS if n is None else n
        assigned = [None] * count
    chosen = choose_backend(backend, uses_gpus=use_gpus)
    pool_order = list(dict.fromkeys(g for g in assigned if g is not None))
    slots = tuple(
        RankSlot(
            rank=i,
            local_rank=i,
            host=host,
            gpu=g,
            local_world_size=count,
            cuda_index=None if g is None else pool_order.index(g),
        )
        for i, g in enumerate(assigned)
    )
    return Placement(
        slots=slots,
        backend=chosen,
        threads={host: threads or default_threads(cores, count)},
        nccl=version,
        cores={host: cores},
    )


def share_backend(
    requested: str | None, version: tuple[int, ...] | None, *, ranks: int, gpus: int
) -> str:
    """The backend for ranks that share GPUs: NCCL where it can (>= 2.30), otherwise gloo.

    gloo takes CUDA tensors for the collectives data parallel needs (all_reduce,
    broadcast) by copying them through host memory; NCCL up to 2.29 refuses two
    ranks on one GPU outright ("Duplicate GPU detected"). An explicit
    ``--backend nccl`` that NCCL cannot honour is refused with the ways out.
    """
    can_share = nccl_can_share(version)
    if requested is not None and requested.lower() == "nccl" and not can_share:
        found = ".".join(map(str, version)) if version else "not available"
        raise PlacementError(
            f"{ranks} ranks on {gpus} GPU(s) with --backend nccl: ranks sharing a GPU need "
            f"NCCL >= 2.30 (this torch's NCCL: {found}). Start at most {gpus} ranks, drop "
            f"--backend to share over gloo, add --cpu, or install a torch built with NCCL >= 2.30"
        )
    if requested is not None:
        return requested
    return "nccl" if can_share else "gloo"


def plan_start(options) -> Placement | None:
    """The placement of a checked :class:`~nbdist.launch.options.StartOptions`.

    None for a cluster the session connects to (planned when its engines report,
    :func:`plan_attached`).
    """
    if options.connect:
        return None
    if options.launch is not None:
        # Engines start on other hosts, whose GPUs this machine cannot see: a
        # provisional CPU layout of n ranks until they report (plan_attached).
        # Their cores are unknown here too: none recorded, so no note is drawn from a guess.
        return replace(plan_local(options.launch.n, gpus_visible=[], cores=1, cpu=True), cores={})
    return plan_local(
        options.n,
        gpus_visible=[] if options.cpu else visible_gpus(),
        cores=os.cpu_count() or 1,
        backend=options.backend,
        cpu=options.cpu,
        gpus=options.gpus,
        threads=options.threads,
    )


def plan_attached(
    engines: Sequence[EngineInfo],
    *,
    cores: dict[str, int],
    backend: str | None = None,
    cpu: bool = False,
    threads: int | None = None,
    nccl: Callable[[], tuple[int, ...] | None] = nccl_version,
) -> tuple[Placement, dict[int, RankSlot]]:
    """Ranks over engines that are already running, possibly on several hosts.

    Ranks are numbered host by host (hosts in order of their lowest engine id,
    engines within a host by id), whatever order they registered in, so that
    LOCAL_RANK is contiguous per host and LOCAL_WORLD_SIZE is the host's
    engine count. A host is a (hostname, address) pair: two machines (or
    network namespaces, or containers) may share a hostname, and they are
    then labelled ``name@address``. GPUs are handed out per host, by local
    rank; MASTER_ADDR is rank 0's host address. Returns the placement and
    engine id -> slot.

    Example::

        >>> engines = [EngineInfo(0, "a", "10.0.0.1", 0), EngineInfo(1, "b", "10.0.0.2", 0),
        ...            EngineInfo(2, "a", "10.0.0.1", 0)]
        >>> p, by_engine = plan_attached(engines, cores={"a": 4, "b": 4})
        >>> [(s.host, s.local_rank) for s in p.slots], p.master_addr
        ([('a', 0), ('a', 1), ('b', 0)], '10.0.0.1')
    """
    check_threads(threads)
    if not engines:
        raise PlacementError("the cluster has no engines: start engines first, then attach")
    by_host: dict[tuple[str, str], list[EngineInfo]] = {}
    for info in sorted(engines, key=lambda e: e.engine_id):
        by_host.setdefault((info.host, info.address), []).append(info)
    labels = _host_labels(list(by_host))
    use_gpus = not cpu and all(e.gpus > 0 for e in engines)
    slots: list[RankSlot] = []
    by_engine: dict[int, RankSlot] = {}
    version = None
    for key, infos in by_host.items():
        host = labels[key]
        if use_gpus and len(infos) > infos[0].gpus:
            # The engines' torch is taken to be the kernel's (one environment, as usual).
            version = nccl() if version is None else version
            backend = share_backend(backend, version, ranks=len(infos), gpus=infos[0].gpus)
        for local_rank, info in enumerate(infos):
            # An engine started elsewhere keeps the GPUs it sees; it uses the local_rank-th.
            gpu = local_rank % infos[0].gpus if use_gpus else None
            slot = RankSlot(len(slots), local_rank, host, gpu, len(infos), cuda_index=gpu)
            slots.append(slot)
            by_engine[info.engine_id] = slot
    chosen = choose_backend(backend, uses_gpus=use_gpus)
    # Cores are reported per hostname; hosts sharing a name report the same machine's count.
    per_host = {
        labels[key]: threads or default_threads(cores.get(key[0], 1), len(infos))
        for key, infos in by_host.items()
    }
    master_addr = next(iter(by_host))[1]
    placement = Placement(
        slots=tuple(slots),
        backend=chosen,
        threads=per_host,
        master_addr=master_addr,
        nccl=version,
        cores={labels[key]: cores[key[0]] for key in by_host if cores.get(key[0])},
    )
    return placement, by_engine


def _host_labels(keys: list[tuple[str, str]]) -> dict[tuple[str, str], str]:
    """'name' per host, or 'name@address' where several hosts share a name."""
    names: dict[str, int] = {}
    for name, _ in keys:
        names[name] = names.get(name, 0) + 1
    return {(name, addr): name if names[name] == 1 else f"{name}@{addr}" for name, addr in keys}
