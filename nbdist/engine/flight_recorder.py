"""Rank side: torch's flight recorder, the process group's own log of its last collectives.

nbdist's collectives wrapper (:mod:`nbdist.engine.collectives`) sees the
collectives called from Python; the flight recorder, kept by the process group
itself (NCCL, and gloo in torch >= 2.8), also sees those issued from C++ — DDP's
gradient all-reduces, FSDP's all-gathers — with their sizes and, on NCCL, their
state (scheduled / started / completed). ``%dist_where`` and a cell's
``--timeout`` report show its last entries per rank, so a hang inside DDP's
backward names the bucket the ranks disagree on.

It records only when its buffer size is set before the group forms:
:func:`enable` sets ``TORCH_FR_BUFFER_SIZE`` (NCCL's older name
``TORCH_NCCL_TRACE_BUFFER_SIZE`` before torch 2.8) unless the user set one. Recording costs a
ring-buffer entry per collective (no stack capture by default): within the noise
of a 16-float gloo all-reduce here (~0.8 ms either way, 3,000 calls).

Example (on a rank)::

    from nbdist.engine import flight_recorder
    flight_recorder.recent(3)
    # [{'seq': 41, 'op': 'all_reduce', 'state': 'completed', 'sizes': [[1024]], ...}, ...]
"""

from __future__ import annotations

import json
import os

__all__ = [
    "DEFAULT_ENTRIES",
    "enable",
    "group_formed",
    "group_forming",
    "open_before",
    "recent",
]

# Entries kept per rank: a few training steps of DDP buckets, a few hundred KB at most.
DEFAULT_ENTRIES = 1024
_ENV_NAMES = ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE")


def enable(entries: int = DEFAULT_ENTRIES) -> None:
    """Ask the next process group to record its collectives (kept if the user set a size)."""
    if any(name in os.environ for name in _ENV_NAMES):
        return
    import torch

    # torch >= 2.8 reads TORCH_FR_BUFFER_SIZE and warns on every rank when it finds
    # the older NCCL name; before 2.8 only NCCL recorded, under the older name.
    modern = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 8)
    os.environ[_ENV_NAMES[0] if modern else _ENV_NAMES[1]] = str(entries)


def _dump() -> dict | None:
    """Every recorder's entries in one ``{"entries": [...]}`` (None when torch has none).

    torch keeps a recorder per kind of device: on a CUDA build NCCL's entries come
    from ``_dump_nccl_trace_json``, while ``_dump_fr_trace_json`` (torch >= 2.8) holds
    the CPU recorder gloo writes to (seen with torch 2.11 on an H200: the latter had
    no NCCL entries). Both are read; an entry is kept once.
    """
    try:
        from torch._C import _distributed_c10d as c10d  # the only entry point torch offers
    except ImportError:
        return None
    entries, seen, found = [], set(), False
    for name in ("_dump_fr_trace_json", "_dump_nccl_trace_json"):
        dump = getattr(c10d, name, None)
        if dump is None:
            continue
        try:
            part = json.loads(dump(True, False))
        except Exception:  # no group yet, or a backend without a recorder
            continue
        found = True
        for entry in part.get("entries", []):
            key = (
                str(entry.get("process_group")),
                entry.get("record_id"),
                entry.get("profiling_name"),
                entry.get("collective_seq_id"),
            )
            if key not in seen:
                seen.add(key)
                entries.append(entry)
    if not found:
        return None
    # Two recorders interleave in time: order by creation where torch says when.
    if all("time_created_ns" in e for e in entries):
        entries.sort(key=lambda e: e["time_created_ns"])
    return {"entries": entries}


def recent(n: int = 8) -> list[dict] | None:
    """This rank's last ``n`` recorded collectives, oldest first; None when none are recorded.

    Each entry: ``seq`` (the group's collective sequence number, the same on every
    rank for the same call; on the default group counted after nbdist's start-up
    check, as ``%dist_where``'s "all_reduce #1" counts the user's calls), ``op`` (e.g. ``all_reduce``), ``group`` (its name),
    ``state`` (``scheduled``, ``started`` or ``completed``: gloo reports only
    ``scheduled``), ``done`` (retired: the work object finished), ``sizes`` and
    ``dtypes`` of its inputs.
    """
    found = _dump()
    if not found:
        return None
    # nbdist's own start-up calls (numbered 0 and below) are left out, and the calls of a
    # default group formed before this one (the recorder is one ring for the process).
    entries = [
        e
        for e in found.get("entries", [])
        if not e.get("is_p2p")
        and _number(e) > 0
        and not (
            (e.get("process_group") or ["", ""])[-1] == DEFAULT_GROUP
            and e.get("time_created_ns", _group_since_ns) < _group_since_ns
        )
    ]
    if not entries:
        return None
    out = []
    for e in entries[-n:]:
        name = str(e.get("profiling_name", ""))
        group = e.get("process_group") or ["", ""]
        out.append(
            {
                "seq": _number(e),
                # "nccl:all_reduce" / "gloo:all_reduce": the backend is known already.
                "op": name.split(":", 1)[-1],
                "group": str(group[-1]) if isinstance(group, list) else str(group),
                "state": str(e.get("state", "")),
                "done": bool(e.get("retired", False)),
                "sizes": e.get("input_sizes", []),
                "dtypes": e.get("input_dtypes", []),
            }
        )
    return out


# The default group's name in the recorder; other groups' members are not recorded (gloo
# leaves pg_config empty), so only the default group's calls are compared across ranks.
DEFAULT_GROUP = "default_pg"
# When this rank's current group began to form (time.time_ns(), the recorder's clock). The
# recorder is one ring for the process: a group formed again after a release keeps the
# old one's entries under the same name, with their own numbers (and calls never retired).
_group_since_ns = 0
# The default group's calls nbdist made itself while it formed (the all_reduce that checks
# every rank reaches every other, gloo-on-CUDA's probe): the recorder numbers them like the
# user's, nbdist's collectives wrapper (collectives.reset after them) does not. Numbers of
# the current default group are shown less these, so the user's first call is #1 in both.
_startup_calls = 0


def group_forming() -> None:
    """Mark that a new group forms now: older entries belong to a group that is gone."""
    import time

    global _group_since_ns, _startup_calls
    _group_since_ns = time.time_ns()
    _startup_calls = 0


def group_formed() -> None:
    """Mark that nbdist's own start-up calls on the new group are done (the user's come next)."""
    global _startup_calls
    found = _dump()
    _startup_calls = max(
        (int(e.get("collective_seq_id", 0)) for e in (found or {}).get("entries", []) if _mine(e)),
        default=0,
    )


def _mine(entry: dict) -> bool:
    """Whether ``entry`` is a collective of the current default group."""
    return (
        not entry.get("is_p2p")
        and (entry.get("process_group") or ["", ""])[-1] == DEFAULT_GROUP
        and entry.get("time_created_ns", 0) >= _group_since_ns
    )


def _number(entry: dict) -> int:
    """``entry``'s sequence number as shown: the current default group's less nbdist's own calls."""
    seq = int(entry.get("collective_seq_id", 0))
    return seq - _startup_calls if _startup_calls and _mine(entry) else seq


def default_group_state() -> dict | None:
    """On the default group: the last call this rank issued, and the newest one still open.

    ``{"last": seq, "open": {"seq", "op", "seconds"} or None}``: ``open`` is the
    newest recorded call not retired yet (its work not finished and waited for),
    ``seconds`` its age; only calls of the group formed last count. Calls issued from C++ (DDP's gradient buckets) count too.
    None when nothing is recorded. Reading the recorder costs ~15-25 ms at 1,024
    entries (gloo, 2 cores): the cell guard asks only while ranks finished a cell
    and others still run.
    """
    import time

    found = _dump()
    if not found:
        return None
    mine = [e for e in found.get("entries", []) if _mine(e) and _number(e) > 0]
    if not mine:
        return None
    # The newest open call: an older one left open (an async_op whose work the code keeps
    # without waiting) was issued by every rank, and would hide the one that waits.
    opened = max((e for e in mine if not e.get("retired", False)), key=_number, default=None)
    state: dict = {"last": max(_number(e) for e in mine), "open": None}
    if opened is not None:
        created = opened.get("time_created_ns")
        state["open"] = {
            "seq": _number(opened),
            "op": str(opened.get("profiling_name", "")).split(":", 1)[-1],
            "seconds": (time.time_ns() - created) / 1e9 if created else 0.0,
        }
    return state


def open_before(ns: int) -> dict | None:
    """The newest call of the groups formed last that was created before ``ns`` and never finished.

    ``{"op", "seq"}``, numbered as :func:`recent` numbers them; None where there is none, or
    nothing is recorded. Any group's calls count, and NCCL's point-to-point ones (numbered
    among the group's point-to-point calls; gloo records none, torch 2.13): what a rank
    held after its release waits in (:mod:`nbdist.engine.held_collective`).
    """
    found = _dump()
    if not found:
        return None
    opened = [
        e
        for e in found.get("entries", [])
        if not e.get("retired", False)
        and _group_since_ns <= e.get("time_created_ns", 0) < ns
        and (e.get("is_p2p") or _number(e) > 0)
    ]
    if not opened:
        return None
    newest = max(opened, key=lambda e: e["time_created_ns"])
    seq = int(newest.get("p2p_seq_id", 0)) if newest.get("is_p2p") else _number(newest)
    return {"op": str(newest.get("profiling_name", "")).split(":", 1)[-1], "seq": seq}
