"""Two dashboards of one run in a real browser: both stay live, both follow their width.

JupyterLab + headless Chromium + 2 CPU ranks. The notebook logs in one cell (its
dashboard appears under it), shows ``%dist_dashboard`` in the next, then logs many more
steps, then stops the ranks. A run has one dashboard widget however often it is shown, so
both views follow the run: scrolled into view after the last step, each plots every rank
up to the last step, and once the ranks stopped each says it is the run's final snapshot. Then the nbdist sidebar opens, the notebook gets narrower, and every plot of both
dashboards is redrawn at its card's new width (none keeps its old layout), also the one
that was off screen while the width changed.
"""

from __future__ import annotations

import pytest

from tests.ui.conftest import notebook_json, on_current_view, poll
from tests.ui.test_dashboard_browser import PageLog, _open_and_run_all, _plot_state

FIRST, LAST = 50, 400


def _cell(first: int, last: int) -> str:
    return f"""%%on_all_ranks
import time
for i in range({first}, {last}):
    nbdist.log(step=i, loss=1.0 / (1.0 + 0.02 * i) + 0.1 * rank, samples=64)
    time.sleep(0.01)
print('logged up to', i)"""


# Each plot's drawn width against its container's: a stale layout keeps its old width.
_WIDTHS = """root => Array.from(root.querySelectorAll('.nbdist-panel'))
    .filter(d => d._fullLayout)
    .map(d => [d.dataset.key, Math.round(d._fullLayout.width), d.clientWidth])"""


def _last_steps(dashboard) -> dict[str, list]:
    return {
        p["key"]: [t["x"][-1] if t["x"] else None for t in p["traces"]]
        for p in _plot_state(dashboard)
    }


@pytest.mark.timeout(300)
def test_two_dashboards_of_one_run_both_reach_the_last_step_and_follow_their_width(
    lab_factory, browser_page, artifacts_dir
):
    server = lab_factory(
        "twice.ipynb",
        notebook_json(
            [
                "%load_ext nbdist",
                "%dist_start 2 --cpu",
                _cell(0, FIRST),
                "%dist_dashboard",
                _cell(FIRST, LAST),
                "%dist_stop",
            ]
        ),
    )
    page = browser_page
    log = PageLog(page)
    _open_and_run_all(page, server, "twice.ipynb")
    done = page.locator(".jp-OutputArea-output", has_text=f"logged up to {LAST - 1}")
    assert poll(lambda: done.count() > 0, timeout=180), "the second logging cell did not end"
    dashboards = page.locator(".nbdist-dashboard")
    assert dashboards.count() == 2, dashboards.count()
    for which in (0, 1):
        dashboard = dashboards.nth(which)
        # The cell that logged has just ended: its update rebuilds the views (see live.py).
        on_current_view(dashboard.scroll_into_view_if_needed)

        def complete(dashboard=dashboard):
            loss = on_current_view(lambda: _last_steps(dashboard)).get("loss")
            return loss if loss and loss[:2] == [LAST - 1, LAST - 1] else None

        assert poll(complete, timeout=30, interval=0.5), (
            f"dashboard {which} did not reach step {LAST - 1}: {_last_steps(dashboard)}"
        )
    first = dashboards.nth(0)
    assert first.get_attribute("data-uid") == dashboards.nth(1).get_attribute("data-uid")
    # Stopped, the run's views say they are its final snapshot: none looks live.
    final = f"final snapshot at step {LAST - 1}: the run has finished; this view no longer updates"
    for which in (0, 1):
        line = dashboards.nth(which).locator(".nbdist-snapshot")
        shown = poll(lambda line=line: on_current_view(line.inner_text) == final, timeout=60)
        assert shown, on_current_view(line.inner_text)
    before = {w[0]: w[1] for w in on_current_view(lambda: first.evaluate(_WIDTHS))}

    # The sidebar opens while the first dashboard is scrolled away: the notebook narrows, and
    # every plot of both dashboards takes its card's new width once on screen.
    page.locator(".jp-SideBar .lm-TabBar-tab[data-id='nbdist-sidebar']").click()
    page.locator("#nbdist-sidebar").wait_for(state="visible")
    for which in (0, 1):
        dashboard = dashboards.nth(which)
        on_current_view(dashboard.scroll_into_view_if_needed)

        def follows(dashboard=dashboard):
            widths = on_current_view(lambda: dashboard.evaluate(_WIDTHS))
            return widths if widths and all(abs(w - c) <= 2 for _, w, c in widths) else None

        widths = poll(follows, timeout=15, interval=0.5)
        assert widths, f"dashboard {which}: plot width vs card {dashboard.evaluate(_WIDTHS)}"
        # The cards re-flow (three to a row can become two, each wider): the plots changed
        # width with them.
        after = {key: w for key, w, _ in widths}
        assert any(after[k] != before[k] for k in before if k in after), (before, after)
    on_current_view(first.scroll_into_view_if_needed)
    first.screenshot(path=str(artifacts_dir / "dashboard-first-of-two-with-sidebar.png"))
    assert not log.page_errors, log.page_errors
    assert not log.ours(), log.ours()
