"""The refusal of launchers inside a rank: its advice, and the module's former name."""

from __future__ import annotations

import pytest

import nbdist.engine
from nbdist.engine import launcher_refusal


def test_the_advice_names_the_way_out_by_its_current_path():
    text = launcher_refusal.message("torch.multiprocessing.spawn (mp.spawn)", 2)
    assert "would start 2 processes of its own" in text
    assert "with nbdist.engine.launcher_refusal.allow_launchers(): ..." in text


def test_the_former_module_name_warns_and_still_works():
    with pytest.warns(DeprecationWarning, match=r"launch_guard moved to .*launcher_refusal"):
        old = nbdist.engine.launch_guard
    assert old is launcher_refusal
    with pytest.raises(AttributeError):
        _ = nbdist.engine.no_such_module
