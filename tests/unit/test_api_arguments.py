"""Bad arguments to nbdist's public API, as a user passes them: one clear error, nothing done.

Each case is something a user plausibly writes (a state_dict where the model goes,
a float parameter count, a checkpoint's own directory where its parent goes...).
The error must name the value and the fix, and come before any side effect: no
file written, no module half wrapped. Cases that need several ranks are in
``tests/dist/test_api_arguments_dist.py``.
"""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

from nbdist.checkpoint import CheckpointError, latest, load, resume, save


def _net(width: int = 4, depth: int = 1) -> nn.Sequential:
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(depth)])


# -- nbdist.checkpoint ---------------------------------------------------------


def test_load_into_a_model_of_other_sizes_names_the_parameter(tmp_path):
    save(tmp_path / "step_1", model=_net(4), step=1)
    wider = _net(8)
    before = [p.detach().clone() for p in wider.parameters()]
    # Before: torch's CheckpointException, a BaseException that `except Exception` misses.
    with pytest.raises(CheckpointError, match=r"'0.weight' is \[4, 4\] there and \[8, 8\] here"):
        load(tmp_path / "step_1", model=wider)
    assert all(torch.equal(a, b) for a, b in zip(before, wider.parameters()))


def test_load_into_a_model_of_other_layers_is_refused(tmp_path):
    save(tmp_path / "step_1", model=_net(4, depth=2), step=1)
    # Before: the first layer loaded and the second was silently left as built.
    with pytest.raises(CheckpointError, match=r"'1.weight', '1.bias' are in the checkpoint but"):
        load(tmp_path / "step_1", model=_net(4, depth=1))
    with pytest.raises(CheckpointError, match=r"'2.weight', '2.bias' are not in the checkpoint"):
        load(tmp_path / "step_1", model=_net(4, depth=3))


def test_resume_given_one_checkpoint_says_to_pass_its_parent(tmp_path):
    model = _net()
    save(tmp_path / "step_20", model=model, step=20)
    # Before: 0, i.e. training silently started over.
    with pytest.raises(CheckpointError, match=r"is one checkpoint.*pass its parent"):
        resume(tmp_path / "step_20", model=model)
    assert resume(tmp_path, model=model) == 20


def test_latest_of_a_file_is_refused(tmp_path):
    (tmp_path / "model.pt").write_bytes(b"")
    with pytest.raises(CheckpointError, match="is a file"):
        latest(tmp_path / "model.pt")
    assert latest(tmp_path / "not_yet") is None  # no checkpoint yet: start afresh


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"model": _net().state_dict()}, r"model= takes the model itself, not its state_dict"),
        ({"model": nn.Linear}, r"model=Linear is a class"),
        ({"model": "net"}, r"model= must be a torch.nn.Module.*got str"),
        (
            {"model": _net(), "optimizer": {"state": {}, "param_groups": []}},
            r"optimizer= takes the optimizer itself",
        ),
    ],
)
def test_save_and_load_refuse_what_is_no_model(tmp_path, kwargs, message):
    # Before: TypeError: unhashable type / Module.named_children() missing 'self'.
    with pytest.raises(CheckpointError, match=message):
        save(tmp_path / "c", step=1, **kwargs)
    assert not os.path.exists(tmp_path / "c")
    save(tmp_path / "ok", model=_net(), optimizer=None, step=1)
    with pytest.raises(CheckpointError, match=message):
        load(tmp_path / "ok", **kwargs)


def test_save_where_a_file_is_names_the_path(tmp_path):
    (tmp_path / "ckpt").write_text("not a directory")
    with pytest.raises(CheckpointError, match=r"cannot be written \(a file of that name exists\)"):
        save(tmp_path / "ckpt", model=_net(), step=1)
    with pytest.raises(CheckpointError, match=r"ckpt/step_1' cannot be written"):
        save(tmp_path / "ckpt" / "step_1", model=_net(), step=1)
    assert (tmp_path / "ckpt").read_text() == "not a directory"


# -- nbdist.metrics: FLOP helpers ---------------------------------------------


def test_transformer_flops_takes_a_float_parameter_count():
    from nbdist.metrics import transformer_flops

    # Before: AttributeError: 'float' object has no attribute 'parameters'.
    assert (
        transformer_flops(124e6, 1024) == transformer_flops(124_000_000, 1024) == 6 * 124e6 * 1024
    )
    assert isinstance(transformer_flops(124_000_000, 1024.0), int)


@pytest.mark.parametrize(
    "args, kwargs, error, message",
    [
        (("124M", 1024), {}, TypeError, r"params='124M': give a whole number >= 1 \(the parameter"),
        ((124_000_000, -8), {}, ValueError, r"tokens=-8: give a whole number >= 1"),
        ((124_000_000, "1024"), {}, TypeError, r"tokens='1024'"),
        ((124_000_000, 1024), {"layers": -1}, ValueError, r"layers=-1"),
        ((124_000_000, 1024), {"layers": 12}, ValueError, r"layers, seq_len and width together"),
    ],
)
def test_transformer_flops_refuses_what_is_no_count(args, kwargs, error, message):
    from nbdist.metrics import transformer_flops

    # Before: a negative count, or attention silently left out for layers= alone.
    with pytest.raises(error, match=message):
        transformer_flops(*args, **kwargs)


def test_set_peak_refuses_text_and_infinity_and_keeps_the_old_peak():
    import nbdist.metrics as metrics

    try:
        metrics.set_peak(2.5)
        with pytest.raises(TypeError, match=r"got '312': give TFLOP/s as a number"):
            metrics.set_peak("312")
        with pytest.raises(ValueError, match="got inf"):
            metrics.set_peak(float("inf"))
        # Before: the peak became 100 although the call raised for its dtype.
        with pytest.raises(ValueError, match="dtype 'int8'"):
            metrics.set_peak(100, dtype="int8")
        assert metrics.device_peak("cpu").tflops == 2.5
    finally:
        metrics.set_peak()


@pytest.mark.parametrize("model", [None, nn.Linear(4, 2).state_dict(), nn.Linear])
def test_flops_per_step_refuses_what_is_no_model(model):
    from nbdist.metrics import flops_per_step

    with pytest.raises(TypeError, match=r"flops_per_step: model must be a torch.nn.Module"):
        flops_per_step(model, torch.ones(3, 4))


# -- nbdist.seed_all -----------------------------------------------------------


@pytest.mark.parametrize("seed", ["abc", None, 1.5])
def test_seed_all_refuses_what_is_no_whole_number(seed):
    import nbdist

    state = torch.random.get_rng_state()
    # Before: int()'s message without the name, or 1.5 silently seeded as 1.
    with pytest.raises(TypeError, match=r"seed_all: seed=.* is not a whole number"):
        nbdist.seed_all(seed)
    assert torch.equal(torch.random.get_rng_state(), state)


def test_seed_all_takes_the_seed_as_text_and_refuses_one_torch_cannot():
    import nbdist

    assert nbdist.seed_all("7") == nbdist.seed_all(7) == 7  # e.g. os.environ["SEED"]
    with pytest.raises(ValueError, match=r"seed_all: seed=\d+ is out of range"):
        nbdist.seed_all(2**70)


# -- nbdist.strategies.parallel: checked before any collective or change ---------


class _Mlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(4, 8), nn.Linear(8, 4)

    def forward(self, x):
        return self.fc2(self.fc1(x))


def test_tensor_parallel_layer_names_given_as_one_string_are_refused():
    from nbdist.strategies.parallel.mesh import ParallelDims
    from nbdist.strategies.parallel.parallelize import parallelize
    from nbdist.strategies.parallel.tensor_parallel import apply_tp

    # Before: the string was split into letters ("no submodule named 'f'").
    with pytest.raises(
        TypeError, match=r"apply_tp: colwise='fc1' is one string.*colwise=\['fc1'\]"
    ):
        apply_tp(_Mlp(), None, colwise="fc1", rowwise=["fc2"])
    with pytest.raises(TypeError, match=r"parallelize: rowwise='fc2' is one string"):
        parallelize(_Mlp(), ParallelDims(1), colwise=["fc1"], rowwise="fc2")
    with pytest.raises(TypeError, match=r"colwise holds Linear"):
        model = _Mlp()
        apply_tp(model, None, colwise=[model.fc1], rowwise=["fc2"])


@pytest.mark.parametrize(
    "call",
    [
        "apply_fsdp(model)",
        "apply_ac(model, blocks=nn.Linear)",
        "apply_tp(model, None, colwise=['fc1'])",
        "parallelize(model, ParallelDims(1))",
    ],
)
@pytest.mark.parametrize("model", [_Mlp, _Mlp().state_dict(), "model"])
def test_strategies_refuse_what_is_no_model(call, model):
    from nbdist.strategies.parallel.checkpointing import apply_ac  # noqa: F401
    from nbdist.strategies.parallel.fsdp import apply_fsdp  # noqa: F401
    from nbdist.strategies.parallel.mesh import ParallelDims  # noqa: F401
    from nbdist.strategies.parallel.parallelize import parallelize  # noqa: F401
    from nbdist.strategies.parallel.tensor_parallel import apply_tp  # noqa: F401

    # Before: AttributeError ('str' object has no attribute 'modules') or worse.
    with pytest.raises(TypeError, match=r": model must be a torch.nn.Module; "):
        eval(call, {**globals(), **locals()})


def test_fsdp_takes_a_dtype_by_its_short_name_and_refuses_others():
    from nbdist.strategies.arguments import as_dtype
    from nbdist.strategies.parallel.fsdp import apply_fsdp

    assert as_dtype("bf16", "param_dtype", "apply_fsdp") is torch.bfloat16
    # Before: accepted, then "Invalid device string: 'int8'" at the first forward.
    with pytest.raises(TypeError, match=r"apply_fsdp: param_dtype='int8' is no floating dtype"):
        apply_fsdp(_Mlp(), param_dtype="int8")


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        (
            {"buffers": torch.zeros(2, 8), "seq_dims": [1]},
            TypeError,
            r"buffers= takes a list of tensors, got Tensor: write buffers=\[x\]",
        ),
        ({"buffers": [torch.zeros(2, 8)], "seq_dims": 1}, TypeError, r"write seq_dims=\[1\]"),
        (
            {"buffers": [torch.zeros(2, 8)], "seq_dims": [2]},
            ValueError,
            r"buffer 0 has shape \(2, 8\): its sequence dim 2 is none of its dimensions",
        ),
    ],
)
def test_context_parallel_names_a_bad_buffer_before_touching_any(kwargs, error, message):
    from nbdist.strategies.parallel.context_parallel import context_parallel

    # Before: "2 buffers, 1 seq_dims" for one tensor, IndexError for a dim out of range.
    with pytest.raises(error, match=message):
        with context_parallel(**kwargs):
            pass


# -- nbdist.DistSession (checked before anything starts) --------------------------


@pytest.mark.parametrize("history", [123, ["runs.db"], ""])
def test_session_history_that_is_no_path_is_refused(history):
    import nbdist
    from nbdist.errors import PlacementError

    # Before: accepted, and the history silently went to the default location.
    with pytest.raises(PlacementError, match=r"history=.*: give a file path for the run history"):
        nbdist.DistSession(2, cpu=True, history=history)


@pytest.mark.parametrize("cpu", ["no", "yes", 2, None])
def test_session_cpu_that_is_no_truth_value_is_refused(cpu):
    import nbdist
    from nbdist.errors import PlacementError

    # Before: cpu="no" was true (a non-empty string) and started CPU ranks.
    with pytest.raises(
        PlacementError, match=rf"cpu {cpu!r}: give True \(CPU ranks, gloo\) or False"
    ):
        nbdist.DistSession(2, cpu=cpu)


# -- nbdist.integrations -----------------------------------------------------------


def test_lightning_kwargs_outside_a_job_say_where_to_call_them(monkeypatch):
    from nbdist.integrations import lightning_trainer_kwargs

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("RANK", raising=False)
    # Before: KeyError: 'WORLD_SIZE'.
    with pytest.raises(RuntimeError, match=r"call it on the ranks, in a %%on_all_ranks cell"):
        lightning_trainer_kwargs()


# -- nbdist.strategies.plan: a function that builds the model, not the model ---------


def _batch():
    return torch.ones(4, 4), torch.ones(4, 4)


@pytest.mark.parametrize(
    "call, message",
    [
        (
            "autoplan(nn.Linear(4, 4), _batch(), world_size=1, memory_per_rank='1 GB')",
            r"autoplan: model_fn must build the model .*got a Linear instance.*model_fn=lambda",
        ),
        (
            "compare(nn.Linear(4, 4), lambda step, rank: _batch(), strategies=['ddp'])",
            r"compare: build_model must build the model .*got a Linear instance",
        ),
        ("build_plan(nn.Linear(4, 4), Plan(1))", r"build_plan: build_model must build the model"),
        (
            "compare(lambda: nn.Linear(4, 4), lambda step, rank: _batch(), strategies='ddp')",
            r"strategies='ddp' is one string; give a list, e.g. strategies=\['ddp'\]",
        ),
        (
            "model_facts(lambda: nn.Linear(4, 4), torch.ones(2, 4))",
            r"batch must be \(inputs, targets\), a pair of tensors, got Tensor of shape \(2, 4\)",
        ),
    ],
)
def test_planners_refuse_a_model_where_its_builder_goes(call, message):
    from nbdist.strategies.plan.autoplan import autoplan  # noqa: F401
    from nbdist.strategies.plan.build import Plan, build_plan  # noqa: F401
    from nbdist.strategies.plan.compare import compare  # noqa: F401
    from nbdist.strategies.plan.estimate import model_facts  # noqa: F401

    # Before: "Linear.forward() missing 1 required positional argument" (the model was
    # called as its own builder), strategies split into ('d', 'd', 'p'), and one tensor
    # silently unpacked along its rows as (inputs, targets).
    with pytest.raises(TypeError, match=message):
        eval(call, {**globals(), **locals()})


# -- nbdist.strategies.training.sparse_attention ------------------------------------


def test_block_sparse_layout_must_cover_the_sequence():
    from nbdist.strategies.training.sparse_attention import block_mask, block_sparse

    layout = torch.ones(2, 2, dtype=torch.bool)
    assert block_mask(block_sparse(layout, 32), 64, block_size=32) is not None
    assert block_mask(block_sparse(layout, 32), 50, block_size=32) is not None  # a partial block
    # A layout for longer sequences serves a shorter one by its first blocks.
    assert block_mask(block_sparse(layout, 32), 32, block_size=32) is not None
    # Before: accepted, every position past the layout attending as its last block does.
    with pytest.raises(ValueError, match=r"layout is 2 x 2 blocks of 32 tokens, but 128 queries"):
        block_mask(block_sparse(layout, 32), 128, block_size=32)
    # Before: accepted, then ZeroDivisionError inside create_block_mask.
    with pytest.raises(ValueError, match=r"block_sparse: block_size must be a whole number >= 1"):
        block_sparse(layout, 0)


# -- numbers given as text (a config file, argparse) --------------------------------


@pytest.mark.parametrize(
    "call, message",
    [
        ("sliding_window('8')", r"sliding_window: window='8' is str, not a number"),
        ("is_sync_step(0, '4')", r"accumulate: every='4' is str, not a number"),
        ("scaled_lr('0.1', 1024)", r"scaled_lr: base_lr='0.1' is str, not a number"),
    ],
)
def test_numbers_given_as_text_are_named(call, message):
    from nbdist.strategies.optim.large_batch import scaled_lr  # noqa: F401
    from nbdist.strategies.parallel.accumulation import is_sync_step  # noqa: F401
    from nbdist.strategies.training.sparse_attention import sliding_window  # noqa: F401

    # Before: "'<' not supported between instances of 'str' and 'int'", naming nothing.
    with pytest.raises(TypeError, match=message):
        eval(call, {**globals(), **locals()})


def test_sliding_window_refuses_a_fractional_window():
    from nbdist.strategies.training.sparse_attention import sliding_window

    # Before: accepted (a window of 1.5 tokens).
    with pytest.raises(ValueError, match=r"sliding_window needs whole numbers .*window=1.5"):
        sliding_window(1.5)


# -- optimizers: the parameters, not the model ---------------------------------------


@pytest.mark.parametrize(
    "call, message",
    [
        ("LAMB(model)", r"LAMB: params takes the model's parameters, got the Linear model itself"),
        ("LARS(model)", r"LARS: params takes the model's parameters"),
        ("OneBitAdam(model)", r"OneBitAdam: params takes the model's parameters"),
        ("zero_optimizer(model)", r"zero_optimizer: params takes the model's parameters"),
        ("LAMB(model.parameters(), lr='1e-3')", r"LAMB: lr='1e-3' is str.*lr=float\('1e-3'\)"),
        (
            "warmup_schedule(model, warmup_steps=10)",
            r"warmup_schedule: optimizer must be a torch.optim.Optimizer, got a Linear",
        ),
    ],
)
def test_optimizers_refuse_the_model_where_its_parameters_go(call, message):
    from nbdist.strategies.optim.large_batch import warmup_schedule  # noqa: F401
    from nbdist.strategies.optim.onebit_adam import OneBitAdam  # noqa: F401
    from nbdist.strategies.optim.optimizers import LAMB, LARS  # noqa: F401
    from nbdist.strategies.parallel.zero import zero_optimizer  # noqa: F401

    model = nn.Linear(2, 2)  # noqa: F841 - used by the call
    # Before: "'Linear' object is not iterable" (as torch.optim says), or an AttributeError.
    with pytest.raises(TypeError, match=message):
        eval(call, {**globals(), **locals()})


def test_checkpoint_takes_numpy_numbers_for_step_and_extra_values(tmp_path):
    np = pytest.importorskip("numpy")
    # Before: "step=np.int64(5): give a whole number" and "extra value best=float32:
    # give a number", refusing numbers.
    save(tmp_path / "c", model=_net(), step=np.int64(5), best=np.float32(0.5))
    info = load(tmp_path / "c", model=_net())
    assert info == {"step": 5, "best": 0.5}
    with pytest.raises(CheckpointError, match=r"step=2.5: give a whole number >= 0"):
        save(tmp_path / "d", model=_net(), step=2.5)


@pytest.mark.parametrize(
    "call, error, message",
    [
        ("split_sequential(_net(depth=2), '2')", TypeError, r"n_stages='2' is str.*int\('2'\)"),
        ("bubble_fraction(0, 4)", ValueError, r"bubble_fraction needs n_stages >= 1"),
        # A count: 2.5 stages gave an idle share for a pipeline that cannot exist.
        ("bubble_fraction(2.5, 4)", TypeError, r"n_stages=2.5 is no whole number.*n_stages=2"),
        ("split_sequential(_net(depth=2), 2.5)", TypeError, r"n_stages=2.5 is no whole number"),
        ("prepare_once(tmp_path / 'x.pt', 5)", TypeError, r"prepare_once: build, save and load"),
        ("rank_zero_only(5)", TypeError, r"rank_zero_only decorates a function, got int"),
    ],
)
def test_pipeline_and_chores_name_a_bad_argument(tmp_path, call, error, message):
    from nbdist.strategies.parallel.pipeline import bubble_fraction, split_sequential  # noqa: F401
    from nbdist.strategies.training.practical import prepare_once, rank_zero_only  # noqa: F401

    # Before: str/int comparison errors, a negative idle share, "'int' object is not
    # callable" on rank 0 alone, and a decorator that failed only when called.
    with pytest.raises(error, match=message):
        eval(call, {**globals(), **locals()})
    assert not (tmp_path / "x.pt").exists()


def test_activation_checkpointing_twice_is_refused():
    from nbdist.strategies.parallel.checkpointing import apply_ac

    model = apply_ac(_net(depth=2), blocks=nn.Linear)
    # Before: accepted, each block checkpointed inside its checkpoint (a cell run twice).
    with pytest.raises(ValueError, match=r"apply_ac: the model has checkpointed blocks already"):
        apply_ac(model, blocks=nn.Linear)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"lr": "1e-3"}, r"lr='1e-3' is str"),
        ({"freeze_step": "10"}, r"freeze_step='10' is str.*freeze_step=int\('10'\)"),
    ],
)
def test_onebit_adam_names_numbers_given_as_text(kwargs, message):
    from nbdist.strategies.optim.onebit_adam import apply_onebit_adam

    # Before: lr='1e-3' accepted (failing at the first step), freeze_step a str/int error.
    with pytest.raises(TypeError, match=rf"OneBitAdam: {message}"):
        apply_onebit_adam(nn.Linear(2, 2), **kwargs)


# -- nbdist.runs ----------------------------------------------------------------------


def test_runs_names_a_path_that_is_no_history(tmp_path):
    import nbdist

    (tmp_path / "notes.txt").write_text("not a database")
    # Before: sqlite3's "disk I/O error" / "file is not a database", and [] for a number.
    with pytest.raises(ValueError, match=r"is a directory: give the history file itself"):
        nbdist.runs(str(tmp_path))
    with pytest.raises(ValueError, match=r"notes.txt' is no nbdist run history"):
        nbdist.runs(str(tmp_path / "notes.txt"))
    with pytest.raises(TypeError, match=r"runs: path=123: give the history file's path"):
        nbdist.runs(123)
    assert nbdist.runs(tmp_path / "not_yet.db") == []


# -- nbdist.profile ---------------------------------------------------------------------


@pytest.mark.parametrize("steps", [2.5, "abc"])
def test_profile_step_count_that_is_no_whole_number_is_named(steps):
    import nbdist

    # Before: 2.5 profiled 2 steps; 'abc' raised int()'s message, naming nothing.
    with pytest.raises(TypeError, match=r"nbdist.profile: steps=.* is not a whole number"):
        nbdist.profile(steps=steps)
    assert nbdist.profile(steps="3").steps == 3


@pytest.mark.parametrize(
    "call, message",
    [
        ("exclude_bias_and_norm('model', weight_decay=0.1)", r"exclude_bias_and_norm: model must"),
        (
            "exclude_bias_and_norm(nn.Linear(2, 2), weight_decay='0.1')",
            r"exclude_bias_and_norm: weight_decay='0.1' is str",
        ),
        (
            "compile_ddp(nn.Linear, ddp=False)",
            r"compile_ddp: model must be a torch.nn.Module; Linear",
        ),
        ("apply_onebit_adam('model')", r"apply_onebit_adam: model must be a torch.nn.Module"),
    ],
)
def test_optimizer_helpers_name_a_model_that_is_none(call, message):
    from nbdist.strategies.optim.onebit_adam import apply_onebit_adam  # noqa: F401
    from nbdist.strategies.optim.optimizers import exclude_bias_and_norm  # noqa: F401
    from nbdist.strategies.training.compile import compile_ddp  # noqa: F401

    # Before: AttributeError ('str' has no 'parameters'), torch.compile's AssertionError,
    # or weight_decay='0.1' accepted until the optimizer compared it.
    with pytest.raises(TypeError, match=message):
        eval(call, {**globals(), **locals()})


def test_checkpoint_path_with_a_tilde_is_under_home(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    # Before: written to ./~/ckpt/step_1, a directory named "~" in the working directory.
    where = save("~/ckpt/step_1", model=_net(), step=1)
    assert where == str(tmp_path / "home" / "ckpt" / "step_1")
    assert not (tmp_path / "~").exists()
    assert latest("~/ckpt") == where


def test_prepare_once_path_with_a_tilde_is_under_home(tmp_path, monkeypatch):
    from nbdist.strategies.training.practical import prepare_once

    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    # Before: cached in ./~/cache/n.pt, a directory named "~" in the working directory.
    assert prepare_once("~/cache/n.pt", lambda: 7) == 7
    assert (tmp_path / "home" / "cache" / "n.pt").exists()
    assert not (tmp_path / "~").exists()


# -- nbdist.strategies.training.evaluation -----------------------------------------


@pytest.mark.parametrize("value", [[1, 2], (3.0,), 4])
def test_all_gather_uneven_names_what_is_no_tensor(value):
    from nbdist.strategies.training.evaluation import all_gather_uneven

    # Before: AttributeError: 'list' object has no attribute 'dim' (or the value returned as
    # it was without a process group, then the same error once ranks ran it).
    with pytest.raises(TypeError, match=r"all_gather_uneven: tensor must be a torch.Tensor, got "):
        all_gather_uneven(value)


@pytest.mark.parametrize("group", ["dp", 0, [0, 1]])
def test_sync_batchnorm_refuses_what_is_no_process_group(group):
    from nbdist.strategies.parallel.syncbn import convert_sync_batchnorm

    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    # Before: converted, and the first forward failed inside the collective.
    with pytest.raises(TypeError, match=r"process_group must be a torch.distributed process group"):
        convert_sync_batchnorm(model, process_group=group)
    assert type(model[1]) is nn.BatchNorm1d  # nothing converted
