"""Real Horovod (0.28.1, built by scripts/build_horovod.sh) on nbdist's ranks: opt-in.

The kernel (this test process) runs Horovod's rendezvous server; each rank gets
the HOROVOD_* environment and calls the real ``hvd.init()``. Run with::

    bash scripts/build_horovod.sh
    NBDIST_TEST_HOROVOD=1 build/horovod-venv/bin/python -m pytest -q tests/dist/test_horovod_real.py
"""

from __future__ import annotations

import os

import psutil
import pytest
import torch

import nbdist
from nbdist.driver.sinks import ListSink
from nbdist.strategies.parallel.horovod import horovod_status, start_rendezvous

_REAL, _WHY = horovod_status()
pytestmark = [
    pytest.mark.skipif(
        os.environ.get("NBDIST_TEST_HOROVOD") != "1",
        reason="real Horovod is opt-in: build it with scripts/build_horovod.sh and run with "
        "NBDIST_TEST_HOROVOD=1 build/horovod-venv/bin/python -m pytest tests/dist/test_horovod_real.py",
    ),
    pytest.mark.skipif(
        not _REAL,
        reason=f"NBDIST_TEST_HOROVOD=1 but Horovod is {_WHY}: build it with "
        "scripts/build_horovod.sh and use build/horovod-venv/bin/python",
    ),
]


@pytest.fixture(scope="module")
def session():
    with nbdist.DistSession(2, cpu=True, timeout=120) as s:
        yield s


@pytest.fixture(scope="module")
def rendezvous(session):
    server = start_rendezvous(2)
    session.push({"rendezvous_port": server.port})
    yield server
    try:
        session.run(
            "import horovod.torch as _h\nif _h.is_initialized():\n    _h.shutdown()",
            sink=ListSink(),
        )
    finally:
        server.stop()


def run(session, code: str) -> None:
    session.run(code, sink=ListSink())


INIT_AND_SUM = """
from nbdist.strategies.parallel.horovod import init_horovod
hvd = init_horovod(rendezvous_port, timeout_s=60)
who = (hvd.__name__, hvd.rank(), hvd.size(), hvd.local_rank())
total = hvd.allreduce(torch.tensor([rank + 1.0]), op=hvd.Sum).item()
"""


def test_real_hvd_init_on_the_ranks_of_the_process_group(session, rendezvous):
    run(session, INIT_AND_SUM)
    assert session.pull("who") == [("horovod.torch", 0, 2, 0), ("horovod.torch", 1, 2, 1)]
    assert session.pull("total") == [3.0, 3.0]  # Horovod's own gloo all-reduce: 1 + 2
    listening = [
        c.laddr
        for c in psutil.Process().net_connections(kind="tcp")
        if c.status == psutil.CONN_LISTEN and c.laddr.port == rendezvous.port
    ]
    assert [a.ip for a in listening] == ["127.0.0.1"]  # the rendezvous binds loopback only


def test_real_distributed_optimizer_matches_ddp(session, rendezvous):
    run(session, INIT_AND_SUM)
    run(
        session,
        """
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
def build():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
def shard(step, r):
    g = torch.Generator().manual_seed(100 * step + r)
    return torch.randn(6, 8, generator=g), torch.randn(6, 4, generator=g)
def train(model, opt, steps=3):
    for step in range(steps):
        x, y = shard(step, rank)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]
ddp = DDP(build())
ref = train(ddp, torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9))
model = build()
if rank == 1:  # a different start: broadcast_parameters must copy rank 0's
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                               named_parameters=model.named_parameters())
got = train(model, opt)
""",
    )
    for r in range(2):
        ref, got = session.pull("ref", rank=r), session.pull("got", rank=r)
        for a, b in zip(got, ref):
            # Horovod and DDP average the same two fp32 gradients (sum, then / 2) in their
            # own order: a few roundings apart after 3 steps.
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    for a, b in zip(session.pull("got", rank=0), session.pull("got", rank=1)):
        assert torch.equal(a, b)


def test_init_again_in_the_same_ranks_and_after_a_restart(session, rendezvous):
    run(session, INIT_AND_SUM)
    run(session, INIT_AND_SUM)  # init_horovod shuts the running Horovod down first
    assert session.pull("total") == [3.0, 3.0]
    old = [r.pid for r in session.ranks]
    session.restart()
    assert [r.pid for r in session.ranks] != old
    rendezvous.reset()  # the old ranks never said goodbye: a fresh round
    session.push({"rendezvous_port": rendezvous.port})
    run(session, INIT_AND_SUM)
    assert session.pull("who") == [("horovod.torch", 0, 2, 0), ("horovod.torch", 1, 2, 1)]
    assert session.pull("total") == [3.0, 3.0]
