"""The JupyterLab sidebar, status bar and kernel indicators in a real browser.

JupyterLab + headless Chromium + 2 CPU ranks. The notebook loads nbdist, starts 2 ranks
(gloo) and runs a long logging cell in which rank 1 steps twice as slowly as rank 0. While
it runs, the test checks in the page that:

- JupyterLab's own kernel indicators (the notebook toolbar's and the status bar's) read
  Busy in every sample taken while the cell runs, also after the cell's dashboard widget
  opened (opening a first widget used to flip them to Idle);
- the sidebar lists the cluster, its 2 ranks' steps and charts advance; at the default
  width (and at a wide one) every figure of every rank is inside the sidebar; the charts
  have axis titles and a legend, in the server's rank palette (the dashboard's); rank 1
  carries the straggler flag; hovering a chart reads out each rank's value;
- the status bar shows "step <lowest>–<highest>" (the lagging rank shows) and the rate;
- all text of the sidebar and the status bar item reads at 4.5:1 or more in the light
  and the dark theme; screenshots at two widths in both themes go to ``artifacts/ui/``;
- Interrupt (after its dialog) stops the cell, the ranks stay up, "SIGINT sent" clears
  after a while, and the rate leaves the status bar once the ranks stop logging;
- the run opens from "Past runs" as interactive plotly charts (hover shows values, a drag
  zooms) with a line per rank in the palette, following the theme at 4.5:1;
- a killed rank shows as dead (and no straggler); Stop ends the cluster and the run is
  then listed as finished; no uncaught page error and no console error about nbdist;
- in Notebook 7 the command palette opens the same panel, without console errors.

The extension under test is this checkout's build (see ``tests/ui/labbuild.py``).
"""

from __future__ import annotations

import os
import re
import secrets
import signal
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from tests.ui.conftest import notebook_json, poll
from tests.ui.labbuild import link_labextension, served_labextension
from tests.ui.sidebar_page import (
    KERNEL_SAMPLER,
    OUTSIDE,
    chart_last_x,
    plot_state,
    readable,
    set_sidebar_width,
    set_theme,
    shoot,
    sidebar_width,
    steps,
)

LOG_CELL = """%%on_all_ranks
import time
for i in range(100_000):  # stopped by the sidebar's Interrupt
    nbdist.log(step=i, loss=1.0 / (1.0 + 0.01 * i) + 0.1 * rank, samples=32)
    time.sleep(0.03 if rank == 0 else 0.06)  # rank 1: twice the step time, a straggler
print("finished " + "all steps")"""


@pytest.mark.timeout(420)
def test_sidebar_status_bar_and_kernel_indicators(lab_factory, browser_page, artifacts_dir):
    server = lab_factory(
        "sidebar.ipynb", notebook_json(["%load_ext nbdist", "%dist_start 2 --cpu", LOG_CELL])
    )
    print(f"nbdist.server {server.extension}")
    palette = server.api("GET", "nbdist/api/palette")[1]["colours"]
    page = browser_page
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(f"page error: {exc}"))
    page.on(
        "console",
        lambda msg: (
            errors.append(msg.text) if msg.type == "error" and "nbdist" in msg.text else None
        ),
    )

    page.goto(f"{server.url}lab/tree/sidebar.ipynb?token={server.token}")
    page.wait_for_selector(".jp-NotebookPanel .jp-Cell", timeout=60_000)
    tab = page.locator(".jp-SideBar .lm-TabBar-tab[data-id='nbdist-sidebar']")
    tab.wait_for(timeout=30_000)  # the extension is loaded
    assert poll(server.kernel_connected, timeout=60), server.kernels()
    page.wait_for_selector(".jp-Notebook-ExecutionIndicator[data-status='idle']", timeout=30_000)
    tab.click()
    sidebar = page.locator("#nbdist-sidebar")
    sidebar.wait_for(state="visible")
    assert "No nbdist cluster is running" in sidebar.inner_text()
    default_width = sidebar_width(page)

    page.evaluate(KERNEL_SAMPLER)
    page.locator("li.lm-MenuBar-item", has_text="Run").click()
    page.locator("li.lm-Menu-item[data-command='runmenu:run-all']").click()

    # The cluster appears with its 2 ranks, and their steps and charts advance.
    page.wait_for_selector(".nbdist-cluster tr.nbdist-rank", timeout=90_000)
    assert page.locator(".nbdist-cluster").count() == 1
    assert page.locator(".nbdist-cluster tr.nbdist-rank").count() == 2
    assert poll(lambda: min(steps(page)) >= 0, timeout=60), steps(page)
    first_steps, first_x = steps(page), chart_last_x(page)
    assert poll(lambda: all(b > a for a, b in zip(first_steps, steps(page))), timeout=30), (
        f"steps did not advance: {first_steps} -> {steps(page)}"
    )
    assert poll(
        lambda: (
            len(chart_last_x(page)) == 2 and all(b > a for a, b in zip(first_x, chart_last_x(page)))
        ),
        timeout=30,
    ), f"the loss chart did not advance: {first_x} -> {chart_last_x(page)}"
    title = page.locator(".nbdist-cluster-title").inner_text()
    assert "sidebar.ipynb · 2 ranks · gloo" in title, title
    states = page.locator(".nbdist-cluster tr.nbdist-rank td.nbdist-col-state").all_inner_texts()
    assert states == ["busy", "busy"], states

    # Rank colours: the palette's, the same in the legend, the lines and the rows' swatches.
    legend = page.locator(".nbdist-cluster .nbdist-legend-item")
    assert legend.all_inner_texts() == ["rank 0", "rank 1"]
    assert [legend.nth(i).get_attribute("data-colour") for i in range(2)] == palette[:2]
    lines = page.locator(".nbdist-cluster svg.nbdist-chart-loss polyline")
    assert [lines.nth(i).get_attribute("stroke") for i in range(2)] == palette[:2]
    axis = page.locator(".nbdist-cluster .nbdist-chart-axis-title").all_text_contents()
    assert axis == ["step", "loss", "step", "samples/s"], axis
    # The straggler, flagged by the dashboard's rule; the other rank is not.
    rows = page.locator(".nbdist-cluster tr.nbdist-rank")
    assert poll(lambda: rows.nth(1).get_attribute("data-straggler"), timeout=30)
    assert rows.nth(0).get_attribute("data-straggler") == ""
    assert "⚠" in rows.nth(1).locator("td.nbdist-col-flag").inner_text()
    # The status bar: the range of steps (rank 1 lags) and the rate.
    status = page.locator(".nbdist-statusbar")
    pattern = r"nbdist · 2 ranks · gloo · step (\d+)–(\d+) · \S+ samples/s"
    assert poll(lambda: re.search(pattern, status.inner_text()), timeout=30), status.inner_text()
    low, high = map(int, re.search(pattern, status.inner_text()).groups())
    assert low < high

    # Hovering the loss chart reads out both ranks' values.
    chart = page.locator(".nbdist-cluster svg.nbdist-chart-loss")
    chart.hover(position={"x": 150, "y": 60})  # inside the plot at any sidebar width
    readout = page.locator(".nbdist-cluster .nbdist-chart-readout").first
    both = re.compile(r"rank 0 · step \d+: \S+.*rank 1 · step \d+: \S+", re.S)
    assert poll(lambda: both.search(readout.inner_text()), 10), readout.inner_text()
    drawn = chart_last_x(page)  # and after the next redraw (one per poll), still there
    assert poll(lambda: chart_last_x(page) != drawn, 10)
    assert both.search(readout.inner_text()), readout.inner_text()
    page.mouse.move(0, 0)

    # Readable at the default width and at a wide one, light theme.
    assert page.evaluate(OUTSIDE) == [], f"at {default_width:.0f} px"
    readable(page, "light")
    shoot(page, artifacts_dir, f"light-{default_width:.0f}px")
    set_sidebar_width(page, 600)
    assert page.locator(".nbdist-cluster thead th").first.is_visible()  # a table from here
    assert poll(lambda: page.evaluate(OUTSIDE) == [], 10), page.evaluate(OUTSIDE)
    shoot(page, artifacts_dir, "light-600px")
    set_theme(page, "JupyterLab Dark", light=False)
    readable(page, "dark")
    shoot(page, artifacts_dir, "dark-600px")
    set_sidebar_width(page, round(default_width))
    assert poll(lambda: page.evaluate(OUTSIDE) == [], 10), page.evaluate(OUTSIDE)
    shoot(page, artifacts_dir, f"dark-{default_width:.0f}px")

    # Every sample taken while the cell ran read Busy, including after its widget opened.
    samples = page.evaluate(
        "() => { clearInterval(window.__kernelSampler); return window.__kernelSamples; }"
    )
    running = [
        s for s in samples if s["prompts"][2:3] == ["[*]:"] and s["prompts"][1][1:-2].isdigit()
    ]
    # JupyterLab shows [*] as soon as it sends the cell, before the kernel's busy status comes
    # back: the status bar may read Idle for that instant. From the kernel's first Busy on,
    # nothing may read Idle until the cell ends.
    first_busy = next(
        (i for i, s in enumerate(running) if s["statusbar"].endswith("| Busy")), len(running)
    )
    assert first_busy <= 5, running[:6]  # Busy within half a second of the prompt showing [*]
    running = running[first_busy:]
    assert len(running) > 20 and any(s["dashboard"] for s in running), (len(running), samples[-3:])
    idle = [s for s in running if s["toolbar"] != "busy" or not s["statusbar"].endswith("| Busy")]
    assert idle == [], f"{len(idle)} of {len(running)} samples not Busy, e.g. {idle[:3]}"

    # Interrupt from the sidebar, confirmed in the dialog: the running cell stops.
    log_prompt = page.locator(".jp-NotebookPanel .jp-Cell .jp-InputPrompt").nth(2)
    assert log_prompt.inner_text().strip() == "[*]:"
    page.locator(".nbdist-cluster button.nbdist-interrupt").click()
    page.locator(".jp-Dialog button.jp-mod-accept").click()
    assert poll(lambda: log_prompt.inner_text().strip() != "[*]:", timeout=30), (
        "the cell still runs after Interrupt"
    )
    output = (
        page.locator(".jp-NotebookPanel .jp-Cell").nth(2).locator(".jp-OutputArea").inner_text()
    )
    assert "KeyboardInterrupt" in output and "finished all steps" not in output, output
    message = page.locator(".nbdist-message")
    assert "SIGINT sent to 2 rank processes" in message.inner_text()
    # The ranks are still up: not dead, and idle; the message and the stale rate go away.
    assert poll(
        lambda: (
            page.locator(".nbdist-cluster tr.nbdist-rank td.nbdist-col-state").all_inner_texts()
            == ["idle", "idle"]
        ),
        timeout=30,
    )
    assert poll(lambda: message.inner_text().strip() == "", timeout=30), message.inner_text()
    assert poll(lambda: "samples/s" not in status.inner_text(), timeout=30), status.inner_text()
    assert re.search(r"step \d+–\d+$", status.inner_text()), status.inner_text()

    # The run, from the history: interactive charts in the main area, in the palette.
    page.locator(".nbdist-runs-refresh").click()
    link = page.locator(".nbdist-run-link").first
    assert poll(lambda: link.inner_text().endswith("· running"), timeout=10), link.inner_text()
    link.click()
    page.wait_for_selector(".nbdist-run-plot-loss .main-svg", timeout=60_000)
    dark = plot_state(page, "loss")
    assert [(name, colour) for name, colour, _ in dark["traces"]] == [
        ("rank 0", palette[0]),
        ("rank 1", palette[1]),
    ]
    assert all(n > 10 for *_, n in dark["traces"]), dark["traces"]
    assert (dark["xtitle"], dark["ytitle"]) == ("step", "loss")
    area = page.locator(".nbdist-run-plot-loss .nsewdrag").bounding_box()
    page.mouse.move(area["x"] + area["width"] * 0.5, area["y"] + area["height"] * 0.5)
    assert poll(lambda: page.locator(".nbdist-run-plot-loss .hoverlayer .hovertext").count(), 10)
    y = area["y"] + area["height"] * 0.5
    page.mouse.move(area["x"] + area["width"] * 0.3, y)
    page.mouse.down()
    page.mouse.move(area["x"] + area["width"] * 0.6, y, steps=8)
    page.mouse.up()
    assert poll(lambda: plot_state(page, "loss")["x"] != dark["x"], timeout=10)
    zoomed = plot_state(page, "loss")["x"]
    assert dark["x"][0] < zoomed[0] < zoomed[1] < dark["x"][1], (dark["x"], zoomed)
    # One legend for all charts: a click hides a rank everywhere, another shows it again.
    rank1 = page.locator(".nbdist-run-chart .nbdist-legend-item[data-rank='1']")
    rank1.click()
    assert poll(lambda: plot_state(page, "loss")["visible"] == [True, "legendonly"], timeout=10)
    rank1.click()
    assert poll(lambda: plot_state(page, "loss")["visible"] == [True, True], timeout=10)
    readable(page, "dark, with the run chart")
    set_theme(page, "JupyterLab Light", light=True)
    assert poll(lambda: plot_state(page, "loss")["titleFill"] != dark["titleFill"], timeout=10)
    assert plot_state(page, "loss")["x"] == zoomed  # a theme change keeps the zoom
    readable(page, "light, with the run chart")
    page.screenshot(path=str(artifacts_dir / "sidebar-run-chart.png"))

    # A rank whose process is stopped (Ctrl-Z, SIGSTOP): its state says so, and its title
    # what lets it go on; continued, the row reads as before.
    _, body = server.api("GET", "nbdist/api/clusters")
    rank1_pid = body["clusters"][0]["ranks"][1]["pid"]
    state1 = rows.nth(1).locator("td.nbdist-col-state")
    os.kill(rank1_pid, signal.SIGSTOP)  # an engine this test's notebook started, by PID
    try:
        assert poll(lambda: state1.inner_text() == "idle · stopped", timeout=30), (
            state1.inner_text()
        )
        assert rows.nth(1).get_attribute("data-process") == "stopped"
        assert f"kill -CONT {rank1_pid} lets it go on" in state1.get_attribute("title")
        readable(page, "light, a stopped rank")
    finally:
        os.kill(rank1_pid, signal.SIGCONT)
    assert poll(lambda: state1.inner_text() == "idle", timeout=30), state1.inner_text()
    assert state1.get_attribute("title") is None

    # A rank that dies: its row says dead (no straggler) and the status bar warns.
    os.kill(rank1_pid, signal.SIGKILL)  # an engine this test's notebook started, by PID
    assert poll(lambda: "rank 1 dead of 2" in status.inner_text(), timeout=30), status.inner_text()
    assert rows.nth(1).get_attribute("data-state") == "dead"
    assert rows.nth(1).get_attribute("data-straggler") == ""
    readable(page, "light, a dead rank")
    shoot(page, artifacts_dir, "dead-rank")

    # Stop, from the sidebar: the cluster goes, and its run is listed as finished.
    page.locator(".nbdist-cluster button.nbdist-stop").click()
    page.locator(".jp-Dialog button.jp-mod-accept").click()
    assert poll(lambda: page.locator(".nbdist-cluster").count() == 0, timeout=60)
    assert poll(lambda: link.inner_text().endswith("· finished"), timeout=30), link.inner_text()
    assert errors == [], errors


TWO_RUN_1S_CELL = """import os, time, nbdist
from nbdist.metrics.store import RunStore
default = RunStore()  # the default history (the server's too): its run 1, losses 9 8 7
run = default.new_run(world_size=1, backend="gloo")
default.append(run.id, 0, [[i, time.time(), {"loss": 9.0 - i}] for i in range(3)])
default.commit(); default.end_run(run.id); default.close()
session = nbdist.DistSession(1, cpu=True, history=os.path.abspath("mine.sqlite"))
session.start()  # its own history: its run is run 1 as well, losses 0.5 1.5 2.5 3.5
session.run("for i in range(4):\\n    nbdist.log(step=i, loss=0.5 + i)")"""

LOSSES = """() => {
  const shown = [...document.querySelectorAll('.nbdist-run-chart')].filter(c => c.offsetParent);
  const plot = shown.length === 1 && shown[0].querySelector('.nbdist-run-plot-loss');
  return plot && plot.data ? plot.data[0].y : null;
}"""  # the loss values of the run chart shown


@pytest.mark.timeout(300)
def test_two_histories_run_1_open_two_charts_of_their_own(lab_factory, browser_page):
    """A live cluster's own history= file and the default history each have a run 1:
    "Past runs" lists both, and each opens its own chart with its own points."""
    server = lab_factory("two.ipynb", notebook_json([TWO_RUN_1S_CELL]))
    page = browser_page
    page.goto(f"{server.url}lab/tree/two.ipynb?token={server.token}")
    page.wait_for_selector(".jp-NotebookPanel .jp-Cell", timeout=60_000)
    # The page shows "idle" before its kernel exists, and a Run All clicked before the
    # kernel is connected is dropped: wait until the server sees the page connected.
    assert poll(server.kernel_connected, timeout=60), server.kernels()
    page.wait_for_selector(".jp-Notebook-ExecutionIndicator[data-status='idle']", timeout=60_000)
    page.locator(".jp-SideBar .lm-TabBar-tab[data-id='nbdist-sidebar']").click()
    page.locator("li.lm-MenuBar-item", has_text="Run").click()
    page.locator("li.lm-Menu-item[data-command='runmenu:run-all']").click()
    prompt = page.locator(".jp-NotebookPanel .jp-Cell .jp-InputPrompt").first
    assert poll(lambda: prompt.inner_text().strip() != "[ ]:", 10), "Run All ran no cell"
    mine = str(server.root_dir / "mine.sqlite")

    def ones() -> list[dict]:
        return [r for r in server.api("GET", "nbdist/api/runs")[1]["runs"] if r["id"] == 1]

    assert poll(lambda: any(r["history"] == mine and r["points"] == 4 for r in ones()), 120)
    page.locator(".nbdist-runs-refresh").click()
    links = page.locator(".nbdist-run-link[data-run-id='1']")
    assert poll(lambda: links.count() == 2, timeout=10), links.all_inner_texts()
    # Newest first: the cluster's run 1, then the default history's; each opens its own chart.
    for i, losses in enumerate(([0.5, 1.5, 2.5, 3.5], [9, 8, 7])):
        links.nth(i).click()
        assert poll(lambda want=losses: page.evaluate(LOSSES) == want, 60), page.evaluate(LOSSES)
        assert page.locator(".nbdist-run-chart").count() == i + 1  # a chart of its own
    histories = [links.nth(i).get_attribute("data-history") for i in range(2)]
    assert histories == [mine, ones()[0]["history"]]  # and each names its history
    assert "mine.sqlite" in links.nth(0).inner_text(), links.nth(0).inner_text()
    links.nth(0).click()  # open already: shown again, not opened twice
    assert page.locator(".nbdist-run-chart").count() == 2
    assert poll(lambda: page.evaluate(LOSSES) == [0.5, 1.5, 2.5, 3.5], 10), page.evaluate(LOSSES)
    page.locator(".nbdist-cluster button.nbdist-stop").click()
    page.locator(".jp-Dialog button.jp-mod-accept").click()
    assert poll(lambda: page.locator(".nbdist-cluster").count() == 0, timeout=60)


def _start_notebook7(tmp: Path) -> tuple[subprocess.Popen, str, str]:
    """Notebook 7 on a free loopback port, isolated dirs, this checkout's extension build."""
    env = dict(os.environ)
    for var in ("JUPYTER_CONFIG_DIR", "JUPYTER_DATA_DIR", "JUPYTER_RUNTIME_DIR", "IPYTHONDIR"):
        (tmp / var).mkdir(parents=True, exist_ok=True)
        env[var] = str(tmp / var)
    labextensions = link_labextension(tmp / "labextensions-under-test")
    (tmp / "root").mkdir(exist_ok=True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    token = secrets.token_hex(16)
    log = open(tmp / "notebook7.log", "wb")  # noqa: SIM115 - closed right after the start
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "notebook",
            "--no-browser",
            "--allow-root",
            "--ip=127.0.0.1",
            f"--port={port}",
            "--ServerApp.port_retries=0",
            f"--IdentityProvider.token={token}",
            f"--ServerApp.root_dir={tmp / 'root'}",
            # The notebook app's pages name the extensions; jupyterlab's serves their files.
            f"--JupyterNotebookApp.extra_labextensions_path={labextensions}",
            f"--LabApp.extra_labextensions_path={labextensions}",
        ],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    log.close()
    url = f"http://127.0.0.1:{port}/"

    def up() -> bool:
        try:
            with urllib.request.urlopen(f"{url}api/status?token={token}", timeout=2):
                return True
        except OSError:
            return proc.poll() is not None

    poll(up, timeout=60)
    if proc.poll() is not None:
        pytest.fail(f"notebook exited: {(tmp / 'notebook7.log').read_text()[-2000:]}")
    with urllib.request.urlopen(f"{url}tree?token={token}", timeout=10) as resp:
        served = served_labextension(resp.read().decode())
    # and the file it names is there (a 404 would leave the page without the extension)
    with urllib.request.urlopen(f"{url}lab/extensions/nbdist/{served}?token={token}", timeout=10):
        pass
    return proc, f"{url}tree?token={token}", served


@pytest.mark.timeout(120)
def test_notebook7_opens_the_panel_without_errors(
    browser_page, tmp_path, artifacts_dir, labextension_entry
):
    pytest.importorskip("notebook", reason="Notebook 7 is not installed")
    proc, url, served = _start_notebook7(tmp_path / "nb7")
    try:
        assert served == labextension_entry, "Notebook 7 serves another nbdist build"
        page = browser_page
        ours: list[str] = []
        page.on(
            "pageerror",
            lambda exc: ours.append(str(exc)) if "nbdist" in f"{exc} {exc.stack}" else None,
        )
        page.on(
            "console",
            lambda msg: (
                ours.append(msg.text)
                if msg.type == "error" and "nbdist" in f"{msg.text} {msg.location}"
                else None
            ),
        )
        page.goto(url)
        page.wait_for_selector(".jp-DirListing", timeout=60_000)
        # Notebook 7 has no sidebar tab bar: the command palette opens the panel.
        page.keyboard.press("Control+Shift+C")
        page.keyboard.type("nbdist: Show Clusters")
        page.keyboard.press("Enter")
        sidebar = page.locator("#nbdist-sidebar")
        sidebar.wait_for(state="visible", timeout=30_000)
        assert poll(lambda: "No nbdist cluster is running" in sidebar.inner_text(), timeout=20)
        page.screenshot(path=str(artifacts_dir / "sidebar-notebook7.png"))
        assert ours == [], ours
    finally:
        proc.terminate()  # our own server process, by PID; it started no kernel
        proc.wait(20)
