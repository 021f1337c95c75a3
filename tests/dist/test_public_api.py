"""nbdist's public names as a cell on real ranks sees them (2 CPU ranks).

Every rank's namespace holds ``rank``, ``local_rank``, ``world_size`` and ``device`` as
values; ``from nbdist import *`` in a cell must leave them as they are, while the
functions of the same names stay reachable as ``nbdist.rank()`` and so on.
"""

from __future__ import annotations

import pytest

import nbdist
from nbdist.driver.sinks import ListSink


@pytest.fixture(scope="module")
def session():
    with nbdist.DistSession(2, cpu=True, timeout=120) as s:
        yield s


def test_star_import_keeps_the_injected_rank_values(session):
    session.run(
        "from nbdist import *\n"
        "seen = (rank, local_rank, world_size, str(device))\n"
        "called = (nbdist.rank(), nbdist.local_rank(), nbdist.world_size(), str(nbdist.device()))\n"
        "logged = callable(log) and callable(print0)\n",
        sink=ListSink(),
    )
    assert session.pull("seen") == [(0, 0, 2, "cpu"), (1, 1, 2, "cpu")]
    assert session.pull("called") == session.pull("seen")
    # The star import brought the rank-side API it is for.
    assert session.pull("logged") == [True, True]
