"""--launcher ssh to an sshd on loopback (keys made for the test): a collective, and each failure."""

from __future__ import annotations

import os

import pytest

import nbdist
from nbdist.driver.sinks import ListSink
from nbdist.errors import PlacementError
from tests.cluster.conftest import gone, python

pytestmark = pytest.mark.slow


def _session(hosts: str, config: str, **options) -> nbdist.DistSession:
    options = {"hosts": hosts, "ssh_args": f"-F {config}", "python": python(), **options}
    return nbdist.DistSession(
        None, cpu=True, timeout=180, history=False, launcher="ssh", launch_options=options
    )


def _remote_dirs() -> set[str]:
    return {name for name in os.listdir("/tmp") if name.startswith("nbdist-ssh-")}


def test_engines_over_ssh_form_the_group_and_stop_leaves_nothing(sshd):
    before = _remote_dirs()
    # The ssh config's alias points at 127.0.0.1: engines on this machine, the
    # controller stays on loopback.
    with _session("nbdist-ssh-test:2", sshd.config) as session:
        assert session.world_size == 2
        session.run("t = torch.ones(1) * (rank + 1)\ndist.all_reduce(t)", sink=ListSink())
        assert [t.item() for t in session.pull("t")] == [3.0, 3.0]  # 1 + 2, exact in float32
        pids = [r.pid for r in session.ranks]
        assert len(_remote_dirs() - before) == 1  # the engines' profile directory "there"
    assert gone(pids) == []
    assert _remote_dirs() == before


@pytest.mark.parametrize(
    "case, words",
    [
        ("refused", "SSH refused the login"),
        ("unreachable", "cannot be reached over SSH (ssh: connect to host 127.0.0.1 port"),
        ("no python", "has no Python at '/nonexistent/bin/python'"),
    ],
)
def test_each_failure_is_named_before_anything_starts(sshd, case, words):
    before = _remote_dirs()
    if case == "refused":  # a key the server never authorized
        session = _session("stranger:1", sshd.client_config("stranger", sshd.other_key))
    elif case == "unreachable":  # a loopback port nothing listens on (ours, closed again)
        from tests.cluster.conftest import free_port

        config = sshd.client_config("nowhere", sshd.key, port=free_port())
        session = _session("nowhere:1", config)
    else:
        session = _session("nbdist-ssh-test:1", sshd.config, python="/nonexistent/bin/python")
    with pytest.raises(PlacementError, match="Nothing was started") as info:
        session.start()
    assert words in str(info.value)
    assert not session.running
    assert _remote_dirs() == before
