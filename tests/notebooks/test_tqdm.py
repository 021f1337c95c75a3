"""Real tqdm loops on real CPU ranks.

``tqdm.auto``: a live widget per rank, whose text form ends at 100 %, through a
``ListSink`` (a script's view) and through a notebook executed by nbclient and saved
(what a reader without widget state sees). Text tqdm (``\r`` bars): one display for
every rank's bar, and one final line for the loop whatever the ranks' timings.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys

import nbformat

from tests.kernel_start import execute_notebook

_VIEW = "application/vnd.jupyter.widget-view+json"

TQDM_CELL = (
    "from tqdm.auto import tqdm\nimport time\n"
    "for i in tqdm(range(20), desc='ep'):\n    time.sleep(0.01)\n"
)


# A plain Python process (no IPython shell): the view of a script or a console.
# (In a process holding a terminal IPython shell, ipyparallel 9's client fails on
# every comm message a rank sends, before nbdist sees it: see the final report.)
LIST_SINK_SCRIPT = f"""
import json
from nbdist import DistSession
from nbdist.driver.sinks import ListSink
with DistSession(2, cpu=True, history=False) as s:
    sink = ListSink()
    s.run({TQDM_CELL!r}, sink=sink)
print(json.dumps(sink.events))
"""


def test_real_tqdm_on_real_ranks_ends_at_100_percent_in_a_list_sink():
    out = subprocess.run(
        [sys.executable, "-c", LIST_SINK_SCRIPT], capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]
    events = json.loads(out.stdout.strip().splitlines()[-1])
    shown = {e[1]: e[2] for e in events if e[0] == "display"}
    final = {e[1]: e[2] for e in events if e[0] == "display_update"}
    assert set(shown) == set(final) == {"rank 0", "rank 1"}
    for label, data in final.items():
        assert _VIEW in data, "the live widget is kept"
        assert data[_VIEW] == shown[label][_VIEW]
        assert data["text/plain"].startswith("ep: 100%|██████████| 20/20 ["), data["text/plain"]


def test_real_tqdm_in_a_saved_notebook_shows_the_final_state(tmp_path):
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {
        "name": "python3",
        "display_name": "Python 3",
        "language": "python",
    }
    nb.cells = [
        nbformat.v4.new_code_cell("%load_ext nbdist\n%dist_start 2 --cpu"),
        nbformat.v4.new_code_cell("%%on_all_ranks\n" + TQDM_CELL),
        nbformat.v4.new_code_cell("%dist_stop"),
    ]
    execute_notebook(
        nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
    )
    path = tmp_path / "saved.ipynb"
    nbformat.write(nb, path)
    saved = nbformat.read(path, as_version=4)
    outputs = saved.cells[1].outputs
    bars = [o for o in outputs if o.output_type == "display_data" and _VIEW in o.data]
    assert len(bars) == 2, outputs  # one live bar per rank
    for bar in bars:
        text = bar.data["text/plain"]
        assert text.startswith("ep: 100%|██████████| 20/20 ["), text
    labels = "".join(o.get("text", "") for o in outputs if o.output_type == "stream")
    assert "[rank 0]" in labels and "[rank 1]" in labels


def _cell_outputs(ranks: int, cell: str) -> tuple[list, str]:
    """Run ``cell`` on ``ranks`` CPU ranks in a real kernel: its outputs, and their stream text."""
    nb = nbformat.v4.new_notebook()
    nb.cells = [
        nbformat.v4.new_code_cell(f"%load_ext nbdist\n%dist_start {ranks} --cpu"),
        nbformat.v4.new_code_cell("%%on_all_ranks\n" + cell),
        nbformat.v4.new_code_cell("%dist_stop"),
    ]
    execute_notebook(nb, timeout=300, kernel_name="python3")
    outputs = nb.cells[1].outputs
    return outputs, "".join(o.get("text", "") for o in outputs if o.output_type == "stream")


def test_carriage_return_progress_of_several_ranks_leaves_one_blank_output_not_one_per_rank():
    # Each rank's "\r" bar had a display of its own, blanked at the end: a saved notebook
    # kept one empty output per rank (256 at 256 ranks). Now one display holds them all.
    outputs, text = _cell_outputs(
        3,
        "import sys, time\nfor i in range(5):\n"
        "    sys.stdout.write(f'\\rprogress {i * 25}%')\n    sys.stdout.flush()\n"
        "    time.sleep(0.3)\nprint()\nprint('done')",
    )
    displays = [o for o in outputs if o.output_type == "display_data"]
    assert len(displays) <= 1, outputs
    assert "[ranks 0-2] progress 100%\n[ranks 0-2] done\n" in text, text


def test_a_text_tqdm_loop_on_ranks_at_different_speeds_ends_as_one_line_with_their_timings():
    # Each rank's final bar differs in its elapsed time and rate: the saved notebook had
    # one line per rank (256 at 256 ranks). The loop's bars now fold into one line whose
    # timings are the ranges the ranks' bars span.
    outputs, text = _cell_outputs(
        4,
        "from tqdm import tqdm\nimport time\n"
        "for i in tqdm(range(20), desc='epoch', mininterval=0):\n"
        "    time.sleep(0.01 * (1 + rank))",
    )
    assert "[rank" not in text.replace("[ranks 0-3] epoch: 100%", ""), text
    final = r"\[ranks 0-3\] epoch: 100%\|██████████\| 20/20 \[\d\d:\d\d(–\d\d:\d\d)?<00:00, "
    assert re.fullmatch(final + r"[\d.]+–[\d.]+it/s\]\n", text), text
    displays = [o for o in outputs if o.output_type == "display_data"]
    assert all(not o.data.get("text/plain") for o in displays), displays
