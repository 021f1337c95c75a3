"""NBDIST_GPU_LIKE=1: CPU ranks step optimizers with foreach kernels and stage point-to-point, as GPU ranks do.

The GPU-like tier (``bash scripts/test.sh --gpu-like``) runs the strategy tests with
this switch; here, that the switch does what it says on two real CPU ranks: an
optimizer left to choose runs foreach (and so refuses a model mixing DTensors and
plain tensors, as it did on an H200), a receive goes through the staging path, and
without the variable nothing changes.
"""

from __future__ import annotations

import pytest

from nbdist.driver.sinks import ListSink
from nbdist.errors import RankError
from tests.dist.gpu_like_ranks import two_cpu_ranks

CELL = """
from torch import nn
from torch.distributed.tensor import Replicate, distribute_tensor
from nbdist.engine import gpu_like, p2p_staging
from nbdist.strategies.parallel.tensor_parallel import device_mesh
flags = (gpu_like.foreach_forced(), p2p_staging.installed())
net = nn.Linear(4, 2)
opt = torch.optim.SGD(net.parameters(), lr=0.1)
net(torch.ones(3, 4)).sum().backward()
opt.step()
foreach = opt.param_groups[0]["foreach"]
# A receive into a leaf that requires grad: what torch's pipelining does from its second step.
leaf = torch.zeros(3, requires_grad=True)
if rank == 0:
    dist.send(torch.arange(3.0), dst=1)
else:
    dist.recv(leaf, src=0)
received = leaf.detach().tolist()
# Half a tensor-parallel model: the weight a DTensor, the bias still a plain tensor.
half = nn.Linear(4, 2)
half.weight = nn.Parameter(distribute_tensor(half.weight.detach(), device_mesh(), [Replicate()]))
half_opt = torch.optim.SGD(half.parameters(), lr=0.1)
"""
MIXED_STEP = """
half.weight.grad = torch.ones_like(half.weight)
half.bias.grad = torch.ones_like(half.bias)
half_opt.step()
"""


@pytest.mark.parametrize("gpu_like", [True, False], ids=["NBDIST_GPU_LIKE=1", "unset"])
def test_the_switch_gives_cpu_ranks_the_gpu_code_paths_and_nothing_without_it(
    gpu_like, monkeypatch
):
    with two_cpu_ranks(gpu_like, monkeypatch) as s:
        s.run(CELL, sink=ListSink())
        assert s.pull("flags") == [(gpu_like, gpu_like)] * 2
        assert s.pull("foreach") == [True if gpu_like else None] * 2
        assert s.pull("received", rank=1) == [0.0, 1.0, 2.0]
        if gpu_like:
            # torch's foreach kernels refuse the mix: the failure CUDA ranks met (example 11).
            with pytest.raises(RankError, match="DTensor"):
                s.run(MIXED_STEP, sink=ListSink())
        else:
            s.run(MIXED_STEP, sink=ListSink())  # the per-tensor loop takes it on CPU
