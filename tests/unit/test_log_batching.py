"""nbdist.log's batching in one process: a real rank-side channel sending to a real collector.

Nothing is started but the collector's thread and the channel's flush thread, so
these run in the unit tier; tests/dist/test_metrics.py does the same through real ranks.
"""

from __future__ import annotations

import math
import os

import numpy as np
import pytest
import torch

from nbdist.metrics import log as metrics_log
from nbdist.metrics.collector import Collector
from nbdist.metrics.store import load_run


def _stored_channel(tmp_path):
    """A channel whose collector also writes the run's history (tmp_path/h.sqlite):
    ``(run, collector, store)``; close with :func:`_close_stored`."""
    from nbdist.metrics.store import RunStore

    key = os.urandom(16)
    store = RunStore(str(tmp_path / "h.sqlite"))
    run = store.new_run(world_size=1)
    collector = Collector(key, run, store)
    metrics_log.configure(collector.url, key, 0)
    return run, collector, store


def _close_stored(collector, store) -> None:
    metrics_log.shutdown()
    collector.stop()
    store.close()


def _settle(collector) -> None:
    total = metrics_log.end_of_cell()
    assert collector.wait_for_points({0: total}, timeout=10)


def test_every_point_arrives_with_its_exact_values(channel):
    run, collector = channel
    weight = torch.ones(3, requires_grad=True)
    for step in range(5000):
        loss = (weight * step).sum() / 3  # a tensor in the autograd graph, value == step
        metrics_log.log(step=step, loss=loss, samples=torch.tensor(8), lr=0.5, ok=True)
    _settle(collector)
    steps, losses = run.series("loss", 0)
    assert steps == list(range(5000))
    assert losses == [float(s) for s in range(5000)]
    assert run.series("samples", 0)[1] == [8.0] * 5000
    assert run.series("lr", 0)[1] == [0.5] * 5000
    assert run.series("ok", 0)[1] == [1.0] * 5000
    assert metrics_log.dropped() == 0


def test_a_flush_that_waits_returns_once_the_collector_has_every_point(channel):
    # What nbdist.checkpoint.save relies on: a rank killed after such a flush keeps its
    # points. Sent is not arrived (zmq's I/O thread sends later): without the collector's
    # answer, a rank killed right after a flush lost it about once in 10 beside CPU burners.
    run, collector = channel
    for round_ in range(20):
        for step in range(round_ * 50, round_ * 50 + 50):
            metrics_log.log(step=step, loss=float(step))
        assert metrics_log.flush(wait_s=10)
        # No waiting here: the points are in the run already.
        assert run.count(0) == round_ * 50 + 50, f"round {round_}"
    assert run.series("loss", 0)[0] == list(range(1000))


def test_a_flush_that_waits_says_so_when_no_collector_answers():
    # A collector that takes messages but never answers: the wait ends at its limit with
    # False (nbdist.checkpoint.save then goes on; the points stay on their way).
    import zmq

    context = zmq.Context()
    silent = context.socket(zmq.ROUTER)  # takes messages, never answers
    port = silent.bind_to_random_port("tcp://127.0.0.1")
    metrics_log.configure(f"tcp://127.0.0.1:{port}", os.urandom(16), 0)
    try:
        metrics_log.log(step=0, loss=1.0)
        assert metrics_log.flush(wait_s=0.3) is False
    finally:
        metrics_log.shutdown()
        silent.close(linger=0)
        context.term()


def test_derived_keys_are_exact_per_point(channel):
    run, collector = channel
    for step in range(300):
        metrics_log.log(step=step, samples=32, tokens=64, flops=1e9, peak_tflops=2.0)
    _settle(collector)
    times = run.timeline("samples", 0)[0]
    step_steps, step_times = run.series("step_time", 0)
    # Every point but the first has the time since the previous call, to the bit.
    assert step_steps == list(range(1, 300))
    assert step_times == [b - a for a, b in zip(times, times[1:])]
    rate = dict(zip(*run.series("samples_per_s", 0)))
    tflops = dict(zip(*run.series("tflops", 0)))
    mfu = dict(zip(*run.series("mfu", 0)))
    for step, dt in zip(step_steps, step_times):
        if dt > 0:
            assert rate[step] == 32 / dt
            assert tflops[step] == 1e9 / dt / 1e12
            assert mfu[step] == pytest.approx(tflops[step] / 2.0)
    parts = [run.series(k, 0)[1] for k in ("comm_s", "data_s", "compute_s")]
    for total, comm, data, compute in zip(step_times, *parts):
        assert comm + data + compute == pytest.approx(total)
    # Memory is read once per flush, and every point of the batch carries that reading.
    assert run.series("memory_mib", 0)[0] == list(range(300))
    assert all(m > 1 for m in run.series("memory_mib", 0)[1])
    assert "peak_tflops" not in run.keys()


def test_a_logged_step_leaves_no_object_for_the_garbage_collector(channel):
    # Each point used to be kept as a tuple and a dict until the flush: objects the cyclic
    # garbage collector tracks, so logging every step set off collections - pauses of the
    # training thread that scanned the whole heap. Now a point's fields are appended to lists.
    import gc
    import time

    run, collector = channel
    metrics_log.log(step=0, loss=1.0)  # the flush thread sends this one at once ...
    _settle(collector)
    time.sleep(0.05)  # ... and its next flush is 0.5 s after that one
    y = torch.tensor(0.25)
    gc.collect()
    before = len(gc.get_objects())
    for step in range(1, 2001):
        metrics_log.log(step=step, loss=y, samples=64, lr=0.1)
    grown = len(gc.get_objects()) - before
    assert grown < 100, f"2,000 logged steps left {grown} tracked objects waiting for the flush"
    _settle(collector)
    assert run.series("loss", 0) == (list(range(2001)), [1.0] + [0.25] * 2000)


def test_steps_count_on_by_default_and_nan_stays_nan(channel):
    run, collector = channel
    for _ in range(3):
        metrics_log.log(loss=float("nan"))
    metrics_log.log(step=10, loss=torch.tensor(float("nan")))
    metrics_log.log(loss=torch.tensor([2.5]))  # one element, not 0-d: read all the same
    _settle(collector)
    steps, losses = run.series("loss", 0)
    assert steps == [0, 1, 2, 10, 11]
    assert all(math.isnan(v) for v in losses[:4]) and losses[4] == 2.5


def test_columns_keep_sparse_keys_at_their_steps_live_and_in_the_history(tmp_path):
    # A batch goes as columns (each key once, with the points that carry it): a key logged
    # on some steps only, a value that is no number, NaN and many flushes must come out
    # point for point, in the kernel's run and in the history read back.
    run, collector, store = _stored_channel(tmp_path)
    try:
        for step in range(2000):
            values = {"loss": torch.tensor(step / 7)}
            if step % 7 == 0:
                values["grad_norm"] = float("nan") if step % 14 == 0 else step * 0.5
            if step == 5:
                values["note"] = "not a number"  # skipped, the rest of the point kept
            metrics_log.log(step=step, **values)
            if step % 333 == 0:
                metrics_log.flush()  # several batches, some of a single point
        _settle(collector)
    finally:
        _close_stored(collector, store)
    loaded = load_run(run.id, path=str(tmp_path / "h.sqlite"))
    for got in (run, loaded):
        expected = [torch.tensor(s / 7).item() for s in range(2000)]  # float32, as logged
        assert got.series("loss", 0) == (list(range(2000)), expected)
        steps, norms = got.series("grad_norm", 0)
        assert steps == list(range(0, 2000, 7))
        for step, norm in zip(steps, norms):
            assert math.isnan(norm) if step % 14 == 0 else norm == step * 0.5
        assert "note" not in got.keys()
        assert got.series("step_time", 0)[0] == list(range(1, 2000))
        assert got.series("memory_mib", 0)[0] == list(range(2000))
    assert loaded.series("step_time", 0) == run.series("step_time", 0)
    # A run id from a DataFrame is a NumPy integer; text is refused naming its type.
    again = load_run(np.int64(run.id), path=str(tmp_path / "h.sqlite"))
    assert again.series("loss", 0) == loaded.series("loss", 0)
    with pytest.raises(TypeError, match=rf"run id '{run.id}' \(a str\): give the run's number"):
        load_run(str(run.id), path=str(tmp_path / "h.sqlite"))


def test_a_follower_of_the_history_sees_every_point_of_the_columns(tmp_path):
    # A named session's kernel follows the keeper's history (nbdist.metrics.follow): it must
    # read the batches as columns exactly as the keeper's collector took them, old rows too.
    from nbdist.metrics.follow import FollowHub
    from nbdist.metrics.store import RunStore

    path = str(tmp_path / "h.sqlite")
    key = os.urandom(16)
    store = RunStore(path)
    run = store.new_run(world_size=1)
    store.append(run.id, 0, [[-1, 1.0, {"loss": 9.0}]])  # a row of the per-point form
    store.commit()
    collector = Collector(key, run, store)
    metrics_log.configure(collector.url, key, 0)
    follower = None
    try:
        for step in range(500):
            metrics_log.log(step=step, loss=step * 0.25, samples=4)
        metrics_log.log(step=500, note="fast")  # told of in the history too
        _settle(collector)
        collector.commit()
        follower = FollowHub(path, run.id, url=collector.url, world_size=1)
        assert follower.run.left_out == {"note": (0, "'fast' (a str)")}
        assert follower.run.series("loss", 0) == (
            [-1, *range(500)],
            [9.0, *(s * 0.25 for s in range(500))],
        )
        assert follower.run.series("samples_per_s", 0) == run.series("samples_per_s", 0)
    finally:
        if follower is not None:
            follower.close()
        metrics_log.shutdown()
        collector.stop()
        store.close()


def test_a_listener_that_raises_loses_no_point_and_is_counted(channel):
    # A dashboard's or a user's listener with a bug must not stop the collector counting
    # what arrived: the cell would then wait for points that came, and time out.
    run, collector = channel

    def broken(_run):
        raise RuntimeError("a listener's bug")

    run.subscribe(broken)
    run.on_points(lambda rank, points: 1 / 0)
    for step in range(300):
        metrics_log.log(step=step, loss=float(step))
    _settle(collector)
    assert run.series("loss", 0) == (list(range(300)), [float(s) for s in range(300)])
    assert run.listener_errors >= 2


def test_a_value_every_point_shares_travels_once_and_reads_back_on_every_point():
    # A flush's memory reading is on every point of the batch: the wire carries it once
    # (a number, null for NaN), and the kernel reads it back on every point it stands for.
    import numpy as np

    from nbdist.metrics.wire import column, columns, floats

    assert column(12.5) == 12.5 and column(float("nan")) is None
    assert column(np.array([64.0, 64.0, 64.0])) == 64.0  # the same value on every point
    assert isinstance(column(np.array([0.0, -0.0])), str)  # equal, not the same bits: kept
    message = {
        "k": "points",
        "steps": [4, 5, 6],
        "times": floats([1.0, 2.0, 3.0]),
        "cols": {
            "memory_mib": [None, column(12.5)],
            "gpu_util": [[0, 2], column(float("nan"))],
            "loss": [None, column([0.5, 0.25, 0.125])],
        },
    }
    steps, times, cols = columns(message)
    assert steps == [4, 5, 6] and times == [1.0, 2.0, 3.0]
    assert cols["memory_mib"] == (None, [12.5, 12.5, 12.5])
    assert cols["gpu_util"][0] == [0, 2] and all(math.isnan(v) for v in cols["gpu_util"][1])
    assert cols["loss"] == (None, [0.5, 0.25, 0.125])


def test_steps_left_out_count_on_across_flushes_and_a_key_may_skip_points(channel):
    # A step not given is one more than the point before it, also when that point went in
    # an earlier batch; a key missing from some points keeps its values at its own steps.
    run, collector = channel
    steps, aux_steps, step = [], [], -1
    for j in range(60):
        if j % 10 == 0:
            metrics_log.flush()  # a batch boundary every ten points
        given = {5: 100, 25: 50}.get(j)
        step = given if given is not None else step + 1
        steps.append(step)
        values = {"loss": float(j)}
        if j % 4 != 1 and not 30 <= j < 40:  # gone on some points, a whole batch, back
            values["aux"] = j * 0.5
            aux_steps.append(step)
        metrics_log.log(step=given, **values)
    _settle(collector)
    assert run.series("loss", 0) == (steps, [float(j) for j in range(60)])
    assert run.series("aux", 0)[0] == aux_steps
    assert run.series("aux", 0)[1] == [steps.index(s) * 0.5 for s in aux_steps]
    # Every point after the first has its step time, the first of each batch included.
    assert run.series("step_time", 0)[0] == steps[1:]


def test_a_batch_sends_its_steps_as_a_range_and_a_repeated_column_once():
    # Steps that follow one another travel as the first and the count; compute_s of a step
    # without collectives or data timers is its step_time to the bit, sent once.
    import zmq

    from nbdist.metrics import wire

    key = os.urandom(16)
    context = zmq.Context()
    pull = context.socket(zmq.ROUTER)  # the collector's kind: each message comes after its sender
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    metrics_log.configure(f"tcp://127.0.0.1:{port}", key, 0)
    try:
        for step in range(200):
            metrics_log.log(step=step, loss=step * 0.5)
        total = metrics_log.end_of_cell()
        messages, received = [], 0
        while received < total:
            assert pull.poll(10_000), "the rank's points did not arrive"
            message = wire.decode(key, pull.recv_multipart()[1:])
            messages.append(message)
            received = message["total"]
    finally:
        metrics_log.shutdown()
        pull.close(linger=0)
        context.term()
    batch = max(messages, key=lambda m: m.get("n", 0))
    assert "steps" not in batch and batch["n"] > 1
    assert batch["cols"]["compute_s"][1] == {"same": "step_time"}
    steps, _, cols = wire.columns(batch)
    assert steps == list(range(batch["step0"], batch["step0"] + batch["n"]))
    assert cols["compute_s"][1] == cols["step_time"][1] and len(cols["step_time"][1]) > 1
    assert [s for m in messages for s in wire.columns(m)[0]] == list(range(200))


def test_a_value_that_is_no_number_is_named_once_and_the_rest_of_the_point_kept(tmp_path):
    # Before, such a value vanished from the charts without a word (and a tensor of several
    # elements became NaN): now its key, what it was and the fix are told, once per key.
    from nbdist.dashboard.text import summary_text

    run, collector, store = _stored_channel(tmp_path)
    try:
        metrics_log.log(step=0, loss=0.5, note="fast")
        metrics_log.log(step=1, loss=torch.ones(3))  # three elements: which one is the loss?
        metrics_log.log(step="two", loss=0.25)  # no whole number: the point cannot be placed
        metrics_log.log(step=2.5, loss=0.25)  # nor this (it was taken for step 2)
        metrics_log.log(step=3, loss=0.125, note="faster")
        metrics_log.flush()
        metrics_log.log(step=4, loss=torch.ones(2), note=[1])  # the same keys again: not retold
        metrics_log.log(step=5, loss=0.0625)
        # An int beyond a float's range is left out alone (it lost the whole flush's points).
        metrics_log.log(step=6, loss=0.03125, big=10**400)
        _settle(collector)
        told_again = metrics_log._channel.left_out_unsent
    finally:
        _close_stored(collector, store)
    assert told_again == {}
    expected = {
        "note": (0, "'fast' (a str)"),
        "loss": (0, "a tensor of shape (3,) on cpu"),
        "": (0, "ValueError: invalid literal for int() with base 10: 'two'"),
        "big": (0, "1000000000000000000000000000000000000... (an int beyond a float's range)"),
    }
    loaded = load_run(run.id, path=str(tmp_path / "h.sqlite"))
    for got in (run, loaded):
        assert got.left_out == expected
        assert got.series("loss", 0) == ([0, 3, 5, 6], [0.5, 0.125, 0.0625, 0.03125])
        assert "note" not in got.keys() and "big" not in got.keys()
        assert got.dropped == {0: 2}
    text = summary_text(run)
    assert (
        "2 points dropped on the ranks (rank 0: 2); the first by an error on rank 0: "
        "ValueError: invalid literal for int() with base 10: 'two'" in text
    )
    fix = "log a Python number or a one-element tensor"
    assert (
        f"'loss' left out of the charts: rank 0 logged a tensor of shape (3,) on cpu; {fix}" in text
    )
    assert f"'note' left out of the charts: rank 0 logged 'fast' (a str); {fix}" in text


def test_a_count_that_is_negative_infinite_or_a_bool_is_left_out_and_named(tmp_path):
    # Before: flops=-6.7e8 gave a TFLOP/s and an MFU below 0, flops=inf an MFU of inf (and
    # the advice to fix the peak), flops=True one FLOP; samples=-8 a negative throughput.
    run, collector, store = _stored_channel(tmp_path)
    try:
        metrics_log.log(step=0, loss=1.0, flops=1e9, samples=8)
        metrics_log.log(step=1, loss=1.0, flops=-6.7e8, samples=-8)
        metrics_log.log(step=2, loss=1.0, flops=math.inf, samples=8)
        metrics_log.log(step=3, loss=1.0, flops=True, samples=8)
        metrics_log.log(step=4, loss=1.0, flops=1e9, samples=8)
        metrics_log.flush()
        _settle(collector)
    finally:
        _close_stored(collector, store)
    assert run.left_out == {
        "flops": (0, "True (a bool): a count is a number >= 0"),  # one value told per key
        "samples": (0, "-8.0: a count is a finite number >= 0"),
    }
    steps, rates = run.series("tflops", 0)
    assert steps == [4] and all(r > 0 for r in rates)  # step 0 has no step time yet
    assert run.series("samples", 0)[0] == [0, 2, 3, 4]
    assert run.series("loss", 0)[0] == [0, 1, 2, 3, 4]  # the rest of each point is kept
