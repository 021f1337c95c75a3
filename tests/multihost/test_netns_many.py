"""8 "hosts" × 32 ranks: network namespaces on a bridge, one engine zygote per namespace, attached.

The controller listens on the bridge address; in each namespace one
``nbdist.launch.zygote`` imports torch once and forks 32 engines, as a host's
engine launcher would. ``%dist_start --connect`` forms one group of 256 ranks
over the bridge (gloo's full mesh crosses it), an all_reduce sums to 256 on every
rank, ranks are numbered host by host, and ``%dist_status`` groups them by host.
Nothing is left afterwards: no process, namespace or link.

Opt-in (``NBDIST_TEST_256=1``; marked ``slow``): on 2 cores it takes about three
minutes and 8 GiB of memory. Skipped (with the reason) where namespaces cannot be made.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import subprocess
import sys

import psutil
import pytest
from IPython.core.interactiveshell import InteractiveShell

from tests.conftest import wait_for_controller, wait_gone
from tests.multihost.netns import Hosts, namespaces_unavailable
from tests.multihost.test_netns import _registered

HOSTS, PER_HOST = 8, 32
_WHY_NOT = namespaces_unavailable()
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        os.environ.get("NBDIST_TEST_256") != "1",
        reason="256 ranks are opt-in: NBDIST_TEST_256=1 bash scripts/test.sh "
        "tests/multihost/test_netns_many.py",
    ),
    pytest.mark.skipif(
        _WHY_NOT is not None, reason=f"multi-host test needs network namespaces: {_WHY_NOT}"
    ),
]


@pytest.fixture(scope="module")
def eight_hosts(tmp_path_factory):
    hosts = Hosts(HOSTS).create()
    profile = tmp_path_factory.mktemp("profile")
    common = [f"--profile-dir={profile}", "--cluster-id=hosts"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    procs: list[subprocess.Popen] = []
    try:
        # Heartbeats as nbdist's own controller has them (3 s of silence before an
        # engine counts as dead): 256 ranks forming their group on 2 cores stall
        # for more than ipyparallel's 10 missed beats at 100 ms.
        procs.append(
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "ipyparallel.controller",
                    f"--ip={hosts.bridge_address}",
                    "--HeartMonitor.period=100",
                    "--HeartMonitor.max_heartmonitor_misses=30",
                    *common,
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                env=env,
            )
        )
        client_file = profile / "security" / "ipcontroller-hosts-client.json"
        wait_for_controller(client_file)
        slots = [{"NBDIST_SLOT": str(j), "LOCAL_RANK": str(j)} for j in range(PER_HOST)]
        for index in range(HOSTS):
            zygote = [
                sys.executable,
                "-m",
                "nbdist.launch.zygote",
                "--slots",
                json.dumps(slots),
                "--parent-pid",
                str(os.getpid()),
                "--threads",
                "1",
                "--status-file",
                str(profile / f"zygote{index}.json"),
                "--",
                *common,
                "--IPEngine.enable_nanny=False",
                "--HistoryManager.enabled=False",
            ]
            procs.append(
                subprocess.Popen(
                    hosts.command(index, zygote),
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                    env=env,
                )
            )
        _registered(client_file, HOSTS * PER_HOST, timeout=900.0, procs=procs)
        yield hosts, client_file
    finally:
        pids = [p.pid for p in procs]
        for proc in procs:
            with contextlib.suppress(psutil.Error):
                pids += [c.pid for c in psutil.Process(proc.pid).children(recursive=True)]
        for proc in reversed(procs):  # the zygotes end their engines; the controller last
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
        alive, inside = wait_gone(pids, timeout=60), hosts.pids_inside()
        for pid in alive:  # ours, by PID, so that a failure leaves nothing running
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        hosts.remove()
        assert alive == []
        assert inside == [], "processes left inside the namespaces"
        assert hosts.leftovers() == []


def _run(shell, cell: str) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        result = shell.run_cell(cell)
    assert result.success, result.error_in_exec
    return out.getvalue()


def test_256_ranks_on_8_hosts_form_one_group_all_reduce_and_group_by_host(eight_hosts):
    hosts, client_file = eight_hosts
    shell = InteractiveShell.instance()
    shell.run_cell("%load_ext nbdist")
    magics = shell.magics_manager.registry["DistMagics"]
    _run(shell, f"%dist_start --connect {client_file} --timeout 900 --cpu")
    session = magics.session
    try:
        assert f"{HOSTS * PER_HOST} ranks ready on {HOSTS} hosts" in session.summary()
        by_host: dict[str, list[int]] = {}
        for r in session.ranks:
            by_host.setdefault(r.host, []).append(r.rank)
        # Host by host: each host holds 32 consecutive ranks, local ranks 0..31.
        assert sorted(len(v) for v in by_host.values()) == [PER_HOST] * HOSTS
        for ranks in by_host.values():
            assert ranks == list(range(ranks[0], ranks[0] + PER_HOST))
        assert {r.local_rank for r in session.ranks} == set(range(PER_HOST))

        _run(
            shell,
            "%%on_all_ranks\nimport os\nt = torch.ones(1)\ntorch.distributed.all_reduce(t)\n"
            "total, master = int(t), os.environ['MASTER_ADDR']",
        )
        assert set(session.pull("total")) == {HOSTS * PER_HOST}
        assert set(session.pull("master")) == {session.ranks[0].host.split("@")[1]}

        status = _run(shell, "%dist_status")
        assert status.splitlines()[0] == f"{HOSTS * PER_HOST} ranks on {HOSTS} hosts · 256 idle"
        for address in hosts.addresses:
            assert any(
                line.split()[:2] == [f"{line.split('@')[0]}@{address}", "32"]
                for line in status.splitlines()
                if "@" in line
            ), status
    finally:
        _run(shell, "%dist_stop")
