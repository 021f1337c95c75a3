"""The collector outlives a message it cannot take, and the history numbers each rank's
batches once (its sequence numbers are taken under the store's lock)."""

from __future__ import annotations

import os

import numpy as np

from nbdist.dashboard.losses import loss_lines
from nbdist.metrics import wire
from nbdist.metrics.collector import Collector
from nbdist.metrics.run import Run
from nbdist.metrics.store import RunStore


def _one_good_point(key, push, collector):
    # A rank's point (step 5, loss 0.5), sent and seen in the run.
    good = wire.points_message(0, [5], np.array([2.0]), {"loss": (None, np.array([0.5]))}, 1, 0)
    push.send_multipart(wire.encode(key, good))
    assert collector.wait_for_points({0: 1}, timeout=30)
    assert collector.run.series("loss", 0) == ([5], [0.5])


def _told_once(run, begins: str, first: str) -> None:
    # One line under the dashboard, with the first error.
    (line,) = loss_lines(run)
    assert line.startswith(begins) and f"; the first: {first}" in line, line


def test_a_signed_message_that_raises_is_dropped_and_the_stream_goes_on(push_to):
    key = os.urandom(16)
    run = Run(0, world_size=1)
    collector = Collector(key, run, None)
    push = push_to(collector)
    try:
        # Signed with the cluster key but of shapes _handle does not read: a cell marker
        # whose number is no number (int() raises), and columns that are a list.
        push.send_multipart(wire.encode(key, {"k": "cell", "rank": 0, "cell": "last"}))
        bad = {"k": "points", "rank": 0, "step0": 0, "n": 1, "times": wire.floats([1.0])}
        push.send_multipart(wire.encode(key, {**bad, "cols": [], "total": 1}))
        # One sender's messages arrive in order: the good one is taken after both bad ones.
        _one_good_point(key, push, collector)
        assert collector.rejected == 2
        # The user is told, under the dashboard: the kernel lost points.
        _told_once(run, "2 messages of points from the ranks could not be read", "ValueError: ")
    finally:
        collector.stop()


def test_a_history_that_cannot_be_written_is_told_and_live_points_go_on(tmp_path, push_to):
    key = os.urandom(16)
    store = RunStore(str(tmp_path / "h.sqlite"))
    run = store.new_run(world_size=1)
    store.close()  # every write to it raises now, as a full or vanished disk would
    collector = Collector(key, run, store)
    push = push_to(collector)
    try:
        _one_good_point(key, push, collector)  # live: the chart has it
        _told_once(run, "the run's history could not be written 1 time ", "")
    finally:
        collector.stop()


class _WatchedSeq(dict):
    """The store's seq counters, noting whether the store's lock was held at each use."""

    def __init__(self, lock):
        super().__init__()
        self.lock = lock
        self.unlocked = 0

    def get(self, key, default=None):
        self.unlocked += not self.lock.locked()
        return super().get(key, default)

    def __setitem__(self, key, value):
        self.unlocked += not self.lock.locked()
        super().__setitem__(key, value)


def test_each_batch_of_a_rank_gets_its_seq_under_the_store_lock(tmp_path):
    # The collector thread and mark_restart (the main thread) both append: a seq read and
    # bumped outside the lock can go to two batches of one rank.
    store = RunStore(str(tmp_path / "h.sqlite"))
    try:
        store._seq = _WatchedSeq(store._lock)
        run = store.new_run(world_size=1)
        for step in range(3):
            store.append(run.id, 0, [[step, 1.0 + step, {"loss": 1.0}]])
        assert store._seq.unlocked == 0
        store.commit()
        rows = store._conn.execute("SELECT seq FROM batches WHERE run=?", (run.id,)).fetchall()
        assert sorted(seq for (seq,) in rows) == [0, 1, 2]
    finally:
        store.close()
