"""Both sides: whether a PID read on a rank names the same process on the kernel's machine.

A PID means one process only within one PID namespace of one running machine: a
rank on another host, or in a container of its own, has PIDs that name other
processes where the kernel runs (PID 1 there is this machine's init). The rank
reports :func:`pid_space` with its PID; the kernel compares it with its own before
it reads, watches or signals that PID. Hostnames cannot tell: containers share them,
and several hosts may carry one name.
"""

from __future__ import annotations

import os
import socket

__all__ = ["pid_space"]


def pid_space() -> str:
    """This process's PID namespace, as ``"<boot id>:<namespace inode>"`` (Linux).

    The boot id changes with each boot of each machine; the inode tells the
    namespaces of one boot apart. Elsewhere, the hostname (the best there is).
    """
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        return f"{boot}:{os.stat('/proc/self/ns/pid').st_ino}"
    except OSError:
        return f"host:{socket.gethostname()}"
