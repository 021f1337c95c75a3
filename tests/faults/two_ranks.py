"""Two real gloo CPU ranks whose group's own timeout is 60 s, and the check that the group works.

Without nbdist releasing the ranks, a cell a fault test expects to end early would end only
with gloo's timeout after a minute (30 minutes with torch's default), and its assertions fail.
"""

from __future__ import annotations

import nbdist
from nbdist.driver.sinks import ListSink


def two_ranks(**options) -> nbdist.DistSession:
    """A session of 2 CPU ranks (group timeout 60 s unless ``options`` says otherwise), to
    use in a ``with`` block."""
    options = {"timeout": 120, "group_timeout": 60, "history": False, **options}
    return nbdist.DistSession(2, cpu=True, **options)


def reduce_works(session) -> None:
    """The group works: an all-reduce on both ranks sums 1 and 2."""
    session.run("t = torch.ones(1) * (rank + 1); dist.all_reduce(t)", sink=ListSink())
    assert [t.item() for t in session.pull("t")] == [3.0, 3.0]
