"""TFLOP/s and MFU from real ranks: ``nbdist.metrics.flops_per_step`` on a DDP model, then
``nbdist.log(..., flops=F)`` every step, read back from the run history."""

from __future__ import annotations

import pytest

import nbdist
from nbdist.dashboard.text import summary_text
from nbdist.driver.sinks import ListSink

BATCH, D_IN, HIDDEN, D_OUT = 64, 256, 512, 128
GIVEN_PEAK = 0.05  # rank 0 logs with peak_tflops=; rank 1 uses its measured CPU peak

TRAIN = f"""
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
torch.manual_seed(0)
model = DDP(nn.Sequential(nn.Linear({D_IN}, {HIDDEN}), nn.ReLU(), nn.Linear({HIDDEN}, {D_OUT})))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
x, y = torch.randn({BATCH}, {D_IN}), torch.randn({BATCH}, {D_OUT})
F = nbdist.metrics.flops_per_step(model, x)
extra = {{"peak_tflops": {GIVEN_PEAK}}} if rank == 0 else {{}}
for step in range(8):
    opt.zero_grad()
    loss = nn.functional.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    nbdist.log(step=step, loss=loss.detach(), samples={BATCH}, flops=F, **extra)
measured = nbdist.metrics.device_peak().tflops
"""


@pytest.fixture(scope="module")
def session(tmp_path_factory):
    history = str(tmp_path_factory.mktemp("history") / "runs.sqlite")
    with nbdist.DistSession(2, cpu=True, timeout=120, history=history) as s:
        yield s


def test_history_has_tflops_and_mfu_for_a_known_flop_count(session):
    session.run(TRAIN, sink=ListSink())
    # Forward: 2*B*in*out per Linear. Backward: the same for each weight's gradient and for
    # each input's gradient but the first layer's (the batch needs none).
    forward = 2 * BATCH * (D_IN * HIDDEN + HIDDEN * D_OUT)
    flop_count = 3 * forward - 2 * BATCH * D_IN * HIDDEN
    assert session.pull("F") == [flop_count, flop_count]
    measured = session.pull("measured", rank=1)
    assert measured > 0

    [record] = [r for r in nbdist.runs(session.history) if r.id == session.metrics.id]
    frame = record.to_pandas()
    assert {"tflops", "mfu"} <= set(frame.columns)
    for rank, peak in ((0, GIVEN_PEAK), (1, measured)):
        mine = frame[frame["rank"] == rank].sort_values("step")
        assert mine["tflops"].iloc[:1].isna().all()  # the first call has no step time yet
        later = mine.iloc[1:]
        assert len(later) == 7
        # The same step time as samples/s: the time since the rank's previous log call.
        tflops = flop_count / later["step_time"] / 1e12
        assert later["tflops"].tolist() == pytest.approx(tflops.tolist(), rel=1e-12)
        assert later["samples_per_s"].tolist() == pytest.approx(
            (BATCH / later["step_time"]).tolist(), rel=1e-12
        )
        assert later["mfu"].tolist() == pytest.approx((later["tflops"] / peak).tolist(), rel=1e-12)

    text = summary_text(session.metrics)
    assert "TFLOP/s" in text and "MFU" in text
