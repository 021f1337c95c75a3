"""The dashboard's kernel side: traces, deltas, mean, table, stragglers, text summary, widget, server.

Runs are filled directly with points (as the collector would); the widget is a
real anywidget outside a kernel, whose comm messages are recorded; a small
replica of widget.js's store applies the messages the way the browser does.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from nbdist.dashboard.live import LiveDashboard
from nbdist.dashboard.model import read_tail
from nbdist.dashboard.table import find_stragglers, rank_rows, step_lags
from nbdist.dashboard.text import summary_text
from nbdist.metrics.run import Run

ROOT = Path(__file__).resolve().parents[2]
T0 = 1_700_000_000.0


def _point(step, when, loss, dt=0.1, samples=64.0):
    return (
        step,
        when,
        {"loss": loss, "samples": samples, "step_time": dt, "samples_per_s": samples / dt},
    )


def _loss(rank, step):
    return 2.0 / (step + 1) + 0.01 * rank + 0.001 * math.sin(step * (rank + 1))


def _fill(run, ranks, steps, *, t0=T0, dt=0.1):
    for rank in ranks:
        run.add(rank, [_point(s, t0 + s * dt, _loss(rank, s), dt) for s in steps])


class Browser:
    """What widget.js keeps per model: the snapshot, then each delta applied in seq order."""

    def __init__(self):
        self.seq = -1
        self.panels = []
        self.messages = 0

    def receive(self, msg):
        msg = json.loads(json.dumps(msg, allow_nan=False))  # as it travels (no NaN in JSON)
        self.messages += 1
        if msg["t"] == "snapshot":
            self.seq = msg["seq"]
            self.panels = msg["panels"]
            return
        assert msg["seq"] == self.seq + 1, "deltas arrive in order, none missing"
        self.seq = msg["seq"]
        self.panels += msg.get("panels", [])
        for p, i, xs, ys in msg.get("reset", []):
            self.panels[p]["data"][i] = [xs, ys]
        for p, i, xs, ys in msg.get("extend", []):
            self.panels[p]["data"][i][0] += xs
            self.panels[p]["data"][i][1] += ys

    def traces(self):
        return {
            p["id"]: {n: (d[0], d[1]) for n, d in zip(p["names"], p["data"])} for p in self.panels
        }


def _as_wire(figure):
    # NaN travels as None
    return {
        key: {
            name: (xs, [None if (v is None or not math.isfinite(v)) else v for v in ys])
            for name, (xs, ys) in traces.items()
        }
        for key, traces in figure.items()
    }


# -- figure data ----------------------------------------------------------------------------


def test_traces_are_exactly_the_logged_points_under_budget_and_the_mean_is_across_ranks():
    run = Run(1, world_size=4, backend="gloo", started=T0)
    _fill(run, range(4), range(300))
    dash = LiveDashboard(run)
    dash.poll()
    figure = dash.figure_data()
    assert list(figure) == ["loss", "samples_per_s"]  # samples (a counter) gets no plot
    for rank in range(4):
        assert figure["loss"][f"rank {rank}"] == run.series("loss", rank)
        times, rates = run.timeline("samples_per_s", rank)
        assert figure["samples_per_s"][f"rank {rank}"] == ([round(t - T0, 3) for t in times], rates)
    steps, mean = figure["loss"]["mean"]
    assert steps == list(range(300))
    expected = np.mean([run.series("loss", r)[1] for r in range(4)], axis=0)
    np.testing.assert_allclose(mean, expected, rtol=1e-12)
    # Total throughput: per second of the run, the sum of the ranks' mean rates in that second.
    assert figure["samples_per_s"]["total"] == ([float(b) for b in range(1, 31)], [4 * 640.0] * 30)
    browser = Browser()
    browser.receive(dash.snapshot())
    assert browser.traces() == _as_wire(figure)


def test_long_traces_are_decimated_subsets_that_keep_extremes_and_ends():
    run = Run(1, world_size=2, started=T0)
    n = 20_000
    for rank in range(2):
        points = [_point(s, T0 + s * 0.01, _loss(rank, s)) for s in range(n)]
        points[12_345] = _point(12_345, T0 + 123.45, 99.0 + rank)  # a spike
        points[6_000] = _point(6_000, T0 + 60.0, -5.0)  # a dip
        run.add(rank, points)
    budget = 400
    dash = LiveDashboard(run, budget=budget)
    dash.poll()
    browser = Browser()
    browser.receive(dash.snapshot())
    for rank in range(2):
        xs, ys = dash.figure_data()["loss"][f"rank {rank}"]
        logged = dict(zip(*run.series("loss", rank)))
        assert len(xs) <= budget
        assert all(logged[x] == y for x, y in zip(xs, ys)), "only logged points"
        assert (12_345, 99.0 + rank) in zip(xs, ys) and (6_000, -5.0) in zip(xs, ys)
        assert xs[0] == 0 and xs[-1] == n - 1
    # Keep logging: the browser follows extends and resets and ends up with the kernel's traces.
    for chunk in range(30):
        start = n + chunk * 100
        for rank in range(2):
            run.add(rank, [_point(s, T0 + s * 0.01, 0.5) for s in range(start, start + 100)])
        if chunk == 17:
            run.add(0, [_point(start + 100, T0 + (start + 100) * 0.01, 500.0)])  # a new maximum
        delta, _ = dash.poll()
        browser.receive(delta)
        figure = dash.figure_data()
        assert browser.traces() == _as_wire(figure)
        assert all(len(xs) <= budget for tr in figure.values() for xs, _ in tr.values())
    xs, ys = dash.figure_data()["loss"]["rank 0"]
    assert max(ys) == 500.0 and min(ys) == -5.0 and (12_345, 99.0) in zip(xs, ys)
    assert xs[-1] == run.series("loss", 0)[0][-1]


def test_a_delta_holds_exactly_the_new_points():
    now = [T0 + 10.0]
    run = Run(1, world_size=4, started=T0)
    _fill(run, range(4), range(50))  # steps 0..49 at T0 .. T0+4.9
    dash = LiveDashboard(run, clock=lambda: now[0])
    dash.poll()
    browser = Browser()
    browser.receive(dash.snapshot())
    assert dash.poll()[0] is None, "nothing new, nothing sent"

    now[0] = T0 + 6.0  # ranks are running
    new = range(50, 60)
    _fill(run, range(4), new)
    delta, _ = dash.poll()
    browser.receive(delta)
    assert set(delta) == {"t", "seq", "now", "extend"}
    ext = {(p, i): (xs, ys) for p, i, xs, ys in delta["extend"]}
    assert set(ext) == {(p, i) for p in (0, 1) for i in range(5)} - {(1, 4)}
    for rank in range(4):
        assert ext[(0, rank)] == (list(new), [_loss(rank, s) for s in new])
        assert ext[(1, rank)] == ([round(s * 0.1, 3) for s in new], [640.0] * 10)
    steps, mean = ext[(0, 4)]
    assert steps == list(new)
    np.testing.assert_allclose(mean, [np.mean([_loss(r, s) for r in range(4)]) for s in new])
    assert (1, 4) not in ext, "the total for second 5 waits until every rank is past it"
    assert browser.traces() == _as_wire(dash.figure_data())
    now[0] = T0 + 7.0
    _fill(run, range(4), range(60, 70))
    delta, _ = dash.poll()
    browser.receive(delta)
    ext = {(p, i): (xs, ys) for p, i, xs, ys in delta["extend"]}
    assert ext[(1, 4)] == ([6.0], [2560.0])
    assert browser.traces() == _as_wire(dash.figure_data())


def test_the_mean_waits_for_running_ranks_but_not_for_dead_ones():
    now = [T0 + 5.0]
    states = {}
    run = Run(1, world_size=4, started=T0)
    _fill(run, range(4), range(50))
    dash = LiveDashboard(run, clock=lambda: now[0], states=lambda: dict(states))
    dash.poll()
    _fill(run, range(3), [50])  # rank 3 has not logged step 50 yet
    delta, _ = dash.poll()
    ext = {(p, i): xs for p, i, xs, _ in delta["extend"]}
    assert ext[(0, 0)] == [50] and (0, 4) not in ext
    _fill(run, [3], [50])
    delta, _ = dash.poll()
    mean = {(p, i): (xs, ys) for p, i, xs, ys in delta["extend"]}[(0, 4)]
    assert mean[0] == [50]
    assert mean[1][0] == pytest.approx(np.mean([_loss(r, 50) for r in range(4)]))
    # Rank 3 dies: the mean goes on over the others, and its row says dead.
    states[3] = "dead"
    dash.refresh_states()
    _fill(run, range(3), [51])
    delta, table = dash.poll()
    mean = {(p, i): (xs, ys) for p, i, xs, ys in delta["extend"]}[(0, 4)]
    assert mean[0] == [51]
    assert mean[1][0] == pytest.approx(np.mean([_loss(r, 51) for r in range(3)]))
    assert [row["state"] for row in table["rows"]] == ["busy"] * 3 + ["dead"]


@pytest.mark.parametrize("polled_while_quiet", [True, False])
def test_a_rank_resuming_after_a_pause_of_all_ranks_gives_one_mean_point_per_step(
    polled_while_quiet,
):
    """Every rank pauses (a cell waits); rank 0 resumes first: the mean at each step waits for rank 1."""
    now = [T0 + 5.0]
    run = Run(1, world_size=2, started=T0)
    _fill(run, range(2), range(50))  # t = T0 .. T0 + 4.9
    dash = LiveDashboard(run, clock=lambda: now[0])
    dash.poll()
    if polled_while_quiet:  # all quiet for a long time: the mean up to step 49 is final
        now[0] = T0 + 60.0
        dash.poll()
    _fill(run, [0], [50, 51], t0=T0 + 55.0)  # rank 0 resumes (t = T0 + 60.0, 60.1)
    now[0] = T0 + 60.2
    delta, _ = dash.poll()
    assert (0, 2) not in {(p, i) for p, i, *_ in delta["extend"]}, "rank 1 is not idle yet"
    _fill(run, [1], [50, 51], t0=T0 + 55.5)  # rank 1 resumes half a second later
    now[0] = T0 + 60.7
    dash.poll()
    steps, mean = dash.figure_data()["loss"]["mean"]
    assert steps == list(range(52)), steps[45:]
    assert mean[50] == pytest.approx(np.mean([_loss(r, 50) for r in range(2)]))


def test_a_new_metric_gets_its_own_panel_with_its_history():
    now = [T0 + 4.0]
    run = Run(1, world_size=2, started=T0)
    _fill(run, range(2), range(30))
    dash = LiveDashboard(run, clock=lambda: now[0])
    dash.poll()
    run.add(0, [(30, T0 + 3.0, {"loss": 0.1, "val_loss": 0.7, "step_time": 0.1})])
    run.add(1, [(30, T0 + 3.0, {"loss": 0.2, "step_time": 0.1})])
    delta, _ = dash.poll()
    (panel,) = delta["panels"]
    assert panel["id"] == "val_loss" and panel["xtitle"] == "step"
    assert panel["data"][0] == [[30], [0.7]]
    assert panel["data"][2] == [[30], [0.7]], "mean over the ranks that logged it"
    assert all(p != 2 for p, *_ in delta["extend"]), "a new panel comes whole, not as an extend"


def test_nan_and_inf_travel_as_null():
    run = Run(1, world_size=1, started=T0)
    run.add(
        0,
        [
            (0, T0, {"loss": 1.0}),
            (1, T0 + 1, {"loss": float("nan")}),
            (2, T0 + 2, {"loss": math.inf}),
        ],
    )
    dash = LiveDashboard(run)
    dash.poll()
    snap = dash.snapshot()
    text = json.dumps(snap, allow_nan=False)
    assert json.loads(text)["panels"][0]["data"][0] == [[0, 1, 2], [1.0, None, None]]


def test_bytes_per_update_grow_with_the_points_added():
    now = [T0 + 1.0]
    run = Run(1, world_size=4, started=T0)
    _fill(run, range(4), range(10))
    dash = LiveDashboard(run, clock=lambda: now[0])
    dash.poll()
    sizes = {}
    step = 10
    for k in (1, 10, 100):
        _fill(run, range(4), range(step, step + k))
        step += k
        now[0] = T0 + step * 0.1 + 0.05
        delta, _ = dash.poll()
        sizes[k] = len(json.dumps(delta, separators=(",", ":")))
    per_point = (sizes[100] - sizes[10]) / (90 * 10)  # 4 ranks + mean, 2 panels
    assert per_point < 60, sizes
    assert sizes[1] < 600, sizes
    assert 6 < sizes[100] / sizes[10] < 12, sizes


def test_reads_start_where_the_previous_poll_left_off():
    class IncrementalRun(Run):
        calls: list = []

        def series(self, key, rank, start=0):
            self.calls.append(start)
            steps, values = super().series(key, rank)
            return steps[start:], values[start:]

        def timeline(self, key, rank, start=0):
            times, values = super().timeline(key, rank)
            return times[start:], values[start:]

    run = IncrementalRun(1, world_size=1, started=T0)
    _fill(run, [0], range(5))
    assert read_tail(run, "loss", 0, 3) == (
        [3, 4],
        [T0 + 0.3, T0 + 0.4],
        [_loss(0, 3), _loss(0, 4)],
    )
    assert run.calls == [3]
    plain = Run(2, world_size=1, started=T0)
    _fill(plain, [0], range(5))
    assert read_tail(plain, "loss", 0, 3) == read_tail(run, "loss", 0, 3)


# -- table, stragglers, states ------------------------------------------------------------------


def _straggler_run():
    # Ranks 0-2 take 0.1 s a step, rank 3 takes 0.2 s: after 10 s it is at step 50, they at 100.
    run = Run(1, world_size=4, backend="gloo", started=T0)
    for rank in range(4):
        dt = 0.2 if rank == 3 else 0.1
        steps = range(50 if rank == 3 else 100)
        run.add(rank, [_point(s, T0 + (s + 1) * dt, _loss(rank, s), dt) for s in steps])
    return run


def test_a_rank_with_twice_the_step_time_is_flagged_and_no_other():
    run = _straggler_run()
    rows = rank_rows(run, now=T0 + 10.5)
    assert [r.straggler for r in rows[:3]] == ["", "", ""]
    assert rows[3].straggler == "2.0× step time"
    assert [r.state for r in rows] == ["busy"] * 4
    assert rows[3].step == 49 and rows[3].step_time == pytest.approx(0.2)
    live = LiveDashboard(run, clock=lambda: T0 + 10.5)
    live.poll()
    assert [r.straggler for r in live.rows] == ["", "", "", "2.0× step time"]
    assert "⚠ straggler (2.0× step time)" in live.table["rows"][3]["cells"]


def test_lag_is_measured_at_the_same_moment():
    history = {
        0: [(T0 + s * 0.1, s) for s in range(100)],
        1: [(T0 + s * 0.1, s) for s in range(80)],  # same pace, its last 20 points still in flight
        2: [(T0 + s * 0.1, s - 20) for s in range(20, 100)],  # 20 steps behind all along
    }
    lags = step_lags(history)
    assert lags == {0: 0, 1: 0, 2: 20}
    assert find_stragglers({}, lags) == {2: "20 steps behind"}
    times = {0: [0.1] * 10, 1: [0.11] * 10, 2: [0.1] * 10, 3: [0.125] * 10}
    assert find_stragglers(times, {}) == {}, "1.25x is within the 1.3 ratio"


def test_states_running_idle_and_dead():
    run = Run(1, world_size=3, started=T0)
    run.add(0, [_point(0, T0 + 9.5, 1.0)])
    run.add(1, [_point(0, T0 + 5.0, 1.0)])
    rows = rank_rows(run, lambda: {2: "dead", 0: "busy"}, now=T0 + 10.0)
    assert [(r.rank, r.state) for r in rows] == [(0, "busy"), (1, "idle"), (2, "dead")]

    def broken():
        raise RuntimeError("session stopped")

    assert [r.state for r in rank_rows(run, broken, now=T0 + 10.0)] == ["busy", "idle", "idle"]
    text = summary_text(run, {2: "dead"}, now=T0 + 10.0)
    assert text.splitlines()[4].split()[-1] == "dead"


def test_the_sessions_idle_wins_over_a_point_just_logged():
    # A short cell: its last point came 0.1 s ago, but the cell is over (%dist_status: idle).
    run = Run(1, world_size=2, started=T0)
    run.add(0, [_point(0, T0 + 9.9, 1.0)])
    run.add(1, [_point(0, T0 + 9.9, 1.0)])
    assert [r.state for r in rank_rows(run, now=T0 + 10.0)] == ["busy", "busy"]  # no word
    assert [r.state for r in rank_rows(run, {0: "idle", 1: "busy"}, now=T0 + 10.0)] == [
        "idle",
        "busy",
    ]
    run.ended = T0 + 9.95  # the session stopped: nothing runs, however recent the points
    assert [r.state for r in rank_rows(run, now=T0 + 10.0)] == ["idle", "idle"]
    assert summary_text(run, now=T0 + 10.0).splitlines()[0].endswith(" · finished")


def test_text_summary_has_a_row_per_rank_and_a_line_per_series():
    run = Run(3, world_size=2, backend="gloo", started=T0)
    run.add(0, [_point(s, T0 + s, loss) for s, loss in enumerate([4.0, 2.0, 1.0])])
    run.add(1, [_point(s, T0 + s, loss) for s, loss in enumerate([3.0, 2.0])])
    run.add(0, [(3, T0 + 3, {"memory_mib": 2048.0})])
    text = summary_text(run, now=T0 + 3.5)
    lines = text.splitlines()
    assert lines[0] == "run 3 · 2 ranks · gloo · 6 points"
    assert lines[1].split() == [
        "rank",
        "step",
        "loss",
        "samples/s",
        "step",
        "time",
        "memory",
        "last",
        "seen",
        "state",
    ]
    assert lines[2].split() == [
        "0",
        "3",
        "1",
        "640",
        "100.0",
        "ms",
        "2.00",
        "GiB",
        "0.5",
        "s",
        "ago",
        "busy",
    ]
    assert lines[3].split() == ["1", "1", "2", "640", "100.0", "ms", "–", "2.5", "s", "ago", "idle"]
    series = {line.split()[0]: line.split()[1:] for line in lines[5:]}
    assert lines[5].split() == ["series", "last", "mean", "min", "max"]
    assert series["loss"] == ["1.5", "2.4", "1", "4"]  # last: mean of 1.0 and 2.0
    assert series["memory_mib"] == ["2048"] * 4
    assert set(series) == {"series", "loss", "samples", "step_time", "samples_per_s", "memory_mib"}


def test_show_prints_the_text_summary_outside_a_kernel():
    script = textwrap.dedent(
        """
        import sys, time
        import nbdist.dashboard
        assert not {"numpy", "IPython", "ipywidgets", "anywidget", "plotly"} & set(sys.modules)
        from nbdist.metrics.run import Run
        run = Run(7, world_size=2, backend="gloo")
        now = time.time()
        for rank in range(2):
            run.add(rank, [(s, now, {"loss": 1.0 + rank, "step_time": 0.1}) for s in range(5)])
        result = nbdist.dashboard.show_run(run)
        print("returned", result)
        assert not {"ipywidgets", "anywidget", "plotly"} & set(sys.modules)
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, cwd=ROOT
    )
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == "run 7 · 2 ranks · gloo · 10 points"
    assert lines[2].split()[:3] == ["0", "4", "1"] and lines[3].split()[:3] == ["1", "4", "2"]
    assert any(line.split()[:2] == ["loss", "1.5"] for line in lines)
    assert lines[-1] == "returned None"


# -- the widget ----------------------------------------------------------------------------------


@pytest.fixture
def comm_log(monkeypatch):
    """Every comm message the widgets send (outside a kernel they go to comm's DummyComm)."""
    import comm

    sent = []

    def publish_msg(self, msg_type, data=None, metadata=None, buffers=None, **keys):
        sent.append((msg_type, data))

    monkeypatch.setattr(comm.DummyComm, "publish_msg", publish_msg)
    # Importing ipykernel (as other tests in this process may) points comm.create_comm at the
    # kernel's Comm, which needs a running kernel: keep the widgets on DummyComm here.
    monkeypatch.setattr(comm, "create_comm", comm.DummyComm)
    return sent


def _custom(sent):
    return [d["content"] for t, d in sent if t == "comm_msg" and d.get("method") == "custom"]


def _table_updates(sent):
    return [
        d["state"]["table"]
        for t, d in sent
        if t == "comm_msg" and d.get("method") == "update" and "table" in d.get("state", {})
    ]


def test_widget_sends_a_snapshot_then_only_new_points(comm_log):
    now = [T0 + 3.0]
    run = Run(1, world_size=2, backend="gloo", started=T0)
    _fill(run, range(2), range(20))
    dash = LiveDashboard(run, clock=lambda: now[0])
    dash.poll()
    widget = dash.start(refresh_thread=False)  # refreshes driven by hand below
    try:
        browser = Browser()
        (snapshot,) = _custom(comm_log)
        browser.receive(snapshot)
        _fill(run, range(2), range(20, 25))
        dash.refresh()
        (_, delta) = _custom(comm_log)
        browser.receive(delta)
        assert [(p, i, xs) for p, i, xs, _ in delta["extend"] if p == 0] == [
            (0, 0, [20, 21, 22, 23, 24]),
            (0, 1, [20, 21, 22, 23, 24]),
            (0, 2, [20, 21, 22, 23, 24]),
        ]
        assert browser.traces() == _as_wire(dash.figure_data())
        # A reloaded page asks for a snapshot.
        widget._handle_custom_msg({"t": "hello"}, [])
        reply = _custom(comm_log)[-1]
        assert reply["t"] == "snapshot" and reply["seq"] == delta["seq"]
        assert _table_updates(comm_log)[-1]["rows"][0]["cells"][:2] == ["0", "24"]
        # The same display carries the text summary for viewers without widgets.
        data, _ = widget._repr_mimebundle_()
        assert data["text/plain"].startswith("run 1 · 2 ranks · gloo · 50 points")
        assert data["application/vnd.jupyter.widget-view+json"]["model_id"] == widget.model_id
        # plotly.js is not in the widget state: a saved notebook stays small.
        state = json.dumps(widget.get_state())
        assert len(state) < 50_000 and "plotly.min.js" in widget._esm  # plotly.js: ~4 MB
    finally:
        dash.close()
    assert widget.comm is None


def test_refresh_thread_is_woken_by_new_points_and_stays_under_5_hz(comm_log):
    run = Run(1, world_size=2, started=time.time())
    dash = LiveDashboard(run)
    dash.start()
    browser = Browser()
    try:
        began = time.monotonic()
        step = 0
        while time.monotonic() - began < 1.5:
            now = time.time()
            for rank in range(2):
                run.add(rank, [_point(step, now, 1.0 / (step + 1))])
            step += 1
            time.sleep(0.005)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            figure = dash.figure_data()
            if figure and figure["loss"]["rank 0"][0][-1:] == [step - 1]:
                break
            time.sleep(0.05)
    finally:
        dash.close()
    for msg in _custom(comm_log):
        browser.receive(msg)
    deltas = [m for m in _custom(comm_log) if m["t"] == "delta"]
    assert 2 <= len(deltas) <= 1.5 * 5 + 3, len(deltas)
    assert browser.traces()["loss"]["rank 0"][0] == list(range(step))
    sent = len(comm_log)
    run.add(0, [_point(step, time.time(), 0.1)])
    time.sleep(0.5)
    assert len(comm_log) == sent, "a closed dashboard sends nothing"
    assert not dash._thread.is_alive()


# -- server extension ------------------------------------------------------------------------------


def test_server_extension_points_config_and_packaging():
    import nbdist.server as server

    assert server._jupyter_server_extension_points() == [{"module": "nbdist.server"}]
    assert os.path.isfile(os.path.join(server.plotly_js_dir(), "plotly.min.js"))
    config = json.loads((ROOT / "jupyter-config/jupyter_server_config.d/nbdist.json").read_text())
    assert config == {"ServerApp": {"jpserver_extensions": {"nbdist.server": True}}}
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert (
        '"jupyter-config/jupyter_server_config.d/nbdist.json" = '
        '"etc/jupyter/jupyter_server_config.d/nbdist.json"' in pyproject
    )


def test_server_serves_plotly_only_to_logged_in_users(tmp_path):
    pytest.importorskip("jupyter_server")
    import socket
    import urllib.error
    import urllib.request

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, JUPYTER_CONFIG_DIR=str(tmp_path / "config"))
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "jupyter_server",
            "--no-browser",
            "--allow-root",
            f"--port={port}",
            "--ip=127.0.0.1",
            "--ServerApp.base_url=/base/",
            "--IdentityProvider.token=secret",
            "--ServerApp.jpserver_extensions={'nbdist.server': True}",
        ],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}/base/nbdist/static/plotly.min.js?v=1"

    class NoRedirect(urllib.request.HTTPRedirectHandler):
        def redirect_request(self, *args, **kwargs):
            return None

    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                request = urllib.request.Request(url, headers={"Authorization": "token secret"})
                with urllib.request.urlopen(request, timeout=5) as reply:
                    body = reply.read()
                    cache = reply.headers["Cache-Control"]
                break
            except (urllib.error.URLError, ConnectionError):
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.3)
        assert body.startswith(b"/**") and len(body) > 1_000_000
        assert cache == "private, max-age=31536000"
        opener = urllib.request.build_opener(NoRedirect)
        with pytest.raises(urllib.error.HTTPError) as refused:
            opener.open(url, timeout=5)
        assert refused.value.code in (302, 403)
    finally:
        server.terminate()
        server.wait(timeout=30)


def test_refresh_thread_ends_once_an_ended_run_is_shown_in_full(comm_log):
    run = Run(1, world_size=2, started=T0, ended=T0 + 30)
    _fill(run, range(2), range(300))
    dash = LiveDashboard(run)
    dash.start()
    try:
        dash._thread.join(timeout=10)
        assert not dash._thread.is_alive()
        figure = dash.figure_data()
        assert figure["loss"]["mean"][0] == list(range(300))
        assert [row.state for row in dash.rows] == ["idle", "idle"]
    finally:
        dash.close()


def test_eight_ranks_by_100k_steps_stay_within_the_point_budget():
    """What keeps a long run responsive: the browser never holds more than the budget per
    trace, however long the history, and an update carries only what was added."""
    now = [T0 + 20_000.0]
    run = Run(1, world_size=8, started=T0)
    _fill(run, range(8), range(100_000))
    dash = LiveDashboard(run, clock=lambda: now[0], budget=2000)
    dash.poll()
    snapshot = dash.snapshot()
    lengths = [len(trace[0]) for panel in snapshot["panels"] for trace in panel["data"]]
    assert lengths and max(lengths) <= 2000
    assert len(json.dumps(snapshot, allow_nan=False)) < 2_000_000
    # Spikes survive decimation: each rank's largest loss (step 0) is still plotted.
    loss = dash.figure_data()["loss"]
    for rank in range(8):
        assert max(loss[f"rank {rank}"][1]) == _loss(rank, 0)
    _fill(run, range(8), range(100_000, 100_010))
    delta, _ = dash.poll()
    added = sum(len(xs) for _, _, xs, _ in delta.get("extend", []))
    assert 0 < added <= 10 * (8 + 1) * 2  # ten steps: per rank, the mean, two panels
    dash.close()


def test_the_final_summary_after_the_session_stopped_still_shows_a_dead_rank(comm_log):
    """%dist_stop freezes the dashboard after the session stopped, when it reports no states."""
    run = Run(4, world_size=32, backend="gloo", started=T0)
    _fill(run, range(32), range(5))
    states = {r: "dead" if r == 11 else "idle" for r in range(32)}
    dash = LiveDashboard(run, states=lambda: dict(states))
    widget = dash.start(refresh_thread=False)
    try:
        dash.refresh_states()
        states.clear()  # the session stopped: DistSession.rank_states is {}
        run.ended = T0 + 60
        dash.freeze(summary=True)
        text = widget._repr_mimebundle_()[0]["text/plain"]
        lines = text.splitlines()
        assert lines[1].startswith("32 ranks · 31 idle · 1 dead"), text
        assert lines[3].split()[:6] == ["all", "32", "0", "31", "1", "4"]
        assert lines[4].startswith("1 rank deviating"), text
        assert [row.state for row in dash.rows if row.state == "dead"] == ["dead"]
    finally:
        dash.close()
