"""The past-run view's payload (nbdist.server.runview) stays bounded however many ranks logged.

Real components: a history written by the real store, read back by load_run.
"""

from __future__ import annotations

import json
import time

from nbdist.dashboard.table import PER_RANK_UP_TO
from nbdist.metrics.store import RunStore, load_run
from nbdist.server.runview import RUN_CHART_POINTS, run_payload


def _run(path: str, ranks: int, steps: int, batch: int = 50):
    writer = RunStore(path)
    run = writer.new_run(world_size=ranks, backend="gloo")
    t0 = time.time()
    for rank in range(ranks):
        for start in range(0, steps, batch):
            points = [
                [
                    s,
                    t0 + s,
                    {
                        # One spike on rank 3: decimation must keep it.
                        "loss": 50.0 if (rank, s) == (3, 1234) else 2.0 - s / steps,
                        "samples_per_s": 100.0 + rank,
                    },
                ]
                for s in range(start, min(steps, start + batch))
            ]
            writer.append(run.id, rank, points)
    writer.commit()
    writer.end_run(run.id)
    writer.close()
    return load_run(run.id, path=path)


def test_many_ranks_share_the_points_a_few_ranks_have(tmp_path):
    run = _run(str(tmp_path / "h.sqlite"), ranks=256, steps=2500)
    payload = run_payload(run, running=False)
    total = PER_RANK_UP_TO * RUN_CHART_POINTS  # what 8 ranks' charts hold
    for key in ("loss", "samples_per_s"):
        per_rank = payload["series"][key]
        assert len(per_rank) == 256  # every rank still drawn, in the same shape
        assert sum(len(points) for points in per_rank.values()) <= total, key
    # Each rank's line still spans the run, and a spike survives.
    assert payload["series"]["loss"]["0"][0][0] == 0
    assert payload["series"]["loss"]["0"][-1][0] == 2499
    assert [1234, 50.0] in payload["series"]["loss"]["3"]
    # About what 8 ranks' charts weigh, not 256 times 2000 points a panel (~25 MB here).
    assert len(json.dumps(payload)) < 2 * 2**20


def test_up_to_the_per_rank_view_each_rank_keeps_its_points(tmp_path):
    run = _run(str(tmp_path / "h.sqlite"), ranks=PER_RANK_UP_TO, steps=2500)
    payload = run_payload(run, running=False)
    for points in payload["series"]["loss"].values():
        # Min/max decimation of a smooth line keeps fewer than its budget; far more
        # than a share of 8 ranks' points all the same.
        assert RUN_CHART_POINTS // 2 < len(points) <= RUN_CHART_POINTS
