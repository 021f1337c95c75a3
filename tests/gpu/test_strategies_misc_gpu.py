"""Strategy comparison, Horovod-style optimizer, compile and 8-bit Adam on real GPUs (NCCL).

One rank per visible GPU. Skipped without CUDA.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

import nbdist
from nbdist.driver.sinks import ListSink

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA GPUs")

MODEL = """
from torch import nn
def build():
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64), nn.ReLU(), nn.Linear(64, 8))
def shard(step, r):
    g = torch.Generator().manual_seed(100 * step + r)
    return torch.randn(16, 64, generator=g), torch.randn(16, 8, generator=g)
"""


@pytest.fixture(scope="module")
def session():
    s = nbdist.DistSession(timeout=300).start()
    try:
        yield s
    finally:
        s.stop()


def test_compare_on_gpus_gives_one_loss_and_cuda_peaks(session):
    gpus = session.world_size
    strategies = ("ddp", "zero", "fsdp", "tp", "pp") if gpus >= 2 else ("ddp", "zero", "fsdp")
    session.run(
        MODEL
        + "from nbdist.strategies.compare import compare\n"
        + f"rows = compare(build, shard, strategies={strategies!r}, steps=3, warmup=1)\n",
        sink=ListSink(),
    )
    rows = session.pull("rows", rank=0)
    assert [r["strategy"] for r in rows] == list(strategies)
    for row in rows[1:]:
        assert row["loss"] == pytest.approx(rows[0]["loss"], rel=1e-3), row["strategy"]
    assert all(min(r["peak_mib"]) > 0 for r in rows)
    if gpus >= 2:
        params_mib = (64 * 128 + 128 + 128 * 64 + 64 + 64 * 8 + 8) * 4 / 2**20
        assert rows[0]["comm_mib"][0] == pytest.approx(params_mib, abs=1e-3)


def test_distributed_optimizer_matches_ddp_on_gpus(session):
    session.run(
        MODEL
        + """
from torch.nn.parallel import DistributedDataParallel as DDP
from nbdist.strategies.horovod import DistributedOptimizer, broadcast_parameters
def train(model, opt):
    for step in range(3):
        x, y = (t.to(device) for t in shard(step, rank))
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return [p.detach().cpu() for p in model.parameters()]
torch.manual_seed(0)
ddp = DDP(build().to(device))
ref = train(ddp, torch.optim.SGD(ddp.parameters(), lr=0.1))
torch.manual_seed(0)
m = build().to(device)
broadcast_parameters(m.state_dict())
got = train(m, DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1)))
""",
        sink=ListSink(),
    )
    for ref, got in zip(session.pull("ref"), session.pull("got")):
        for a, b in zip(ref, got):
            torch.testing.assert_close(a, b)


def test_compile_ddp_on_gpus_matches_eager(session):
    session.run(
        MODEL
        + """
import copy
from torch.nn.parallel import DistributedDataParallel as DDP
from nbdist.strategies.compile import compile_ddp
torch.manual_seed(0)
base = build().to(device)
x, y = (t.to(device) for t in shard(0, rank))
models = [DDP(copy.deepcopy(base)), compile_ddp(copy.deepcopy(base), example=(x,))]
for model in models:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(3):
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
pairs = [(a.detach().cpu(), b.detach().cpu()) for a, b in zip(models[0].parameters(), models[1].parameters())]
""",
        sink=ListSink(),
    )
    for a, b in session.pull("pairs", rank=0):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-4)


@pytest.mark.skipif(importlib.util.find_spec("bitsandbytes") is None, reason="needs bitsandbytes")
def test_adam8bit_state_is_a_quarter_of_adams(session):
    session.run(
        """
import bitsandbytes as bnb
from torch import nn
from nbdist.strategies.optimizers import state_bytes
model = nn.Linear(1024, 1024).to(device)
sizes = []
for opt in (torch.optim.Adam(model.parameters()), bnb.optim.Adam8bit(model.parameters())):
    model(torch.randn(8, 1024, device=device)).sum().backward()
    opt.step()
    sizes.append(state_bytes(opt))
""",
        sink=ListSink(),
    )
    adam, adam8 = session.pull("sizes", rank=0)
    assert adam8 < 0.3 * adam, (adam8, adam)
