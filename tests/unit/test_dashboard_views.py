"""The dashboard as users read it: one rank palette, readable titles and units, the header, one
vocabulary of rank states, and when the kernel re-displays the widget (each re-display is a new
view in the browser, so only when the text summary it carries would change).

Runs are filled directly with points (as the collector would); the widgets are real anywidgets
outside a kernel (their comm messages go to comm's DummyComm); the shell is a real IPython shell.
"""

from __future__ import annotations

import time

import pytest

from nbdist.dashboard import live
from nbdist.dashboard.header import header
from nbdist.dashboard.labels import describe_key, title
from nbdist.dashboard.live import LiveDashboard, cell_watcher
from nbdist.dashboard.model import STATES_FRESH_S
from nbdist.dashboard.palette import RANK_COLOURS, contrast, rank_colour, rank_colours
from nbdist.dashboard.table import build_rows, rank_rows
from nbdist.metrics.run import Run

T0 = 1_700_000_000.0
# The page backgrounds the lines are drawn on: JupyterLab's light theme, and its dark theme's
# notebook (--jp-layout-color0) and cell (--jp-layout-color1) backgrounds.
BACKGROUNDS = ("#ffffff", "#111111", "#212121")


def _fill(run, ranks, steps, *, t0=T0, dt=0.1):
    for rank in ranks:
        run.add(
            rank,
            [(s, t0 + s * dt, {"loss": 1.0 / (s + 1) + rank, "step_time": dt}) for s in steps],
        )


# -- one palette ---------------------------------------------------------------------------------


def test_every_rank_colour_stands_out_on_light_and_dark_pages():
    assert len(set(RANK_COLOURS)) == len(RANK_COLOURS) == 10
    for colour in rank_colours():
        for background in BACKGROUNDS:
            # 3:1 is WCAG's minimum contrast for lines and other graphics.
            assert contrast(colour, background) >= 3.0, (colour, background)


def test_rank_colour_is_the_palette_entry_and_repeats_after_ten():
    assert [rank_colour(r) for r in range(12)] == rank_colours() + rank_colours()[:2]
    assert rank_colours() is not rank_colours()  # a copy: callers cannot change the palette
    for bad in (-1, 1.0, "0", True):
        with pytest.raises(ValueError, match="rank must be an int >= 0"):
            rank_colour(bad)


def test_contrast_is_the_wcag_ratio():
    assert contrast("#000000", "#ffffff") == pytest.approx(21.0)
    assert contrast("#777777", "#777777") == 1.0
    with pytest.raises(ValueError, match="'#rrggbb'"):
        contrast("red", "#ffffff")


def test_the_comparison_chart_draws_each_rank_in_its_palette_colour():
    from nbdist.dashboard.plan_comparison import ALL_RANKS, comparison_chart

    rows = [
        {"strategy": s, "samples_per_s": 100.0, "peak_mib": [1.0, 2.0, 3.0], "comm_mib": [1, 1, 1]}
        for s in ("ddp", "fsdp")
    ]
    fig = comparison_chart(rows)
    by_name = {}
    for trace in fig.data:
        by_name.setdefault(trace.name, set()).add(trace.marker.color)
    assert by_name == {"all ranks": {ALL_RANKS}} | {f"rank {r}": {rank_colour(r)} for r in range(3)}
    assert ALL_RANKS not in RANK_COLOURS


# -- titles and units ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "key, by_time, want",
    [
        ("loss", False, ("loss", "", "loss", "step", True)),
        ("loss_ddp", False, ("loss · ddp", "", "loss", "step", True)),
        ("eval_loss", False, ("eval loss", "", "eval loss", "step", True)),
        ("lr", False, ("learning rate", "", "learning rate", "step", False)),
        ("grad_norm", False, ("gradient norm", "", "gradient norm", "step", False)),
        ("data_wait_s", False, ("data wait", "s", "data wait (s)", "step", False)),
        ("act_mib", False, ("act", "MiB", "act (MiB)", "step", False)),
        ("memory_mib", False, (None, "MiB", "memory (MiB)", "step", False)),
        ("samples_per_s", True, (None, "samples/s", "samples/s", None, False)),
        ("gpu_util", True, ("GPU utilisation (%)", "%", "utilisation (%)", None, False)),
    ],
)
def test_panels_have_readable_titles_units_and_axis_titles(key, by_time, want):
    got = describe_key(key, by_time=by_time)
    name, unit, ytitle, xtitle, log = want
    assert got["title"] == (name or got["title"]) and "_" not in got["title"]
    assert (got["unit"], got["ytitle"], got["log"]) == (unit, ytitle, log)
    assert got["xtitle"] == (xtitle or "time since the run started (s)")
    assert title(key) == got["title"]


def test_a_panel_spec_carries_its_title_units_and_scale():
    run = Run(1, world_size=2, started=T0)
    for rank in range(2):
        points = [
            (s, T0 + s, {"loss": 1.0, "lr_warm": 0.1, "samples_per_s": 8.0}) for s in range(3)
        ]
        run.add(rank, points)
    dash = LiveDashboard(run)
    dash.poll()
    panels = {p["id"]: p for p in dash.snapshot()["panels"]}
    assert panels["loss"]["log"] is True and panels["loss"]["ytitle"] == "loss"
    assert panels["lr_warm"]["title"] == "learning rate · warm"
    assert panels["samples_per_s"]["ytitle"] == "samples/s"
    assert panels["samples_per_s"]["xtitle"] == "time since the run started (s)"


# -- the header ----------------------------------------------------------------------------------


def test_header_says_which_run_how_far_and_how_the_ranks_are():
    run = Run(5, world_size=3, backend="gloo", started=T0, label="sweep")
    for rank, last in ((0, 49), (1, 47), (2, 49)):
        run.add(rank, [(s, T0 + s, {"loss": 1.0, "total_steps": 200}) for s in range(last + 1)])
    rows = rank_rows(run, {1: "dead"}, now=T0 + 49.5)
    h = header(run, rows)
    assert h["name"] == "run 5 · sweep" and h["detail"] == "3 ranks · gloo"
    assert (h["step"], h["steps"], h["total"], h["progress"]) == (49, "47–49", 200, 0.25)
    assert h["points"] == 148 and h["last"] == T0 + 49
    assert h["states"] == "2 busy · 1 dead"
    assert h["gpu"] is None  # no GPU readings: no GPU line
    # total_steps is the progress bar, not a chart or the table's loss column.
    assert [p["id"] for p in _panels(run)] == ["loss"]


def test_header_counts_each_gpu_once_when_ranks_share_it():
    run = Run(1, world_size=2, started=T0)
    reading = {"gpu_index": 0, "gpu_util": 50.0, "gpu_mem_mib": 1024.0, "gpu_mem_total_mib": 8192.0}
    for rank in range(2):
        run.add(rank, [(0, T0, {"loss": 1.0, **reading})])
    h = header(run, rank_rows(run, now=T0))
    assert h["gpu"] == "1 GPU: utilisation 50 % (mean) · memory 1.0/8.0 GiB"


def _panels(run):
    dash = LiveDashboard(run)
    dash.poll()
    return dash.snapshot()["panels"]


# -- one vocabulary of rank states -----------------------------------------------------------------


def test_a_dead_rank_is_dead_and_never_a_straggler():
    run = Run(1, world_size=2, started=T0)
    _fill(run, range(2), range(10))
    slow = {0: [0.1] * 5, 1: [0.3] * 5}  # rank 1's last steps took three times as long
    alive = build_rows(run, slow, {}, {}, now=T0 + 20)
    assert (alive[1].state, alive[1].straggler) == ("idle", "3.0× step time")
    dead = build_rows(run, slow, {}, {1: "dead"}, now=T0 + 20)
    assert (dead[1].state, dead[1].straggler) == ("dead", "")


def test_a_rank_running_a_cell_is_busy_while_that_is_fresh():
    now = [T0 + 60.0]  # the ranks logged a minute ago: by logging alone they would be idle
    run = Run(1, world_size=2, started=T0)
    _fill(run, range(2), range(10))
    dash = LiveDashboard(run, states=lambda: {0: "busy", 1: "idle"}, clock=lambda: now[0])
    dash.poll()
    assert [row.state for row in dash.rows] == ["busy", "idle"]  # as %dist_status says
    now[0] += STATES_FRESH_S + 1  # not read again since (a --noblock cell may have ended)
    dash.poll()
    assert [row.state for row in dash.rows] == ["idle", "idle"]


def test_a_rank_dying_mid_cell_shows_dead_before_the_cell_ends(comm_log):
    run = Run(1, world_size=2, started=time.time())
    states = {0: "busy", 1: "busy"}
    dash = LiveDashboard(run, states=lambda: dict(states))
    live._VIEWS[run] = views = live._RunViews()
    views.dash = dash
    dash.start()
    try:
        watch = cell_watcher(run, lambda: dict(states))  # the cell's waiting loop calls it
        states[1] = "dead"  # the session now knows rank 1 died; the cell goes on

        def shown_dead():
            watch()
            return [row.state for row in dash.rows][1] == "dead"

        deadline = time.monotonic() + 10
        while not shown_dead():
            assert time.monotonic() < deadline, [row.state for row in dash.rows]
            time.sleep(0.05)
    finally:
        dash.close()
        del live._VIEWS[run]


# -- re-displaying the widget --------------------------------------------------------------------


class _Handle:
    """Records what IPython's DisplayHandle would publish (update_display_data)."""

    def __init__(self):
        self.updates = []

    def update(self, obj, **kwargs):
        self.updates.append(obj)


@pytest.fixture
def comm_log(monkeypatch):
    import comm

    sent = []

    def publish_msg(self, msg_type, data=None, metadata=None, buffers=None, **keys):
        sent.append((msg_type, data))

    monkeypatch.setattr(comm.DummyComm, "publish_msg", publish_msg)
    monkeypatch.setattr(comm, "create_comm", comm.DummyComm)
    return sent


def test_the_widget_is_re_displayed_only_when_its_summary_would_change(comm_log):
    run = Run(1, world_size=2, started=time.time())
    _fill(run, range(2), range(5), t0=time.time())
    states = {0: "idle", 1: "idle"}
    dash = LiveDashboard(run, states=lambda: dict(states))
    handle = _Handle()
    dash.displayed(handle)
    dash.start(refresh_thread=False)
    try:
        _fill(run, range(2), range(5, 9), t0=time.time())
        dash._after_cell()  # the end of the cell that logged: its final summary
        assert len(handle.updates) == 1 and handle.updates[0] is dash.widget
        for _ in range(10):  # cells that log nothing: errors, %dist_where, to_pandas, ...
            dash._after_cell()
        assert len(handle.updates) == 1
        states[1] = "dead"  # a rank died: the summary says so
        dash._after_cell()
        assert len(handle.updates) == 2
        dash.freeze()
        _fill(run, range(1), range(9, 12), t0=time.time())
        dash._after_cell()  # a frozen dashboard is never re-displayed
        assert len(handle.updates) == 2
    finally:
        dash.close()


def test_a_dashboard_shown_again_marks_its_earlier_saved_text_as_a_snapshot(comm_log):
    run = Run(1, world_size=2, started=time.time())
    _fill(run, range(2), range(5), t0=time.time())
    dash = LiveDashboard(run, states=lambda: {0: "idle", 1: "idle"})
    first, second = _Handle(), _Handle()
    dash.start(refresh_thread=False)
    try:
        dash.displayed(first)
        _fill(run, range(2), range(5, 12), t0=time.time())
        dash.displayed(second)  # the same widget under a later cell: one model, both views live
        [marked] = first.updates
        assert (
            marked["application/vnd.jupyter.widget-view+json"]["model_id"] == dash.widget.model_id
        )
        assert marked["text/plain"].endswith(
            "(snapshot at step 11: the live view of this run is in a later cell)"
        )
        assert second.updates == []
    finally:
        dash.close()


def test_a_frozen_dashboard_says_it_is_a_final_snapshot(comm_log):
    run = Run(1, world_size=2, started=time.time())
    _fill(run, range(2), range(7), t0=time.time())
    dash = LiveDashboard(run, states=lambda: {0: "idle", 1: "idle"})
    dash.start(refresh_thread=False)
    try:
        dash.refresh()
        assert "snapshot" not in dash.widget.table["header"]  # live: no such line
        dash.freeze()  # a kernel let go of a run that goes on elsewhere
        assert dash.widget.table["header"]["snapshot"] == (
            "final snapshot at step 6: this kernel no longer follows the run; "
            "this view no longer updates"
        )
    finally:
        dash.close()


def test_text_dashboard_prints_after_the_cell_output_it_sums_up(capsys):
    from IPython.core.interactiveshell import InteractiveShell

    shell = InteractiveShell.instance()
    run = Run(2, world_size=2, backend="gloo", started=T0)
    _fill(run, range(2), range(3))
    live._summary_after_cell(shell, run, None)  # what show_run does without anywidget
    shell.run_cell("print('[ranks 0-1] epoch 1 done')")
    shell.run_cell("print('next cell')")
    out = capsys.readouterr().out.splitlines()
    first = out.index("[ranks 0-1] epoch 1 done")
    assert out[first + 1] == "run 2 · 2 ranks · gloo · 6 points"
    assert "(pip install anywidget for the live dashboard)" in out
    assert out[-1] == "next cell"  # once: the next cell prints no summary
