"""Ranks held up by a DNS resolver as they connect to rank 0's store are named at start, with the fix.

torch's store client looks up the name of rank 0's address (``::ffff:127.0.0.1`` on one machine)
for every connection. Here a real session runs behind a resolver that never answers (a UDP
socket on 127.0.0.2:53 that reads nothing, glibc told to wait 3 s), in a mount namespace of its
own so that this machine's /etc/resolv.conf and /etc/hosts stay as they are: every rank but 0
waits the resolver out, and the ready lines say why; with the address listed in /etc/hosts,
the same start has no such wait and no note. Needs root (the namespace, port 53).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap

import pytest

_SCRIPT = textwrap.dedent(
    """
    import socket
    import nbdist
    # The resolver /etc/resolv.conf names: it takes each question and never answers.
    deaf = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    deaf.bind(("127.0.0.2", 53))
    with nbdist.DistSession(4, cpu=True, timeout=120, history=False) as s:
        print(s.summary())
        s.run("t = torch.ones(1); dist.all_reduce(t)")
        print("sum", s.pull("t.item()"))
    """
)


def _namespaces_work() -> bool:
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        return False
    probe = subprocess.run(["unshare", "-m", "true"], capture_output=True, timeout=30)
    return probe.returncode == 0


pytestmark = pytest.mark.skipif(
    not _namespaces_work(), reason="needs root and unshare -m (a mount namespace of its own)"
)


def _start_behind_a_deaf_resolver(tmp_path, *, list_the_address: bool) -> str:
    script = tmp_path / "start.py"
    script.write_text(_SCRIPT)
    resolv = tmp_path / "resolv.conf"
    resolv.write_text("nameserver 127.0.0.2\noptions timeout:3 attempts:1\n")
    mounts = f"mount --bind {resolv} /etc/resolv.conf"
    if list_the_address:
        hosts = tmp_path / "hosts"
        with open("/etc/hosts") as own:
            hosts.write_text(own.read() + "\n::ffff:127.0.0.1 localhost\n")
        mounts += f" && mount --bind {hosts} /etc/hosts"
    done = subprocess.run(
        ["unshare", "-m", "sh", "-c", f"{mounts} && exec {sys.executable} {script}"],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "sum [4.0, 4.0, 4.0, 4.0]" in done.stdout, done.stdout
    return done.stdout


def test_ranks_held_by_the_resolver_are_named_with_the_line_that_frees_them(tmp_path):
    out = _start_behind_a_deaf_resolver(tmp_path, list_the_address=False)
    assert "nbdist: ranks 1-3 waited up to 3." in out, out
    assert "to connect to rank 0's store: torch looks up the name of ::ffff:127.0.0.1" in out
    assert "Add '::ffff:127.0.0.1 localhost' to /etc/hosts to skip it" in out


def test_with_the_address_in_etc_hosts_no_rank_waits_and_nothing_is_said(tmp_path):
    out = _start_behind_a_deaf_resolver(tmp_path, list_the_address=True)
    assert "nbdist: 4 ranks ready" in out, out
    assert "connect to rank 0's store" not in out, out
