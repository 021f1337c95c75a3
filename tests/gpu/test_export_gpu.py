"""``%dist_export`` on GPUs: the notebook's cells, as a script, print under torchrun what the ranks printed.

The cells train a DDP model on the GPU a few steps and print, per rank, the
all_reduced rank sum, the last loss and a checksum of the weights, each as the
exact float (``repr``). The same GPU, kernels and collectives give the same bits,
so the reference (the ranks' own lines in the notebook) must match exactly.
"""

from __future__ import annotations

import os
import re

import pytest
import torch

from tests.conftest import run_torchrun
from tests.gpu.conftest import dist_stop_cleanly, nccl_shares_gpus

CELLS = [
    """
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
torch.manual_seed(0)
model = DDP(nn.Sequential(nn.Linear(64, 128), nn.Tanh(), nn.Linear(128, 1)).to(device))
opt = torch.optim.SGD(model.parameters(), lr=0.05)
g = torch.Generator(device=device).manual_seed(1000 + rank)
""",
    """
for step in range(5):
    x = torch.randn(32, 64, device=device, generator=g)
    loss = (model(x) - x[:, :1] * x[:, 1:2]).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
""",
    """
t = torch.tensor([float(rank + 1)], device=device)
dist.all_reduce(t)
w = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).double().sum().item()
print(f"result rank={rank} world={world_size} backend={dist.get_backend()} "
      f"device={device.type} sum={t.item()!r} loss={loss.item()!r} weights={w!r}")
""",
]
RESULT = re.compile(r"(result rank=\d+ .*)$", re.MULTILINE)


def _ranks_reason(ranks: int) -> str:
    if ranks == 1 or torch.cuda.device_count() >= 2 or nccl_shares_gpus():
        return ""
    return "2 torchrun processes on one GPU need NCCL >= 2.30 (older NCCL refuses two ranks on one GPU)"


@pytest.mark.parametrize("ranks", [1, 2])
def test_exported_notebook_prints_the_same_under_torchrun(ranks, ipython, capsys, tmp_path):
    """Cells run with ``%%on_all_ranks`` on GPU ranks, then ``%dist_export``: the script runs under
    ``torchrun --standalone --nproc_per_node N`` on the same GPU(s) and prints, rank by rank,
    exactly the lines the ranks printed in the notebook. With 2 ranks and one GPU, both share it.

    Reference: the notebook ranks' own output. Tolerance: none (same kernels, same data).
    """
    reason = _ranks_reason(ranks)
    if reason:
        pytest.skip(reason)
    assert ipython.run_cell(f"%dist_start {ranks} --timeout 300").success
    for cell in CELLS:
        result = ipython.run_cell("%%on_all_ranks\n" + cell)
        assert result.success, result.error_in_exec
    notebook = sorted(RESULT.findall(capsys.readouterr().out))
    assert len(notebook) == ranks, notebook
    assert all("backend=nccl device=cuda" in line for line in notebook), notebook
    script = tmp_path / "train.py"
    assert ipython.run_cell(f"%dist_export {script}").success
    dist_stop_cleanly(ipython)  # every rank gone: the GPU is the script's alone

    env = dict(os.environ, NBDIST_HISTORY=str(tmp_path / "history.sqlite"), OMP_NUM_THREADS="1")
    returncode, output = run_torchrun(script, ranks, env, tmp_path)
    assert returncode == 0, output[-4000:]
    assert sorted(RESULT.findall(output)) == notebook, output[-4000:]
