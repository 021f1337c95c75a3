"""Strategy arguments that failed deep in torch or did the wrong thing quietly, in one process.

Each case is named as a user meets it: the error names the value and the fix,
before anything runs. Cases that need a process group get a one-rank gloo
group (``one_rank``); those that need two ranks are in
``tests/dist/test_strategies_compression.py``.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn


@pytest.fixture
def one_rank(tmp_path):
    """This process as the only rank of a gloo group, torn down after the test."""
    if dist.is_initialized():
        pytest.skip("a process group is already up in this process")
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


# -- refused before anything runs (with a group up, so that before the fix the call got as
# far as the user saw it get) ----------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        # Before: "autoplan(world_size=1) but the process group has 1 ranks" (the '1' unquoted).
        ({"world_size": "1"}, TypeError, r"autoplan: world_size='1' is str.*world_size=int\('1'\)"),
        # Before: "can't multiply sequence by non-int of type 'float'".
        ({"world_size": 1, "steps": 2.5}, TypeError, r"autoplan: steps=2.5 is no whole number"),
        ({"world_size": 1, "microbatches": 1.5}, TypeError, r"microbatches=1.5 is no whole"),
    ],
)
def test_autoplan_names_a_count_that_is_no_whole_number(kwargs, error, message, one_rank):
    from nbdist.strategies.plan.autoplan import autoplan

    with pytest.raises(error, match=message):
        autoplan(
            lambda: nn.Linear(2, 2), (torch.zeros(2, 2),) * 2, memory_per_rank="1 MiB", **kwargs
        )


@pytest.mark.parametrize("value", ["0 MiB", "1.2.3 GiB", ".", "0"])
def test_parse_bytes_refuses_zero_and_malformed_numbers_alike(value):
    from nbdist.strategies.plan.autoplan import parse_bytes

    # Before: "0 MiB" gave a budget of 0 (the number 0 is refused), and "1.2.3 GiB" a bare
    # "could not convert string to float" that named no argument.
    with pytest.raises(ValueError, match=rf"memory_per_rank='{value}': give bytes .*'512 MiB'"):
        parse_bytes(value)
    assert parse_bytes("1.5 KiB") == 1536 and parse_bytes(".5kb") == 500


def test_parse_bytes_takes_numpy_numbers():
    np = pytest.importorskip("numpy")
    from nbdist.strategies.plan.autoplan import parse_bytes

    assert parse_bytes(np.int64(2**20)) == 2**20


def test_fsdp_refuses_an_integer_param_dtype_by_name(one_rank):
    from nbdist.strategies.parallel.fsdp import apply_fsdp

    model = nn.Linear(2, 2)
    # Before: accepted, then "Only Tensors of floating point and complex dtype can require
    # gradients" at the first forward.
    with pytest.raises(TypeError, match=r"apply_fsdp: param_dtype=torch.int8 is no floating dtype"):
        apply_fsdp(model, param_dtype=torch.int8)
    with pytest.raises(TypeError, match=r"reduce_dtype=torch.int64 is no floating.*'bf16'"):
        apply_fsdp(model, reduce_dtype=torch.int64)
    assert type(model) is nn.Linear  # nothing wrapped


def test_parallel_dims_take_numpy_ints_and_check_model_names_a_zero_count():
    np = pytest.importorskip("numpy")
    from nbdist.strategies.parallel.mesh import ParallelDims

    # Before: "world_size must be an int, got np.int64(4)", though require_whole takes it.
    dims = ParallelDims(np.int64(4), tp=np.int64(2))
    assert (dims.world_size, dims.dp, dims.tp) == (4, 2, 2) and type(dims.tp) is int
    # Before: ZeroDivisionError.
    with pytest.raises(ValueError, match=r"check_model: n_microbatches=0 must be a count >= 1"):
        ParallelDims(1).check_model(batch=8, n_microbatches=0)
    with pytest.raises(
        TypeError, match=r"check_model: batch='8' is no count: pass batch=int\('8'\)"
    ):
        ParallelDims(1).check_model(batch="8")


def test_zero_optimizer_names_a_learning_rate_given_as_text(one_rank):
    from nbdist.strategies.parallel.zero import zero_optimizer

    # Before: "'<=' not supported between instances of 'float' and 'str'" from torch.
    with pytest.raises(TypeError, match=r"zero_optimizer: lr='1e-3' is str.*lr=float\('1e-3'\)"):
        zero_optimizer(nn.Linear(2, 2).parameters(), lr="1e-3")


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        # Before: accepted; the warm-up then never ended on a step count (steps == 2.5).
        ({"freeze_step": 2.5}, TypeError, r"OneBitAdam: freeze_step=2.5 is no whole number"),
        # Before: accepted, though torch.optim.Adam refuses a negative lr.
        ({"lr": -1.0}, ValueError, r"OneBitAdam: lr=-1.0 must be >= 0: pass e.g. lr=1.0"),
        (
            {"eps": float("nan")},
            ValueError,
            r"OneBitAdam: eps=nan must be >= 0: pass e.g. eps=1e-08",
        ),
        ({"weight_decay": -0.1}, ValueError, r"weight_decay=-0.1 must be >= 0"),
    ],
)
def test_onebit_adam_refuses_what_torch_adam_refuses(kwargs, error, message, one_rank):
    from nbdist.strategies.optim.onebit_adam import OneBitAdam

    with pytest.raises(error, match=message):
        OneBitAdam(nn.Linear(2, 2).parameters(), **kwargs)


def test_pipeline_schedule_names_a_loss_that_is_no_function(one_rank):
    from nbdist.strategies.parallel.pipeline import pipeline_schedule

    # Before: accepted here; torch calls it only at the last stage's first step.
    # (None stays torch's forward-only schedule.)
    with pytest.raises(TypeError, match=r"pipeline_schedule: loss_fn='mse' is no function"):
        pipeline_schedule(nn.Sequential(nn.Linear(2, 2)), n_microbatches=2, loss_fn="mse")


# -- one rank: a gloo process group of world size 1 ----------------------------------


def test_device_mesh_refuses_a_fractional_size(one_rank):
    from nbdist.strategies.parallel.tensor_parallel import device_mesh

    # Before: int(1.5) made it a mesh of 1 without a word.
    with pytest.raises(
        TypeError, match=r"device_mesh: shape=\(1.5,\) must hold whole numbers.*\(1,\)"
    ):
        device_mesh((1.5,))


def test_powersgd_refuses_the_default_ddp_whose_first_bucket_is_1_mib(one_rank):
    from torch.nn.parallel import DistributedDataParallel as DDP

    from nbdist.strategies.optim.compression import apply_comm_hook

    # 3.0 MiB of gradients: under the 25 MiB cap, over DDP's 1 MiB first bucket. Before:
    # accepted, and on 2 ranks gloo aborted after the plain steps (two buckets).
    with pytest.raises(
        ValueError,
        match=r"3.0 MiB over DDP's first bucket of 1 MiB \(bucket_cap_mb unset\).*"
        r"DistributedDataParallel\(model, bucket_cap_mb=5\)",
    ):
        apply_comm_hook(DDP(nn.Linear(1024, 768)), "powersgd", start_iter=2)
    # The advice is taken: one bucket (its training on 2 ranks is in tests/dist).
    apply_comm_hook(DDP(nn.Linear(1024, 768), bucket_cap_mb=5), "powersgd", start_iter=2)
    # Under 1 MiB the default DDP is one bucket, as before.
    apply_comm_hook(DDP(nn.Linear(256, 256)), "powersgd", start_iter=2)


def _frozen_first_layer() -> nn.Sequential:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    model[0].requires_grad_(False)
    return model


def _train(model, opt, steps: int) -> None:
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(16, 4, generator=g), torch.randn(16, 1, generator=g)
    for _ in range(steps):
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()


def test_onebit_adam_leaves_frozen_weights_alone_and_equals_adamw(one_rank):
    from nbdist.strategies.optim.onebit_adam import apply_onebit_adam

    model = _frozen_first_layer()
    ref = copy.deepcopy(model)
    frozen = [p.detach().clone() for p in model[0].parameters()]
    opt = apply_onebit_adam(model, lr=1e-2, weight_decay=0.1, freeze_step=100)
    _train(model, opt, 20)
    _train(ref, torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1), 20)
    # Before: weight decay shrank the frozen layer (max change 0.009 here).
    assert all(torch.equal(a, b) for a, b in zip(frozen, model[0].parameters()))
    # The trainable layer still follows torch's AdamW (frozen ones it skips too).
    for a, b in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


def test_onebit_lamb_leaves_frozen_weights_alone_past_the_warmup(one_rank):
    from nbdist.strategies.optim.onebit_lamb import apply_onebit_lamb

    model = _frozen_first_layer()
    frozen = [p.detach().clone() for p in model[0].parameters()]
    trained = model[1].weight.detach().clone()
    opt = apply_onebit_lamb(model, lr=1e-2, weight_decay=0.1, freeze_step=5)
    _train(model, opt, 12)  # warm-up, then compressed steps
    # Before: moved by 0.087 (weight decay through a zero gradient).
    assert all(torch.equal(a, b) for a, b in zip(frozen, model[0].parameters()))
    assert not torch.equal(trained, model[1].weight)
    assert opt.steps == 12 and opt.compressing


def test_onebit_adam_names_a_layer_unfrozen_after_the_warmup(one_rank):
    from nbdist.strategies.optim.onebit_adam import apply_onebit_adam

    model = _frozen_first_layer()
    opt = apply_onebit_adam(model, lr=1e-2, freeze_step=3)
    _train(model, opt, 4)
    model[0].requires_grad_(True)
    # Its variance was never gathered: a step of lr / eps. Before: frozen layers had state
    # (zero gradients) and took that step silently.
    late = r"OneBitAdam: 2 parameter\(s\) .*\(4, 4\)\) became trainable after the warm-up"
    with pytest.raises(ValueError, match=late + r" \(freeze_step=3\).*unfreeze them before"):
        _train(model, opt, 1)
    assert opt.steps == 4
