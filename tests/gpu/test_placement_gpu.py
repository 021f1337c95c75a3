"""Where ranks land on GPUs: NCCL with one rank, one rank per GPU, and two ranks sharing one GPU.

References: the GPU's UUID as a plain process sees it for the same index
(``gpu_uuids``), a single-process training step, and exact integer sums.
"""

from __future__ import annotations

import re

import pytest
import torch

from nbdist.driver.sinks import ListSink
from tests.gpu.conftest import nccl_shares_gpus, nccl_version, visible_gpu_indices

BINDING = """
import os
props = torch.cuda.get_device_properties(torch.cuda.current_device())
seen = {
    "mask": os.environ.get("CUDA_VISIBLE_DEVICES"),
    "count": torch.cuda.device_count(),
    "current": torch.cuda.current_device(),
    "helper": str(nbdist.device()),
    "device": str(device),
    "uuid": str(props.uuid),
    "backend": dist.get_backend(),
    "shared_env": os.environ.get("NCCL_MULTI_RANK_GPU_ENABLE"),
}
"""


def test_nccl_with_one_rank_trains_exactly_like_one_process(start_session):
    """``%dist_start 1`` on a GPU gives an NCCL group of one, and DDP there is plain training.

    Reference: the same model, data and SGD step without DDP in the same process.
    Tolerance: none. With one rank the all_reduce is a copy and the average a
    division by 1, so every bit must match.
    """
    s = start_session(1)
    assert (s.backend, s.world_size, [r.device for r in s.ranks]) == ("nccl", 1, ["cuda:0"])
    s.run(
        """
import copy
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
torch.manual_seed(0)
plain = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 1)).to(device)
wrapped = DDP(copy.deepcopy(plain))
initial = [p.detach().cpu().clone() for p in plain.parameters()]
g = torch.Generator().manual_seed(1)
x, y = torch.randn(128, 32, generator=g).to(device), torch.randn(128, 1, generator=g).to(device)
for model in (plain, wrapped):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(3):
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
pairs = [(a.detach().cpu(), b.detach().cpu())
         for a, b in zip(plain.parameters(), wrapped.module.parameters())]
info = (dist.get_backend(), dist.get_world_size(), next(plain.parameters()).device.type)
""",
        sink=ListSink(),
    )
    assert s.pull("info", rank=0) == ("nccl", 1, "cuda")
    pairs, initial = s.pull("pairs", rank=0), s.pull("initial", rank=0)
    for (a, b), before in zip(pairs, initial):
        assert not torch.equal(a, before)  # the steps moved the weights
        torch.testing.assert_close(b, a, rtol=0, atol=0)


def test_each_rank_takes_the_gpu_of_its_local_rank(start_session, gpu_uuids):
    """``%dist_start`` with no number: one rank per visible GPU, as torchrun would place them.

    Every rank sees the same GPUs (CUDA_VISIBLE_DEVICES as the kernel had it) and
    uses ``cuda:<local rank>``, its current device and ``nbdist.device()``, so code
    written for torchrun that picks ``cuda:LOCAL_RANK`` finds the same GPU.
    Reference: the UUID a plain process reports for each GPU index.
    """
    visible = visible_gpu_indices()
    s = start_session()
    assert (s.world_size, s.backend) == (len(visible), "nccl")
    s.run(BINDING + "seen['local_rank'] = int(os.environ['LOCAL_RANK'])\n", sink=ListSink())
    seen = s.pull("seen")
    for rank, (index, got) in enumerate(zip(visible, seen)):
        assert got["count"] == len(visible), f"rank {rank}"
        assert (got["current"], got["local_rank"]) == (rank, rank), f"rank {rank}"
        assert (got["helper"], got["device"]) == (f"cuda:{rank}", f"cuda:{rank}"), f"rank {rank}"
        assert got["uuid"] == gpu_uuids[index], f"rank {rank} is not on GPU {index}"
        assert got["backend"] == "nccl"
    assert len({got["uuid"] for got in seen}) == len(visible)  # no GPU used twice


def test_two_ranks_share_the_last_gpu_and_all_reduce_exactly(
    ipython, capsys, monkeypatch, gpu_uuids
):
    """``%dist_start 2`` with one GPU visible (the machine's last one, not only GPU 0) shares it.

    The user sees a start line saying the ranks share GPU k; both ranks run on that GPU
    (its UUID as a plain process sees it, CUDA_VISIBLE_DEVICES=k, ``cuda:0``: the one GPU
    they were given); the backend
    is NCCL when NCCL >= 2.30 (ranks get NCCL_MULTI_RANK_GPU_ENABLE=1), gloo otherwise;
    and an all_reduce of CUDA tensors gives the exact sum. Reference: the sum computed
    here; integers below 2**24 are exact in float32, so the tolerance is zero.
    """
    last = visible_gpu_indices()[-1]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", str(last))
    monkeypatch.delenv("NCCL_MULTI_RANK_GPU_ENABLE", raising=False)  # the rule, not the user's say
    result = ipython.run_cell("%dist_start 2 --timeout 300")
    assert result.success, result.error_in_exec
    out = capsys.readouterr().out
    expected_backend = "nccl" if nccl_shares_gpus() else "gloo"
    assert f"backend {expected_backend}" in out, out
    assert re.search(rf"ranks 0,1 share GPU {last}\b", out), out

    session = ipython.magics_manager.registry["DistMagics"].session
    # Keyed by GPU index, or by (host, GPU index) where hosts are told apart.
    shared = {
        (k[-1] if isinstance(k, tuple) else k): v for k, v in session.placement.shared_gpus.items()
    }
    assert shared == {last: [0, 1]}
    assert session.backend == expected_backend, f"NCCL {nccl_version()}"

    result = ipython.run_cell(
        "%%on_all_ranks\n"
        + BINDING
        + "t = torch.arange(4096, dtype=torch.float32, device=device) * (rank + 1)\n"
        "dist.all_reduce(t)\n"
        "reduced = t.cpu()\n"
    )
    assert result.success, result.error_in_exec
    seen = session.pull("seen")
    for got in seen:
        assert got["mask"] == str(last)
        assert got["uuid"] == gpu_uuids[last]
        assert (got["count"], got["current"], got["helper"], got["device"]) == (
            1,
            0,
            "cuda:0",
            "cuda:0",
        )
        assert got["backend"] == expected_backend
        assert got["shared_env"] == ("1" if expected_backend == "nccl" else None)
    want = torch.arange(4096, dtype=torch.float32) * (1 + 2)
    for reduced in session.pull("reduced"):
        torch.testing.assert_close(reduced, want, rtol=0, atol=0)


@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2,
    reason="choosing a GPU other than the first needs 2 GPUs",
)
def test_gpus_option_puts_ranks_on_the_gpus_named(start_session, gpu_uuids):
    """``%dist_start --gpus k`` on a multi-GPU machine: the rank runs on GPU k, not GPU 0.

    Reference: the UUID a plain process reports for index k.
    """
    last = visible_gpu_indices()[-1]
    s = start_session(gpus=[last])
    s.run(BINDING, sink=ListSink())
    [got] = s.pull("seen")
    assert (got["mask"], got["uuid"], got["device"]) == (str(last), gpu_uuids[last], "cuda:0")


P2P_CELL = """
from nbdist.strategies.teaching import data_parallel_by_hand as by_hand

# Plain send/recv, isend/irecv through P2POp, and a ring of them (example 03).
mine = torch.full((1000,), float(rank + 1), device=device)
other = torch.empty(1000, device=device)
if rank == 0:
    dist.send(mine, dst=1)
    dist.recv(other, src=1)
else:
    dist.recv(other, src=0)
    dist.send(mine, dst=0)
peer = 1 - rank
posted = torch.empty(1000, device=device)
works = dist.batch_isend_irecv(
    [dist.P2POp(dist.isend, mine, peer), dist.P2POp(dist.irecv, posted, peer)]
)
for work in works:
    work.wait()
ring = torch.arange(4097, dtype=torch.float32, device=device) * (rank + 1)
by_hand.ring_all_reduce(ring)
after = torch.ones(3, device=device)
dist.all_reduce(after)  # the group still works after all of it
p2p = {
    "other": other.cpu(),
    "posted": posted.cpu(),
    "ring": ring.cpu(),
    "after": after.cpu(),
    "devices": {str(t.device) for t in (other, posted, ring)},
}
"""


@pytest.mark.example(3)
def test_point_to_point_of_cuda_tensors_works_on_a_shared_gpu(pair):
    """send/recv, batched isend/irecv and a send/recv ring of CUDA tensors give exact results.

    Over gloo (two ranks on one GPU, NCCL < 2.30) torch's own send/recv of a CUDA tensor
    fails with "writev ... Bad address" and closes the ranks' connection, so every later
    collective fails (seen on an H200 with torch 2.11); nbdist copies them through host
    memory. With NCCL the same cell checks NCCL's own send/recv. Reference: the values
    each rank sent; small integers are exact in float32, so the tolerance is zero.
    """
    pair.run(P2P_CELL, sink=ListSink())
    want_ring = torch.arange(4097, dtype=torch.float32) * (1 + 2)
    for rank, got in enumerate(pair.pull("p2p")):
        peer_value = float(2 - rank)  # what the other rank sent: its rank + 1
        assert torch.equal(got["other"], torch.full((1000,), peer_value)), got["other"][:4]
        assert torch.equal(got["posted"], torch.full((1000,), peer_value)), got["posted"][:4]
        torch.testing.assert_close(got["ring"], want_ring, rtol=0, atol=0)
        assert torch.equal(got["after"], torch.full((3,), 2.0))
        assert all(d.startswith("cuda") for d in got["devices"]), got["devices"]


@pytest.mark.example(23)
def test_a_torchrun_script_asking_for_nccl_is_served_on_a_shared_gpu(pair):
    """A script's own ``init_process_group("nccl")`` runs unchanged where two ranks share a GPU.

    With NCCL < 2.30 nbdist's group there is gloo with CUDA tensors; the script asked for
    NCCL only because it saw a GPU, and gloo serves it (example 23 failed with
    GroupConflict on an H200 before). Reference: exact integer sum of the ranks' values.
    """
    pair.run(
        """
dist.init_process_group("nccl")
served = torch.full((4,), float(rank + 1), device=device)
dist.all_reduce(served)
served = served.cpu()
""",
        sink=ListSink(),
    )
    for got in pair.pull("served"):
        assert torch.equal(got, torch.full((4,), 3.0))


@pytest.mark.example(12)
def test_a_pipeline_trains_on_a_shared_gpu(pair):
    """torch's pipelining (GPipe, 2 stages) on CUDA tensors, 3 SGD steps: the losses equal
    one process's on the same model.

    From its second step the receiving stage receives into buffers that require grad;
    nbdist's host staging copied into them under autograd and raised (examples 12 and 18
    on an H200). Reference: the same float32 model trained on the whole batch in one
    process on the same GPU; the pipeline sums 4 micro-batch losses in another order,
    so rel 1e-5 (a few float32 units).
    """
    pair.run(
        """
import torch.nn.functional as F
from torch import nn
from nbdist.strategies.parallel.pipeline import pipeline_schedule

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 1))
x = torch.randn(8, 4, generator=torch.Generator().manual_seed(1)).to(device)
y = torch.randn(8, 1, generator=torch.Generator().manual_seed(2)).to(device)
stage, schedule = pipeline_schedule(model, n_microbatches=4, loss_fn=F.mse_loss, schedule="gpipe")
opt = torch.optim.SGD(stage.submod.parameters(), lr=0.1)
pipe_losses = []
for step in range(3):
    opt.zero_grad()
    losses = []
    if stage.is_first:
        schedule.step(x)
    else:
        schedule.step(target=y, losses=losses)
        pipe_losses.append(sum(float(l) for l in losses) / 4)
    opt.step()
""",
        sink=ListSink(),
    )
    # On the CPU here (this process never initialises CUDA): float32 either way.
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 1))
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(1))
    y = torch.randn(8, 1, generator=torch.Generator().manual_seed(2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    want = []
    for _ in range(3):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        want.append(loss.item())
    first, last = pair.pull("pipe_losses")
    assert first == []
    assert last == pytest.approx(want, rel=1e-5)
