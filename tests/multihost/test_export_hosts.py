"""An exported script on two "hosts" (network namespaces): torchrun --nnodes 2, one rank on each.

Each namespace runs its own torchrun, as two machines would. The script must
choose the interface gloo uses, let rank 0 collect both ranks' nbdist.log
points on its bridge address, and train DDP to the same weights on both hosts.
Skipped (with the reason shown) where network namespaces cannot be made.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import warnings

import pytest
import torch

import nbdist
from nbdist.driver.export import export_script
from tests.multihost.netns import Hosts, namespaces_unavailable

_WHY_NOT = namespaces_unavailable()
if _WHY_NOT is not None:  # shown in the warnings summary too, not only with -rs
    warnings.warn(f"multi-host export test skipped: {_WHY_NOT}", pytest.PytestWarning, stacklevel=1)
pytestmark = pytest.mark.skipif(
    _WHY_NOT is not None, reason=f"multi-host test needs network namespaces: {_WHY_NOT}"
)

CELLS = [
    "import os\n"
    "from torch.nn.parallel import DistributedDataParallel as DDP\n"
    "torch.manual_seed(0)\n"
    "model = DDP(torch.nn.Linear(4, 1))\n"
    "opt = torch.optim.SGD(model.parameters(), lr=0.1)",
    "g = torch.Generator().manual_seed(7 + rank)\n"
    "for step in range(4):\n"
    "    x = torch.randn(8, 4, generator=g)\n"
    "    loss = (model(x) - x.sum(1, keepdim=True)).pow(2).mean()\n"
    "    opt.zero_grad(); loss.backward(); opt.step()\n"
    "    nbdist.log(step=step, loss=loss)",
    "env = {k: os.environ.get(k) for k in ('RANK', 'LOCAL_RANK', 'MASTER_ADDR', "
    "'GLOO_SOCKET_IFNAME')}\n"
    "torch.save({'env': env, 'weight': model.module.weight.detach()},\n"
    "           os.path.join(os.environ['OUT_DIR'], f'rank{rank}.pt'))",
]


def test_exported_script_trains_over_two_hosts_with_torchrun(tmp_path):
    script = export_script(CELLS, str(tmp_path / "two_hosts.py"), ranks=2)
    history = tmp_path / "history.sqlite"
    env = dict(os.environ, OUT_DIR=str(tmp_path), NBDIST_HISTORY=str(history), OMP_NUM_THREADS="1")
    # Names and subnet of their own, apart from any other test's namespaces.
    hosts = Hosts(2, tag=f"{os.getpid() % 100000}x", subnet=1).create()
    procs = []
    try:
        master = hosts.addresses[0]
        for node in range(2):
            command = [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--log-dir",
                str(tmp_path / f"torchrun-logs-{node}"),
                "--nnodes",
                "2",
                "--nproc_per_node",
                "1",
                "--node_rank",
                str(node),
                "--master_addr",
                master,
                "--master_port",
                "29511",
                script,
            ]
            procs.append(
                subprocess.Popen(
                    hosts.command(node, command),
                    env=env,
                    text=True,
                    start_new_session=True,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                )
            )
        outputs = []
        for proc in procs:
            outputs.append(proc.communicate(timeout=240)[0])
    finally:
        for proc in procs:
            if proc.poll() is None:  # torchrun and its worker: the groups we started
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        inside = hosts.pids_inside()
        hosts.remove()
    assert inside == []
    assert hosts.leftovers() == []
    for proc, output in zip(procs, outputs):
        assert proc.returncode == 0, output[-3000:]

    results = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    # One rank per host: both are local rank 0, MASTER_ADDR is host A's bridge address,
    # and each chose the interface holding its own host's address.
    assert [r["env"]["RANK"] for r in results] == ["0", "1"]
    assert [r["env"]["LOCAL_RANK"] for r in results] == ["0", "0"]
    assert {r["env"]["MASTER_ADDR"] for r in results} == {master}
    assert all(r["env"]["GLOO_SOCKET_IFNAME"].startswith(f"nbd{hosts.tag}p") for r in results)
    assert results[0]["weight"].equal(results[1]["weight"])
    # Rank 0 (host A) collected both hosts' points into the history.
    frame = nbdist.runs(str(history))[-1].to_pandas()
    assert sorted(frame["rank"].unique()) == [0, 1]
    assert frame.groupby("rank")["step"].max().tolist() == [3, 3]
