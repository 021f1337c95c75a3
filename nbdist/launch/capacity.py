"""Kernel side, before any process starts: do N ranks fit this machine's limits?

A start of many ranks that runs into a limit fails late and obscurely: a
controller that cannot accept another engine ("Too many open files" in its
log, then a registration timeout minutes later), a fork that fails with
EAGAIN, the out-of-memory killer ending ranks at random. :func:`check_limits`
compares what a start of ``N`` ranks needs with the limits in force and either
fixes the limit (the soft open-files limit is raised up to the hard one; the
controller, the zygote and the ranks inherit it) or refuses, before anything
starts, naming the value, the limit and the fix.

What a start needs, measured on a 2-core VM (torch 2.13, ipyparallel 9.2, gloo,
``--cpu --threads 1``; 64, 128 and 256 ranks):

- open files: the kernel holds about 2 per rank (a metrics connection and the
  rank's pidfd) beyond what it held before; the controller about 1.8 per rank
  plus ~90; a rank one per peer (gloo's full mesh) plus ~60, rank 0 twice that
  (it also serves the rendezvous store). Each of them inherits the kernel's limit.
- threads: 16 per rank plus its torch threads; on Linux every thread counts
  against the user's process limit (``ulimit -u``, not enforced for root), and
  against the system's ``kernel.threads-max``, ``kernel.pid_max`` and the
  cgroup's ``pids.max``.
- memory: a rank forked from the zygote shares torch's pages and owns about
  30 MiB at start (7.4 GiB for 256); a spawned rank imports torch itself and
  owns about 350 MiB. The controller and the zygote add ~0.5 GiB. What the
  cells allocate later comes on top: the check only refuses starts that
  cannot fit at all.
"""

from __future__ import annotations

import os
import resource
from dataclasses import dataclass

from nbdist.errors import NbdistError

__all__ = [
    "Limits",
    "Needs",
    "check_limits",
    "current_limits",
    "needs_for",
    "problems",
]

MIB = 1 << 20
GIB = 1 << 30
# Measured (see the module docstring), rounded up.
FDS_PER_RANK_KERNEL = 2
FDS_KERNEL_MARGIN = 64  # zmq's own sockets, the history, a late collector connection
FDS_PER_PEER = 1  # a rank's gloo connection to each other rank
FDS_RANK_BASE = 100  # ipyparallel's sockets, torch's, stdio, the metrics socket
THREADS_PER_RANK = 16  # ipyparallel's, zmq's, gloo's and torch's threads of an idle rank
UNIQUE_BYTES_FORKED_RANK = 30 * MIB
UNIQUE_BYTES_SPAWNED_RANK = 350 * MIB
BASE_BYTES = 512 * MIB  # the controller and the zygote (it holds torch's pages once)


@dataclass(frozen=True)
class Needs:
    """What a start of ``ranks`` ranks, ``local`` of them on this machine, needs here."""

    ranks: int
    local: int
    open_files: int  # per process, the most any one of ours opens (the limit is per process)
    threads: int  # new threads on this machine
    memory: int  # bytes of new unique memory on this machine
    spawn: bool = False  # ranks import torch each (no zygote)


@dataclass(frozen=True)
class Limits:
    """The limits in force for this process and the ones it starts (None: none / unknown)."""

    open_files_soft: int | None
    open_files_hard: int | None
    user_processes: int | None  # RLIMIT_NPROC, None where not enforced (root)
    user_threads_now: int  # threads of this user running now (what RLIMIT_NPROC counts)
    tasks_max: int | None  # min(kernel.threads-max, kernel.pid_max, cgroup pids.max)
    tasks_now: int
    memory_available: int | None  # bytes: MemAvailable, or the cgroup's room if smaller


def needs_for(
    ranks: int,
    *,
    local: int,
    rank0_local: bool,
    fds_open: int,
    threads: int = 1,
    spawn: bool = False,
) -> Needs:
    """What starting ``ranks`` ranks needs; ``fds_open``: files this kernel holds now.

    >>> needs_for(256, local=256, rank0_local=True, fds_open=60).open_files
    636
    """
    kernel = fds_open + FDS_PER_RANK_KERNEL * ranks + FDS_KERNEL_MARGIN
    rank = 0
    if local:
        peers = (ranks - 1) * FDS_PER_PEER
        # Rank 0 also serves the rendezvous store: one more connection per rank.
        rank = FDS_RANK_BASE + peers + (ranks if rank0_local else 0)
    per_rank = UNIQUE_BYTES_SPAWNED_RANK if spawn else UNIQUE_BYTES_FORKED_RANK
    return Needs(
        ranks=ranks,
        local=local,
        open_files=max(kernel, rank),
        threads=local * (THREADS_PER_RANK + max(0, threads)),
        memory=(BASE_BYTES + local * per_rank) if local else 0,
        spawn=spawn,
    )


def _read_int(path: str) -> int | None:
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def _cgroup_files(name: str) -> list[str]:
    """``name`` (e.g. ``pids.max``) of this process's cgroup, v2 and v1 layouts."""
    paths = []
    try:
        with open("/proc/self/cgroup") as f:
            lines = f.read().splitlines()
    except OSError:
        return paths
    controller = name.split(".")[0]
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # v2 unified hierarchy
            paths.append(f"/sys/fs/cgroup{path}/{name}")
        elif controller in controllers.split(","):
            paths.append(f"/sys/fs/cgroup/{controllers}{path}/{name}")
    return paths


def _memory_available() -> int | None:
    available = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    available = int(line.split()[1]) * 1024
    except OSError:
        pass
    for limit_file in _cgroup_files("memory.max") + _cgroup_files("memory.limit_in_bytes"):
        limit = _read_int(limit_file)
        if limit is None or limit >= 1 << 60:  # "max", or v1's "no limit"
            continue
        folder = os.path.dirname(limit_file)
        used = _read_int(os.path.join(folder, "memory.current"))
        if used is None:
            used = _read_int(os.path.join(folder, "memory.usage_in_bytes")) or 0
        room = max(0, limit - used)
        available = room if available is None else min(available, room)
    return available


def _threads_of_user(uid: int) -> tuple[int, int]:
    """(this user's threads, all threads) on this machine, from /proc."""
    mine = total = 0
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            count = len(os.listdir(f"/proc/{entry.name}/task"))
            owner = entry.stat().st_uid
        except OSError:
            continue
        total += count
        mine += count if owner == uid else 0
    return mine, total


def current_limits() -> Limits:
    """The limits in force for this process (Linux; elsewhere only what ``resource`` says)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    unlimited = resource.RLIM_INFINITY
    nproc, _ = resource.getrlimit(resource.RLIMIT_NPROC)
    linux = os.path.isdir("/proc/self/task")
    mine, total = _threads_of_user(os.getuid()) if linux else (0, 0)
    caps = [
        _read_int("/proc/sys/kernel/threads-max"),
        _read_int("/proc/sys/kernel/pid_max"),
        *(_read_int(p) for p in _cgroup_files("pids.max")),
    ]
    caps = [c for c in caps if c is not None]
    return Limits(
        open_files_soft=None if soft == unlimited else soft,
        open_files_hard=None if hard == unlimited else hard,
        # The kernel does not enforce RLIMIT_NPROC for root.
        user_processes=None if nproc == unlimited or os.getuid() == 0 else nproc,
        user_threads_now=mine,
        tasks_max=min(caps) if caps else None,
        tasks_now=total,
        memory_available=_memory_available() if linux else None,
    )


def _gib(n: int) -> str:
    return f"{n / GIB:.1f} GiB"


def problems(needs: Needs, limits: Limits) -> list[str]:
    """What stops the start, one sentence each naming the value, the limit and the fix.

    The open-files soft limit is not a problem while the hard limit allows
    raising it (:func:`check_limits` raises it).
    """
    n = needs.ranks
    found = []
    hard = limits.open_files_hard
    if hard is not None and needs.open_files > hard:
        found.append(
            f"{n} ranks need about {needs.open_files} open files per process (the kernel, the "
            f"controller and rank 0 each hold about 2 per rank); the limit is {hard} (hard "
            "limit, `ulimit -Hn`): raise it where Jupyter starts, e.g. `ulimit -n "
            f"{_round_up(needs.open_files)}` in its shell (as root, or via "
            "/etc/security/limits.conf `nofile`, or `LimitNOFILE=` in its systemd unit), "
            "then restart the kernel"
        )
    if limits.user_processes is not None:
        want = limits.user_threads_now + needs.threads
        if want > limits.user_processes:
            found.append(
                f"{needs.local} ranks start about {needs.threads} threads "
                f"({needs.threads // max(1, needs.local)} per rank) and your user already runs "
                f"{limits.user_threads_now}; the limit is {limits.user_processes} processes and "
                f"threads per user (`ulimit -u`): raise it (`ulimit -u {_round_up(want)}` where "
                "Jupyter starts, or `nproc` in /etc/security/limits.conf) or start fewer ranks"
            )
    if limits.tasks_max is not None and limits.tasks_now + needs.threads > limits.tasks_max:
        found.append(
            f"{needs.local} ranks start about {needs.threads} threads and the machine runs "
            f"{limits.tasks_now}; the system allows {limits.tasks_max} (the least of "
            "kernel.threads-max, kernel.pid_max and the cgroup's pids.max): raise it "
            f"(`sysctl -w kernel.pid_max={_round_up(limits.tasks_now + needs.threads)}`, "
            "or the container's pids limit) or start fewer ranks"
        )
    avail = limits.memory_available
    if avail is not None and needs.memory > avail:
        per_rank = (needs.memory - BASE_BYTES) // max(1, needs.local) // MIB
        found.append(
            f"{needs.local} ranks need about {_gib(needs.memory)} of memory to start "
            f"(~{per_rank} MiB per rank, before any cell allocates) and "
            f"{_gib(avail)} is available (MemAvailable, or the cgroup's memory limit): "
            "start fewer ranks or free memory"
            + (
                ", or start them by fork (the default start method), sharing torch's memory"
                if needs.spawn
                else ""
            )
        )
    return found


def _round_up(value: int) -> int:
    """A round figure to suggest: the next multiple of 1024."""
    return -(-value // 1024) * 1024


def check_limits(
    ranks: int,
    *,
    local: int,
    rank0_local: bool = True,
    threads: int = 1,
    spawn: bool = False,
) -> str:
    """Refuse (:class:`NbdistError`) a start that cannot fit; raise the soft open-files limit.

    Returns a note for the start line when it changed a limit, else "".
    """
    fds_open = len(os.listdir("/proc/self/fd")) if os.path.isdir("/proc/self/fd") else 0
    needs = needs_for(
        ranks, local=local, rank0_local=rank0_local, fds_open=fds_open, threads=threads, spawn=spawn
    )
    limits = current_limits()
    found = problems(needs, limits)
    if found:
        raise NbdistError("\n".join(f"{p}." for p in found) + "\nNothing was started.")
    soft = limits.open_files_soft
    if soft is not None and needs.open_files > soft:
        # Allowed without privileges up to the hard limit; what starts next inherits it.
        hard = limits.open_files_hard
        new = max(soft, _round_up(2 * needs.open_files))
        new = new if hard is None else min(new, hard)
        resource.setrlimit(
            resource.RLIMIT_NOFILE, (new, resource.RLIM_INFINITY if hard is None else hard)
        )
        return f"open-files limit raised from {soft} to {new} for {ranks} ranks"
    return ""
