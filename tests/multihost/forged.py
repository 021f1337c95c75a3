"""A metrics message an attacker could forge: signed with the empty key."""

from __future__ import annotations

import time


def send_forged_metrics(url: str) -> None:
    """Send one metrics message signed with the empty key (what CurveZMQ clusters hold)."""
    import zmq

    from nbdist.metrics.wire import encode

    context = zmq.Context()
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 2000)
    sock.connect(url)
    points = [[99, time.time(), {"loss": -1.0}]]
    sock.send_multipart(encode(b"", {"k": "points", "rank": 0, "points": points}))
    sock.close()
    context.term()
