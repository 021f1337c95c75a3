"""Every strategy of README's table on ONE GPU, each against the same training in one process.

Each test runs twice (``one_gpu``): two ranks sharing GPU 0 over gloo with CUDA tensors
(the path a user of one GPU gets with NCCL < 2.30: point-to-point staged through host
memory, optimizers on foreach kernels, where the first GPU run's failures were) and one
rank on GPU 0 over NCCL. A test that needs two ranks says so when it skips on one.

References are computed in this process on the CPU (CUDA stays off here), float32, on
the whole batch: the mean of the ranks' shard losses, which is what data parallelism
averages. The ranks use ``torch.set_float32_matmul_precision("highest")`` (no TF32).

Tolerance ``GPU_TOL`` (rtol 1e-5, atol 5e-5): a GPU kernel sums in another order than
the CPU's, and a sharded run in another order again. Sums here have at most 64 terms
of size O(1), so a gradient entry may differ by 64 x 2**-24 x (sum of magnitudes, <= 16)
= 6e-5 relative to its size, at most ~1e-5 absolute for these gradients (< 0.2); over
3 SGD steps of lr 0.1 (or Adam's lr 0.01-sized steps) that moves a weight by < 1e-5,
and the forward's own rounding adds the same order: 5e-5 holds both with room. Tests
in bf16 or fp16 say their own.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from nbdist.driver.sinks import ListSink
from nbdist.strategies.parallel.pipeline import split_sequential
from tests.dist.tiny_transformer import TRANSFORMER_BLOCKS
from tests.gpu.conftest import ranks_on_one_gpu

GPU_TOL = dict(rtol=1e-5, atol=5e-5)
STEPS, LR = 3, 0.1

# Defined on the ranks and in this process alike, so both build the same models.
COMMON = (
    TRANSFORMER_BLOCKS
    + """
import torch.distributed as dist
torch.set_float32_matmul_precision("highest")  # float32 stays float32 (no TF32)

class Res(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)
    def forward(self, x):
        return x + self.fc2(torch.relu(self.fc1(x)))

def make_net(seed=0, d=8, n_blocks=2):
    torch.manual_seed(seed)
    return nn.Sequential(*[Res(d) for _ in range(n_blocks)], nn.Linear(d, 1))

def make_data(n=16, d=8):
    g = torch.Generator().manual_seed(1)
    return torch.randn(n, d, generator=g), torch.randn(n, 1, generator=g)

def make_gpt(seed=0, vocab=32, d=16, heads=4, t=8, n_blocks=2):
    torch.manual_seed(seed)
    return nn.Sequential(Embed(vocab, d, t), *[Block(d, heads) for _ in range(n_blocks)],
                         nn.LayerNorm(d), nn.Linear(d, vocab))

class GPT(nn.Module):
    # The GPT sequence and context parallel take: named embeddings, blocks, norm and head.
    def __init__(self, vocab=32, d=16, heads=4, t=16, n_blocks=2):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(t, d)
        self.blocks = nn.Sequential(*[Block(d, heads) for _ in range(n_blocks)])
        self.norm, self.head = nn.LayerNorm(d), nn.Linear(d, vocab)
    def forward(self, idx, pos=None):
        pos = torch.arange(idx.shape[1], device=idx.device) if pos is None else pos
        return self.head(self.norm(self.blocks(self.tok(idx) + self.pos(pos))))

def make_seq_gpt(seed=0, t=16):
    torch.manual_seed(seed)
    return GPT(t=t)

def make_tokens(n=8, t=8, vocab=32):
    g = torch.Generator().manual_seed(1)
    x = torch.randint(vocab, (n, t + 1), generator=g)
    return x[:, :-1], x[:, 1:]

def lm_loss(logits, y):
    return F.cross_entropy(logits.flatten(0, 1), y.flatten())

def tanh_mlp(d_in, hidden, d_out):
    # compare's build_model: the same seeded weights for every strategy
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(d_in, hidden), nn.Tanh(), nn.Linear(hidden, d_out))

def random_shards(n, d_in, d_out):
    # compare's make_batch(step, rank): n random rows per rank and step
    def shard(step, r):
        g = torch.Generator().manual_seed(100 * step + r)
        return torch.randn(n, d_in, generator=g), torch.randn(n, d_out, generator=g)
    return shard

COLWISE, ROWWISE = ["attn.q", "attn.k", "attn.v", "mlp.up"], ["attn.o", "mlp.down"]
SP = dict(blocks=Block, colwise=COLWISE, rowwise=ROWWISE, norms=["norm1", "norm2"],
          gather=["attn", "mlp"])

def cpu_state(model):
    # Whole float32 values on the CPU (DTensors gathered): what the test process compares.
    out = {}
    for k, v in model.state_dict().items():
        v = v.full_tensor() if hasattr(v, "full_tensor") else v
        out[k] = v.detach().float().cpu().clone()  # a copy, also where v is on the CPU
    return out

def train_mse(model, opt, steps=3):
    # Each rank its shard of make_data(): DDP-style data parallelism over world_size ranks.
    X, Y = make_data()
    x, y = X[rank::world_size].to(device), Y[rank::world_size].to(device)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = F.mse_loss(model(x).float(), y)  # bf16 outputs: CUDA's mse_loss backward wants one dtype
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses
"""
)
exec(COMMON)  # noqa: S102 - the same definitions as on the ranks


def run(session, code: str) -> None:
    session.run(code, sink=ListSink())


def needs_two_ranks(session, what: str) -> None:
    if session.world_size < 2:
        pytest.skip(f"{what} needs 2 ranks; this layout has one (NCCL, one rank on one GPU)")


def reference_mse(opt_class, world: int, steps=STEPS, **opt_kwargs):
    """One process: the mean of the ``world`` shards' losses, each step. (model, losses)"""
    net = make_net()  # noqa: F821 - from COMMON
    X, Y = make_data()  # noqa: F821
    opt = opt_class(net.parameters(), **opt_kwargs)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        shard_losses = [F.mse_loss(net(X[r::world]), Y[r::world]) for r in range(world)]
        loss = sum(shard_losses) / world
        loss.backward()
        opt.step()
        losses.append([x.item() for x in shard_losses])
    return net, losses


def reference_gpt(make, steps=STEPS, tokens=None, momentum=0.0):
    """One process, the whole batch of tokens, SGD: (model, losses)."""
    net = make()
    X, Y = tokens or make_tokens()  # noqa: F821
    opt = torch.optim.SGD(net.parameters(), lr=LR, momentum=momentum)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = lm_loss(net(X), Y)  # noqa: F821
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return net, losses


def assert_state(state: dict, want: nn.Module, who: str, **tol) -> None:
    tol = tol or GPU_TOL
    expected = {k: v.detach().float() for k, v in want.state_dict().items()}
    assert state.keys() == expected.keys(), who
    for name, value in state.items():
        torch.testing.assert_close(
            value, expected[name], **tol, msg=lambda m, n=name: f"{who} {n}: {m}"
        )


def assert_losses(got, want, **tol) -> None:
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), **(tol or GPU_TOL))


# -- data parallel -------------------------------------------------------------------------


@pytest.mark.example(0, 1, 16)
def test_ddp_with_the_default_optimizer_trains_like_one_process(one_gpu):
    """DDP and SGD as torch gives it on CUDA (foreach kernels), per-rank shards."""
    run(
        one_gpu,
        """
from torch.nn.parallel import DistributedDataParallel as DDP
ddp = DDP(make_net().to(device))
ddp_losses = train_mse(ddp, torch.optim.SGD(ddp.parameters(), lr=0.1))
ddp_state = cpu_state(ddp.module)
""",
    )
    world = one_gpu.world_size
    net, want = reference_mse(torch.optim.SGD, world, lr=LR)
    for r, (state, losses) in enumerate(zip(one_gpu.pull("ddp_state"), one_gpu.pull("ddp_losses"))):
        assert_state(state, net, f"rank {r}")
        assert_losses(losses, [step[r] for step in want])


@pytest.mark.example(2)
def test_dataparallel_on_a_rank_trains_like_one_process(one_gpu):
    """``nn.DataParallel`` over the GPUs a rank sees, on rank 0, the whole batch."""
    run(
        one_gpu,
        """
if rank == 0:
    dp = nn.DataParallel(make_net().to(device), device_ids=[device.index], output_device=device)
    opt = torch.optim.SGD(dp.parameters(), lr=0.1)
    X, Y = make_data()
    for _ in range(3):
        opt.zero_grad()
        F.mse_loss(dp(X.to(device)), Y.to(device)).backward()
        opt.step()
    dp_state = cpu_state(dp.module)
""",
    )
    net, _ = reference_mse(torch.optim.SGD, 1, lr=LR)
    assert_state(one_gpu.pull("dp_state", rank=0), net, "rank 0")


@pytest.mark.example(3)
def test_hand_written_all_reduces_and_ring_training_on_cuda_tensors(one_gpu):
    """The ring and rank-0 all-reduces (send/recv of CUDA tensors) equal ``dist.all_reduce``
    exactly on integers, and training with the ring equals one process."""
    run(
        one_gpu,
        """
from nbdist.strategies.teaching import data_parallel_by_hand as by_hand
ints = (torch.arange(4097, dtype=torch.float32) * (rank + 1)).to(device)
ring = by_hand.ring_all_reduce(ints.clone())
via0 = by_hand.all_reduce_via_rank0(ints.clone())
plain = ints.clone(); dist.all_reduce(plain)
sums = [t.cpu() for t in (ring, via0, plain)]
torch.manual_seed(rank)  # different starts: broadcast_model must fix that
model = make_net(seed=0 if rank == 0 else 5).to(device)
by_hand.broadcast_model(model)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
X, Y = make_data()
for _ in range(3):
    opt.zero_grad()
    x, y = by_hand.split_batch(X, Y)
    F.mse_loss(model(x.to(device)), y.to(device)).backward()
    by_hand.average_gradients(model)
    opt.step()
ring_state = cpu_state(model)
""",
    )
    world = one_gpu.world_size
    want = torch.arange(4097, dtype=torch.float32) * (world * (world + 1) // 2)
    for sums in one_gpu.pull("sums"):
        for got in sums:
            assert torch.equal(got, want)
    # split_batch gives contiguous shards; the reference's strided shards have the same mean.
    net, _ = reference_mse(torch.optim.SGD, 1, lr=LR)
    for r, state in enumerate(one_gpu.pull("ring_state")):
        assert_state(state, net, f"rank {r}")


@pytest.mark.example(4)
def test_bf16_autocast_under_ddp_tracks_float32(one_gpu):
    """bf16 autocast on CUDA: matmuls in bf16, weights float32, no scaler needed.

    Reference: float32 in one process. bf16 keeps 8 bits: each product rounded to 2**-8
    relative, so a gradient entry is off by ~2**-8 of its magnitude (< 0.5 here); 3 steps
    of lr 0.1 move a weight by at most 3 x 0.1 x 2**-8 x 0.5 x a few: atol 2e-2 (as on CPU).
    """
    run(
        one_gpu,
        """
from torch.nn.parallel import DistributedDataParallel as DDP
from nbdist.strategies.training.amp import autocast, grad_scaler, pick_dtype
ddp = DDP(make_net().to(device))
opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
X, Y = make_data()
x, y = X[rank::world_size].to(device), Y[rank::world_size].to(device)
scaler = grad_scaler(device, torch.bfloat16)
for _ in range(3):
    opt.zero_grad()
    with autocast(device, torch.bfloat16):
        out = ddp(x)
        loss = F.mse_loss(out.float(), y)
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
bf16_info = (str(out.dtype), scaler.is_enabled(), str(pick_dtype(device)))
bf16_state = cpu_state(ddp.module)
""",
    )
    infos = one_gpu.pull("bf16_info")
    assert all(i[:2] == ("torch.bfloat16", False) for i in infos), infos
    net, _ = reference_mse(torch.optim.SGD, one_gpu.world_size, lr=LR)
    states = one_gpu.pull("bf16_state")
    for r, state in enumerate(states):
        assert_state(state, net, f"rank {r}", rtol=0, atol=2e-2)
        assert_state(state, _as_module(states[0]), f"rank {r} vs rank 0", rtol=0, atol=0)


def _as_module(state: dict) -> nn.Module:
    """A module whose state_dict() is ``state`` (to compare two ranks with assert_state)."""
    holder = nn.Module()
    holder.state_dict = lambda: state  # type: ignore[method-assign]
    return holder


@pytest.mark.example(5)
def test_no_sync_accumulation_equals_one_step_on_the_whole_batch(one_gpu):
    """4 micro-batches per rank under ``accumulate`` (DDP's no_sync): one all-reduce per
    step, and the weights of one step on all 16 samples."""
    run(
        one_gpu,
        """
from torch.nn.parallel import DistributedDataParallel as DDP
from nbdist.strategies.parallel.accumulation import AllReduceCounter, accumulate
ddp = DDP(make_net().to(device))
counter = AllReduceCounter(ddp)
opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
X, Y = make_data()
x_rank, y_rank = X[rank::world_size].to(device), Y[rank::world_size].to(device)
K = 4
calls = []
for step in range(3):
    before = counter.calls
    for i, (x, y) in enumerate(zip(x_rank.chunk(K), y_rank.chunk(K))):
        with accumulate(ddp, i, every=K):
            (F.mse_loss(ddp(x), y) / K).backward()
    calls.append(counter.calls - before)
    opt.step()
    opt.zero_grad()
acc_state = cpu_state(ddp.module)
""",
    )
    net, _ = reference_mse(torch.optim.SGD, one_gpu.world_size, lr=LR)
    for r, state in enumerate(one_gpu.pull("acc_state")):
        assert_state(state, net, f"rank {r}")
    assert one_gpu.pull("calls") == [[1, 1, 1]] * one_gpu.world_size


@pytest.mark.example(6)
def test_distributed_eval_is_exactly_the_single_process_metric(one_gpu):
    """1001 samples: every one evaluated once, the same predictions and accuracy as one process."""
    run(
        one_gpu,
        """
from torch.utils.data import DataLoader, TensorDataset
from nbdist.strategies.training.evaluation import (
    SequentialDistributedSampler, all_gather_uneven, all_reduce_sums)
g = torch.Generator().manual_seed(3)
data = TensorDataset(torch.randn(1001, 5, generator=g), torch.randint(0, 4, (1001,), generator=g))
torch.manual_seed(0)
model = torch.nn.Linear(5, 4).to(device).eval()
preds, correct = [], 0
with torch.no_grad():
    for x, y in DataLoader(data, batch_size=64, sampler=SequentialDistributedSampler(data)):
        out = model(x.to(device))
        preds.append(out.argmax(1))
        correct += (out.argmax(1) == y.to(device)).sum()
eval_sums = all_reduce_sums(correct=correct, count=sum(len(p) for p in preds))
eval_preds = all_gather_uneven(torch.cat(preds)).cpu()
""",
    )
    g = torch.Generator().manual_seed(3)
    X, Y = torch.randn(1001, 5, generator=g), torch.randint(0, 4, (1001,), generator=g)
    torch.manual_seed(0)
    with torch.no_grad():
        want = torch.nn.Linear(5, 4)(X).argmax(1)
    for sums, preds in zip(one_gpu.pull("eval_sums"), one_gpu.pull("eval_preds")):
        assert sums["count"] == 1001
        assert torch.equal(preds, want)
        assert sums["correct"] == int((want == Y).sum())


@pytest.mark.example(7)
def test_nbdist_syncbn_under_ddp_trains_like_batchnorm_on_the_whole_batch(one_gpu):
    """nbdist's SyncBatchNorm on CUDA tensors under DDP: running statistics and weights of
    plain BatchNorm over the whole batch in one process (torch's is tested in
    test_training_gpu.py). Built by hand: ``convert_sync_batchnorm`` gives torch's class on
    CUDA, and a BatchNorm's initial values take nothing from the random generator, so the
    seeded Linear layers match the reference's."""
    run(
        one_gpu,
        """
from torch.nn.parallel import DistributedDataParallel as DDP
from nbdist.strategies.parallel.syncbn import SyncBatchNorm
def bn_net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), SyncBatchNorm(16), nn.ReLU(), nn.Linear(16, 1))
ddp = DDP(bn_net().to(device))
bn_kind = type(ddp.module[1]).__module__
opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
X, Y = make_data()
x, y = X.tensor_split(world_size)[rank].to(device), Y.tensor_split(world_size)[rank].to(device)
for _ in range(3):
    opt.zero_grad()
    F.mse_loss(ddp(x), y).backward()
    opt.step()
bn_state = cpu_state(ddp.module)
""",
    )
    assert one_gpu.pull("bn_kind") == ["nbdist.strategies.parallel.syncbn"] * one_gpu.world_size
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 1))
    X, Y = make_data()  # noqa: F821
    opt = torch.optim.SGD(ref.parameters(), lr=LR)
    for _ in range(STEPS):
        opt.zero_grad()
        F.mse_loss(ref(X), Y).backward()
        opt.step()
    for r, state in enumerate(one_gpu.pull("bn_state")):
        assert_state(state, ref, f"rank {r}")


# -- sharded -------------------------------------------------------------------------------


@pytest.mark.example(8)
def test_zero_trains_like_one_process_adam_and_shards_its_state(one_gpu):
    run(
        one_gpu,
        """
from torch.nn.parallel import DistributedDataParallel as DDP
from nbdist.strategies.parallel.zero import optimizer_state_bytes, zero_optimizer
ddp = DDP(make_net().to(device))
opt = zero_optimizer(ddp.parameters(), torch.optim.Adam, lr=0.01)
zero_losses = train_mse(ddp, opt)
zero_bytes = optimizer_state_bytes(opt)
zero_state = cpu_state(ddp.module)
""",
    )
    world = one_gpu.world_size
    net, _ = reference_mse(torch.optim.Adam, world, lr=0.01)
    for r, state in enumerate(one_gpu.pull("zero_state")):
        assert_state(state, net, f"rank {r}")
    from nbdist.strategies.parallel.zero import optimizer_state_bytes

    adam = torch.optim.Adam(net.parameters(), lr=0.01)
    net(torch.zeros(1, 8)).sum().backward()
    adam.step()
    adam_bytes = optimizer_state_bytes(adam)
    zero_bytes = one_gpu.pull("zero_bytes")
    # Each rank keeps a part of Adam's state; together exactly what one plain Adam keeps.
    assert sum(zero_bytes) == adam_bytes, (zero_bytes, adam_bytes)
    if world > 1:
        assert all(0 < b < adam_bytes for b in zero_bytes), zero_bytes


@pytest.mark.example(9)
@pytest.mark.parametrize("precision", ["float32", "bf16 params, float32 reduce"])
def test_fsdp2_trains_like_one_process(one_gpu, precision):
    """``apply_fsdp`` per block then the whole model, SGD.

    bf16 parameters (float32 gradient reduction): each forward and backward rounds to
    2**-8 relative; a gradient entry (< 0.5 here) is off by a few 2**-8 of itself, and 3
    steps of lr 0.1 move a weight by at most 3 x 0.1 x 4 x 2**-8 x 0.5: atol 3e-3."""
    one_gpu.push({"fsdp_bf16": precision != "float32"})
    run(
        one_gpu,
        """
from nbdist.strategies.parallel.fsdp import apply_fsdp, param_bytes
kw = dict(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if fsdp_bf16 else {}
model = apply_fsdp(make_net().to(device), blocks=Res, **kw)
fsdp_losses = train_mse(model, torch.optim.SGD(model.parameters(), lr=0.1))
fsdp_sizes = param_bytes(model)
fsdp_state = cpu_state(model)
""",
    )
    net, _ = reference_mse(torch.optim.SGD, one_gpu.world_size, lr=LR)
    tol = {} if precision == "float32" else dict(rtol=0, atol=3e-3)
    for r, state in enumerate(one_gpu.pull("fsdp_state")):
        assert_state(state, net, f"rank {r}", **tol)
    full = sum(p.numel() * 4 for p in net.parameters())
    sizes = one_gpu.pull("fsdp_sizes")
    assert sum(local for local, _ in sizes) == full and all(f == full for _, f in sizes)


@pytest.mark.example(10)
def test_activation_checkpointing_lowers_the_cuda_peak_and_keeps_gradients(one_gpu):
    """``apply_ac`` on 16 wide residual blocks: the CUDA memory peak of a forward and backward,
    measured with ``torch.cuda.max_memory_allocated``, is lower than without, and the
    gradients are the same (recomputation repeats the same kernels on the same inputs:
    GPU_TOL holds it; usually they are bit-equal).

    Without checkpointing each of the 16 blocks keeps its input (4096 x 256 floats, 4 MiB)
    and the ReLU's output (8 MiB) for backward: 192 MiB; with it only the blocks' inputs
    (64 MiB) and one block's recomputation (12 MiB) at a time. The parameters' gradients
    (16 x 1 MiB) come on top of both: 0.7 leaves room.
    """
    run(
        one_gpu,
        """
import copy
from nbdist.strategies.parallel.checkpointing import apply_ac
torch.cuda.synchronize(device)
plain = make_net(d=256, n_blocks=16).to(device)
ac = apply_ac(copy.deepcopy(plain), blocks=Res)
x = torch.randn(4096, 256, generator=torch.Generator().manual_seed(3)).to(device)
peaks, grads = [], []
for model in (plain, ac):
    torch.cuda.synchronize(device)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    model(x).pow(2).mean().backward()
    torch.cuda.synchronize(device)
    peaks.append(torch.cuda.max_memory_allocated(device) - base)
    grads.append([p.grad.detach().cpu() for p in model.parameters()])
    model.zero_grad(set_to_none=True)
""",
    )
    for r, (peaks, grads) in enumerate(zip(one_gpu.pull("peaks"), one_gpu.pull("grads"))):
        plain, ac = peaks
        assert ac < 0.7 * plain, f"rank {r}: checkpointed peak {ac} B vs plain {plain} B"
        for a, b in zip(*grads):
            torch.testing.assert_close(b, a, **GPU_TOL)


# -- tensor, sequence, context and pipeline parallel ------------------------------------------


@pytest.mark.example(11)
def test_tensor_parallel_gpt_steps_with_the_default_optimizer(one_gpu):
    """``apply_tp`` on the blocks of a GPT, SGD with torch's default (foreach on CUDA): every
    parameter a DTensor (the rest replicated), and the training of one process.

    Example 11 failed at its first ``opt.step()`` on an H200: the embeddings, norm and head
    stayed plain tensors and the foreach kernel refused the mix."""
    run(
        one_gpu,
        """
from torch.distributed.tensor import DTensor
from nbdist.strategies.parallel.tensor_parallel import apply_tp, device_mesh
names = [f"blocks.{i}.{n}" for i in range(2) for n in COLWISE + ROWWISE]
cols = [n for n in names if any(n.endswith(c) for c in COLWISE)]
rows = [n for n in names if any(n.endswith(c) for c in ROWWISE)]
model = apply_tp(make_seq_gpt().to(device), device_mesh(), colwise=cols, rowwise=rows)
tp_plain = [n for n, p in model.named_parameters() if not isinstance(p, DTensor)]
X, Y = make_tokens(t=16)
X, Y = X.to(device), Y.to(device)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
tp_losses = []
for _ in range(3):
    opt.zero_grad()
    loss = lm_loss(model(X), Y)
    loss.backward()
    opt.step()
    tp_losses.append(loss.item())
tp_state = cpu_state(model)
""",
    )
    assert one_gpu.pull("tp_plain") == [[]] * one_gpu.world_size
    net, want = reference_gpt(make_seq_gpt, tokens=make_tokens(t=16))  # noqa: F821
    for r, (state, losses) in enumerate(zip(one_gpu.pull("tp_state"), one_gpu.pull("tp_losses"))):
        assert_state(state, net, f"rank {r}")
        assert_losses(losses, want)


@pytest.mark.example(27)
def test_sequence_parallel_gpt_trains_like_one_process(one_gpu):
    """Megatron sequence parallel (norm activations sharded over the sequence), default SGD
    with momentum: the norms' partial gradients are reduced in backward (torch 2.11's
    momentum step on a GPU parted from the one-process model from its second step)."""
    run(
        one_gpu,
        """
from nbdist.strategies.parallel.sequence_parallel import apply_sequence_parallel
from nbdist.strategies.parallel.tensor_parallel import device_mesh
model = apply_sequence_parallel(make_seq_gpt().to(device), device_mesh(), **SP)
X, Y = make_tokens(t=16)
X, Y = X.to(device), Y.to(device)
opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
sp_losses = []
for _ in range(3):
    opt.zero_grad()
    loss = lm_loss(model(X), Y)
    loss.backward()
    opt.step()
    sp_losses.append(loss.item())
sp_state = cpu_state(model)
""",
    )
    net, want = reference_gpt(make_seq_gpt, tokens=make_tokens(t=16), momentum=0.9)  # noqa: F821
    for r, (state, losses) in enumerate(zip(one_gpu.pull("sp_state"), one_gpu.pull("sp_losses"))):
        assert_state(state, net, f"rank {r}")
        assert_losses(losses, want)


@pytest.mark.example(27)
@pytest.mark.parametrize(
    ("backend", "seq"),
    [("auto", 128), ("auto", 16), ("ring", 16)],
    ids=["auto-torch", "auto-short", "ring"],
)
def test_context_parallel_trains_like_one_process(one_gpu, backend, seq):
    """The model's SDPA over all ranks' sequence shards under DDP; ``auto`` takes torch's own
    context parallel on CUDA where each rank's chunk is a multiple of 32 tokens (128 tokens
    over 2 ranks: chunks of 32), else nbdist's ring (16 tokens: chunks of 4, whose
    log-sum-exp CUDA's memory-efficient attention pads to 32, which torch's merge does not
    take); ``ring`` nbdist's ring attention (send/recv of CUDA tensors).

    The attention kernels differ from the CPU's (memory-efficient or flash SDPA): their
    float32 results keep ~1e-6 relative, inside GPU_TOL. With one NCCL rank the "split" is the
    whole sequence: a ring of one (its backward once sent to itself and failed on gloo)."""
    one_gpu.push({"cp_backend": backend, "cp_seq": seq})
    run(
        one_gpu,
        """
from torch.nn.parallel import DistributedDataParallel as DDP
from nbdist.strategies.parallel.context_parallel import context_parallel
model = DDP(make_seq_gpt(t=cp_seq).to(device))
X, Y = make_tokens(t=cp_seq)
x, y = X.clone().to(device), Y.clone().to(device)
pos = torch.arange(cp_seq, device=device).unsqueeze(0)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
cp_losses = []
for _ in range(3):
    opt.zero_grad()
    with context_parallel(buffers=[x, y, pos], seq_dims=[1, 1, 1], backend=cp_backend):
        loss = lm_loss(model(x, pos[0]), y)
        loss.backward()
    total = loss.detach().clone()
    dist.all_reduce(total)
    cp_losses.append(total.item() / world_size)
    opt.step()
cp_restored = torch.equal(x.cpu(), X) and torch.equal(y.cpu(), Y)
cp_state = cpu_state(model.module)
""",
    )
    net, want = reference_gpt(
        lambda: make_seq_gpt(t=seq),  # noqa: F821
        tokens=make_tokens(t=seq),  # noqa: F821
    )
    assert one_gpu.pull("cp_restored") == [True] * one_gpu.world_size
    for r, (state, losses) in enumerate(zip(one_gpu.pull("cp_state"), one_gpu.pull("cp_losses"))):
        assert_state(state, net, f"rank {r}")
        assert_losses(losses, want)


@pytest.mark.example(12)
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_pipeline_trains_like_the_sequential_model(one_gpu, schedule):
    """Two stages, 4 micro-batches: from the second step the receiving stage receives into
    buffers that require grad (examples 12 and 18 failed there on an H200)."""
    needs_two_ranks(one_gpu, "a pipeline of 2 stages")
    one_gpu.push({"pp_schedule": schedule})
    run(
        one_gpu,
        """
from nbdist.strategies.parallel.pipeline import pipeline_schedule
X, Y = make_data()
stage, sched = pipeline_schedule(make_net(n_blocks=3).to(device), n_microbatches=4,
                                 loss_fn=F.mse_loss, schedule=pp_schedule)
opt = torch.optim.SGD(stage.submod.parameters(), lr=0.1)
pp_losses = []
for _ in range(3):
    opt.zero_grad()
    losses = []
    if stage.is_first:
        sched.step(X.to(device))
    else:
        sched.step(target=Y.to(device), losses=losses)
        pp_losses.append(torch.stack(losses).mean().item())
    opt.step()
pp_part = cpu_state(stage.submod)
""",
    )
    net = make_net(n_blocks=3)  # noqa: F821
    X, Y = make_data()  # noqa: F821
    opt = torch.optim.SGD(net.parameters(), lr=LR)
    want = []
    for _ in range(STEPS):
        opt.zero_grad()
        loss = F.mse_loss(net(X), Y)
        loss.backward()
        opt.step()
        want.append(loss.item())
    first, last = one_gpu.pull("pp_losses")
    assert first == []
    assert_losses(last, want)
    for r, (got, part) in enumerate(zip(one_gpu.pull("pp_part"), split_sequential(net, 2))):
        assert_state(got, part, f"stage {r}")


@pytest.mark.example(26)
@pytest.mark.parametrize("ac", [False, True], ids=["2d", "2d+checkpointing"])
def test_2d_layout_with_dp_1_steps_with_the_default_optimizer(one_gpu, ac):
    """dp 1 x tp (all ranks) through ``parallelize``: every parameter a DTensor, so torch's
    default optimizer (foreach on CUDA) steps it; the training of one process (example
    18's 3d plan with dp 1 failed at the first foreach step on an H200)."""
    needs_two_ranks(one_gpu, "a tensor-parallel dimension (tp = world size)")
    one_gpu.push({"with_ac": ac})
    run(
        one_gpu,
        """
from torch.distributed.tensor import DTensor
from nbdist.strategies.parallel.mesh import ParallelDims
from nbdist.strategies.parallel.parallelize import parallelize
done = parallelize(make_gpt().to(device), ParallelDims(world_size, dp=1, tp=world_size),
                   blocks=Block, colwise=COLWISE, rowwise=ROWWISE, ac=with_ac)
plain_2d = [n for n, p in done.model.named_parameters() if not isinstance(p, DTensor)]
X, Y = make_tokens()
X, Y = X.to(device), Y.to(device)
opt = torch.optim.SGD(done.model.parameters(), lr=0.1)
losses_2d = []
for _ in range(3):
    opt.zero_grad()
    loss = lm_loss(done.model(X), Y)
    loss.backward()
    opt.step()
    losses_2d.append(loss.item())
state_2d = {k.replace(".block.", "."): v for k, v in cpu_state(done.model).items()}
""",
    )
    assert one_gpu.pull("plain_2d") == [[]] * one_gpu.world_size
    net, want = reference_gpt(make_gpt)  # noqa: F821
    for r, (state, losses) in enumerate(zip(one_gpu.pull("state_2d"), one_gpu.pull("losses_2d"))):
        assert_state(state, net, f"rank {r}")
        assert_losses(losses, want)


def test_3d_dp1_tp2_pp2_on_four_ranks_sharing_the_gpu():
    """dp 1 x tp 2 x pp 2 on four ranks sharing GPU 0 over gloo: each stage tensor parallel,
    stages passing activations through staged send/recv, SGD by torch's default (foreach),
    the batch a strided view."""
    pytest.importorskip("numpy")  # torch's pipelining needs it
    gen = ranks_on_one_gpu(dict(n=4, gpus=[0], backend="gloo"))
    s = next(gen)
    try:
        run(
            s,
            COMMON
            + """
from nbdist.strategies.parallel.mesh import ParallelDims
from nbdist.strategies.parallel.parallelize import apply_fsdp_tp_pp
dims = ParallelDims(world_size, dp=1, tp=2, pp=2)
stage, schedule = apply_fsdp_tp_pp(make_gpt().to(device), dims.build_mesh(), blocks=Block,
                                   colwise=COLWISE, rowwise=ROWWISE, n_microbatches=2,
                                   loss_fn=lm_loss)
X, Y = make_tokens()
opt = torch.optim.SGD(stage.submod.parameters(), lr=0.1)
losses_3d = []
for _ in range(3):
    opt.zero_grad()
    micro = []
    if stage.is_first:
        # A strided view of X, as a data-parallel share x[rank::dp] is (torch 2.11 refused
        # one: "stride mismatch", example 26).
        schedule.step(torch.stack([X, X], 1).to(device)[:, 0])
    else:
        schedule.step(target=Y.to(device), losses=micro)
        losses_3d.append(torch.stack(micro).mean().item())
    opt.step()
pp_coord = dims.coordinates(rank)["pp"]
state_3d = cpu_state(stage.submod)
""",
        )
        coords, states, losses = s.pull("pp_coord"), s.pull("state_3d"), s.pull("losses_3d")
    finally:
        gen.close()
    net, want = reference_gpt(make_gpt)  # noqa: F821
    parts = split_sequential(net, 2)
    for r, (pp, state, got) in enumerate(zip(coords, states, losses)):
        assert_state(state, parts[pp], f"rank {r} (stage {pp})")
        if pp == 0:
            assert got == []
        else:
            assert_losses(got, want)


# -- optimizers, compile, compression -------------------------------------------------------


@pytest.mark.example(13)
@pytest.mark.parametrize(("name", "lr"), [("LARS", 1.0), ("LAMB", 0.01)])
def test_large_batch_optimizers_under_ddp_train_like_one_process(one_gpu, name, lr):
    """LARS scales each step by its trust ratio (eta 1e-3 times |w| / |g|): at lr 0.01 the
    weights moved 4e-5 in 3 steps, inside GPU_TOL, so gradients never averaged over the ranks
    passed too; at lr 1.0 they move 4e-3 and one rank's own gradients miss by 3e-3."""
    one_gpu.push({"lb_name": name, "lb_lr": lr})
    run(
        one_gpu,
        """
from torch.nn.parallel import DistributedDataParallel as DDP
from nbdist.strategies.optim import optimizers
ddp = DDP(make_net().to(device))
opt = getattr(optimizers, lb_name)(ddp.parameters(), lr=lb_lr)
train_mse(ddp, opt)
lb_state = cpu_state(ddp.module)
""",
    )
    from nbdist.strategies.optim import optimizers

    net, _ = reference_mse(getattr(optimizers, name), one_gpu.world_size, lr=lr)
    for r, state in enumerate(one_gpu.pull("lb_state")):
        assert_state(state, net, f"rank {r}")


@pytest.mark.example(14)
def test_adafactor_under_ddp_trains_like_one_process(one_gpu):
    """Adafactor (torch's), a memory-saving optimizer; 8-bit AdamW is in test_training_gpu.py."""
    run(
        one_gpu,
        """
from torch.nn.parallel import DistributedDataParallel as DDP
ddp = DDP(make_net().to(device))
train_mse(ddp, torch.optim.Adafactor(ddp.parameters(), lr=0.01))
af_state = cpu_state(ddp.module)
""",
    )
    net, _ = reference_mse(torch.optim.Adafactor, one_gpu.world_size, lr=0.01)
    for r, state in enumerate(one_gpu.pull("af_state")):
        assert_state(state, net, f"rank {r}")


@pytest.mark.example(15)
def test_compile_ddp_trains_like_eager_ddp(one_gpu):
    """``compile_ddp`` (TorchInductor, Triton kernels on the GPU) against the same DDP eager.

    Fused kernels round in another order than eager ones: GPU_TOL."""
    run(
        one_gpu,
        """
from torch.nn.parallel import DistributedDataParallel as DDP
from nbdist.strategies.training.compile import compile_ddp
X, Y = make_data()
compiled = compile_ddp(make_net().to(device), example=(X[rank::world_size].to(device),))
compiled_losses = train_mse(compiled, torch.optim.SGD(compiled.parameters(), lr=0.1))
eager = DDP(make_net().to(device))
eager_losses = train_mse(eager, torch.optim.SGD(eager.parameters(), lr=0.1))
""",
    )
    for compiled, eager in zip(one_gpu.pull("compiled_losses"), one_gpu.pull("eager_losses")):
        assert_losses(compiled, eager)
        assert compiled[-1] < compiled[0]


@pytest.mark.example(17)
def test_horovod_style_distributed_optimizer_matches_ddp(one_gpu):
    """The emulated Horovod ``DistributedOptimizer`` (gradients all-reduced by hooks as they
    become ready, CUDA tensors) trains like one process."""
    run(
        one_gpu,
        """
from nbdist.strategies.parallel.horovod import DistributedOptimizer, broadcast_parameters
hvd_model = make_net(seed=0 if rank == 0 else 7).to(device)
broadcast_parameters(hvd_model.state_dict(), root_rank=0)
opt = DistributedOptimizer(torch.optim.SGD(hvd_model.parameters(), lr=0.1, momentum=0.9))
train_mse(hvd_model, opt)
opt.remove_hooks()
hvd_state = cpu_state(hvd_model)
""",
    )
    net, _ = reference_mse(torch.optim.SGD, one_gpu.world_size, lr=LR, momentum=0.9)
    for r, state in enumerate(one_gpu.pull("hvd_state")):
        assert_state(state, net, f"rank {r}")


@pytest.mark.example(29)
@pytest.mark.parametrize("kind", ["fp16", "bf16", "powersgd"])
def test_compressed_ddp_hooks_train_close_to_plain_ddp(one_gpu, kind):
    """fp16/bf16 cast hooks and PowerSGD (rank 1, from the third step) on CUDA tensors.

    Casts, 6 steps: each step's averaged gradient is rounded once or twice to 16 bits
    (relative 2**-11 fp16, 2**-8 bf16), so 6 steps of lr 0.1 on gradients < 0.5 move a
    weight by at most 6 x 0.1 x 2 x u x 0.5: 3e-4 for fp16, 2.4e-3 for bf16 (atol twice
    that), and each step hands the all-reduce 16 bits a number. PowerSGD: its first 2 steps
    are the plain float32 all-reduce (GPU_TOL); from then on each weight matrix's averaged
    gradient is the rank-1 product P Q^T (its second singular value only float32 rounding
    of the entries, <= 4 sqrt(n m) 2**-24 of the first) and fewer bytes travel."""
    one_gpu.push({"hook_kind": kind})
    run(
        one_gpu,
        """
from torch.nn.parallel import DistributedDataParallel as DDP
from nbdist.strategies.optim.compression import apply_comm_hook
kw = dict(matrix_rank=1, start_iter=2) if hook_kind == "powersgd" else {}
hooked = DDP(make_net().to(device))
sent = apply_comm_hook(hooked, hook_kind, **kw)
hook_opt = torch.optim.SGD(hooked.parameters(), lr=0.1)
train_mse(hooked, hook_opt, steps=2)
hook_state2 = cpu_state(hooked.module)
hook_sent = [sent.take()]
train_mse(hooked, hook_opt, steps=4)
hook_sent.append(sent.take())
hook_dense = sent.dense
hook_state = cpu_state(hooked.module)
# One more backward: the averaged gradient of each weight matrix, as the last step had it.
X, Y = make_data()
hook_opt.zero_grad()
F.mse_loss(hooked(X[rank::world_size].to(device)), Y[rank::world_size].to(device)).backward()
hook_svd = [torch.linalg.svdvals(p.grad.float()).cpu().tolist()[:2] + [p.grad.numel()]
            for p in hooked.parameters() if p.dim() == 2 and min(p.shape) > 1]
""",
    )
    world = one_gpu.world_size
    (first, last), dense = one_gpu.pull("hook_sent", rank=0), one_gpu.pull("hook_dense", rank=0)
    per_step = dense // 6  # float32 bytes of every gradient, once a step
    if kind == "powersgd":
        net2, _ = reference_mse(torch.optim.SGD, world, steps=2, lr=LR)
        for r, state in enumerate(one_gpu.pull("hook_state2")):
            assert_state(state, net2, f"rank {r} after the 2 plain steps")
        # take() counts since the previous take: 2 plain steps, then 4 compressed ones.
        assert first == 2 * per_step and last < 4 * per_step / 2, (first, last, per_step)
        for r, svd in enumerate(one_gpu.pull("hook_svd")):
            for s0, s1, numel in svd:
                assert 0 < s0 and s1 <= 4 * numel**0.5 * 2.0**-24 * s0, (r, s0, s1)
        return
    net, _ = reference_mse(torch.optim.SGD, world, steps=6, lr=LR)
    atol = {"fp16": 6e-4, "bf16": 5e-3}[kind]
    for r, state in enumerate(one_gpu.pull("hook_state")):
        assert_state(state, net, f"rank {r}", rtol=0, atol=atol)
    assert (first, last) == (2 * per_step // 2, 4 * per_step // 2)  # 16 bits a number


@pytest.mark.example(29)
def test_onebit_adam_warmup_is_adam_on_cuda_tensors(one_gpu):
    """``apply_onebit_adam``: the warm-up steps are Adam on the averaged gradient (GPU_TOL),
    then momentum goes at one bit and every rank decodes the same weights."""
    run(
        one_gpu,
        """
from nbdist.strategies.optim.onebit_adam import apply_onebit_adam
ob_model = make_net(seed=0 if rank == 0 else 3).to(device)
opt = apply_onebit_adam(ob_model, lr=0.01, freeze_step=3)
warm = [train_mse(ob_model, opt, steps=3), cpu_state(ob_model)]
train_mse(ob_model, opt, steps=3)
onebit_after = cpu_state(ob_model)
""",
    )
    net, _ = reference_mse(torch.optim.Adam, one_gpu.world_size, lr=0.01)
    afters = one_gpu.pull("onebit_after")
    for r, (warm, after) in enumerate(zip(one_gpu.pull("warm"), afters)):
        assert_state(warm[1], net, f"rank {r} after the warm-up")
        assert_state(after, _as_module(afters[0]), f"rank {r} vs rank 0", rtol=0, atol=0)


# -- planning ------------------------------------------------------------------------------


@pytest.mark.example(18)
def test_compare_trains_every_strategy_to_the_same_loss(one_gpu):
    """``compare`` on CUDA: DDP, ZeRO, FSDP2, TP (and PP with 2 ranks) reach DDP's loss."""
    strategies = ("ddp", "zero", "fsdp", "tp") + (("pp",) if one_gpu.world_size > 1 else ())
    one_gpu.push({"cmp_strategies": strategies})
    run(
        one_gpu,
        """
from nbdist.strategies.plan.compare import compare
cmp_rows = compare(lambda: tanh_mlp(8, 16, 4), random_shards(6, 8, 4), strategies=cmp_strategies,
                   steps=2, warmup=1, optimizer=torch.optim.SGD, optimizer_kwargs={"lr": 0.1})
""",
    )
    rows = one_gpu.pull("cmp_rows", rank=0)
    assert [r["strategy"] for r in rows] == list(strategies)
    by = {r["strategy"]: r for r in rows}
    for name in strategies[1:]:
        assert by[name]["loss"] == pytest.approx(by["ddp"]["loss"], rel=1e-4), name
    assert all(r["samples_per_s"] > 0 and r["peak_mib"][0] > 0 for r in rows), rows


@pytest.mark.example(18)
def test_compare_counts_each_strategys_own_cuda_memory(one_gpu):
    """ZeRO-1 below DDP in ``compare``'s CUDA peak: with Adam on 2 ranks each keeps half of
    the two moments (a 1,050,112-parameter model: DDP about 16 MiB of parameters, gradients,
    buckets and moments, ZeRO about 4 MiB less). CUDA's peak counts every tensor of the
    process: were DDP's still alive when ZeRO's peak starts, ZeRO's would be the larger."""
    needs_two_ranks(one_gpu, "ZeRO's sharded optimizer state")
    run(
        one_gpu,
        """
from nbdist.strategies.plan.compare import compare
mem_rows = compare(lambda: tanh_mlp(512, 1024, 512), random_shards(8, 512, 512),
                   strategies=("ddp", "zero"), steps=2, warmup=1,
                   optimizer=torch.optim.Adam, optimizer_kwargs={"lr": 1e-3})
""",
    )
    ddp, zero = one_gpu.pull("mem_rows", rank=0)
    assert (ddp["strategy"], zero["strategy"]) == ("ddp", "zero")
    for r, (d, z) in enumerate(zip(ddp["peak_mib"], zero["peak_mib"])):
        assert 0 < z < d, f"rank {r}: ZeRO {z} MiB, DDP {d} MiB"


@pytest.mark.example(18)
def test_autoplan_chooses_a_plan_that_trains_like_one_process(one_gpu):
    """``autoplan`` measures plans on CUDA and applies the fastest; torch's default SGD
    (foreach) steps whichever it chose."""
    run(
        one_gpu,
        """
from nbdist.strategies.plan.autoplan import autoplan
X, Y = (t.to(device) for t in make_tokens())
plan = autoplan(make_gpt, (X, Y), world_size=world_size, memory_per_rank="1 GiB",
                optimizer=torch.optim.SGD, optimizer_kwargs={"lr": 0.1}, top_k=3, steps=2,
                warmup=1, loss_fn=lm_loss, blocks=Block, colwise=COLWISE, rowwise=ROWWISE)
plan_rows = plan.table
plan_losses = [plan.step(X, Y) for _ in range(3)]
""",
    )
    tables = one_gpu.pull("plan_rows")
    assert all(t == tables[0] for t in tables[1:])
    assert any(r["status"] == "chosen" for r in tables[0])
    _, want = reference_gpt(make_gpt)  # noqa: F821
    for losses in one_gpu.pull("plan_losses"):
        assert_losses([float(x) for x in losses], want)


# -- tools around training ------------------------------------------------------------------


@pytest.mark.example(24)
def test_diff_names_the_rank_whose_cuda_tensor_differs(one_gpu):
    """``nbdist.diff`` compares CUDA tensors across ranks and measures the difference."""
    needs_two_ranks(one_gpu, "a difference between ranks")
    import nbdist

    run(one_gpu, "weights = torch.ones(5, device=device)\nweights[2] += 0.5 * rank")
    table = nbdist.diff("weights", session=one_gpu)
    rows = table.to_dict("records") if hasattr(table, "to_dict") else table
    assert [r["rank"] for r in rows] == [1], rows
    assert rows[0]["max_abs_diff"] == pytest.approx(0.5)


@pytest.mark.example(28)
@pytest.mark.parametrize("block", [128, 32])
def test_flex_attention_trains_on_cuda_like_dense_masked_attention(one_gpu, block):
    """Sliding window + global tokens through FlexAttention on CUDA, forward and backward
    (CPU refuses flex backward), against dense SDPA with the same mask on the CPU here.
    Blocks of 32 as example 28 has them: TorchInductor's own float32 tiles (64 x 64 for a
    head dimension of 16 on an H100/H200) do not divide them.

    The flex kernel accumulates in float32 in blocks of keys: ~1e-6 relative, GPU_TOL."""
    one_gpu.push({"flex_block": block})
    run(
        one_gpu,
        """
from nbdist.strategies.training.sparse_attention import block_mask, sliding_window, sparse_attention
g = torch.Generator().manual_seed(4)
q, k, v, grad_out = (torch.randn(1, 2, 256, 16, generator=g) for _ in range(4))
mask = block_mask(sliding_window(32, n_global=4), 256, block_size=flex_block, device=device)
leaves = [t.to(device).requires_grad_() for t in (q, k, v)]
out = sparse_attention(*leaves, mask, backend="flex")
out.backward(grad_out.to(device))
flex = [t.detach().cpu() for t in (out, *(x.grad for x in leaves))]
""",
    )
    from nbdist.strategies.training.sparse_attention import dense_mask, sliding_window

    g = torch.Generator().manual_seed(4)
    q, k, v, grad_out = (torch.randn(1, 2, 256, 16, generator=g) for _ in range(4))
    allowed = dense_mask(sliding_window(32, n_global=4), 256)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = F.scaled_dot_product_attention(*leaves, attn_mask=allowed)
    out.backward(grad_out)
    want = [out.detach(), *(x.grad for x in leaves)]
    for r, got in enumerate(one_gpu.pull("flex")):
        for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
            torch.testing.assert_close(
                a, b, **GPU_TOL, msg=lambda m, n=name, r=r: f"rank {r} {n}: {m}"
            )
