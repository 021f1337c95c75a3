"""GET nbdist/api/runs and runs/<id> in a real jupyter_server: the history is read off the
event loop, and a run once.

Real components: the server (pytest-jupyter), the real run history written by the
real store (SQLite). The store's ``runs`` and ``load_run`` are wrapped only to see where and how
often it runs (and, in the first test, to hold it until the test lets it finish).
"""

from __future__ import annotations

import asyncio
import json
import threading
import time

import pytest

from nbdist.metrics import store
from nbdist.metrics.store import RunStore


def _write_run(path: str, *, ranks: int = 2, steps: int = 20) -> tuple[RunStore, int]:
    """A run of ``ranks`` ranks logging loss for ``steps`` steps; the store is left open."""
    writer = RunStore(path)
    run = writer.new_run(world_size=ranks, backend="gloo")
    t0 = time.time()
    for rank in range(ranks):
        writer.append(run.id, rank, [[s, t0 + s, {"loss": 2.0 - s / 100}] for s in range(steps)])
    writer.commit()
    return writer, run.id


async def _get_run(jp_fetch, run_id: int) -> dict:
    response = await jp_fetch("nbdist", "api", "runs", str(run_id))
    assert response.code == 200
    return json.loads(response.body)


def _watch(monkeypatch, name: str, hold: threading.Event | None = None):
    """Wrap ``store.<name>`` (load_run or runs): ``(calls, entered)``, each call appending
    where it ran to ``calls`` and setting ``entered``; ``hold`` keeps a call until it is set."""
    real, calls = getattr(store, name), []
    entered = threading.Event()

    def watched(*args, **kwargs):
        try:
            asyncio.get_running_loop()
            on_loop = True
        except RuntimeError:
            on_loop = False
        calls.append({"thread": threading.get_ident(), "on_loop": on_loop})
        entered.set()
        if hold is not None:
            # Only a handler that reads on the event loop waits this out (and then fails).
            hold.wait(30)
        return real(*args, **kwargs)

    monkeypatch.setattr(store, name, watched)
    return calls, entered


async def _answered_meanwhile(jp_fetch, request, entered, release):
    """Send ``request`` (a coroutine); once its read is held in the store, the server must
    still answer another request and ``request`` must still wait; then the read goes on.
    Returns what ``request`` returned."""
    pending = asyncio.ensure_future(request)
    try:
        assert await asyncio.to_thread(entered.wait, 60), "the history was never read"
        palette = await jp_fetch("nbdist", "api", "palette")
        assert palette.code == 200
        assert not pending.done(), "the request ended before its read was let go"
    finally:
        release.set()
    return await pending


async def test_a_run_is_read_off_the_event_loop_while_other_requests_are_answered(
    jp_fetch, history, monkeypatch
):
    writer, run_id = _write_run(history)
    writer.end_run(run_id)
    writer.close()
    release = threading.Event()
    calls, entered = _watch(monkeypatch, "load_run", hold=release)

    chart = await _answered_meanwhile(jp_fetch, _get_run(jp_fetch, run_id), entered, release)
    assert chart["id"] == run_id and chart["series"]["loss"]["1"][-1] == [19, 1.81]
    [call] = calls
    assert call["on_loop"] is False, "the run was read on the server's event loop"
    assert call["thread"] != threading.get_ident()


async def test_a_run_opened_again_unchanged_is_not_read_again(jp_fetch, history, monkeypatch):
    writer, run_id = _write_run(history)
    calls, _ = _watch(monkeypatch, "load_run")

    # Two clicks at once, then one more: one read of the run's points.
    first, second = await asyncio.gather(_get_run(jp_fetch, run_id), _get_run(jp_fetch, run_id))
    third = await _get_run(jp_fetch, run_id)
    assert first == second == third
    assert len(calls) == 1

    # New points make it another run to show: read again, and they are in it.
    t0 = time.time()
    writer.append(run_id, 0, [[s, t0 + s, {"loss": 0.5}] for s in range(20, 25)])
    writer.commit()
    grown = await _get_run(jp_fetch, run_id)
    assert len(calls) == 2 and grown["series"]["loss"]["0"][-1] == [24, 0.5]

    # Ending the run changes it too (its end time); then it stays cached.
    writer.end_run(run_id)
    writer.close()
    ended = await _get_run(jp_fetch, run_id)
    assert ended["ended"] is not None and len(calls) == 3
    assert await _get_run(jp_fetch, run_id) == ended and len(calls) == 3

    # A run that is not in the history is still a 404, and reads no points.
    from tornado.httpclient import HTTPClientError

    try:
        await jp_fetch("nbdist", "api", "runs", str(run_id + 100))
    except HTTPClientError as err:
        assert err.code == 404
    else:
        raise AssertionError("an unknown run answered")
    assert len(calls) == 3
    # Nor is a run id of 5,000 digits a server error (int() refuses 4,300 and more).
    with pytest.raises(HTTPClientError) as caught:
        await jp_fetch("nbdist", "api", "runs", "9" * 5000)
    assert caught.value.code == 404
    assert b"is not in the history" in caught.value.response.body


async def test_the_list_of_runs_is_read_off_the_event_loop(jp_fetch, history, monkeypatch):
    # GET runs sums every run's batches: a long history's read must not hold the server.
    writer, run_id = _write_run(history)
    writer.close()
    release = threading.Event()
    calls, entered = _watch(monkeypatch, "runs", hold=release)
    listing = await _answered_meanwhile(
        jp_fetch, jp_fetch("nbdist", "api", "runs"), entered, release
    )
    listed = json.loads(listing.body)["runs"]
    assert [r["id"] for r in listed] == [run_id] and listed[0]["points"] == 40
    [call] = calls
    assert call["on_loop"] is False, "the history was read on the server's event loop"


def test_the_payload_cache_keeps_no_lock_for_runs_it_does_not_hold(tmp_path):
    # One lock was kept for every run id ever asked for (absent ones too): a server asked
    # for many ids grew without bound, whatever the cache's size.
    from nbdist.server.runview import PayloadCache

    path = str(tmp_path / "runs.sqlite")
    ids = []
    for _ in range(3):
        writer, run_id = _write_run(path, steps=3)
        writer.close()
        ids.append(run_id)
    cache = PayloadCache(size=2)
    for absent in range(1000, 1200):
        assert cache.payload(absent, [path]) is None
    for run_id in ids:
        assert cache.payload(run_id, [path])[1]["id"] == run_id
    assert len(cache._building) <= 2  # noqa: SLF001 - what the cache holds is the point
