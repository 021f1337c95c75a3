"""nbdist.checkpoint of FSDP2 on two ranks sharing GPU 0: both shards saved, training resumed bitwise.

Two ranks on one GPU is what ``%dist_start 2`` gives on a one-GPU machine (gloo with
CUDA tensors with NCCL < 2.30, NCCL from 2.30). The weights after save, wipe, load
and more training equal, bit for bit, those of the same training without
interruption; the checkpoint also loads on the CPU in this process (no process
group), e.g. for evaluation.
"""

from __future__ import annotations

import os

import pytest
import torch

from nbdist.checkpoint import load
from nbdist.driver.sinks import ListSink

TRAIN = """
import torch.nn as nn
from torch.distributed.fsdp import fully_shard

def build():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8)).to(device)
    for layer in net:
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    fully_shard(net)
    return net, torch.optim.AdamW(net.parameters(), lr=0.01)

def train(net, opt, start, stop):
    for step in range(start, stop):
        g = torch.Generator().manual_seed(1000 * step + rank)
        x, y = torch.randn(16, 32, generator=g), torch.randn(16, 8, generator=g)
        loss = ((net(x.to(device)) - y.to(device)) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()

def flat(net):
    return torch.cat([p.full_tensor().reshape(-1).cpu() for p in net.parameters()])

net, opt = build()
train(net, opt, 0, 3)
at_save = flat(net)
nbdist.checkpoint.save(path, model=net, optimizer=opt, step=3)
train(net, opt, 3, 6)
reference = flat(net)
net, opt = build()
info = nbdist.checkpoint.load(path, model=net, optimizer=opt)
train(net, opt, info["step"], 6)
resumed = flat(net)
"""


@pytest.mark.example(19)
def test_fsdp2_checkpoint_of_two_ranks_on_one_gpu_resumes_bitwise(start_session, tmp_path):
    """Training resumed from an ``nbdist.checkpoint`` of FSDP2 shards ends where it would have
    without the interruption, on both ranks, each of which wrote its own shard; the
    checkpoint loads on the CPU here.

    Reference: the same 6 steps run straight through in the same cell. Tolerance: none
    (``torch.equal``): the resumed run repeats the same kernels on the same data from the
    same saved bits (parameters, AdamW's moments and step count).
    """
    s = start_session(2, gpus=[0])  # both ranks on GPU 0
    path = str(tmp_path / "fsdp_gpu")
    s.push({"path": path})
    s.run(TRAIN, sink=ListSink())
    reference, at_save = s.pull("reference", rank=0), s.pull("at_save", rank=0)
    for rank, resumed in enumerate(s.pull("resumed")):
        assert torch.equal(resumed, reference), (
            f"rank {rank}: resumed weights differ from the uninterrupted run's by up to "
            f"{(resumed - reference).abs().max().item():.3g}"
        )
    s.stop()
    # One shard file per rank: both ranks held (and wrote) half of every parameter.
    shards = sorted(f for f in os.listdir(path) if f.endswith(".distcp"))
    assert shards == ["__0_0.distcp", "__1_0.distcp"], shards
    # The same checkpoint, on the CPU in one process.
    torch.manual_seed(1)
    plain = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    assert load(path, model=plain)["step"] == 3
    loaded = torch.cat([t.reshape(-1) for t in plain.state_dict().values()])
    assert torch.equal(loaded, at_save)  # the weights as saved, after step 3
