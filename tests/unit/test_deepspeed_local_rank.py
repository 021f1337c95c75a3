"""Which LOCAL_RANK ``apply_deepspeed`` gives DeepSpeed on a rank (kernel-free, no DeepSpeed).

DeepSpeed takes LOCAL_RANK for the index of the rank's GPU. On a GPU rank whose
local rank is not its GPU's index (two ranks sharing ``cuda:0``; GPUs picked with
``%dist_start --gpus``) it must be pointed at the rank's GPU; elsewhere left alone.
The GPU path itself runs in tests/gpu/test_integrations_gpu.py.
"""

from __future__ import annotations

import pytest
import torch

from nbdist.strategies.parallel.deepspeed_zero import gpu_local_rank


@pytest.mark.parametrize(
    ("device", "local_rank", "expected"),
    [
        # Two ranks sharing one GPU: rank 1 would ask DeepSpeed for cuda:1.
        ("cuda:0", "1", "0"),
        # %dist_start --gpus 2,3: local rank 0 runs on cuda:2.
        ("cuda:2", "0", "2"),
        # One rank per GPU, local rank i on GPU i: nothing to change.
        ("cuda:1", "1", None),
        # No LOCAL_RANK at all (a rank that no launcher set it for).
        ("cuda:0", None, "0"),
        # CPU ranks: DeepSpeed's CPU accelerator has no device index to match.
        ("cpu", "1", None),
    ],
)
def test_local_rank_names_the_ranks_gpu(device, local_rank, expected):
    assert gpu_local_rank(torch.device(device), local_rank) == expected


def test_a_cuda_device_without_an_index_is_left_alone():
    # "cuda" alone means the current device: there is no index to compare.
    assert gpu_local_rank(torch.device("cuda"), "1") is None
