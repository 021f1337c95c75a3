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
