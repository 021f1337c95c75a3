"""Rank side: the crash record of a rank a launcher started (Slurm, MPI, SSH), and reading one.

A rank that dies of a fatal signal in native code (SIGSEGV, SIGABRT, SIGBUS,
SIGFPE, SIGILL) says nothing itself. The ranks nbdist forks get a record from
the zygote (:mod:`nbdist.launch.zygote`); a rank that Slurm, ``mpiexec`` or SSH
started opens its own here when it joins the group: faulthandler writes every
thread's Python stack to ``<temp dir>/nbdist-crash-<uid>/<host>-<space>-<pid>.txt`` (``<space>``
names the machine's boot and the PID namespace, where a PID means one process;
``$NBDIST_CRASH_DIR`` instead of the temp dir), a file on the rank's machine.
The kernel reads it when the rank dies: itself where the file is on its own
machine, else through a live rank of the same machine (:func:`read_record`, a control
request), so the death's line says where in Python the rank was.

A rank that ends without crashing removes its own record (at exit, on the
scheduler's SIGTERM, when its kernel is gone, at ``%dist_stop``:
:func:`remove_own_record`); a crashed rank's goes at ``%dist_stop``
(:mod:`nbdist.driver.launcher_crashes`). One left where no rank of that machine
was alive to remove it is pruned by the next rank of the same machine and PID
namespace to open a record (:func:`open_record` removes those of processes
that no longer run).
"""

from __future__ import annotations

import atexit
import contextlib
import faulthandler
import hashlib
import os
import re
import socket
import stat
import tempfile

__all__ = [
    "open_record",
    "read_record",
    "record_dir",
    "record_host",
    "remove_own_record",
    "remove_record",
]

# A record holds one dump, from its top; a dump of many threads is capped here.
_MAX_BYTES = 256 * 1024
_NAME = re.compile(r"^(?P<host>.+)-(?P<space>[0-9a-f]{8})-(?P<pid>\d+)\.txt$")

_own: str = ""  # this process's record ('' when it has none of its own)
_file = None  # the open file faulthandler writes to: it must stay open while the rank runs


def record_dir() -> str:
    """Where this machine's ranks keep their records (one folder per user)."""
    base = os.environ.get("NBDIST_CRASH_DIR") or tempfile.gettempdir()
    return os.path.join(base, _folder_name())


def _folder_name() -> str:
    return f"nbdist-crash-{os.getuid()}"


def record_host(path: str) -> str:
    """The host name in a record's file name ('' if ``path`` names no record)."""
    found = _NAME.match(os.path.basename(path))
    return found["host"] if found else ""


def _space() -> str:
    # Where a PID names one process: this boot of the machine and its PID namespace (ranks in
    # containers, or in namespaces of their own, may share a temp dir and a PID).
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        namespace = os.stat("/proc/self/ns/pid").st_ino
    except OSError:  # not Linux: the host name alone tells the processes apart
        boot, namespace = "", 0
    return hashlib.sha256(f"{boot}/{namespace}".encode()).hexdigest()[:8]


def _private_folder(folder: str) -> bool:
    # Ours alone: in a shared temp dir another user could have made it first (and planted links).
    os.makedirs(folder, mode=0o700, exist_ok=True)
    found = os.lstat(folder)
    return (
        stat.S_ISDIR(found.st_mode)
        and found.st_uid == os.getuid()
        and not found.st_mode & (stat.S_IRWXG | stat.S_IRWXO)
    )


def open_record() -> str:
    """Open this rank's record and have faulthandler write to it; its path ('' if none).

    A rank whose faulthandler is on already (the zygote's record, or the user's
    own) keeps it.
    """
    global _own, _file
    if _own or faulthandler.is_enabled():
        return _own
    folder = record_dir()
    host, space = socket.gethostname(), _space()
    path = os.path.join(folder, f"{host}-{space}-{os.getpid()}.txt")
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
    try:
        if not _private_folder(folder):
            return ""
        _prune(folder, host, space)
        with contextlib.suppress(FileNotFoundError):
            os.remove(path)  # an earlier process's, with this PID: it ended
        _file = os.fdopen(os.open(path, flags, 0o600), "w")
    except OSError:
        return ""
    faulthandler.enable(file=_file, all_threads=True)
    _own = path
    # A child the rank forks (a DataLoader worker) would write its own crash here, or remove
    # the record as it ends: it has none.
    os.register_at_fork(after_in_child=_forget_in_child)
    atexit.register(remove_own_record)  # an orderly exit: nothing to tell
    return path


def _forget_in_child() -> None:
    global _own, _file
    if _own:
        faulthandler.disable()
        _own, _file = "", None


def _prune(folder: str, host: str, space: str) -> None:
    # Records of processes of this machine and PID namespace that no longer run: their
    # deaths were reported (or their kernel is gone).
    for name in os.listdir(folder):
        found = _NAME.match(name)
        if not found or (found["host"], found["space"]) != (host, space):
            continue
        pid = int(found["pid"])
        if pid == os.getpid():
            continue
        try:
            os.kill(pid, 0)
            continue  # it runs
        except OSError:  # gone (or the PID is another user's process now: ours is gone)
            pass
        with contextlib.suppress(OSError):
            os.remove(os.path.join(folder, name))


def _checked(path: str) -> str:
    # Only records: a rank (or the kernel) reads and removes no other file for it. The folder is
    # checked by name: a rank's temp dir may differ from the kernel's (a job's own TMPDIR).
    if not (
        _NAME.match(os.path.basename(path))
        and os.path.basename(os.path.dirname(path)) == _folder_name()
    ):
        raise ValueError(f"{path!r} is not an nbdist crash record")
    return path


def read_record(path: str) -> str | None:
    """The record at ``path`` on this machine ('' if empty, None if there is none)."""
    try:
        with open(_checked(path), "rb") as f:
            return f.read(_MAX_BYTES).decode(errors="replace")
    except (OSError, ValueError):
        return None


def remove_record(path: str) -> bool:
    """Remove the record at ``path`` on this machine; whether there was one."""
    try:
        os.remove(_checked(path))
    except (OSError, ValueError):
        return False
    return True


def remove_own_record() -> None:
    """This rank ends without a crash: its record goes (faulthandler off first).

    Called from the control thread, the controller watch, a signal handler or at exit: the
    state is taken before anything else, so two callers cannot both act on it.
    """
    global _own, _file
    own, file = _own, _file
    _own, _file = "", None
    if not own:
        return
    faulthandler.disable()
    with contextlib.suppress(OSError):
        file.close()
    with contextlib.suppress(OSError):
        os.remove(own)
