"""The live dashboard in a real browser: JupyterLab + headless Chromium + 2 CPU ranks.

The notebook loads nbdist, starts 2 ranks (gloo), shows the dashboard, then
runs a cell in which each rank calls ``nbdist.log`` a few hundred times. The
test runs all cells from the Run menu and checks, in the page:

- the dashboard (``.nbdist-dashboard``) appears and its ``data-points`` grows
  while the logging cell is still running (the cell waits for the test's signal
  files half-way and at the end, so this does not race the machine's load);
- plotly.js came from the nbdist server extension's route;
- at the end the loss plot holds one trace per rank with exactly the values the
  ranks logged, plus the mean across ranks, and the counts match what the kernel
  received (``nbdist.current_session().metrics``);
- no uncaught page error, and no console error about nbdist, plotly or widgets.

A screenshot of the finished dashboard is kept in ``artifacts/ui/``.
"""

from __future__ import annotations

import json
import re
import time

import pytest

from tests.ui.conftest import notebook_json, poll

STEPS = 500  # per rank, in two halves: the test lets the second half start
SLEEP_S = 0.01
RANKS = 2
OFFSET = 0.1  # rank r logs loss(i) + OFFSET * r
WAIT_S = 120  # how long the cell waits for the test's go-ahead at most


def _loss(i: int, rank: int) -> float:
    return 1.0 / (1.0 + 0.02 * i) + OFFSET * rank


def _log_cell(signals: str) -> str:
    """Log the first half, wait for ``more``, log the rest, wait for ``done``.

    The waits make "the plot grows while the cell runs" a fact the test controls, not a
    race against the machine's load.
    """
    return f"""%%on_all_ranks
import os, time
import nbdist

def wait_for(name):
    path = os.path.join({signals!r}, name)
    deadline = time.monotonic() + {WAIT_S}
    while not os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.05)

for i in range({STEPS}):
    if i == {STEPS // 2}:
        wait_for("more")
    nbdist.log(step=i, loss=1.0 / (1.0 + 0.02 * i) + {OFFSET} * rank, samples=64)
    time.sleep({SLEEP_S})
wait_for("done")
print("logging done on rank", rank)"""


REPORT_CELL = """import json
import nbdist
_run = nbdist.current_session().metrics
print("LOGGED " + json.dumps({"total": _run.count(), "per_rank": {str(r): _run.count(r) for r in _run.ranks}}))"""


def _dashboard_cell() -> str:
    """``%dist_dashboard`` where nbdist has it, else the API it stands for."""
    from nbdist.magics import DistMagics

    if hasattr(DistMagics, "dist_dashboard"):
        return "%dist_dashboard"
    return "import nbdist\nimport nbdist.dashboard\nnbdist.current_session().dashboard();"


def _dashboard_notebook(signals: str) -> dict:
    return notebook_json(
        [
            "%load_ext nbdist",
            f"%dist_start {RANKS} --cpu",
            _dashboard_cell(),
            _log_cell(signals),
            REPORT_CELL,
        ]
    )


# Console errors that concern what this test checks (message text or source URL).
_OURS = re.compile(r"nbdist|plotly|anywidget|widget", re.IGNORECASE)


class PageLog:
    """Console messages and uncaught errors of one page."""

    def __init__(self, page):
        self.errors: list[str] = []
        self.page_errors: list[str] = []
        page.on("console", self._console)
        page.on("pageerror", lambda exc: self.page_errors.append(str(exc)))

    def _console(self, msg) -> None:
        if msg.type == "error":
            url = (msg.location or {}).get("url", "")
            self.errors.append(f"{msg.text} [{url}]")

    def ours(self) -> list[str]:
        return [e for e in self.errors if _OURS.search(e)]


def _kernel_ready(server) -> bool:
    """The notebook's kernel is started, idle and connected to the page."""
    kernels = server.kernels()
    return any(k["execution_state"] == "idle" and k["connections"] >= 1 for k in kernels)


def _open_and_run_all(page, server, name: str) -> None:
    page.goto(f"{server.url}lab/tree/{name}?token={server.token}")
    page.wait_for_selector(".jp-NotebookPanel .jp-Cell", timeout=60_000)
    # The page shows "idle" before its kernel exists, and a Run All clicked before the
    # kernel is connected is dropped: wait until the server sees the page connected.
    assert poll(lambda: _kernel_ready(server), timeout=60, interval=0.2), server.kernels()
    page.wait_for_selector(".jp-Notebook-ExecutionIndicator[data-status='idle']", timeout=30_000)
    # A news / update toast would cover the page: the lab settings turn them off; just in case:
    for text in ("Would you like to get notified", "Would you like to receive"):
        if page.get_by_text(text).count():
            page.get_by_role("button", name="No").first.click()
    # Collapse the file browser so the notebook (and the dashboard) gets the width.
    page.locator(".jp-SideBar.jp-mod-left .lm-TabBar-tab.lm-mod-current").click()
    page.locator("li.lm-MenuBar-item", has_text="Run").click()
    page.locator("li.lm-Menu-item[data-command='runmenu:run-all']").click()
    started = poll(lambda: any(p.strip() != "[ ]:" for p in _prompts(page)), timeout=10)
    assert started, f"Run All did not start the cells: {_prompts(page)}"


def _prompts(page) -> list[str]:
    return page.locator(".jp-NotebookPanel .jp-Cell .jp-InputPrompt").all_inner_texts()


def _points(dashboard) -> int:
    return int(dashboard.get_attribute("data-points") or 0)


def _plot_state(dashboard) -> list[dict]:
    """Every panel's traces as plotted (each Plotly graph div's ``data``) in one dashboard."""
    return dashboard.evaluate(
        """root => Array.from(root.querySelectorAll('.nbdist-panel')).map(div => ({
            key: div.dataset.key,
            points: Number(div.dataset.points || 0),
            traces: (div.data || []).map(t => ({name: t.name, x: Array.from(t.x), y: Array.from(t.y)})),
        }))"""
    )


@pytest.mark.timeout(180)
def test_dashboard_grows_live_and_matches_logged(
    lab_factory, browser_page, artifacts_dir, tmp_path
):
    t0 = time.monotonic()
    timings: dict[str, float] = {}
    signals = tmp_path / "signals"
    signals.mkdir()
    server = lab_factory("dashboard.ipynb", _dashboard_notebook(str(signals)))
    timings["server up"] = time.monotonic() - t0
    print(f"nbdist.server: {server.extension}")
    status, body = server.get("nbdist/static/plotly.min.js")
    assert status == 200 and len(body) > 100_000, (
        f"GET nbdist/static/plotly.min.js: {status}, {len(body)} bytes (nbdist.server "
        f"{server.extension})"
    )

    page = browser_page
    log = PageLog(page)
    _open_and_run_all(page, server, "dashboard.ipynb")
    timings["run all clicked"] = time.monotonic() - t0

    dashboard = page.locator(".nbdist-dashboard").first
    dashboard.wait_for(state="visible", timeout=60_000)
    timings["dashboard shown"] = time.monotonic() - t0

    # Live: while the logging cell runs, the plotted point count goes up.
    assert poll(lambda: _points(dashboard) > 0, timeout=45), (
        f"no point plotted: prompts {_prompts(page)}, console {log.errors}, "
        f"page errors {log.page_errors}, note {page.locator('.nbdist-note').all_inner_texts()}"
    )
    timings["first points"] = time.monotonic() - t0
    # The ranks now wait half-way: let them go on and watch the plot grow while the cell runs.
    first = _points(dashboard)
    (signals / "more").touch()
    log_cell_prompt = page.locator(".jp-NotebookPanel .jp-Cell .jp-InputPrompt").nth(3)
    grew = poll(lambda: _points(dashboard) > first, timeout=60, interval=0.1)
    second = _points(dashboard)
    running = log_cell_prompt.inner_text().strip()
    page.screenshot(path=str(artifacts_dir / "dashboard-live.png"))
    (signals / "done").touch()
    assert grew, f"data-points did not grow while the cell ran: {first} -> {second}"
    assert running == "[*]:", f"the logging cell was not running any more ({running!r})"

    # The end: the report cell prints what the kernel received.
    report = page.locator(".jp-OutputArea-output", has_text="LOGGED ").first
    report.wait_for(timeout=60_000)
    timings["run done"] = time.monotonic() - t0
    logged = json.loads(report.inner_text().split("LOGGED ", 1)[1].strip().splitlines()[0])
    assert logged["per_rank"] == {str(r): STEPS for r in range(RANKS)}, logged
    assert all(p.startswith("[") and p[1:-2].isdigit() for p in _prompts(page)), _prompts(page)

    # Every logged point reaches the plot (the last ones come with the end-of-cell flush).
    def settled():
        panels = _plot_state(dashboard)
        loss = next((p for p in panels if p["key"] == "loss"), None)
        if loss is None or len(loss["traces"]) != RANKS + 1:
            return None
        if any(len(t["x"]) < STEPS for t in loss["traces"]):
            return None
        return panels

    panels = poll(settled, timeout=15, interval=0.2)
    panels = panels or _plot_state(dashboard)
    summary = {p["key"]: [(t["name"], len(t["x"])) for t in p["traces"]] for p in panels}
    loss = next((p for p in panels if p["key"] == "loss"), None)
    assert loss is not None, f"no loss panel: {summary}"
    assert len(loss["traces"]) == RANKS + 1, f"want one trace per rank + mean: {summary}"
    *rank_traces, mean = loss["traces"]
    assert "mean" in mean["name"].lower(), summary
    for rank, trace in enumerate(rank_traces):
        assert str(rank) in trace["name"], summary
        assert trace["x"] == list(range(STEPS)), f"rank {rank} steps: {summary}"
        assert trace["y"] == pytest.approx([_loss(i, rank) for i in range(STEPS)]), rank
    assert sum(len(t["x"]) for t in rank_traces) == logged["total"]
    assert mean["x"] == list(range(STEPS)), summary
    want_mean = [sum(_loss(i, r) for r in range(RANKS)) / RANKS for i in range(STEPS)]
    assert mean["y"] == pytest.approx(want_mean)
    # data-points is what is plotted: every trace of every panel.
    total = sum(len(t["x"]) for p in panels for t in p["traces"])
    assert _points(dashboard) == total, (_points(dashboard), summary)
    assert total >= (RANKS + 1) * STEPS

    # plotly.js came from the server extension's route, not from the widget state.
    scripts = page.evaluate(
        "() => performance.getEntriesByType('resource').map(e => e.name)"
        ".filter(n => n.includes('plotly'))"
    )
    assert any("/nbdist/static/plotly.min.js" in s for s in scripts), scripts

    # The per-rank table: a row per rank, turning from "busy" to "idle" once the ranks are quiet.
    rows = dashboard.locator(".nbdist-table tbody tr")
    assert rows.count() == RANKS, rows.all_inner_texts()
    idle = poll(
        lambda: all(
            "idle" in (c or "") for c in rows.evaluate_all("rs => rs.map(r => r.className)")
        ),
        timeout=10,
        interval=0.2,
    )
    assert idle, f"table rows not idle after the run: {rows.all_inner_texts()}"
    timings["table idle"] = time.monotonic() - t0

    dashboard.scroll_into_view_if_needed()
    page.screenshot(path=str(artifacts_dir / "dashboard.png"))
    dashboard.screenshot(path=str(artifacts_dir / "dashboard-widget.png"))
    timings["checked"] = time.monotonic() - t0

    assert not log.page_errors, f"uncaught errors in the page: {log.page_errors}"
    assert not log.ours(), f"console errors from nbdist/plotly/widgets: {log.ours()}"
    print("timings (s from start): " + ", ".join(f"{k} {v:.1f}" for k, v in timings.items()))
    if log.errors:
        print("other console errors:", log.errors)
