"""LARS/LAMB against the papers' update rules, the LR scaling/warmup rules, state sizes."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from nbdist.strategies.optim.large_batch import (
    global_batch,
    scaled_lr,
    warmup_factor,
    warmup_schedule,
)
from nbdist.strategies.optim.optimizers import LAMB, LARS, exclude_bias_and_norm, state_bytes


def _grads(shape, steps, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g, dtype=torch.float64) for _ in range(steps)]


def _run(opt_cls, w0, grads, **kw):
    w = nn.Parameter(w0.clone())
    opt = opt_cls([w], **kw)
    for g in grads:
        w.grad = g.clone()
        opt.step()
    return w.detach()


def test_lars_follows_algorithm_1():
    w0 = torch.randn(5, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    grads = _grads((5, 3), 3)
    lr, m, wd, eta = 0.5, 0.9, 1e-2, 0.02
    # The paper's rule, written out independently.
    w, v = w0.clone(), torch.zeros_like(w0)
    for g in grads:
        local = eta * w.norm() / (g.norm() + wd * w.norm())
        v = m * v + lr * local * (g + wd * w)
        w = w - v
    got = _run(LARS, w0, grads, lr=lr, momentum=m, weight_decay=wd, eta=eta)
    torch.testing.assert_close(got, w)
    # Without the trust ratio it is SGD with momentum (torch's, dampening 0).
    plain = _run(LARS, w0, grads, lr=lr, momentum=m, weight_decay=wd, trust_ratio=False)
    sgd = _run(torch.optim.SGD, w0, grads, lr=lr, momentum=m, weight_decay=wd)
    torch.testing.assert_close(plain, sgd)


def test_lamb_follows_algorithm_2():
    w0 = torch.randn(4, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    grads = _grads((4, 6), 4, seed=3)
    lr, (b1, b2), eps, wd = 0.01, (0.9, 0.99), 1e-6, 0.1
    w, m, v = w0.clone(), torch.zeros_like(w0), torch.zeros_like(w0)
    for t, g in enumerate(grads, start=1):
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        r = (m / (1 - b1**t)) / ((v / (1 - b2**t)).sqrt() + eps)
        u = r + wd * w
        w = w - lr * (w.norm() / u.norm()) * u
    got = _run(LAMB, w0, grads, lr=lr, betas=(b1, b2), eps=eps, weight_decay=wd)
    torch.testing.assert_close(got, w)
    # Without the trust ratio it is AdamW.
    plain = _run(
        LAMB, w0, grads, lr=lr, betas=(b1, b2), eps=eps, weight_decay=wd, trust_ratio=False
    )
    adamw = _run(torch.optim.AdamW, w0, grads, lr=lr, betas=(b1, b2), eps=eps, weight_decay=wd)
    torch.testing.assert_close(plain, adamw)


def test_trust_ratio_makes_the_step_relative_to_the_weights():
    # Scaling a layer's weights by 100 scales its LAMB step by 100: layers move by
    # the same fraction of their size, whatever their scale.
    grads = _grads((8,), 1, seed=4)
    small = torch.full((8,), 0.01, dtype=torch.float64)
    step_small = small - _run(LAMB, small, grads, lr=0.1)
    step_large = 100 * small - _run(LAMB, 100 * small, grads, lr=0.1)
    torch.testing.assert_close(step_large, 100 * step_small)


def test_zero_weights_still_move():
    # A zero-initialised layer has ||w|| = 0: the ratio falls back to 1 instead of freezing it.
    grads = _grads((3,), 1)
    assert not torch.equal(_run(LAMB, torch.zeros(3, dtype=torch.float64), grads), torch.zeros(3))
    assert not torch.equal(_run(LARS, torch.zeros(3, dtype=torch.float64), grads), torch.zeros(3))


def test_bad_hyperparameters_name_the_value():
    p = [nn.Parameter(torch.zeros(2))]
    with pytest.raises(ValueError, match="eta=0"):
        LARS(p, eta=0)
    with pytest.raises(ValueError, match=r"betas=\(0.9, 1.0\)"):
        LAMB(p, betas=(0.9, 1.0))


def test_exclude_bias_and_norm_groups():
    model = nn.Sequential(nn.Linear(4, 3), nn.LayerNorm(3))
    groups = exclude_bias_and_norm(model, weight_decay=0.1)
    assert [len(g["params"]) for g in groups] == [1, 3]
    opt = LARS(groups, lr=0.1)
    assert [g["trust_ratio"] for g in opt.param_groups] == [True, False]
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]


def test_state_bytes_adafactor_is_far_smaller_than_adam():
    model = nn.Linear(256, 128, bias=False)
    model(torch.randn(4, 256)).sum().backward()
    adam = torch.optim.Adam(model.parameters())
    factor = torch.optim.Adafactor(model.parameters())
    assert state_bytes(adam) == 0  # state is created lazily, at the first step
    adam.step()
    factor.step()
    params = 256 * 128 * 4
    assert state_bytes(adam) == 2 * params + 4  # exp_avg, exp_avg_sq, step (float32 scalar)
    # Adafactor: one row and one column of second moments (+ a step counter).
    assert state_bytes(factor) < (256 + 128) * 4 + 16


def test_scaled_lr_rules():
    assert scaled_lr(0.1, 1024) == pytest.approx(0.4)
    assert scaled_lr(1e-3, 1024, rule="sqrt") == pytest.approx(2e-3)
    with pytest.raises(ValueError, match="'cubic'"):
        scaled_lr(0.1, 512, rule="cubic")
    with pytest.raises(ValueError, match="batch_size=0"):
        scaled_lr(0.1, 0)
    assert global_batch(64) == 64  # no process group: one rank
    assert global_batch(64, accumulation_steps=4) == 256


def test_warmup_then_cosine():
    f = [warmup_factor(s, warmup_steps=4) for s in range(6)]
    assert f == [0.0, 0.25, 0.5, 0.75, 1.0, 1.0]
    assert warmup_factor(0, warmup_steps=10, start=0.1) == pytest.approx(0.1)
    cos = [warmup_factor(s, warmup_steps=2, total_steps=6) for s in range(2, 7)]
    assert cos == pytest.approx(
        [1.0, 0.5 + 0.5 * math.cos(math.pi / 4), 0.5, 0.5 - 0.5 * math.cos(math.pi / 4), 0.0]
    )
    with pytest.raises(ValueError, match=r"total_steps \(5\)"):
        warmup_factor(0, warmup_steps=5, total_steps=5)


def test_warmup_schedule_drives_the_optimizer():
    p = nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=0.8)
    sched = warmup_schedule(opt, warmup_steps=4, start=0.0)
    lrs = []
    for _ in range(6):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert lrs == pytest.approx([0.0, 0.2, 0.4, 0.6, 0.8, 0.8])


def test_tensor_parallel_pairs_linears_and_names_the_indivisible_layer():
    from nbdist.strategies.parallel.tensor_parallel import linear_pairs

    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4), nn.Linear(4, 2))
    assert linear_pairs(model, 2) == (["0"], ["2"])  # the odd last layer stays whole
    with pytest.raises(ValueError, match=r"0.out_features \(7\) over 2 ranks"):
        linear_pairs(nn.Sequential(nn.Linear(4, 7), nn.Linear(7, 4)), 2)
    with pytest.raises(ValueError, match="at least two nn.Linear"):
        linear_pairs(nn.Sequential(nn.Linear(4, 4)), 2)


def test_find_blocks_takes_classes_names_and_submodules():
    from nbdist.strategies.parallel.checkpointing import find_blocks

    model = nn.Sequential(nn.Linear(2, 4), nn.Sequential(nn.ReLU(), nn.Linear(4, 2)))
    assert [n for n, _ in find_blocks(model, nn.Linear)] == ["0", "1.1"]
    assert [n for n, _ in find_blocks(model, (nn.ReLU, nn.Linear))] == ["0", "1.0", "1.1"]
    assert find_blocks(model, ["1.1", model[0]]) == [("1.1", model[1][1]), ("0", model[0])]
    assert find_blocks(model, model[1]) == [("1", model[1])]
    with pytest.raises(ValueError, match="apply_x: the model has no submodule of type"):
        find_blocks(model, nn.Conv2d, caller="apply_x")
    with pytest.raises(ValueError, match="no submodule named '2'"):
        find_blocks(model, ["2"])
    with pytest.raises(ValueError, match="Linear in blocks is not a submodule"):
        find_blocks(model, [nn.Linear(1, 1)])
    with pytest.raises(TypeError, match="blocks must be a module class"):
        find_blocks(model, 3)


def test_one_byte_count_serves_params_and_optimizer_state():
    from nbdist.strategies.measure import local_bytes
    from nbdist.strategies.parallel.fsdp import param_bytes
    from nbdist.strategies.parallel.tensor_parallel import local_param_bytes
    from nbdist.strategies.parallel.zero import optimizer_state_bytes

    model = nn.Linear(8, 4)  # 36 float32 parameters
    assert local_bytes([torch.zeros(3, dtype=torch.float64), "not a tensor", None]) == 24
    assert param_bytes(model) == (36 * 4, 36 * 4)  # unsharded: local == full
    assert local_param_bytes(model) == 36 * 4
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    assert optimizer_state_bytes(opt) == state_bytes(opt) == 2 * 36 * 4 + 2 * 4


def test_peak_bytes_sees_a_temporary_and_comm_bytes_ignores_local_ops():
    from nbdist.strategies.measure import CommBytes, peak_bytes

    def step():
        big = torch.ones(1024, 1024)  # 4 MiB, freed at return
        return float(big.sum())

    assert peak_bytes(step, resident=100) >= 100 + 4 * 2**20
    with CommBytes() as comm:
        torch.ones(10).sum()
    assert (comm.bytes, comm.ops) == (0, {})


def test_table_and_chart_show_every_rank():
    from nbdist.dashboard.plan_comparison import comparison_chart, comparison_table

    rows = [
        {
            "strategy": s,
            "samples_per_s": 100.0 * i + 1,
            "step_ms": 10.0,
            "peak_mib": [1.0, 2.0],
            "comm_mib": [0.5, 0.5],
            "comm_ops": {},
            "loss": 0.25,
        }
        for i, s in enumerate(("ddp", "fsdp"))
    ]
    df = comparison_table(rows)
    assert list(df.index) == ["ddp", "fsdp"]
    assert df.loc["fsdp", "peak MiB r1"] == 2.0 and "comm MiB/step r0" in df.columns
    fig = comparison_chart(rows)
    assert [t.name for t in fig.data] == ["all ranks", "rank 0", "rank 0", "rank 1", "rank 1"]


@pytest.mark.parametrize(
    ("seq_len", "world", "load_balance", "fits"),
    [
        # tests/gpu's 16 tokens over 2 ranks, load-balanced: chunks of 4 tokens, whose
        # log-sum-exp CUDA pads to 32: torch's merge fails, the ring runs.
        (16, 2, True, False),
        (128, 2, True, True),  # chunks of 32
        (128, 4, True, False),  # chunks of 16
        (128, 4, False, True),  # slices of 32, no halves
        (8192, 8, True, True),  # a long-context run: chunks of 512
        (48, 2, False, False),  # slices of 24 tokens, padded to 32
        (48, 1, True, True),  # one rank merges nothing
        (1, 2, True, False),  # fewer tokens than chunks
    ],
)
def test_torch_context_parallel_only_where_cudas_padded_log_sum_exp_fits(
    seq_len, world, load_balance, fits
):
    from nbdist.strategies.parallel.context_parallel import torch_path_fits

    assert torch_path_fits(seq_len, world, load_balance) is fits


@pytest.mark.parametrize(
    ("q_len", "blocks", "options"),
    [
        # Example 28's masks (blocks of 32 over 256 or 128 tokens): TorchInductor's 64 x 64
        # float32 tiles on an H100/H200 do not divide them, so the forward's are set.
        (256, (32, 32), {"fwd_BLOCK_M": 32, "fwd_BLOCK_N": 32}),
        (128, (32, 32), {"fwd_BLOCK_M": 32, "fwd_BLOCK_N": 32}),
        (4096, (64, 64), {"fwd_BLOCK_M": 64, "fwd_BLOCK_N": 64}),  # the H100 table has 128 x 32
        (1024, (48, 96), {"fwd_BLOCK_M": 16, "fwd_BLOCK_N": 32}),
        (4096, (128, 128), None),  # every tile divides 128: TorchInductor's choice stands
        (64, (32, 32), None),  # fewer than 128 queries: the decoding kernel, its own tiles
    ],
)
def test_flex_tiles_divide_the_masks_blocks_on_cuda(q_len, blocks, options):
    from nbdist.strategies.training.sparse_attention import flex_kernel_options

    got = flex_kernel_options(q_len, *blocks)
    assert got == options
    if got:
        assert blocks[0] % got["fwd_BLOCK_M"] == 0 and blocks[1] % got["fwd_BLOCK_N"] == 0
