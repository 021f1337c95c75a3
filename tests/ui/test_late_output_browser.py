"""What the ranks print between cells, in a real browser: under the last cell run on them.

JupyterLab + headless Chromium + 2 CPU ranks. A cell starts a thread on each rank
that waits for a file the test writes, then prints (rank 1 a second after rank 0);
the next cell runs on the ranks and ends; the one after waits in the kernel for the
test. Once the test writes the file, the threads' lines appear in the notebook under
the last cell run on the ranks, folded across ranks (``[ranks 0-1] late 2``), while
the kernel is busy with another cell; the cell that started the thread shows none.
"""

from __future__ import annotations

import pytest

from tests.ui.conftest import notebook_json, poll
from tests.ui.test_dashboard_browser import PageLog, _open_and_run_all


@pytest.mark.timeout(300)
def test_lines_printed_between_cells_appear_under_the_last_cell_run_on_the_ranks(
    lab_factory, browser_page, tmp_path
):
    go, stop = tmp_path / "go", tmp_path / "stop"
    server = lab_factory(
        "late.ipynb",
        notebook_json(
            [
                "%load_ext nbdist",
                "%dist_start 2 --cpu",
                "%%on_all_ranks\nimport os, threading, time\ndef late():\n"
                f"    while not os.path.exists({str(go)!r}):\n        time.sleep(0.05)\n"
                "    time.sleep(1.0 * rank)\n"
                "    for i in range(3):\n        print('late', i, flush=True)\n"
                "threading.Thread(target=late, daemon=True).start()\nprint('started')",
                "%%on_all_ranks\nprint('second')",
                f"import os, time\nwhile not os.path.exists({str(stop)!r}):\n    time.sleep(0.05)",
                "%dist_stop",
            ]
        ),
    )
    page = browser_page
    log = PageLog(page)
    _open_and_run_all(page, server, "late.ipynb")
    outputs = page.locator(".jp-NotebookPanel .jp-Cell .jp-Cell-outputArea")
    started, last = outputs.nth(2), outputs.nth(3)
    assert poll(lambda: "[ranks 0-1] second" in last.inner_text(), timeout=120), (
        f"the last cell on the ranks did not end: {last.inner_text()!r}"
    )
    go.touch()
    want = "[ranks 0-1] late 0\n[ranks 0-1] late 1\n[ranks 0-1] late 2"
    shown = poll(lambda: want in last.inner_text(), timeout=60, interval=0.2)
    text = last.inner_text()
    stop.touch()
    assert shown, f"under the last cell: {text!r}"
    assert "nbdist: printed by the ranks after they finished this cell" in text, text
    assert "late" not in started.inner_text(), started.inner_text()
    assert poll(lambda: "stopped 2 ranks" in outputs.nth(5).inner_text(), timeout=60)
    assert not log.page_errors, log.page_errors
