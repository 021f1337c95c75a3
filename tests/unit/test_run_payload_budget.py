"""The past-run view's payload (nbdist.server.runview) stays bounded however many ranks logged,
and above 8 ranks charts what the dashboard charts: the median and min-max band of every
rank, and the ranks that deviate on their own.

Real components: a history written by the real store, read back by load_run.
"""

from __future__ import annotations

import json
import time

from nbdist.dashboard.table import PER_RANK_UP_TO, SHOWN_RANKS
from nbdist.metrics.store import RunStore, load_run
from nbdist.server.runview import RUN_CHART_POINTS, run_payload

STRAGGLER, ASTRAY = 201, 17


def _loss(rank: int, step: int, steps: int) -> float:
    if (rank, step) == (3, 1234):
        return 50.0  # one spike on rank 3: decimation must keep it
    if rank == ASTRAY and step >= steps - 100:
        return 5.0  # rank 17's loss ends far from every other rank's
    return 2.0 - step / steps + 0.0001 * rank


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
                        "loss": _loss(rank, s, steps),
                        "samples_per_s": 100.0 + rank,
                        # Rank 201 steps three times slower than the others: a straggler.
                        "step_time": 0.3 if rank == STRAGGLER else 0.1,
                    },
                ]
                for s in range(start, min(steps, start + batch))
            ]
            writer.append(run.id, rank, points)
    writer.commit()
    writer.end_run(run.id)
    writer.close()
    return load_run(run.id, path=path)


def test_many_ranks_are_drawn_as_their_median_band_and_the_ranks_that_deviate(tmp_path):
    run = _run(str(tmp_path / "h.sqlite"), ranks=256, steps=2500)
    payload = run_payload(run, running=False)
    # The straggler first, then the rank whose last loss is far from the others'.
    assert payload["shown"] == [
        {"rank": STRAGGLER, "why": "3.0× step time"},
        {"rank": ASTRAY, "why": "last loss far from the others'"},
    ]
    assert len(payload["shown"]) <= SHOWN_RANKS
    for key in ("loss", "samples_per_s", "step_time"):
        assert set(payload["series"][key]) == {str(STRAGGLER), str(ASTRAY)}, key
        band = payload["bands"][key]
        assert set(band) == {"median", "min", "max"}
        assert all(0 < len(band[line]) <= RUN_CHART_POINTS for line in band), key
    loss = payload["bands"]["loss"]
    # Across all 256 ranks at each step: rank 0 lowest, rank 255 highest (but at 1234,
    # rank 3's spike; and at the end, rank 17's astray loss), the median between.
    assert loss["median"][0] == [0, 2.0 + 0.0001 * 127.5]
    assert loss["min"][0] == [0, 2.0] and loss["max"][0] == [0, 2.0 + 0.0001 * 255]
    assert [1234, 50.0] in loss["max"]
    assert loss["max"][-1] == [2499, 5.0]
    assert loss["median"][-1][0] == 2499
    # Throughput against seconds: ranks log at their own moments, so binned by time.
    rate = payload["bands"]["samples_per_s"]
    assert rate["min"][0][1] == 100.0 and rate["max"][0][1] == 355.0
    assert payload["panels"]["samples_per_s"]["by_time"] is True
    # About what 8 ranks' charts weigh, not 256 times 2000 points a panel (~25 MB here).
    assert len(json.dumps(payload)) < 2 * 2**20


def test_up_to_the_per_rank_view_each_rank_keeps_its_points(tmp_path):
    run = _run(str(tmp_path / "h.sqlite"), ranks=PER_RANK_UP_TO, steps=2500)
    payload = run_payload(run, running=False)
    assert "bands" not in payload and "shown" not in payload
    for points in payload["series"]["loss"].values():
        # Min/max decimation of a smooth line keeps fewer than its budget; far more
        # than a share of 8 ranks' points all the same.
        assert RUN_CHART_POINTS // 2 < len(points) <= RUN_CHART_POINTS
