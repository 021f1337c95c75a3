"""A group whose gloo connects lazily (TORCH_GLOO_LAZY_INIT) is named at start, with what it costs.

nbdist releases ranks hung in a collective by shutting down the sockets their group
opened while it formed (nbdist/engine/control.py); a lazily connected group opens
them later, inside collectives, so the start line says that release is off for it.
Real CPU ranks: the variable is inherited from this process, as from a kernel's.
"""

from __future__ import annotations

import pytest

import nbdist
from nbdist.driver.group import Group
from nbdist.engine import control


def test_a_lazily_connecting_gloo_group_is_named_in_the_ready_lines(monkeypatch):
    monkeypatch.setenv("TORCH_GLOO_LAZY_INIT", "1")
    s = nbdist.DistSession(2, cpu=True, timeout=120).start()
    try:
        text = s.summary()
        assert "nbdist: ranks 0-1 have TORCH_GLOO_LAZY_INIT set" in text, text
        assert "nbdist may not release ranks hung in one" in text
        s.run("t = torch.ones(1); dist.all_reduce(t)")  # the group still works
        assert s.pull("t.item()") == [2.0, 2.0]
    finally:
        s.stop()


def test_an_eagerly_connecting_group_has_no_such_note(monkeypatch):
    monkeypatch.delenv("TORCH_GLOO_LAZY_INIT", raising=False)
    s = nbdist.DistSession(2, cpu=True, timeout=120).start()
    try:
        assert "TORCH_GLOO_LAZY_INIT" not in s.summary()
    finally:
        s.stop()


@pytest.mark.parametrize(
    ("value", "lazy"),
    [("1", True), ("true", True), (" Yes ", True), ("0", False), ("false", False), ("", False)],
)
def test_torch_gloo_lazy_init_is_read_as_torch_reads_a_boolean(monkeypatch, value, lazy):
    monkeypatch.setenv("TORCH_GLOO_LAZY_INIT", value)
    assert control.gloo_connects_lazily() is lazy


def test_the_note_names_one_rank_in_the_singular():
    group = Group([], "127.0.0.1", "gloo", lazy_gloo=[3])
    assert group.notes()[0].startswith("rank 3 has TORCH_GLOO_LAZY_INIT set")
    assert Group([], "127.0.0.1", "gloo").notes() == []
