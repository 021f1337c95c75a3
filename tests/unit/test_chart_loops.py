"""A run whose steps start again (a second training loop, a restart from a checkpoint) is
charted without a line from its last step back to the first: the past-run view gets a gap
(``[x, null]``, which plotly leaves undrawn) where the step goes back, and the sidebar's
live charts get the current loop only (x ascending).

Real components: a history written by the real store, read by load_run / the real
LiveView, as the Jupyter server's routes read it.
"""

from __future__ import annotations

import json
import time

from nbdist.metrics.store import RunStore, load_run
from nbdist.server.runview import RUN_CHART_POINTS, run_payload
from nbdist.server.sidebar_state import LiveView


def _history(path: str, loops: list[range], ranks: int = 2) -> int:
    """A run whose ranks log ``loss`` over each of ``loops``' steps, one loop after the other."""
    writer = RunStore(path)
    run = writer.new_run(world_size=ranks, backend="gloo")
    t0 = time.time()
    for rank in range(ranks):
        when = t0
        for loop, steps in enumerate(loops):
            points = []
            for s in steps:
                when += 0.01
                points.append([s, when, {"loss": 3.0 - loop - s / 10_000 + rank / 100}])
            writer.append(run.id, rank, points)
    writer.commit()
    writer.close()
    return run.id


def test_past_run_has_a_gap_where_the_step_goes_back_not_a_line_back_to_step_0(tmp_path):
    path = str(tmp_path / "h.sqlite")
    run_id = _history(path, [range(0, 50), range(0, 30)])
    payload = json.loads(json.dumps(run_payload(load_run(run_id, path=path), running=False)))
    for rank in ("0", "1"):
        points = payload["series"]["loss"][rank]
        assert [x for x, _ in points] == [*range(50), 0, *range(30)]
        # The one null, between step 49 of the first loop and step 0 of the second.
        assert [i for i, (_, y) in enumerate(points) if y is None] == [50]
        assert points[49][0] == 49 and points[51] == [0, points[51][1]]


def test_past_run_gaps_survive_decimation_and_the_budget_holds(tmp_path):
    path = str(tmp_path / "h.sqlite")
    run_id = _history(path, [range(0, 3000), range(0, 2500), range(100, 1500)], ranks=1)
    points = run_payload(load_run(run_id, path=path), running=False)["series"]["loss"]["0"]
    assert len(points) <= RUN_CHART_POINTS
    gaps = [i for i, (_, y) in enumerate(points) if y is None]
    assert len(gaps) == 2
    # Each gap sits between a loop's last step and the next loop's first.
    assert [(points[i - 1][0], points[i + 1][0]) for i in gaps] == [(2999, 0), (2499, 100)]
    # Between gaps the steps only go forward: no line is drawn back.
    drawn = [x for x, y in points if y is not None]
    backs = [i for i in range(1, len(drawn)) if drawn[i] < drawn[i - 1]]
    assert len(backs) == 2


def _sidebar_rows(path: str, run_id: int, ranks: int = 2) -> list[dict]:
    entry = {
        "id": "c1",
        "history": path,
        "run_id": run_id,
        "owned": False,
        "ranks": [{"rank": r, "host": "h", "pid": None} for r in range(ranks)],
    }
    return LiveView(registry_dir=None).rank_rows(entry)


def test_sidebar_charts_show_the_current_loop_only_with_steps_ascending(tmp_path):
    path = str(tmp_path / "h.sqlite")
    run_id = _history(path, [range(0, 200), range(0, 40)])
    for row in _sidebar_rows(path, run_id):
        assert [x for x, _ in row["loss_series"]] == list(range(40))


def test_sidebar_charts_start_over_when_a_later_poll_brings_a_new_loop(tmp_path):
    path = str(tmp_path / "h.sqlite")
    run_id = _history(path, [range(0, 100)], ranks=1)
    view = LiveView(registry_dir=None)
    entry = {
        "id": "c1",
        "history": path,
        "run_id": run_id,
        "owned": False,
        "ranks": [{"rank": 0, "host": "h", "pid": None}],
    }
    assert [x for x, _ in view.rank_rows(entry)[0]["loss_series"]] == list(range(100))
    writer = RunStore(path)
    writer.append(run_id, 0, [[s, time.time(), {"loss": 1.0}] for s in range(10, 25)])
    writer.close()
    assert [x for x, _ in view.rank_rows(entry)[0]["loss_series"]] == list(range(10, 25))
