"""TFLOP/s and MFU: the FLOP count of a step, the peak of a device, and where they show.

``nbdist.log`` runs for real here: its points go over a real socket to a real
collector and into a real run history in this process, as a rank's would.
"""

from __future__ import annotations

import time

import pytest
import torch
from torch import nn

import nbdist
from nbdist.dashboard.model import DashboardModel
from nbdist.dashboard.text import summary_text
from nbdist.metrics import flops
from nbdist.metrics import log as metrics_log
from nbdist.metrics.collector import Collector
from nbdist.metrics.run import Run
from nbdist.metrics.store import RunStore, load_run
from nbdist.server.sidebar_state import LiveView

T0 = 1_700_000_000.0
WIDTHS = [64, 128, 32, 10]  # an nn.Linear stack: 64 -> 128 -> 32 -> 10
BATCH = 16


def _stack(**extra) -> nn.Sequential:
    torch.manual_seed(0)
    layers = []
    for i, (n_in, n_out) in enumerate(zip(WIDTHS, WIDTHS[1:])):
        layers += [nn.Linear(n_in, n_out)] + ([nn.ReLU()] if i < len(WIDTHS) - 2 else [])
    return nn.Sequential(*layers, *extra.values())


# -- the FLOP count ----------------------------------------------------------------------------


def test_a_linear_stack_counts_2_in_out_batch_forward_and_the_same_per_gradient():
    # Forward, per layer: an (B x in) @ (in x out) product, B*in*out multiply-adds = 2*B*in*out FLOPs.
    pairs = list(zip(WIDTHS, WIDTHS[1:]))
    forward = sum(2 * BATCH * n_in * n_out for n_in, n_out in pairs)
    first = 2 * BATCH * WIDTHS[0] * WIDTHS[1]
    model, x = _stack(), torch.randn(BATCH, WIDTHS[0])
    assert nbdist.metrics.flops_per_step(model, x, backward=False) == forward
    # Backward: the weight's gradient (x^T @ grad_out) costs the forward again, and so does
    # the input's (grad_out @ W), except for the first layer: nothing needs the batch's gradient.
    assert nbdist.metrics.flops_per_step(model, x) == 3 * forward - first
    # A batch that needs its gradient: exactly 3x forward, i.e. 6 * (weights) * batch.
    weights = sum(n_in * n_out for n_in, n_out in pairs)
    assert (
        nbdist.metrics.flops_per_step(model, x.requires_grad_())
        == 3 * forward
        == 6 * weights * BATCH
    )


def test_counting_leaves_the_model_its_gradients_buffers_and_the_rng_as_they_were():
    model = _stack(norm=nn.BatchNorm1d(WIDTHS[-1]), drop=nn.Dropout(0.5))
    x = torch.randn(BATCH, WIDTHS[0])
    model(x).sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    stats = [b.clone() for b in model.buffers()]
    rng = torch.get_rng_state()
    assert nbdist.metrics.flops_per_step(model, (x,), loss_fn=lambda out: out.pow(2).mean()) > 0
    for p, g in zip(model.parameters(), grads):
        torch.testing.assert_close(p.grad, g, rtol=0, atol=0)
    for b, s in zip(model.buffers(), stats):
        torch.testing.assert_close(b, s, rtol=0, atol=0)
    assert torch.equal(torch.get_rng_state(), rng)


def test_keyword_inputs_and_outputs_with_a_loss_are_understood():
    class WithLoss(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = _stack()

        def forward(self, features, target):
            out = self.body(features)
            return {"logits": out, "loss": nn.functional.cross_entropy(out, target)}

    x, y = torch.randn(BATCH, WIDTHS[0]), torch.randint(0, WIDTHS[-1], (BATCH,))
    assert nbdist.metrics.flops_per_step(
        WithLoss(), {"features": x, "target": y}
    ) == nbdist.metrics.flops_per_step(_stack(), x)


def test_the_transformer_rule_is_6_params_tokens_plus_attention():
    assert nbdist.metrics.transformer_flops(124_000_000, 8 * 1024) == 6 * 124_000_000 * 8192
    # GPT-2 small shape: 12 layers, 1024 positions, width 768; 12*L*s*d per token for attention.
    per_token = 6 * 124_000_000 + 12 * 12 * 1024 * 768
    assert nbdist.metrics.transformer_flops(
        124_000_000, 4096, layers=12, seq_len=1024, width=768
    ) == (per_token * 4096)
    assert nbdist.metrics.transformer_flops(124_000_000, 3, backward=False) == 2 * 124_000_000 * 3
    model = _stack()
    n = sum(p.numel() for p in model.parameters())
    assert nbdist.metrics.transformer_flops(model, 10) == 6 * n * 10


# -- peaks -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name, product, fp32, tf32, bf16, fp16",
    [
        ("NVIDIA H100 80GB HBM3", "H100 SXM", 67.0, 494.5, 989.5, 989.5),
        ("NVIDIA H100 PCIe", "H100 PCIe", 51.0, 378.0, 756.0, 756.0),
        ("NVIDIA H100 NVL", "H100 NVL", 60.0, 417.5, 835.5, 835.5),
        ("NVIDIA H200", "H200 SXM", 67.0, 494.5, 989.5, 989.5),
        ("NVIDIA H200 NVL", "H200 NVL", 60.0, 417.5, 835.5, 835.5),
        ("NVIDIA GH200 480GB", "GH200", 67.0, 494.5, 989.5, 989.5),
        ("NVIDIA A100-SXM4-40GB", "A100", 19.5, 156.0, 312.0, 312.0),
        ("NVIDIA A100-SXM4-80GB", "A100", 19.5, 156.0, 312.0, 312.0),
        ("NVIDIA A100-PCIE-40GB", "A100", 19.5, 156.0, 312.0, 312.0),
        ("NVIDIA A100 80GB PCIe", "A100", 19.5, 156.0, 312.0, 312.0),
        ("NVIDIA L4", "L4", 30.3, 60.0, 121.0, 121.0),
        ("NVIDIA L40S", "L40S", 91.6, 183.0, 362.05, 362.05),
        ("NVIDIA L40", "L40", 90.5, 90.5, 181.05, 181.05),
        ("NVIDIA A10", "A10", 31.2, 62.5, 125.0, 125.0),
        ("NVIDIA A40", "A40", 37.4, 74.8, 149.7, 149.7),
        ("NVIDIA GeForce RTX 4090", "GeForce RTX 4090", 82.6, 82.6, 165.2, 165.2),
        ("NVIDIA GeForce RTX 3090", "GeForce RTX 3090", 35.6, 35.6, 71.0, 71.0),
        ("Tesla V100-SXM2-16GB", "V100 SXM2", 15.7, 15.7, None, 125.0),
        ("Tesla V100-PCIE-32GB", "V100 PCIe", 14.0, 14.0, None, 112.0),
        ("Tesla V100S-PCIE-32GB", "V100S PCIe", 16.4, 16.4, None, 130.0),
        ("Tesla T4", "T4", 8.1, 8.1, None, 65.0),
    ],
)
def test_the_table_knows_gpus_by_the_name_torch_gives(name, product, fp32, tf32, bf16, fp16):
    for dtype, want in (("fp32", fp32), ("tf32", tf32), ("bf16", bf16), ("fp16", fp16)):
        peak = flops.table_peak(name, dtype)
        if want is None:  # no such unit on this GPU: measured instead
            assert peak is None, (name, dtype)
        else:
            assert (peak.tflops, peak.dtype, peak.source) == (want, dtype, f"table: {product}")


@pytest.mark.parametrize(
    "name",
    [
        "NVIDIA A10G",
        "NVIDIA GeForce RTX 4090 D",
        "NVIDIA GeForce RTX 3090 Ti",
        "AMD Instinct MI300X",
    ],
)
def test_gpus_not_in_the_table_have_no_table_peak(name):
    assert flops.table_peak(name, "bf16") is None


def test_dtypes_are_named_as_torch_or_short_names():
    h100 = "NVIDIA H100 80GB HBM3"
    assert flops.table_peak(h100, torch.bfloat16) == flops.table_peak(h100, "bf16")
    assert flops.table_peak(h100, torch.float16).tflops == flops.table_peak(h100, "half").tflops
    assert flops.table_peak(h100, torch.float32).tflops == 67.0
    with pytest.raises(ValueError, match="fp32, tf32, bf16, fp16"):
        flops.table_peak(h100, "int8")


def test_the_cpu_peak_is_measured_once_and_positive():
    first = nbdist.metrics.device_peak("cpu")
    assert first.tflops > 0 and first.source.startswith("measured: best of timed 1024x1024")
    assert (first.device, first.dtype) == ("cpu", "fp32")
    assert nbdist.metrics.device_peak("cpu") is first  # cached: not measured again
    assert nbdist.metrics.device_peak() is first  # no CUDA in use here: the CPU


def test_set_peak_replaces_the_peak_until_reset():
    try:
        nbdist.metrics.set_peak(2.5)
        assert nbdist.metrics.device_peak("cpu").tflops == 2.5
        assert nbdist.metrics.device_peak("cpu").source == "set by set_peak"
        with pytest.raises(ValueError, match="positive"):
            nbdist.metrics.set_peak(0)
    finally:
        nbdist.metrics.set_peak()
    assert nbdist.metrics.device_peak("cpu").source.startswith("measured")


# -- through nbdist.log, the collector and the history -----------------------------------------


@pytest.fixture
def logged(tmp_path):
    """``log`` connected to a real collector writing a real history; yields a reader."""
    key = b"k" * 32
    path = str(tmp_path / "history.sqlite")
    store = RunStore(path)
    run = store.new_run(world_size=1, backend="gloo")
    collector = Collector(key, run, store)
    metrics_log.configure(collector.url, key, 0)

    def read():
        assert collector.wait_for_points({0: metrics_log.end_of_cell()}, timeout=30)
        collector.commit()
        return load_run(run.id, path=path).to_pandas()

    try:
        yield read
    finally:
        metrics_log.shutdown()
        collector.stop()
        store.close()
        nbdist.metrics.set_peak()


def test_history_has_tflops_and_mfu_from_the_step_time_and_the_peak(logged):
    flop_count = nbdist.metrics.flops_per_step(_stack(), torch.randn(BATCH, WIDTHS[0]))
    peak = 0.02
    for step in range(4):
        time.sleep(0.01)  # a step that takes some time
        nbdist.log(step=step, loss=1.0, flops=flop_count, peak_tflops=peak)
    frame = logged()
    assert {"tflops", "mfu"} <= set(frame.columns)
    assert "peak_tflops" not in frame  # an argument, not a series
    first, later = frame.iloc[0], frame.iloc[1:]
    assert first[["tflops", "mfu"]].isna().all()  # no previous call: no step time yet
    # tflops = FLOPs / step time, in 1e12 per second; mfu = that over the peak used.
    expected = flop_count / later["step_time"] / 1e12
    assert later["tflops"].tolist() == pytest.approx(expected.tolist(), rel=1e-12)
    assert later["mfu"].tolist() == pytest.approx((later["tflops"] / peak).tolist(), rel=1e-12)


def test_without_a_given_peak_mfu_is_against_the_measured_one(logged):
    flops._measure.cache_clear()  # the first flops= call measures, as on a fresh rank
    nbdist.metrics.set_peak()
    for step in range(3):
        nbdist.log(step=step, flops=1e9)
    frame = logged()
    peak = nbdist.metrics.device_peak("cpu").tflops
    later = frame.iloc[1:]
    assert later["mfu"].tolist() == pytest.approx((later["tflops"] / peak).tolist(), rel=1e-12)
    # The first call measured the peak (its timing loop runs at least 0.3 s) after taking its
    # time stamp; the next step's time starts after the measurement, so it is shorter than
    # the time between the two points' stamps by at least that much.
    gap = (frame.iloc[1]["time"] - frame.iloc[0]["time"]).total_seconds()
    assert gap - frame.iloc[1]["step_time"] >= 0.3


def test_without_flops_there_are_no_tflops_or_mfu_columns(logged):
    for step in range(3):
        nbdist.log(step=step, loss=1.0, samples=8)
    frame = logged()
    assert "samples_per_s" in frame and "tflops" not in frame and "mfu" not in frame


# -- where they show ---------------------------------------------------------------------------


def _points(tflops_by_step):
    return [
        (s, T0 + s, {"loss": 1.0, "flops": 4e12, "step_time": 0.1, "tflops": t, "mfu": t / 100})
        for s, t in enumerate(tflops_by_step)
    ]


def test_the_dashboard_charts_tflops_and_mfu_and_the_table_has_their_columns():
    run = Run(1, world_size=2, started=T0)
    run.add(0, _points([40.0, 41.7]))
    run.add(1, _points([38.0, 20.5]))
    model = DashboardModel(run, clock=lambda: T0 + 10)
    _, table = model.poll()
    panels = {p["id"]: p for p in model.snapshot()["panels"]}
    assert "flops" not in panels  # the count logged, constant: not a chart
    assert panels["tflops"]["title"] == "TFLOP/s per rank"
    assert panels["tflops"]["names"] == ["rank 0", "rank 1", "mean"]
    assert panels["tflops"]["data"][1] == [[0, 1], [38.0, 20.5]]
    assert panels["tflops"]["data"][2][1] == pytest.approx([39.0, (41.7 + 20.5) / 2])
    assert panels["mfu"]["title"] == "MFU (% of the device's peak)"
    assert panels["mfu"]["data"][0] == [[0, 1], [0.4, 41.7 / 100]]  # fractions; the axis shows %
    headers = table["headers"]
    at = headers.index("TFLOP/s")
    assert headers[at - 1 : at + 3] == ["step time", "TFLOP/s", "MFU", "memory"]
    assert [row["cells"][at : at + 2] for row in table["rows"]] == [
        ["41.7", "41.7 %"],
        ["20.5", "20.5 %"],
    ]
    text = summary_text(run, now=T0 + 10)
    assert "TFLOP/s" in text and "41.7 %" in text


def test_the_dashboard_has_no_tflops_without_flops():
    run = Run(1, world_size=1, started=T0)
    run.add(0, [(s, T0 + s, {"loss": 1.0, "step_time": 0.1}) for s in range(3)])
    model = DashboardModel(run, clock=lambda: T0 + 10)
    _, table = model.poll()
    assert [p["id"] for p in model.snapshot()["panels"]] == ["loss"]
    assert "TFLOP/s" not in table["headers"] and "MFU" not in table["headers"]
    assert "TFLOP/s" not in summary_text(run, now=T0 + 10)


def test_the_sidebar_payload_has_tflops_and_mfu_only_for_ranks_that_log_flops(tmp_path):
    path = str(tmp_path / "history.sqlite")
    store = RunStore(path)
    run = store.new_run(world_size=2, backend="gloo")
    store.append(run.id, 0, [list(p) for p in _points([40.0, 41.7])])
    store.append(run.id, 1, [[0, T0, {"loss": 1.0}]])
    store.commit()
    entry = {
        "id": "c1",
        "history": path,
        "run_id": run.id,
        "owned": False,
        "ranks": [{"rank": r, "pid": None, "host": "h", "device": "cpu"} for r in (0, 1)],
    }
    rows = LiveView(str(tmp_path)).rank_rows(entry)
    store.close()
    assert (rows[0]["tflops"], rows[0]["mfu"]) == (41.7, 41.7 / 100)
    assert "tflops" not in rows[1] and "mfu" not in rows[1]
