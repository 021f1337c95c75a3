"""Kernel side, before anything starts: is a host this machine (may engines there dial loopback)?

Engines on another host cannot reach a controller on 127.0.0.1, so a launcher
that starts them elsewhere needs ``--ip``; engines on this machine (a one-node
Slurm cluster, ``ssh localhost``, ``mpiexec`` without hosts) reach loopback fine,
and nothing then listens beyond it.

Example::

    >>> is_this_machine("127.0.0.1"), is_this_machine("localhost")
    (True, True)
    >>> is_this_machine("192.0.2.99")  # TEST-NET-1: never this machine's address
    False
"""

from __future__ import annotations

import ipaddress
import socket
import subprocess
from collections.abc import Sequence

__all__ = ["is_this_machine", "ssh_hostname"]


def _local_addresses() -> set[str]:
    from nbdist.engine.netif import local_interfaces

    return {a.split("%")[0] for addrs in local_interfaces().values() for a in addrs}


def is_this_machine(host: str) -> bool:
    """True if ``host`` (a name or an address; ``user@`` allowed) is this machine."""
    host = host.rpartition("@")[2].strip("[]")
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        address = None
    if address is not None:
        return address.is_loopback or str(address) in _local_addresses()
    names = {"localhost", socket.gethostname(), socket.gethostname().split(".")[0]}
    try:
        names.add(socket.getfqdn())
    except OSError:
        pass
    if host in names:
        return True
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError):
        return False
    addresses = {info[4][0] for info in infos}
    local = _local_addresses()
    return bool(addresses) and all(
        ipaddress.ip_address(a.split("%")[0]).is_loopback or a in local for a in addresses
    )


def ssh_hostname(host: str, ssh_args: Sequence[str] = ()) -> str:
    """The host ``ssh [ssh_args] host`` would connect to (its config resolves aliases).

    ``ssh -G`` prints the configuration it would use and connects nowhere; without
    an ssh client, ``host`` itself.
    """
    name = host.rpartition("@")[2]
    try:
        result = subprocess.run(
            ["ssh", "-G", *ssh_args, name], capture_output=True, text=True, timeout=10, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return name
    for line in result.stdout.splitlines():
        key, _, value = line.partition(" ")
        if key == "hostname" and value:
            return value.strip()
    return name
