"""The run history (SQLite) and the signed wire format, without engines."""

from __future__ import annotations

import math

import pytest

from nbdist.metrics import wire
from nbdist.metrics.run import Run
from nbdist.metrics.store import RunStore, load_run, runs


def test_signed_messages_round_trip_and_forgeries_are_dropped():
    key = b"cluster-key"
    frames = wire.encode(key, {"k": "points", "rank": 1, "points": [[0, 1.5, {"loss": 2.0}]]})
    assert wire.decode(key, frames) == {
        "k": "points",
        "rank": 1,
        "points": [[0, 1.5, {"loss": 2.0}]],
    }
    assert wire.decode(b"other-key", frames) is None
    tampered = [frames[0], frames[1].replace(b"2.0", b"9.0")]
    assert wire.decode(key, tampered) is None
    assert wire.decode(key, [frames[1]]) is None
    # A correctly signed payload that is not JSON is still refused (never unpickled).
    import hashlib
    import hmac

    junk = b"\x80\x04K\x01."  # a pickle
    assert (
        wire.decode(key, [hmac.new(key, junk, hashlib.sha256).hexdigest().encode(), junk]) is None
    )


def test_history_keeps_every_point_and_reads_back(tmp_path):
    path = str(tmp_path / "h.sqlite")
    store = RunStore(path)
    run = store.new_run(world_size=2, backend="gloo", label="demo")
    points0 = [(i, 100.0 + i, {"loss": 1.0 / (i + 1), "samples": 8.0}) for i in range(50)]
    points1 = [(i, 100.5 + i, {"loss": 2.0 / (i + 1)}) for i in range(50)]
    points1[3][2]["grad_norm"] = math.nan
    for rank, pts in ((0, points0), (1, points1)):
        run.add(rank, pts)
        store.append(run.id, rank, pts)
    store.end_run(run.id)
    store.close()

    [record] = runs(path)
    assert (record.world_size, record.backend, record.label, record.points) == (
        2,
        "gloo",
        "demo",
        100,
    )
    assert record.ended is not None
    loaded = load_run(run.id, path=path)
    assert loaded.count(0) == 50 and loaded.count(1) == 50
    assert loaded.series("loss", 1) == run.series("loss", 1)
    assert math.isnan(loaded.last(1)["grad_norm"])  # NaN survives the round trip
    frame = record.to_pandas()
    assert list(frame.columns[:3]) == ["rank", "step", "time"]
    assert len(frame) == 100
    assert frame[(frame["rank"] == 0) & (frame["step"] == 4)]["loss"].item() == pytest.approx(0.2)


def test_runs_on_a_missing_history_is_empty(tmp_path):
    assert runs(str(tmp_path / "none.sqlite")) == []
    with pytest.raises(KeyError, match="nbdist.runs"):
        RunStore(str(tmp_path / "h.sqlite"))  # creates the file
        load_run(42, path=str(tmp_path / "h.sqlite"))


def test_a_history_being_created_reads_as_empty_and_another_database_is_named(tmp_path):
    # The file exists a moment before its tables (a kernel's RunStore is opening it): the
    # sidebar, reading then, got "no such table: runs" as a server error.
    import sqlite3

    creating = tmp_path / "history.sqlite"
    sqlite3.connect(creating).execute("PRAGMA journal_mode=WAL").fetchall()
    assert creating.exists() and runs(str(creating)) == []
    other = tmp_path / "other.sqlite"
    with sqlite3.connect(other) as conn:
        conn.execute("CREATE TABLE notes (text)")
    with pytest.raises(ValueError, match="other.sqlite' is no nbdist run history"):
        runs(str(other))


def test_histories_read_while_a_kernel_creates_them_never_fail(tmp_path):
    """A reader racing a kernel's RunStore creating the history: the read that found no
    ``runs`` table and then saw the tables, committed a moment later, called the file no run
    history (the sidebar's GET /nbdist/api/runs answered 500; 32 of 300 creations here).
    Each creation is raced by a reader that polls until the history exists whole."""
    import threading

    failed = []
    for i in range(150):
        path = str(tmp_path / f"h{i}.sqlite")
        created = threading.Event()

        def read(path, created):
            while not created.is_set():
                try:
                    runs(path)
                except ValueError as exc:
                    failed.append(exc)
                    return

        reader = threading.Thread(target=read, args=(path, created))
        reader.start()
        RunStore(path)._conn.close()
        created.set()
        reader.join()
        assert runs(path) == []  # whole: an empty history
    assert not failed, failed[:1]


def test_run_to_pandas_one_row_per_rank_and_step():
    run = Run(1, world_size=2)
    run.add(0, [(0, 1.0, {"loss": 3.0}), (0, 1.1, {"memory_mib": 5.0}), (1, 2.0, {"loss": 2.0})])
    run.add(1, [(0, 1.0, {"loss": 4.0})])
    frame = run.to_pandas()
    assert frame[["rank", "step"]].values.tolist() == [[0, 0], [0, 1], [1, 0]]
    row = frame.iloc[0]
    assert row["loss"] == 3.0 and row["memory_mib"] == 5.0  # merged by (rank, step)


def test_run_to_pandas_a_later_nan_wins_over_the_value_before_it():
    # A resumed run logs step 5 again and has diverged: the frame shows the NaN it logged
    # last (not the 0.25 from before the resume); a key the later point lacks stays merged.
    run = Run(1, world_size=1)
    run.add(0, [(4, 1.0, {"loss": 0.5}), (5, 1.1, {"loss": 0.25, "acc": 0.9})])
    run.add(0, [(5, 9.0, {"loss": math.nan}), (6, 9.1, {"loss": math.inf})])
    frame = run.to_pandas()
    assert frame["step"].tolist() == [4, 5, 6]
    assert frame["loss"].tolist()[0] == 0.5 and math.isnan(frame["loss"].tolist()[1])
    assert frame["loss"].tolist()[2] == math.inf and frame["acc"].tolist()[1] == 0.9
    assert frame["time"].iloc[1].timestamp() == 9.0  # when the step was last logged


def _points(rank: int, total: int) -> dict:
    return {"k": "points", "rank": rank, "points": [[total, 1.0, {"loss": 1.0}]], "total": total}


def _marker(rank: int, cell: int) -> dict:
    return {"k": "cell", "rank": rank, "cell": cell}


@pytest.mark.parametrize(
    "message, wait",
    [(_points, "wait_for_points"), (_marker, "wait_for_cells")],
    ids=["notebook: running count of points", "script: end marker"],
)
def test_after_a_restart_the_end_of_a_cell_waits_for_the_new_ranks(message, wait, push_to):
    """Fresh ranks count from 1 again: what the old ranks reached (9) must not do."""
    from nbdist.metrics.collector import Collector

    old_key, new_key = b"k" * 32, b"n" * 32
    collector = Collector(old_key, Run(1, world_size=1), None)
    wait = getattr(collector, wait)
    push = push_to(collector)
    try:
        push.send_multipart(wire.encode(old_key, message(0, 9)))
        assert wait({0: 9}, timeout=10)
        collector.new_cluster(new_key)
        assert not wait({0: 1}, timeout=0.2), "what the old ranks sent counted"
        push.send_multipart(wire.encode(new_key, message(0, 1)))
        assert wait({0: 1}, timeout=10)
    finally:
        collector.stop()


def test_the_end_of_a_cell_waits_until_a_ranks_points_are_in_the_history(tmp_path, push_to):
    """A cell returns once the count its rank reported has arrived, and its points are
    readable from the history then, not only in memory."""
    from nbdist.metrics.collector import Collector

    key = b"k" * 32
    store = RunStore(str(tmp_path / "runs.sqlite"))
    run = store.new_run(world_size=1, backend="gloo")
    collector = Collector(key, run, store)
    push = push_to(collector)
    try:
        assert not collector.wait_for_points({0: 2}, timeout=0.2), "nothing was sent yet"
        push.send_multipart(wire.encode(key, _points(0, 1)))
        assert not collector.wait_for_points({0: 2}, timeout=0.2), "1 of 2 points counted as all"
        push.send_multipart(wire.encode(key, _points(0, 2)))
        assert collector.wait_for_points({0: 2}, timeout=10)
        collector.commit()
        assert len(load_run(run.id, path=str(tmp_path / "runs.sqlite")).to_pandas()) == 2
    finally:
        collector.stop()
        store.close()


def test_to_pandas_has_dates_and_whole_counts(tmp_path):
    """Times read as dates, counts as integers (with <NA> where a rank did not log them),
    measurements stay floats; the same from the history as from memory."""
    store = RunStore(str(tmp_path / "h.sqlite"))
    run = store.new_run(world_size=2)
    t0 = 1_790_000_000.0  # 2026-09-21 UTC
    points = {
        0: [[0, t0, {"loss": 2.5, "samples": 64.0}], [1, t0 + 1.5, {"loss": 1.5, "samples": 64.0}]],
        1: [[0, t0 + 0.1, {"loss": 2.25}], [1, t0 + 1.6, {"loss": 1.25, "samples": 32.0}]],
    }
    for rank, batch in points.items():
        run.add(rank, [tuple(p) for p in batch])
        store.append(run.id, rank, batch)
    store.close()
    for frame in (run.to_pandas(), load_run(run.id, path=store.path).to_pandas()):
        assert str(frame["time"].dtype) == "datetime64[ns, UTC]"
        assert frame["time"].iloc[0].isoformat() == "2026-09-21T14:13:20+00:00"
        assert str(frame["samples"].dtype) == "Int64"
        assert frame["samples"].tolist()[:2] == [64, 64] and frame["samples"].isna().sum() == 1
        assert frame["loss"].dtype == float


def test_a_signed_message_the_kernel_cannot_read_is_counted_and_the_next_one_arrives(push_to):
    """A message in a shape this kernel cannot read (a rank of another version, say) is
    rejected and counted; the collector goes on taking the ones after it."""
    from nbdist.metrics.collector import Collector

    key = b"k" * 32
    run = Run(1, world_size=1)
    collector = Collector(key, run, None)
    push = push_to(collector)
    unreadable = {
        "k": "points",
        "rank": 0,
        "step0": 0,
        "n": 2,
        "times": wire.floats([1.0, 2.0]),
        "cols": {"loss": [None, {"same": "no such column"}]},
        "total": 2,
    }
    try:
        push.send_multipart(wire.encode(key, unreadable))
        push.send_multipart(wire.encode(key, _points(0, 2)))
        assert collector.wait_for_points({0: 2}, timeout=10), "the readable message was lost"
        assert collector.rejected == 1
        assert run.series("loss", 0) == ([2], [1.0])  # only the readable message's point
    finally:
        collector.stop()


def test_a_history_given_by_a_relative_path_is_found_from_another_directory(tmp_path, monkeypatch):
    # The kernel registers its history's path; the Jupyter server (the sidebar) and other
    # kernels read it from working directories of their own.
    (tmp_path / "notebooks").mkdir()
    (tmp_path / "server").mkdir()
    monkeypatch.chdir(tmp_path / "notebooks")
    store = RunStore("mine.sqlite")
    run = store.new_run(world_size=1, backend="gloo")
    store.append(run.id, 0, [[0, 1.0, {"loss": 0.5}]])
    store.commit()
    store.close()
    monkeypatch.chdir(tmp_path / "server")
    assert store.path == str(tmp_path / "notebooks" / "mine.sqlite")
    assert load_run(run.id, path=store.path).series("loss", 0) == ([0], [0.5])
