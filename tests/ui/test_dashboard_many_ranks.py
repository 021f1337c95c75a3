"""The live dashboard of 64 ranks in a real browser: a readable legend, distinct colours.

JupyterLab + headless Chromium + 64 CPU ranks; one rank steps slower than the
others and one logs a loss far from theirs. Above 8 ranks each chart draws the
median with a min-max band and only the ranks that deviate, so the legend stays
short (at most 12 entries), the ranks drawn on their own have distinct colours,
and the straggler and the outlier are among them; the table lists those ranks and a row
for the host instead of a row per rank. A screenshot goes to
``artifacts/ui/dashboard-64-ranks.png``.
"""

from __future__ import annotations

import pytest

from tests.ui.conftest import attached, drawn, notebook_json, on_current_view, poll
from tests.ui.test_dashboard_browser import PageLog, _open_and_run_all, _plot_state

RANKS = 64
STEPS = 60

LOG_CELL = f"""%%on_all_ranks
import time
for i in range({STEPS}):
    nbdist.log(step=i, loss=1.0 / (1.0 + 0.05 * i) + 0.001 * rank + (3.0 if rank == 40 else 0.0),
               samples=64)
    time.sleep(0.06 if rank == 17 else 0.02)
print("trained")"""


@pytest.mark.timeout(300)
def test_64_ranks_draw_a_band_and_only_the_deviating_ranks(
    lab_factory, browser_page, artifacts_dir
):
    server = lab_factory(
        "many.ipynb",
        notebook_json(
            [
                "%load_ext nbdist",
                f"%dist_start {RANKS} --cpu --threads 1",
                "%dist_dashboard",
                LOG_CELL,
            ]
        ),
    )
    page = browser_page
    log = PageLog(page)
    _open_and_run_all(page, server, "many.ipynb")
    assert poll(lambda: page.locator(".jp-OutputArea-output", has_text="trained").count(), 180), (
        "the logging cell did not end"
    )
    dashboard = page.locator(".nbdist-dashboard").first

    def settled():
        panels = {p["key"]: p for p in _plot_state(dashboard)}
        loss = panels.get("loss")
        if not loss or not loss["traces"] or len(loss["traces"][0]["x"]) < STEPS:
            return None
        names = [t["name"] for t in loss["traces"]]
        return panels if "rank 17" in names and "rank 40" in names else None

    panels = poll(settled, timeout=30, interval=0.5)
    assert panels, {p["key"]: [t["name"] for t in p["traces"]] for p in _plot_state(dashboard)}
    names = [t["name"] for t in panels["loss"]["traces"]]
    assert names[:3] == ["median", "min", "max"], names
    legend = dashboard.locator(".nbdist-legend .nbdist-legend-item").all_inner_texts()
    assert len(legend) <= 12, legend
    # Each legend swatch looks like what is drawn: the median a solid line in the text's
    # colour, min and max the grey band, the total (a dotted line) dotted.
    swatches = attached(
        dashboard,
        "r => Object.fromEntries(Array.from(r.querySelectorAll('.nbdist-legend-item')).map(i => {"
        " const s = getComputedStyle(i.querySelector('.nbdist-swatch'));"
        " return [i.innerText.trim(), [s.borderTopStyle, s.backgroundColor, getComputedStyle(i).color]];"
        " }))",
    )
    style, fill, text = swatches["median"]
    assert style == "none" and fill == text, swatches
    for edge in ("min", "max"):
        assert swatches[edge][:2] == ["solid", "rgba(128, 128, 128, 0.22)"], swatches
    if "total" in swatches:
        assert swatches["total"][0] == "dotted", swatches
    colours = drawn(
        dashboard.locator(".nbdist-panel[data-key='loss']"),
        "d => d._fullData.filter(t => /^rank /.test(t.name)).map(t => t.line.color)",
    )
    assert len(colours) >= 2 and len(set(colours)) == len(colours), colours
    # The table: the deviating ranks, then the host's row with its ranks counted by state.
    rows = dashboard.locator(".nbdist-table tbody tr").all_inner_texts()
    assert len(rows) <= 6 and any(f"{RANKS} ranks" in r for r in rows), rows

    def capture():
        dashboard.scroll_into_view_if_needed()
        dashboard.screenshot(path=str(artifacts_dir / "dashboard-64-ranks.png"))

    on_current_view(capture)
    assert not log.page_errors, log.page_errors
    assert not log.ours(), log.ours()
