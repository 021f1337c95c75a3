"""nbdist.log through real engines into the kernel's collector and the run history."""

from __future__ import annotations

import gc
import json
import time
import weakref

import pytest

import nbdist
from nbdist.driver.sinks import ListSink
from nbdist.metrics import wire


@pytest.fixture(scope="module")
def session(tmp_path_factory):
    history = str(tmp_path_factory.mktemp("history") / "runs.sqlite")
    with nbdist.DistSession(2, cpu=True, timeout=120, history=history) as s:
        yield s


def test_every_point_arrives_per_rank(session):
    before = [session.metrics.count(r) for r in (0, 1)]
    # Fast logging (no sleeps): thousands of points between flushes, none may be lost.
    session.run(
        "for i in range(3000):\n    nbdist.log(step=i, loss=torch.tensor(1.0 / (i + 1)), lr=0.1)\n",
        sink=ListSink(),
    )
    after = [session.metrics.count(r) for r in (0, 1)]
    assert [a - b for a, b in zip(after, before)] == [3000, 3000]
    steps, losses = session.metrics.series("loss", 1)
    assert steps[-3000:] == list(range(3000))
    assert losses[-1] == pytest.approx(1 / 3000)


def test_throughput_and_step_time_are_derived(session):
    session.run(
        "import time\n"
        "for i in range(6):\n"
        "    time.sleep(0.02)\n"
        "    nbdist.log(step=100 + i, samples=32, tokens=64)\n",
        sink=ListSink(),
    )
    last = session.metrics.last(0)
    assert last["step"] == 105
    assert last["step_time"] >= 0.02
    # samples/s is samples over the time since the previous log call, exactly.
    assert last["samples_per_s"] * last["step_time"] == pytest.approx(32)
    assert last["tokens_per_s"] == pytest.approx(2 * last["samples_per_s"])
    assert last["memory_mib"] > 10  # the rank's RSS, sampled at the flush


def test_a_cells_first_point_does_not_take_the_pause_before_the_cell_as_its_step(session):
    # Steps no other test of the module logs (the session's run keeps them all).
    cell = "for i in range(3):\n    nbdist.log(step=STEP + i, samples=32)\n"
    session.run(cell.replace("STEP", "90000"), sink=ListSink())
    time.sleep(1.5)  # the user reads the last cell's output
    session.run(cell.replace("STEP", "90003"), sink=ListSink())
    for rank in (0, 1):
        steps, step_times = session.metrics.series("step_time", rank)
        timed = {s: t for s, t in zip(steps, step_times) if s >= 90000}
        # Within a cell each point has the time since the previous one; the first point of
        # the second cell has none (it had the 1.5 s pause, and a samples/s near 0).
        assert sorted(timed) == [90001, 90002, 90004, 90005]
        assert all(t < 1.5 for t in timed.values())
        rates = dict(zip(*session.metrics.series("samples_per_s", rank)))
        assert 90003 not in rates and 90004 in rates
        assert session.metrics.last(rank)["step"] == 90005  # steps still count on


def test_history_has_the_points_after_the_run(session):
    record = [r for r in nbdist.runs(session.history) if r.id == session.metrics.id][0]
    frame = record.to_pandas()
    assert set(frame["rank"]) == {0, 1}
    assert len(frame) == len(session.metrics.to_pandas())


def test_every_step_of_every_rank_arrives_exactly_live_forwarded_and_in_the_history(session):
    from nbdist.metrics.store import load_run

    forwarded = []
    with session.metrics.forward(forwarded.append) as forwarder:
        # Several flushes' worth per rank, tensors and numbers, values known to the bit.
        session.run(
            "for i in range(4000):\n"
            "    nbdist.log(step=50_000 + i, loss=torch.tensor(i * 0.25 + rank), n=i)\n",
            sink=ListSink(),
        )
        assert forwarder.wait(timeout=30)
    history = load_run(session.metrics.id, path=session.history)
    for rank in (0, 1):
        want_steps = list(range(50_000, 54_000))
        want_loss = [i * 0.25 + rank for i in range(4000)]
        for run in (session.metrics, history):
            steps, losses = run.series("loss", rank)
            assert steps[-4000:] == want_steps
            assert losses[-4000:] == want_loss
            assert run.series("n", rank)[1][-4000:] == [float(i) for i in range(4000)]
        mine = [p for p in forwarded if p.rank == rank]
        assert [p.step for p in mine] == want_steps
        assert [p.values["loss"] for p in mine] == want_loss
    assert session.metrics.dropped_total() == 0


def test_points_reach_the_kernel_while_the_cell_still_runs(session):
    # The dashboard is live: a point logged mid-cell is in the run before the cell ends.
    before = session.metrics.count(0)
    pending = session.run(
        "import time\nnbdist.log(step=90_000, loss=1.0)\ntime.sleep(4)\n",
        block=False,
        sink=ListSink(),
    )
    try:
        seen = False
        for _ in range(80):
            if session.metrics.count(0) > before:
                seen = True
                break
            time.sleep(0.05)
        assert seen, "no point arrived while the cell ran"
        assert not pending.done()
    finally:
        pending.wait()


def test_forged_metrics_are_rejected(session):
    import zmq

    collector = session.metrics_hub.collector
    assert collector.url.startswith("tcp://127.0.0.1:")
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.connect(collector.url)
    rejected = collector.rejected
    count = session.metrics.count(0)
    sock.send_multipart(
        wire.encode(
            b"not-the-cluster-key", {"k": "points", "rank": 0, "points": [[9, 1.0, {"loss": 0}]]}
        )
    )
    sock.send_multipart([b"garbage"])
    import time

    deadline = time.monotonic() + 10
    while collector.rejected < rejected + 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    sock.close(0)
    ctx.term()
    assert collector.rejected == rejected + 2
    assert session.metrics.count(0) == count


def test_log_never_raises_into_the_training_loop(session):
    session.run(
        "nbdist.log(loss='not a number', bad=object(), good=1.0)\nok = True", sink=ListSink()
    )
    assert session.pull("ok") == [True, True]
    assert session.metrics.last(0)["good"] == 1.0


def test_after_a_restart_a_cell_returns_with_its_points_in_the_run(session):
    for _ in range(5):  # the old ranks' cell count climbs well past the new ranks' first cells
        session.run("pass", sink=ListSink())
    old_client = weakref.ref(session.client)
    session.restart()
    before = session.metrics.count()
    session.run(
        "import time\nfor i in range(3):\n    nbdist.log(step=i, loss=1.0)\n    time.sleep(0.05)",
        sink=ListSink(),
    )
    # The end of the cell waits for each rank's points: they are all here at once.
    assert session.metrics.count() - before == 6
    gc.collect()
    # A fast restart keeps the controller, and the client with it; a full one must let
    # the stopped cluster's client (and its sockets' state) go.
    if old_client() is not session.client:
        assert old_client() is None, "the stopped cluster's client (and its sockets' state) is kept"


def test_a_failing_cell_returns_with_every_point_it_logged_before_the_error(session):
    """The points a cell logged before it raised are all in the run when the error shows.

    Each rank's execute reply says how many points it has sent, failed cells included
    (nbdist.engine.cell_reply), and the kernel waits for that many before the cell ends.
    3,000 points per rank without pauses: far more than one flush (5 a second) takes.
    """
    before = [session.metrics.count(r) for r in (0, 1)]
    with pytest.raises(nbdist.RankError) as info:
        session.run(
            "for i in range(3000):\n    nbdist.log(step=i, loss=float(i))\n"
            "raise ValueError('after the points')\n",
            sink=ListSink(),
        )
    assert "after the points" in str(info.value)
    after = [session.metrics.count(r) for r in (0, 1)]
    assert [a - b for a, b in zip(after, before)] == [3000, 3000]
    steps, losses = session.metrics.series("loss", 0)
    assert steps[-1] == 2999 and losses[-1] == 2999.0


_SCRIPT_FORWARDING_ON_RANK_0 = """
import json
import torch, nbdist
from nbdist.engine.standalone import init, finish, metrics_run
rank, local_rank, world_size, device = init()
got = []
forwarder = metrics_run().forward(got.append) if rank == 0 else None
assert (metrics_run() is None) == (rank != 0)
# The forwarder hands on what arrives from then on: rank 1 logs once it is there.
torch.distributed.barrier()
for i in range(500):
    nbdist.log(step=i, loss=torch.tensor(i + 0.5 * rank))
finish()
if forwarder is not None:
    forwarder.close()
    print("FORWARDED", json.dumps(sorted((p.rank, p.step, p.values["loss"]) for p in got)))
"""


def test_a_torchrun_script_forwards_every_rank_s_points_to_a_callback_on_rank_0(tmp_path):
    import os

    from tests.conftest import run_torchrun

    script = tmp_path / "forward.py"
    script.write_text(_SCRIPT_FORWARDING_ON_RANK_0)
    env = dict(os.environ, NBDIST_HISTORY=str(tmp_path / "h.sqlite"), OMP_NUM_THREADS="1")
    returncode, output = run_torchrun(script, 2, env, tmp_path)
    assert returncode == 0, output[-3000:]
    line = next(x for x in output.splitlines() if x.startswith("FORWARDED"))
    forwarded = [tuple(p) for p in json.loads(line.split(" ", 1)[1])]
    assert forwarded == [(r, i, i + 0.5 * r) for r in (0, 1) for i in range(500)]
