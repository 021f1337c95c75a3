"""GPU figures on a real GPU: ``%dist_status``, the metrics stream, the dashboard and the sidebar
name the rank's GPU as nvidia-smi does, and its memory in use grows by what the rank allocates.
Skipped without CUDA.
"""

from __future__ import annotations

import shutil
import subprocess
import time

import pytest
import torch

import nbdist
from nbdist.dashboard.model import DashboardModel
from nbdist.driver.sinks import ListSink
from nbdist.driver.status import format_status
from nbdist.server.sidebar_state import LiveView

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA GPUs")

GIB_MIB = 1024.0
# NVML counts memory in pages of the driver's; the caching allocator asks for exactly 1 GiB
# here (a multiple of its 2 MiB blocks), so the GPU's use grows by that, give or take a page run.
SLACK_MIB = 64.0


def _number(text: str) -> float | None:
    """nvidia-smi's reading, or None where it says the GPU does not report it ('[N/A]')."""
    try:
        return float(text)
    except ValueError:
        return None


def _smi_gpus() -> dict[str, tuple[int, str, float | None, float | None]]:
    """uuid -> (index, name, utilisation %, temperature C), as nvidia-smi reports them.

    Utilisation and temperature are None where nvidia-smi answers '[N/A]' (some GPUs in
    some modes): only then may nbdist's figures be missing too.
    """
    smi = shutil.which("nvidia-smi")
    if smi is None:
        pytest.skip("nvidia-smi is not installed")
    out = subprocess.run(
        [
            smi,
            "--query-gpu=index,uuid,name,utilization.gpu,temperature.gpu",
            "--format=csv,noheader,nounits",
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    gpus = {}
    for line in out.splitlines():
        index, uuid, rest = (part.strip() for part in line.split(",", 2))
        name, util, temp = (part.strip() for part in rest.rsplit(",", 2))
        gpus[uuid] = (int(index), name, _number(util), _number(temp))
    return gpus


def _gpu_row(session) -> dict:
    [row] = session.status()
    assert "gpu" in row, f"no GPU figures in %dist_status: {row}"
    return row["gpu"]


def _wait_for(read, accept, what: str, timeout: float = 30.0):
    # The figures are cached for a second on the rank: poll until a new reading shows the change.
    deadline = time.monotonic() + timeout
    value = read()
    while not accept(value):
        if time.monotonic() > deadline:
            pytest.fail(f"{what}: last seen {value}")
        time.sleep(0.25)
        value = read()
    return value


def test_status_names_the_gpu_and_sees_a_1_gib_allocation():
    smi = _smi_gpus()
    with nbdist.DistSession(1, timeout=300) as s:
        s.run(
            "import os\n"
            "props = torch.cuda.get_device_properties(device)\n"
            "mine = (props.name, os.environ.get('CUDA_VISIBLE_DEVICES'))\n",
            sink=ListSink(),
        )
        [(torch_name, mask)] = s.pull("mine")
        before = _gpu_row(s)
        # The same GPU as nvidia-smi calls it: its number and name, found by its UUID.
        assert before["uuid"] in smi, f"{before['uuid']} not among nvidia-smi's {list(smi)}"
        index, name, smi_util, smi_temp = smi[before["uuid"]]
        assert (before["index"], before["name"]) == (index, name)
        assert before["name"] == torch_name
        if mask is not None and mask.isdigit() and len(smi) == 1:
            assert before["index"] == int(mask)
        assert 0 < before["mem_used_mib"] < before["mem_total_mib"]
        # Where NVML answers (nvidia-smi reads it), nbdist must report it too, plausibly.
        if smi_util is not None:
            assert before["util"] is not None and 0 <= before["util"] <= 100, before
        if smi_temp is not None:
            assert before["temp_c"] is not None and 0 < before["temp_c"] < 120, before
            # The same sensor a moment apart: within 15 C of nvidia-smi's reading.
            assert abs(before["temp_c"] - smi_temp) <= 15, (before["temp_c"], smi_temp)
        text = format_status(s.status())
        assert f"{before['index']} {before['name']}" in text and "gpu memory" in text

        s.run(
            "x = torch.ones(2**30, dtype=torch.uint8, device=device)\ntorch.cuda.synchronize()",
            sink=ListSink(),
        )
        after = _wait_for(
            lambda: _gpu_row(s),
            lambda g: g["mem_used_mib"] >= before["mem_used_mib"] + GIB_MIB - SLACK_MIB,
            "the GPU's memory in use did not grow by 1 GiB",
        )
        assert after["mem_used_mib"] <= before["mem_used_mib"] + GIB_MIB + SLACK_MIB

        s.run("del x\ntorch.cuda.empty_cache()", sink=ListSink())
        _wait_for(
            lambda: _gpu_row(s),
            lambda g: g["mem_used_mib"] <= before["mem_used_mib"] + SLACK_MIB,
            "the GPU's memory in use did not shrink back after freeing 1 GiB",
        )


def test_logged_points_carry_the_gpu_to_the_dashboard_and_the_sidebar():
    with nbdist.DistSession(1, timeout=300) as s:
        # Logging for over two seconds: at least two GPU readings ride along, one a second at most.
        s.run(
            "import time\n"
            "x = torch.ones(2**30, dtype=torch.uint8, device=device)\n"
            "t0 = time.monotonic()\n"
            "i = 0\n"
            "while time.monotonic() - t0 < 2.5:\n"
            "    x.add_(1)\n"
            "    nbdist.log(step=i, loss=float(i))\n"
            "    i += 1\n"
            "    time.sleep(0.05)\n",
            sink=ListSink(),
        )
        run = s.metrics_hub.run
        _, used = run.series("gpu_mem_mib", 0)
        assert 2 <= len(used) < run.count(0)  # on some points only: one reading a second
        assert min(used) >= GIB_MIB
        [row] = s.status()
        assert run.last(0)["gpu_index"] == row["gpu"]["index"]

        model = DashboardModel(run)
        _, table = model.poll()
        assert {"gpu_util", "gpu_mem_mib"} <= {p["id"] for p in model.snapshot()["panels"]}
        gpu_col = table["headers"].index("gpu")
        assert table["rows"][0]["cells"][gpu_col] == str(row["gpu"]["index"])

        [cluster] = [c for c in LiveView().clusters() if c["run_id"] == run.id]
        payload = cluster["ranks"][0]["gpu"]
        assert payload["index"] == row["gpu"]["index"]
        assert payload["mem_used_mib"] >= GIB_MIB
        assert payload["mem_total_mib"] == pytest.approx(row["gpu"]["mem_total_mib"])
