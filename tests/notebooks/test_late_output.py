"""What the ranks print between cells, in a real kernel with 2 real CPU ranks.

A thread a cell started on the ranks prints after the last cell ended: its lines
are published under that last cell (its request's header: JupyterLab shows them
there), folded across ranks whatever their timing; the kernel keeps none of that
text once shown, and shows a thread that prints on and on as its latest lines.
The thread waits for a file the test writes once the cells ended, so that "after
the cell" is a fact, not a race with the machine's load.
"""

from __future__ import annotations

import queue
import time
from pathlib import Path

import pytest

HEADER = "nbdist: printed by the ranks after they finished this cell"


def _late_cell(go: Path) -> str:
    # Rank 1's thread prints a second after rank 0's: far apart for any grouping by arrival.
    return f"""%%on_all_ranks
import os, threading, time
def late():
    while not os.path.exists({str(go)!r}):
        time.sleep(0.05)
    time.sleep(1.0 * rank)
    for i in range(3):
        print('late', i, flush=True)
threading.Thread(target=late, daemon=True).start()
print('started')
"""


def _run(kernel, code: str):
    """Execute ``code``; (its msg id, its outputs), insisting it succeeded."""
    msg_id = kernel.submit(code)
    outputs, _idle = kernel.collect(msg_id)
    assert kernel.reply(msg_id)["status"] == "ok", outputs
    return msg_id, outputs


def _late_displays(kernel, parent: str, until, timeout: float = 60):
    """(every message whose parent is ``parent``, every other's parent) read until ``until(text)``
    holds for the text of ``parent``'s late display, or ``timeout``."""
    mine, others = [], []
    text = ""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not until(text):
        try:
            msg = kernel.kc.get_iopub_msg(timeout=0.5)
        except queue.Empty:
            continue
        if msg["parent_header"].get("msg_id") != parent:
            others.append(msg)
            continue
        mine.append(msg)
        if msg["msg_type"] in ("display_data", "update_display_data"):
            text = msg["content"]["data"]["text/plain"]
    return mine, others, text


@pytest.mark.timeout(300)
def test_lines_printed_after_the_last_cell_show_under_it_folded_across_ranks(dist_kernel, tmp_path):
    go = tmp_path / "go"
    first, outputs = _run(dist_kernel, _late_cell(go))
    assert [m["content"].get("text") for m in outputs] == ["[ranks 0-1] started\n"], outputs
    last, outputs = _run(dist_kernel, "%%on_all_ranks\nprint('second')")
    assert [m["content"].get("text") for m in outputs] == ["[ranks 0-1] second\n"], outputs
    go.touch()
    want = f"{HEADER}\n[ranks 0-1] late 0\n[ranks 0-1] late 1\n[ranks 0-1] late 2"
    mine, others, text = _late_displays(dist_kernel, last, until=lambda t: t == want)
    assert text == want, f"late display of the last cell: {text!r}; its messages {mine}"
    assert {m["msg_type"] for m in mine} <= {"display_data", "update_display_data"}, mine
    ids = {m["content"]["transient"]["display_id"] for m in mine}
    assert len(ids) == 1, f"one display, redrawn: {mine}"
    assert not [m for m in others if m["parent_header"].get("msg_id") == first], others


@pytest.mark.timeout(300)
def test_a_thread_printing_on_shows_its_latest_lines_and_the_kernel_keeps_none(
    dist_kernel, tmp_path
):
    import re

    go = tmp_path / "go"
    # 1500 distinct lines of 200 characters on each rank, after the cell, in batches of 100:
    # a rank far behind the other (CI load) prints its copies of lines whose group the
    # fold has let go already, and they count as lines of their own.
    parent, _outputs = _run(
        dist_kernel,
        "%%on_all_ranks\nimport os, threading, time\n"
        "def on():\n"
        f"    while not os.path.exists({str(go)!r}):\n        time.sleep(0.05)\n"
        "    for i in range(1500):\n        print('line', i, 'x' * 190, flush=True)\n"
        "        if i % 100 == 99:\n            time.sleep(0.2)\n"
        "threading.Thread(target=on, daemon=True).start()",
    )
    go.touch()
    last = f"[ranks 0-1] line 1499 {'x' * 190}"
    _mine, _others, text = _late_displays(
        dist_kernel, parent, until=lambda t: t.endswith(last), timeout=120
    )
    lines = text.split("\n")
    assert lines[0] == HEADER, lines[:3]
    # The latest 1000 distinct lines, the rest counted: 500 with the ranks in step.
    dropped = re.fullmatch(r"… (\d+) earlier lines not shown \(the latest 1000 are\)", lines[1])
    assert dropped and int(dropped.group(1)) >= 500, lines[:3]
    shown = lines[2:]
    assert len(shown) == 1000, len(shown)
    form = re.compile(r"\[(?:ranks 0-1|rank 0|rank 1)\] line (\d+) x{190}")
    odd = [line for line in shown if not form.fullmatch(line)]
    assert not odd, odd[:3]
    # In step, exactly lines 500-1499 folded; ranks apart, the latest of them all the same.
    numbers = [int(form.fullmatch(line).group(1)) for line in shown]
    assert numbers[-1] == 1499 and 1498 in numbers, numbers[-5:]
    # ipyparallel's client kept every late chunk of a finished request, for good.
    kept = dist_kernel.ok(
        "import nbdist\nmd = nbdist.current_session().client.metadata\n"
        "print(sum(len(v.get('stdout') or '') for v in md.values() if isinstance(v, dict)))"
    )
    assert kept.stdout.strip() == "0", kept.stdout


@pytest.mark.timeout(300)
def test_a_progress_bar_drawn_after_the_cell_shows_its_latest_state(dist_kernel, tmp_path):
    """A thread's ``\\r`` progress line is never ended by a newline while it runs; its latest
    state shows under the cell as it is drawn, as a kernel of its own shows a partial line.
    Before, nothing showed until the newline."""
    go = tmp_path / "go"
    parent, _outputs = _run(
        dist_kernel,
        "%%on_all_ranks\nimport os, sys, threading, time\n"
        "def bar():\n"
        f"    while not os.path.exists({str(go)!r}):\n        time.sleep(0.05)\n"
        "    print('loading', flush=True)\n"
        "    for i in range(1, 6):\n"
        "        sys.stdout.write(f'\\rstep {i}/5')\n        sys.stdout.flush()\n"
        "        time.sleep(0.1)\n"
        "threading.Thread(target=bar, daemon=True).start()",
    )
    go.touch()
    want = f"{HEADER}\n[ranks 0-1] loading\n[ranks 0-1] step 5/5"
    mine, _others, text = _late_displays(dist_kernel, parent, until=lambda t: t == want)
    assert text == want, f"{text!r}; its messages {mine}"
