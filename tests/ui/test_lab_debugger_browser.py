"""JupyterLab's own debugger on 2 CPU ranks, in headless Chromium.

Switch the debugger on, click a line number in a ``%%on_all_ranks`` cell's
gutter, Run All: the Callstack panel lists both ranks stopped at that line, a
rank's frame shows its variable's value; Continue with that frame selected
finishes that rank while the other stays paused, Continue again finishes the
cell. The screenshot of the stopped ranks is ``artifacts/ui/lab-debugger.png``
(docs/debugging.md shows it).
"""

from __future__ import annotations

import pytest

from tests.ui.conftest import notebook_json, poll

pytestmark = pytest.mark.slow

CELLS = [
    "%load_ext nbdist",
    "%dist_start 2 --cpu",
    "%%on_all_ranks\nx = rank * 10\ny = x + 1\nprint('done', rank, y)",
]


def test_gutter_breakpoint_stops_both_ranks_in_the_callstack(
    lab_factory, browser_page, artifacts_dir
):
    server = lab_factory("debug.ipynb", notebook_json(CELLS))
    page = browser_page
    page.goto(f"{server.url}lab/tree/debug.ipynb?token={server.token}")
    page.wait_for_selector(".jp-NotebookPanel .jp-Cell", timeout=60_000)
    assert poll(server.kernel_connected, timeout=60, interval=0.2), server.kernels()
    for text in ("Would you like to get notified", "Would you like to receive"):
        if page.get_by_text(text).count():
            page.get_by_role("button", name="No").first.click()

    # %load_ext first, then the debugger on, then Run All (which starts the ranks with it on).
    page.locator(".jp-NotebookPanel .jp-Cell").nth(0).click()
    page.keyboard.press("Shift+Enter")
    assert poll(lambda: "[1]:" in page.locator(".jp-InputPrompt").first.inner_text(), 60)
    # The bug icon in the notebook's toolbar; the debugger sidebar opens with it.
    page.locator(".jp-NotebookPanel .jp-DebuggerBugButton").first.click()
    assert poll(lambda: page.locator(".jp-DebuggerBugButton[aria-pressed='true']").count(), 30), (
        "the debugger did not switch on"
    )
    cell = page.locator(".jp-NotebookPanel .jp-Cell").nth(2)
    # The breakpoint gutter, at line 3's height (its empty elements carry no line number).
    line = cell.locator(".cm-lineNumbers .cm-gutterElement").get_by_text("3", exact=True)
    line_box = line.bounding_box()
    gutter = cell.locator(".cm-gutter.cm-breakpoint-gutter").bounding_box()
    page.mouse.click(gutter["x"] + gutter["width"] / 2, line_box["y"] + line_box["height"] / 2)
    assert poll(lambda: page.locator(".jp-DebuggerBreakpoint").count() >= 1, 10), page.locator(
        ".jp-DebuggerBreakpoints"
    ).all_inner_texts()

    page.locator("li.lm-MenuBar-item", has_text="Run").click()
    page.locator("li.lm-Menu-item[data-command='runmenu:run-all']").click()

    frames = page.locator(".jp-DebuggerCallstackFrame")
    assert poll(
        lambda: (
            {"rank 0 · <module>", "rank 1 · <module>"}
            <= set(page.locator(".jp-DebuggerCallstackFrame-name").all_inner_texts())
        ),
        240,
        interval=0.5,
    ), page.locator(".jp-DebuggerCallstack").all_inner_texts()
    locations = page.locator(".jp-DebuggerCallstackFrame-location").all_inner_texts()
    assert all(loc.endswith(":3") for loc in locations[:2]), locations

    frames.filter(has_text="rank 1").first.click()
    variables = page.locator(".jp-DebuggerVariables")
    assert poll(
        lambda: "10" in " ".join(variables.all_inner_texts()) and "x" in variables.inner_text(),
        60,
        interval=0.5,
    ), variables.all_inner_texts()
    page.screenshot(path=str(artifacts_dir / "lab-debugger.png"))

    # Continue with rank 1's frame selected: rank 1 finishes the cell, rank 0 stays paused
    # and the Callstack shows it alone.
    page.locator("button[title^='Continue']").first.click()
    output = page.locator(".jp-OutputArea-output", has_text="done")
    assert poll(lambda: "done 1 11" in " ".join(output.all_inner_texts()), 120, interval=0.5), (
        page.locator(".jp-OutputArea-output").all_inner_texts()
    )
    names = page.locator(".jp-DebuggerCallstackFrame-name")
    assert poll(
        lambda: (
            "rank 0 · <module>" in names.all_inner_texts()
            and "rank 1 · <module>" not in names.all_inner_texts()
        ),
        60,
        interval=0.5,
    ), names.all_inner_texts()
    assert "done 0 1" not in " ".join(output.all_inner_texts())
    # Continue again, the summary frame selected (as after every stop): rank 0 finishes.
    page.locator("button[title^='Continue']").first.click()
    assert poll(lambda: "done 0 1" in " ".join(output.all_inner_texts()), 120, interval=0.5), (
        page.locator(".jp-OutputArea-output").all_inner_texts()
    )
