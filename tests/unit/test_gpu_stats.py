"""GPU figures per rank: which NVML device a rank's GPU is, the once-a-second cache, and where the
figures show (``%dist_status``, the dashboard, the sidebar's REST payload) — and that nothing
GPU-related shows anywhere without GPUs, checked on this machine's real NVML and a real session.

Runs with GPU readings are filled with points as the collector receives them from a rank.
"""

from __future__ import annotations

import shutil

import pytest
import torch

import nbdist
from nbdist.dashboard.model import DashboardModel
from nbdist.dashboard.table import fmt_gpu_memory, fmt_gpu_temp, fmt_gpu_util
from nbdist.dashboard.text import summary_text
from nbdist.driver.sinks import ListSink
from nbdist.driver.status import format_status
from nbdist.driver.where import control_request
from nbdist.metrics import gpu
from nbdist.metrics.run import Run
from nbdist.metrics.store import RunStore
from nbdist.server.sidebar_state import LiveView

T0 = 1_700_000_000.0
NO_GPU = not torch.cuda.is_available() and shutil.which("nvidia-smi") is None
H100 = {
    "index": 3,
    "name": "NVIDIA H100 80GB HBM3",
    "uuid": "GPU-5f0c1b2a-0000-1111-2222-333344445555",
    "util": 87.0,
    "mem_used_mib": 40960.0,
    "mem_total_mib": 81920.0,
    "temp_c": 61.0,
}


# -- which NVML device ---------------------------------------------------------------------


def test_the_uuid_names_the_gpu_whatever_the_mask_says():
    # CUDA may order GPUs differently from NVML: the UUID is the sure answer.
    assert gpu.nvml_target("GPU-ab", "3", 0) == ("uuid", "GPU-ab")


def test_without_a_uuid_the_mask_entry_is_the_physical_gpu():
    assert gpu.nvml_target(None, "3", 0) == ("index", 3)  # a rank nbdist started: cuda:0 is GPU 3
    assert gpu.nvml_target(None, "2, 0", 1) == ("index", 0)
    assert gpu.nvml_target(None, None, 2) == ("index", 2)  # no mask: CUDA's index is the GPU's
    assert gpu.nvml_target(None, "GPU-5f0c,1", 0) == ("uuid", "GPU-5f0c")


def test_a_device_outside_the_mask_has_no_gpu():
    assert gpu.nvml_target(None, "1", 1) is None
    assert gpu.nvml_target(None, "", 0) is None
    # Like CUDA, the list ends at the first entry it cannot use.
    assert gpu.nvml_target(None, "1,x,2", 2) is None
    assert gpu.nvml_target(None, "1,x,2", 0) == ("index", 1)


def test_uuid_text_is_nvml_s_spelling():
    raw = bytes(range(16))
    assert gpu.uuid_text(raw) == "GPU-00010203-0405-0607-0809-0a0b0c0d0e0f"
    assert gpu.uuid_text("5f0c1b2a-0000-1111-2222-333344445555") == H100["uuid"]
    assert gpu.uuid_text(H100["uuid"]) == H100["uuid"]
    assert gpu.uuid_text(None) is None and gpu.uuid_text("") is None


# -- at most once a second -----------------------------------------------------------------


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_gpu_is_read_at_most_once_a_second():
    clock, asked = _Clock(), []

    def read(key):
        asked.append(key)
        return dict(H100, util=float(len(asked)))

    sampler = gpu.GpuSampler(read, clock=clock)
    assert sampler.get("a")["util"] == 1.0
    clock.now += 0.99
    assert sampler.get("a")["util"] == 1.0  # the cached reading
    clock.now += 0.01
    assert sampler.get("a")["util"] == 2.0
    assert sampler.get("b")["util"] == 3.0  # another GPU has its own reading
    assert asked == ["a", "a", "b"]


def test_a_shorter_interval_is_raised_to_a_second():
    clock, reads = _Clock(), []
    sampler = gpu.GpuSampler(lambda key: reads.append(key) or H100, clock=clock, interval=0.1)
    sampler.get("a")
    clock.now += 0.5
    sampler.get("a")
    assert len(reads) == 1


def test_the_metrics_stream_gets_each_reading_once():
    clock = _Clock()
    sampler = gpu.GpuSampler(lambda key: dict(H100), clock=clock)
    assert sampler.fresh("a") == H100
    assert sampler.fresh("a") is None  # the same reading: not sent twice
    clock.now += 1.0
    assert sampler.fresh("a") == H100


def test_a_gpu_that_cannot_be_read_has_no_figures():
    def broken(key):
        raise RuntimeError("driver went away")

    assert gpu.GpuSampler(broken, clock=_Clock()).get("a") is None


def test_point_values_leave_out_what_the_gpu_did_not_report():
    values = gpu.as_point_values(dict(H100, util=None))
    assert values == {
        "gpu_index": 3.0,
        "gpu_mem_mib": 40960.0,
        "gpu_mem_total_mib": 81920.0,
        "gpu_temp_c": 61.0,
    }
    assert gpu.as_point_values(None) == {}


@pytest.mark.skipif(not NO_GPU, reason="this machine has a GPU")
def test_without_a_gpu_nvml_reads_nothing_not_zeros():
    assert gpu.read_nvml(("index", 0)) is None
    assert gpu.read_this_rank() is None


# -- %dist_status --------------------------------------------------------------------------


def _row(rank, *, gpu_figures=None, host="node1"):
    row = dict(
        rank=rank,
        engine=rank,
        host=host,
        pid=100 + rank,
        device="cuda:0",
        backend="nccl",
        state="idle",
        memory_mib=812.0,
        died=None,
    )
    if gpu_figures is not None:
        row["gpu"] = gpu_figures
    return row


def test_status_shows_each_rank_s_gpu_and_which_ranks_share_one():
    other = dict(H100, index=1, uuid="GPU-other", util=None)
    text = format_status(
        [_row(0, gpu_figures=H100), _row(1, gpu_figures=H100), _row(2, gpu_figures=other)]
    )
    lines = text.splitlines()
    assert lines[0].split()[:8] == [
        *"rank host pid device backend state memory".split(),
        "gpu",
    ]
    assert "gpu util" in lines[0] and "gpu memory" in lines[0] and "gpu temp" in lines[0]
    assert "3 NVIDIA H100 80GB HBM3" in lines[1] and "87 %" in lines[1]
    assert "40.0/80.0 GiB" in lines[1] and "61 °C" in lines[1]
    assert "1 NVIDIA H100" in lines[3] and " ? " in lines[3]  # utilisation not reported
    assert lines[-1] == "ranks 0, 1 share GPU 3 on node1 (gpu figures are the whole GPU's)"


def test_status_has_no_gpu_column_when_no_rank_has_a_gpu():
    text = format_status([dict(_row(0), device="cpu"), dict(_row(1), device="cpu")])
    assert "gpu" not in text.lower()


def test_gpu_figures_read_as_a_user_expects():
    assert fmt_gpu_util(87.4) == "87 %" and fmt_gpu_util(None) == "?"
    assert fmt_gpu_temp(61.0) == "61 °C"
    assert fmt_gpu_memory(1228.8, 81920.0) == "1.2/80.0 GiB"
    assert fmt_gpu_memory(None, 81920.0) == "?/80.0 GiB"


# -- the dashboard and the sidebar's payload -------------------------------------------------


def _gpu_points(rank, util):
    values = gpu.as_point_values(dict(H100, util=util))
    return [
        (0, T0, {"loss": 1.0, "step_time": 0.1}),
        (1, T0 + 1, {"loss": 0.5, "step_time": 0.1, **values}),
    ]


def test_the_dashboard_has_gpu_panels_and_columns_when_ranks_report_a_gpu():
    run = Run(1, world_size=2, started=T0)
    run.add(0, _gpu_points(0, 80.0))
    run.add(1, _gpu_points(1, 90.0))
    model = DashboardModel(run, clock=lambda: T0 + 2)
    _, table = model.poll()
    panels = {p["id"]: p for p in model.snapshot()["panels"]}
    assert panels["gpu_util"]["title"] == "GPU utilisation (%)"
    assert panels["gpu_util"]["names"] == ["rank 0", "rank 1"]  # per GPU: no mean over ranks
    assert panels["gpu_util"]["data"][1] == [[1.0], [90.0]]  # seconds into the run, %
    assert "gpu_mem_mib" in panels and "loss" in panels and "gpu_index" not in panels
    headers = table["headers"]
    assert headers[6:10] == ["gpu", "gpu util", "gpu memory", "gpu temp"]
    assert headers[table["seen_col"]] == "last seen"
    assert table["rows"][1]["cells"][6:10] == ["3", "90 %", "40.0/80.0 GiB", "61 °C"]
    assert table["rows"][1]["cells"][table["seen_col"]] == ""  # ticked by the browser
    text = summary_text(run, now=T0 + 2)
    assert "gpu util" in text and "90 %" in text


def test_the_dashboard_shows_nothing_of_gpus_without_readings():
    run = Run(1, world_size=2, started=T0)
    for rank in (0, 1):
        run.add(rank, [(0, T0, {"loss": 1.0, "step_time": 0.1, "memory_mib": 300.0})])
    model = DashboardModel(run, clock=lambda: T0 + 2)
    _, table = model.poll()
    assert [p["id"] for p in model.snapshot()["panels"]] == ["loss"]
    assert not any("gpu" in h for h in table["headers"])
    assert table["headers"][table["seen_col"]] == "last seen"
    assert "gpu" not in summary_text(run, now=T0 + 2)


def _entry(history, run_id, ranks):
    return {
        "id": "c1",
        "history": history,
        "run_id": run_id,
        "owned": False,
        "ranks": [{"rank": r, "pid": None, "host": "node1", "device": "cuda:0"} for r in ranks],
    }


def test_the_sidebar_payload_carries_a_rank_s_gpu_only_when_it_has_one(tmp_path):
    path = str(tmp_path / "history.sqlite")
    store = RunStore(path)
    run = store.new_run(world_size=2, backend="nccl")
    store.append(run.id, 0, [list(p) for p in _gpu_points(0, 75.0)])
    store.append(run.id, 1, [[0, T0, {"loss": 1.0}]])  # a rank that reported no GPU
    store.commit()
    rows = LiveView(str(tmp_path)).rank_rows(_entry(path, run.id, [0, 1]))
    store.close()
    assert rows[0]["gpu"] == {
        "index": 3,
        "util": 75.0,
        "mem_used_mib": 40960.0,
        "mem_total_mib": 81920.0,
        "temp_c": 61.0,
        "time": T0 + 1,
    }
    assert "gpu" not in rows[1]


# -- a real session without GPUs: nothing GPU-related anywhere --------------------------------


@pytest.mark.skipif(not NO_GPU, reason="this machine has a GPU")
def test_a_cpu_session_shows_no_gpu_anywhere(tmp_path):
    history = str(tmp_path / "history.sqlite")
    with nbdist.DistSession(2, cpu=True, timeout=120, history=history) as s:
        s.run(
            "for i in range(3):\n    nbdist.log(step=i, loss=1.0 / (i + 1))\n"
            "from nbdist.metrics import gpu as _g\nseen = _g.read_this_rank()",
            sink=ListSink(),
        )
        assert s.pull("seen") == [None, None]
        # Asked on the control channel as %dist_status asks GPU ranks: a CPU rank has none.
        replies = control_request(s.client, [r.engine_id for r in s.ranks], "gpu", timeout=10)
        assert [reply["gpu"] for reply in replies] == [None, None]
        rows = s.status()
        assert all("gpu" not in row for row in rows)
        assert "gpu" not in format_status(rows).lower()
        model = DashboardModel(s.metrics_hub.run)
        _, table = model.poll()
        assert not any("gpu" in key for key in s.metrics_hub.run.keys())
        assert not any("gpu" in h for h in table["headers"])
        assert not any("gpu" in p["id"] for p in model.snapshot()["panels"])
        [cluster] = [c for c in LiveView().clusters() if c["run_id"] == s.metrics_hub.run.id]
        assert [r["step"] for r in cluster["ranks"]] == [2, 2]
        assert all("gpu" not in row for row in cluster["ranks"])
