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

import nbdist
from nbdist.driver.sinks import ListSink
from nbdist.driver.trace_merge import collect
from tests.gpu.conftest import stop_cleanly

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


@pytest.fixture(scope="module")
def merged():
    """The merged profile of one NCCL rank training the model above (the trace and summary)."""
    session = nbdist.DistSession(1, timeout=300, history=False)
    session.start()
    pids = {r.pid for r in session.ranks}
    try:
        session.run(textwrap.dedent(LOOP), sink=ListSink())
        out = collect(session)
    finally:
        stop_cleanly(session, pids)
    assert out is not None and out.ranks == [0]
    return out


@pytest.mark.example(25)
def test_a_gpu_profile_holds_the_matmuls_kernels(merged):
    with open(merged.path) as f:
        events = json.load(f)["traceEvents"]
    kernels = [e for e in events if e.get("cat") == "kernel"]
    assert kernels, "no CUDA kernel in the merged trace"
    # The Linear layers' kernels, found by the op that launched them (the profiler's
    # "External id"), not by name: cuBLAS names them gemm, sgemm, cutlass or nvjet.
    matmuls = {
        e["args"]["External id"]
        for e in events
        if e.get("cat") == "cpu_op"
        and e["name"] in ("aten::addmm", "aten::mm")
        and "External id" in e.get("args", {})
    }
    assert matmuls, "no aten::addmm/aten::mm op in the merged trace"
    launched = [k for k in kernels if k.get("args", {}).get("External id") in matmuls]
    assert launched, (
        f"no kernel launched by a matmul; kernels: {sorted({k['name'] for k in kernels})[:10]}"
    )
    (row,) = merged.summary
    assert row.compute > 0


@pytest.mark.example(25)
def test_hta_breaks_the_gpu_profile_down_into_shares_of_one_window(merged):
    pytest.importorskip("hta", reason="HTA not installed: pip install nbdist[profile]")
    (row,) = merged.summary
    assert row.hta, "HTA is importable but gave no breakdown for a trace with GPU kernels"
    shares = [
        v for k, v in row.hta.items() if k.endswith("_pctg") and k != "comp_comm_overlap_pctg"
    ]
    # HTA splits the same window into idle, compute, non-compute and communication time.
    assert sum(shares) == pytest.approx(100.0, abs=0.1)
