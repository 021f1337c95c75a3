"""The live dashboard of 256 ranks in a real browser: readable, distinct, flat, and the page answers.

JupyterLab + headless Chromium. Rank 201 steps three times slower than the other 255,
every rank at a steady rate. Checked in the page while the ranks log and after:

- the legend has at most 12 entries; the ranks drawn on their own have distinct colours,
  and the straggler is among them;
- the rank x step heatmap of step time has a row per rank (256) and a readable number of
  step bins, and the straggler's row is the brightest;
- the total throughput is flat (every rank steady): no bin after the first two is below
  80 % or above 120 % of the median bin, the last ones included;
- the page keeps answering while 256 ranks log: a trivial ``evaluate`` is timed every
  quarter second; the test fails when the median answer takes 2 s or one takes 10 s (a
  freeze guard: 0.7-2.4 s was the slowest at load averages of 7-10 on 2 cores; the times are
  printed: median, 95th percentile, slowest, the longest main-thread stall, the longest
  update and heatmap draw, and the load average).

Two ways to get 256 ranks logging:

- **default suite**: one kernel feeds a generated history of 256 ranks into a run, as
  the collector would (each rank's points every half second, the ranks' own flush period),
  and the run's dashboard is shown as a logging cell shows it; this exercises the kernel's
  dashboard, the widget and the browser at 256 ranks, not the ranks' processes;
- **opt-in** (``NBDIST_TEST_256=1``, also marked slow): 256 real CPU ranks, about 7.4 GiB
  and 80 s to start on a 2-core machine.

Screenshots go to ``artifacts/ui/dashboard-256-ranks*.png``.
"""

from __future__ import annotations

import os
import statistics
import time

import pytest

from tests.ui.conftest import drawn, notebook_json, on_current_view, poll
from tests.ui.test_dashboard_browser import (
    STALL_MONITOR,
    PageLog,
    _open_and_run_all,
    _plot_state,
)

RANKS = 256
SLOW = 201
# The page answers: its median answer stays under ANSWER_MEDIAN_S, and no answer takes
# FREEZE_GUARD_S (a freeze). At load averages of 7-10 on 2 cores the slowest answer took
# 0.7-2.4 s; on 2 cores shared with much other work (load averages of 30-150) single answers
# took 4-21 s while the median stayed at 6-470 ms: the slowest answers follow the load.
ANSWER_MEDIAN_S = 2.0
FREEZE_GUARD_S = 10.0

# The collector's job, done by a thread: every rank's points each half second.
GENERATED_CELL = f"""import threading, time
import nbdist.dashboard
from nbdist.metrics.run import Run

RANKS, SLOW, SECONDS = {RANKS}, {SLOW}, 40
run = Run(0, world_size=RANKS, backend="gloo", label="generated: {RANKS} steady ranks")

def feed():
    began = time.time()
    step = [0] * RANKS
    when = [began] * RANKS
    while True:
        now = min(time.time(), began + SECONDS)
        for rank in range(RANKS):
            dt = 0.3 if rank == SLOW else 0.1
            points = []
            while when[rank] + dt <= now:
                when[rank] += dt
                loss = 2.0 / (1.0 + 0.05 * step[rank]) + 0.0005 * rank
                points.append((step[rank], when[rank], {{
                    "loss": loss, "samples": 32.0, "step_time": dt, "samples_per_s": 32.0 / dt}}))
                step[rank] += 1
            if points:
                run.add(rank, points)
        if now >= began + SECONDS:
            break
        time.sleep(0.5)
    print("fed", sum(step), "points")

feeder = threading.Thread(target=feed, daemon=True)
feeder.start()
dash = nbdist.dashboard.show_run(run, auto=True)"""

WAIT_CELL = """feeder.join()
print("generated run", "done")"""

REAL_CELL = f"""%%on_all_ranks
import time
import torch
import torch.distributed as dist
# One deadline for every rank (rank 0's clock): they all stop logging together, so the total
# throughput is steady to the end.
end = torch.tensor([time.time() + 40.0], dtype=torch.float64)
dist.broadcast(end, 0)
i = 0
while time.time() < end.item():
    nbdist.log(step=i, loss=2.0 / (1.0 + 0.05 * i) + 0.0005 * rank, samples=32)
    time.sleep(0.6 if rank == {SLOW} else 0.2)
    i += 1
print("trained")"""


class Answers:
    """How long the page takes to answer a trivial call, sampled while the ranks log."""

    def __init__(self, page):
        self.page = page
        self.times: list[float] = []

    def sample(self) -> None:
        began = time.monotonic()
        self.page.evaluate("() => 1")
        self.times.append(time.monotonic() - began)

    def until(self, done, timeout: float, what: str):
        deadline = time.monotonic() + timeout
        while True:
            self.sample()
            value = done()
            if value:
                return value
            assert time.monotonic() < deadline, what
            time.sleep(0.25)

    def check(self, line: str) -> None:
        assert statistics.median(self.times) < ANSWER_MEDIAN_S, line
        assert max(self.times) < FREEZE_GUARD_S, line

    def report(self, where: str) -> str:
        ordered = sorted(self.times)
        p95 = ordered[int(0.95 * (len(ordered) - 1))]
        stall = self.page.evaluate("() => window.__nbdistStall.max") / 1000
        stats = self.page.evaluate("() => nbdistDashboardStats")
        line = (
            f"{where}: {len(ordered)} page answers while {RANKS} ranks logged: median "
            f"{1000 * statistics.median(ordered):.0f} ms, p95 {1000 * p95:.0f} ms, slowest "
            f"{1000 * ordered[-1]:.0f} ms; longest main-thread stall {stall:.2f} s; longest "
            f"update {stats['longestUpdateMs']:.0f} ms, longest heatmap draw "
            f"{stats['longestHeatMs']:.0f} ms; load average {os.getloadavg()[0]:.1f}"
        )
        print("\n" + line)
        return line


def _check_dashboard(page, dashboard, artifacts_dir, name: str) -> None:
    """Legend, colours, heatmap and the flat total of a 256-rank dashboard, once drawn."""

    def settled():
        panels = {p["key"]: p for p in on_current_view(lambda: _plot_state(dashboard))}
        loss = panels.get("loss")
        names = [t["name"] for t in loss["traces"]] if loss else []
        return panels if f"rank {SLOW}" in names else None

    panels = poll(settled, timeout=60, interval=0.5)
    assert panels, {p["key"]: [t["name"] for t in p["traces"]] for p in _plot_state(dashboard)}
    legend = dashboard.locator(".nbdist-legend .nbdist-legend-item").all_inner_texts()
    assert len(legend) <= 12, legend
    colours = drawn(
        dashboard.locator(".nbdist-panel[data-key='loss']"),
        "d => d._fullData.filter(t => /^rank /.test(t.name)).map(t => t.line.color)",
    )
    assert colours and len(set(colours)) == len(colours), colours

    # One read of the attribute and the data: the view is rebuilt at the cell's end, and a
    # new view's heatmap has neither until its first draw (CI, 2026-12-02: the attribute
    # read on the old view, the data on the new, "d.data is undefined").
    heat = dashboard.locator(".nbdist-heatmap")
    z = drawn(heat, f"d => d.dataset.ranks === '{RANKS}' ? d.data[0].z : null")
    assert z, heat.get_attribute("data-ranks")
    columns = len(z[0])
    assert 2 <= columns <= 120, columns
    means = [statistics.fmean(v for v in row if v is not None) for row in z]
    assert max(range(RANKS), key=means.__getitem__) == SLOW, means[SLOW]

    def total_and_off():
        # A view rebuilt a moment ago has no traces until its first draw: read it again.
        traces = [
            t
            for p in on_current_view(lambda: _plot_state(dashboard))
            if p["key"] in ("samples_per_s", "tokens_per_s")
            for t in p["traces"]
        ]
        total = next((t["y"] for t in traces if t["name"] == "total"), [])
        if not total:
            return total, 0.0, ["no total trace drawn yet"]
        middle = statistics.median(total)
        off = [
            (i, round(v))
            for i, v in enumerate(total[2:], 2)
            if not 0.8 * middle <= v <= 1.2 * middle
        ]
        return total, middle, off

    # A bin is final once every rank's points are in: ranks the feed (or a loaded machine)
    # held back past the others are added, and the trace sent again, at the next refresh,
    # seconds later at load averages over 30. The page was read once, and CI (2026-12-02,
    # load average 36) found bin 38 of 39 at the rates of 91 of 256 ranks; a model of the
    # feed with stalls did not reproduce it. Read until flat: a bin that stays off fails.
    poll(lambda: not total_and_off()[2], timeout=30, interval=1.0)
    total, middle, off = total_and_off()
    print(f"{name}: total throughput, {len(total)} bins, median {middle:.0f}/s, off: {off}")
    assert len(total) >= 5 and not off, (middle, total)
    on_current_view(dashboard.scroll_into_view_if_needed)
    dashboard.screenshot(path=str(artifacts_dir / f"{name}.png"))


@pytest.mark.timeout(300)
def test_256_generated_ranks_keep_the_dashboard_readable_and_the_page_answering(
    lab_factory, browser_page, artifacts_dir
):
    server = lab_factory("generated256.ipynb", notebook_json([GENERATED_CELL, WAIT_CELL]))
    page = browser_page
    log = PageLog(page)
    _open_and_run_all(page, server, "generated256.ipynb")
    page.evaluate(STALL_MONITOR)
    answers = Answers(page)
    dashboard = page.locator(".nbdist-dashboard").first
    done = page.locator(".jp-OutputArea-output", has_text="generated run done")
    answers.until(lambda: done.count() > 0, 180, "the generated run did not end")
    line = answers.report("generated history")
    _check_dashboard(page, dashboard, artifacts_dir, "dashboard-256-ranks")
    answers.check(line)
    assert not log.page_errors, log.page_errors
    assert not log.ours(), log.ours()


@pytest.mark.slow
@pytest.mark.skipif(
    os.environ.get("NBDIST_TEST_256") != "1",
    reason="256 real ranks (~7.4 GiB, ~80 s to start) are opt-in: NBDIST_TEST_256=1",
)
@pytest.mark.timeout(900)
def test_256_real_ranks_keep_the_dashboard_readable_and_the_page_answering(
    lab_factory, browser_page, artifacts_dir
):
    server = lab_factory(
        "real256.ipynb",
        notebook_json(
            [
                "%load_ext nbdist",
                f"%dist_start {RANKS} --cpu --threads 1",
                "%dist_dashboard",
                REAL_CELL,
            ]
        ),
    )
    page = browser_page
    log = PageLog(page)
    _open_and_run_all(page, server, "real256.ipynb")
    page.evaluate(STALL_MONITOR)
    answers = Answers(page)
    dashboard = page.locator(".nbdist-dashboard").first
    answers.until(lambda: dashboard.count() > 0, 400, "no dashboard after %dist_start 256")
    done = page.locator(".jp-OutputArea-output", has_text="trained")
    answers.until(lambda: done.count() > 0, 400, "the logging cell did not end")
    line = answers.report("real ranks")
    _check_dashboard(page, dashboard, artifacts_dir, "dashboard-256-real-ranks")
    answers.check(line)
    assert not log.page_errors, log.page_errors
    assert not log.ours(), log.ours()
