"""A module-scoped session of real ranks that already ran some shared definitions.

The strategy tests define their model and data once (a ``COMMON`` source that
the test module also ``exec``s for its single-process reference) and need those
names on every rank before the first test::

    @pytest.fixture(scope="module")
    def session():
        yield from ranks_with(4, COMMON)
"""

from __future__ import annotations

import nbdist
from nbdist.driver.sinks import ListSink

__all__ = ["ranks_with"]


def ranks_with(n: int, common: str, *, timeout: float = 120, **options):
    """Start ``n`` CPU ranks, run ``common`` on them, yield the session, stop it afterwards.

    ``options``: more of :class:`nbdist.DistSession`'s keywords (``group_timeout=``...).
    """
    session = nbdist.DistSession(n, cpu=True, timeout=timeout, **options)
    session.start()
    try:
        session.run(common, sink=ListSink())
        yield session
    finally:
        session.stop()
