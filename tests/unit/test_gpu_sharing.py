"""Ranks sharing a GPU: the words the user reads, and the guard strategies run first.

Without a GPU the guard is exercised on the ``meta`` device, where gloo runs
no collective at all: the probe must name each one, and a strategy must stop
before it starts with an error naming itself, the collective and the fixes.
(tests/gpu covers real sharing on a GPU.)
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from nbdist.driver.group import gloo_on_gpu_reason
from nbdist.engine import backend_support
from nbdist.launch.placement import plan_local
from nbdist.strategies.parallel.fsdp import apply_fsdp


@pytest.fixture
def one_rank_group(tmp_path, monkeypatch):
    """A real gloo process group of world size 1 in this process."""
    monkeypatch.delenv("NCCL_MULTI_RANK_GPU_ENABLE", raising=False)
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield
    finally:
        backend_support.probe("cpu")  # leave nothing marked missing for other tests
        dist.destroy_process_group()


def test_probe_names_every_collective_gloo_cannot_run_on_the_device(one_rank_group):
    assert backend_support.probe("cpu") == {}
    lacking = backend_support.probe("meta", context="a test asked for it")
    # send/recv needs a second rank; the other five are tried and all fail on meta.
    assert set(lacking) == set(backend_support.COLLECTIVES) - {"send/recv"}
    assert backend_support.missing() == lacking


def test_a_strategy_stops_before_it_starts_naming_itself_and_the_fix(one_rank_group):
    backend_support.probe("meta", context="ranks 0,1 share GPU 0")
    with pytest.raises(backend_support.StrategyUnavailable) as info:
        apply_fsdp(torch.nn.Linear(2, 2), blocks=[])
    message = str(info.value)
    assert message.startswith("FSDP2 (apply_fsdp) needs all_gather_into_tensor, reduce_scatter")
    assert "because ranks 0,1 share GPU 0" in message
    assert "--cpu" in message and "NCCL >= 2.30" in message and "one rank per GPU" in message


def test_the_reason_given_to_ranks_says_why_gloo_runs_on_a_gpu(monkeypatch):
    monkeypatch.delenv("NCCL_MULTI_RANK_GPU_ENABLE", raising=False)
    shared = plan_local(2, gpus_visible=[3], cores=2, nccl=lambda: (2, 29, 3))
    assert gloo_on_gpu_reason(shared) == (
        "ranks 0,1 share GPU 3 and this torch's NCCL (2.29.3) cannot put two ranks "
        "on one GPU (2.30 can)"
    )
    asked = plan_local(1, gpus_visible=[0], cores=2, backend="gloo")
    assert gloo_on_gpu_reason(asked) == "--backend gloo was asked for"
    assert gloo_on_gpu_reason(plan_local(2, gpus_visible=[], cores=2)) == ""
    over_nccl = plan_local(2, gpus_visible=[0], cores=2, nccl=lambda: (2, 30, 7))
    assert gloo_on_gpu_reason(over_nccl) == ""


def test_a_cuda_out_of_memory_names_the_machine_wide_gpu_and_who_shares_it():
    from nbdist.driver.oom import cuda_oom_note
    from nbdist.errors import RankFailure

    oom = RankFailure(rank=1, ename="OutOfMemoryError", evalue="CUDA out of memory.", traceback="")
    other = RankFailure(rank=0, ename="ValueError", evalue="bad", traceback="")
    shared = plan_local(2, gpus_visible=[3], cores=2, nccl=lambda: (2, 30, 7))
    note = cuda_oom_note([other, oom], shared)
    assert note.startswith("rank 1 ran out of memory on GPU 3 (cuda:0), shared with rank 0: ")
    assert "torch.cuda.empty_cache()" in note and "the next cell runs" in note
    own = plan_local(2, gpus_visible=[4, 6], cores=2)
    assert cuda_oom_note([oom], own).startswith("rank 1 ran out of memory on GPU 6 (cuda:1): ")
    assert cuda_oom_note([oom], plan_local(2, gpus_visible=[], cores=2)) == ""
    assert cuda_oom_note([other], own) == ""
