"""Four ranks on two "hosts" (network namespaces sharing one hostname), attached from a real shell.

The controller listens on the bridge address only; two engines run inside each
namespace and register in the order A, B, A, B. ``%dist_start --connect`` must
number ranks host by host, choose the interface gloo uses on every rank, train
DDP over the bridge, and receive every rank's metrics on the bridge address. The controller
encrypts with CurveZMQ, as docs/multihost.md recommends beyond one machine.
Skipped (with the reason shown) where network namespaces cannot be made.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import warnings

import psutil
import pytest
from IPython.core.interactiveshell import InteractiveShell

from nbdist.dashboard.table import rank_rows
from nbdist.dashboard.text import summary_text
from tests.conftest import terminate_in_order, wait_for_controller, wait_gone
from tests.multihost.forged import send_forged_metrics
from tests.multihost.netns import Hosts, namespaces_unavailable

_WHY_NOT = namespaces_unavailable()
if _WHY_NOT is not None:  # shown in the warnings summary too, not only with -rs
    warnings.warn(f"multi-host test skipped: {_WHY_NOT}", pytest.PytestWarning, stacklevel=1)
pytestmark = pytest.mark.skipif(
    _WHY_NOT is not None, reason=f"multi-host test needs network namespaces: {_WHY_NOT}"
)

CLUSTER_ID = "hosts"


def _registered(client_file, count: int, timeout: float = 90.0, procs=()) -> None:
    """Wait for ``count`` engines; fails at once if one of ``procs`` (their launchers) exits."""
    import ipyparallel as ipp

    client = ipp.Client(str(client_file))
    try:
        deadline = time.monotonic() + timeout
        while len(client.ids) < count:
            dead = [p.args for p in procs if p.poll() is not None]
            assert not dead, f"exited before all engines registered: {dead}"
            if time.monotonic() > deadline:
                raise TimeoutError(f"{len(client.ids)} of {count} engines registered")
            time.sleep(0.1)
    finally:
        client.close()


@pytest.fixture(scope="module")
def two_hosts(tmp_path_factory):
    """Bridge + 2 namespaces; controller on the bridge address; engines A, B, A, B inside."""
    hosts = Hosts(2).create()
    profile = tmp_path_factory.mktemp("profile")
    common = [f"--profile-dir={profile}", f"--cluster-id={CLUSTER_ID}"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    procs: list[subprocess.Popen] = []
    try:
        procs.append(
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "ipyparallel.controller",
                    f"--ip={hosts.bridge_address}",
                    "--HeartMonitor.period=100",
                    "--IPController.enable_curve=True",
                    *common,
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                env=env,
            )
        )
        client_file = profile / "security" / f"ipcontroller-{CLUSTER_ID}-client.json"
        wait_for_controller(client_file)
        # One at a time, waiting for each, so the registration order is A, B, A, B.
        for count, index in enumerate([0, 1, 0, 1], start=1):
            procs.append(
                subprocess.Popen(
                    hosts.command(
                        index,
                        [
                            sys.executable,
                            "-m",
                            "ipyparallel.engine",
                            "--IPEngine.enable_nanny=False",
                            *common,
                        ],
                    ),
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                    env=env,
                )
            )
            _registered(client_file, count)
        yield hosts, client_file, procs
    finally:
        pids = [p.pid for p in procs]
        for proc in procs:
            try:
                pids += [c.pid for c in psutil.Process(proc.pid).children(recursive=True)]
            except psutil.Error:
                pass
        terminate_in_order(procs)  # engines first, the controller last; by PID only
        alive, inside = wait_gone(pids, timeout=10), hosts.pids_inside()
        hosts.remove()  # before any assertion, so a failure leaves no namespace behind
        assert alive == []
        assert inside == [], "processes left inside the namespaces"
        assert hosts.leftovers() == []


TRAIN = """
import os
from torch.nn.parallel import DistributedDataParallel as DDP
torch.manual_seed(0)
model = DDP(torch.nn.Linear(8, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
g = torch.Generator().manual_seed(100 + rank)
for step in range(5):
    x = torch.randn(16, 8, generator=g)
    loss = (model(x) - x.sum(1, keepdim=True)).pow(2).mean()
    opt.zero_grad(); loss.backward(); opt.step()
    nbdist.log(step=step, loss=loss, samples=len(x))
weights = model.module.weight.detach().clone()
env = {k: os.environ.get(k) for k in ("RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                                       "GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")}
import nbdist.engine.netif
iface_addresses = nbdist.engine.netif.local_interfaces()[env["GLOO_SOCKET_IFNAME"]]
"""


def test_four_ranks_over_two_namespaces_train_ddp_and_log(two_hosts):
    hosts, client_file, procs = two_hosts
    shell = InteractiveShell.instance()
    shell.run_cell("%load_ext nbdist")
    magics = shell.magics_manager.registry["DistMagics"]
    result = shell.run_cell(f"%dist_start --connect {client_file} --timeout 120 --cpu")
    assert result.success, result.error_in_exec
    session = magics.session
    try:
        assert "4 ranks ready on 2 hosts" in session.summary()
        # Engines 0..3 registered as A, B, A, B: ranks go host by host.
        by_engine = {r.engine_id: r for r in session.ranks}
        assert [by_engine[e].rank for e in range(4)] == [0, 2, 1, 3]
        host_a, host_b = (f"{session.ranks[0].host.split('@')[0]}@{a}" for a in hosts.addresses)
        assert [r.host for r in session.ranks] == [host_a, host_a, host_b, host_b]
        assert [r.local_rank for r in session.ranks] == [0, 1, 0, 1]

        result = shell.run_cell("%%on_all_ranks\n" + TRAIN)
        assert result.success, result.error_in_exec
        env = session.pull("env")
        assert [e["RANK"] for e in env] == ["0", "1", "2", "3"]
        assert [e["LOCAL_RANK"] for e in env] == ["0", "1", "0", "1"]
        assert {e["LOCAL_WORLD_SIZE"] for e in env} == {"2"}
        # MASTER_ADDR: rank 0's address on the bridge, as host B reaches it.
        assert {e["MASTER_ADDR"] for e in env} == {hosts.addresses[0]}
        # gloo/NCCL use, on each rank, the interface holding that host's bridge address.
        addresses = session.pull("iface_addresses")
        for rank, expected in enumerate([0, 0, 1, 1]):
            assert hosts.addresses[expected] in addresses[rank]
            assert env[rank]["GLOO_SOCKET_IFNAME"] == env[rank]["NCCL_SOCKET_IFNAME"]
        # DDP kept the replicas identical across the two hosts.
        weights = session.pull("weights")
        for w in weights[1:]:
            assert w.equal(weights[0])

        # Metrics crossed the bridge: the collector listens on the bridge address only.
        assert session.metrics_hub.url.startswith(f"tcp://{hosts.bridge_address}:")
        # CurveZMQ encrypts the cluster's traffic and drops its HMAC key: metrics are
        # then signed with a random key, so a message signed with the empty key is refused.
        assert session.client.session.key == b""
        send_forged_metrics(session.metrics_hub.url)
        deadline = time.monotonic() + 10
        while session.metrics_hub.collector.rejected == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert session.metrics_hub.collector.rejected == 1
        frame = session.metrics.to_pandas()
        assert sorted(frame["rank"].unique()) == [0, 1, 2, 3]
        assert frame.groupby("rank")["step"].max().tolist() == [4, 4, 4, 4]
        assert frame["loss"].notna().all()
        # The dashboard's rank table (widget and text summary) names each rank's host.
        rows = [row.cells(time.time())[0] for row in rank_rows(session.metrics)]
        assert rows == [f"0 · {host_a}", f"1 · {host_a}", f"2 · {host_b}", f"3 · {host_b}"]
        assert f"2 · {host_b}" in summary_text(session.metrics)
        status = {row["rank"]: row["host"] for row in session.status()}
        assert status == {0: host_a, 1: host_a, 2: host_b, 3: host_b}
    finally:
        result = shell.run_cell("%dist_stop")
    assert result.success
    # Attached: the engines are not nbdist's, so they still run.
    assert all(p.poll() is None for p in procs)
