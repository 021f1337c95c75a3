"""Kernel side: the private ipyparallel profile directory of each local start, and clearing those a killed kernel left.

A start without a named profile gets a directory of its own,
``<temp dir>/nbdist-XXXXXXXX`` (``0700``): the cluster's connection files and its
processes' logs. :func:`nbdist.launch.cluster.stop_processes` removes it
(:func:`remove_profile`). A kernel that is killed outright (SIGKILL, the
out-of-memory killer) cannot: its controller and ranks end themselves
(:mod:`nbdist.launch.parent_watchdog`, the zygote), but the directory stayed, one
per killed kernel, for as long as the machine ran.

So each directory holds an ``owner.json``: the process that made it (PID and start
time, so a reused PID is not taken for it) and, once the cluster is up, the
processes it started. :func:`remove_orphans`, run by every local start, removes the
directories whose owner and processes are all gone. A directory without that file
(a named profile, another program's) is never touched; one whose processes were
never recorded (the kernel died while starting) is removed only once nothing was
written in it for :data:`UNRECORDED_GRACE_S`, since a rank may still be ending there.

Example::

    path = private_profiles.make()            # /tmp/nbdist-k2j4x9ab, owner.json inside
    private_profiles.record_processes(path, {controller_pid, zygote_pid, *rank_pids})
    private_profiles.remove_orphans()          # [] while this process lives
"""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
import tempfile
import time
from collections.abc import Iterable

from nbdist.launch import named_session_records, process_tree

__all__ = [
    "OWNER_FILE",
    "PREFIX",
    "UNRECORDED_GRACE_S",
    "make",
    "record_processes",
    "remove_profile",
    "remove_orphans",
]

PREFIX = "nbdist-"
OWNER_FILE = "owner.json"
# A killed kernel's controller ends within ~6 s (its watchdog's SIGTERM, then SIGKILL 5 s
# later) and its zygote's ranks within ~4 s; a minute leaves a wide margin for a loaded machine.
UNRECORDED_GRACE_S = 60.0
# What tempfile.mkdtemp(prefix=PREFIX) makes: 8 characters from its alphabet.
_NAME = re.compile(r"^nbdist-[a-z0-9_]{8}$")


def _write(path: str, owner: dict) -> None:
    # Atomic, so a sweep never reads half a file.
    named_session_records.write_json(os.path.join(path, OWNER_FILE), owner)


def make() -> str:
    """A new private profile directory (``0700``), owned by this process."""
    path = tempfile.mkdtemp(prefix=PREFIX)
    _write(path, {"owner": process_tree.pid_entry(os.getpid()), "processes": None})
    return path


def record_processes(path: str, pids: Iterable[int]) -> None:
    """Note the processes started for the directory at ``path``; never raises.

    Until they are noted, a sweep waits :data:`UNRECORDED_GRACE_S` after the owner dies.
    """
    try:
        processes = [e for e in map(process_tree.pid_entry, sorted(pids)) if e is not None]
        _write(path, {"owner": process_tree.pid_entry(os.getpid()), "processes": processes})
    except OSError:
        pass  # the directory is still removed by a clean stop; only a kill would leave it


def remove_profile(path: str) -> None:
    """Remove the directory at ``path`` once its processes are stopped; never raises.

    A process still ending may write a file while the tree is removed (the zygote notes
    each rank's exit), which leaves the directory: it is tried again, and what still
    stays is marked as owned by nobody, so the next start removes it.
    """
    for _ in range(3):
        shutil.rmtree(path, ignore_errors=True)
        if not os.path.exists(path):
            return
        time.sleep(0.1)
    try:
        _write(path, {"owner": {"pid": 0}, "processes": []})
    except OSError:
        pass


def _orphaned(path: str, now: float) -> bool:
    try:
        with open(os.path.join(path, OWNER_FILE)) as f:
            owner = json.load(f)
        if not isinstance(owner, dict) or not isinstance(owner.get("owner"), dict):
            return False
        if process_tree.alive(owner["owner"]) is not None:
            return False
        processes = owner.get("processes")
        if processes is None:
            newest = max(
                (
                    os.stat(os.path.join(d, n)).st_mtime
                    for d, _, names in os.walk(path)
                    for n in names
                ),
                default=os.stat(path).st_mtime,
            )
            return now - newest >= UNRECORDED_GRACE_S
        return not any(process_tree.alive(p) is not None for p in processes)
    except (OSError, ValueError, TypeError):
        return False  # not ours to judge (no owner file, another user's, half gone)


def remove_orphans(folder: str | None = None) -> list[str]:
    """Remove the private profile directories whose kernel and processes are gone; their paths.

    ``folder``: where to look (the temp directory by default). Only this user's
    directories named as :func:`make` names them, with an owner file, are looked at.
    Never raises: a start must not fail over another kernel's leftovers.
    """
    folder = folder or tempfile.gettempdir()
    removed = []
    now = time.time()
    try:
        names = [n for n in os.listdir(folder) if _NAME.match(n)]
    except OSError:
        return removed
    uid = os.getuid()
    for name in names:
        path = os.path.join(folder, name)
        try:
            info = os.lstat(path)  # a link is not followed
        except OSError:
            continue
        if info.st_uid != uid or not stat.S_ISDIR(info.st_mode):
            continue
        if _orphaned(path, now):
            shutil.rmtree(path, ignore_errors=True)
            if not os.path.exists(path):
                removed.append(path)
    return removed
