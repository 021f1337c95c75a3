"""Fixtures shared by the unit tests."""

from __future__ import annotations

import os

import pytest

from nbdist.metrics import log as metrics_log
from nbdist.metrics.collector import Collector
from nbdist.metrics.run import Run


@pytest.fixture
def channel():
    """This process as rank 0 logging into a real collector: ``(run, collector)``."""
    key = os.urandom(16)
    run = Run(0, world_size=1)
    collector = Collector(key, run, None)
    metrics_log.configure(collector.url, key, 0)
    try:
        yield run, collector
    finally:
        metrics_log.shutdown()
        collector.stop()


@pytest.fixture
def push_to():
    """What a rank sends with: ``push_to(collector)`` is a DEALER socket connected to the
    collector, closed after the test."""
    import zmq

    sockets = []

    def connect(collector):
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(collector.url)
        sockets.append(sock)
        return sock

    yield connect
    for sock in sockets:
        sock.close()
