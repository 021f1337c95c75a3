"""The JupyterLab sidebar above 8 ranks, and the named sessions' list, in a real browser.

JupyterLab + headless Chromium + 12 CPU ranks, rank 5 stepping three times slower than
the others. Above 8 ranks the sidebar shows the notebook dashboard's summary instead of a
card per rank: the ranks counted by state, one row per host, then the deviating ranks
(the straggler; rank 2 as stopped while the test stops it, counted so beside its state; once
the test kills rank 9, rank 9 first, as dead); the charts draw the
median of the ranks and the deviating ranks only, each in its own colour.

A second test starts a named session (2 ranks, ``--idle-timeout 1h``) and restarts the
kernel, which lets go of it: the sidebar's named-session list shows it idle, with what it
holds (ranks, GPUs, memory). Screenshots go to ``artifacts/ui/``.
"""

from __future__ import annotations

import os
import signal

import pytest

from tests.ui.conftest import notebook_json, poll
from tests.ui.sidebar_page import set_sidebar_width

RANKS = 12
SLOW = 5
KILLED = 9
STOPPED = 2


def _open_sidebar(page, server, name: str) -> None:
    page.goto(f"{server.url}lab/tree/{name}?token={server.token}")
    page.wait_for_selector(".jp-NotebookPanel .jp-Cell", timeout=60_000)
    tab = page.locator(".jp-SideBar .lm-TabBar-tab[data-id='nbdist-sidebar']")
    tab.wait_for(timeout=30_000)
    assert poll(server.kernel_connected, timeout=60), server.kernels()
    page.wait_for_selector(".jp-Notebook-ExecutionIndicator[data-status='idle']", timeout=30_000)
    tab.click()
    page.locator("#nbdist-sidebar").wait_for(state="visible")
    page.locator("li.lm-MenuBar-item", has_text="Run").click()
    page.locator("li.lm-Menu-item[data-command='runmenu:run-all']").click()


def _deviating(page) -> list[tuple[str, str]]:
    items = page.locator(".nbdist-cluster li.nbdist-deviating-rank")
    return [
        (items.nth(i).get_attribute("data-rank"), items.nth(i).get_attribute("data-why"))
        for i in range(items.count())
    ]


@pytest.mark.timeout(600)
def test_sidebar_above_8_ranks_shows_hosts_and_deviating_ranks(
    lab_factory, browser_page, artifacts_dir, tmp_path
):
    stop = tmp_path / "stop"
    cell = f"""%%on_all_ranks
import os, time
i = 0
while not os.path.exists({str(stop)!r}) and i < 20_000:
    nbdist.log(step=i, loss=1.0 / (1.0 + 0.01 * i) + 0.01 * rank, samples=32)
    time.sleep(0.15 if rank == {SLOW} else 0.05)
    i += 1
print("stopped")"""
    server = lab_factory(
        "many.ipynb",
        notebook_json(["%load_ext nbdist", f"%dist_start {RANKS} --cpu --threads 1", cell]),
    )
    page = browser_page
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(f"page error: {exc}"))
    page.on(
        "console",
        lambda msg: (
            errors.append(msg.text) if msg.type == "error" and "nbdist" in msg.text else None
        ),
    )
    try:
        _open_sidebar(page, server, "many.ipynb")
        summary = page.locator(".nbdist-cluster .nbdist-summary")
        summary.wait_for(state="visible", timeout=180_000)
        # No card per rank: the summary counts them, one row for the (one) host.
        assert page.locator(".nbdist-cluster tr.nbdist-rank:visible").count() == 0
        hosts = page.locator(".nbdist-cluster tr.nbdist-host")
        assert poll(lambda: hosts.count() == 1, timeout=30), hosts.all_inner_texts()
        assert hosts.first.get_attribute("data-ranks") == str(RANKS)
        states = page.locator(".nbdist-summary-states")
        assert poll(lambda: f"{RANKS} ranks: {RANKS} busy" in states.inner_text(), 240), (
            states.inner_text()
        )
        # The slow rank is named as a straggler, and drawn in the charts with the median.
        assert poll(
            lambda: any(r == str(SLOW) and w.startswith("straggler") for r, w in _deviating(page)),
            timeout=90,
        ), _deviating(page)
        lines = page.locator(".nbdist-cluster svg.nbdist-chart-loss polyline")
        assert poll(
            lambda: (
                {lines.nth(i).get_attribute("data-rank") for i in range(lines.count())}
                >= {"-1", str(SLOW)}
            ),
            timeout=30,
        )
        legend = page.locator(".nbdist-cluster .nbdist-legend-item").all_inner_texts()
        assert legend[0] == "median of the ranks" and len(legend) <= 5, legend

        _, body = server.api("GET", "nbdist/api/clusters")
        [cluster] = body["clusters"]
        assert len(cluster["ranks"]) == RANKS and cluster["summary"]["hosts"][0]["ranks"] == RANKS
        # A rank stopped (a rank this test started): listed as stopped, and counted beside its
        # state in the counts and its host's row; continued, it is not any more.
        stopped_pid = cluster["ranks"][STOPPED]["pid"]
        os.kill(stopped_pid, signal.SIGSTOP)
        try:
            assert poll(lambda: (str(STOPPED), "stopped") in _deviating(page), timeout=30), (
                _deviating(page)
            )
            assert poll(lambda: "(1 stopped)" in states.inner_text(), timeout=10), (
                states.inner_text()
            )
            assert "(1 stopped)" in hosts.first.inner_text(), hosts.first.inner_text()
        finally:
            os.kill(stopped_pid, signal.SIGCONT)
        assert poll(lambda: "stopped" not in states.inner_text(), timeout=30), states.inner_text()

        # A rank killed: it comes first in the list, as dead; the counts say so.
        os.kill(cluster["ranks"][KILLED]["pid"], signal.SIGKILL)  # a rank this test started
        assert poll(lambda: _deviating(page)[:1] == [(str(KILLED), "dead")], timeout=30), (
            _deviating(page)
        )
        assert poll(lambda: "1 dead" in states.inner_text(), timeout=10), states.inner_text()
        strokes = [lines.nth(i).get_attribute("stroke") for i in range(lines.count())]
        assert len(set(strokes)) == len(strokes), strokes  # each line drawn in its own colour
        _, body = server.api("GET", "nbdist/api/clusters")
        drawn = [r for r in body["clusters"][0]["ranks"] if r["loss_series"]]
        assert len(drawn) <= 4, [r["rank"] for r in drawn]  # the others only in the median
        page.locator("#nbdist-sidebar").screenshot(
            path=str(artifacts_dir / "sidebar-many-ranks.png")
        )
        # Wide enough for the per-rank table's header row: still the summary, no empty table.
        set_sidebar_width(page, 700)
        assert page.locator(".nbdist-cluster table.nbdist-ranks").is_hidden()
        assert hosts.first.is_visible() and summary.is_visible()
    finally:
        stop.touch()
    assert errors == [], errors


@pytest.mark.timeout(300)
def test_named_session_list_shows_idle_time_and_what_it_holds(
    lab_factory, browser_page, artifacts_dir
):
    server = lab_factory(
        "named.ipynb",
        notebook_json(
            [
                "%load_ext nbdist",
                "%dist_start 2 --cpu --name held1 --idle-timeout 1h",
                "print('named session started')",
            ]
        ),
    )
    page = browser_page
    try:
        _open_sidebar(page, server, "named.ipynb")
        started = page.locator(".jp-OutputArea-output", has_text="named session started")
        assert poll(lambda: started.count() > 0, timeout=120), "the named session did not start"
        item = page.locator(".nbdist-named-session[data-name='held1']")
        held = item.locator(".nbdist-named-held")
        assert poll(lambda: held.count() and "2 ranks" in held.inner_text(), timeout=30)
        [kernel] = server.kernels()
        # A restarted kernel lets go of the session: nobody uses it, it is idle.
        server.api("POST", f"api/kernels/{kernel['id']}/restart", {}, timeout=60)
        assert poll(lambda: held.inner_text().startswith("idle "), timeout=60), held.inner_text()
        text = held.inner_text()
        assert "(ends at 1.0 h)" in text and "no GPU" in text and "GiB" in text, text
        assert not text.endswith(" 0.0 GiB"), text  # its processes hold memory
        page.locator("#nbdist-sidebar").screenshot(path=str(artifacts_dir / "sidebar-named.png"))
    finally:
        try:  # the keeper ends the session's processes (the fixture checks none is left)
            server.api("POST", "nbdist/api/sessions/held1/stop", {}, timeout=60)
        except OSError as exc:
            print(f"stopping held1: {exc}")


# A finished 64-rank run in the default history (the server's too): rank 41 steps three
# times slower than the others, rank 17's loss ends far from every other rank's.
PAST_RANKS, PAST_SLOW, PAST_ASTRAY, PAST_STEPS = 64, 41, 17, 300
PAST_RUN_CELL = f"""import time
from nbdist.metrics.store import RunStore
history = RunStore()
run = history.new_run(world_size={PAST_RANKS}, backend="gloo")
t0 = time.time()
for rank in range({PAST_RANKS}):
    dt = 0.3 if rank == {PAST_SLOW} else 0.1
    history.append(run.id, rank, [
        [s, t0 + s * dt, {{
            "loss": 5.0 if rank == {PAST_ASTRAY} and s > 250 else 2.0 / (1 + 0.01 * s) + 0.001 * rank,
            "step_time": dt,
        }}]
        for s in range({PAST_STEPS})
    ])
history.commit(); history.end_run(run.id); history.close()
print("run", run.id, "written")"""

PAST_PLOT = """() => {
  const plot = document.querySelector('.nbdist-run-chart .nbdist-run-plot-loss');
  if (!plot || !plot.data) return null;
  const legend = [...document.querySelectorAll('.nbdist-run-chart .nbdist-legend-item')];
  return {
    traces: plot.data.map(t => [t.name, t.visible, t.line.color, t.fill || '']),
    legend: legend.map(i => [i.textContent, i.title]),
  };
}"""


@pytest.mark.timeout(300)
def test_a_past_run_above_8_ranks_charts_the_median_band_and_the_deviating_ranks(
    lab_factory, browser_page, artifacts_dir
):
    server = lab_factory("past.ipynb", notebook_json([PAST_RUN_CELL]))
    page = browser_page
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(f"page error: {exc}"))
    _open_sidebar(page, server, "past.ipynb")
    assert poll(
        lambda: any(
            r["world_size"] == PAST_RANKS and r["ended"]
            for r in server.api("GET", "nbdist/api/runs")[1]["runs"]
        ),
        60,
    )
    page.locator(".nbdist-runs-refresh").click()
    page.locator(".nbdist-run-link").first.click()
    state = poll(lambda: page.evaluate(PAST_PLOT), timeout=60)
    assert state, "the run's loss chart was not drawn"
    names = [name for name, *_ in state["traces"]]
    # Not 64 lines: the band every rank lies in, its median, and the two deviating ranks.
    assert names == [
        "min of the ranks",
        "max of the ranks",
        "median of the ranks",
        f"rank {PAST_ASTRAY}",
        f"rank {PAST_SLOW}",
    ], names
    assert state["traces"][1][3] == "tonexty"  # the band is filled
    colours = [colour for name, _, colour, _ in state["traces"] if name.startswith("rank ")]
    assert len(set(colours)) == 2, colours
    legend = dict(state["legend"])
    assert list(legend) == [
        "median, min–max of the ranks",
        f"rank {PAST_SLOW}",
        f"rank {PAST_ASTRAY}",
    ], legend
    assert "step time" in legend[f"rank {PAST_SLOW}"]  # why it is drawn, on hover
    assert "far from the others" in legend[f"rank {PAST_ASTRAY}"]
    page.locator(".nbdist-run-chart").first.screenshot(
        path=str(artifacts_dir / "past-run-64-ranks.png")
    )
    # The median's legend entry hides the band and the median, as a rank's hides its line.
    page.locator(".nbdist-run-chart .nbdist-legend-item").first.click()
    assert poll(
        lambda: [v for _, v, *_ in page.evaluate(PAST_PLOT)["traces"]][:3] == ["legendonly"] * 3,
        10,
    )
    assert errors == [], errors
