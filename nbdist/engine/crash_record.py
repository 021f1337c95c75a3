"""Rank side: the crash record of a rank a launcher started (Slurm, MPI, SSH), and reading one.

A rank that dies of a fatal signal in native code (SIGSEGV, SIGABRT, SIGBUS,
SIGFPE, SIGILL) says nothing itself. The ranks nbdist forks get a record from
the zygote (:mod:`nbdist.launch.zygote`); a rank that Slurm, ``mpiexec`` or SSH
started opens its own here when it joins the group: faulthandler writes every
thread's Python stack to ``<temp dir>/nbdist-crash-<uid>/<host>-<pid namespace>-<pid>.txt``
(``$NBDIST_CRASH_DIR`` instead of the temp dir), a file on the rank's machine.
The kernel reads it when the rank dies: itself where the file is on its own
machine, else through a live rank of the same machine (:func:`read_record`, a control
request), so the death's line says where in Python the rank was.

At ``%dist_stop`` each live rank removes its own record (:func:`remove_own_record`)
and a crashed rank's goes too (:mod:`nbdist.driver.launcher_crashes`); one left on
a machine whose ranks all died is pruned by the next rank there to open a record
(:func:`open_record` removes those of processes that no longer run).
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import re
import socket
import tempfile

__all__ = ["open_record", "read_record", "record_dir", "remove_own_record", "remove_record"]

# The end of a record: its last dump, the one of the rank's death.
_TAIL_BYTES = 64 * 1024
_NAME = re.compile(r"^(?P<host>.+)-(?P<space>\d+)-(?P<pid>\d+)\.txt$")

_own: str = ""  # this process's record ('' when it has none of its own)
_file = None  # the open file faulthandler writes to: it must stay open while the rank runs


def record_dir() -> str:
    """Where this machine's ranks keep their records (one folder per user)."""
    base = os.environ.get("NBDIST_CRASH_DIR") or tempfile.gettempdir()
    return os.path.join(base, f"nbdist-crash-{os.getuid()}")


def open_record() -> str:
    """Open this rank's record and have faulthandler write to it; its path ('' if none).

    A rank whose faulthandler is on already (the zygote's record, or the user's
    own) keeps it.
    """
    global _own, _file
    if _own or faulthandler.is_enabled():
        return _own
    folder = record_dir()
    try:
        os.makedirs(folder, mode=0o700, exist_ok=True)
        _prune(folder)
        path = os.path.join(folder, f"{_space()}-{os.getpid()}.txt")
        _file = open(path, "w")  # noqa: SIM115 - open for the rank's whole life
    except OSError:
        return ""
    faulthandler.enable(file=_file, all_threads=True)
    # A child the rank forks (a DataLoader worker) would write its own crash here: it gets none.
    os.register_at_fork(after_in_child=faulthandler.disable)
    _own = path
    return path


def _space() -> str:
    # Where a PID names one process: the host and its PID namespace (ranks in containers, or
    # in namespaces of their own, may share a temp dir and a PID).
    try:
        namespace = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        namespace = 0
    return f"{socket.gethostname()}-{namespace}"


def _prune(folder: str) -> None:
    # Records of processes of this host and PID namespace that no longer run: their deaths
    # were reported.
    space = _space()
    for name in os.listdir(folder):
        found = _NAME.match(name)
        if not found or f"{found['host']}-{found['space']}" != space:
            continue
        pid = int(found["pid"])
        if pid == os.getpid():
            continue
        try:
            os.kill(pid, 0)
            continue
        except PermissionError:  # another user's process holds that PID now: ours is gone
            pass
        except OSError:
            pass
        with contextlib.suppress(OSError):
            os.remove(os.path.join(folder, name))


def _checked(path: str) -> str:
    # Only records: the kernel asks by path, and a rank reads no other file for it.
    real = os.path.realpath(path)
    if os.path.dirname(real) != os.path.realpath(record_dir()) or not _NAME.match(
        os.path.basename(real)
    ):
        raise ValueError(f"{path!r} is not a crash record of this machine ({record_dir()})")
    return real


def read_record(path: str) -> str | None:
    """The end of the record at ``path`` on this machine ('' if empty, None if there is none)."""
    try:
        with open(_checked(path), "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - _TAIL_BYTES))
            return f.read().decode(errors="replace")
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
    """This rank leaves: its record goes (faulthandler off first, so nothing writes to it)."""
    global _own, _file
    if not _own:
        return
    faulthandler.disable()
    with contextlib.suppress(OSError):
        _file.close()
        os.remove(_own)
    _own, _file = "", None
