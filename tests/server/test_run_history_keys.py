"""A past run is named by its history and its id: two histories each have a run 1.

Run ids count from 1 in every history file (SQLite AUTOINCREMENT per file). The sidebar
lists the runs of the default history and of each live cluster's own ``history=`` file,
so two "run 1"s can be listed at once; ``GET runs/<id>?history=`` must read the one asked
for, and only from a history the server lists.

Real components: the server (pytest-jupyter), a real 1-rank session (gloo, CPU) logging
to its own history file, and the real default history (SQLite).
"""

from __future__ import annotations

import asyncio
import json
import time

import pytest
from tornado.httpclient import HTTPClientError

from nbdist import DistSession
from nbdist.metrics.store import RunStore


def _history_with_run_1(path: str, losses: list[float]) -> None:
    store = RunStore(path)
    run = store.new_run(world_size=1, backend="gloo")
    assert run.id == 1
    t0 = time.time()
    store.append(run.id, 0, [[s, t0 + s, {"loss": v}] for s, v in enumerate(losses)])
    store.commit()
    store.end_run(run.id)
    store.close()


async def _get(jp_fetch, *parts, **params):
    response = await jp_fetch(*parts, params=params)
    return json.loads(response.body)


async def _refused(jp_fetch, history: str) -> str:
    with pytest.raises(HTTPClientError) as err:
        await jp_fetch("nbdist", "api", "runs", "1", params={"history": history})
    assert err.value.code == 404
    return json.loads(err.value.response.body)["message"]


def _losses(chart: dict) -> list[float]:
    return [y for _, y in chart["series"]["loss"]["0"]]


async def test_two_run_1s_of_two_histories_each_open_their_own(jp_fetch, history, tmp_path):
    _history_with_run_1(history, [9.0, 8.0, 7.0])  # the default history's run 1
    mine = str(tmp_path / "mine.sqlite")  # DistSession(history=...): the user's own file
    elsewhere = str(tmp_path / "elsewhere.sqlite")  # a history no cluster of the server uses
    _history_with_run_1(elsewhere, [5.0])
    session = DistSession(1, cpu=True, history=mine, timeout=120)
    await asyncio.to_thread(session.start)
    try:
        await asyncio.to_thread(
            session.run, "for i in range(4):\n    nbdist.log(step=i, loss=0.5 + i)"
        )
        later = RunStore(history)  # a run of the default history begun after mine
        later.new_run(world_size=1, backend="gloo")
        later.close()
        runs = (await _get(jp_fetch, "nbdist", "api", "runs"))["runs"]
        # Oldest first across both histories: the sidebar shows the newest 50 of them.
        assert [(r["history"], r["id"]) for r in runs] == [(history, 1), (mine, 1), (history, 2)]
        ones = {r["history"]: r for r in runs if r["id"] == 1}
        assert set(ones) == {history, mine}, runs  # both listed, told apart by their history
        assert (ones[history]["points"], ones[history]["running"]) == (3, False)
        assert (ones[mine]["points"], ones[mine]["running"]) == (4, True)

        # Each one's chart is its own run's points, whichever history comes first.
        own = await _get(jp_fetch, "nbdist", "api", "runs", "1", history=mine)
        assert _losses(own) == [0.5, 1.5, 2.5, 3.5]
        assert (own["history"], own["running"]) == (mine, True)
        default = await _get(jp_fetch, "nbdist", "api", "runs", "1", history=history)
        assert _losses(default) == [9.0, 8.0, 7.0]
        assert (default["history"], default["running"]) == (history, False)
        # Without a history: the first that holds the run, the default one (as before).
        assert _losses(await _get(jp_fetch, "nbdist", "api", "runs", "1")) == [9.0, 8.0, 7.0]

        # A history the server does not list is refused, and not read, even if it exists;
        # so is another spelling of a listed one, and a run missing from a listed one.
        for path in (elsewhere, "", mine.replace("mine.sqlite", "./mine.sqlite")):
            message = await _refused(jp_fetch, path)
            assert "is not one the server reads" in message and "GET nbdist/api/runs" in message
        with pytest.raises(HTTPClientError) as err:
            await jp_fetch("nbdist", "api", "runs", "2", params={"history": mine})
        assert err.value.code == 404
        assert f"run 2 is not in history {mine!r}" in json.loads(err.value.response.body)["message"]
    finally:
        await asyncio.to_thread(session.stop)
    # Its cluster stopped: its history is no longer listed, and a chart asking for it is told.
    runs = (await _get(jp_fetch, "nbdist", "api", "runs"))["runs"]
    assert {r["history"] for r in runs} == {history}
    assert "its cluster may have stopped" in await _refused(jp_fetch, mine)
