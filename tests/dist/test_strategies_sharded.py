"""Sharded strategies on real engines (2 ranks, gloo) against single-process references.

ZeRO-1, FSDP2, tensor parallel and pipeline parallel (GPipe, 1F1B) must train
to the parameters one process gets on the whole batch; activation
checkpointing must leave gradients unchanged while saving less for backward.
"""

from __future__ import annotations

import copy

import pytest
import torch
from ranks_with import ranks_with
from torch import nn

from nbdist.driver.sinks import ListSink
from nbdist.errors import RankError
from nbdist.strategies.parallel.checkpointing import Checkpointed, apply_ac, saved_activation_bytes
from nbdist.strategies.parallel.pipeline import bubble_fraction, render_timeline, split_sequential

# Defined on the ranks and in this process alike, so both build the same model.
COMMON = """
import torch
from torch import nn

class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)
    def forward(self, x):
        return x + self.fc2(torch.relu(self.fc1(x)))

def make_net(seed=0, d=8, n_blocks=2):
    torch.manual_seed(seed)
    return nn.Sequential(*[Block(d) for _ in range(n_blocks)], nn.Linear(d, 1))

def make_data(n=16, d=8):
    g = torch.Generator().manual_seed(1)
    return torch.randn(n, d, generator=g), torch.randn(n, 1, generator=g)
"""
exec(COMMON)  # noqa: S102 - the same definitions as on the ranks
STEPS = 3


@pytest.fixture(scope="module")
def session():
    yield from ranks_with(2, COMMON)


def _reference(opt_class, lr, steps=STEPS):
    """One process on the full batch: mean of the two ranks' half-batch losses."""
    net = make_net()  # noqa: F821 - from COMMON
    X, Y = make_data()  # noqa: F821
    opt = opt_class(net.parameters(), lr=lr)
    for _ in range(steps):
        opt.zero_grad()
        loss = sum(nn.functional.mse_loss(net(X[r::2]), Y[r::2]) for r in range(2)) / 2
        loss.backward()
        opt.step()
    return net


def _assert_same_params(states, net):
    want = {k: v.detach() for k, v in net.state_dict().items()}
    for state in states:
        assert state.keys() == want.keys()
        for name, value in state.items():
            torch.testing.assert_close(value, want[name], msg=lambda m, n=name: f"{n}: {m}")


def test_zero_matches_one_process_and_shards_adam_state(session):
    session.run(
        f"""
from torch.nn.parallel import DistributedDataParallel as DDP
from nbdist.strategies.parallel.zero import zero_optimizer, optimizer_state_bytes
X, Y = make_data()
def train(make_opt):
    model = DDP(make_net())
    opt = make_opt(model.parameters())
    for _ in range({STEPS}):
        opt.zero_grad()
        nn.functional.mse_loss(model(X[rank::2]), Y[rank::2]).backward()
        opt.step()
    return model.module, optimizer_state_bytes(opt)
net, zero_bytes = train(lambda p: zero_optimizer(p, torch.optim.Adam, lr=0.01))
_, adam_bytes = train(lambda p: torch.optim.Adam(p, lr=0.01))
state = {{k: v.detach().clone() for k, v in net.state_dict().items()}}
""",
        sink=ListSink(),
    )
    _assert_same_params(session.pull("state"), _reference(torch.optim.Adam, 0.01))
    zero_bytes, adam_bytes = session.pull("zero_bytes"), session.pull("adam_bytes")
    # Each rank keeps a part of Adam's state; together exactly what one plain Adam keeps.
    assert all(0 < z < a for z, a in zip(zero_bytes, adam_bytes)), (zero_bytes, adam_bytes)
    assert sum(zero_bytes) == adam_bytes[0] == adam_bytes[1], (zero_bytes, adam_bytes)


def test_zero_optimizer_refuses_a_non_optimizer(session):
    with pytest.raises(RankError, match="torch.optim.Optimizer subclass"):
        session.run(
            "from nbdist.strategies.parallel.zero import zero_optimizer\n"
            "zero_optimizer(make_net().parameters(), 'adam', lr=0.1)",
            sink=ListSink(),
        )


def test_fsdp_matches_one_process_and_stores_half_the_parameters(session):
    session.run(
        f"""
from nbdist.strategies.parallel.fsdp import apply_fsdp, full_state_dict, param_bytes
X, Y = make_data()
model = apply_fsdp(make_net(), blocks=Block)
opt = torch.optim.Adam(model.parameters(), lr=0.01)
for _ in range({STEPS}):
    opt.zero_grad()
    nn.functional.mse_loss(model(X[rank::2]), Y[rank::2]).backward()
    opt.step()
state = full_state_dict(model)
sizes = param_bytes(model)
""",
        sink=ListSink(),
    )
    _assert_same_params(session.pull("state"), _reference(torch.optim.Adam, 0.01))
    (local0, full0), (local1, full1) = session.pull("sizes")
    full = sum(p.numel() * 4 for p in make_net().parameters())  # noqa: F821
    assert full0 == full1 == full
    assert local0 + local1 == full and local0 < full and local1 < full, (local0, local1, full)


def test_fsdp_names_a_block_class_the_model_lacks():
    from nbdist.strategies.parallel.fsdp import apply_fsdp

    # Checked before any collective: no process group is needed to see the mistake.
    with pytest.raises(ValueError, match="no submodule of type <class 'torch.nn.modules.conv"):
        apply_fsdp(make_net(), blocks=nn.Conv2d)  # noqa: F821


def test_fsdp_cpu_offload_is_refused_on_cpu_ranks_with_the_fix(session):
    # torch itself refuses it on CPU; nbdist says why and what to do instead.
    session.run(
        "from torch.distributed.fsdp import fully_shard, CPUOffloadPolicy\n"
        "try:\n"
        "    fully_shard(make_net(), offload_policy=CPUOffloadPolicy())\n"
        "    torch_error = None\n"
        "except Exception as e:\n"
        "    torch_error = str(e)\n",
        sink=ListSink(),
    )
    assert all(e and "accelerator" in e for e in session.pull("torch_error"))
    with pytest.raises(RankError, match=r"offload=True\) needs GPU ranks.*offload=False"):
        session.run(
            "from nbdist.strategies.parallel.fsdp import apply_fsdp\napply_fsdp(make_net(), offload=True)",
            sink=ListSink(),
        )


def test_tensor_parallel_mlp_equals_the_dense_mlp(session):
    session.run(
        f"""
from nbdist.strategies.parallel.tensor_parallel import apply_tp, device_mesh, local_param_bytes
class MLP(nn.Module):
    def __init__(self, d=8, h=32):
        super().__init__()
        self.up, self.down = nn.Linear(d, h), nn.Linear(h, d)
    def forward(self, x):
        return self.down(torch.relu(self.up(x)))
torch.manual_seed(0)
mlp = apply_tp(MLP(), device_mesh(), colwise=["up"], rowwise=["down"])
X, _ = make_data()
out0 = mlp(X).detach()
# The same sharding given as a ready parallelize_module plan (compare's tp_plan=).
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
torch.manual_seed(0)
planned = apply_tp(MLP(), device_mesh(), plan={{"up": ColwiseParallel(), "down": RowwiseParallel()}})
out_plan = planned(X).detach()
opt = torch.optim.SGD(mlp.parameters(), lr=0.1)
for _ in range({STEPS}):
    opt.zero_grad()
    mlp(X).pow(2).mean().backward()
    opt.step()
state = {{k: v.full_tensor().detach() for k, v in mlp.state_dict().items()}}
tp_bytes = local_param_bytes(mlp)
""",
        sink=ListSink(),
    )

    class MLP(nn.Module):
        def __init__(self, d=8, h=32):
            super().__init__()
            self.up, self.down = nn.Linear(d, h), nn.Linear(h, d)

        def forward(self, x):
            return self.down(torch.relu(self.up(x)))

    torch.manual_seed(0)
    dense = MLP()
    X, _ = make_data()  # noqa: F821
    for out in session.pull("out0") + session.pull("out_plan"):
        torch.testing.assert_close(out, dense(X).detach())
    opt = torch.optim.SGD(dense.parameters(), lr=0.1)
    for _ in range(STEPS):
        opt.zero_grad()
        dense(X).pow(2).mean().backward()
        opt.step()
    _assert_same_params(session.pull("state"), dense)
    full = sum(p.numel() * 4 for p in dense.parameters())
    # Column-parallel splits up's weight and bias; row-parallel splits down's weight, its
    # bias (8 floats) stays whole on each rank.
    assert session.pull("tp_bytes") == [(full - 8 * 4) // 2 + 8 * 4] * 2


def test_tensor_parallel_names_a_missing_layer(session):
    with pytest.raises(RankError, match="no submodule named 'upp'"):
        session.run(
            "from nbdist.strategies.parallel.tensor_parallel import apply_tp, device_mesh\n"
            "apply_tp(make_net(), device_mesh(), colwise=['upp'])",
            sink=ListSink(),
        )
    with pytest.raises(RankError, match=r"mesh shape 4 = 4 != world size 2"):
        session.run(
            "from nbdist.strategies.parallel.tensor_parallel import device_mesh\ndevice_mesh(4)",
            sink=ListSink(),
        )


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_pipeline_loss_and_parameters_equal_the_sequential_model(session, schedule):
    session.run(
        f"""
from nbdist.strategies.parallel.pipeline import StageTimer, pipeline_schedule
X, Y = make_data()
stage, sched = pipeline_schedule(make_net(n_blocks=3), n_microbatches=4,
                                 loss_fn=nn.functional.mse_loss, schedule={schedule!r})
timer = StageTimer(stage)
opt = torch.optim.SGD(stage.submod.parameters(), lr=0.1)
step_losses = []
for _ in range({STEPS}):
    opt.zero_grad()
    losses = []
    if stage.is_first:
        sched.step(X)
    else:
        sched.step(target=Y, losses=losses)
        step_losses.append(torch.stack(losses).mean().item())
    opt.step()
part = {{k: v.detach().clone() for k, v in stage.submod.state_dict().items()}}
chunks = sorted((kind, i) for kind, i, start, end in timer.events if end >= start)
""",
        sink=ListSink(),
    )
    net = make_net(n_blocks=3)  # noqa: F821
    X, Y = make_data()  # noqa: F821
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    want_losses = []
    for _ in range(STEPS):
        opt.zero_grad()
        loss = nn.functional.mse_loss(net(X), Y)
        loss.backward()
        want_losses.append(loss.item())
        opt.step()
    first, last = session.pull("step_losses")
    assert first == []  # only the last stage computes the loss
    torch.testing.assert_close(torch.tensor(last), torch.tensor(want_losses))
    parts = split_sequential(net, 2)
    for got, part in zip(session.pull("part"), parts):
        _assert_same_params([got], part)
    # The timer saw every micro-batch's forward and backward on both stages, every step.
    expected = sorted([(kind, i) for kind in "BF" for i in range(4)] * STEPS)
    assert session.pull("chunks") == [expected, expected]


def test_pipeline_takes_a_strided_batch_as_contiguous_micro_batches(session):
    """A data-parallel share ``x[rank::dp]`` is a strided view; torch 2.11's first stage
    refused it ("stride mismatch", example 26 on a GPU): the schedule hands the stage
    contiguous micro-batches, and the losses are those of the same batch made contiguous."""
    session.run(
        """
from nbdist.strategies.parallel.pipeline import pipeline_schedule

class Probe(nn.Module):
    seen = []
    def forward(self, x):
        Probe.seen.append(x.is_contiguous())
        return x

X, Y = make_data(n=32)
strided_losses = []
for x in (X[::2], X[::2].contiguous()):
    stage, sched = pipeline_schedule(nn.Sequential(Probe(), *make_net()), n_microbatches=4,
                                     loss_fn=nn.functional.mse_loss)
    losses = []
    if stage.is_first:
        sched.step(x)
    else:
        sched.step(target=Y[::2], losses=losses)
        strided_losses.append(torch.stack(losses).mean().item())
seen = Probe.seen
""",
        sink=ListSink(),
    )
    first, last = session.pull("seen")
    # The probe is on stage 0 (4 micro-batches twice, and torch's shape inference).
    assert len(first) >= 8 and all(first) and last == []
    strided, contiguous = session.pull("strided_losses")[1]
    assert strided == contiguous


def test_pipeline_refuses_too_few_microbatches_for_1f1b(session):
    with pytest.raises(RankError, match=r"n_microbatches=1 < 2 stages"):
        session.run(
            "from nbdist.strategies.parallel.pipeline import pipeline_schedule\n"
            "pipeline_schedule(make_net(), n_microbatches=1, loss_fn=nn.functional.mse_loss)",
            sink=ListSink(),
        )


def test_split_sequential_balances_parameters_and_checks_its_input():
    net = make_net(n_blocks=3)  # noqa: F821
    parts = split_sequential(net, 2)
    assert [len(p) for p in parts] == [2, 2]
    assert [m for p in parts for m in p] == list(net)  # same layers, same order, not copies
    with pytest.raises(ValueError, match="cannot split 4 layers into 5 stages"):
        split_sequential(net, 5)
    with pytest.raises(TypeError, match="needs an nn.Sequential"):
        split_sequential(net[0], 2)
    assert bubble_fraction(2, 8) == pytest.approx(1 / 9)


def test_render_timeline_draws_fill_and_drain():
    stage0 = [("F", i, i, i + 1) for i in range(4)] + [
        ("B", i, 6 + 2 * i, 8 + 2 * i) for i in range(4)
    ]
    stage1 = [("F", i, 1 + i, 2 + i) for i in range(4)] + [
        ("B", i, 5 + 2 * i, 7 + 2 * i) for i in range(4)
    ]
    lines = render_timeline([stage0, stage1], width=28).splitlines()
    assert lines[0] == "stage 0 |FFffFFff····BBBBbbbbBBBBbbbb| busy 86%"
    assert lines[1] == "stage 1 |··FFffFFffBBBBbbbbBBBBbbbb··| busy 86%"
    assert lines[2].endswith("14000.0 ms")
    with pytest.raises(ValueError, match="no events"):
        render_timeline([[], []])


def test_activation_checkpointing_keeps_gradients_and_saves_less():
    net = make_net(d=32, n_blocks=4)  # noqa: F821
    ac = apply_ac(copy.deepcopy(net), blocks=Block)  # noqa: F821
    assert sum(isinstance(m, Checkpointed) for m in ac.modules()) == 4
    x = torch.randn(64, 32)
    saved = []
    for model in (net, ac):
        with saved_activation_bytes(exclude=model.parameters()) as s:
            loss = model(x).pow(2).mean()
        loss.backward()
        saved.append(s.bytes)
    for a, b in zip(net.parameters(), ac.parameters()):
        torch.testing.assert_close(a.grad, b.grad)
    # Checkpointed: only the input of each block and of the head (64 x 32 floats each) and
    # the output (for pow) are kept for backward.
    assert saved[1] <= 5 * 64 * 32 * 4 + 64 * 4 < saved[0], saved
    with pytest.raises(ValueError, match="no submodule of type"):
        apply_ac(net, blocks=nn.Conv2d)


def test_collective_probe_finds_every_collective_on_two_cpu_ranks(session):
    """The probe that guards strategies on shared GPUs calls nothing missing where all work.

    Each of the six collectives must also give the right numbers on both ranks
    (the probe checks results, so a collective that ran wrongly would be named).
    """
    session.run(
        "from nbdist.engine import backend_support\nlacking = backend_support.probe('cpu')",
        sink=ListSink(),
    )
    assert session.pull("lacking") == [{}, {}]
