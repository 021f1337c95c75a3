"""2D (FSDP2 × tensor parallel, 4 ranks) and 3D (data × tensor × pipeline, 8 ranks) on one DeviceMesh.

A tiny transformer trained on real gloo engines must end with the parameters
one process gets on the whole batch, and each rank must store only its share.

Tolerances: float32, SGD for 3 steps; the sharded runs differ from the
reference only in the order of sums (partial products added by all-reduce or
reduce-scatter instead of in one matmul). Sums here have at most 64 terms of
size O(1), so the reordering error is ~64 × float32 unit roundoff (6e-8) ≈
4e-6 per gradient entry, times lr 0.1 per step: ``assert_close``'s float32
defaults (atol 1e-5, rtol 1.3e-6) hold it with room.
"""

from __future__ import annotations

import pytest
import torch

# Defined on the ranks and in this process alike, so both build the same model.
# pytest puts this test directory on sys.path (no __init__.py here).
from ranks_with import ranks_with
from tiny_transformer import TRANSFORMER_BLOCKS
from torch import nn

import nbdist
from nbdist.driver.sinks import ListSink
from nbdist.errors import RankError
from nbdist.strategies.parallel.mesh import ParallelDims
from nbdist.strategies.parallel.pipeline import split_sequential

COMMON = (
    TRANSFORMER_BLOCKS
    + """

def make_gpt(seed=0, vocab=32, d=16, heads=4, t=8, n_blocks=2):
    torch.manual_seed(seed)
    return nn.Sequential(Embed(vocab, d, t), *[Block(d, heads) for _ in range(n_blocks)],
                         nn.LayerNorm(d), nn.Linear(d, vocab))

def make_tokens(n=8, t=8, vocab=32):
    g = torch.Generator().manual_seed(1)
    x = torch.randint(vocab, (n, t + 1), generator=g)
    return x[:, :-1], x[:, 1:]

def lm_loss(logits, y):
    return F.cross_entropy(logits.flatten(0, 1), y.flatten())

COLWISE, ROWWISE = ["attn.q", "attn.k", "attn.v", "mlp.up"], ["attn.o", "mlp.down"]
"""
)
exec(COMMON)  # noqa: S102 - the same definitions as on the ranks
STEPS, LR = 3, 0.1


@pytest.fixture(scope="module")
def session():
    yield from ranks_with(4, COMMON)


def _reference(dp: int):
    """One process, whole batch: the mean of the dp replicas' losses on their shares."""
    net = make_gpt()  # noqa: F821 - from COMMON
    X, Y = make_tokens()  # noqa: F821
    opt = torch.optim.SGD(net.parameters(), lr=LR)
    losses = []
    for _ in range(STEPS):
        opt.zero_grad()
        per_replica = [lm_loss(net(X[r::dp]), Y[r::dp]) for r in range(dp)]  # noqa: F821
        loss = sum(per_replica) / dp
        loss.backward()
        opt.step()
        losses.append([x.item() for x in per_replica])
    return net, losses


def _assert_same(state: dict, want: nn.Module, who: str) -> None:
    expected = want.state_dict()
    assert state.keys() == expected.keys(), who
    for name, value in state.items():
        torch.testing.assert_close(value, expected[name], msg=lambda m, n=name: f"{who} {n}: {m}")


def test_fsdp_tp_2d_trains_like_one_process_and_shards_four_ways(session):
    session.run(
        f"""
from nbdist.strategies.parallel.fsdp import full_state_dict
from nbdist.strategies.parallel.mesh import ParallelDims
from nbdist.strategies.parallel.parallelize import apply_fsdp_tp
from nbdist.strategies.parallel.tensor_parallel import local_param_bytes
dims = ParallelDims(world_size, dp=2, tp=2)
mesh = dims.build_mesh()
model = apply_fsdp_tp(make_gpt(), mesh, blocks=Block, colwise=COLWISE, rowwise=ROWWISE)
dp_rank = dims.coordinates(rank)["dp"]
# Both tp ranks of a replica see the same samples; the two replicas see different ones.
X, Y = make_tokens()
opt = torch.optim.SGD(model.parameters(), lr={LR})
losses = []
for _ in range({STEPS}):
    opt.zero_grad()
    loss = lm_loss(model(X[dp_rank::2]), Y[dp_rank::2])
    loss.backward()
    opt.step()
    losses.append(loss.item())
local_shapes = {{n: tuple(v.to_local().shape) for n, v in model.named_parameters()}}
mesh_dims = {{n: v.device_mesh.mesh_dim_names for n, v in model.named_parameters()}}
stored = local_param_bytes(model)
state = full_state_dict(model)
""",
        sink=ListSink(),
    )
    net, want_losses = _reference(dp=2)
    for r, state in enumerate(session.pull("state")):
        _assert_same(state, net, f"rank {r}")
    coords = [ParallelDims(4, dp=2, tp=2).coordinates(r)["dp"] for r in range(4)]
    for r, got in enumerate(session.pull("losses")):
        # float32 losses: compared as float32 tensors (Python floats would get float64 tolerances).
        torch.testing.assert_close(
            torch.tensor(got), torch.tensor([s[coords[r]] for s in want_losses])
        )
    shapes, mesh_dims = session.pull("local_shapes", rank=0), session.pull("mesh_dims", rank=0)
    # Block matrices are 2D DTensors: split over tp (q by rows, o by columns), then FSDP
    # splits the rows of that over dp: a quarter of each 16 x 16 weight per rank.
    assert mesh_dims["1.attn.q.weight"] == ("dp", "tp")
    assert shapes["1.attn.q.weight"] == (4, 16) and shapes["1.attn.o.weight"] == (8, 8)
    # Outside the blocks (embeddings, head) only FSDP shards, over dp.
    assert mesh_dims["0.tok.weight"] == ("dp",) and shapes["0.tok.weight"] == (16, 16)
    full = sum(p.numel() * 4 for p in net.parameters())
    stored = session.pull("stored")
    # Every block matrix is split 4 ways; only biases of row-parallel layers and LayerNorms
    # (replicated over tp) and the non-block layers (split 2 ways) keep more than a quarter.
    assert all(full / 4 <= s < 0.4 * full for s in stored), (stored, full)


def test_tp_only_2d_layout_trains_with_a_foreach_optimizer(session):
    """dp 1 × tp 4: no FSDP makes the layers outside the blocks DTensors, so nbdist
    replicates them on tp; a foreach optimizer (CUDA's default) then steps the whole
    model (it refused the mix of DTensors and plain tensors: example 18's "3d" plan on an
    H200) and the model trains like one process. Tolerances: module docstring."""
    session.run(
        f"""
from torch.distributed.tensor import DTensor
from nbdist.strategies.parallel.mesh import ParallelDims
from nbdist.strategies.parallel.parallelize import apply_fsdp_tp
model = apply_fsdp_tp(make_gpt(), ParallelDims(world_size, dp=1, tp=4).build_mesh(), blocks=Block,
                      colwise=COLWISE, rowwise=ROWWISE)
tp_plain = [n for n, p in model.named_parameters() if not isinstance(p, DTensor)]
X, Y = make_tokens()
opt = torch.optim.SGD(model.parameters(), lr={LR}, foreach=True)
tp_losses = []
for _ in range({STEPS}):
    opt.zero_grad()
    loss = lm_loss(model(X), Y)
    loss.backward()
    opt.step()
    tp_losses.append(loss.item())
tp_state = {{k: v.full_tensor().detach() for k, v in model.state_dict().items()}}
""",
        sink=ListSink(),
    )
    net, want_losses = _reference(dp=1)
    assert session.pull("tp_plain") == [[]] * 4
    for r, (state, losses) in enumerate(zip(session.pull("tp_state"), session.pull("tp_losses"))):
        _assert_same(state, net, f"rank {r}")
        torch.testing.assert_close(torch.tensor(losses), torch.tensor([s[0] for s in want_losses]))


def test_parallelize_applies_tp_then_checkpointing_then_fsdp(session):
    """dp 2 × tp 2 with activation checkpointing: the steps come in the fixed order.

    The order shows in the result: FSDP2's units are the Checkpointed wrappers (AC before
    FSDP2), and a block's weights are 2D DTensors on ("dp", "tp"), FSDP2 having sharded the
    tensor-parallel shards (TP before FSDP2). Recomputing activations changes no gradient:
    the model trains like one process (tolerances: module docstring)."""
    session.run(
        f"""
from torch.distributed.fsdp import FSDPModule
from nbdist.strategies.parallel.checkpointing import Checkpointed
from nbdist.strategies.parallel.fsdp import full_state_dict
from nbdist.strategies.parallel.mesh import ParallelDims
from nbdist.strategies.parallel.parallelize import STEPS, parallelize
dims = ParallelDims(world_size, dp=2, tp=2)
done = parallelize(make_gpt(), dims, blocks=Block, colwise=COLWISE, rowwise=ROWWISE, ac=True)
model = done.model
applied, all_steps = done.steps, STEPS
units = [(isinstance(m, Checkpointed), isinstance(m, FSDPModule)) for m in model[1:3]]
inner = type(model[1].block).__name__
q_mesh = model[1].block.attn.q.weight.device_mesh.mesh_dim_names
dp_rank = dims.coordinates(rank)["dp"]
X, Y = make_tokens()
opt = torch.optim.SGD(model.parameters(), lr={LR})
for _ in range({STEPS}):
    opt.zero_grad()
    lm_loss(model(X[dp_rank::2]), Y[dp_rank::2]).backward()
    opt.step()
# Checkpointed adds ".block" to its block's keys.
state = {{k.replace(".block.", "."): v for k, v in full_state_dict(model).items()}}
""",
        sink=ListSink(),
    )
    assert session.pull("applied", rank=0) == ("tp", "ac", "fsdp")
    assert session.pull("all_steps", rank=0) == ("pp_split", "tp", "ac", "fsdp", "pp_stage")
    assert session.pull("units", rank=0) == [(True, True)] * 2  # Checkpointed, FSDP2 units
    assert session.pull("inner", rank=0) == "Block"
    assert session.pull("q_mesh", rank=0) == ("dp", "tp")
    net, _ = _reference(dp=2)
    for r, state in enumerate(session.pull("state")):
        _assert_same(state, net, f"rank {r}")


def test_parallelize_dp1_layout_has_only_dtensor_parameters(session):
    """dp 1 × tp 4 with checkpointing: no FSDP2, and still every parameter a DTensor
    (the layers outside the blocks replicated on tp), so a foreach optimizer steps it."""
    session.run(
        f"""
from torch.distributed.tensor import DTensor
from nbdist.strategies.parallel.mesh import ParallelDims
from nbdist.strategies.parallel.parallelize import parallelize
done = parallelize(make_gpt(), ParallelDims(world_size, dp=1, tp=4), blocks=Block,
                   colwise=COLWISE, rowwise=ROWWISE, ac=True)
applied = done.steps
plain = [n for n, p in done.model.named_parameters() if not isinstance(p, DTensor)]
X, Y = make_tokens()
opt = torch.optim.SGD(done.model.parameters(), lr={LR}, foreach=True)
for _ in range({STEPS}):
    opt.zero_grad()
    lm_loss(done.model(X), Y).backward()
    opt.step()
""",
        sink=ListSink(),
    )
    assert session.pull("applied") == [("tp", "ac")] * 4
    assert session.pull("plain") == [[]] * 4


def test_build_mesh_names_the_world_size_it_was_made_for(session):
    with pytest.raises(RankError, match=r"made for world size 8, but the process group has 4"):
        session.run(
            "from nbdist.strategies.parallel.mesh import ParallelDims\n"
            "ParallelDims(8, dp=2, tp=2, pp=2).build_mesh()",
            sink=ListSink(),
        )


def test_3d_data_tensor_pipeline_on_eight_ranks_trains_like_one_process():
    """dp 2 × tp 2 × pp 2: each stage is 2D-parallel, stages pass activations (1F1B)."""
    with nbdist.DistSession(8, cpu=True, timeout=180) as s:
        s.run(
            COMMON
            + f"""
from nbdist.strategies.parallel.fsdp import full_state_dict
from nbdist.strategies.parallel.mesh import ParallelDims
from nbdist.strategies.parallel.parallelize import apply_fsdp_tp_pp
dims = ParallelDims(world_size, dp=2, tp=2, pp=2)
dims.check_model(n_heads=4, hidden=16, n_layers=5, batch=8, n_microbatches=2)
mesh = dims.build_mesh()
c = dims.coordinates(rank)
stage, schedule = apply_fsdp_tp_pp(make_gpt(), mesh, blocks=Block, colwise=COLWISE,
                                   rowwise=ROWWISE, n_microbatches=2, loss_fn=lm_loss)
X, Y = make_tokens()
opt = torch.optim.SGD(stage.submod.parameters(), lr={LR})
losses = []
for _ in range({STEPS}):
    opt.zero_grad()
    micro = []
    if stage.is_first:
        schedule.step(X[c["dp"]::2])
    else:
        schedule.step(target=Y[c["dp"]::2], losses=micro)
        losses.append(torch.stack(micro).mean().item())
    opt.step()
state = full_state_dict(stage.submod)
""",
            sink=ListSink(),
        )
        states, losses = s.pull("state"), s.pull("losses")
    net, want_losses = _reference(dp=2)
    parts = split_sequential(net, 2)
    dims = ParallelDims(8, dp=2, tp=2, pp=2)
    for r, (state, got) in enumerate(zip(states, losses)):
        c = dims.coordinates(r)
        _assert_same(state, parts[c["pp"]], f"rank {r} (pp {c['pp']}, dp {c['dp']}, tp {c['tp']})")
        if c["pp"] == 0:
            assert got == []  # only the last stage computes the loss
        else:
            want = torch.tensor([step[c["dp"]] for step in want_losses])
            torch.testing.assert_close(torch.tensor(got), want)
