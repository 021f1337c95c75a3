"""Pure logic of the data-parallel strategy helpers (no process group needed)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from nbdist.strategies.parallel import accumulation, syncbn
from nbdist.strategies.teaching import data_parallel_by_hand as by_hand
from nbdist.strategies.training import amp, evaluation


@pytest.mark.parametrize("length", [0, 1, 5, 1001])
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_blocks_cover_the_dataset_once_in_order(length, world):
    blocks = [list(evaluation.block_range(length, r, world)) for r in range(world)]
    assert sum(blocks, []) == list(range(length))
    assert max(map(len, blocks)) - min(map(len, blocks)) <= 1


def test_sequential_sampler_without_a_group_is_the_whole_dataset():
    assert list(evaluation.SequentialDistributedSampler(range(4))) == [0, 1, 2, 3]
    sampler = evaluation.SequentialDistributedSampler(7, rank=2, world_size=3)
    assert list(sampler) == [5, 6] and len(sampler) == 2


def test_bad_rank_is_refused_with_the_numbers():
    with pytest.raises(ValueError, match=r"rank 2 is not in range\(world_size=2\)"):
        evaluation.block_range(10, 2, 2)
    with pytest.raises(ValueError, match=r"rank 3 is not in range\(world_size=2\)"):
        by_hand.split_batch(torch.zeros(4), rank=3, world_size=2)


def test_split_batch_gives_contiguous_shares():
    X, Y = torch.arange(10).reshape(5, 2), torch.arange(5)
    x0, y0 = by_hand.split_batch(X, Y, rank=0, world_size=2)
    x1, y1 = by_hand.split_batch(X, Y, rank=1, world_size=2)
    assert y0.tolist() == [0, 1, 2] and y1.tolist() == [3, 4]
    assert torch.equal(torch.cat([x0, x1]), X)
    assert torch.equal(by_hand.split_batch(Y), Y)  # no process group: the whole batch
    with pytest.raises(ValueError, match=r"differ in length.*\[5, 4\]"):
        by_hand.split_batch(X, Y[:4], rank=0, world_size=2)


def test_collectives_need_a_process_group():
    with pytest.raises(RuntimeError, match="%dist_start"):
        by_hand.ring_all_reduce(torch.ones(3))


def test_sync_steps_are_the_last_of_each_group():
    assert [accumulation.is_sync_step(i, 4) for i in range(8)] == [False, False, False, True] * 2
    with pytest.raises(ValueError, match="every=0"):
        accumulation.is_sync_step(0, 0)


def test_accumulate_is_a_no_op_for_a_plain_module():
    model = nn.Linear(2, 1)
    with accumulation.accumulate(model, 0, every=4):
        model(torch.ones(1, 2)).sum().backward()
    assert model.weight.grad is not None
    with pytest.raises(TypeError, match="not a DistributedDataParallel model"):
        accumulation.AllReduceCounter(model)


def test_amp_picks_bf16_on_cpu_and_refuses_fp16_there():
    assert amp.pick_dtype("cpu") == torch.bfloat16
    assert amp.pick_dtype("cpu", prefer="bf16") == torch.bfloat16
    with pytest.raises(ValueError, match="fp16 autocast is for CUDA devices, not cpu"):
        amp.pick_dtype("cpu", prefer="fp16")
    with pytest.raises(ValueError, match="'int8' is not supported"):
        amp.pick_dtype("cpu", prefer="int8")
    assert not amp.grad_scaler("cpu").is_enabled()


def test_amp_autocast_runs_matmuls_in_bf16_on_cpu():
    layer = nn.Linear(4, 3)
    with amp.autocast("cpu"):
        out = layer(torch.randn(2, 4))
    assert out.dtype == torch.bfloat16
    assert layer.weight.dtype == torch.float32  # weights stay float32


def test_syncbn_without_a_group_is_batchnorm():
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4, momentum=None))
    model = syncbn.convert_sync_batchnorm(nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4)))
    model[1].momentum = None
    model.load_state_dict(ref.state_dict())
    assert isinstance(model[1], syncbn.SyncBatchNorm)
    x = torch.randn(6, 3)
    torch.testing.assert_close(model(x), ref(x))
    torch.testing.assert_close(model[1].running_var, ref[1].running_var)
    model.eval(), ref.eval()
    torch.testing.assert_close(model(x), ref(x))


def test_convert_keeps_parameters_and_state():
    bn = nn.BatchNorm2d(3)
    model = nn.Sequential(nn.Conv2d(1, 3, 3), nn.Sequential(bn)).eval()
    converted = syncbn.convert_sync_batchnorm(model, device="cpu")
    inner = converted[1][0]
    assert isinstance(inner, syncbn.SyncBatchNorm) and not inner.training
    assert inner.weight is bn.weight and inner.running_mean is bn.running_mean


def test_syncbn_refuses_wrong_channels():
    with pytest.raises(ValueError, match=r"SyncBatchNorm\(4\) got 3 channels"):
        syncbn.SyncBatchNorm(4)(torch.zeros(2, 3))
    with pytest.raises(TypeError, match="expects an nn.Module"):
        syncbn.convert_sync_batchnorm("bn")
