"""Metrics in a real kernel: the dashboard appears under the cell that logs; history survives a restart."""

from __future__ import annotations

import json

WIDGET = "application/vnd.jupyter.widget-view+json"

LOG_CELL = """%%on_all_ranks
for i in range(200):
    nbdist.log(step=i, loss=1.0 / (i + 1), samples=16)
print("done")"""


def _displays(result) -> list[dict]:
    return [m["content"]["data"] for m in result.outputs if m["msg_type"] == "display_data"]


def test_dashboard_appears_under_the_logging_cell_and_history_survives_restart(kernel_factory):
    kernel = kernel_factory()
    kernel.start_dist(2)
    quiet = kernel.ok("%%on_all_ranks\nx = rank")
    assert not any(WIDGET in d for d in _displays(quiet))  # no logging, no dashboard

    result = kernel.ok(LOG_CELL)
    widgets = [d for d in _displays(result) if WIDGET in d]
    assert len(widgets) == 1, _displays(result)
    assert "rank" in widgets[0]["text/plain"]  # the text summary rides along for static viewers
    assert "[ranks 0-1] done" in result.stdout

    # A second logging cell gets its own (the first one stops refreshing, keeps its view).
    again = kernel.ok(LOG_CELL.replace("range(200)", "range(200, 250)"))
    assert sum(WIDGET in d for d in _displays(again)) == 1

    info = json.loads(
        kernel.ok(
            "import json, nbdist\n"
            "m = nbdist.current_session().metrics\n"
            "print(json.dumps({'id': m.id, 'counts': [m.count(0), m.count(1)]}))"
        ).stdout
    )
    assert info["counts"] == [250, 250]

    kernel.km.restart_kernel(now=False)
    kernel.kc.wait_for_ready(timeout=120)
    after = json.loads(
        kernel.ok(
            "import json, nbdist\n"
            f"r = [r for r in nbdist.runs() if r.id == {info['id']}][0]\n"
            "df = r.to_pandas()\n"
            "print(json.dumps({'points': r.points, 'rows': len(df), 'ranks': sorted(set(df['rank'].tolist())),"
            " 'last_loss': df[df['rank'] == 1]['loss'].iloc[-1], 'ended': r.ended is not None}))"
        ).stdout
    )
    assert after == {
        "points": 500,
        "rows": 500,
        "ranks": [0, 1],
        "last_loss": 1 / 250,
        "ended": True,
    }

    # %dist_dashboard RUN shows a finished run from the history after the restart.
    shown = kernel.ok(f"%load_ext nbdist\n%dist_dashboard {info['id']}")
    assert any(WIDGET in d for d in _displays(shown))


def test_a_notebook_without_widgets_shows_the_final_summary(tmp_path):
    """nbconvert-style viewers read text/plain: it is the summary as of the cell's end."""
    from nbformat.v4 import new_code_cell, new_notebook

    from tests.kernel_start import execute_notebook

    nb = new_notebook(
        cells=[
            new_code_cell("%load_ext nbdist\n%dist_start 2 --cpu"),
            # Slow enough that the dashboard is shown (first points) long before the end.
            new_code_cell(
                LOG_CELL.replace(
                    "for i in range(200):",
                    "import time\nfor i in range(200):\n    time.sleep(0.01)",
                )
            ),
            new_code_cell("%dist_stop"),
        ]
    )
    nb.metadata["kernelspec"] = {
        "name": "python3",
        "display_name": "Python 3",
        "language": "python",
    }
    execute_notebook(
        nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
    )
    [widget] = [o for o in nb.cells[1].outputs if WIDGET in o.get("data", {})]
    text = widget["data"]["text/plain"]
    rows = [line.split() for line in text.splitlines() if line.split()[:1] in (["0"], ["1"])]
    assert [row[:2] for row in rows] == [["0", "199"], ["1", "199"]], text
    # As %dist_status says after the cell (idle), and the run is over after %dist_stop.
    assert [row[-1] for row in rows] == ["idle", "idle"], text
    assert text.splitlines()[0].endswith(" · finished"), text
