"""CurveZMQ on a cluster nbdist starts: encrypted control traffic, metrics signed with a key of their own."""

from __future__ import annotations

import time

import psutil

import nbdist
from tests.conftest import wait_gone
from tests.multihost.forged import send_forged_metrics


def test_curve_cluster_keeps_metrics_signed_and_everything_on_loopback(monkeypatch):
    # Read by the controller nbdist starts (it inherits the kernel's environment).
    monkeypatch.setenv("IPP_ENABLE_CURVE", "1")
    s = nbdist.DistSession(2, cpu=True, timeout=120, history=False).start()
    try:
        # ipyparallel drops its HMAC key under CurveZMQ; metrics must not go unsigned.
        assert s.client.session.key == b""
        assert len(s.metrics_hub.collector.key) == 32
        s.run("for i in range(3): nbdist.log(step=i, loss=float(i))")
        frame = s.metrics.to_pandas()
        assert sorted(frame["rank"].unique()) == [0, 1]
        assert len(frame) == 6
        send_forged_metrics(s.metrics_hub.url)
        deadline = time.monotonic() + 10
        while s.metrics_hub.collector.rejected == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert s.metrics_hub.collector.rejected == 1
        assert len(s.metrics.to_pandas()) == 6
        pids = set(s.cluster.pids) | {r.pid for r in s.ranks}
        listening = [
            c
            for c in psutil.net_connections(kind="inet")
            if c.status == psutil.CONN_LISTEN and c.pid in pids
        ]
        assert listening and all(c.laddr.ip.startswith("127.") for c in listening)
        assert s.metrics_hub.url.startswith("tcp://127.0.0.1:")
        # A restart in place: the old engines leave the controller at once, told so over the
        # encrypted channel (unsigned, as CurveZMQ's messages are), not after their hearts'
        # silence: the same controller, fresh ranks, the old ones gone from its list.
        controller = s.cluster.cluster.controller.pid
        old_ids, old_pids = set(s.client.ids), {r.pid for r in s.ranks}
        s.restart()
        assert s.cluster.cluster.controller.pid == controller
        assert not old_ids & set(s.client.ids), (old_ids, s.client.ids)
        assert not old_pids & {r.pid for r in s.ranks}
        assert s.pull("rank") == [0, 1]
        pids |= set(s.cluster.pids) | {r.pid for r in s.ranks}
    finally:
        killed = s.stop()
    assert killed == []
    assert wait_gone(pids, timeout=10) == []
