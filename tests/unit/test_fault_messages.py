"""The ranks a fault message names stay readable at any count (kernel-side text only)."""

from __future__ import annotations

from nbdist.errors import ranks_text


def test_a_few_ranks_read_as_prose():
    assert ranks_text([1]) == "rank 1"
    assert ranks_text([2, 3]) == "ranks 2 and 3"
    assert ranks_text([1, 2, 5]) == "ranks 1, 2 and 5"


def test_many_ranks_read_as_runs_not_a_list_of_each():
    assert ranks_text(list(range(1, 64))) == "ranks 1-63"
    # 255 ranks of 256 wait for rank 7: before, each of the 254 others was listed.
    others = [r for r in range(256) if r not in (7, 100)]
    assert ranks_text(others) == "ranks 0-6,8-99,101-255"
