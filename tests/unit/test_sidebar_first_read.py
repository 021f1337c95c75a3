"""The sidebar's first read of a long run (RunReader._tail) decodes a few hundred points per rank.

Real components: a history written by the real store, read by the real RunReader.
Only the wire decoder is wrapped, to count the points the read decoded.
"""

from __future__ import annotations

import time

from nbdist.dashboard.table import HISTORY
from nbdist.metrics import wire
from nbdist.metrics.store import RunStore
from nbdist.server.sidebar_state import CHART_POINTS, RunReader

RANKS, BATCHES, PER_BATCH = 4, 400, 50  # 20,000 points a rank, sent 50 to a message


def test_first_read_takes_in_enough_batches_for_the_charts_not_a_batch_per_chart_point(
    tmp_path, monkeypatch
):
    path = str(tmp_path / "history.sqlite")
    writer = RunStore(path)
    run = writer.new_run(world_size=RANKS, backend="gloo")
    t0 = time.time()
    for b in range(BATCHES):
        for rank in range(RANKS):
            steps = range(b * PER_BATCH, (b + 1) * PER_BATCH)
            writer.append(
                run.id, rank, [[s, t0 + s, {"loss": 1.0 + rank + s / 1e5}] for s in steps]
            )
    writer.commit()
    writer.close()

    decoded = []
    real = wire.points

    def points(message):
        batch = real(message)
        decoded.append(len(batch))
        return batch

    monkeypatch.setattr(wire, "points", points)
    reader = RunReader(path, run.id)
    reader.update()

    # Enough whole batches per rank to cover the charts and the straggler rule, no more.
    wanted = max(CHART_POINTS, HISTORY)
    per_rank = -(-wanted // PER_BATCH) * PER_BATCH
    assert sum(decoded) == RANKS * per_rank, "points decoded by the first read"
    last = BATCHES * PER_BATCH - 1
    for rank in range(RANKS):
        live = reader.ranks[rank]
        assert live.points == BATCHES * PER_BATCH  # the count is the run's, not the read's
        assert live.step == last
        assert [s for s, _ in live.loss] == list(range(last - CHART_POINTS + 1, last + 1))
        assert len(live.recent.history) == HISTORY

    # Then only what is new is read.
    decoded.clear()
    writer = RunStore(path)
    writer.append(run.id, 0, [[last + 1, t0 + last + 1, {"loss": 0.5}]])
    writer.close()
    reader.update()
    assert decoded == [1] and reader.ranks[0].step == last + 1
