"""GPU-only training techniques on two ranks (one per GPU, or both on one GPU), each against a reference.

fp16 autocast with GradScaler under DDP, torch's SyncBatchNorm, FSDP2 with CPU
offload, and torchao's 8-bit AdamW: the techniques CPU ranks cannot run. The
references are the same training in one process (float64 on the CPU here, or
on rank 0 where the arithmetic must be the GPU's), and each tolerance says
where it comes from.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from torch import nn

from nbdist.driver.sinks import ListSink

# float32 unit roundoff (half an ulp at 1.0).
U32 = 2.0**-24

FP16_CELL = """
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
torch.set_float32_matmul_precision("highest")  # fp32 stays fp32 (no TF32) outside autocast
STEPS, LR, INIT_SCALE = 25, 0.05, 2.0**24
g = torch.Generator().manual_seed(1)
X = torch.randn(32 * world_size, 32, generator=g)
Y = X[:, :4].sum(1, keepdim=True) / 2
X, Y = X.to(device), Y.to(device)

def build():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 1)).to(device)

def shard(k):
    return X[k::world_size], Y[k::world_size]

def fp16_loss(model, x, y):
    with torch.autocast(device.type, dtype=torch.float16):
        out = model(x)
    return nn.functional.mse_loss(out.float(), y)

def scaler():
    # 2**24 times gradients of order 0.1 overflow fp16 (max 65504): the first steps are
    # skipped and the scale halves; growth_interval=4 lets it double again after 4 good steps.
    return torch.amp.GradScaler(device.type, init_scale=INIT_SCALE, growth_interval=4)

ddp = DDP(build())
opt = torch.optim.SGD(ddp.parameters(), lr=LR)
ddp_scaler = scaler()
ddp_scales, ddp_losses = [], []
for _ in range(STEPS):
    opt.zero_grad(set_to_none=True)
    loss = fp16_loss(ddp, *shard(rank))
    ddp_scaler.scale(loss).backward()
    ddp_scaler.step(opt)
    ddp_scaler.update()
    ddp_scales.append(ddp_scaler.get_scale())
    ddp_losses.append(loss.item())
ddp_params = [p.detach().cpu() for p in ddp.module.parameters()]

if rank == 0:
    # One process, no DDP: each rank's shard forward and backward in turn (the same
    # shapes and fp16 ranges the ranks saw), gradients summed, unscaled, then divided by
    # the number of ranks, as DDP averages them.
    ref = build()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=LR)
    ref_scaler = scaler()
    ref_scales, max_grad = [], 0.0
    for _ in range(STEPS):
        ref_opt.zero_grad(set_to_none=True)
        for k in range(world_size):
            ref_scaler.scale(fp16_loss(ref, *shard(k))).backward()
        ref_scaler.unscale_(ref_opt)
        for p in ref.parameters():
            p.grad.div_(world_size)
        if all(bool(p.grad.isfinite().all()) for p in ref.parameters()):  # a step taken
            max_grad = max([max_grad] + [p.grad.abs().max().item() for p in ref.parameters()])
        ref_scaler.step(ref_opt)
        ref_scaler.update()
        ref_scales.append(ref_scaler.get_scale())
    ref_params = [p.detach().cpu() for p in ref.parameters()]
    with torch.no_grad():
        full_before = nn.functional.mse_loss(build()(X), Y).item()
        full_after = nn.functional.mse_loss(ddp.module(X), Y).item()
"""


@pytest.mark.example(4)
def test_fp16_autocast_and_grad_scaler_under_ddp_match_one_process(pair):
    """fp16 autocast + GradScaler under DDP trains like the same recipe in one process, and
    every rank's loss scale is the same.

    Reference: on rank 0, one process without DDP, the same model, data, autocast and
    scaler, each rank's shard back-propagated in turn and the gradients averaged. The
    scales (powers of two) and the skipped steps must match exactly. Weights: the
    arithmetic is the same, so they differ only where a GEMM's fp16 result is rounded
    differently (another kernel, another summation order across ranks): at most one
    fp16 rounding, 2**-11 relative, of a gradient element per step. Over STEPS steps
    of lr that moves a weight by at most STEPS * lr * 2**-10 * max|grad|, the atol.
    """
    pair.run(FP16_CELL, sink=ListSink())
    scales = pair.pull("ddp_scales")
    assert scales[1:] == scales[:1] * (len(scales) - 1)  # every rank, every step
    ref_scales = pair.pull("ref_scales", rank=0)
    assert scales[0] == ref_scales
    steps, lr, init_scale = 25, 0.05, 2.0**24
    assert scales[0][0] < init_scale  # the scaler did skip an overflowing step
    assert sum(b < a for a, b in zip(scales[0], scales[0][1:])) < steps // 2  # and trained
    max_grad = pair.pull("max_grad", rank=0)
    atol = steps * lr * 2.0**-10 * max_grad
    ref_params = pair.pull("ref_params", rank=0)
    for params in pair.pull("ddp_params"):
        for got, want in zip(params, ref_params):
            torch.testing.assert_close(got, want, rtol=0, atol=atol)
    before, after = pair.pull("full_before", rank=0), pair.pull("full_after", rank=0)
    assert after < 0.5 * before, (before, after)


def _syncbn_model(channels: int, length: int) -> nn.Module:
    return nn.Sequential(nn.BatchNorm1d(channels), nn.Flatten(), nn.Linear(channels * length, 1))


@pytest.mark.example(7)
def test_syncbatchnorm_under_ddp_equals_batchnorm_over_the_whole_batch(pair):
    """torch's SyncBatchNorm under DDP: after one training step the running mean and variance,
    and the weights, equal those of plain BatchNorm trained on the concatenated batch in one
    process.

    Reference: float64 on the CPU here, plain ``BatchNorm1d`` over all ranks' samples. The
    ranks' halves are shifted apart, so statistics of one rank's half alone would miss by
    ~0.05 and fail. Tolerance (float32 on the GPU): a channel's mean or variance is a sum of
    n = 160 values of magnitude <= 10, off by at most n * 2**-24 * 10 = 9.5e-5, and the
    running statistics take 0.1 of it (momentum): 9.5e-6. The step moves each weight by
    lr * grad, a grad being such a sum too, so the same 1e-5 covers it.
    """
    channels, length, per_rank, world = 6, 5, 16, pair.world_size
    g = torch.Generator().manual_seed(0)
    x = torch.randn(per_rank * world, channels, length, generator=g) * 2 + 1
    x[per_rank:] += 1.0  # the second rank's half differs: only synced statistics match
    y = torch.randn(per_rank * world, 1, generator=g)
    torch.manual_seed(0)
    init = _syncbn_model(channels, length).state_dict()
    pair.push({"bn_x": x, "bn_y": y, "bn_init": init, "bn_shape": (channels, length)})
    pair.run(
        """
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
torch.set_float32_matmul_precision("highest")
C, L = bn_shape
net = nn.Sequential(nn.BatchNorm1d(C), nn.Flatten(), nn.Linear(C * L, 1))
net.load_state_dict(bn_init)
net = DDP(nn.SyncBatchNorm.convert_sync_batchnorm(net).to(device))
is_sync = isinstance(net.module[0], nn.SyncBatchNorm)
opt = torch.optim.SGD(net.parameters(), lr=0.1)
x, y = bn_x.tensor_split(world_size)[rank].to(device), bn_y.tensor_split(world_size)[rank].to(device)
opt.zero_grad()
nn.functional.mse_loss(net(x), y).backward()
opt.step()
bn_after = {k: v.detach().cpu() for k, v in net.module.state_dict().items()}
""",
        sink=ListSink(),
    )
    assert pair.pull("is_sync") == [True] * world

    ref = _syncbn_model(channels, length).double()
    ref.load_state_dict(init)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    nn.functional.mse_loss(ref(x.double()), y.double()).backward()
    opt.step()
    want = {k: v.detach() for k, v in ref.state_dict().items()}
    for got in pair.pull("bn_after"):
        assert int(got["0.num_batches_tracked"]) == 1
        for name in ("0.running_mean", "0.running_var", "0.weight", "0.bias", "2.weight", "2.bias"):
            torch.testing.assert_close(
                got[name].double(), want[name], rtol=1e-5, atol=1e-5, msg=name
            )


FSDP_CELL = """
from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard
torch.set_float32_matmul_precision("highest")
net = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 32), nn.Tanh(), nn.Linear(32, 1))
net.load_state_dict(fsdp_init)
net.to(device)
for layer in net:
    if isinstance(layer, nn.Linear):
        fully_shard(layer, offload_policy=CPUOffloadPolicy())
fully_shard(net, offload_policy=CPUOffloadPolicy())
opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
x, y = fsdp_x[rank::world_size].to(device), fsdp_y[rank::world_size].to(device)
where_between = []
for _ in range(3):
    loss = nn.functional.mse_loss(net(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    where_between.append(sorted(
        {p.to_local().device.type for p in net.parameters()}
        | {p.grad.to_local().device.type for p in net.parameters()}
        | {s["momentum_buffer"].to_local().device.type for s in opt.state.values()}
    ))
shards = {n: p.to_local().detach().clone() for n, p in net.named_parameters()}
"""


def _fsdp_model() -> nn.Module:
    return nn.Sequential(
        nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 32), nn.Tanh(), nn.Linear(32, 1)
    )


@pytest.mark.example(9)
@pytest.mark.parametrize("ranks", [1, 2])
def test_fsdp2_cpu_offload_keeps_parameters_on_cpu_and_trains_like_one_process(
    ranks, start_session, request
):
    """FSDP2 (``fully_shard``) with ``CPUOffloadPolicy``: between steps every parameter shard,
    gradient and momentum buffer is in CPU memory, and 3 steps give the weights one process
    gets training on the whole batch.

    Reference: float64 on the CPU here, the same model, data and SGD (lr 0.1, momentum 0.9)
    without sharding. Tolerance: a gradient element is a sum over the 64 samples, off in
    float32 by at most 64 * 2**-24 = 3.8e-6 of the sum of magnitudes (<= 1 here); 3 momentum
    steps move a weight by lr * (1 + 1.9 + 2.71) such gradients: 2.1e-6, and the forward's
    own rounding adds the same order. atol 1e-5.
    """
    if ranks == 1:
        session = start_session(1)  # NCCL, world size 1: offload without sharding
    else:
        # No skip: FSDP2 on two ranks sharing a GPU needs gloo's all-gather and reduce-scatter
        # of CUDA tensors, which torch has (measured on an H200 with torch 2.11); a torch
        # without them fails here, as it would fail the user.
        session = request.getfixturevalue("pair")
    g = torch.Generator().manual_seed(2)
    x = torch.randn(64, 16, generator=g)
    y = torch.sin(x[:, :1]) + x[:, 1:2]
    torch.manual_seed(0)
    init = _fsdp_model().state_dict()
    session.push({"fsdp_x": x, "fsdp_y": y, "fsdp_init": init})
    session.run(FSDP_CELL, sink=ListSink())
    assert session.pull("where_between") == [[["cpu"]] * 3] * ranks

    shards = session.pull("shards")
    ref = _fsdp_model().double()
    ref.load_state_dict(init)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    for _ in range(3):
        loss = nn.functional.mse_loss(ref(x.double()), y.double())
        opt.zero_grad()
        loss.backward()
        opt.step()
    for name, want in ref.named_parameters():
        # FSDP2 shards dim 0 in rank order (torch.chunk): concatenated, the shards are the whole.
        got = torch.cat([s[name] for s in shards], dim=0)
        assert not torch.equal(got.double(), init[name].double()), f"{name} did not move"
        torch.testing.assert_close(got.double(), want.detach(), rtol=0, atol=1e-5, msg=name)


ADAM8_CELL = """
import copy
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
try:
    from torchao.optim import AdamW8bit
    ao_missing = ""
except Exception as exc:  # reported by the test as the reason to skip
    ao_missing = f"{type(exc).__name__}: {exc}"

def state_bytes(opt):
    def size(t):
        if hasattr(t, "__tensor_flatten__"):  # torchao's 8-bit state: codes, scales, code map
            names, _ = t.__tensor_flatten__()
            return sum(size(getattr(t, n)) for n in names)
        return t.numel() * t.element_size()
    return sum(size(v) for s in opt.state.values() for v in s.values() if torch.is_tensor(v))

if not ao_missing:
    torch.set_float32_matmul_precision("highest")
    g = torch.Generator().manual_seed(1)
    X = torch.randn(256 * world_size, 256, generator=g)
    Y = torch.tanh(X @ (torch.randn(256, 1, generator=g) / 16))
    x, y = X[rank::world_size].to(device), Y[rank::world_size].to(device)
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 256), nn.ReLU(),
                         nn.Linear(256, 1)).to(device)
    curves, sizes = {}, {}
    for name, make in (("adamw", torch.optim.AdamW), ("adamw8bit", AdamW8bit)):
        model = DDP(copy.deepcopy(base))
        opt = make(model.parameters(), lr=1e-3, weight_decay=0.0)
        losses = []
        for _ in range(30):
            loss = nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        curves[name], sizes[name] = losses, state_bytes(opt)
"""


@pytest.mark.example(14)
def test_adamw8bit_trains_like_adamw_with_a_quarter_of_the_state(pair):
    """torchao's ``AdamW8bit`` under DDP: its loss follows AdamW's step by step, and its
    optimizer state takes about a quarter of AdamW's memory.

    Reference: ``torch.optim.AdamW`` with the same model, data and hyperparameters. Bound:
    8-bit block-wise quantisation keeps each moment to a few percent of its block's
    largest value, so each update m/(sqrt(v)+eps) differs from AdamW's by a few percent
    and the losses stay within 5 % of AdamW's (plus 0.1 % of the starting loss where the
    loss nears zero). State: 1-byte codes plus one float32 scale per 256-value block
    (1.016 bytes) instead of 4 bytes per value, for the 2 big weight matrices; the 1,537
    values of small tensors keep float32 state: a ratio of 0.26, so < 0.3.
    """
    if importlib.util.find_spec("torchao") is None:
        pytest.skip(
            "torchao is not installed (pip install torchao; it installs offline from a wheel)"
        )
    pair.run(ADAM8_CELL, sink=ListSink())
    missing = pair.pull("ao_missing", rank=0)
    if missing:
        pytest.skip(f"torchao.optim.AdamW8bit cannot be imported on the ranks: {missing}")
    for curves, sizes in zip(pair.pull("curves"), pair.pull("sizes")):
        ref, got = curves["adamw"], curves["adamw8bit"]
        assert got[0] == pytest.approx(ref[0], rel=1e-6)  # same model, same data
        assert got[-1] < 0.1 * got[0], got  # it trains
        for step, (a, b) in enumerate(zip(ref, got)):
            assert abs(b - a) <= 0.05 * a + 1e-3 * ref[0], (step, a, b)
        assert sizes["adamw8bit"] < 0.3 * sizes["adamw"], sizes
