"""Rank side: a rank that a launcher started ends itself once its controller has gone.

When its kernel is killed, a rank forked by nbdist's zygote dies with it (the zygote
watches the kernel; each rank has ``PR_SET_PDEATHSIG``). A rank that a launcher
started (``--launcher ssh``, ``slurm``, ``mpi``, ``local``) is nobody's child there.
ipyparallel ends an idle engine about 30 s after the controller's heartbeats stop,
but it checks on the engine's event loop, which a running cell holds. Measured over
SSH: after the kernel was SIGKILLed, the idle ranks ended 29 s later, but a rank in
a long cell ran on (and would have kept its GPU) until the cell ended.

:func:`start` watches from a thread of its own, outside that loop. Every
:data:`PERIOD_S` it opens, and closes at once, a TCP connection to the controller's
registration port: the address the engine registered with. The controller ends with
its kernel (or with a named session's keeper), and the connection is refused from
then on. Once no connection has succeeded for ``gone_s`` seconds, the rank gets
SIGTERM, and SIGKILL 5 s later if it is still there (ipyparallel's SIGTERM handler
stops an idle engine cleanly, but waits for a running cell to end). A network that
drops for less than that changes nothing; the controller itself gives up on a silent
rank after 3 s. The processes the rank's code started there are ended first, while
they are still its descendants (:mod:`nbdist.engine.own_processes`). Ranks that
the SSH launcher started also remove their host's copy of the connection file
(``/tmp/nbdist-ssh-<cluster>``), which ``%dist_stop`` would have removed.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import threading
import time
from urllib.parse import urlsplit

from nbdist.engine import crash_record, own_processes

__all__ = [
    "DEFAULT_GONE_S",
    "PERIOD_S",
    "controller_address",
    "engine_directory",
    "start",
]

# ipyparallel's own limit for an idle engine is ~30 s (50 missed checks): the same here.
DEFAULT_GONE_S = 30.0
PERIOD_S = 5.0
_started: list[threading.Thread] = []


def controller_address() -> tuple[str, int] | None:
    """``(host, port)`` this engine registered with, None outside an ipyparallel engine.

    None too for an engine that reaches its controller through an SSH tunnel
    (``--sshserver``): it is not watched.
    """
    try:
        from ipyparallel.engine.app import IPEngine
        from ipyparallel.util import disambiguate_url

        if not IPEngine.initialized():
            return None
        engine = IPEngine.instance()
        if engine.using_ssh:  # reached through an SSH tunnel: no address to try directly
            return None
        # As the engine itself connects: a wildcard (tcp://*) means the controller's host.
        url = urlsplit(disambiguate_url(engine.registration_url, engine.location))
        return (url.hostname, url.port) if url.hostname and url.port else None
    except Exception:  # not an engine, or an ipyparallel without these names
        return None


def _reachable(address: tuple[str, int], timeout: float) -> bool:
    try:
        with socket.create_connection(address, timeout=timeout):
            return True
    except OSError:
        return False


def engine_directory() -> str | None:
    """This engine's ipyparallel profile directory, None outside an engine."""
    try:
        from ipyparallel.engine.app import IPEngine

        return IPEngine.instance().profile_dir.location if IPEngine.initialized() else None
    except Exception:  # not an engine, or an ipyparallel without these names
        return None


def _watch(
    address: tuple[str, int], gone_s: float, period_s: float, remove_dir: str | None
) -> None:
    last_seen = time.monotonic()
    while True:
        if _reachable(address, timeout=period_s):
            last_seen = time.monotonic()
        elif time.monotonic() - last_seen >= gone_s:
            break
        time.sleep(period_s)
    print(
        f"nbdist: the controller at {address[0]}:{address[1]} has not answered for "
        f"{gone_s:g} s (its kernel is gone): this rank ends",
        flush=True,
    )
    if remove_dir:  # nothing else would: the kernel that made it is gone
        shutil.rmtree(remove_dir, ignore_errors=True)
    crash_record.remove_own_record()  # no kernel is left to read it
    own_processes.end_children()
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(5)  # still here: something caught SIGTERM
    os.kill(os.getpid(), signal.SIGKILL)


def start(
    gone_s: float = DEFAULT_GONE_S,
    *,
    period_s: float = PERIOD_S,
    address: tuple[str, int] | None = None,
    remove_dir: str | None = None,
) -> bool:
    """Start watching this engine's controller (once per process); False where there is none.

    ``address``: ``(host, port)`` to watch instead of :func:`controller_address`.
    ``remove_dir``: a directory made for this host's engines alone (the SSH launcher's copy
    of the connection file), removed before the rank ends.
    """
    if _started:
        return True
    address = address or controller_address()
    if address is None:
        return False
    thread = threading.Thread(
        target=_watch,
        args=(address, float(gone_s), min(float(period_s), float(gone_s)), remove_dir),
        name="nbdist-controller-watch",
        daemon=True,
    )
    thread.start()
    _started.append(thread)
    return True
