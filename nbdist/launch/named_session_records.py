"""Kernel side and separate process (read by the Jupyter server too): the records of named sessions.

A named session (``%dist_start N --name NAME``) outlives the kernel that
started it, so what a later kernel needs to reach it is kept on disk, in
``<jupyter runtime dir>/nbdist/sessions/NAME/``:

- ``session.json``: written by the session's keeper process
  (:mod:`nbdist.launch.named_session_keeper`): its state, the PIDs it started (each with its
  start time, so a reused PID is never taken for it), the controller's client
  connection file, the metrics collector's address, the run id and history.
- ``group.json``: written by the kernel that formed the process group: the
  ranks (rank, engine, PID, host, device), so a kernel that attaches while the
  ranks are busy with a cell needs nothing from them.
- ``keeper.log``: the keeper's own output.
- ``.NAME.starting`` (beside the session directories): held locked (``flock``) by the
  kernel starting session ``NAME``, from its check that the name is free until the
  session runs or its start failed (:func:`claim`); a second kernel starting the
  same name at that moment is refused instead of starting a second keeper. The
  lock ends with the process holding it, so a kernel killed mid-start blocks nothing.
- ``attached/PID.json``: one per kernel attached now (its PID and start time),
  written when a kernel starts or attaches to the session and removed when it
  detaches; a kernel that died leaves one whose process is gone, which counts
  for nothing. The keeper reads them to know when the session is idle (no kernel
  attached and no cell running): ``idle_since`` in the record, and the end of a
  session started with ``--idle-timeout``.

The directories are ``0700`` and the files ``0600``: only the user who started
a session can read its connection file and attach (ipyparallel's HMAC key is
in that file, unchanged). Only the standard library and psutil are imported
here.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
import time
from contextlib import contextmanager

import psutil

from nbdist.engine import process_ending
from nbdist.errors import NbdistError
from nbdist.launch import process_tree

__all__ = [
    "FORMAT",
    "attached_kernels",
    "check_name",
    "claim",
    "describe_session",
    "mark_attached",
    "mark_detached",
    "read",
    "read_group",
    "records",
    "remove",
    "session_dir",
    "sessions_dir",
    "state_of",
    "stop",
    "write_json",
]

FORMAT = 1
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
RECORD, GROUP, LOG, ATTACHED = "session.json", "group.json", "keeper.log", "attached"


def check_name(name: object) -> str:
    """``name`` if it can name a session (letters, digits, ``_ . -``, <= 64), else NbdistError."""
    if not isinstance(name, str) or not _NAME.match(name):
        raise NbdistError(
            f"session name {name!r}: use letters, digits, '_', '.' or '-' (at most 64, "
            "starting with a letter or digit), e.g. --name train1"
        )
    return name


def sessions_dir(create: bool = False) -> str:
    """``<jupyter runtime dir>/nbdist/sessions``; ``create`` makes it ``0700`` (and narrows it)."""
    from jupyter_core.paths import jupyter_runtime_dir

    path = os.path.join(jupyter_runtime_dir(), "nbdist", "sessions")
    if create:
        os.makedirs(path, mode=0o700, exist_ok=True)
        os.chmod(os.path.dirname(path), 0o700)
        os.chmod(path, 0o700)
    return path


def session_dir(name: str, create: bool = False) -> str:
    """The directory of session ``name`` (checked); ``create`` makes it ``0700``."""
    path = os.path.join(sessions_dir(create=create), check_name(name))
    if create:
        os.makedirs(path, mode=0o700, exist_ok=True)
        os.chmod(path, 0o700)
    return path


@contextmanager
def claim(name: str):
    """Hold the right to start session ``name`` (this process alone) for the ``with`` block.

    NbdistError, naming the other kernel, if another process holds it now. The
    lock file is removed when the block ends; a process that dies holding it
    releases it with its file descriptors (the next claim takes the file over).
    """
    path = os.path.join(sessions_dir(create=True), f".{check_name(name)}.starting")
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 64).decode(errors="replace").strip() or "?"
            os.close(fd)
            raise NbdistError(
                f"session {name!r} is being started by another kernel (PID {holder}) right now: "
                f"%dist_attach {name} once it runs, or pick another name"
            ) from None
        # Locked: but a holder that just finished may have removed this file (it unlinks
        # before unlocking); then the lock is on a file nobody else will open again.
        try:
            same = os.stat(path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)
    try:
        os.ftruncate(fd, 0)
        os.write(fd, str(os.getpid()).encode())
        yield
    finally:
        try:
            os.unlink(path)
        finally:
            os.close(fd)


def write_json(path: str, content: dict) -> None:
    """Write ``content`` to ``path`` as ``0600`` JSON, atomically (a reader never sees half)."""
    tmp = f"{path}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(content, f)
    os.replace(tmp, path)


def _read_json(path: str) -> dict | None:
    try:
        if os.stat(path).st_uid != os.getuid():
            return None  # another user's file is never trusted (nor attached to)
        with open(path) as f:
            content = json.load(f)
    except (OSError, ValueError):
        return None
    return content if isinstance(content, dict) else None


def read(name: str) -> dict | None:
    """Session ``name``'s record (``session.json``), or None when there is none."""
    record = _read_json(os.path.join(session_dir(name), RECORD))
    if record is None or record.get("format") != FORMAT:
        return None
    return record


def read_group(name: str) -> dict | None:
    """The process group the first kernel formed for ``name`` (``group.json``), or None."""
    return _read_json(os.path.join(session_dir(name), GROUP))


def mark_attached(name: str, pid: int | None = None) -> None:
    """Note that the kernel ``pid`` (this process by default) is attached to session ``name``."""
    pid = os.getpid() if pid is None else pid
    folder = os.path.join(session_dir(name), ATTACHED)
    os.makedirs(folder, mode=0o700, exist_ok=True)
    entry = process_tree.pid_entry(pid)
    if entry is not None:
        write_json(os.path.join(folder, f"{pid}.json"), entry)


def mark_detached(name: str, pid: int | None = None) -> None:
    """Undo :func:`mark_attached` (never raises: the session may be gone already)."""
    pid = os.getpid() if pid is None else pid
    try:
        os.remove(os.path.join(session_dir(name), ATTACHED, f"{pid}.json"))
    except (OSError, NbdistError):
        pass


def attached_kernels(name: str) -> list[int]:
    """The PIDs of the kernels attached to session ``name`` now (alive ones only)."""
    folder = os.path.join(session_dir(name), ATTACHED)
    try:
        names = os.listdir(folder)
    except OSError:
        return []
    pids = []
    for entry in sorted(names):
        if entry.endswith(".json") and process_tree.alive(_read_json(os.path.join(folder, entry))):
            pids.append(int(entry[: -len(".json")]))
    return pids


def state_of(record: dict) -> str:
    """'starting', 'running', 'failed', 'stopping' or 'gone' (its keeper process ended)."""
    if process_tree.alive(record.get("keeper")) is None:
        return "gone"
    state = record.get("state", "")
    return "running" if state == "ready" else state


def describe_session(record: dict, now: float | None = None) -> dict:
    """The row ``%dist_sessions`` and the sidebar show for one record.

    ``idle_s``: seconds with no kernel attached and no cell running (None while
    one is, or before the keeper first looked); ``idle_timeout``: when the keeper
    ends it (None: never); ``memory``: resident bytes of its processes on this
    host (keeper, controller, zygote, ranks); ``gpus``: the GPUs its ranks hold.
    """
    state = state_of(record)
    idle_since = record.get("idle_since")
    now = time.time() if now is None else now
    return {
        "name": record.get("name"),
        "ranks": record.get("n"),
        "launcher": record.get("launcher") or "local",
        "started": record.get("started"),
        "state": state,
        "last_step": record.get("last_step"),
        "run_id": record.get("run_id"),
        "error": record.get("error") or "",
        "idle_s": max(0.0, now - idle_since) if idle_since and state == "running" else None,
        "idle_timeout": (record.get("options") or {}).get("idle_timeout"),
        "memory": _memory(record) if state != "gone" else 0,
        "gpus": record.get("gpus") or [],
    }


def _memory(record: dict) -> int:
    # Resident set sizes summed: forked ranks share pages with the zygote, so this
    # overstates what freeing them gives back, never understates what they hold.
    procs = {}
    for entry in [record.get("keeper"), *record.get("pids", [])]:
        proc = process_tree.alive(entry)
        if proc is None:
            continue
        procs[proc.pid] = proc
        try:
            procs.update((c.pid, c) for c in proc.children(recursive=True))
        except psutil.Error:
            pass
    total = 0
    for proc in procs.values():
        try:
            total += proc.memory_info().rss
        except psutil.Error:
            pass
    return total


def records() -> list[dict]:
    """Every named session's record of this user, oldest first (gone ones included)."""
    folder = sessions_dir()
    try:
        names = sorted(os.listdir(folder))
    except OSError:
        return []
    out = []
    for name in names:
        if not _NAME.match(name):
            continue
        record = read(name)
        if record is not None:
            out.append(record)
    out.sort(key=lambda r: (r.get("started") or 0, r.get("name") or ""))
    return out


def remove(name: str) -> None:
    """Remove session ``name``'s directory (its record, group and log); never raises."""
    shutil.rmtree(session_dir(name), ignore_errors=True)


def stop(name: str, *, wait: float = 20.0) -> list[int]:
    """End session ``name`` wherever it runs; the PIDs that had to be killed.

    SIGTERM to its keeper, which stops its ranks and controller and removes its
    record; if the keeper is gone or does not finish within ``wait`` s, the
    recorded processes (each checked by its start time) and everything below
    them are ended by PID, and the record removed. NbdistError if there is no such session.
    """
    record = read(check_name(name))
    if record is None:
        if os.path.isdir(session_dir(name)):
            remove(name)  # a keeper that never wrote its record
            return []
        raise NbdistError(f"no named session {name!r}: %dist_sessions lists them")
    keeper = process_tree.alive(record.get("keeper"))
    if keeper is not None:
        try:
            keeper.terminate()
            keeper.wait(wait)
        except psutil.Error:  # gone meanwhile, or still there after ``wait``: ended below
            pass
    procs = [p for p in map(process_tree.alive, record.get("pids", [])) if p is not None]
    if process_tree.alive(record.get("keeper")) is not None:
        procs.append(keeper)
    killed = process_ending.end(procs + process_tree.descendants([p.pid for p in procs]))
    remove(name)
    return killed
