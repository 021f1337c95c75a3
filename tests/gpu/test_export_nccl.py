"""An exported script under torchrun on real GPUs: NCCL, one process per GPU. Skipped without CUDA."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest
import torch

import nbdist
from nbdist.driver.export import export_script

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA GPUs")

CELLS = [
    "import os\n"
    "t = torch.ones(4, device=device) * (rank + 1)\n"
    "dist.all_reduce(t)\n"
    "nbdist.log(step=0, total=t.sum())",  # a CUDA tensor: converted at flush time
    "if rank == 0:\n"
    "    torch.save({'backend': dist.get_backend(), 'device': str(device),\n"
    "                'total': t.sum().item(), 'world': world_size},\n"
    "               os.environ['EXPORT_OUT'])",
]


def test_exported_script_uses_nccl_and_one_gpu_per_process(tmp_path):
    gpus = torch.cuda.device_count()
    script = export_script(CELLS, str(tmp_path / "gpu.py"), ranks=gpus)
    out, history = tmp_path / "out.pt", tmp_path / "history.sqlite"
    env = dict(os.environ, EXPORT_OUT=str(out), NBDIST_HISTORY=str(history))
    proc = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--standalone",
         "--nproc_per_node", str(gpus), script],
        env=env, text=True, start_new_session=True,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        output, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:  # torchrun and its workers: the group we started
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0, output[-3000:]
    result = torch.load(out)
    assert result["backend"] == "nccl"
    assert result["device"] == "cuda:0"  # rank 0 = local rank 0 = GPU 0
    assert result["world"] == gpus
    assert result["total"] == 4 * gpus * (gpus + 1) / 2
    frame = nbdist.runs(str(history))[-1].to_pandas()
    assert sorted(frame["rank"].unique()) == list(range(gpus))
    assert (frame["total"] == result["total"]).all()
