"""Data-parallel strategy helpers on real engines (2 gloo ranks) against single-process references.

Each test runs the strategy on the ranks, pulls the result back and compares it with
the same computation done here in one process on the full batch.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import nbdist


@pytest.fixture(scope="module")
def session():
    with nbdist.DistSession(2, cpu=True, timeout=120) as s:
        yield s


def test_ring_and_rank0_all_reduce_equal_dist_all_reduce(session):
    session.run("""
from nbdist.strategies.teaching import data_parallel_by_hand as by_hand
results = []
for shape in [(1,), (3,), (7, 5), (1000,)]:
    t = torch.randn(shape, generator=torch.Generator().manual_seed(rank * 100 + len(shape)))
    expected = t.clone(); dist.all_reduce(expected)
    ring = t.clone(); by_hand.ring_all_reduce(ring)
    via0 = t.clone(); by_hand.all_reduce_via_rank0(via0)
    results.append((t, expected, ring, via0))
ints = torch.arange(11) * (rank + 1)
ring_ints = by_hand.ring_all_reduce(ints.clone())
""")
    per_rank = session.pull("results")
    for i in range(4):
        inputs = [per_rank[r][i][0] for r in range(2)]
        want = inputs[0] + inputs[1]
        for r in range(2):
            _, expected, ring, via0 = per_rank[r][i]
            torch.testing.assert_close(expected, want)
            torch.testing.assert_close(ring, want)
            torch.testing.assert_close(via0, want)
            assert ring.shape == inputs[0].shape
    # Integers: exact, whatever the summation order.
    assert [t.tolist() for t in session.pull("ring_ints")] == [(torch.arange(11) * 3).tolist()] * 2


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))


DATA = """
g = torch.Generator().manual_seed(1)
X, Y = torch.randn(24, 6, generator=g), torch.randint(0, 3, (24,), generator=g)
"""


def _data():
    g = torch.Generator().manual_seed(1)
    return torch.randn(24, 6, generator=g), torch.randint(0, 3, (24,), generator=g)


def _reference_steps(model, X, Y, steps, lr=0.5):
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    for _ in range(steps):
        opt.zero_grad()
        nn.functional.cross_entropy(model(X), Y).backward()
        opt.step()
    return [p.detach() for p in model.parameters()]


def test_training_with_the_hand_written_ring_matches_one_process(session):
    session.run(
        DATA
        + """
from torch import nn
from nbdist.strategies.teaching import data_parallel_by_hand as by_hand
torch.manual_seed(rank)   # different starts: broadcast_model must fix that
model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))
if rank == 0:
    torch.manual_seed(0); model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))
by_hand.broadcast_model(model)
opt = torch.optim.SGD(model.parameters(), lr=0.5)
for _ in range(4):
    opt.zero_grad()
    x, y = by_hand.split_batch(X, Y)
    nn.functional.cross_entropy(model(x), y).backward()
    by_hand.average_gradients(model)          # the ring, by default
    opt.step()
weights = [p.detach().clone() for p in model.parameters()]
"""
    )
    X, Y = _data()
    want = _reference_steps(_mlp(), X, Y, steps=4)
    for weights in session.pull("weights"):
        for got, ref in zip(weights, want):
            torch.testing.assert_close(got, ref)


def test_no_sync_accumulation_equals_one_step_on_the_k_times_batch(session):
    """4 micro-batches of 3 rows per rank, accumulated = one step on all 24 rows."""
    session.run(
        DATA
        + """
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from nbdist.strategies.parallel.accumulation import AllReduceCounter, accumulate
torch.manual_seed(0)
ddp = DDP(nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3)))
counter = AllReduceCounter(ddp)
opt = torch.optim.SGD(ddp.parameters(), lr=0.5)
K = 4
calls_per_step = []
for step in range(2):
    x_rank, y_rank = X[rank * 12:(rank + 1) * 12], Y[rank * 12:(rank + 1) * 12]
    before = counter.calls
    for i, (x, y) in enumerate(zip(x_rank.split(3), y_rank.split(3))):
        with accumulate(ddp, i, every=K):
            (nn.functional.cross_entropy(ddp(x), y) / K).backward()
    calls_per_step.append(counter.calls - before)
    opt.step()
    opt.zero_grad()
weights = [p.detach().clone() for p in ddp.parameters()]
# Without no_sync every micro-batch's backward reduces.
counter.reset()
for x, y in zip(x_rank.split(3), y_rank.split(3)):
    (nn.functional.cross_entropy(ddp(x), y) / K).backward()
calls_without = counter.calls
"""
    )
    X, Y = _data()
    want = _reference_steps(_mlp(), X, Y, steps=2)
    for weights in session.pull("weights"):
        for got, ref in zip(weights, want):
            torch.testing.assert_close(got, ref)
    # The small model fits in one DDP bucket: one all-reduce per step instead of K.
    assert session.pull("calls_per_step") == [[1, 1], [1, 1]]
    assert session.pull("calls_without") == [4, 4]


def test_distributed_eval_is_exactly_the_single_process_metric(session):
    """1001 samples on 2 ranks: no duplicate, no reordering, the same accuracy and predictions."""
    session.run("""
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset
from nbdist.strategies.training.evaluation import SequentialDistributedSampler, all_gather_uneven, all_reduce_sums
g = torch.Generator().manual_seed(3)
data = TensorDataset(torch.randn(1001, 5, generator=g), torch.randint(0, 4, (1001,), generator=g))
torch.manual_seed(0)
model = torch.nn.Linear(5, 4).eval()
sampler = SequentialDistributedSampler(data)
preds, correct, loss_sum = [], 0, 0.0
with torch.no_grad():
    for x, y in DataLoader(data, batch_size=64, sampler=sampler):
        out = model(x)
        preds.append(out.argmax(1))
        correct += (out.argmax(1) == y).sum()
        loss_sum += torch.nn.functional.cross_entropy(out, y, reduction="sum")
sums = all_reduce_sums(correct=correct, loss=loss_sum, count=len(sampler))
all_preds = all_gather_uneven(torch.cat(preds))
local_count = len(sampler)
torch_count = len(DistributedSampler(data, shuffle=False))   # pads: 501 per rank
""")
    g = torch.Generator().manual_seed(3)
    X, Y = torch.randn(1001, 5, generator=g), torch.randint(0, 4, (1001,), generator=g)
    torch.manual_seed(0)
    model = torch.nn.Linear(5, 4).eval()
    with torch.no_grad():
        out = model(X)
    want_correct = int((out.argmax(1) == Y).sum())
    want_loss = float(nn.functional.cross_entropy(out, Y, reduction="sum"))
    assert session.pull("local_count") == [501, 500]
    assert session.pull("torch_count") == [501, 501]  # the duplicate this helper avoids
    for sums, preds in zip(session.pull("sums"), session.pull("all_preds")):
        assert sums["count"] == 1001
        assert sums["correct"] == want_correct
        assert sums["correct"] / sums["count"] == want_correct / 1001
        assert sums["loss"] == pytest.approx(want_loss, rel=1e-5)
        assert torch.equal(preds, out.argmax(1))


def test_all_gather_uneven_keeps_trailing_shape_and_order(session):
    session.run(
        "from nbdist.strategies.training.evaluation import all_gather_uneven\n"
        "mine = torch.arange(6 * (rank + 1), dtype=torch.float64).reshape(-1, 2, 3) + 100 * rank\n"
        "gathered = all_gather_uneven(mine)"
    )
    want = torch.cat(
        [
            torch.arange(6, dtype=torch.float64).reshape(-1, 2, 3),
            torch.arange(12, dtype=torch.float64).reshape(-1, 2, 3) + 100,
        ]
    )
    for got in session.pull("gathered"):
        assert got.shape == (3, 2, 3)
        assert torch.equal(got, want)


SYNCBN_CASE = """
from torch import nn
from nbdist.strategies.parallel.syncbn import SyncBatchNorm, convert_sync_batchnorm
g = torch.Generator().manual_seed(5)
X = torch.randn({shape}, generator=g) * 3 + 1
R = torch.randn({shape}, generator=g)      # loss = sum(y * R): a gradient that differs per element
bn = convert_sync_batchnorm(nn.Sequential(nn.{cls}({c}, momentum={momentum})))[0]
with torch.no_grad():
    bn.weight.copy_(torch.linspace(0.5, 1.5, {c})); bn.bias.copy_(torch.linspace(-1, 1, {c}))
x = X.tensor_split(2)[rank].clone().requires_grad_()
for _ in range(2):                         # two steps: running statistics accumulate
    y = bn(x)
    x.grad = None; bn.zero_grad()
    (y * R.tensor_split(2)[rank]).sum().backward()
grads = (x.grad.clone(), bn.weight.grad.clone(), bn.bias.grad.clone())
state = (bn.running_mean.clone(), bn.running_var.clone(), int(bn.num_batches_tracked))
bn.eval()
y_eval = bn(x.detach())
kind = type(bn).__module__ + "." + type(bn).__name__
"""


@pytest.mark.parametrize(
    "cls, shape, momentum",
    [("BatchNorm1d", (9, 4), 0.1), ("BatchNorm2d", (6, 3, 4, 5), None)],
    ids=["1d-uneven-batch", "2d-cumulative-average"],
)
def test_cpu_syncbn_equals_batchnorm_on_the_full_batch(session, cls, shape, momentum):
    """Forward, input/weight/bias gradients and running statistics, local batches 5 + 4 or 3 + 3."""
    c = shape[1]
    session.run(SYNCBN_CASE.format(shape=shape, cls=cls, c=c, momentum=momentum))
    assert session.pull("kind") == ["nbdist.strategies.parallel.syncbn.SyncBatchNorm"] * 2

    g = torch.Generator().manual_seed(5)
    X = torch.randn(shape, generator=g) * 3 + 1
    R = torch.randn(shape, generator=g)
    ref = getattr(nn, cls)(c, momentum=momentum)
    with torch.no_grad():
        ref.weight.copy_(torch.linspace(0.5, 1.5, c))
        ref.bias.copy_(torch.linspace(-1, 1, c))
    x = X.clone().requires_grad_()
    for _ in range(2):
        y = ref(x)
        x.grad = None
        ref.zero_grad()
        (y * R).sum().backward()
    ref.eval()
    y_eval = ref(X)

    grads = session.pull("grads")
    states = session.pull("state")
    evals = session.pull("y_eval")
    for r in range(2):
        torch.testing.assert_close(grads[r][0], x.grad.tensor_split(2)[r])
        torch.testing.assert_close(evals[r], y_eval.tensor_split(2)[r].detach())
        torch.testing.assert_close(states[r][0], ref.running_mean)
        torch.testing.assert_close(states[r][1], ref.running_var)
        assert states[r][2] == 2
    # Weight and bias gradients are per-rank sums: together they are the full batch's.
    torch.testing.assert_close(grads[0][1] + grads[1][1], ref.weight.grad)
    torch.testing.assert_close(grads[0][2] + grads[1][2], ref.bias.grad)


def test_cpu_syncbn_under_ddp_trains_like_batchnorm_on_the_full_batch(session):
    """DDP accepts nbdist's SyncBatchNorm on CPU (torch's is refused) and matches one process."""
    session.run(
        DATA
        + """
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from nbdist.strategies.parallel.syncbn import convert_sync_batchnorm
def net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 3))
try:
    DDP(nn.SyncBatchNorm.convert_sync_batchnorm(net()))
    refused = None
except ValueError as e:
    refused = str(e)
ddp = DDP(convert_sync_batchnorm(net()))
opt = torch.optim.SGD(ddp.parameters(), lr=0.5)
x, y = X.tensor_split(2)[rank], Y.tensor_split(2)[rank]
for _ in range(3):
    opt.zero_grad()
    nn.functional.cross_entropy(ddp(x), y).backward()
    opt.step()
state = {k: v.clone() for k, v in ddp.module.state_dict().items()}
"""
    )
    assert session.pull("refused") == ["SyncBatchNorm layers only work with GPU modules"] * 2
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 3))
    X, Y = _data()
    _reference_steps(ref, X, Y, steps=3)
    for state in session.pull("state"):
        assert state.keys() == ref.state_dict().keys()
        for name, want in ref.state_dict().items():
            torch.testing.assert_close(state[name], want, msg=name)


def test_bf16_autocast_under_ddp_tracks_float32(session):
    """bf16 autocast on CPU ranks: matmuls in bf16, weights float32, close to the fp32 run."""
    session.run(
        DATA
        + """
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from nbdist.strategies.training.amp import autocast, grad_scaler, pick_dtype
torch.manual_seed(0)
ddp = DDP(nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3)))
opt = torch.optim.SGD(ddp.parameters(), lr=0.5)
dtype = pick_dtype(device)
scaler = grad_scaler(device, dtype)
x, y = X.tensor_split(2)[rank], Y.tensor_split(2)[rank]
for _ in range(3):
    opt.zero_grad()
    with autocast(device, dtype):
        out = ddp(x)
        loss = nn.functional.cross_entropy(out, y)
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
info = (str(dtype), str(out.dtype), scaler.is_enabled())
weights = [p.detach().clone() for p in ddp.parameters()]
"""
    )
    assert session.pull("info") == [("torch.bfloat16", "torch.bfloat16", False)] * 2
    X, Y = _data()
    want = _reference_steps(_mlp(), X, Y, steps=3)
    w0, w1 = session.pull("weights")
    for a, b, ref in zip(w0, w1, want):
        assert a.dtype == torch.float32
        torch.testing.assert_close(a, b)  # the ranks agree exactly (DDP)
        torch.testing.assert_close(a, ref, atol=2e-2, rtol=0)  # bf16 rounding only
