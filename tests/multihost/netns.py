"""Two "hosts" on one machine: network namespaces joined by a bridge (needs root and `ip`).

The bridge address lives in this (the test's) namespace, where the controller and
the kernel side run; each namespace holds one address on the bridge's subnet and
nothing else, so ranks there reach each other and the controller only through
the bridge, as separate machines would. Every name carries this process's PID,
so concurrent runs do not collide, and :meth:`Hosts.remove` deletes all of it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass, field

__all__ = ["Hosts", "namespaces_unavailable"]


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


def namespaces_unavailable() -> str | None:
    """Why network namespaces cannot be used here, or None when they can."""
    if shutil.which("ip") is None:
        return "the `ip` command (iproute2) is not installed"
    if os.geteuid() != 0:
        return "creating network namespaces needs root"
    probe = f"nbdprobe{os.getpid()}"
    made = _ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"`ip netns add` failed: {made.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return None


@dataclass
class Hosts:
    """A bridge with ``count`` namespaces on it; ``addresses[i]`` is namespace ``names[i]``'s."""

    count: int = 2
    tag: str = field(default_factory=lambda: str(os.getpid() % 100000))
    subnet: int = 0  # a second set of hosts alive at the same time takes another subnet
    names: list[str] = field(default_factory=list)
    addresses: list[str] = field(default_factory=list)
    bridge_address: str = ""
    _links: list[str] = field(default_factory=list)

    @property
    def bridge(self) -> str:
        return f"nbdbr{self.tag}"

    def create(self) -> Hosts:
        subnet = f"10.{213 + self.subnet}.{os.getpid() % 250}"
        self.bridge_address = f"{subnet}.1"
        try:
            _ip("link", "add", self.bridge, "type", "bridge")
            self._links.append(self.bridge)
            _ip("addr", "add", f"{self.bridge_address}/24", "dev", self.bridge)
            _ip("link", "set", self.bridge, "up")
            for i in range(self.count):
                name, outer, inner = (f"nbd{self.tag}{c}{i}" for c in "nvp")
                _ip("netns", "add", name)
                self.names.append(name)
                _ip("link", "add", outer, "type", "veth", "peer", "name", inner)
                self._links.append(outer)
                _ip("link", "set", outer, "master", self.bridge)
                _ip("link", "set", outer, "up")
                _ip("link", "set", inner, "netns", name)
                address = f"{subnet}.{i + 2}"
                _ip("-n", name, "addr", "add", f"{address}/24", "dev", inner)
                _ip("-n", name, "link", "set", inner, "up")
                _ip("-n", name, "link", "set", "lo", "up")
                self.addresses.append(address)
        except BaseException:
            self.remove()
            raise
        return self

    def command(self, index: int, argv: list[str]) -> list[str]:
        """``argv`` run inside namespace ``index`` (``ip netns exec`` execs it: same PID)."""
        return ["ip", "netns", "exec", self.names[index], *argv]

    def pids_inside(self) -> list[int]:
        pids = []
        for name in self.names:
            out = _ip("netns", "pids", name, check=False).stdout
            pids += [int(p) for p in out.split()]
        return pids

    def remove(self) -> None:
        """Delete the namespaces (their veth ends go with them) and the bridge."""
        for name in self.names:
            _ip("netns", "del", name, check=False)
        for link in reversed(self._links):
            _ip("link", "del", link, check=False)
        self.names, self._links = [], []

    def leftovers(self) -> list[str]:
        """Names of ours that still exist (should be none after :meth:`remove`)."""
        netns = _ip("netns", "list", check=False).stdout
        links = _ip("-o", "link", "show", check=False).stdout
        return [w for w in (netns + links).split() if self.tag in w and w.startswith("nbd")]
