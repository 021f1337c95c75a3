"""The JupyterLab sidebar in a real browser: JupyterLab + headless Chromium + 2 CPU ranks.

The notebook loads nbdist, starts 2 ranks (gloo) and runs a long logging
cell. While it runs, the test checks in the page that:

- the nbdist sidebar lists the cluster with 2 ranks whose step advances, and
  its loss chart gains points (``polyline[data-points]``);
- the status bar shows "nbdist · 2 ranks · gloo · step N · ... samples/s";
- Interrupt in the sidebar (after its confirmation dialog) stops the running
  cell: it ends with KeyboardInterrupt on the ranks, the ranks stay up;
- the run opens from "Past runs" as a main-area chart with one line per rank;
- a rank killed outright shows as dead, and the status bar warns about it;
- no uncaught page error and no console error about nbdist;
- in Notebook 7 (no JupyterLab shell) the command palette opens the same panel, and
  nothing about nbdist fails in the console.

The extension under test is the one built into ``nbdist/labextension`` (the
package build puts it there); screenshots go to ``artifacts/ui/``.
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

ROOT = Path(__file__).resolve().parents[2]
BUILT = ROOT / "nbdist" / "labextension"

LOG_CELL = """%%on_all_ranks
import time
for i in range(3000):
    nbdist.log(step=i, loss=1.0 / (1.0 + 0.01 * i) + 0.1 * rank, samples=32)
    time.sleep(0.03)
print("finished " + "all steps")"""


def _use_built_extension(data_dir: Path) -> str:
    """Make the lab server load the extension built from this checkout.

    A link in the server's (isolated) data dir wins over an installed copy in
    ``sys.prefix``, so the test always sees the current build.
    """
    if (BUILT / "package.json").exists():
        link = data_dir / "labextensions" / "nbdist"
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(BUILT, target_is_directory=True)
        return f"built at {BUILT}"
    installed = Path(sys.prefix) / "share" / "jupyter" / "labextensions" / "nbdist"
    if (installed / "package.json").exists():
        return f"installed at {installed}"
    pytest.fail(
        f"the JupyterLab extension is not built ({BUILT} is missing): run "
        "`pip install -e .` (builds it) or `cd labextension && jlpm install && jlpm build`"
    )


def _steps(page) -> list[int]:
    texts = page.locator(".nbdist-cluster tr.nbdist-rank td.nbdist-col-step").all_inner_texts()
    return [int(t) if t.strip().isdigit() else -1 for t in texts]


def _chart_last_x(page) -> list[int]:
    """The newest step drawn by each rank's line of the sidebar's loss chart."""
    lines = page.locator(".nbdist-cluster svg.nbdist-chart-loss polyline")
    return [int(lines.nth(i).get_attribute("data-last-x") or -1) for i in range(lines.count())]


@pytest.mark.timeout(240)
def test_sidebar_shows_live_ranks_and_interrupts(
    lab_factory, browser_page, tmp_path, artifacts_dir
):
    where = _use_built_extension(tmp_path / "jupyter" / "data")
    server = lab_factory(
        "sidebar.ipynb", notebook_json(["%load_ext nbdist", "%dist_start 2 --cpu", LOG_CELL])
    )
    print(f"nbdist labextension {where}; nbdist.server {server.extension}")
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
    assert poll(
        lambda: any(
            k["execution_state"] == "idle" and k["connections"] >= 1 for k in server.kernels()
        ),
        timeout=60,
    ), server.kernels()
    page.wait_for_selector(".jp-Notebook-ExecutionIndicator[data-status='idle']", timeout=30_000)
    tab.click()
    sidebar = page.locator("#nbdist-sidebar")
    sidebar.wait_for(state="visible")
    assert "No nbdist cluster is running" in sidebar.inner_text()

    page.locator("li.lm-MenuBar-item", has_text="Run").click()
    page.locator("li.lm-Menu-item[data-command='runmenu:run-all']").click()

    # The cluster appears with its 2 ranks, and their steps and charts advance.
    page.wait_for_selector(".nbdist-cluster tr.nbdist-rank", timeout=90_000)
    assert page.locator(".nbdist-cluster").count() == 1
    assert page.locator(".nbdist-cluster tr.nbdist-rank").count() == 2
    assert poll(lambda: min(_steps(page)) >= 0, timeout=60), _steps(page)
    first_steps, first_x = _steps(page), _chart_last_x(page)
    assert poll(lambda: all(b > a for a, b in zip(first_steps, _steps(page))), timeout=30), (
        f"steps did not advance: {first_steps} -> {_steps(page)}"
    )
    assert poll(
        lambda: (
            len(_chart_last_x(page)) == 2
            and all(b > a for a, b in zip(first_x, _chart_last_x(page)))
        ),
        timeout=30,
    ), f"the loss chart did not advance: {first_x} -> {_chart_last_x(page)}"
    title = page.locator(".nbdist-cluster-title").inner_text()
    assert "sidebar.ipynb · 2 ranks · gloo" in title, title
    states = page.locator(".nbdist-cluster tr.nbdist-rank td.nbdist-col-state").all_inner_texts()
    assert states == ["busy", "busy"], states
    status = page.locator(".nbdist-statusbar")
    assert poll(
        lambda: re.search(
            r"nbdist · 2 ranks · gloo · step \d+ · \S+ samples/s", status.inner_text()
        ),
        timeout=20,
    ), status.inner_text()
    page.screenshot(path=str(artifacts_dir / "sidebar-live.png"))

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
    assert "SIGINT sent to 2 rank processes" in page.locator(".nbdist-message").inner_text()
    # The ranks are still up: not dead, and their steps stop advancing.
    assert poll(
        lambda: (
            page.locator(".nbdist-cluster tr.nbdist-rank td.nbdist-col-state").all_inner_texts()
            == ["idle", "idle"]
        ),
        timeout=30,
    )
    page.screenshot(path=str(artifacts_dir / "sidebar-interrupted.png"))

    # The run, from the history, as a chart in the main area.
    page.locator(".nbdist-runs-refresh").click()
    page.locator(".nbdist-run-link").first.click()
    chart = page.locator(".nbdist-run-chart svg.nbdist-chart-loss polyline")
    chart.first.wait_for(timeout=30_000)
    assert chart.count() == 2
    assert all(int(chart.nth(i).get_attribute("data-points")) > 10 for i in range(2))
    page.screenshot(path=str(artifacts_dir / "sidebar-run-chart.png"))

    # A rank that dies: its row says dead and the status bar warns.
    _, body = server.api("GET", "nbdist/api/clusters")
    rank1_pid = body["clusters"][0]["ranks"][1]["pid"]
    os.kill(rank1_pid, signal.SIGKILL)  # an engine this test's notebook started, by PID
    assert poll(lambda: "rank 1 dead of 2" in status.inner_text(), timeout=30), status.inner_text()
    assert (
        page.locator(".nbdist-cluster tr.nbdist-rank").nth(1).get_attribute("data-state") == "dead"
    )
    page.screenshot(path=str(artifacts_dir / "sidebar-dead-rank.png"))
    assert errors == [], errors


def _start_notebook7(tmp: Path) -> tuple[subprocess.Popen, str]:
    """Notebook 7 (``python -m notebook``) on a free loopback port, isolated dirs; (process, url)."""
    env = dict(os.environ)
    for var in ("JUPYTER_CONFIG_DIR", "JUPYTER_DATA_DIR", "JUPYTER_RUNTIME_DIR", "IPYTHONDIR"):
        (tmp / var).mkdir(parents=True, exist_ok=True)
        env[var] = str(tmp / var)
    _use_built_extension(tmp / "JUPYTER_DATA_DIR")
    (tmp / "root").mkdir(exist_ok=True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    token = secrets.token_hex(16)
    log = open(tmp / "notebook7.log", "wb")  # noqa: SIM115 - closed right after the start
    proc = subprocess.Popen(
        [sys.executable, "-m", "notebook", "--no-browser", "--allow-root", "--ip=127.0.0.1",
         f"--port={port}", "--ServerApp.port_retries=0", f"--IdentityProvider.token={token}",
         f"--ServerApp.root_dir={tmp / 'root'}"],
        env=env, stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
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
    return proc, f"{url}tree?token={token}"


@pytest.mark.timeout(120)
def test_notebook7_opens_the_panel_without_errors(browser_page, tmp_path, artifacts_dir):
    pytest.importorskip("notebook", reason="Notebook 7 is not installed")
    proc, url = _start_notebook7(tmp_path / "nb7")
    try:
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
