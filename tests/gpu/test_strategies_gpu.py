"""Sharded strategies on real GPUs (NCCL, one rank per GPU). Skipped without CUDA.

What CPU ranks cannot show: FSDP2 with CPU offload (torch refuses it without
an accelerator), FSDP2 in bf16/fp16 mixed precision, activation checkpointing
lowering the CUDA peak, tensor and pipeline parallel over NCCL.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import nbdist
from nbdist.driver.sinks import ListSink

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA GPUs")

COMMON = """
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

class Block(nn.Module):
    def __init__(self, d=256):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
    def forward(self, x):
        return x + self.fc2(torch.relu(self.fc1(x)))

def make_net(seed=0, d=256, n_blocks=4):
    torch.manual_seed(seed)
    return nn.Sequential(*[Block(d) for _ in range(n_blocks)], nn.Linear(d, 1))

g = torch.Generator().manual_seed(1)
X = torch.randn(64 * world_size, 256, generator=g).to(device)
Y = X[:, :4].sum(1, keepdim=True).to(device) / 2

def train(model, steps=5, lr=1e-3):
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(X[rank::world_size]).float(), Y[rank::world_size])
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses
"""


@pytest.fixture(scope="module")
def session():
    s = nbdist.DistSession(timeout=300).start()  # one rank per visible GPU
    try:
        s.run(COMMON, sink=ListSink())
        yield s
    finally:
        s.stop()


def test_fsdp_cpu_offload_keeps_shards_on_cpu_and_matches_ddp(session):
    session.run(
        """
from nbdist.strategies.fsdp import apply_fsdp, full_state_dict
off = apply_fsdp(make_net().to(device), blocks=Block, offload=True)
shard_device = str(next(off.parameters()).to_local().device)
off_losses = train(off)
ddp = DDP(make_net().to(device))
ddp_losses = train(ddp)
off_state = full_state_dict(off)
ddp_state = {k: v.detach().cpu() for k, v in ddp.module.state_dict().items()}
""",
        sink=ListSink(),
    )
    assert set(session.pull("shard_device")) == {"cpu"}
    for off_state, ddp_state in zip(session.pull("off_state"), session.pull("ddp_state")):
        for name, value in off_state.items():
            torch.testing.assert_close(value, ddp_state[name], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_fsdp_mixed_precision_trains_close_to_fp32(session, dtype):
    session.run(
        f"""
from nbdist.strategies.fsdp import apply_fsdp, full_state_dict
mp = apply_fsdp(make_net().to(device), blocks=Block, param_dtype=torch.{dtype},
                reduce_dtype=torch.float32)
mp_losses = train(mp, steps=20, lr=1e-4)
fp32_losses = train(DDP(make_net().to(device)), steps=20, lr=1e-4)
master_dtypes = sorted({{str(v.dtype) for v in full_state_dict(mp).values()}})
""",
        sink=ListSink(),
    )
    # Sharded master weights stay fp32; only the compute runs in low precision.
    assert session.pull("master_dtypes") == [["torch.float32"]] * len(session.ranks)
    for mp_losses, fp32_losses in zip(session.pull("mp_losses"), session.pull("fp32_losses")):
        assert mp_losses[-1] < 0.5 * mp_losses[0], mp_losses
        torch.testing.assert_close(
            torch.tensor(mp_losses), torch.tensor(fp32_losses), rtol=0.05, atol=0.02
        )


def test_activation_checkpointing_lowers_the_cuda_peak(session):
    session.run(
        """
from nbdist.strategies.checkpointing import apply_ac
def peak(model):
    x = torch.randn(4096, 256, device=device)
    torch.cuda.synchronize(); torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    model(x).sum().backward()
    torch.cuda.synchronize()
    model.zero_grad(set_to_none=True)
    return torch.cuda.max_memory_allocated(device) - base
plain_peak = peak(make_net(n_blocks=8).to(device))
ac_peak = peak(apply_ac(make_net(n_blocks=8).to(device), blocks=Block))
""",
        sink=ListSink(),
    )
    for plain, ac in zip(session.pull("plain_peak"), session.pull("ac_peak")):
        assert ac < 0.6 * plain, (ac, plain)


def test_tensor_parallel_over_nccl_equals_dense(session):
    session.run(
        """
import copy
from nbdist.strategies.tensor_parallel import apply_tp, device_mesh
dense = make_net(n_blocks=1).to(device)
tp = apply_tp(copy.deepcopy(dense), device_mesh(), colwise=["0.fc1"], rowwise=["0.fc2"])
x = torch.randn(32, 256, device=device)
with torch.no_grad():
    tp_out, dense_out = tp(x).cpu(), dense(x).cpu()
""",
        sink=ListSink(),
    )
    for got, want in zip(session.pull("tp_out"), session.pull("dense_out")):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_pipeline_over_nccl_equals_sequential(session):
    if len(session.ranks) < 2:
        pytest.skip("pipeline parallel needs 2 GPUs (one stage per rank)")
    session.run(
        """
from nbdist.strategies.pipeline import pipeline_schedule
stage, sched = pipeline_schedule(make_net(), n_microbatches=4, loss_fn=nn.functional.mse_loss)
losses = []
if stage.is_first:
    sched.step(X)
elif stage.is_last:
    sched.step(target=Y, losses=losses)
else:
    sched.step()
pp_loss = torch.stack(losses).mean().item() if losses else None
ref_loss = nn.functional.mse_loss(make_net().to(device)(X), Y).item()
""",
        sink=ListSink(),
    )
    pp, ref = session.pull("pp_loss")[-1], session.pull("ref_loss")[-1]
    assert pp == pytest.approx(ref, rel=1e-4)


EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
SHARDED = sorted(p for n in ("08", "09", "10", "11", "12") for p in EXAMPLES.glob(f"{n}_*.ipynb"))


@pytest.mark.skipif(
    torch.cuda.device_count() < 2,
    reason="the sharded examples need 2 GPUs (one stage, one shard each)",
)
@pytest.mark.parametrize("path", SHARDED, ids=[p.stem for p in SHARDED])
def test_sharded_example_runs_on_every_gpu(path, tmp_path):
    """The notebook as a GPU user runs it: ``%dist_start`` with no number, one rank per GPU."""
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.read(path, as_version=4)
    starts = [c for c in nb.cells if c.cell_type == "code" and c.source.strip() == "%dist_start 2"]
    assert len(starts) == 1
    starts[0].source = "%dist_start"
    NotebookClient(
        nb, timeout=900, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
    ).execute()
    text = "".join(
        o.get("text", "")
        for c in nb.cells
        for o in c.get("outputs", [])
        if o.output_type == "stream"
    )
    assert "backend nccl" in text
    assert "SKIPPED" not in text  # GPU-only cells (CPU offload) really ran
