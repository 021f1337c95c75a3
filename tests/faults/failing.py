"""A cell the tests expect to fail on the ranks: its RankError, or the test fails."""

from __future__ import annotations

import pytest

from nbdist.driver.sinks import ListSink
from nbdist.errors import RankError


def failing_cell(session, code: str, *, timeout: float = 120) -> RankError:
    """Run ``code`` on every rank of ``session``; the RankError it must raise.

    ``timeout`` is the cell's ``--timeout``: shorter than the group's, so a cell nbdist
    failed to end early fails the test with a CellTimeout instead of a gloo timeout.
    """
    with pytest.raises(RankError) as info:
        session.run(code, timeout=timeout, sink=ListSink())
    return info.value
