"""Kernel side: a rank out of memory: killed by the host (its memory cgroup), or out of GPU memory.

The kernel's out-of-memory killer ends a process with SIGKILL, which looks like
``kill -9``. Each memory cgroup (a container, a batch job's allocation, a
systemd slice) counts its OOM kills, so nbdist reads the rank's counter when it
starts watching the rank and again when the rank dies: if it rose, the cause is
named, with the cgroup's memory limit.

A dead process no longer shows its cgroup in ``/proc`` (it is moved to the root
as it exits), which is why the counter's file is found while the rank is alive.
cgroup v1 (``memory.oom_control``) and v2 (``memory.events``) are both read;
where neither is readable nothing is claimed.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

__all__ = ["OomCounter", "cuda_oom_note", "oom_counter"]

_ROOT = "/sys/fs/cgroup"


@dataclass(frozen=True)
class OomCounter:
    """A memory cgroup's OOM-kill count, as read at one moment."""

    directory: str  # the cgroup's directory under /sys/fs/cgroup
    file: str  # memory.oom_control (v1) or memory.events (v2)
    kills: int

    def now(self) -> int | None:
        """The cgroup's OOM-kill count now (None if it can no longer be read)."""
        return _read_kills(os.path.join(self.directory, self.file))

    def rose(self) -> bool:
        """True if the cgroup counted an OOM kill since this counter was read."""
        now = self.now()
        return now is not None and now > self.kills

    def limit(self) -> str:
        """The cgroup's memory limit in words ('' when there is none)."""
        for name in ("memory.max", "memory.limit_in_bytes"):
            try:
                with open(os.path.join(self.directory, name)) as f:
                    value = f.read().strip()
            except OSError:
                continue
            if value == "max" or not value.isdigit() or int(value) >= 2**62:
                return ""  # unlimited (v1 writes a huge number)
            return f"{int(value) / 2**30:.2f} GiB"
        return ""


def oom_counter(pid: int) -> OomCounter | None:
    """The OOM-kill counter of the memory cgroup ``pid`` is in now; None if unreadable."""
    for directory, file in _candidates(pid):
        kills = _read_kills(os.path.join(directory, file))
        if kills is not None:
            return OomCounter(directory, file, kills)
    return None


def _candidates(pid: int) -> list[tuple[str, str]]:
    try:
        with open(f"/proc/{pid}/cgroup") as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    v1, v2 = [], []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        path = path.lstrip("/")
        if controllers == "":  # the unified (v2) hierarchy
            # /sys/fs/cgroup itself on v2 hosts, /sys/fs/cgroup/unified on hybrid ones.
            v2 += [(os.path.join(_ROOT, path), "memory.events")]
            v2 += [(os.path.join(_ROOT, "unified", path), "memory.events")]
        elif "memory" in controllers.split(","):
            v1.append((os.path.join(_ROOT, "memory", path), "memory.oom_control"))
    # Where both exist (hybrid), the memory controller is the v1 one.
    return v1 + v2


def _read_kills(path: str) -> int | None:
    try:
        with open(path) as f:
            for line in f:
                key, _, value = line.partition(" ")
                if key == "oom_kill":
                    return int(value)
    except (OSError, ValueError):
        return None
    return None


# torch.OutOfMemoryError (torch.cuda.OutOfMemoryError before 2.5) as the rank reports it.
_CUDA_OOM = {"OutOfMemoryError", "torch.OutOfMemoryError", "torch.cuda.OutOfMemoryError"}


def cuda_oom_note(failures, placement) -> str:
    """A line naming the GPU of each rank that ran out of GPU memory ('' if none did).

    torch numbers GPUs within the rank's CUDA_VISIBLE_DEVICES. The user knows
    the GPU by its host's index (``nvidia-smi``, the CUDA_VISIBLE_DEVICES
    entry), so that is named with the rank's ``cuda:<i>``, with the ranks
    sharing it (their tensors count against the same memory) and the way on.
    ``placement``: the session's :class:`~nbdist.launch.placement.Placement` (or None).
    """
    if placement is None:
        return ""
    slots = {s.rank: s for s in placement.slots}
    shared = placement.shared_gpus
    lines = []
    for failure in failures:
        slot = slots.get(failure.rank)
        if failure.ename not in _CUDA_OOM or slot is None or slot.gpu is None:
            continue
        others = [r for r in shared.get((slot.host, slot.gpu), []) if r != failure.rank]
        sharing = f", shared with rank {','.join(map(str, others))}" if others else ""
        where = f" on {slot.host}" if slot.host != "localhost" else ""
        lines.append(
            f"rank {failure.rank} ran out of memory on GPU {slot.gpu}{where} ({slot.device}){sharing}: "
            "what it holds stays; free tensors (del x; torch.cuda.empty_cache()) or use "
            "smaller batches, and the next cell runs"
        )
    return "\n".join(lines)
