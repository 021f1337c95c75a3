"""nbdist.driver.rank_debugpy over real loopback sockets: a rank's debugpy that goes away."""

from __future__ import annotations

import socket
import time

import pytest

from nbdist.driver.rank_debugpy import RankConnection


def test_a_request_after_the_debugpy_hung_up_fails_at_once():
    """A debugpy that hangs up at once (its rank ending): the connection's reader sees it go,
    and a request sent after fails at once. A send to a socket the peer closed still
    succeeds, so the request used to wait its whole reply timeout (30 s) for an answer."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    events = []
    connection = RankConnection(
        3, "127.0.0.1", server.getsockname()[1], lambda r, m: events.append(m)
    )
    accepted, _ = server.accept()
    accepted.close()
    server.close()
    deadline = time.monotonic() + 30
    while not connection.closed and time.monotonic() < deadline:
        time.sleep(0.01)
    assert connection.closed and events == [{"type": "event", "event": "nbdist_closed"}]
    answer = connection.request("initialize", {})
    with pytest.raises(ConnectionError, match="rank 3's debugpy"):
        answer.result(timeout=1)
    connection.close()
