"""--launcher mpi with Debian's Open MPI: mpiexec starts the engines, ranks numbered as MPI's."""

from __future__ import annotations

import os
import shutil

import pytest

import nbdist
from nbdist.driver.sinks import ListSink
from nbdist.engine.netif import local_interfaces
from nbdist.errors import NbdistError
from tests.cluster.conftest import gone

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        shutil.which("mpiexec") is None, reason="no mpiexec: apt-get install openmpi-bin"
    ),
]

# Open MPI refuses to start as root unless told; CI runs as root.
AS_ROOT = "--allow-run-as-root " if os.geteuid() == 0 else ""


def _session(ip: str = "127.0.0.1", **options) -> nbdist.DistSession:
    options.setdefault("mpi_args", AS_ROOT + "--oversubscribe")
    return nbdist.DistSession(
        2, cpu=True, timeout=180, history=False, launcher="mpi", ip=ip, launch_options=options
    )


def _address() -> str | None:
    for addresses in local_interfaces().values():
        for address in addresses:
            if "." in address and not address.startswith("127."):
                return address
    return None


def test_mpiexec_starts_the_ranks_numbered_as_mpi_and_stop_ends_them():
    with _session() as session:
        session.run(
            "import os\n"
            "t = torch.ones(1) * (rank + 1)\n"
            "dist.all_reduce(t)\n"
            "seen = (rank, int(os.environ['OMPI_COMM_WORLD_RANK']), local_rank,\n"
            "        int(os.environ['OMPI_COMM_WORLD_LOCAL_RANK']), t.item())",
            sink=ListSink(),
        )
        # 1 + 2 summed over the group: exact in float32.
        assert session.pull("seen") == [(0, 0, 0, 0, 3.0), (1, 1, 1, 1, 3.0)]
        pids = [r.pid for r in session.ranks] + sorted(session.cluster.pids)
    assert gone(pids) == []


def test_a_missing_python_is_mpiexecs_error_and_nothing_is_left():
    session = _session(python="/nonexistent/bin/python")
    with pytest.raises(NbdistError) as info:
        session.start()
    message = str(info.value)
    assert "mpiexec exited" in message and "before its 2 ranks started" in message
    assert "/nonexistent/bin/python" in message  # mpiexec's own words name it
    assert not session.running


@pytest.mark.skipif(_address() is None, reason="this machine has no non-loopback IPv4")
def test_an_unreachable_host_is_mpiexecs_error_and_nothing_is_left():
    # Engines on another host need a controller they can reach: this machine's address.
    session = _session(ip=_address(), hosts="no-such-host.invalid:2")
    with pytest.raises(NbdistError) as info:
        session.start()
    message = str(info.value)
    assert "mpiexec exited" in message
    assert "Could not resolve hostname" in message  # ssh's words, through mpiexec
    assert not session.running


@pytest.mark.skipif(_address() is None, reason="this machine has no non-loopback IPv4")
def test_a_refused_login_is_mpiexecs_error_and_nothing_is_left(sshd):
    # mpiexec reaches other hosts over ssh: a host whose sshd never authorized our key.
    config = sshd.client_config("stranger", sshd.other_key)
    session = _session(
        ip=_address(),
        hosts="stranger:2",
        mpi_args=f"{AS_ROOT}--oversubscribe --mca plm_rsh_args '-F {config}'",
    )
    with pytest.raises(NbdistError) as info:
        session.start()
    message = str(info.value)
    assert "mpiexec exited" in message
    assert "Permission denied" in message  # ssh's words, through mpiexec
    assert not session.running
