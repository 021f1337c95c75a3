"""Horovod-style optimizer, strategy comparison, one-time preparation: real engines, gloo, 2 ranks."""

from __future__ import annotations

import pytest
import torch

import nbdist
from nbdist.driver.sinks import ListSink
from nbdist.errors import RankError


@pytest.fixture(scope="module")
def session():
    with nbdist.DistSession(2, cpu=True, timeout=120) as s:
        yield s


def run(session, code: str) -> None:
    session.run(code, sink=ListSink())


MODEL = """
from torch import nn
def build():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
def shard(step, r):
    g = torch.Generator().manual_seed(100 * step + r)
    return torch.randn(6, 8, generator=g), torch.randn(6, 4, generator=g)
"""


def test_distributed_optimizer_matches_ddp(session):
    run(
        session,
        MODEL
        + """
from torch.nn.parallel import DistributedDataParallel as DDP
from nbdist.strategies.parallel.horovod import DistributedOptimizer, broadcast_parameters

def train(model, opt, steps=3):
    for step in range(steps):
        x, y = shard(step, rank)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]

ddp = DDP(build())
ref = train(ddp, torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9))

hvd_model = build()
if rank == 1:  # different start on rank 1: broadcast_parameters must fix it
    with torch.no_grad():
        for p in hvd_model.parameters():
            p.add_(1.0)
broadcast_parameters(hvd_model.state_dict(), root_rank=0)
opt = DistributedOptimizer(torch.optim.SGD(hvd_model.parameters(), lr=0.1, momentum=0.9))
got = train(hvd_model, opt)
launched = opt.nbdist_averager.reduced_count
local_only = build()
alone = train(local_only, torch.optim.SGD(local_only.parameters(), lr=0.1, momentum=0.9))
""",
    )
    ref, got, alone = session.pull("ref"), session.pull("got"), session.pull("alone")
    for r in range(2):
        for a, b in zip(got[r], ref[r]):
            torch.testing.assert_close(a, b)
    # The hooks did the averaging: one all-reduce per parameter per step...
    assert session.pull("launched") == [4 * 3, 4 * 3]
    # ...and without them each rank would have drifted apart on its own data.
    assert not torch.allclose(alone[0][0], alone[1][0])


def test_broadcast_optimizer_state_copies_rank_zeros_moments(session):
    run(
        session,
        MODEL
        + """
from nbdist.strategies.parallel.horovod import broadcast_optimizer_state
m = build()
adam = torch.optim.Adam(m.parameters(), lr=0.1)
x, y = shard(0, rank)  # each rank its own data: different moments
nn.functional.mse_loss(m(x), y).backward()
adam.step()
before = [v.clone() for s in adam.state.values() for v in s.values()]
broadcast_optimizer_state(adam, root_rank=0)
after = [v.clone() for s in adam.state.values() for v in s.values()]
""",
    )
    before, after = session.pull("before"), session.pull("after")
    assert not torch.equal(before[0][1], before[1][1])  # exp_avg differed
    for a, b in zip(after[0], after[1]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    for a, b in zip(after[0], before[0]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)  # rank 0's own state unchanged


def test_distributed_optimizer_needs_a_step_per_backward(session):
    with pytest.raises(RankError, match="gradient accumulation"):
        run(
            session,
            MODEL
            + """
from nbdist.strategies.parallel.horovod import DistributedOptimizer
m = build()
o = DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1))
try:
    for step in range(2):
        x, y = shard(step, rank)
        nn.functional.mse_loss(m(x), y).backward()
finally:
    o.step()
    o.remove_hooks()
""",
        )


def test_compare_every_strategy_trains_the_same_model(session):
    run(
        session,
        MODEL
        + """
from nbdist.strategies.plan.compare import compare
rows = compare(build, shard, steps=2, warmup=1, optimizer=torch.optim.SGD,
               optimizer_kwargs={"lr": 0.1})
""",
    )
    rows0, rows1 = session.pull("rows")
    assert [r["strategy"] for r in rows0] == ["ddp", "zero", "fsdp", "tp", "pp"]
    by = {r["strategy"]: r for r in rows0}
    # Same maths on the same global batch: the same loss after the same steps.
    for name in ("zero", "fsdp", "tp", "pp"):
        assert by[name]["loss"] == pytest.approx(by["ddp"]["loss"], rel=1e-4), name
    # Bytes: DDP all-reduces every gradient once (8*16+16 + 16*4+4 = 212 floats).
    params_mib = 212 * 4 / 2**20
    assert by["ddp"]["comm_mib"] == [pytest.approx(params_mib, abs=1e-3)] * 2
    assert by["ddp"]["comm_ops"] == {"allreduce_": 1}
    # FSDP gathers the weights for forward and backward and reduce-scatters gradients.
    assert by["fsdp"]["comm_mib"][0] == pytest.approx(3 * params_mib, abs=2e-3)
    assert set(by["pp"]["comm_ops"]) == {"send", "recv_"}
    assert all(r["samples_per_s"] > 0 and len(r["peak_mib"]) == 2 for r in rows0)
    # Timing, memory and loss are gathered: both ranks report the same figures.
    strip = [{k: v for k, v in r.items() if k != "comm_ops"} for r in rows0]
    assert strip == [{k: v for k, v in r.items() if k != "comm_ops"} for r in rows1]


def test_compare_names_the_bad_strategy(session):
    with pytest.raises(RankError, match="'dp'"):
        run(
            session,
            MODEL
            + "from nbdist.strategies.plan.compare import compare\ncompare(build, shard, strategies=('dp',))",
        )


def test_compare_says_which_strategy_cannot_take_the_model(session):
    # A model that is not an nn.Sequential cannot be cut into pipeline stages.
    with pytest.raises(RankError, match=r"pipeline parallel: .*nn.Sequential.*leave 'pp' out"):
        run(
            session,
            MODEL
            + "from nbdist.strategies.plan.compare import compare\n"
            + "class Net(nn.Module):\n"
            + "    def __init__(self):\n"
            + "        super().__init__(); self.body = build()\n"
            + "    def forward(self, x):\n"
            + "        return self.body(x)\n"
            + "compare(Net, shard, strategies=('pp',), steps=1, warmup=0)",
        )


def test_prepare_once_builds_on_rank_zero_only(session, tmp_path):
    target = tmp_path / "cache" / "data.pt"
    session.push({"target": str(target), "log": str(tmp_path / "built.txt")})
    code = """
from nbdist.strategies.training.practical import prepare_once
def build_data():
    with open(log, "a") as f:
        f.write(f"built on {rank}\\n")
    return torch.arange(5) * 10
data = prepare_once(target, build_data)
"""
    run(session, code)
    run(session, code)  # second time: the file exists, nothing is built
    assert [d.tolist() for d in session.pull("data")] == [[0, 10, 20, 30, 40]] * 2
    assert (tmp_path / "built.txt").read_text() == "built on 0\n"
    assert [p.name for p in target.parent.iterdir()] == ["data.pt"]  # no partial file left
