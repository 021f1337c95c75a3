"""A run resumed from a checkpoint: one run, every step once, the resumed values win.

The history keeps every point as it arrived; reading the run (``to_pandas``)
keeps the latest value of each (rank, step). After ``restart()`` the new ranks'
points still reach the same run (the new cluster has a new signing key).
"""

from __future__ import annotations

import time

import pytest

import nbdist
from nbdist.metrics.store import RunStore, load_run


def _points(steps, loss_of):
    return [(s, 1000.0 + s, {"loss": loss_of(s)}) for s in steps]


def test_relogged_steps_read_once_with_the_latest_value(tmp_path):
    store = RunStore(str(tmp_path / "history.sqlite"))
    run = store.new_run(world_size=1)
    # Before the crash: steps 0-34 (the checkpoint was at 30); after resuming: 30-59.
    first = _points(range(35), lambda s: 1.0)
    again = _points(range(30, 60), lambda s: 2.0)
    for batch in (first, again):
        run.add(0, batch)
        store.append(run.id, 0, [[s, t, v] for s, t, v in batch])
    store.commit()
    for read in (run, load_run(run.id, path=store.path)):
        frame = read.to_pandas()
        assert list(frame.step) == list(range(60))  # no hole, no duplicate
        assert set(frame[frame.step < 30].loss) == {1.0}
        assert set(frame[frame.step >= 30].loss) == {2.0}  # the resumed run's values
        assert read.count(0) == 65  # and nothing was thrown away
    store.close()


@pytest.fixture(scope="module")
def session(tmp_path_factory):
    history = str(tmp_path_factory.mktemp("history") / "history.sqlite")
    with nbdist.DistSession(2, cpu=True, timeout=120, history=history) as s:
        yield s


def _eventually(read, want, timeout: float = 60.0):
    """``read()`` once it equals ``want`` (points may still be on their way on a busy machine)."""
    deadline = time.monotonic() + timeout
    while True:
        got = read()
        if got == want or time.monotonic() > deadline:
            return got
        time.sleep(0.2)


def _losses(run):
    frame = run.to_pandas()
    return {
        r: list(zip(frame[frame["rank"] == r].step, frame[frame["rank"] == r].loss)) for r in (0, 1)
    }


def test_metrics_after_restart_continue_the_same_run(session):
    session.run("for i in range(5):\n    nbdist.log(step=i, loss=1.0)")
    run_id = session.metrics.id
    session.restart()
    session.run("for i in range(3, 8):\n    nbdist.log(step=i, loss=2.0)")
    assert session.metrics.id == run_id
    # Steps 0-7 once each; 3 and 4 with the values logged after the restart.
    want = {r: [(s, 1.0 if s < 3 else 2.0) for s in range(8)] for r in (0, 1)}
    assert _eventually(lambda: _losses(session.metrics), want) == want
    assert _eventually(lambda: _losses(load_run(run_id, path=session.history)), want) == want
