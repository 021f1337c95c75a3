"""NCCL on real GPUs: one rank per GPU, each seeing only its own device. Skipped without CUDA.

With a single GPU, two ranks can share it only with NCCL >= 2.30 and
NCCL_MULTI_RANK_GPU_ENABLE=1 (older NCCL refuses "Duplicate GPU detected").
"""

from __future__ import annotations

import os

import pytest
import torch

import nbdist
from nbdist.driver.sinks import ListSink

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA GPUs")


def _nccl_version() -> tuple[int, ...]:
    version = torch.cuda.nccl.version()
    return version if isinstance(version, tuple) else (version // 1000, version // 100 % 10)


def test_one_rank_per_gpu_with_nccl():
    gpus = torch.cuda.device_count()
    s = nbdist.DistSession(timeout=300).start()
    try:
        assert s.world_size == gpus
        assert s.backend == "nccl"
        # The zygote forked the engines: importing torch does not initialise CUDA.
        assert "spawned" not in s.summary()
        s.run(
            "import os\n"
            "seen = (os.environ['CUDA_VISIBLE_DEVICES'], torch.cuda.device_count(), str(device))\n"
            "t = torch.ones(4, device=device) * (rank + 1)\n"
            "dist.all_reduce(t)\n"
            "total = t.sum().item()\n",
            sink=ListSink(),
        )
        assert s.pull("seen") == [(str(i), 1, "cuda:0") for i in range(gpus)]
        expected = 4 * gpus * (gpus + 1) / 2
        assert s.pull("total") == [expected] * gpus
    finally:
        s.stop()


def test_ddp_on_gpus_matches_one_process():
    gpus = torch.cuda.device_count()
    s = nbdist.DistSession(timeout=300).start()
    try:
        s.run(
            "import torch.nn as nn\n"
            "from torch.nn.parallel import DistributedDataParallel as DDP\n"
            "torch.manual_seed(0)\n"
            "model = nn.Linear(8, 1).to(device)\n"
            "ddp = DDP(model)\n"
            "opt = torch.optim.SGD(ddp.parameters(), lr=0.1)\n"
            "g = torch.Generator().manual_seed(1)\n"
            f"X, Y = torch.randn({4 * gpus}, 8, generator=g), torch.randn({4 * gpus}, 1, generator=g)\n"
            "opt.zero_grad()\n"
            "nn.functional.mse_loss(ddp(X[rank::world_size].to(device)), Y[rank::world_size].to(device)).backward()\n"
            "opt.step()\n"
            "w = model.weight.detach().cpu()\n"
        )
        weights = s.pull("w")
        for w in weights[1:]:
            torch.testing.assert_close(w, weights[0])
    finally:
        s.stop()


@pytest.mark.skipif(
    torch.cuda.is_available() and _nccl_version() < (2, 30),
    reason="two ranks on one GPU need NCCL >= 2.30",
)
def test_two_ranks_share_one_gpu_when_enabled(monkeypatch):
    monkeypatch.setenv("NCCL_MULTI_RANK_GPU_ENABLE", "1")
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "0")
    s = nbdist.DistSession(2, gpus=[0], timeout=300).start()
    try:
        s.run("t = torch.ones(1, device=device); dist.all_reduce(t); v = t.item()")
        assert s.pull("v") == [2.0, 2.0]
        assert os.environ["NCCL_MULTI_RANK_GPU_ENABLE"] == "1"
    finally:
        s.stop()
