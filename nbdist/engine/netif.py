"""Rank side: which network interface gloo and NCCL use on a rank.

gloo and NCCL pick an interface by themselves from the hostname or the first
non-loopback interface, which goes wrong as soon as a host has several
networks (a login network and a fast fabric, a container bridge, hosts that
share a hostname). Measured with ranks in two network namespaces sharing one
hostname: ``init_process_group("gloo")`` never completed with the default
choice, and formed in 0.1 s once ``GLOO_SOCKET_IFNAME`` named the interface
holding the address that reaches rank 0.

So each rank sets ``GLOO_SOCKET_IFNAME`` and ``NCCL_SOCKET_IFNAME`` to the
interface that holds its own address on the route to rank 0 (MASTER_ADDR).
A value the user already set is kept: theirs wins.

Pure parts (:func:`interface_for`, :func:`socket_ifname_env`) take the
interface table as an argument and are unit-tested; :func:`local_interfaces`
and :func:`choose_socket_ifname` read this machine. Imports with the standard
library alone (psutil, a dependency of nbdist, only when reading interfaces).

Example::

    >>> interface_for("10.0.0.2", {"lo": ["127.0.0.1"], "eth1": ["10.0.0.2"]})
    'eth1'
    >>> socket_ifname_env("10.0.0.2", {"eth1": ["10.0.0.2"]}, environ={})
    {'GLOO_SOCKET_IFNAME': 'eth1', 'NCCL_SOCKET_IFNAME': 'eth1'}
"""

from __future__ import annotations

import ipaddress
import os
import socket
from collections.abc import Mapping, Sequence

__all__ = [
    "IFNAME_VARIABLES",
    "address_towards",
    "choose_socket_ifname",
    "interface_for",
    "is_loopback",
    "local_interfaces",
    "socket_ifname_env",
]


def is_loopback(host: str) -> bool:
    """Whether ``host`` is a loopback address or ``localhost`` (only this machine reaches it).

    >>> is_loopback("127.0.0.1"), is_loopback("::1"), is_loopback("localhost"), is_loopback("node1")
    (True, True, True, False)
    """
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


# The variables that name the interface of each backend's data sockets.
IFNAME_VARIABLES = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")


def interface_for(address: str, interfaces: Mapping[str, Sequence[str]]) -> str | None:
    """The name of the interface holding ``address``, or None if none holds it.

    Loopback addresses (127.0.0.0/8, ::1) map to the loopback interface even
    when the table lists only 127.0.0.1 on it.
    """
    try:
        wanted = ipaddress.ip_address(address)
    except ValueError:
        return None
    for name, addresses in interfaces.items():
        for text in addresses:
            # IPv6 link-local addresses come as 'fe80::1%eth0'
            try:
                if ipaddress.ip_address(text.split("%", 1)[0]) == wanted:
                    return name
            except ValueError:
                continue
    if wanted.is_loopback:
        loopbacks = [n for n, addrs in interfaces.items() if _is_loopback_interface(n, addrs)]
        return loopbacks[0] if loopbacks else None
    return None


def _is_loopback_interface(name: str, addresses: Sequence[str]) -> bool:
    if name.startswith("lo"):
        return True
    for text in addresses:
        try:
            if ipaddress.ip_address(text.split("%", 1)[0]).is_loopback:
                return True
        except ValueError:
            continue
    return False


def socket_ifname_env(
    address: str,
    interfaces: Mapping[str, Sequence[str]],
    *,
    environ: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """The GLOO/NCCL interface variables to set for a rank whose address is ``address``.

    Returns only the variables to add: those the user set (in ``environ``) are
    left out, and nothing is returned when no interface holds the address (the
    backends then fall back to their own choice).
    """
    env = os.environ if environ is None else environ
    name = interface_for(address, interfaces)
    if name is None:
        return {}
    return {var: name for var in IFNAME_VARIABLES if not env.get(var)}


def local_interfaces() -> dict[str, list[str]]:
    """This machine's (this network namespace's) interfaces and their IP addresses."""
    import psutil

    families = (socket.AF_INET, socket.AF_INET6)
    return {
        name: [a.address for a in addrs if a.family in families]
        for name, addrs in psutil.net_if_addrs().items()
    }


def address_towards(host: str) -> str:
    """This machine's address on the route to ``host`` (what ``host`` would see us as).

    A UDP ``connect`` sends nothing; it only asks the kernel to pick a route.
    """
    if is_loopback(host):
        return "127.0.0.1"
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        probe.connect((host, 9))
        return probe.getsockname()[0]
    finally:
        probe.close()


def choose_socket_ifname(master_addr: str, environ: dict[str, str] | None = None) -> dict[str, str]:
    """Set the interface variables on this rank for a group whose rank 0 is ``master_addr``.

    Returns what it set (empty if the user set both, or no route was found).
    Called by nbdist before ``init_process_group`` on every rank.
    """
    env = os.environ if environ is None else environ
    try:
        address = address_towards(master_addr)
    except OSError:
        return {}
    chosen = socket_ifname_env(address, local_interfaces(), environ=env)
    env.update(chosen)
    return chosen
