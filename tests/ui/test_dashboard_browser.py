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

Two more tests:

- a long walk-through (a logging cell, then cells that raise on one rank, time
  out, hang and are interrupted, run with ``--noblock``, ``%dist_where``,
  ``to_pandas()`` and quick cells, then a second logging cell): each dashboard
  is drawn at most twice however many cells follow, no view is left drawing
  off the page, an update redraws only what is on it, the page answers within
  2 s throughout, and the second cell's points appear while it runs;
- the layout at 1600, 1000 (also with the sidebar open) and 700 px, in the
  light and the dark theme: no plot, tick label, legend or title over another,
  plots as wide as their cards, no empty slot, axis titles, the loss on a log
  scale (a toggle), the constant learning rate shown as a value, one rank
  palette in legend, plots and table, the theme followed live and every text
  at 4.5:1 contrast or more. Screenshots in light and dark at 1600 and 700 px go
  to ``$NBDIST_UI_SCREENSHOTS`` (default: the test's tmp_path).
"""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path

import pytest

from tests.ui.conftest import attached, drawn, notebook_json, on_current_view, poll

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
nbdist.log(step={STEPS}, phase="done")  # no number: left out, and said so under the table
wait_for("done")
print("logging done on rank", rank)"""


REPORT_CELL = """import json
import nbdist
_run = nbdist.current_session().metrics
print("LOGGED " + json.dumps({"total": _run.count(), "per_rank": {str(r): _run.count(r) for r in _run.ranks}}))"""


def _dashboard_cell() -> str:
    """``%dist_dashboard`` where nbdist has it, else the API it stands for."""
    from nbdist.magics.inspect import InspectMagics

    if hasattr(InspectMagics, "dist_dashboard"):
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


def _open_and_run_all(page, server, name: str) -> None:
    page.goto(f"{server.url}lab/tree/{name}?token={server.token}")
    page.wait_for_selector(".jp-NotebookPanel .jp-Cell", timeout=60_000)
    # The page shows "idle" before its kernel exists, and a Run All clicked before the
    # kernel is connected is dropped: wait until the server sees the page connected.
    assert poll(server.kernel_connected, timeout=60, interval=0.2), server.kernels()
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
    # Case-sensitive (a plain has_text is not): the dashboard's note says "rank 0 logged".
    report = page.locator(".jp-OutputArea-output", has_text=re.compile(r"LOGGED \{")).first
    report.wait_for(timeout=60_000)
    timings["run done"] = time.monotonic() - t0
    logged = json.loads(report.inner_text().split("LOGGED ", 1)[1].strip().splitlines()[0])
    # STEPS points with a loss, and the last one whose only value was left out
    assert logged["per_rank"] == {str(r): STEPS + 1 for r in range(RANKS)}, logged
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
    assert sum(len(t["x"]) for t in rank_traces) == logged["total"] - RANKS  # "phase" points
    assert mean["x"] == list(range(STEPS)), summary
    want_mean = [sum(_loss(i, r) for r in range(RANKS)) / RANKS for i in range(STEPS)]
    assert mean["y"] == pytest.approx(want_mean)
    # data-points is what the view holds: every trace of every plot, and the points behind
    # the series shown as a single value (constant so far).
    total = sum(len(t["x"]) for p in panels for t in p["traces"])
    tiles = dashboard.evaluate(
        "root => Array.from(root.querySelectorAll('.nbdist-tile'))"
        ".reduce((n, t) => n + Number(t.dataset.points || 0), 0)"
    )
    assert _points(dashboard) == total + tiles, (_points(dashboard), tiles, summary)
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

    # The value that was no number: its key, what it was and the fix, under the table.
    note = dashboard.locator(".nbdist-dropped")
    said = poll(lambda: "'phase' left out" in note.inner_text(), timeout=10, interval=0.2)
    assert said, note.inner_text()
    assert re.fullmatch(
        r"'phase' left out of the charts: rank [01] logged 'done' \(a str\); "
        r"log a Python number or a one-element tensor",
        note.inner_text().strip(),
    ), note.inner_text()

    on_current_view(dashboard.scroll_into_view_if_needed)
    page.screenshot(path=str(artifacts_dir / "dashboard.png"))
    dashboard.screenshot(path=str(artifacts_dir / "dashboard-widget.png"))
    timings["checked"] = time.monotonic() - t0

    assert not log.page_errors, f"uncaught errors in the page: {log.page_errors}"
    assert not log.ours(), f"console errors from nbdist/plotly/widgets: {log.ours()}"
    print("timings (s from start): " + ", ".join(f"{k} {v:.1f}" for k, v in timings.items()))
    if log.errors:
        print("other console errors:", log.errors)


# -- a long walk-through: the page stays responsive, views do not pile up -------------------------

# In the page: the longest the main thread went without running a 50 ms timer (a page that is
# busy redrawing hidden plots answers nothing: clicks, keys and this timer all wait). Printed
# beside the page answers the test asserts on: it counts JupyterLab's own work too.
STALL_MONITOR = """() => {
    if (window.__nbdistStall) return;
    const s = window.__nbdistStall = {max: 0, last: performance.now()};
    setInterval(() => {
        const now = performance.now();
        s.max = Math.max(s.max, now - s.last - 50);
        s.last = now;
    }, 50);
}"""
FILLERS = 8  # quick cells between the two logging cells; each used to add a view of the dashboard


def _steps_cell(first: int, n: int, signals: str | None = None) -> str:
    """Log steps first..first+n-1; with ``signals``, wait for ``more`` half-way and ``done`` after."""
    wait = ""
    if signals is not None:
        wait = f"""
def wait_for(name):
    path = os.path.join({signals!r}, name)
    deadline = time.monotonic() + {WAIT_S}
    while not os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.05)
"""
    half = f"    if i == {first + n // 2}:\n        wait_for('more')\n" if signals else ""
    end = "wait_for('done')\n" if signals else ""
    return (
        f"%%on_all_ranks\nimport os, time\nimport nbdist\n{wait}"
        f"for i in range({first}, {first + n}):\n{half}"
        f"    nbdist.log(step=i, loss=1.0 / (1.0 + 0.02 * i) + {OFFSET} * rank, samples=64)\n"
        f"    time.sleep({SLEEP_S})\n{end}print('last step', i)"
    )


def _walkthrough_notebook(signals: str) -> dict:
    """What a user does between two training cells: errors, a hang, --noblock, where, pandas."""
    cells = [
        ("%load_ext nbdist", False),
        (f"%dist_start {RANKS} --cpu", False),
        (_steps_cell(0, 100), False),
        ("%%on_all_ranks\nif rank == 1:\n    raise ValueError('boom on rank 1')", True),
        ("%%on_all_ranks --timeout 2\nimport time\ntime.sleep(60)", True),
        ("%%on_all_ranks\nimport time\nprint('hanging', flush=True)\ntime.sleep(60)", True),
        ("%%on_all_ranks --noblock\nimport time\ntime.sleep(0.5)\nz = rank", False),
        ("%dist_where", False),
        ("import nbdist\ndf = nbdist.current_session().metrics.to_pandas()\nlen(df)", False),
        *[(f"%%on_all_ranks\ny{i} = rank + {i}", False) for i in range(FILLERS)],
        (_steps_cell(100, 200, signals), False),
        (REPORT_CELL, False),
    ]
    nb = notebook_json([source for source, _ in cells])
    for cell, (_, raises) in zip(nb["cells"], cells):
        if raises:  # JupyterLab's Run All goes on past a cell tagged so (stop_on_error off)
            cell["metadata"]["tags"] = ["raises-exception"]
    return nb


def _page_answers(page) -> float:
    """Seconds a trivial evaluate takes: how long the page makes a caller wait right now."""
    began = time.monotonic()
    page.evaluate("() => 1")
    return time.monotonic() - began


@pytest.mark.timeout(300)
def test_a_long_walkthrough_keeps_the_page_responsive(lab_factory, browser_page, tmp_path):
    signals = tmp_path / "signals"
    signals.mkdir()
    server = lab_factory("walkthrough.ipynb", _walkthrough_notebook(str(signals)))
    page = browser_page
    log = PageLog(page)
    _open_and_run_all(page, server, "walkthrough.ipynb")
    page.evaluate(STALL_MONITOR)
    answers: list[float] = []

    def watch(until, timeout: float, what: str):
        """Poll ``until`` while timing the page's answers; fail with ``what`` on timeout."""
        deadline = time.monotonic() + timeout
        while True:
            answers.append(_page_answers(page))
            value = until()
            if value:
                return value
            assert time.monotonic() < deadline, f"{what}: prompts {_prompts(page)}"
            time.sleep(0.2)

    # The hung cell: interrupt it the way the toolbar's stop button does.
    hanging = page.locator(".jp-OutputArea-output", has_text="hanging")
    watch(lambda: hanging.count() > 0, 120, "the hanging cell did not start")
    [kernel] = server.kernels()
    server.api("POST", f"api/kernels/{kernel['id']}/interrupt")

    # The second logging cell: its dashboard grows while the cell runs.
    dashboards = page.locator(".nbdist-dashboard")
    watch(lambda: dashboards.count() >= 2, 120, "no dashboard for the second logging cell")
    second = dashboards.nth(dashboards.count() - 1)
    watch(lambda: _points(second) > 0, 60, "the second dashboard shows no point")
    page.evaluate("() => { nbdistDashboardStats.maxDrawn = 0; }")
    first = _points(second)
    (signals / "more").touch()
    watch(lambda: _points(second) > first, 60, "no new point while the cell ran")
    (signals / "done").touch()
    report = page.locator(".jp-OutputArea-output", has_text="LOGGED ")
    watch(lambda: report.count() > 0, 120, "the walk-through did not finish")
    logged = json.loads(report.first.inner_text().split("LOGGED ", 1)[1].strip().splitlines()[0])
    assert logged["per_rank"] == {str(r): 300 for r in range(RANKS)}, logged

    # Every point of the second cell reached its plot.
    def complete():
        loss = next((p for p in _plot_state(second) if p["key"] == "loss"), None)
        return loss if loss and all(t["x"][-1:] == [299] for t in loss["traces"]) else None

    loss = watch(complete, 20, "the second dashboard's loss did not reach step 299")
    for rank, trace in enumerate(loss["traces"][:RANKS]):
        assert trace["x"] == list(range(300)), rank

    stats = page.evaluate("() => nbdistDashboardStats")
    shown = page.evaluate(
        "() => Array.from(document.querySelectorAll('.nbdist-dashboard')).map(d => d.dataset.uid)"
    )
    stall = page.evaluate("() => window.__nbdistStall.max") / 1000
    print(
        f"walk-through: {len(answers)} page answers, slowest {max(answers):.2f} s; longest "
        f"main-thread stall {stall:.2f} s; views made per dashboard {stats['renders']}; "
        f"views drawing {stats['views']}; most views drawing one update {stats['maxDrawn']}; "
        f"longest update {stats['longestUpdateMs']:.0f} ms"
    )
    # Views do not pile up: each display of the run's dashboard (both show its one widget,
    # both live) was drawn at most three times (shown, re-shown once with the cell's final
    # summary, and the first once more as it became a snapshot in the saved text), however many
    # cells ran after it; none is left drawing off the page; and an update redraws at most the
    # two dashboards on the page.
    assert len(shown) == 2, shown
    assert all(stats["renders"].get(uid, 0) <= 3 * shown.count(uid) for uid in shown), stats[
        "renders"
    ]
    assert stats["views"] <= len(shown), stats
    assert 1 <= stats["maxDrawn"] <= 2, stats
    # And the page answered throughout (the stall and the longest update are printed to show
    # where time went; a shared machine's load stretches both).
    assert max(answers) < 2.0, f"the page took {max(answers):.2f} s to answer"
    assert not log.page_errors, f"uncaught errors in the page: {log.page_errors}"
    assert not log.ours(), f"console errors from nbdist/plotly/widgets: {log.ours()}"


# -- layout at several widths, light and dark theme, screenshots -----------------------------------

LAYOUT_STEPS = 120
LAYOUT_CELL = f"""%%on_all_ranks
import time
import nbdist
for i in range({LAYOUT_STEPS}):
    nbdist.log(step=i, loss=2.0 / (1.0 + 0.2 * i) + 0.005 * rank, lr=0.001,
               grad_norm=1.0 + 0.3 * ((i * (rank + 3)) % 7), samples=64, total_steps={LAYOUT_STEPS})
    time.sleep({SLEEP_S})
print("trained")"""

# Boxes of everything drawn in one dashboard (page pixels), for the overlap checks.
_BOXES = """root => {
    const box = e => { const r = e.getBoundingClientRect();
        return {x: r.left, y: r.top, r: r.right, b: r.bottom, w: r.width, h: r.height}; };
    const shown = e => e.getClientRects().length > 0 && e.getBoundingClientRect().width > 0;
    const texts = (card, sel) => Array.from(card.querySelectorAll(sel))
        .filter(t => shown(t) && t.textContent.trim()).map(t => ({...box(t), text: t.textContent}));
    const grid = root.querySelector('.nbdist-plots');
    return {
        root: box(root), grid: box(grid), legend: box(root.querySelector('.nbdist-legend')),
        header: box(root.querySelector('.nbdist-header')),
        tiles: Array.from(root.querySelectorAll('.nbdist-tile')).map(t => ({...box(t), key: t.dataset.key})),
        cards: Array.from(grid.querySelectorAll('.nbdist-card')).filter(shown).map(card => {
            const svg = card.querySelector('.main-svg');
            const area = card.querySelector('.nsewdrag');
            const legend = card.querySelector('g.legend');
            return {
                key: card.dataset.key || 'breakdown', ...box(card),
                head: box(card.querySelector('.nbdist-card-head')),
                svg: svg && box(svg), area: area && box(area), legend: legend && box(legend),
                xticks: texts(card, '.xtick text'), yticks: texts(card, '.ytick text'),
                titles: texts(card, '.g-xtitle text, .g-ytitle text'),
            };
        }),
    };
}"""

# Every piece of text in the dashboard: its colour against what is behind it (WCAG ratio).
_CONTRAST = """root => {
    const parse = c => { const m = c.match(/rgba?\\(([^)]+)\\)/); if (!m) return null;
        const p = m[1].split(/[ ,\\/]+/).filter(Boolean).map(Number);
        return [p[0], p[1], p[2], p.length > 3 ? p[3] : 1]; };
    const over = (top, bottom) => top.map((v, i) => i < 3 ? v * top[3] + bottom[i] * (1 - top[3]) : 1);
    const lum = c => { const l = c.slice(0, 3).map(v => { v /= 255;
        return v <= 0.04045 ? v / 12.92 : Math.pow((v + 0.055) / 1.055, 2.4); });
        return 0.2126 * l[0] + 0.7152 * l[1] + 0.0722 * l[2]; };
    const behind = el => {  // blend the backgrounds from the page down to this element
        const chain = [];
        for (let e = el; e && e.nodeType === 1; e = e.parentElement) chain.push(e);
        let bg = [255, 255, 255, 1];
        for (const e of chain.reverse()) {
            const c = parse(getComputedStyle(e).backgroundColor);
            if (c && c[3] > 0) bg = over(c, bg);
        }
        return bg;
    };
    const out = [];
    const visible = e => e.getClientRects().length > 0 && e.getBoundingClientRect().width > 0;
    for (const t of root.querySelectorAll('text')) {
        if (!visible(t) || !t.textContent.trim()) continue;
        const s = getComputedStyle(t);
        const fill = parse(s.fill);
        if (!fill) continue;
        fill[3] *= Number(s.fillOpacity || 1) * Number(s.opacity || 1);
        const bg = behind(t);
        const fg = over(fill, bg);
        const [a, b] = [lum(fg), lum(bg)].sort((x, y) => y - x);
        out.push({text: t.textContent.slice(0, 40), ratio: (a + 0.05) / (b + 0.05), colour: s.fill});
    }
    const walker = document.createTreeWalker(root, NodeFilter.SHOW_TEXT);
    for (let n = walker.nextNode(); n; n = walker.nextNode()) {
        const el = n.parentElement;
        if (!n.textContent.trim() || el.closest('svg') || !visible(el)) continue;
        const colour = parse(getComputedStyle(el).color);
        const bg = behind(el);
        const fg = over(colour, bg);
        const [a, b] = [lum(fg), lum(bg)].sort((x, y) => y - x);
        out.push({text: n.textContent.slice(0, 40), ratio: (a + 0.05) / (b + 0.05),
                  colour: getComputedStyle(el).color});
    }
    return out;
}"""


def _overlap(a: dict, b: dict, slack: float = 0.5) -> bool:
    return (
        a["x"] + slack < b["r"]
        and b["x"] + slack < a["r"]
        and a["y"] + slack < b["b"]
        and b["y"] + slack < a["b"]
    )


def _settled(dashboard) -> dict | None:
    """The boxes once every plot has the width of its card (plots resize a frame later)."""
    boxes = dashboard.evaluate(_BOXES)
    for card in boxes["cards"]:
        if card["svg"] is None or abs(card["svg"]["w"] - (card["w"] - 10)) > 3:
            return None  # card: 4 px padding and 1 px border on each side
    return boxes


def _check_layout(boxes: dict, where: str) -> None:
    cards = boxes["cards"]
    assert cards, f"{where}: no plot"
    for i, a in enumerate(cards):
        # Inside the dashboard, and no card over another.
        assert a["x"] >= boxes["grid"]["x"] - 1 and a["r"] <= boxes["grid"]["r"] + 1, (where, a)
        for b in cards[i + 1 :]:
            assert not _overlap(a, b), f"{where}: {a['key']} and {b['key']} overlap"
        assert not _overlap(a, boxes["legend"]), f"{where}: the legend covers {a['key']}"
        assert not _overlap(a["head"], a["svg"]), f"{where}: {a['key']}'s title is on its plot"
        assert a["svg"]["r"] <= a["r"] + 1, f"{where}: {a['key']}'s plot is wider than its card"
        for axis in ("xticks", "yticks"):
            ticks = a[axis]
            assert ticks, f"{where}: {a['key']} has no {axis}"
            for j, t in enumerate(ticks):
                assert t["x"] >= a["svg"]["x"] - 1 and t["r"] <= a["svg"]["r"] + 1, (where, t)
                for u in ticks[j + 1 :]:
                    assert not _overlap(t, u), (
                        f"{where}: {a['key']} ticks {t['text']!r}, {u['text']!r}"
                    )
        assert len(a["titles"]) == 2, f"{where}: {a['key']} axis titles {a['titles']}"
        if a["legend"] is not None:  # the breakdown's parts
            assert not _overlap(a["legend"], a["area"]), f"{where}: {a['key']}'s legend on its plot"
    # No empty slot: in every row of cards, the last one reaches the right edge.
    rows: dict[int, list[dict]] = {}
    for card in cards:
        rows.setdefault(round(card["y"]), []).append(card)
    for row in rows.values():
        right = max(c["r"] for c in row)
        assert abs(right - boxes["grid"]["r"]) <= 2, f"{where}: a row ends short: {row}"


def _screenshot_dir(tmp_path) -> Path:
    folder = Path(os.environ.get("NBDIST_UI_SCREENSHOTS") or tmp_path / "screenshots")
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def _switch_theme(page, name: str) -> None:
    page.locator("li.lm-MenuBar-item", has_text="Settings").click()
    page.locator("li.lm-Menu-item", has_text="Theme").first.hover()
    page.get_by_role("menuitem", name=name, exact=True).click()


@pytest.mark.timeout(300)
def test_layout_theme_and_colours_at_every_width(lab_factory, browser_page, tmp_path):
    from nbdist.dashboard.palette import rank_colours

    server = lab_factory(
        "layout.ipynb",
        notebook_json(
            ["%load_ext nbdist", f"%dist_start {RANKS} --cpu", LAYOUT_CELL, "%dist_stop"]
        ),
    )
    page = browser_page
    log = PageLog(page)
    shots = _screenshot_dir(tmp_path)
    _open_and_run_all(page, server, "layout.ipynb")
    dashboard = page.locator(".nbdist-dashboard").first
    dashboard.wait_for(state="visible", timeout=120_000)
    done = page.locator(".jp-OutputArea-output", has_text="stopped")
    assert poll(lambda: page.locator(".jp-OutputArea-output", has_text="trained").count(), 120)
    assert poll(lambda: "step 119 of 120" in dashboard.inner_text(), 30), dashboard.inner_text()
    poll(lambda: done.count(), 60)

    # Charts: titles in words, axis titles with units, the loss on a log scale (a toggle turns
    # it linear), the constant learning rate a value, not a line; the progress of total_steps.
    head = dashboard.locator(".nbdist-header").inner_text()
    assert "run " in head and "2 ranks" in head and "elapsed" in head, head
    assert dashboard.locator(".nbdist-progress-bar").evaluate("e => e.style.width") == "100%"
    keys = dashboard.evaluate(
        "r => Array.from(r.querySelectorAll('.nbdist-panel')).filter(p => p.isConnected)"
        ".map(p => p.dataset.key)"
    )
    assert {"loss", "grad_norm", "samples_per_s"} <= set(keys) and "lr" not in keys, keys
    tile = dashboard.locator(".nbdist-tile[data-key='lr']")
    assert "learning rate" in tile.inner_text() and "0.001" in tile.inner_text()
    titles = dashboard.locator(".nbdist-card-title").all_inner_texts()
    assert "gradient norm" in titles and "grad_norm" not in titles, titles
    loss = dashboard.locator(".nbdist-panel[data-key='loss']")
    assert drawn(loss, "d => d._fullLayout.yaxis.type") == "log"
    # Its ticks read as values in order (0.1, 0.2, 0.5, 1, 2), not plotly's bare digits (5, 2, 0.1).
    ticks = loss.evaluate(
        "d => Array.from(d.querySelectorAll('.ytick text')).map(t => t.textContent)"
    )
    values = [float(t.replace("\u2212", "-")) for t in ticks]
    assert len(values) >= 3 and values == sorted(set(values)), ticks
    # One palette: the legend, the plots and the table draw rank r in rank_colours()[r].
    want = [_rgb(c) for c in rank_colours()[:RANKS]]
    swatches = attached(
        dashboard,
        "r => Array.from(r.querySelectorAll('.nbdist-legend .nbdist-swatch'))"
        ".slice(0, 2).map(s => getComputedStyle(s).backgroundColor)",
    )
    lines = drawn(loss, "d => d._fullData.slice(0, 2).map(t => t.line.color)")
    table = attached(
        dashboard,
        "r => Array.from(r.querySelectorAll('.nbdist-table td .nbdist-swatch'))"
        ".map(s => getComputedStyle(s).backgroundColor)",
    )
    assert swatches == table == want and [_rgb(c) for c in lines] == want, (swatches, lines, table)

    for theme in ("light", "dark"):
        if theme == "dark":
            before = _tick_fill(dashboard)
            _switch_theme(page, "JupyterLab Dark")
            assert poll(
                lambda: page.evaluate("() => document.body.dataset.jpThemeLight") == "false", 30
            )
            # The plots follow the theme without a re-run.
            changed = poll(lambda b=before: _tick_fill(dashboard) != b, 10)
            assert changed, "the plots kept their light-theme colours"
        for width, sidebar in ((1600, False), (1000, False), (1000, True), (700, False)):
            page.set_viewport_size({"width": width, "height": 1000})
            _sidebar(page, sidebar)
            where = f"{theme}, {width} px{' with the sidebar open' if sidebar else ''}"
            on_current_view(dashboard.scroll_into_view_if_needed)
            boxes = poll(lambda: _settled(dashboard), 15)
            assert boxes, (
                f"{where}: plots did not take their cards' width: {dashboard.evaluate(_BOXES)}"
            )
            _check_layout(boxes, where)
            if not sidebar and width in (1600, 700):
                # Tall enough for the whole dashboard: an element's screenshot shows only what
                # its scrolling notebook has on screen.
                page.set_viewport_size({"width": width, "height": 2400})
                on_current_view(dashboard.scroll_into_view_if_needed)
                poll(lambda: _settled(dashboard), 15)
                dashboard.screenshot(path=str(shots / f"dashboard-{theme}-{width}.png"))
        texts = attached(dashboard, _CONTRAST)
        worst = min(texts, key=lambda t: t["ratio"])
        assert len(texts) > 30 and worst["ratio"] >= 4.5, f"{theme}: {worst}"
        print(
            f"{theme}: {len(texts)} texts, lowest contrast {worst['ratio']:.2f} ({worst['text']!r})"
        )
    # The loss's scale is a toggle.
    dashboard.locator(".nbdist-card[data-key='loss'] .nbdist-log").click()
    assert poll(lambda: loss.evaluate("d => d._fullLayout.yaxis.type") == "linear", 5)
    print(f"screenshots in {shots}: {sorted(p.name for p in shots.iterdir())}")
    assert len(list(shots.glob("dashboard-*.png"))) == 4
    assert not log.page_errors, f"uncaught errors in the page: {log.page_errors}"
    assert not log.ours(), f"console errors from nbdist/plotly/widgets: {log.ours()}"


def _tick_fill(dashboard) -> str:
    return attached(
        dashboard.locator(".nbdist-panel .xtick text").first, "t => getComputedStyle(t).fill"
    )


def _rgb(hex_colour: str) -> str:
    r, g, b = (int(hex_colour[i : i + 2], 16) for i in (1, 3, 5))
    return f"rgb({r}, {g}, {b})"


def _sidebar(page, open_: bool) -> None:
    """Open or close JupyterLab's left sidebar (the file browser)."""
    tab = page.locator(".jp-SideBar.jp-mod-left .lm-TabBar-tab").first
    is_open = "lm-mod-current" in (tab.get_attribute("class") or "")
    if is_open != open_:
        tab.click()
