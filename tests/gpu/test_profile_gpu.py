"""A merged profile on a GPU rank: CUDA kernels in the trace, and HTA's breakdown where it installs.

On one GPU (any machine with CUDA) one NCCL rank trains a small model under
``nbdist.profile``; the merged trace must hold the rank's GPU kernels, and with
HolisticTraceAnalysis importable (``pip install nbdist[profile]``) the summary
gains HTA's temporal breakdown, whose shares are percentages of the same window.
"""

from __future__ import annotations

import json
import textwrap

import pytest

from nbdist.driver.sinks import ListSink
from nbdist.driver.trace_merge import collect

LOOP = """
from torch import nn
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(1024, 4096), nn.ReLU(), nn.Linear(4096, 1024)).to(device)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
x = torch.randn(256, 1024, device=device)
with nbdist.profile(steps=3, skip=1):
    for step in range(5):
        opt.zero_grad()
        loss = model(x).square().mean()
        loss.backward()
        t = torch.ones(1, device=device)
        dist.all_reduce(t)
        opt.step()
        nbdist.log(step=step, loss=loss)
"""


@pytest.mark.example(25)
def test_a_gpu_profile_has_kernels_and_hta_shares(start_session):
    s = start_session(1)
    s.run(textwrap.dedent(LOOP), sink=ListSink())
    merged = collect(s)
    assert merged is not None and merged.ranks == [0]
    with open(merged.path) as f:
        events = json.load(f)["traceEvents"]
    kernels = [e for e in events if e.get("cat") == "kernel"]
    assert kernels, "no CUDA kernel in the merged trace"
    assert any("gemm" in e["name"].lower() or "sgemm" in e["name"].lower() for e in kernels)
    (row,) = merged.summary
    assert row.compute > 0
    pytest.importorskip("hta", reason="HTA not installed: pip install nbdist[profile]")
    assert row.hta, "HTA is importable but gave no breakdown for a trace with GPU kernels"
    shares = [
        v for k, v in row.hta.items() if k.endswith("_pctg") and k != "comp_comm_overlap_pctg"
    ]
    # HTA splits the same window into idle, compute, non-compute and communication time.
    assert sum(shares) == pytest.approx(100.0, abs=0.1)
