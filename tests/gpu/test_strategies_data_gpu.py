"""GPU paths of the data-parallel strategy helpers. Skipped without CUDA.

Single-process checks need one GPU; the NCCL ones run one rank per GPU and need two.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import nbdist
from nbdist.driver.sinks import ListSink
from nbdist.strategies import amp, syncbn

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA GPUs")


def test_amp_on_cuda_picks_bf16_where_supported_and_scales_fp16():
    want = torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    assert amp.pick_dtype("cuda") == want
    assert amp.grad_scaler("cuda", "fp16").is_enabled()
    assert amp.grad_scaler("cuda").is_enabled() == (want == torch.float16)  # scale fp16 only
    layer = nn.Linear(8, 8).cuda()
    with amp.autocast("cuda", "fp16"):
        out = layer(torch.randn(2, 8, device="cuda"))
    assert out.dtype == torch.float16


def test_convert_picks_torchs_syncbatchnorm_on_cuda():
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8))
    assert isinstance(syncbn.convert_sync_batchnorm(model, device="cuda")[1], nn.SyncBatchNorm)
    on_gpu = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8)).cuda()
    assert isinstance(syncbn.convert_sync_batchnorm(on_gpu)[1], nn.SyncBatchNorm)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs for NCCL collectives")
def test_ring_and_nbdist_syncbn_on_nccl_match_torch():
    s = nbdist.DistSession(timeout=300).start()
    try:
        s.run(
            """
from torch import nn
from nbdist.strategies import scratch
from nbdist.strategies.syncbn import SyncBatchNorm
t = torch.randn(1001, device=device) + rank
expected = t.clone(); dist.all_reduce(expected)
torch.testing.assert_close(scratch.ring_all_reduce(t.clone()), expected)

g = torch.Generator().manual_seed(0)
X = (torch.randn(8 * world_size, 6, 5, generator=g) * 2 + 1).to(device)
ours, theirs = SyncBatchNorm(6).to(device), nn.SyncBatchNorm(6).to(device)
x1 = X.tensor_split(world_size)[rank].clone().requires_grad_()
x2 = x1.detach().clone().requires_grad_()
y1, y2 = ours(x1), theirs(x2)
(y1 * y1).sum().backward(); (y2 * y2).sum().backward()
torch.testing.assert_close(y1, y2)
torch.testing.assert_close(x1.grad, x2.grad)
torch.testing.assert_close(ours.running_var, theirs.running_var)
ok = True
""",
            sink=ListSink(),
        )
        assert s.pull("ok") == [True] * s.world_size
    finally:
        s.stop()
