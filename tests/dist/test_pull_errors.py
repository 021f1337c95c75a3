"""A value the kernel cannot unpickle (its class known only to the ranks) fails a pull at
once, says what to do, and leaves the session usable; other values pull as before."""

from __future__ import annotations

import copy

import ipyparallel as ipp
import numpy as np
import pytest
import torch

import nbdist
from nbdist.driver.sinks import ListSink
from nbdist.errors import NbdistError, RankError, UnpicklableValue

# Before the fix such a pull never returned: the limit turns that into a failure.
pytestmark = pytest.mark.timeout(120)

FIX = "define the class in a module both the kernel and the ranks import, or pull plain data"


@pytest.fixture(scope="module")
def session():
    with nbdist.DistSession(2, cpu=True, timeout=120) as s:
        yield s


def still_works(session) -> None:
    session.run("after = rank + 40")
    assert session.pull("after") == [40, 41]


def test_a_class_defined_on_the_ranks_fails_the_pull_and_says_why(session):
    session.run(
        "from dataclasses import dataclass\n@dataclass\nclass Point:\n    x: int = 1\np = Point()"
    )
    with pytest.raises(UnpicklableValue) as caught:
        session.pull("p")
    text = str(caught.value)
    assert isinstance(caught.value, NbdistError)
    assert "cannot pull 'p'" in text
    assert "on ranks 0-1 it is a __main__.Point" in text
    assert "Can't get attribute 'Point'" in text
    assert FIX in text
    still_works(session)


def test_a_module_only_the_ranks_import_names_the_rank_and_module(session, tmp_path):
    (tmp_path / "nbdist_rank_only_mod.py").write_text("class Thing:\n    pass\n")
    session.run(
        f"import sys\nsys.path.insert(0, {str(tmp_path)!r})\n"
        "import nbdist_rank_only_mod\nthing = nbdist_rank_only_mod.Thing()"
    )
    with pytest.raises(UnpicklableValue) as caught:
        session.pull("thing", rank=1)
    text = str(caught.value)
    assert "on rank 1 it is a nbdist_rank_only_mod.Thing" in text
    assert "No module named 'nbdist_rank_only_mod'" in text
    assert FIX in text
    still_works(session)


def test_only_the_ranks_whose_value_cannot_come_are_named(session):
    session.run("class Local:\n    pass\nmixed = Local() if rank == 1 else 5")
    assert session.pull("mixed", rank=0) == 5
    with pytest.raises(UnpicklableValue, match=r"on rank 1 it is a __main__\.Local"):
        session.pull("mixed")
    still_works(session)


def test_a_missing_name_is_still_the_ranks_own_error(session):
    with pytest.raises(RankError) as caught:
        session.pull("never_defined_here")
    assert not isinstance(caught.value, UnpicklableValue)
    assert "NameError" in str(caught.value)


def test_a_function_returning_such_a_value_fails_too(session):
    session.run("class Made:\n    pass\nmade = Made()")
    with pytest.raises(RankError) as caught:
        session.apply(copy.copy, ipp.Reference("made"))  # a Made, returned by value
    failure = caught.value.failures[0]
    assert failure.ename == "UnpicklableValue"
    assert "Can't get attribute 'Made'" in failure.evalue
    assert "define the class in a module both the kernel and the ranks import" in failure.evalue
    still_works(session)


def test_a_cell_that_ends_with_such_a_value_shows_its_repr(session):
    sink = ListSink()
    session.run(
        "class Shown:\n    def __repr__(self):\n        return 'shown here'\nShown()", sink=sink
    )
    shown = [(e[1], e[2]["text/plain"]) for e in sink.events if e[0] == "display"]
    assert shown == [("ranks 0-1", "shown here")]
    still_works(session)


def test_plain_values_pull_as_before(session):
    session.run(
        "import numpy as np\n"
        "t = torch.arange(4.0) + rank\n"
        "big = torch.full((1 << 21,), float(rank))\n"  # 8 MiB: sent as a buffer
        "arr = np.arange(3) * (rank + 1)\n"
        "d = {'rank': rank, 'loss': 0.5}\n"
        "nothing = None"
    )
    assert [v.tolist() for v in session.pull("t")] == [[0, 1, 2, 3], [1, 2, 3, 4]]
    big = session.pull("big", rank=1)
    assert isinstance(big, torch.Tensor) and big.shape == (1 << 21,) and bool((big == 1).all())
    arrays = session.pull("arr")
    assert all(isinstance(a, np.ndarray) for a in arrays)
    assert [a.tolist() for a in arrays] == [[0, 1, 2], [0, 2, 4]]
    assert session.pull("d") == [{"rank": 0, "loss": 0.5}, {"rank": 1, "loss": 0.5}]
    assert session.pull("nothing") == [None, None]
