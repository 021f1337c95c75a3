"""Kernel side: why some ranks took seconds to connect to rank 0's store, said in the ready lines.

Every rank connects to rank 0's ``TCPStore`` as the group forms. torch's client prefers IPv6,
so an IPv4 address becomes its IPv4-mapped form (``::ffff:127.0.0.1``), and it looks up the
name of that address for its log on every connection, whatever the log level. Few
``/etc/hosts`` list that form, so each rank asks the DNS resolver; a resolver that leaves some
of a burst of such questions unanswered holds those ranks for its timeout (glibc's: 5 s), and
every rank waits for them: at the start, and each time the group forms again. Measured on a
2-core VM at 64 ranks: the start 14.8 s against 9.1 s, a release 10.7-13.3 s against 5.8-7.8 s
with the address listed (bench/RESULTS.md, 2026-12-06).

:func:`slow_connects_note` says so, naming the ranks and the line that ends the wait, when
some rank's connect took seconds and the address's name is indeed not found on this machine.
"""

from __future__ import annotations

import ipaddress
import socket
import threading
from collections.abc import Callable, Mapping

from nbdist.engine.netif import is_loopback
from nbdist.errors import format_ranks

__all__ = ["SLOW_S", "asks_the_resolver", "connect_address", "slow_connects_note"]

# A connect over loopback takes milliseconds (0.01-0.13 s at 64 ranks on 2 cores); a resolver's
# timeout is whole seconds (glibc's: 5 s unless resolv.conf's "options timeout:N" says otherwise).
SLOW_S = 2.5
# Up to this many ranks held up are named; more are counted.
NAMED = 8
# How long the kernel waits for its own lookup: longer means the resolver is slow now.
LOOKUP_WAIT_S = 0.5


def connect_address(master_addr: str) -> str:
    """The address torch's store client names, for rank 0's ``master_addr`` ('' if not an address).

    >>> connect_address("127.0.0.1"), connect_address("::1"), connect_address("node1")
    ('::ffff:127.0.0.1', '::1', '')
    """
    try:
        address = ipaddress.ip_address(master_addr)
    except ValueError:
        return ""
    return f"::ffff:{address}" if address.version == 4 else str(address)


def asks_the_resolver(address: str, wait_s: float = LOOKUP_WAIT_S) -> bool:
    """Whether looking up ``address``'s name finds none on this machine quickly.

    True when the lookup finds no name (``/etc/hosts`` does not list it and the resolver had
    none) or has not answered within ``wait_s`` (the resolver is slow now); False when a name
    came back. The lookup runs in a daemon thread, so the kernel never waits out a timeout.
    """
    answer: list[bool] = []

    def look() -> None:
        try:
            socket.getnameinfo((address, 0), socket.NI_NAMEREQD)
            answer.append(False)
        except OSError:  # socket.gaierror: no name, or the resolver failed
            answer.append(True)

    thread = threading.Thread(target=look, name="nbdist-name-lookup", daemon=True)
    thread.start()
    thread.join(wait_s)
    return answer[0] if answer else True


def slow_connects_note(
    seconds: Mapping[int, float],
    master_addr: str,
    *,
    asks: Callable[[str], bool] = asks_the_resolver,
) -> str:
    """A sentence for the ready lines when ranks took seconds to reach rank 0's store ('' if not).

    ``seconds``: each rank's time to connect (rank 0's own is left out: as the store's server it
    also waits for every other rank). Only for a group on this machine (a loopback
    ``master_addr``: other hosts look the name up in their own files) and where the address's
    name is not found here (``asks``).
    """
    slow = sorted(r for r, s in seconds.items() if r != 0 and s >= SLOW_S)
    address = connect_address(master_addr)
    if not slow or not is_loopback(master_addr) or not asks(address):
        return ""
    others = [s for r, s in seconds.items() if r != 0 and s < SLOW_S]
    longest = max(seconds[r] for r in slow)
    # Past a few, their count reads better than their list (hundreds of ranks on one line).
    who = format_ranks(slow) if len(slow) <= NAMED else f"{len(slow)} of {len(seconds) - 1} ranks"
    took = f"{who} waited up to {longest:.1f} s to connect to rank 0's store"
    if others:
        took += f" (the others {max(others):.2f} s at most)"
    return (
        f"{took}: torch looks up the name of {address} for each connection, /etc/hosts does not "
        f"list it, and the DNS resolver answered late; so at every start and each time the group "
        f"forms again. Add '{address} localhost' to /etc/hosts to skip it"
    )
