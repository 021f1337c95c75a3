"""torch's functional all-gather served by the c10d all-gather (nbdist.engine.functional_gather).

On gloo with CUDA tensors torch's own functional all-gather dies of a segmentation
fault (torch 2.11 on an H200), so nbdist serves it there. NBDIST_GPU_LIKE=1 has CPU
ranks serve it the same way: here, on two real CPU ranks, what DTensor and full state
dicts do with it gives the right tensors and gradients through nbdist's kernel, and
without the switch nbdist's kernel is not used.
"""

from __future__ import annotations

import pytest

from nbdist.driver.sinks import ListSink
from tests.dist.gpu_like_ranks import two_cpu_ranks

CELL = """
import torch.distributed._functional_collectives as funcol
from torch.distributed.tensor import Shard, distribute_tensor
from nbdist.engine import functional_gather
from nbdist.strategies.parallel.tensor_parallel import device_mesh
before = functional_gather.calls()
full = torch.arange(24.0).reshape(6, 4)
leaf = distribute_tensor(full.clone().requires_grad_(), device_mesh(), [Shard(0)])
gathered = leaf.full_tensor()
# Backward through the gather: each rank's shard gets its rows' gradient.
(gathered * torch.arange(1.0, 7.0).unsqueeze(1)).sum().backward()
grad = leaf.grad.to_local().tolist()
mine = torch.full((2, 3), float(rank))
group = dist.group.WORLD.group_name
# The _out form is asynchronous too: its work is registered on `out`, read after the wait.
out = funcol.wait_tensor(
    torch.ops._c10d_functional.all_gather_into_tensor_out(mine, 2, group, out=torch.empty(4, 3))
)
pair = torch.ops._c10d_functional.all_gather_into_tensor_coalesced([mine, mine + 10], 2, group)
pair = [funcol.wait_tensor(t).tolist() for t in pair]
# torch 2.13's operators take the group itself too (schema: Any).
by_group = funcol.wait_tensor(
    torch.ops._c10d_functional.all_gather_into_tensor(mine, 2, dist.group.WORLD)
).tolist()
results = (gathered.tolist(), out.tolist(), pair, by_group, functional_gather.calls() - before)
"""


@pytest.mark.parametrize("gpu_like", [True, False], ids=["NBDIST_GPU_LIKE=1", "unset"])
def test_dtensor_gathers_and_their_gradients_through_nbdists_kernel(gpu_like, monkeypatch):
    with two_cpu_ranks(gpu_like, monkeypatch) as s:
        s.run(CELL, sink=ListSink())
        full = [[4.0 * r + c for c in range(4)] for r in range(6)]
        zeros_then_ones = [[0.0] * 3] * 2 + [[1.0] * 3] * 2
        pair = [zeros_then_ones, [[10.0] * 3] * 2 + [[11.0] * 3] * 2]
        # Rows 0-2 on rank 0, 3-5 on rank 1; each row's gradient is its weight (1..6):
        # DTensor takes a replicated gradient as the same on every rank (no sum).
        grads = [[[float(3 * r + i + 1)] * 4 for i in range(3)] for r in range(2)]
        assert s.pull("grad") == grads
        # full_tensor, _out, _coalesced's two tensors, the gather given the group itself
        served = 5 if gpu_like else 0
        assert s.pull("results") == [(full, zeros_then_ones, pair, zeros_then_ones, served)] * 2
