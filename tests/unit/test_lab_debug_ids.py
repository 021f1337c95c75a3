"""The ids JupyterLab's debugger is given for ranks' frames and variables (kernel side)."""

from __future__ import annotations

from nbdist.driver.lab_debug_ids import FIRST_ID, RankIds


def test_the_same_object_keeps_its_id_and_each_id_maps_back_to_its_rank():
    ids = RankIds()
    a = ids.give(0, 3)
    b = ids.give(1, 3)  # the same debugpy id on another rank is another object
    assert a >= FIRST_ID and b >= FIRST_ID and a != b
    # JupyterLab keeps a selected frame across a Callstack refresh only if its id is listed again.
    assert ids.give(0, 3) == a and ids.give(1, 3) == b
    assert ids.find(a) == (0, 3) and ids.find(b) == (1, 3)
    assert ids.is_ours(a) and not ids.is_ours(3) and not ids.is_ours("x")


def test_zero_stays_zero_and_a_cleared_map_forgets_but_never_reuses_an_id():
    ids = RankIds()
    assert ids.give(0, 0) == 0  # "no children" in every DAP message
    old = ids.give(0, 7)
    ids.clear()
    assert ids.find(old) is None
    new = ids.give(0, 7)
    assert new != old and ids.find(new) == (0, 7)
