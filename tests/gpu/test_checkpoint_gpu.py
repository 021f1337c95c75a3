"""nbdist.checkpoint with NCCL on real GPUs (one rank per GPU): FSDP2 shards saved and restored.

Skipped without CUDA. The weights after save, wipe, load and more training
equal those of the same training without interruption; the checkpoint also
loads on the CPU in this process (no process group), e.g. for evaluation.
"""

from __future__ import annotations

import pytest
import torch

import nbdist
from nbdist.checkpoint import load
from nbdist.driver.sinks import ListSink

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA GPUs")

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
nbdist.checkpoint.save(path, model=net, optimizer=opt, step=3)
train(net, opt, 3, 6)
reference = flat(net)
net, opt = build()
info = nbdist.checkpoint.load(path, model=net, optimizer=opt)
train(net, opt, info["step"], 6)
resumed = flat(net)
"""


def test_fsdp2_checkpoint_on_gpus_resumes_exactly(tmp_path):
    gpus = torch.cuda.device_count()
    s = nbdist.DistSession(timeout=300).start()
    try:
        assert s.backend == "nccl"
        path = str(tmp_path / "fsdp_gpu")
        s.push({"path": path})
        s.run(TRAIN, sink=ListSink())
        reference = s.pull("reference", rank=0)
        for rank in range(gpus):
            torch.testing.assert_close(s.pull("resumed", rank=rank), reference)
    finally:
        s.stop()
    # The same checkpoint, on the CPU in one process.
    torch.manual_seed(1)
    plain = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    assert load(path, model=plain)["step"] == 3
