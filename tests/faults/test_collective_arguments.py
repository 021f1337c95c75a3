"""Ranks make the same collective with different tensors (2 real gloo ranks).

gloo pairs calls by order, not by size: an all-reduce of 1 element on rank 1 against one of
4 on rank 0 returns on rank 1, with a wrong value, while rank 0 waits for the rest. Without
``check_collectives`` nbdist releases rank 0 and says the calls paired but differ; with it
(torch's ``TORCH_DISTRIBUTED_DEBUG=DETAIL``) the call fails at once on every rank, naming the
shapes, and no rank's tensor is touched.
"""

from __future__ import annotations

import re

import pytest

import nbdist
from nbdist.driver.crash_stack import ABORTED_IN_COLLECTIVE
from nbdist.driver.sinks import ListSink
from nbdist.errors import PlacementError, RankError
from tests.faults.two_ranks import reduce_works, two_ranks

_SIZES_DIFFER = "t = torch.ones(4 if rank == 0 else 1)\ndist.all_reduce(t)"


@pytest.fixture(scope="module")
def session():
    with two_ranks() as s:
        yield s


@pytest.fixture(scope="module")
def checked():
    with two_ranks(check_collectives=True) as s:
        yield s


def test_a_collective_whose_sizes_differ_is_named_as_paired_but_different(session):
    with pytest.raises(RankError) as caught:
        session.run(_SIZES_DIFFER, sink=ListSink())
    text = str(caught.value)
    assert [(f.rank, f.ename) for f in caught.value.failures] == [(0, "CollectiveMismatch")], text
    assert re.search(
        r"rank 0: CollectiveMismatch: waited in all_reduce #(\d+) with float32 \[4\] for rank 1 "
        r"with float32 \[1\], which made all_reduce #\1 too and returned from it: the calls "
        r"paired but their tensors differ",
        text,
    ), text
    # Not the words of a rank that skipped the call, and the way to have it named at once.
    assert "without entering it" not in text, text
    assert "%dist_start --check-collectives" in text, text
    reduce_works(session)


def test_checked_collectives_fail_at_once_on_every_rank_naming_the_shapes(checked):
    assert "each collective is compared across the ranks before it runs" in checked.summary()
    with pytest.raises(RankError) as caught:
        checked.run(_SIZES_DIFFER, sink=ListSink())
    text = str(caught.value)
    assert sorted(f.rank for f in caught.value.failures) == [0, 1], text
    assert {f.ename for f in caught.value.failures} == {"RuntimeError"}, text
    assert "Detected mismatch between collectives on ranks" in text, text
    assert "Tensor shapes: 4vs 1" in text and "Tensor shapes: 1vs 4" in text, text
    # Nothing was reduced: each rank keeps its ones, and nothing was released.
    assert [t.tolist() for t in checked.pull("t")] == [[1.0] * 4, [1.0]]
    assert "released" not in text, text
    reduce_works(checked)


def test_a_collective_one_rank_skips_is_still_released_under_the_check(checked):
    """torch's check waits in its own barrier for the rank that skipped the call: nbdist
    releases that wait as it releases the call's, and the group is formed again."""
    with pytest.raises(RankError) as caught:
        checked.run("t = torch.ones(2)\nif rank == 0:\n    dist.all_reduce(t)", sink=ListSink())
    # (The call's number counts the group's calls since it was last formed.)
    said = re.search(
        r"rank 0: CollectiveMismatch: waited in all_reduce #\d+ for rank 1, which finished the "
        "cell without entering it",
        str(caught.value),
    )
    assert said, str(caught.value)
    reduce_works(checked)


def test_checked_collectives_stay_checked_when_the_group_is_formed_again(checked):
    checked.reform_group()
    with pytest.raises(RankError) as caught:
        checked.run(
            "u = torch.ones(2, dtype=torch.float64 if rank else torch.float32)\ndist.all_reduce(u)",
            sink=ListSink(),
        )
    assert "Detected mismatch between collectives on ranks" in str(caught.value)
    reduce_works(checked)


def test_a_session_checks_no_collective_unless_asked(session):
    session.run("level = str(dist.get_debug_level())", sink=ListSink())
    assert session.pull("level") == ["DebugLevel.OFF"] * 2


def test_check_collectives_takes_true_or_false():
    with pytest.raises(PlacementError, match=r"check_collectives 'yes': give True"):
        nbdist.DistSession(2, cpu=True, check_collectives="yes")


_DTYPE_DIFFERS_ON_RANK_1 = (
    "t = torch.ones(2, dtype=torch.float64 if rank == 1 else torch.float32)\ndist.all_reduce(t)"
)


def test_a_dtype_that_differs_on_one_of_four_ranks_kills_a_rank_unless_checked():
    """Four ranks, rank 1's tensor float64: unchecked, gloo aborts a rank whose tensor was
    right and the death's line says what does that; checked, every rank fails at once
    naming the dtypes, no rank dies and the group goes on. (A size that differs on rank 3
    first: unchecked, the ranks it leaves waiting are named in one line; checked, the three
    alike in one line and rank 3 in its own.)"""
    options = {"timeout": 120, "group_timeout": 60, "history": False}
    with nbdist.DistSession(4, cpu=True, **options) as unchecked:
        # First a size that differs: the three ranks left waiting are released, each with
        # gloo's error naming another peer, and read as one line.
        with pytest.raises(RankError) as caught:
            unchecked.run(
                "t = torch.ones(1 if rank == 3 else 4)\ndist.all_reduce(t)", sink=ListSink()
            )
        lines = str(caught.value).splitlines()
        assert len(lines) == 2, lines
        assert lines[0].startswith(
            "ranks 0-2: CollectiveMismatch: waited in all_reduce #1 with float32 [4] for rank 3 "
            "with float32 [1]"
        ), lines
        with pytest.raises(RankError) as caught:
            unchecked.run(_DTYPE_DIFFERS_ON_RANK_1, sink=ListSink())
        text = str(caught.value)
        died = [f for f in caught.value.failures if f.ename == "RankDied"]
        assert died and all(f.rank != 1 for f in died), text
        assert all(f.evalue.endswith(ABORTED_IN_COLLECTIVE) for f in died), text
    with nbdist.DistSession(4, cpu=True, check_collectives=True, **options) as checked:
        # Every rank's message names itself and the rank it differs from: the three alike
        # read as one line, rank 3's shape kept apart from theirs (not "TensorShape=[1–4]").
        with pytest.raises(RankError) as caught:
            checked.run(
                "t = torch.ones(1 if rank == 3 else 4)\ndist.all_reduce(t)", sink=ListSink()
            )
        lines = str(caught.value).splitlines()
        assert [line.split(": ")[0] for line in lines] == ["ranks 0-2", "rank 3"], lines
        assert re.search(r"Rank 0–2 is running .*TensorShape=\[4\].* but Rank 3 .*\[1\]", lines[0])
        assert re.search(r"Rank 3 is running .*TensorShape=\[1\].* but Rank 0 .*\[4\]", lines[1])
        assert "(default)" not in lines[0] and "TensorOptions(device=cpu)" in lines[0], lines
        with pytest.raises(RankError) as caught:
            checked.run(_DTYPE_DIFFERS_ON_RANK_1, sink=ListSink())
        text = str(caught.value)
        assert sorted(f.rank for f in caught.value.failures) == [0, 1, 2, 3], text
        assert {f.ename for f in caught.value.failures} == {"RuntimeError"}, text
        assert re.search(r"Tensor dtypes: (Floatvs Double|Doublevs Float)", text), text
        assert checked.dead_ranks() == {}
        checked.run("u = torch.ones(1) * (rank + 1)\ndist.all_reduce(u)", sink=ListSink())
        assert [u.item() for u in checked.pull("u")] == [10.0] * 4
