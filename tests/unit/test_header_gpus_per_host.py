"""The dashboard header counts GPUs per host: NVML's gpu_index numbers one host's GPUs."""

from __future__ import annotations

from nbdist.dashboard.header import header
from nbdist.dashboard.table import rank_rows
from nbdist.metrics.run import Run

T0 = 1_700_000_000.0


def test_the_same_gpu_index_on_two_hosts_is_two_gpus():
    # Two hosts of two GPUs; rank 4 shares host-a's GPU 0 with rank 0 (counted once).
    placed = {0: ("host-a", 0), 1: ("host-a", 1), 2: ("host-b", 0), 3: ("host-b", 1)}
    placed[4] = ("host-a", 0)
    run = Run(1, world_size=len(placed), started=T0)
    for rank, (host, index) in placed.items():
        run.hosts[rank] = host
        reading = {
            "gpu_index": float(index),
            "gpu_util": 50.0,
            "gpu_mem_mib": 1024.0,
            "gpu_mem_total_mib": 8192.0,
        }
        run.add(rank, [(0, T0, {"loss": 1.0, **reading})])
    h = header(run, rank_rows(run, now=T0))
    assert h["gpu"] == "4 GPUs: utilisation 50 % (mean) · memory 4.0/32.0 GiB"
